"""The delayed kind: a neuron layer whose input goes through a delay line inside the kernels' time loop (two
steps per channel with linear taps, every step of the line with `tapped` ones; continuing a line `held` from
earlier calls), on Triton and the C target."""
import dataclasses
import functools
from typing import NamedTuple

from ..launch import NeuronOps
from ..launch import c_path
from ..render.layout import Kind as Saved, Layout, SavedValue, delay_gradient, delay_parameter
from ..version import __version__
from .base import Kind

__all__ = ["DELAYED", "CompiledDelayed", "delayed_layout"]


class DelayedOptions(NamedTuple):
    input: str  # the input read through the line
    max_delay: int
    tapped: bool = False
    held: bool = False


def delayed_layout(plain, input, max_delay, tapped=False, held=False):
    """The plain layout with `input` read through a delay line of at most `max_delay` steps: the kernels read
    `input` d steps back, d = `<input>_delay` (a learnable value per channel: the delays in steps, fractional ones
    mixing the two steps around them), and the backward reads it again for the delays' gradient. `tapped`: the
    kernels weigh every step of the line by taps per channel instead (`taps_parameter`, not a learnable value of
    the step: the kernels sum its gradient per tap and neuron in `taps_partials`, the host per channel). `held`: the
    kernels read the steps before the call's first from `held_line` (a call that continues a line)."""
    saved = plain.saved
    index = plain.inputs.index(input)
    if not any(s.kind is Saved.INPUT and s.name == input for s in saved):
        saved += (SavedValue(input, Saved.INPUT, index),)
    line = {"delayed": input, "max_delay": int(max_delay), "held": bool(held)}
    if tapped:
        return dataclasses.replace(plain, saved=saved, tapped=True, **line)
    return dataclasses.replace(plain, saved=saved, learnable=plain.learnable + (delay_parameter(input),),
                               grad_learnable=plain.grad_learnable + (delay_gradient(input),), **line)


class DelayedKind(Kind):
    name = "delayed"
    Options = DelayedOptions

    def options(self, input, max_delay, tapped=False, held=False):
        return DelayedOptions(input, int(max_delay), bool(tapped), bool(held))

    def key(self, options):
        return ("delayed", options.input, str(options.max_delay), *(["tapped"] if options.tapped else []),
                *(["held"] if options.held else []))

    def generate(self, derivation, options):
        """The module of the neuron's kernels with the delay line (`delayed_layout`): the
        plain design's Triton kernels and the C target's source, in the module frame `delayed_kernels.py.j2`; the
        torch path runs the `Delay` layer before the neuron's own kernels."""
        from ..printing import TritonPrinter  # (a cache miss: sympy and jinja2 only here)
        from ..render.contexts import c_source, check_delay_names, module_source, plain_design_kernels
        from ..render.layout import plain_layout

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
