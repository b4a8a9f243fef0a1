"""The kernel ABI's values: a call's tensors as the arguments `flexgen.render.layout` lists, with their strides.

Every per-step tensor is read as [T, N] (N neurons) through a step stride and one neuron stride, so
expanded (stride-0) gradients, such as the one of `y.sum()`, are never materialised. The kernels' per-neuron
partial gradients are reduced to the parameters' here too, as is a bias's gradient over steps and rows.
"""
import torch

from ..render.layout import Access
from .config import numel
from .scalars import cached_scalar, is_kept


def _flat_stride(sizes, strides):
    """The one stride that walks dims (sizes, strides) as a single flat dim, or None if there is none."""
    stride = expected = None
    for size, st in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if stride is None:
            stride = st
        elif st != expected:
            return None
        expected = st * size
    return 0 if stride is None else stride


def neuron_stride(t, first_dim):
    """Stride between neurons of `t` whose dims from `first_dim` on are the neurons, and `t` itself.

    Kernels index neurons with one stride, so a tensor whose neuron dims do not
    flatten (a permuted or sliced view) is copied first; the common layouts
    (contiguous, or expanded with stride 0) are passed as they are: no view,
    no copy, a few integer comparisons on the host. A 0-d tensor stands for
    one value everywhere (a constant initial state, a zero gradient).
    """
    if t.dim() == 0:
        return 0, t
    if t.is_contiguous():
        return 1, t
    stride = _flat_stride(t.shape[first_dim:], t.stride()[first_dim:])
    if stride is None:
        t = t.contiguous()
        return 1, t
    return stride, t


def _strided(t):
    """Pointer, step stride, neuron stride and whether every neuron reads the same value (stride 0)."""
    if t.is_contiguous() and t.dim():
        return [t, t.stride(0), 1, False]
    stride, t = neuron_stride(t, 1)
    return [t, t.stride(0) if t.dim() else 0, stride, stride == 0]


def broadcasts_per_neuron(param, step_shape):
    """Whether a learnable parameter is neither one value nor one per channel (1-d, as long as dim 1 of a step)
    but another shape that broadcasts against a step (torch's rules): the kernels read it expanded."""
    per_channel = param.dim() == 1 and len(step_shape) > 1 and param.shape[0] == step_shape[1]
    return param.numel() > 1 and not per_channel


def per_neuron(param, step_shape):
    """A learnable parameter as one value per neuron of a flattened step ([N]), or as is if scalar."""
    if param.numel() == 1:
        return param.reshape(())
    if broadcasts_per_neuron(param, step_shape):
        return param.expand(step_shape).reshape(-1)
    channels = param.numel()
    view = [1] * len(step_shape)
    view[1] = channels
    return param.reshape(view).expand(step_shape).reshape(-1)


def reduce_to_param(per_neuron_grad, param, step_shape):
    """Sum a per-neuron gradient ([N], or a scalar) to the parameter's shape."""
    if param.numel() == 1:
        return per_neuron_grad.sum().reshape(param.shape)
    if broadcasts_per_neuron(param, step_shape):  # summed over the dims the parameter was broadcast along
        return per_neuron_grad.reshape(step_shape).sum_to_size(param.shape)
    channels = param.numel()
    return per_neuron_grad.reshape(step_shape[0], channels, -1).sum(dim=(0, 2)).reshape(param.shape)


def learnable_gradients(layout, partials, learnable, step_shape, held_grad=True):
    """The learnable values' gradients from the backward kernel's per-neuron partial sums. After them a tapped
    line's taps, from the rows the kernel gathered from and their sums [K, N] per tap and neuron; then a held line
    ([max_delay, ...] like the line), from its gradient rows (None without `held_grad`: not computed)."""
    n_summed = len(layout.learnable)
    grads = [reduce_to_param(p, w, step_shape).to(w.dtype) for p, w in zip(partials[:n_summed], learnable[:n_summed])]
    if layout.tapped:  # summed over the neurons of each channel: [K, B, C, inner] -> [C, K]
        taps, taps_partials = learnable[n_summed], partials[n_summed + 1]
        grads.append(taps_partials.reshape(taps.shape[1], step_shape[0], taps.shape[0], -1).sum((1, 3)).t()
                     .to(taps.dtype))
    if layout.held:
        line = learnable[-1]
        grads.append(partials[-1].view(line.shape).to(line.dtype) if held_grad else None)
    return grads


class KernelArgs(list):
    """A kernel's argument list that remembers which caller tensor went where.

    `slots` holds (position, group, index) for every tensor argument; `reusable`
    turns False when an argument is a copy or view made for this call only. A
    reusable list is a template (`EagerPlan`): the next call with tensors of the
    same shapes, strides and dtypes needs only its tensors put in the slots.
    """

    def __init__(self):
        super().__init__()
        self.slots = []
        self.reusable = True

    def tensor(self, t, source, group, index):
        if t is not source:
            self.reusable = False
        self.slots.append((len(self), group, index))
        self.append(t)

    def template(self):
        """The arguments with None in the tensor slots."""
        template = list(self)
        for position, _, _ in self.slots:
            template[position] = None
        return template


def fill(template, slots, groups):
    """A template's arguments with this call's tensors in its slots."""
    args = template.copy()
    for position, group, index in slots:
        args[position] = groups[group][index]
    return args


def fp64_scalar(value, device):
    """A hyper-parameter of an fp64 run as the kernels take it (`Access.SCALAR`): a 0-d fp64 tensor on `device`,
    since a Python float reaches a Triton kernel as fp32; and whether it is kept for later calls (not made while
    tracing or capturing a CUDA graph)."""
    value = float(value)
    t = cached_scalar(value, torch.float64, device)
    return t, is_kept(t, value)


def kernel_args(arguments, groups, step_shape, state_seqs=False, flatten_params=True, dtype=None, device=None):
    """The values of `arguments` (see `flexgen.render.layout`) for one call, taken from `groups` (the call's tensors
    by `Forward`/`Backward` group), before `n_steps, n_elem` and the constexprs. `dtype` and `device`: the
    run's I/O dtype and device; fp64 runs pass hyper-parameters as tensors (see `fp64_scalar`), others as numbers.

    With `flatten_params` a learnable parameter (or an fp64 hyper-parameter) is passed as a 1-d view: Inductor
    turns 0-d constant tensors (parameters of an exported eval model) into scalar constants, which it cannot pass
    to a user Triton kernel as a pointer. Eager calls pass the parameter itself (one view less per call).
    """
    args = KernelArgs()
    for a in arguments:
        value = groups[a.group][a.index]
        if a.access is Access.STRIDED:
            ptr, step, neuron, bcast = _strided(value)
            args.tensor(ptr, value, a.group, a.index)
            args += [step, neuron, bcast]
        elif a.access is Access.STEP:
            stride, t = neuron_stride(value, 0)
            args.tensor(t, value, a.group, a.index)
            args.append(stride)
        elif a.access is Access.CARRIED:  # per step with state sequences, else the last step's only
            stride, t = neuron_stride(value, 1 if state_seqs else 0)
            args.tensor(t, value, a.group, a.index)
            args += [t.stride(0) if state_seqs and t.dim() else 0, stride]
        elif a.access is Access.ROWS:  # under torch.func saved values may be slices: rows must be contiguous
            args.tensor(value.contiguous(), value, a.group, a.index)
        elif a.access is Access.PARAMETER and broadcasts_per_neuron(value, step_shape):  # read expanded, per neuron
            args.tensor(per_neuron(value, step_shape).contiguous(), value, a.group, a.index)
            args += [1, numel(step_shape), True]
        elif a.access is Access.PARAMETER:  # one value (shape ()) or one per channel (dim 1 of a step)
            per_channel = value.numel() > 1
            args.tensor(value.reshape(-1) if flatten_params else value, value, a.group, a.index)
            args += [numel(step_shape[2:]) if per_channel else 1, value.numel(), per_channel]
        elif a.access is Access.TAPS:  # [channels, K]: the row of neuron n is its channel, (n // inner) % channels
            args.tensor(value, value, a.group, a.index)
            args += [numel(step_shape[2:]), value.shape[0], value.stride(0), value.stride(1)]
        elif a.access is Access.MATRIX:  # read through its strides: a transposed weight is not copied
            args.tensor(value, value, a.group, a.index)
            args += [value.stride(0), value.stride(1)]
        elif a.access is Access.COLUMNS:  # [H], or 0-d: one value for every hidden neuron
            args.tensor(value, value, a.group, a.index)
            args.append(value.stride(0) if value.dim() else 0)
        elif dtype == torch.float64:  # Access.SCALAR
            t, kept = fp64_scalar(value, device)
            args.reusable &= kept
            args.append(t.reshape(1) if flatten_params else t)  # 1-d, like the learnable parameters
        else:  # Access.SCALAR
            args.append(value)
    return args


def summed_over_steps_and_rows(values, dtype=None):
    """`values` [T, B, ...] summed over its steps and batch rows, in fp32 (fp64 for fp64) and given in `dtype` (by
    default the values'): a bias's gradient. Over T, then over B: torch's CUDA sum over both at once stages its
    partial sums in a buffer of twice the values' size, up to 132 MiB, which the backward's peak memory would carry
    (docs/perf/h100/bias_gradient_workspace_2026-11-27.log, dense_bias_probe_2026-11-27.log)."""
    wide = torch.float64 if torch.float64 in (values.dtype, dtype) else torch.float32
    return values.sum(0, dtype=wide).sum(0).to(dtype or values.dtype)
