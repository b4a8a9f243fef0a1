"""The C target's kernel ABI: the parameter lists of the C forward and backward, in the order of the neuron
kernels' argument lists (`flexgen.render.layout`), with the data pointers, strides and values a C function takes
where a Triton kernel takes a tensor."""
import dataclasses

from .layout import Backward, Forward


@dataclasses.dataclass(frozen=True)
class CParameter:
    """One parameter of a C kernel after its leading counts and flags: its declaration, which caller value it
    is (group and index, as for `Argument`), and `part`: "data" (a tensor's contiguous data), "stride" (a learnable
    parameter's neuron stride: 0 for one value, 1 for one per neuron), "step" (the elements from one step's row of
    a gradient to the next: N, or 0 where one row holds every step's) or "value" (a hyper-parameter)."""

    declaration: str
    group: int
    index: int
    part: str = "data"


def _c_reads(stem, group, index, ctype="scalar_t"):
    return CParameter(f"const {ctype} *restrict {stem}_ptr", group, index)


def _c_writes(stem, group, index, ctype="scalar_t"):
    return CParameter(f"{ctype} *restrict {stem}_ptr", group, index)


def _c_type(saved):
    return "uint8_t" if saved.binary else "scalar_t"


def _c_learnable(layout, group):
    params = []
    for i, w in enumerate(layout.learnable):
        params += [_c_reads(w, group, i), CParameter(f"int64_t {w}_sn", group, i, "stride")]
    return params


def c_forward_parameters(layout):
    """The C forward's parameters after (n_steps, n_elem, THREADS, SAVE, STATE_SEQS)."""
    params = [_c_reads(x, Forward.INPUTS, i) for i, x in enumerate(layout.inputs)]
    params += [_c_reads(v, Forward.STATES, i) for i, v in enumerate(layout.states)]
    params += _c_learnable(layout, Forward.LEARNABLE)
    if layout.tapped:  # tap-major rows of one tap per neuron, [max_delay + 1, N]
        params.append(_c_reads(layout.taps_parameter, Forward.LEARNABLE, len(layout.learnable)))
    if layout.held:
        params.append(_c_reads(layout.held_line, Forward.LEARNABLE, len(layout.learnable) + layout.tapped))
    params += [CParameter(f"scalar_t {p}", Forward.HYPER, i, "value") for i, p in enumerate(layout.hyper)]
    params += [_c_writes(o, Forward.OUTPUTS, i) for i, o in enumerate(layout.outputs)]
    params += [_c_writes(f"{v}_seq", Forward.FINALS, i) for i, v in enumerate(layout.states)]
    return params + [_c_writes(b.stem, Forward.BUFFERS, i, _c_type(b)) for i, b in enumerate(layout.buffers)]


def c_backward_parameters(layout):
    """The C backward's parameters after (n_steps, n_elem, THREADS, STATE_SEQS)."""
    params = [_c_reads(s.stem, Backward.SAVED, i, _c_type(s)) for i, s in enumerate(layout.saved)]
    for i, g in enumerate(layout.grad_outputs):
        params += [_c_reads(g, Backward.GRAD_OUTPUTS, i),
                   CParameter(f"int64_t {g}_ss", Backward.GRAD_OUTPUTS, i, "step")]
    params += [_c_reads(g, Backward.GRAD_STATES, i) for i, g in enumerate(layout.carried)]
    params += _c_learnable(layout, Backward.LEARNABLE)
    if layout.tapped:
        params.append(_c_reads(layout.taps_parameter, Backward.LEARNABLE, len(layout.learnable)))
    if layout.held:
        params.append(_c_reads(layout.held_line, Backward.LEARNABLE, len(layout.learnable) + layout.tapped))
    params += [CParameter(f"scalar_t {p}", Backward.HYPER, i, "value") for i, p in enumerate(layout.hyper)]
    params += [_c_writes(g, Backward.GRAD_INPUTS, i) for i, g in enumerate(layout.grad_inputs)]
    params += [_c_writes(f"{g}_prev", Backward.GRAD_PREV, i) for i, g in enumerate(layout.carried)]
    params += [_c_writes(f"partial_{w}", Backward.PARTIALS, i) for i, w in enumerate(layout.learnable)]
    if layout.tapped:  # [T, N] rows of every step's gradient of the delayed input, and the taps' partial sums
        params += [_c_writes(layout.sent_rows, Backward.PARTIALS, len(layout.learnable)),
                   _c_writes(layout.taps_partials, Backward.PARTIALS, len(layout.learnable) + 1)]
    if layout.held:  # [max_delay, N] rows
        params.append(_c_writes(layout.held_grad, Backward.PARTIALS, len(layout.learnable) + 2 * layout.tapped))
    return params
