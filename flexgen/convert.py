"""Drop-in conversion: replace SpikingJelly and snnTorch neurons in a model by flexgen layers.

`convert(model)` swaps, in place,

* SpikingJelly's `IFNode`, `LIFNode`, `ParametricLIFNode` -> `flexgen.IF`, `LIF`, `PLIF`;
* snnTorch's `Leaky`, `Synaptic`, `Alpha`, `Lapicque`, `RLeaky`, `RSynaptic` -> `flexgen.peers.snntorch`
  layers that follow snnTorch's update and call signature,

keeping options, surrogate gradients, step modes, and the peer's own parameter and
buffer tensors (so dtype, device and `state_dict()` keys stay the same). It is
atomic: every neuron is checked and its replacement built before the first swap,
so a neuron flexgen cannot convert (snnTorch's SLSTM, an option without
an equivalent) raises `ConversionError` with the model untouched. Neither library
is imported unless the model holds one of its modules.
"""
import dataclasses
import logging

import torch

from .peers import Unsupported, class_path, snntorch, spikingjelly

PEERS = (spikingjelly, snntorch)
logger = logging.getLogger("flexgen.convert")


class ConversionError(ValueError):
    """A model holds neurons `convert` cannot replace faithfully; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class Swapped:
    """A module `convert` replaced: where (dotted name, "" for the model itself), what and by what."""

    name: str
    before: str
    after: str


@dataclasses.dataclass(frozen=True)
class Left:
    """A peer library's module `convert` left in place, and why."""

    name: str
    kind: str
    reason: str


@dataclasses.dataclass
class ConversionReport:
    """What `convert` swapped and which of the peer libraries' modules it left (with the reason)."""

    swapped: list = dataclasses.field(default_factory=list)
    left: list = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"flexgen.convert: swapped {len(self.swapped)} module(s), left {len(self.left)}"]
        lines += [f"  swapped {s.name or '<model>'}: {s.before} -> {s.after}" for s in self.swapped]
        lines += [f"  left    {m.name or '<model>'}: {m.kind} ({m.reason})" for m in self.left]
        return "\n".join(lines)


def convert(model, backend="auto", strict=True, report=False):
    """Replace SpikingJelly / snnTorch neuron modules in `model` by flexgen layers, in place.

    Returns the model (or the replacement, when `model` itself is a neuron), or
    `(model, ConversionReport)` with `report=True`; the report is logged too
    (logger "flexgen.convert", level INFO). A peer neuron that cannot be
    converted raises `ConversionError` before anything changes; with
    `strict=False` it is left in place and listed in the report instead.

    >>> import torch, flexgen
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> flexgen.convert(net) is net
    True
    >>> print(flexgen.convert(net, report=True)[1])
    flexgen.convert: swapped 0 module(s), left 0
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert takes a torch.nn.Module, got {type(model).__name__}")
    plan = _Plan(backend)
    plan.visit(model, "")
    if plan.problems and strict:
        listed = "\n".join(f"  {m.name or '<model>'} ({m.kind}): {m.reason}" for m in plan.problems)
        raise ConversionError(
            f"flexgen.convert cannot replace {len(plan.problems)} neuron(s); the model was left unchanged:\n{listed}\n"
            "(convert(..., strict=False) converts the others and leaves these in place)"
        )
    result = plan.apply(model)
    conversion = ConversionReport(swapped=plan.swapped, left=plan.problems + plan.others)
    if conversion.swapped or conversion.left:
        logger.info("%s", conversion)
    return (result, conversion) if report else result


class _Plan:
    """The replacements, built while walking the model, before any of them is swapped in."""

    def __init__(self, backend):
        self.backend = backend
        self.replacements = {}  # id(old module) -> new module
        self.visited = set()
        self.swapped, self.problems, self.others = [], [], []

    def visit(self, module, name):
        if id(module) in self.visited:  # a module shared by several parents is planned once
            return
        self.visited.add(id(module))
        neuron_of = next((p for p in PEERS if p.is_neuron(module)), None)
        if neuron_of is not None:
            self._plan_neuron(neuron_of, module, name)
            return
        if any(p.owns(module) for p in PEERS):
            self.others.append(Left(name, class_path(module), "not a neuron: runs unchanged"))
        for child_name, child in module.named_children():
            self.visit(child, f"{name}.{child_name}" if name else child_name)

    def _plan_neuron(self, peer, module, name):
        try:
            new = peer.replacement(module, self.backend)
        except Unsupported as exc:
            self.problems.append(Left(name, class_path(module), str(exc)))
            return
        self.replacements[id(module)] = new
        self.swapped.append(Swapped(name, class_path(module), class_path(new)))

    def apply(self, model):
        if id(model) in self.replacements:
            return self.replacements[id(model)]
        self._swap_children(model, set())
        return model

    def _swap_children(self, module, done):
        if id(module) in done:
            return
        done.add(id(module))
        for child_name, child in list(module.named_children()):
            if id(child) in self.replacements:
                setattr(module, child_name, self.replacements[id(child)])
            else:
                self._swap_children(child, done)


def reset(model):
    """Forget the states of every flexgen layer in `model`: the next call starts from the initial values.

    snnTorch's `utils.reset` does not see flexgen layers; SpikingJelly's
    `functional.reset_net` resets them, with a warning for each (they are not
    its MemoryModules). This resets flexgen layers only.

    >>> import torch, flexgen
    >>> net = torch.nn.Sequential(flexgen.LIF(backend="torch"))
    >>> _ = net(torch.ones(2, 3))
    >>> flexgen.reset(net)
    >>> net[0].v
    0.0
    """
    from .module import NeuronModule

    for module in model.modules():
        if isinstance(module, NeuronModule):
            module.reset()
