"""The recurrent kind: a layer whose output, times a dense weight, is added to its input at the next step, with
the product inside the kernels' time loop (through per-neuron delay lines if `delayed`, of any taps if `tapped`; a
delay per synapse if `synaptic`); Triton kernels, launched by `flexgen.launch.recurrent`."""
import functools
from typing import NamedTuple

from ..launch.recurrent.ops import RecurrentOps
from ..launch.triton_path import SpecialisedLaunches
from ..render.recurrent_abi import RecurrentLayout, recurrent_backward_arguments, recurrent_forward_arguments
from ..version import __version__
from .base import Kind

__all__ = ["RECURRENT", "CompiledRecurrent"]


class RecurrentOptions(NamedTuple):
    input: str  # the input the product is added to
    output: str  # the output fed back
    delayed: bool = False
    tapped: bool = False
    synaptic: bool = False


class RecurrentKind(Kind):
    name = "recurrent"
    Options = RecurrentOptions

    def options(self, input, output, delayed=False, tapped=False, synaptic=False):
        return RecurrentOptions(input, output, bool(delayed), bool(tapped), bool(synaptic))

    def key(self, options):
        line = (["delayed-taps"] if options.tapped else ["delayed"] if options.delayed
                else ["synaptic"] if options.synaptic else [])
        return ("recurrent", options.input, options.output, *line)

    def generate(self, derivation, options):
        from ..render.contexts import render_recurrent  # (a cache miss: jinja2 only here)

        source, layout, sources = render_recurrent(derivation, *options)
        meta = {"neuron": derivation.trace.name, "layout": layout.to_json(), "sources": sources,
                "version": __version__}
        return source, meta

    def load(self, module, meta, key):
        return CompiledRecurrent(module, meta, key)


class CompiledRecurrent:
    """A recurrent layer's generated module loaded from the cache, with its `RecurrentLayout`."""

    def __init__(self, module, meta, key):
        self.module, self.meta, self.key = module, meta, key
        self.layout = RecurrentLayout.from_json(meta["layout"])
        self.ops = RecurrentOps(self)  # registered now, never inside a compiled graph's trace
        self._launches = {}
        self.argument_plans = {}  # eager calls' kernel arguments by call signature (`launch.recurrent`)

    def kernel(self, kind):
        """The Triton kernel of `kind`: "forward", "inference" or "backward"."""
        return getattr(self.module, self.layout.kernel_name(kind))

    def launches(self, kind):
        """The eager launches of the kernel of `kind` (`flexgen.launch.triton_path.SpecialisedLaunches`)."""
        if kind not in self._launches:
            self._launches[kind] = SpecialisedLaunches(self.kernel(kind))
        return self._launches[kind]

    @functools.cached_property
    def arguments(self):
        """The kernels' argument lists by kind (`flexgen.render.layout`), made once: every call walks them."""
        return {"forward": recurrent_forward_arguments(self.layout, training=True),
                "inference": recurrent_forward_arguments(self.layout, training=False),
                "backward": recurrent_backward_arguments(self.layout)}

    def module_source(self):
        return self.module.__flexgen_source__


RECURRENT = RecurrentKind()
