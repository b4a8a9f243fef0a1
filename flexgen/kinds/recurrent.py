"""The recurrent kind: a layer whose output, times a dense weight, is added to its input at the next step, with
the product inside the kernels' time loop (through per-neuron delay lines if `delayed`, of any taps if `tapped`; a
delay per synapse if `synaptic`); Triton kernels, launched by `flexgen.launch.recurrent`."""
import dataclasses
import functools
from typing import NamedTuple

from ..launch.recurrent.ops import RecurrentOps
from ..launch.triton_path import SpecialisedLaunches
from ..render.layout import Kind as Saved, SavedValue
from ..render.recurrent_abi import (RecurrentLayout, recurrent_backward_arguments, recurrent_forward_arguments,
                                   recurrent_step_arguments)
from ..version import __version__
from .base import Kind

__all__ = ["RECURRENT", "CompiledRecurrent", "recurrent_layout"]


class RecurrentOptions(NamedTuple):
    input: str  # the input the product is added to
    output: str  # the output fed back
    delayed: bool = False
    tapped: bool = False
    synaptic: bool = False


def recurrent_layout(plain, input, output, delayed=False, tapped=False, synaptic=False):
    """The layout of a recurrent layer's kernels: the plain layout of its neuron, except that `input`, if the
    backward reads it, is saved as a buffer. The neuron's input at a step is then `input` plus the recurrent
    product, a value only the forward computes. `delayed`: the output goes through a delay line per hidden neuron
    before the product, with two taps (linear) or, `tapped`, any taps; `synaptic`: a delay per synapse, the weight
    being tap matrices side by side (the kernels take no other argument for it)."""
    saved = tuple(SavedValue(s.name, Saved.BUFFER) if s.kind is Saved.INPUT and s.name == input else s
                  for s in plain.saved)
    return RecurrentLayout(dataclasses.replace(plain, saved=saved), input, output, delayed or tapped, tapped, synaptic)


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
        """The module of the layer's kernels (`kernel_sources`) in the module frame `recurrent_kernels.py.j2`."""
        from ..render.contexts import module_source  # (a cache miss: sympy and jinja2 only here)
        from ..render.layout import plain_layout

        layout = recurrent_layout(plain_layout(derivation), *options)
        sources = kernel_sources(derivation, layout)
        module = module_source("recurrent_kernels.py.j2", derivation, layout, sources, libdevice_in=tuple(sources),
                               binary_output=any("tf32_nearest(" in text for text in sources.values()))
        meta = {"neuron": derivation.trace.name, "layout": layout.to_json(), "sources": sources,
                "version": __version__, "kind": self.name}
        return module, meta

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
        """The Triton kernel of `kind`: "forward", "inference", "backward", "replay" or "step" (the last two: layers
        without delays)."""
        return getattr(self.module, self.layout.kernel_name(kind))

    def launches(self, kind):
        """The eager launches of the kernel of `kind` (`flexgen.launch.triton_path.SpecialisedLaunches`)."""
        if kind not in self._launches:
            self._launches[kind] = SpecialisedLaunches(self.kernel(kind))
        return self._launches[kind]

    @functools.cached_property
    def arguments(self):
        """The kernels' argument lists by kind (`flexgen.render.layout`), made once: every call walks them."""
        arguments = {"forward": recurrent_forward_arguments(self.layout, training=True),
                     "inference": recurrent_forward_arguments(self.layout, training=False),
                     "backward": recurrent_backward_arguments(self.layout)}
        if self.layout.reads_previous:
            arguments["step"] = recurrent_step_arguments(self.layout)
        return arguments

    def module_source(self):
        return self.module.__flexgen_source__


# ---------------------------------------------------------------- the render context of the recurrent frames


def _feedback_context(layout, printer):
    """The recurrent frames' `layout` (the input the product is added to, the output fed back, their gradients and
    the kind of delay line) and a delayed layer's printed delay line: the fed-back operand mixes the output
    `lag` + 1 (near) and `lag` + 2 (far) steps back by `frac`, and its gradient goes to those two steps the same
    way; or, with taps, the operand sums every step back weighed by its tap, and the output's gradient sums the
    later operands' gradients the same way."""
    import sympy
    from sympy.codegen.ast import Assignment

    context = {"layout": layout}
    if layout.tapped:
        tap, pushed = sympy.Symbol("rec_tap", real=True), sympy.Symbol("rec_pushed", real=True)
        context["products"] = printer.doprint(Assignment(sympy.Symbol("rec_products", real=True), tap * pushed))
    elif layout.delayed:
        near, far, frac, back = (sympy.Symbol(n, real=True) for n in ("rec_near", "rec_far", "rec_frac", "rec_current"))
        context["mix"] = printer.doprint(Assignment(sympy.Symbol("rec_operand", real=True),
                                                    (1 - frac) * near + frac * far))
        context["to_near"] = printer.doprint(Assignment(sympy.Symbol("rec_to_near", real=True), (1 - frac) * back))
        context["to_far"] = printer.doprint(Assignment(sympy.Symbol("rec_to_far", real=True), frac * back))
    return context


def _recurrent_kernel(frame_name, layout, kind, arguments, context):
    from ..frames import frame
    from ..printing import RecurrentTritonPrinter
    from ..render.layout import signature

    return frame(frame_name).render(kernel=layout.kernel_name(kind), args=signature(arguments),
                                    **context, **_feedback_context(layout, RecurrentTritonPrinter()))


def binary_feedback(derivation, layout):
    """Whether the plain recurrent product (no delays) reads an output that is 0 or 1 at every step: the forward's
    and the replay's products then take one TF32 pass fewer in float32 (`binary_operand_product` in the frames)."""
    from ..derive.cost import binary_values

    if layout.delayed or layout.synaptic:
        return False
    return layout.output in {str(s) for s in binary_values(derivation.trace, derivation.forward)}


def kernel_sources(derivation, layout):
    """The recurrent layer's Triton kernels by kind: the neuron's printed step in the recurrent frames; for a layer
    without delays also the replay of known outputs' recurrent currents
    (`flexgen.launch.recurrent.replay.run_replayed`) and the one step a stream takes
    (`flexgen.launch.recurrent.step`)."""
    from ..frames import frame
    from ..printing import RecurrentTritonPrinter
    from ..render.contexts import backward_context, forward_context

    triton, plain = RecurrentTritonPrinter(), layout.layout
    binary = binary_feedback(derivation, layout)
    undelayed = {} if layout.delayed or layout.synaptic else {
        "replay": frame("recurrent_replay.py.j2").render(kernel=layout.kernel_name("replay"), layout=layout,
                                                          binary_output=binary),
        "step": _recurrent_kernel("recurrent_step.py.j2", layout, "step", recurrent_step_arguments(layout),
                                  dict(forward_context(derivation, plain, False, triton), binary_output=binary)),
    }
    return {
        "forward": _recurrent_kernel("recurrent_forward.py.j2", layout, "forward",
                                     recurrent_forward_arguments(layout, training=True),
                                     dict(forward_context(derivation, plain, True, triton), binary_output=binary)),
        "inference": _recurrent_kernel("recurrent_forward.py.j2", layout, "inference",
                                       recurrent_forward_arguments(layout, training=False),
                                       dict(forward_context(derivation, plain, False, triton), binary_output=binary)),
        "backward": _recurrent_kernel("recurrent_backward.py.j2", layout, "backward",
                                      recurrent_backward_arguments(layout),
                                      backward_context(derivation, plain, triton)),
        **undelayed,
    }


RECURRENT = RecurrentKind()
