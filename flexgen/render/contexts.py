"""Stage 4, render: print the derived programs and splice them into the jinja2 kernel frames.

The render contexts every layer kind's neuron kernels share: a `Derivation`'s programs printed for a `Layout`
(forward, backward, recompute, the torch path's loops, the C target's source; a delay line's printed pieces), and
the kernels they fill (`kernel_sources`, `plain_design_kernels`, `c_source`). Each kind (`flexgen.kinds`) puts
them into its module frame; the frames (`flexgen.frames`) hold the loops, loads and stores, the printers
(`flexgen.printing`) the math.
"""
import re

import sympy
from sympy.codegen.ast import Assignment, aug_assign

from ..derive.programs import backward_code, forward_code, recompute_code
from ..errors import SpecError
from ..frames import frame
from .c_abi import c_backward_parameters, c_forward_parameters
from .layout import Kind, backward_arguments, delay_gradient, forward_arguments, recompute_layout, signature
from ..printing import CPrinter, TorchPrinter, TritonPrinter
from ..version import __version__


def print_program(program, printer):
    return "\n".join(printer.doprint(Assignment(a.target, a.expr)) for a in program)


def _printed(code, printer):
    return {"prelude": print_program(code.prelude, printer), "code": print_program(code.step, printer)}


def forward_context(derivation, layout, training, printer):
    """The forward frame's names. The recompute variant's training forward checkpoints the states every
    `chunk` steps instead of writing the saved values."""
    chunk = layout.variant.chunk if training else 0
    buffers = [b.name for b in layout.buffers] if training and not chunk else []
    binary = [b.name for b in layout.buffers if b.binary and b.name in buffers]
    return {
        "checkpoints": layout.states if chunk else [],
        "chunk": chunk,
        "inputs": layout.inputs,
        "states": layout.states,
        "learnable": layout.learnable,
        "hyper": layout.hyper,
        "outputs": layout.outputs,
        "buffers": buffers,
        "binary": binary,  # kept in bytes, exactly: never rounded
        "stores": [(o, f"{o}_ptr") for o in layout.outputs],
        "updates": list(zip(layout.states, layout.next_states)),
        **_kept_decisions(derivation, layout, [b for b in buffers if b not in binary], printer),
        **_printed(forward_code(derivation), printer),
        "delay": _delay_context(layout, printer),
    }


def _delay_context(layout, printer):
    """The delay line's names and printed equations for the frames (None without one): the delayed input mixes
    its values `lag` (near) and `lag` + 1 (far) steps back by `frac`; its gradient spreads over the two input steps
    the same way; the delay's gradient is the input gradient times far - near."""
    if not layout.delayed:
        return None
    x = layout.delayed
    grad = layout.grad_inputs[layout.inputs.index(x)]
    held = {"held": layout.held_line if layout.held else None, "held_grad": layout.held_grad}
    if layout.tapped:
        return {**_tapped_delay_context(layout, x, grad, printer), **held}
    names = (f"{x}_near", f"{x}_far", f"{x}_frac", grad, f"{x}_later")
    near, far, frac, g, later = (sympy.Symbol(n, real=True) for n in names)
    equations = {
        "mix": Assignment(sympy.Symbol(x, real=True), (1 - frac) * near + frac * far),
        "spread": Assignment(sympy.Symbol(f"{x}_spread", real=True), (1 - frac) * g + frac * later),
        "first_spread": Assignment(sympy.Symbol(f"{x}_spread", real=True), frac * later),
        "grad_delay": Assignment(sympy.Symbol(delay_gradient(x), real=True), g * (far - near)),
    }
    return {"input": x, "tapped": False, "parameter": layout.delay_parameter, "max_delay": layout.max_delay,
            "grad": grad, **held, **{name: printer.doprint(eq) for name, eq in equations.items()}}


# Steps a tapped line's Triton kernels sum at once: their loads of the input (or of the delayed input's gradients)
# are independent, and each tap is loaded once for all of them. A step-at-a-time sum was latency-bound (a program
# has few warps, since each neuron's line is its own). On an H100, 700 LIF neurons, gaussian taps, fwd + bwd
# (docs/perf/NOTES.md): T 1000 B 32 max_delay 250 took 139.6 ms a step at a time, 58.5 / 32.2 / 21.7 / 15.5 at
# chunks of 8 / 16 / 32 / 64, and 125 at 128, whose backward spills its three [chunk, BLOCK] tiles.
TAP_CHUNK = 64


def _tapped_delay_context(layout, x, grad, printer):
    """A tapped line's names and printed sums: the delayed input adds every step back weighed by its channel's
    tap; the input step's gradient adds the delayed input's gradients of the steps that read it, the same way; a
    tap's gradient adds the delayed input's gradient of each step times the input that tap read."""
    delayed, tap, value, gathered, later = (sympy.Symbol(n, real=True) for n in
                                            (x, f"{x}_tap", f"{x}_value", f"{x}_gathered", f"{x}_later"))
    tap_grad, sent = sympy.Symbol(f"{x}_tap_grad", real=True), sympy.Symbol(f"{x}_sent_value", real=True)
    chunk = sympy.Symbol(f"{x}_chunk", real=True)
    return {"input": x, "tapped": True, "taps": layout.taps_parameter, "sent": layout.sent_rows,
            "partials": layout.taps_partials, "max_delay": layout.max_delay, "n_taps": layout.max_delay + 1,
            "grad": grad, "chunk": TAP_CHUNK,
            "accumulate": printer.doprint(aug_assign(delayed, "+", tap * value)),
            "accumulate_chunk": printer.doprint(aug_assign(chunk, "+", tap * value)),
            "gather": printer.doprint(aug_assign(gathered, "+", tap * later)),
            "tap_gradient": printer.doprint(aug_assign(tap_grad, "+", sent * value)),
            "tap_products": printer.doprint(Assignment(sympy.Symbol(f"{x}_tap_products", real=True), sent * value))}


DELAY_LINE_FORMS = ("{}_delay", "grad_{}_delay", "{}_clamped", "{}_lag", "{}_frac", "{}_far_on_line", "{}_src",
                    "{}_carried", "{}_near", "{}_far", "{}_later", "{}_spread", "{}_dst", "{}_taps", "{}_taps_row",
                    "{}_tap_index", "{}_tap", "{}_value", "{}_gathered", "{}_sent", "{}_tap_grad",
                    "{}_sent_value", "{}_chunk", "{}_rows", "{}_slot", "{}_in", "{}_done", "{}_at",
                    "{}_tap_products", "{}_held", "grad_{}_held", "{}_line")


def check_delay_names(derivation, layout):
    """A SpecError where a name of the step (a parameter, state, output or a local of its printed code) is one the
    delay line's frames make from the delayed input's name: the kernels would read the wrong value."""
    x = layout.delayed
    made = {form.format(x) for form in DELAY_LINE_FORMS}
    printer = TritonPrinter()
    code = " ".join(print_program(program, printer) for kernel in (forward_code(derivation), backward_code(derivation))
                    for program in (kernel.prelude, kernel.step))
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code))
    names.update(layout.inputs + layout.states + layout.hyper + layout.outputs)
    names.update(w for w in layout.learnable if w != layout.delay_parameter)
    clash = sorted(made & names)
    if clash:
        raise SpecError(f"{layout.neuron}: the delay line on input {x!r} names its values {clash}, which the step "
                        "uses too; rename them in the step")


def _kept_decisions(derivation, layout, written, printer):
    """What the forward needs to keep the backward's comparisons when it rounds saved values to a 16-bit
    I/O dtype (see `derive.decisions_on`): `rounded`, the written values the comparisons read (each
    rounded first, as `<name>_io`, and read back as `<name>_seen`); `seen_outputs`, the saved outputs
    they read; `nudged`, (value, printed test that the comparisons it answers for agree on the values
    as stored with the forward's outcomes) in order; `reread`, values whose comparisons a later test reads."""
    outputs = {s.name for s in layout.saved if s.kind is Kind.OUTPUT}
    nudged, read_by = [], {}
    for value, comparisons in derivation.decisions if written else ():
        read = sorted(set().union(*(c.free_symbols for c in comparisons)), key=str)
        seen = {s: sympy.Symbol(f"{s}_seen", real=True) for s in read if str(s) in written or str(s) in outputs}
        for s in seen:
            read_by.setdefault(str(s), []).append(str(value))
        agree = sympy.And(*(sympy.Equivalent(c.xreplace(seen), c) for c in comparisons))
        nudged.append((str(value), printer.doprint(agree)))
    order = [v for v, _ in nudged]
    rounded = [b for b in written if b in read_by]
    seen_outputs = [o for o in read_by if o in outputs]
    reread = [v for v in order if any(order.index(user) > order.index(v) for user in read_by.get(v, ()))]
    return {"rounded": rounded, "seen_outputs": seen_outputs, "nudged": nudged, "reread": reread}


def backward_context(derivation, layout, printer):
    delay = _delay_context(layout, printer)
    if delay and delay.get("tapped"):  # the taps' gradient reads the input after the time loop; the step may not
        delay["reread"] = layout.delayed in map(str, derivation.saved)
    initial = _initial_states(layout)
    loads = [(s.name, s.stem, s.kind is Kind.INPUT, initial.get(s.name, "")) for s in layout.saved
             if s.kind is not Kind.STATE]
    loads += [(g, g, True, "") for g in layout.grad_outputs]
    return {
        "learnable": layout.learnable,
        "hyper": layout.hyper,
        "carried": layout.carried,
        "loads": loads,
        "grad_inputs": layout.grad_inputs,
        "grad_learnable": list(zip(layout.learnable, layout.grad_learnable)),
        "updates": list(zip(layout.carried, layout.grad_prev_states)),
        **_printed(backward_code(derivation), printer),
        "delay": delay,
    }


def _initial_states(layout):
    """A plain backward's states kept in bytes -> the stem of their initial state, which their first step reads."""
    return {s.name: s.stem for s in layout.saved if s.kind is Kind.STATE}


def recompute_backward_context(derivation, layout, printer):
    """The recompute backward frame: the forward step (as the forward kernel prints it), then the backward."""
    code = recompute_code(derivation, layout.variant.chunk)
    return {
        "hyper": layout.hyper,
        "learnable": layout.learnable,
        "inputs": layout.inputs,
        "states": layout.states,
        "carried": layout.carried,
        "chunk": layout.variant.chunk,
        "prelude": print_program(code.prelude, printer),
        "code": print_program(code.forward_step, printer),
        "kept": code.kept,
        "updates": list(zip(layout.states, layout.next_states)),
        "grad_outputs": layout.grad_outputs,
        "backward_code": print_program(code.backward_step, printer),
        "grad_inputs": layout.grad_inputs,
        "grad_learnable": list(zip(layout.learnable, layout.grad_learnable)),
        "carried_updates": list(zip(layout.carried, layout.grad_prev_states)),
        "delay": _delay_context(layout, printer),
    }


def torch_backward_context(derivation, layout, printer):
    context = backward_context(derivation, layout, printer)
    first = {s.name: f"saved[{k}]" for k, s in enumerate(layout.saved) if s.kind is Kind.STATE}
    context["loads"] = [(s.name, f"saved[{k}]", first.get(s.name, "")) for k, s in enumerate(layout.saved)
                        if s.kind is not Kind.STATE]
    context["loads"] += [(g, f"grad_outputs[{k}]", "") for k, g in enumerate(layout.grad_outputs)]
    return context


def _prelude_names(code):
    """The names a derived program's prelude assigns (the C frame keeps them per neuron of a block)."""
    return {"prelude_names": [str(a.target) for a in code.prelude]}


def _c_variant(derivation, layout, printer):
    """One design's names for the C frame: its forward's, its backward's and their parameter lists."""
    forward = {**forward_context(derivation, layout, True, printer), **_prelude_names(forward_code(derivation))}
    if layout.variant.recompute:
        context = recompute_backward_context(derivation, layout, printer)
        code = recompute_code(derivation, layout.variant.chunk)
        prelude = _prelude_names(code)["prelude_names"]
        backward = {**context, "code": context["backward_code"], "forward_code": context["code"],
                    "updates": context["carried_updates"], "state_updates": context["updates"],
                    "prelude_names": prelude,
                    # a step that computes a prelude value again defines it itself (C allows one definition)
                    "forward_prelude_loads": _not_assigned(prelude, code.forward_step),
                    "backward_prelude_loads": _not_assigned(prelude, code.backward_step)}
    else:
        backward = {**backward_context(derivation, layout, printer), "chunk": 0, "grad_outputs": layout.grad_outputs,
                    **_prelude_names(backward_code(derivation))}
    return {"suffix": layout.variant.suffix, "forward": forward, "backward": backward,
            "forward_args": [p.declaration for p in c_forward_parameters(layout)],
            "backward_args": [p.declaration for p in c_backward_parameters(layout)]}


def _not_assigned(names, program):
    assigned = {str(a.target) for a in program}
    return [n for n in names if n not in assigned]


def c_source(derivation, layout, recompute=True):
    """The C target's source: the forward and the backward of the plain design and (with `recompute`) the recompute
    one, for float and double."""
    printer = CPrinter()
    designs = (layout, recompute_layout(layout)) if recompute else (layout,)
    return frame("c_kernels.c.j2").render(
        header=f"/* {layout.neuron}: generated by flexgen {__version__} from the neuron's derived step "
               "(spec.equations() prints it) */",
        layout=layout,
        variants=[_c_variant(derivation, variant, printer) for variant in designs],
    )


def _triton_kernel(frame_name, layout, kind, arguments, context):
    return frame(frame_name).render(kernel=layout.kernel_name(kind), args=signature(arguments), **context)


def plain_design_kernels(derivation, layout, printer):
    """The plain design's Triton kernels of `layout`: "forward" (training), "inference" and "backward"."""
    return {
        "forward": _triton_kernel("forward.py.j2", layout, "forward", forward_arguments(layout, training=True),
                                  forward_context(derivation, layout, True, printer)),
        "inference": _triton_kernel("forward.py.j2", layout, "inference", forward_arguments(layout, training=False),
                                    forward_context(derivation, layout, False, printer)),
        "backward": _triton_kernel("backward.py.j2", layout, "backward", backward_arguments(layout),
                                   backward_context(derivation, layout, printer)),
    }


def kernel_sources(derivation, plain):
    """Each kernel's source by kind: the Triton kernels of both variants, the torch path's two loops and the C
    target's source."""
    triton, torch = TritonPrinter(), TorchPrinter()
    recompute = recompute_layout(plain)
    return {
        **plain_design_kernels(derivation, plain, triton),
        "forward_recompute": _triton_kernel("forward.py.j2", recompute, "forward",
                                            forward_arguments(recompute, training=True),
                                            forward_context(derivation, recompute, True, triton)),
        "backward_recompute": _triton_kernel("backward_recompute.py.j2", recompute, "backward",
                                             backward_arguments(recompute),
                                             recompute_backward_context(derivation, recompute, triton)),
        "torch_forward": frame("torch_forward.py.j2").render(**forward_context(derivation, plain, True, torch)),
        "torch_backward": frame("torch_backward.py.j2").render(**torch_backward_context(derivation, plain, torch)),
        "c": c_source(derivation, plain),
    }


def module_source(frame_name, derivation, layout, sources, libdevice_in, **extra):
    """A generated module: the kernels' `sources` in a kind's module frame `frame_name`, with what every module
    frame reads: the version, the layout, whether the kernels keep decisions, and whether the kernels named in
    `libdevice_in` call libdevice (the module then imports it)."""
    text = frame(frame_name).render(
        version=__version__, layout=layout, keeps_decisions=bool(derivation.decisions),
        uses_libdevice=any("libdevice." in sources[kind] for kind in libdevice_in), **extra, **sources)
    return text + "\n"
