"""Layer kinds, one module each, registered here once: `plain` (a neuron layer), `delayed` (a neuron layer with
a delay line in its kernels), `recurrent` (the fused recurrent layer), `eventprop` (the C kernels of an EventProp
layer, generated from the neuron's continuous system). A kind owns what differs between them: its options and
cache key, its layout, render context and frames (`generate`), and its launch ops (`load`); the stages (trace,
derive, render, cache, launch) run every kind alike through `flexgen.compile.compile_kernels` (the eventprop kind
through its own `kernels`, from the neuron's equations).
`register` adds a kind (docs/extending.md shows one that lives outside the package)."""
from .base import Kind
from .delayed import DELAYED
from .eventprop import EVENTPROP
from .plain import PLAIN
from .recurrent import RECURRENT

__all__ = ["Kind", "KINDS", "register", "get"]

KINDS = {}


def register(kind):
    """Make `kind` (a `Kind`) known by its name; returns it. A name is registered once."""
    if not isinstance(kind, Kind) or not kind.name:
        raise TypeError(f"register takes a flexgen.kinds.Kind with a name, got {kind!r}")
    if KINDS.get(kind.name, kind) is not kind:
        raise ValueError(f"a layer kind named {kind.name!r} is registered already")
    KINDS[kind.name] = kind
    return kind


def get(kind):
    """The registered kind named `kind` (or `kind` itself, a `Kind`)."""
    if isinstance(kind, Kind):
        return kind
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)} (or a flexgen.kinds.Kind), got {kind!r}")
    return KINDS[kind]


for _kind in (PLAIN, DELAYED, RECURRENT, EVENTPROP):
    register(_kind)
