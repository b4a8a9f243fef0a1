"""What `flexgen.convert` knows about each peer library: which of its modules are neurons, and the flexgen
layer that replaces each one it supports.

Every peer module (`spikingjelly`, `snntorch`) offers the same three functions:

* `owns(module)`: the module's class comes from that library (nothing is imported to find out);
* `is_neuron(module)`: it is one of the library's spiking neurons, or a subclass of one;
* `replacement(module, backend)`: the flexgen layer doing what it does, or `Unsupported` saying why not.
"""
import torch


class Unsupported(ValueError):
    """A peer neuron, or one of its options, that flexgen has no faithful equivalent for."""


def class_path(module):
    """'package.module.Class' of a module's class, for reports and messages."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def defined_in(module, *packages):
    """Whether the module's class is defined in one of `packages` (or a subpackage)."""
    return _in_packages(type(module), packages)


def derives_from(module, *packages):
    """Whether the module's class or one of its bases is defined in one of `packages` (a user's subclass of a
    peer's neuron is still a neuron)."""
    return any(_in_packages(cls, packages) for cls in type(module).__mro__)


def _in_packages(cls, packages):
    name = cls.__module__
    return any(name == p or name.startswith(p + ".") for p in packages)


def adopt(layer, name, tensor):
    """Make the peer's `tensor` itself the parameter (for an `nn.Parameter`) or buffer `name` of `layer`.

    Shared, not copied: dtype, device, values, requires_grad and an optimizer built on
    the peer's parameters all carry over.
    """
    if hasattr(layer, name):
        delattr(layer, name)
    if isinstance(tensor, torch.nn.Parameter):
        layer.register_parameter(name, tensor)
    else:
        layer.register_buffer(name, tensor)


def finish(new, old):
    """The replacement in the peer module's training mode and on its device."""
    new.train(old.training)
    tensors = list(old.parameters()) + list(old.buffers())
    return new.to(tensors[0].device) if tensors else new
