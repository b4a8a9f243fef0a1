"""Drop-in conversion: replace SpikingJelly and snnTorch neurons in a model by flexgen layers.

`convert(model)` swaps, in place,

* SpikingJelly's `IFNode`, `LIFNode`, `ParametricLIFNode` -> `flexgen.IF`, `LIF`, `PLIF`;
* snnTorch's `Leaky`, `Synaptic`, `Alpha`, `Lapicque`, `RLeaky`, `RSynaptic` -> `flexgen.interop.peers.snntorch`
  layers that follow snnTorch's update and call signature,

keeping options, surrogate gradients, step modes, and the peer's own parameter and
buffer tensors (so dtype, device and `state_dict()` keys stay the same). It is
atomic: every neuron is checked and its replacement built before the first swap,
so a neuron flexgen cannot convert (snnTorch's SLSTM, an option without
an equivalent) raises `ConversionError` with the model untouched. A neuron held
in several places (the same module in two slots of a `Sequential`, or under two
parents) becomes one flexgen layer in all of them, so they share state as they
did. Forward hooks, forward pre-hooks and full backward hooks registered on a
neuron carry over to its replacement (their handles still remove them); a
legacy `register_backward_hook` hook cannot, and is refused by name. Neither
library is imported unless the model holds one of its modules.
"""
import dataclasses
import logging

import torch

from .peers import Unsupported, class_path
from .peers import snntorch, spikingjelly

PEERS = (spikingjelly, snntorch)
logger = logging.getLogger("flexgen.convert")


class ConversionError(ValueError):
    """A model holds neurons `convert` cannot replace faithfully; nothing was changed."""


@dataclasses.dataclass(frozen=True)
class Swapped:
    """A module `convert` replaced: where (dotted name, "" for the model itself; `also`, the other places that held
    the same module), what and by what."""

    name: str
    before: str
    after: str
    also: tuple = ()


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
        lines += [f"  swapped {s.name or '<model>'}: {s.before} -> {s.after}"
                  + (f" (also at {', '.join(s.also)})" if s.also else "")
                  for s in self.swapped]
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
    conversion = ConversionReport(swapped=plan.swapped_with_places(), left=plan.problems + plan.others)
    if conversion.swapped or conversion.left:
        logger.info("%s", conversion)
    return (result, conversion) if report else result


class _Plan:
    """The replacements, built while walking the model, before any of them is swapped in."""

    def __init__(self, backend):
        self.backend = backend
        self.replacements = {}  # id(old module) -> new module
        self.places = {}  # id(old module) -> every dotted name it is held under
        self.visited = set()
        self.swapped, self.problems, self.others = [], [], []

    def visit(self, module, name):
        self.places.setdefault(id(module), []).append(name)
        if id(module) in self.visited:  # a module held in several places is planned once
            return
        self.visited.add(id(module))
        neuron_of = next((p for p in PEERS if p.is_neuron(module)), None)
        if neuron_of is not None:
            self._plan_neuron(neuron_of, module, name)
            return
        if any(p.owns(module) for p in PEERS):
            self.others.append(Left(name, class_path(module), "not a neuron: runs unchanged"))
        for child_name, child in _every_slot(module):
            self.visit(child, f"{name}.{child_name}" if name else child_name)

    def _plan_neuron(self, peer, module, name):
        try:
            _check_hooks(module)
            new = peer.replacement(module, self.backend)
        except Unsupported as exc:
            self.problems.append(Left(name, class_path(module), str(exc)))
            return
        _carry_hooks(module, new)
        self.replacements[id(module)] = new
        self.swapped.append(Swapped(name, class_path(module), class_path(new)))

    def swapped_with_places(self):
        """The swaps, each with the other places its module was held in (known once the walk is over)."""
        by_name = {places[0]: tuple(places[1:]) for places in self.places.values()}
        return [dataclasses.replace(s, also=by_name.get(s.name, ())) for s in self.swapped]

    def apply(self, model):
        if id(model) in self.replacements:
            return self.replacements[id(model)]
        self._swap_children(model, set())
        return model

    def _swap_children(self, module, done):
        if id(module) in done:
            return
        done.add(id(module))
        for child_name, child in _every_slot(module):
            if id(child) in self.replacements:
                setattr(module, child_name, self.replacements[id(child)])
            else:
                self._swap_children(child, done)


def _every_slot(module):
    """(name, child) for every slot of `module`; unlike `named_children()`, a child held twice is listed twice."""
    return [(name, child) for name, child in list(module._modules.items()) if child is not None]


# The hook tables nn.Module's call reads; shared with the replacement, so the user's handles still remove them.
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


def _check_hooks(module):
    if module._backward_hooks and module._is_full_backward_hook is False:
        names = ", ".join(getattr(h, "__qualname__", repr(h)) for h in module._backward_hooks.values())
        raise Unsupported(f"it has a backward hook registered with the deprecated register_backward_hook ({names}), "
                          "which cannot be moved to another module; register it with register_full_backward_hook")


def _carry_hooks(old, new):
    """Give `new` the forward hooks, pre-hooks and full backward hooks registered on `old`."""
    for table in _CALL_HOOKS:
        hooks = getattr(old, table, None)
        if hooks and not getattr(new, table):
            setattr(new, table, hooks)
        elif hooks:  # the replacement has hooks of its own: add the user's after them
            getattr(new, table).update(hooks)
    if old._backward_hooks or old._backward_pre_hooks:
        new._is_full_backward_hook = old._is_full_backward_hook


def reset(model):
    """Forget the states of every flexgen layer in `model` (neuron layers and `Recurrent` layers): the next call
    starts from the initial values.

    snnTorch's `utils.reset` does not see flexgen layers; SpikingJelly's
    `functional.reset_net` resets them too (it calls `reset()` on every module
    that has one). This resets flexgen layers only.

    >>> import torch, flexgen
    >>> net = torch.nn.Sequential(flexgen.LIF(backend="torch"))
    >>> _ = net(torch.ones(2, 3))
    >>> flexgen.reset(net)
    >>> net[0].v
    0.0
    """
    from ..layers.neuron import NeuronModule
    from ..layers.recurrent import Recurrent

    for module in model.modules():
        if isinstance(module, (NeuronModule, Recurrent)):
            module.reset()
