"""The eventprop kind: the C kernels of one `flexgen.EventPropDense` layer (an event-driven forward and the
EventProp adjoint backward), generated from the neuron's derived `EventPropProgram`
(`flexgen.derive.eventprop_program`) by `flexgen.render.eventprop_c`: exact flows for a neuron linear between
events, `substeps` steps of its method per piece of trajectory for any other (its one option, a define in the
source; a linear neuron's source does not depend on it). For a neuron linear between events, `triton_module`
renders its Triton kernels (`flexgen.render.eventprop_triton`; the GPU's, feed-forward layers) into a module kept
in the disk cache under the hash of its source.

Unlike the other kinds, its kernels come from the neuron's continuous system, not from a traced discrete step, so
they are not built through `flexgen.compile.compile_kernels`: `EVENTPROP.kernels(program, substeps)` renders and
loads them (`flexgen.EventPropDense` keeps them once per process, neuron and substeps), and the compiled library
is kept in the disk cache by `c_path.load` like every C library (keyed by the source, which holds the substeps)."""
import functools
import hashlib
from typing import NamedTuple

from .. import cache
from ..launch import c_path
from ..launch.eventprop_c import CSimulator
from ..launch.eventprop_triton import TritonSimulator
from ..launch.eventprop_triton_recurrent import RecurrentTritonSimulator
from ..version import __version__
from .base import Kind

__all__ = ["EVENTPROP", "EventPropKernels", "EventPropOptions", "EventPropTritonKernels"]


class EventPropOptions(NamedTuple):
    substeps: int = 8  # steps of the neuron's method per piece of trajectory (a neuron nonlinear between events)


class EventPropKind(Kind):
    name = "eventprop"
    Options = EventPropOptions

    def options(self, substeps=8):
        return EventPropOptions(substeps)

    def generate(self, derivation, options=EventPropOptions()):
        """(C source, metadata) of the layer's kernels; `derivation`: the neuron's `EventPropProgram` (SpecError
        for substeps the C kernels cannot take)."""
        from ..render.eventprop_c import c_source  # (sympy and jinja2 only here)

        name = derivation.adjoint.system.name
        source = c_source(derivation, name, options.substeps)
        meta = {"sources": {"c": source}, "neuron": name, "linear": derivation.linear, "version": __version__}
        if not derivation.linear:
            meta["substeps"] = options.substeps
        return source, meta

    def load(self, module, meta, key):
        return EventPropKernels(module, meta)

    def kernels(self, program, substeps=8):
        """The loaded kernels of an `EventPropProgram` (its C library compiled at the first use on this machine;
        the caller keeps them, one per neuron and, for a nonlinear one, substeps)."""
        options = self.options(substeps)
        source, meta = self.generate(program, options)
        return self.load(source, meta, self.key(options if not program.linear else ()))

    def triton_module(self, program, substeps=8):
        """The loaded Triton module of an `EventPropProgram` (the neuron's functions printed by
        `flexgen.render.eventprop_triton` and the static kernels), kept in the disk cache under the hash of its
        source (which holds `substeps` for a neuron nonlinear between events; a linear one's does not)."""
        from ..render.eventprop_triton import triton_source  # (sympy and jinja2 only here)

        source = triton_source(program, program.adjoint.system.name, substeps)
        key = hashlib.sha256(f"{self.name} triton {__version__}\n{source}".encode()).hexdigest()
        module, _ = cache.load_or_build(key, lambda: (source, {"sources": {"triton": source},
                                                               "neuron": program.adjoint.system.name,
                                                               "version": __version__}))
        return EventPropTritonKernels(source, module)


class EventPropTritonKernels:
    """A generated EventProp Triton source and its loaded module."""

    def __init__(self, source, module):
        self.source, self.module = source, module

    def simulator(self, states, parameters, init, dt, steps, capacity, recurrent=False):
        """A `flexgen.launch.eventprop_triton.TritonSimulator` of one feed-forward layer on these kernels
        (recurrent: `flexgen.launch.eventprop_triton_recurrent.RecurrentTritonSimulator`, a recurrent layer's)."""
        kind = RecurrentTritonSimulator if recurrent else TritonSimulator
        return kind(self.module, states, parameters, init, dt, steps, capacity)


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
