"""The eventprop kind: the C kernels of one `flexgen.EventPropDense` layer (an exact event-driven forward and the
EventProp adjoint backward) for a neuron linear between events, generated from its derived `EventPropProgram`
(`flexgen.derive.eventprop_program`) by `flexgen.render.eventprop_c`.

Unlike the other kinds, its kernels come from the neuron's continuous system, not from a traced discrete step, so
they are not built through `flexgen.compile.compile_kernels`: `EVENTPROP.kernels(program)` renders and loads
them (`flexgen.EventPropDense` keeps them once per process and neuron), and the compiled library is kept in the
disk cache by `c_path.load` like every C library."""
import functools

from ..launch import c_path
from ..launch.eventprop_c import CSimulator
from ..version import __version__
from .base import Kind

__all__ = ["EVENTPROP", "EventPropKernels"]


class EventPropKind(Kind):
    name = "eventprop"

    def generate(self, derivation, options=()):
        """(C source, metadata) of the layer's kernels; `derivation`: the neuron's `EventPropProgram` (SpecError
        for a neuron nonlinear between events, whose flow has no closed form)."""
        from ..render.eventprop_c import c_source  # (sympy and jinja2 only here)

        name = derivation.adjoint.system.name
        source = c_source(derivation, name)
        return source, {"sources": {"c": source}, "neuron": name, "linear": derivation.linear,
                        "version": __version__}

    def load(self, module, meta, key):
        return EventPropKernels(module, meta)

    def kernels(self, program):
        """The loaded kernels of an `EventPropProgram` (its C library compiled at the first use on this machine;
        the caller keeps them, one per neuron)."""
        source, meta = self.generate(program)
        return self.load(source, meta, self.key(()))


class EventPropKernels:
    """A generated EventProp C source and, at the first use, its compiled library (`c_path.CompilerError` if it
    cannot be built here)."""

    def __init__(self, source, meta):
        self.source, self.meta = source, meta

    @functools.cached_property
    def library(self):
        return c_path.load(self.source)

    def simulator(self, states, parameters, init, dt, steps, capacity, recurrent=False):
        """A `flexgen.launch.eventprop_c.CSimulator` of one layer on these kernels (recurrent: a recurrent
        layer's)."""
        return CSimulator(self.library, states, parameters, init, dt, steps, capacity, recurrent)


EVENTPROP = EventPropKind()
