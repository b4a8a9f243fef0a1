"""The delayed kind: a neuron layer whose input goes through a delay line inside the kernels' time loop (two
steps per channel with linear taps, every step of the line with `tapped` ones; continuing a line `held` from
earlier calls), on Triton and the C target."""
import functools
from typing import NamedTuple

from ..launch import NeuronOps
from ..launch import c_path
from ..render.layout import Layout
from ..version import __version__
from .base import Kind

__all__ = ["DELAYED", "CompiledDelayed"]


class DelayedOptions(NamedTuple):
    input: str  # the input read through the line
    max_delay: int
    tapped: bool = False
    held: bool = False


class DelayedKind(Kind):
    name = "delayed"
    Options = DelayedOptions

    def options(self, input, max_delay, tapped=False, held=False):
        return DelayedOptions(input, int(max_delay), bool(tapped), bool(held))

    def key(self, options):
        return ("delayed", options.input, str(options.max_delay), *(["tapped"] if options.tapped else []),
                *(["held"] if options.held else []))

    def generate(self, derivation, options):
        """The module of the neuron's kernels with the delay line (`flexgen.render.layout.delayed_layout`): the
        plain design's Triton kernels and the C target's source, in the module frame `delayed_kernels.py.j2`; the
        torch path runs the `Delay` layer before the neuron's own kernels."""
        from ..printing import TritonPrinter  # (a cache miss: sympy and jinja2 only here)
        from ..render.contexts import c_source, check_delay_names, module_source, plain_design_kernels
        from ..render.layout import delayed_layout, plain_layout

        layout = delayed_layout(plain_layout(derivation), *options)
        check_delay_names(derivation, layout)
        sources = plain_design_kernels(derivation, layout, TritonPrinter())
        sources["c"] = c_source(derivation, layout, recompute=False)
        module = module_source("delayed_kernels.py.j2", derivation, layout, sources,
                               libdevice_in=("forward", "inference", "backward"))
        return module, {"layout": layout.to_json(), "sources": sources, "version": __version__, "kind": self.name}

    def load(self, module, meta, key):
        return CompiledDelayed(module, meta, key)


class CompiledDelayed:
    """A neuron's kernels with a delayed input, loaded from the cache: the custom ops of the plain design (a
    delayed input is read again by the backward, so recomputing would save nothing for it), on Triton and on the
    C target."""

    def __init__(self, module, meta, key):
        self.module, self.meta, self.key = module, meta, key
        self.layout = Layout.from_json(meta["layout"])
        self.ops = NeuronOps(module, self.layout, key)

    def ops_for_call(self, recompute, use_triton, like):
        return self.ops

    @functools.cached_property
    def c_library(self):
        """The C target's library (`CompiledNeuron.c_library`)."""
        return c_path.load(self.meta["sources"]["c"])

    def c_ops_for(self, recompute):
        return self._c_ops

    @functools.cached_property
    def _c_ops(self):
        library = self.c_library
        cpu = (functools.partial(c_path.c_forward, library), functools.partial(c_path.c_backward, library))
        return NeuronOps(self.module, self.layout, self.key, cpu=cpu, target="_c")

    def module_source(self):
        return self.module.__flexgen_source__


DELAYED = DelayedKind()
