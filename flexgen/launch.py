"""Stage 6: call the generated kernels, as PyTorch custom ops with autograd.

Each neuron gets two `torch.library.triton_op`s, `flexgen::<neuron>_<key>_forward`
and `..._backward`, so `torch.compile` and `torch.export` see and trace into
the Triton launches; the forward op's autograd formula calls the backward op.
Eager calls run the same implementations through a plain autograd.Function
(see `NeuronOps.call`). Both run the Triton kernels (`use_triton=True`: CUDA
tensors, or CPU tensors under TRITON_INTERPRET=1) or the generated torch path
(`use_triton=False`).

Every per-step tensor is viewed as [T, N] (N neurons); kernels read inputs and
incoming gradients through their strides, so expanded (stride-0) gradients,
such as the one of `y.sum()`, are never materialised.
"""
import contextlib
import functools
import math
import os
import types
from typing import List

import torch
import triton
from torch.library import triton_op, wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode

BLOCK = 1024
# The recompute backward keeps a chunk's values in registers: fewer neurons per program leave room for them.
RECOMPUTE_BLOCK = 512
NUM_WARPS = 4
MAX_PLANS = 64  # EagerPlans kept per neuron


# I/O dtypes narrower than the arithmetic: the forward rounds saved values to them (keeping the outcome of the
# backward's comparisons, see derive.decisions_on).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype):
    """Arithmetic runs in fp32 for every I/O dtype except fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows(t, n_steps, n_elem):
    """`t` as a [T, N] view where its strides allow, else a contiguous copy (the torch path)."""
    if t.dim() == 0:  # one value for every step and neuron
        return t.expand(n_steps, n_elem)
    try:
        return t.view(n_steps, n_elem)
    except RuntimeError:
        return t.reshape(n_steps, n_elem)


def flat(t, n_elem):
    if t.dim() == 0:
        return t.expand(n_elem)
    try:
        return t.view(n_elem)
    except RuntimeError:
        return t.reshape(n_elem)


def _skip_kernel_scan(fn):
    """Keep triton_op from scanning `fn`'s source for kernels.

    That best-effort scan imports torch._inductor (about a second of start-up
    for every process, compiled or not) and only feeds the AOTAutograd cache
    key, which the op names already pin: they carry the generated module's
    hash. The scan reads the source of `inspect.unwrap(fn)`; a partial has none,
    while the signature (schema inference follows __wrapped__ too) stays the
    one of a twin of `fn`.
    """
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__annotations__ = dict(fn.__annotations__)
    fn.__wrapped__ = functools.partial(twin)
    return fn


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


def _neuron_stride(t, first_dim):
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
    stride, t = _neuron_stride(t, 1)
    return [t, t.stride(0) if t.dim() else 0, stride, stride == 0]


def _param_args(args, params, step_shape, flatten, group):
    """Pointer, neurons per channel, channels and the per-channel flag of each learnable parameter.

    A parameter holds one value (shape ()), one per channel (dim 1 of a step, as in [T, B, C, ...]) or
    another shape that broadcasts against a step (passed expanded, as one value per neuron).
    With `flatten` the pointer is a 1-d view: Inductor turns 0-d constant tensors (parameters of an
    exported eval model) into scalar constants, which it cannot pass to a user Triton kernel as a
    pointer. Eager calls pass the parameter itself (one view less per call).
    """
    for i, p in enumerate(params):
        if broadcasts_per_neuron(p, step_shape):  # read expanded: one value per neuron, indexed directly
            args.tensor(per_neuron(p, step_shape).contiguous(), p, group, i)
            args += [1, _numel(step_shape), True]
            continue
        per_channel = p.numel() > 1
        inner = _numel(step_shape[2:]) if per_channel else 1
        args.tensor(p.reshape(-1) if flatten else p, p, group, i)
        args += [inner, p.numel(), per_channel]


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


def _direct(kernel):
    return kernel


def _grid(n_elem, block=BLOCK):
    return ((n_elem + block - 1) // block,)


def backward_block(lay):
    return RECOMPUTE_BLOCK if lay["chunk"] else BLOCK


# Argument groups: where a kernel argument's tensor comes from (see KernelArgs), as indices into the
# groups an EagerPlan fills its templates from.
INPUTS, STATES, LEARNABLE, OUTPUTS, FINALS, BUFFERS = range(6)  # forward
SAVED, GRAD_OUTPUTS, GRAD_STATES, PARAMS, GRAD_INPUTS, GRAD_PREV, PARTIALS = range(7)  # backward


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

    def strided(self, t, group, index):
        """`t` with its step stride, neuron stride and stride-0 flag (see `_strided`)."""
        ptr, step, neuron, bcast = _strided(t)
        self.tensor(ptr, t, group, index)
        self += [step, neuron, bcast]

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


def forward_args(xs, vs, ws, hyper, fresh, step_shape, flatten_params=True):
    """The forward (or inference) kernel's arguments before `n_steps, n_elem` and the constexprs.

    fresh: the (outputs, finals, buffers) the kernel writes.
    """
    outputs, finals, buffers = fresh
    args = KernelArgs()
    for i, x in enumerate(xs):
        args.strided(x, INPUTS, i)
    for i, (v, final) in enumerate(zip(vs, finals)):
        stride, t = _neuron_stride(v, 0)
        args.tensor(t, v, STATES, i)
        args.append(stride)
        args.tensor(final, final, FINALS, i)
    for i, o in enumerate(outputs):
        args.tensor(o, o, OUTPUTS, i)
    for i, b in enumerate(buffers):
        args.tensor(b, b, BUFFERS, i)
    _param_args(args, ws, step_shape, flatten_params, LEARNABLE)
    args += hyper
    return args


def backward_args(lay, saved, grad_outputs, grad_states, ws, hyper, fresh, step_shape, state_seqs, flatten_params=True):
    """The backward kernel's arguments before `n_steps, n_elem` and the constexprs.

    fresh: (grad_inputs, grad_prev, partials); grad_prev None when the initial states' gradients are
    not wanted (the kernel stores nothing there; the first input gradient fills those slots).
    """
    grad_inputs, grad_prev, partials = fresh
    args = KernelArgs()
    for i, (entry, tensor) in enumerate(zip(lay["saved"], saved)):
        if entry["kind"] == "input":
            args.strided(tensor, SAVED, i)
        elif entry["kind"] == "state":  # an initial state (recompute): one step, read like the forward reads it
            stride, t = _neuron_stride(tensor, 0)
            args.tensor(t, tensor, SAVED, i)
            args.append(stride)
        else:  # buffers, checkpoints and saved outputs are read as contiguous rows; under torch.func they may be slices
            args.tensor(tensor.contiguous(), tensor, SAVED, i)
    for i, g in enumerate(grad_outputs):
        args.strided(g, GRAD_OUTPUTS, i)
    for i, g in enumerate(grad_states):
        if state_seqs:
            stride, t = _neuron_stride(g, 1)
            args.tensor(t, g, GRAD_STATES, i)
            args += [t.stride(0) if t.dim() else 0, stride]
        else:
            stride, t = _neuron_stride(g, 0)
            args.tensor(t, g, GRAD_STATES, i)
            args += [0, stride]
    for i, g in enumerate(grad_inputs):
        args.tensor(g, g, GRAD_INPUTS, i)
    for i in range(len(grad_states)):
        if grad_prev is None:
            args.tensor(grad_inputs[0], grad_inputs[0], GRAD_INPUTS, 0)
        else:
            args.tensor(grad_prev[i], grad_prev[i], GRAD_PREV, i)
    _param_args(args, ws, step_shape, flatten_params, PARAMS)
    for i, p in enumerate(partials):
        args.tensor(p, p, PARTIALS, i)
    args += hyper
    return args


def n_checkpoints(n_steps, chunk):
    """Rows of states the recompute forward writes: one before every chunk of `chunk` steps but the first."""
    return max(0, -(-n_steps // chunk) - 1)


def buffer_shape_dtype(lay, shape, dtype):
    """Shape and dtype of each buffer the training forward writes.

    Saved values: one per step, in the I/O dtype. Checkpoints (recompute): a
    few rows of states in the compute dtype, so the backward's re-run of the
    forward steps gives what the forward computed, bit for bit.
    """
    if lay["chunk"]:
        return (n_checkpoints(shape[0], lay["chunk"]), *shape[1:]), compute_dtype(dtype)
    return tuple(shape), dtype


def saved_bytes_per_step(lay, dtype):
    """Bytes per neuron and step that keeping what the backward needs costs, besides reading the inputs,
    writing the outputs and the gradients once: saved values written and read back, saved inputs or
    outputs read again; with recompute, the inputs read again and the checkpoints written and read once
    a chunk."""
    io = torch.finfo(dtype).bits // 8
    if lay["chunk"]:
        state = torch.finfo(compute_dtype(dtype)).bits // 8
        return io * len(lay["inputs"]) + 2 * state * len(lay["buffers"]) / lay["chunk"]
    return sum(2 * io if s["kind"] == "buffer" else io for s in lay["saved"])


def _allocate_forward(lay, shape, dtype, device, state_dtypes, state_seqs, save):
    step_shape = shape[1:]
    outputs = [torch.empty(shape, dtype=dtype, device=device) for _ in lay["outputs"]]
    finals = [torch.empty(shape if state_seqs else step_shape, dtype=dt, device=device) for dt in state_dtypes]
    return outputs, finals, _allocate_buffers(lay, shape, dtype, device) if save else []


def _allocate_buffers(lay, shape, dtype, device):
    buffer_shape, buffer_dtype = buffer_shape_dtype(lay, shape, dtype)
    return [torch.empty(buffer_shape, dtype=buffer_dtype, device=device) for _ in lay["buffers"]]


def _allocate_backward(lay, shape, dtype, device, state_dtypes, n_learnable, grad_init):
    grad_inputs = [torch.empty(shape, dtype=dtype, device=device) for _ in lay["inputs"]]
    grad_prev = [torch.empty(shape[1:], dtype=dt, device=device) for dt in state_dtypes] if grad_init else None
    n_elem = _numel(shape[1:])
    partials = [torch.empty((n_elem,), dtype=compute_dtype(dtype), device=device) for _ in range(n_learnable)]
    return grad_inputs, grad_prev, partials


def _forward_kernel(module, lay, save):
    return getattr(module, lay["kernels"]["forward" if save else "inference"])


def _backward_kernel(module, lay):
    return getattr(module, lay["kernels"]["backward"])


def triton_forward(module, lay, xs, vs, ws, hyper, state_seqs, save, launch, shape, n_elem):
    """Launch the forward (or inference) kernel; outputs, final states (or their sequences) and buffers."""
    dtype = xs[0].dtype
    fresh = _allocate_forward(lay, shape, dtype, xs[0].device, [v.dtype for v in vs], state_seqs, save)
    args = forward_args(xs, vs, ws, hyper, fresh, shape[1:])
    launch(_forward_kernel(module, lay, save))[_grid(n_elem)](
        *args, shape[0], n_elem,
        STATE_SEQS=state_seqs, F64=dtype == torch.float64, HALF_IO=dtype in HALF_DTYPES, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )
    outputs, finals, buffers = fresh
    return outputs + finals + buffers


def triton_backward(module, lay, saved, grad_outputs, grad_states, ws, hyper, state_seqs, grad_init, launch, shape, n_elem):
    """Launch the backward kernel; gradients of the inputs, the initial states (None unless `grad_init`)
    and the learnable parameters."""
    dtype = grad_outputs[0].dtype
    state_dtypes = [g.dtype for g in grad_states]
    fresh = _allocate_backward(lay, shape, dtype, grad_outputs[0].device, state_dtypes, len(ws), grad_init)
    args = backward_args(lay, saved, grad_outputs, grad_states, ws, hyper, fresh, shape[1:], state_seqs)
    block = backward_block(lay)
    launch(_backward_kernel(module, lay))[_grid(n_elem, block)](
        *args, shape[0], n_elem,
        STATE_SEQS=state_seqs, GRAD_INIT=grad_init, F64=dtype == torch.float64, BLOCK=block, num_warps=NUM_WARPS,
    )
    grad_inputs, grad_prev, partials = fresh
    grad_learnable = [reduce_to_param(p, w, shape[1:]).to(w.dtype) for p, w in zip(partials, ws)]
    return grad_inputs + (grad_prev or [None] * len(grad_states)) + grad_learnable


def _triton_version():
    parts = []
    for piece in triton.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# Since Triton 3.3 a compiled kernel's launcher takes every argument of the kernel's signature, the
# constexprs included (3.2 took only the others); 3.3 to 3.9 keep that convention.
DIRECT_LAUNCH = (
    _triton_version() >= (3, 3)
    and getattr(torch.version, "hip", None) is None
    and os.environ.get("FLEXGEN_DIRECT_LAUNCH", "1") != "0"
)


def _launch_hook_holder():
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; before, the hooks were CompiledKernel's
    return knobs.runtime if knobs is not None else triton.compiler.CompiledKernel


_HOOKS = _launch_hook_holder()


def _launch_hooks_set():
    """Whether a profiler (Proton, for one) hooks Triton launches: those go through Triton's own path."""
    return _hook_set(getattr(_HOOKS, "launch_enter_hook", None)) or _hook_set(getattr(_HOOKS, "launch_exit_hook", None))


def _hook_set(hook):
    """A launch hook: None, a function, or (Triton 3.5+) a chain of functions, empty when none is added."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


def on_device_of(device):
    """Triton launches on the current CUDA device; make that the tensors' device, as torch ops do."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


class KernelCall:
    """One generated kernel launched with fixed non-tensor arguments (an `EagerPlan`'s).

    Triton's `JITFunction.run` works out the compiled specialisation from every
    argument on every call, about 11 µs of host time per launch on an H200
    machine. Here every argument but the tensors is fixed, so what is left to
    key the specialisation on is whether each pointer is 16-byte aligned (what
    Triton specialises pointers on). The first call of each key goes through
    Triton's path, which compiles or finds the kernel and returns it; later
    calls hand the arguments straight to its launcher. Launches run on the
    plan's device, made current for the call when another one is.
    """

    def __init__(self, kernel, n_elem, constexprs, tensor_positions, device):
        self.kernel, self.grid, self.constexprs = kernel, _grid(n_elem, constexprs["BLOCK"]), constexprs
        self.constexpr_values = list(constexprs.values())
        self.tensor_positions = tensor_positions
        self.device = device
        self.cuda_index = device.index if device.type == "cuda" else None
        self.direct = DIRECT_LAUNCH and device.type == "cuda" and self._constexprs_come_last()
        self.compiled = {}

    def _constexprs_come_last(self):
        names = getattr(self.kernel, "arg_names", None)
        return names is not None and names[len(names) - len(self.constexprs):] == list(self.constexprs)

    def __call__(self, args):
        if not self.direct or _launch_hooks_set():
            with on_device_of(self.device):
                self.kernel[self.grid](*args, **self.constexprs, num_warps=NUM_WARPS)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        if device != self.cuda_index:
            with torch.cuda.device(self.cuda_index):
                return self(args)
        key = tuple(args[i].data_ptr() & 15 for i in self.tensor_positions)
        launcher = self.compiled.get(key)
        if launcher is None:
            compiled = self.kernel[self.grid](*args, **self.constexprs, num_warps=NUM_WARPS)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = launcher
        run(self.grid[0], 1, 1, driver.get_current_stream(device), function, metadata, None, None, None,
            *args, *self.constexpr_values)


class EagerPlan:
    """The host side of eager Triton calls with one signature, worked out once.

    A signature is the shapes, strides, dtypes and devices of a call's tensors,
    with its hyper-parameters and flags. Everything a launch needs besides the
    tensors themselves (sizes, strides, stride-0 flags, the kernel, which
    buffers to allocate) follows from it, so a plan keeps the argument lists as
    templates and a call only allocates its outputs and fills in its tensors.
    Calls whose tensors need a copy first (a layout the kernels cannot index)
    get no plan and take the general path.
    """

    def __init__(self, ops, inputs, states, learnable, hyper, state_seqs, save):
        first = inputs[0]
        self.ops, self.lay = ops, ops.lay
        self.shape, self.dtype, self.device = tuple(first.shape), first.dtype, first.device
        self.hyper, self.state_seqs, self.save = list(hyper), state_seqs, save
        self.state_dtypes = [v.dtype for v in states]
        self.n_elem = _numel(self.shape[1:])
        lay = self.lay
        self.n_inputs, self.n_states, self.n_outputs = len(lay["inputs"]), len(lay["states"]), len(lay["outputs"])
        self.n_saved = len(lay["saved"])
        self.saved_slots = _saved_slots(lay)
        # Outputs and saved values take the first input's shape and dtype; empty_like keeps its layout, so only if
        # contiguous. Checkpoints (recompute) have shapes of their own.
        self.like_first = first.is_contiguous()
        self.buffers_like_first = self.like_first and not lay["chunk"]
        self.n_buffers = len(lay["buffers"]) if save else 0
        self.final_shapes = [(self.shape if state_seqs else self.shape[1:], dt) for dt in self.state_dtypes]
        self.grad_dtypes = [self.dtype] * self.n_outputs + self.state_dtypes
        self.zero_grads = self._zero_grads()
        fresh = self._allocate_forward()
        args = forward_args(inputs, states, learnable, self.hyper, fresh, self.shape[1:], flatten_params=False)
        args += [self.shape[0], self.n_elem]
        self.reusable, self.template, self.slots = args.reusable, args.template(), args.slots
        constexprs = {"STATE_SEQS": state_seqs, "F64": self.dtype == torch.float64, "HALF_IO": self.dtype in HALF_DTYPES,
                      "BLOCK": BLOCK}
        kernel = _forward_kernel(ops.module, lay, save)
        self.kernel = KernelCall(kernel, self.n_elem, constexprs, [p for p, _, _ in self.slots], self.device)
        self.backward_plans = {}

    def _allocate_forward(self, first=None):
        if first is not None and self.like_first:  # empty_like parses fewer arguments than empty: ~1 µs less each
            outputs = [torch.empty_like(first) for _ in range(self.n_outputs)]
            finals = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.final_shapes]
            if self.buffers_like_first:
                return outputs, finals, [torch.empty_like(first) for _ in range(self.n_buffers)]
            return outputs, finals, _allocate_buffers(self.lay, self.shape, self.dtype, self.device) if self.save else []
        return _allocate_forward(self.lay, self.shape, self.dtype, self.device, self.state_dtypes, self.state_seqs, self.save)

    def __call__(self, inputs, states, learnable):
        """The outputs and the final states (or their sequences), through autograd when the plan saves."""
        if self.save:
            return list(_PlannedFunction.apply(self, *inputs, *states, *learnable))
        outputs, finals, _ = self.forward(inputs, states, learnable)
        return outputs + finals

    def forward(self, inputs, states, learnable):
        """outputs, final states (or their sequences) and buffers."""
        fresh = self._allocate_forward(inputs[0])
        self.kernel(fill(self.template, self.slots, (inputs, states, learnable, *fresh)))
        return fresh

    def saved(self, inputs, states, outputs, buffers):
        """The tensors the backward reads, in the layout's order."""
        groups = (inputs, states, outputs, buffers)
        return [groups[group][index] for group, index in self.saved_slots]

    def backward(self, saved, learnable, grads, grad_init):
        """Gradients of the inputs, the initial states (None unless `grad_init`) and the learnable parameters.

        grads: the incoming gradients of the outputs and the final states, None where autograd has none
        (read as a stride-0 zero).
        """
        key = (grad_init, *[None if g is None else (g.shape, g.stride(), g.dtype) for g in grads])
        plan = self.backward_plans.get(key)
        if plan is None:
            plan = self.backward_plans[key] = _BackwardPlan(self, saved, learnable, self._with_zeros(grads), grad_init)
        return plan(saved, learnable, self._with_zeros(grads))

    def _zero_grads(self):
        """The stride-0 zeros read for missing incoming gradients, looked up once; None while a CUDA
        graph is captured (see `cached_scalar`: those are made per call)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        return [cached_zero(dt, self.device) for dt in self.grad_dtypes]

    def _with_zeros(self, grads):
        if self.zero_grads is None:
            return [cached_zero(dt, self.device) if g is None else g for g, dt in zip(grads, self.grad_dtypes)]
        return [z if g is None else g for g, z in zip(grads, self.zero_grads)]


SAVED_INPUT, SAVED_STATE, SAVED_OUTPUT, SAVED_BUFFER = range(4)  # where a saved tensor comes from: EagerPlan.saved's groups
_SAVED_GROUPS = {"input": SAVED_INPUT, "state": SAVED_STATE, "output": SAVED_OUTPUT}


def _saved_slots(lay):
    """(group, index) of each saved tensor among (inputs, states, outputs, buffers); buffers (saved values
    or checkpoints) in the order written."""
    slots, n_buffers = [], 0
    for entry in lay["saved"]:
        if entry["kind"] in _SAVED_GROUPS:
            slots.append((_SAVED_GROUPS[entry["kind"]], entry["index"]))
        else:
            slots.append((SAVED_BUFFER, n_buffers))
            n_buffers += 1
    return slots


class _BackwardPlan:
    """`EagerPlan`'s backward for one layout of the incoming gradients."""

    def __init__(self, forward, saved, learnable, grads, grad_init):
        self.forward, self.grad_init = forward, grad_init
        self.n_learnable = len(learnable)
        n_out = forward.n_outputs
        fresh = self._allocate()
        args = backward_args(
            forward.lay, saved, grads[:n_out], grads[n_out:], learnable, forward.hyper, fresh,
            forward.shape[1:], forward.state_seqs, flatten_params=False,
        )
        args += [forward.shape[0], forward.n_elem]
        self.reusable, self.template, self.slots = args.reusable, args.template(), args.slots
        constexprs = {
            "STATE_SEQS": forward.state_seqs, "GRAD_INIT": grad_init, "F64": forward.dtype == torch.float64,
            "BLOCK": backward_block(forward.lay),
        }
        kernel = _backward_kernel(forward.ops.module, forward.lay)
        self.kernel = KernelCall(kernel, forward.n_elem, constexprs, [p for p, _, _ in self.slots], forward.device)
        # A saved buffer has the input gradients' shape, dtype and contiguous layout: empty_like it (cheaper).
        buffers = [i for i, (group, _) in enumerate(forward.saved_slots) if group == SAVED_BUFFER]
        plain = not forward.lay["chunk"]
        self.like_saved = buffers[0] if plain and buffers and not grad_init and not self.n_learnable else None
        self.n_inputs, self.no_state_grads = len(forward.lay["inputs"]), [None] * forward.n_states

    def _allocate(self, saved=None):
        f = self.forward
        if saved is not None and self.like_saved is not None:
            like = saved[self.like_saved]
            return [torch.empty_like(like) for _ in range(self.n_inputs)], None, []
        return _allocate_backward(f.lay, f.shape, f.dtype, f.device, f.state_dtypes, self.n_learnable, self.grad_init)

    def __call__(self, saved, learnable, grads):
        f = self.forward
        if not self.reusable:  # a gradient in a layout the kernel cannot index: copied, call by call
            return triton_backward(
                f.ops.module, f.lay, saved, grads[:f.n_outputs], grads[f.n_outputs:], learnable, f.hyper,
                f.state_seqs, self.grad_init, _direct, f.shape, f.n_elem,
            )
        grad_inputs, grad_prev, partials = self._allocate(saved)
        groups = (saved, grads[:f.n_outputs], grads[f.n_outputs:], learnable, grad_inputs, grad_prev, partials)
        self.kernel(fill(self.template, self.slots, groups))
        if not partials:
            return grad_inputs + (grad_prev or self.no_state_grads)
        step_shape = f.shape[1:]
        grad_learnable = [reduce_to_param(p, w, step_shape).to(w.dtype) for p, w in zip(partials, learnable)]
        return grad_inputs + (grad_prev or self.no_state_grads) + grad_learnable


def torch_forward(module, lay, xs, vs, ws, hyper, state_seqs, save, launch, shape, n_elem):
    """The generated torch code on [T, N] views, in the compute dtype; results in `shape`."""
    n_steps, step_shape = shape[0], shape[1:]
    dtype = xs[0].dtype
    compute = compute_dtype(dtype)
    xs = [rows(x, n_steps, n_elem).to(compute) for x in xs]
    vs = [flat(v, n_elem).to(compute) for v in vs]
    ws = [per_neuron(w, step_shape).to(compute) for w in ws]
    hyper = [torch.tensor(p, dtype=compute, device=xs[0].device) for p in hyper]
    chunk = lay["chunk"] if save else 0
    outputs, finals, buffers = module.torch_forward(xs, vs, ws, hyper, state_seqs or bool(chunk), save and not chunk, dtype)
    if chunk:  # checkpoints: the states before steps chunk, 2 chunk, ... (in the compute dtype)
        rows_kept = n_checkpoints(n_steps, chunk)
        # Copies: an op's outputs may not alias each other.
        buffers = [f[chunk - 1::chunk][:rows_kept].reshape(rows_kept, *step_shape).clone() for f in finals]
        finals = finals if state_seqs else [f[-1].clone() for f in finals]
    final_shape = shape if state_seqs else step_shape
    return (
        [o.to(dtype).view(shape) for o in outputs]
        + [f.to(dtype).view(final_shape) for f in finals]
        + (buffers if chunk else [b.to(dtype).view(shape) for b in buffers])
    )


def torch_backward(module, lay, saved, grad_outputs, grad_states, ws, hyper, state_seqs, grad_init, launch, shape, n_elem):
    n_steps, step_shape = shape[0], shape[1:]
    dtype = grad_outputs[0].dtype
    compute = compute_dtype(dtype)
    device = grad_outputs[0].device
    if lay["chunk"]:  # inputs, initial states, checkpoints
        n_in, n_states = len(lay["inputs"]), len(lay["states"])
        saved = (
            [rows(t, n_steps, n_elem).to(compute) for t in saved[:n_in]]
            + [flat(t, n_elem).to(compute) for t in saved[n_in:n_in + n_states]]
            + [t.reshape(-1, n_elem).to(compute) for t in saved[n_in + n_states:]]
        )
    else:
        saved = [rows(t, n_steps, n_elem).to(compute) for t in saved]
    grad_outputs = [rows(g, n_steps, n_elem).to(compute) for g in grad_outputs]
    grad_states = [(rows(g, n_steps, n_elem) if state_seqs else flat(g, n_elem)).to(compute) for g in grad_states]
    hyper = [torch.tensor(p, dtype=compute, device=device) for p in hyper]
    params = [per_neuron(w, step_shape).to(compute) for w in ws]
    if lay["chunk"]:
        results = _torch_backward_by_chunks(module, lay, saved, grad_outputs, grad_states, params, hyper, state_seqs)
    else:
        results = module.torch_backward(saved, grad_outputs, grad_states, params, hyper, state_seqs)
    grad_inputs, grad_init, grad_learnable = results
    return (
        [g.to(dtype).view(shape) for g in grad_inputs]
        + [g.to(dtype).view(step_shape) for g in grad_init]
        + [reduce_to_param(g, w, step_shape).to(w.dtype) for g, w in zip(grad_learnable, ws)]
    )


def _torch_backward_by_chunks(module, lay, saved, grad_outputs, grad_states, params, hyper, state_seqs):
    """The recompute backward in torch ops: chunks last to first, each re-run forward from its checkpoint.

    Runs the generated torch code on each chunk: its forward saves what the plain backward reads, its
    backward (with per-step state gradients) takes the gradient carried in from the chunk after it.
    """
    n_in, n_states, chunk = len(lay["inputs"]), len(lay["states"]), lay["chunk"]
    xs, starts, checkpoints = saved[:n_in], saved[n_in:n_in + n_states], saved[n_in + n_states:]
    n_steps = grad_outputs[0].shape[0]
    like = grad_outputs[0][0]
    carried = [torch.zeros_like(like) if state_seqs else g for g in grad_states]
    grad_chunks, grad_learnable = [], [torch.zeros_like(like) for _ in params]
    for first in reversed(range(0, n_steps, chunk)):
        last = min(first + chunk, n_steps)
        states = starts if first == 0 else [c[first // chunk - 1] for c in checkpoints]
        chunk_xs = [x[first:last] for x in xs]
        outputs, _, buffers = module.torch_forward(chunk_xs, states, params, hyper, False, True, like.dtype)
        step_saved, buffers = [], iter(buffers)
        for entry in lay["step_saved"]:
            kind, index = entry["kind"], entry.get("index")
            step_saved.append(chunk_xs[index] if kind == "input" else outputs[index] if kind == "output" else next(buffers))
        state_grads = []
        for g, c in zip(grad_states, carried):
            per_step = g[first:last].clone() if state_seqs else torch.zeros((last - first, *like.shape), dtype=like.dtype, device=like.device)
            per_step[-1] += c  # what the later chunks carried back into this chunk's last step
            state_grads.append(per_step)
        chunk_outputs = [g[first:last] for g in grad_outputs]
        grads, carried, learnable = module.torch_backward(step_saved, chunk_outputs, state_grads, params, hyper, True)
        grad_chunks.append(grads)
        grad_learnable = [a + b for a, b in zip(grad_learnable, learnable)]
    grad_inputs = [torch.cat([grads[i] for grads in reversed(grad_chunks)]) for i in range(n_in)]
    return grad_inputs, carried, grad_learnable


class NeuronOps:
    """The forward and backward custom ops of one generated neuron module.

    `call` is the entry point: inside `torch.compile` it calls the registered
    `triton_op`s (which the compiler traces into); in eager mode it runs the
    same implementations through a plain autograd.Function, which skips the
    dispatcher's per-call overhead and keeps torch._dynamo from being imported.
    """

    def __init__(self, module, lay, key):
        self.module, self.lay = module, lay
        self.n_visible = len(lay["outputs"]) + len(lay["states"])  # outputs the caller sees: not the buffers
        prefix = f"flexgen::{lay['neuron']}_{key[:12]}" + ("_recompute" if lay["chunk"] else "")
        # Eager calls launch the kernels directly; the ops go through wrap_triton so the compiler can trace them.
        self.forward_impl, self.backward_impl = self._forward_impl(_direct), self._backward_impl(_direct)
        self.forward = triton_op(prefix + "_forward", mutates_args=())(_skip_kernel_scan(self._forward_impl(wrap_triton)))
        self.backward = triton_op(prefix + "_backward", mutates_args=())(_skip_kernel_scan(self._backward_impl(wrap_triton)))
        self.forward.register_autograd(self._backward_formula, setup_context=self._setup_context)
        self._plans = {}

    def call(self, inputs, states, learnable, hyper, state_seqs, save, use_triton):
        if torch.compiler.is_compiling():
            return self.forward(inputs, states, learnable, hyper, state_seqs, save, use_triton)
        transforms = torch._C._are_functorch_transforms_active()  # wrapped tensors: unwrapped by the Function
        plan = self.plan(inputs, states, learnable, hyper, state_seqs, save) if use_triton and not transforms else None
        if plan is not None:
            return plan(inputs, states, learnable)
        config = (self, hyper, state_seqs, use_triton, len(inputs), len(states), save)
        with on_device_of(inputs[0].device) if use_triton else contextlib.nullcontext():
            if transforms:
                return list(_TransformableFunction.apply(config, *inputs, *states, *learnable))
            if not save:
                return self.forward_impl(inputs, states, learnable, hyper, state_seqs, save, use_triton)
            return list(_EagerFunction.apply(config, *inputs, *states, *learnable))

    def plan(self, inputs, states, learnable, hyper, state_seqs, save):
        """The `EagerPlan` for this call's signature; None when the call takes the general path."""
        tensors = (*inputs, *states, *learnable)
        key = (state_seqs, save, *hyper, *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
        plan = self._plans.get(key)
        if plan is None:
            if inputs[0].shape[0] == 0 or inputs[0].numel() == 0:
                return None
            if len(self._plans) >= MAX_PLANS:  # shapes that keep changing: start over rather than grow
                self._plans.clear()
            plan = self._plans[key] = EagerPlan(self, inputs, states, learnable, hyper, state_seqs, save)
        return plan if plan.reusable else None

    def _forward_impl(self, launch):
        module, lay = self.module, self.lay

        def forward(
            inputs: List[torch.Tensor],
            states: List[torch.Tensor],
            learnable: List[torch.Tensor],
            hyper: List[float],
            state_seqs: bool,
            save: bool,
            use_triton: bool,
        ) -> List[torch.Tensor]:
            shape = tuple(inputs[0].shape)
            n_elem = _numel(shape[1:])
            if shape[0] == 0 or n_elem == 0:
                return _empty_forward(lay, inputs, states, state_seqs, save)
            run = triton_forward if use_triton else torch_forward
            return run(module, lay, inputs, states, learnable, hyper, state_seqs, save, launch, shape, n_elem)

        return forward

    def _backward_impl(self, launch):
        module, lay = self.module, self.lay

        def backward(
            saved: List[torch.Tensor],
            grad_outputs: List[torch.Tensor],
            grad_states: List[torch.Tensor],
            learnable: List[torch.Tensor],
            hyper: List[float],
            state_seqs: bool,
            use_triton: bool,
            grad_init: bool,
        ) -> List[torch.Tensor]:
            shape = tuple(grad_outputs[0].shape)
            run = triton_backward if use_triton else torch_backward
            return run(module, lay, saved, grad_outputs, grad_states, learnable, hyper, state_seqs, grad_init, launch,
                       shape, _numel(shape[1:]))

        return backward

    def _setup_context(self, ctx, inputs, output):
        xs, states, learnable, hyper, state_seqs, save, use_triton = inputs
        lay = self.lay
        n_out, n_states = len(lay["outputs"]), len(lay["states"])
        buffers = iter(output[n_out + n_states:])
        saved = []
        for entry in lay["saved"]:
            if entry["kind"] == "input":
                saved.append(xs[entry["index"]])
            elif entry["kind"] == "state":
                saved.append(states[entry["index"]])
            elif entry["kind"] == "output":
                saved.append(output[entry["index"]])
            else:
                saved.append(next(buffers))
        # Buffers may be neither inputs nor outputs (eager calls do not return them): autograd saves
        # such intermediates too, and frees them after the backward like the rest.
        ctx.save_for_backward(*saved, *learnable)
        ctx.n_saved = len(saved)
        ctx.hyper, ctx.state_seqs, ctx.use_triton = hyper, state_seqs, use_triton
        ctx.shape, ctx.dtype, ctx.device = xs[0].shape, xs[0].dtype, xs[0].device
        ctx.state_dtypes = [v.dtype for v in states]

    def _backward_formula(self, ctx, grads, backward=None, zero=None, grad_init=True):
        """Gradients for the op's inputs; a None incoming gradient reads as a stride-0 `zero(dtype, device)`.

        Without `grad_init` the initial states' gradients are not computed (None).
        """
        lay = self.lay
        n_out, n_states, n_in = len(lay["outputs"]), len(lay["states"]), len(lay["inputs"])
        tensors = ctx.saved_tensors
        saved, learnable = list(tensors[: ctx.n_saved]), list(tensors[ctx.n_saved:])
        shape = ctx.shape
        state_shape = shape if ctx.state_seqs else shape[1:]
        zero = zero or _fresh_zero
        # Missing gradients read as zeros with stride 0; the outputs' keep their shape (the backward's
        # shape comes from them), the states' stay 0-d (see _neuron_stride): one expand less per call.
        grad_outputs = [g if g is not None else zero(ctx.dtype, ctx.device).expand(shape) for g in grads[:n_out]]
        grad_states = [
            g if g is not None else zero(dt, ctx.device)
            for g, dt in zip(grads[n_out:n_out + n_states], ctx.state_dtypes)
        ]
        if shape[0] == 0 or _numel(shape[1:]) == 0:
            grad_inputs = [torch.zeros(shape, dtype=ctx.dtype, device=ctx.device) for _ in range(n_in)]
            grad_init = [
                g.expand(shape[1:]) if not ctx.state_seqs else torch.zeros(shape[1:], dtype=g.dtype, device=ctx.device)
                for g in grad_states
            ]
            no_hyper = None if ctx.hyper else []  # autograd wants an empty list back for an empty list input
            return grad_inputs, grad_init, [torch.zeros_like(w) for w in learnable], no_hyper, None, None, None
        backward = backward or self.backward
        result = backward(saved, grad_outputs, grad_states, learnable, ctx.hyper, ctx.state_seqs, ctx.use_triton, grad_init)
        no_hyper = None if ctx.hyper else []  # autograd wants an empty list back for an empty list input
        return result[:n_in], result[n_in:n_in + n_states], result[n_in + n_states:], no_hyper, None, None, None


def _eager_forward(config, tensors):
    ops, hyper, state_seqs, use_triton, n_inputs, n_states, save = config
    inputs = list(tensors[:n_inputs])
    states = list(tensors[n_inputs:n_inputs + n_states])
    learnable = list(tensors[n_inputs + n_states:])
    return tuple(ops.forward_impl(inputs, states, learnable, hyper, state_seqs, save, use_triton))


def _eager_setup_context(ctx, config, tensors, output, buffers_returned=True):
    ops, hyper, state_seqs, use_triton, n_inputs, n_states, save = config
    if not save:  # no gradient wanted (a torch.func transform without grad)
        return
    xs, states, learnable = tensors[:n_inputs], tensors[n_inputs:n_inputs + n_states], tensors[n_inputs + n_states:]
    ops._setup_context(ctx, (xs, states, learnable, hyper, state_seqs, True, use_triton), output)
    ctx.ops = ops
    if buffers_returned:
        ctx.mark_non_differentiable(*output[len(ops.lay["outputs"]) + n_states:])
    # Unused outputs (often the final states) would otherwise get full-size zero gradients
    # written to memory; the backward reads a stride-0 zero instead.
    ctx.set_materialize_grads(False)


def _eager_backward(ctx, grads, backward):
    ops = ctx.ops
    n_in, n_states = len(ops.lay["inputs"]), len(ops.lay["states"])
    grad_init = any(ctx.needs_input_grad[1 + n_in:1 + n_in + n_states])
    grad_inputs, grad_states, grad_learnable, *_ = ops._backward_formula(ctx, grads, backward, cached_zero, grad_init)
    return (None, *grad_inputs, *grad_states, *grad_learnable)


class _EagerFunction(torch.autograd.Function):
    """Eager-mode autograd around the same forward/backward implementations as the custom ops.

    Old-style (forward takes ctx): Function.apply of a setup_context-style
    Function inspects the forward's signature on every call, tens of
    microseconds; `_TransformableFunction` is its twin for torch.func.
    """

    @staticmethod
    def forward(ctx, config, *tensors):
        output = _eager_forward(config, tensors)
        _eager_setup_context(ctx, config, tensors, output, buffers_returned=False)
        return output[:config[0].n_visible]  # fewer outputs for autograd to wrap

    @staticmethod
    def backward(ctx, *grads):
        return _eager_backward(ctx, grads, ctx.ops.backward_impl)


class _PlannedFunction(torch.autograd.Function):
    """Eager autograd for calls that have an `EagerPlan` (Triton kernels, no transforms): the common case."""

    @staticmethod
    def forward(ctx, plan, *tensors):
        n_in, n_states = plan.n_inputs, plan.n_states
        inputs, states, learnable = tensors[:n_in], tensors[n_in:n_in + n_states], tensors[n_in + n_states:]
        outputs, finals, buffers = plan.forward(inputs, states, learnable)
        ctx.save_for_backward(*plan.saved(inputs, states, outputs, buffers), *learnable)
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # unused outputs (often the final states) are read as a stride-0 zero
        return (*outputs, *finals)

    @staticmethod
    def backward(ctx, *grads):
        plan = ctx.plan
        tensors = ctx.saved_tensors
        first_state = 1 + plan.n_inputs
        grad_init = any(ctx.needs_input_grad[first_state:first_state + plan.n_states])
        return (None, *plan.backward(tensors[:plan.n_saved], tensors[plan.n_saved:], grads, grad_init))


class _TransformableFunction(torch.autograd.Function):
    """`_EagerFunction` in the setup_context style with a vmap rule: used while torch.func transforms run."""

    @staticmethod
    def forward(config, *tensors):
        return _eager_forward(config, tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _eager_setup_context(ctx, inputs[0], inputs[1:], output)

    @staticmethod
    def backward(ctx, *grads):
        # Under torch.func the incoming tensors are wrapped (grad levels, batches); the kernels need plain
        # tensors, which the backward gets as an autograd.Function of its own.
        transforms = torch._C._are_functorch_transforms_active()
        return _eager_backward(ctx, grads, _transformable_backward(ctx.ops) if transforms else ctx.ops.backward_impl)

    @staticmethod
    def vmap(info, in_dims, config, *tensors):
        n_inputs, n_states = config[4], config[5]
        n_neuron_tensors = n_inputs + n_states
        if any(d is not None for d in in_dims[1 + n_neuron_tensors:]):  # per-sample learnable parameters
            return _vmap_by_loop(_TransformableFunction, info, in_dims, config, tensors)
        moved = _batch_as_last_neuron_dim(info, in_dims[1:1 + n_neuron_tensors], tensors[:n_neuron_tensors])
        learnable = _with_batch_dim(tensors[n_neuron_tensors:], moved[0].shape[1:-1])
        result = _TransformableFunction.apply(config, *moved, *learnable)
        return result, tuple(r.dim() - 1 for r in result)


class _EagerBackward(torch.autograd.Function):
    """The backward kernels as a function of their tensors, used only under torch.func transforms.

    torch.func unwraps the tensors for `forward` (plain tensors for the kernels)
    and batches through `vmap`. Differentiable once: no double backward.
    """

    @staticmethod
    def forward(config, *tensors):
        ops, hyper, state_seqs, use_triton, grad_init, counts = config
        saved, grad_outputs, grad_states, learnable = _split(tensors, counts)
        result = ops.backward_impl(saved, grad_outputs, grad_states, learnable, hyper, state_seqs, use_triton, grad_init)
        return tuple(result)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("flexgen neurons are differentiable once: a gradient of their gradient is not supported")

    @staticmethod
    def vmap(info, in_dims, config, *tensors):
        counts = config[-1]
        n_learnable = counts[-1]
        if n_learnable:  # per-sample parameter gradients: the kernels would sum them over the batch
            return _vmap_by_loop(_EagerBackward, info, in_dims, config, tensors)
        result = _EagerBackward.apply(config, *_batch_as_last_neuron_dim(info, in_dims[1:], tensors))
        return result, tuple(None if r is None else r.dim() - 1 for r in result)


def _transformable_backward(ops):
    """`ops.backward_impl`'s signature, running through `_EagerBackward`."""
    def backward(saved, grad_outputs, grad_states, learnable, hyper, state_seqs, use_triton, grad_init):
        counts = (len(saved), len(grad_outputs), len(grad_states), len(learnable))
        config = (ops, hyper, state_seqs, use_triton, grad_init, counts)
        return list(_EagerBackward.apply(config, *saved, *grad_outputs, *grad_states, *learnable))

    return backward


def _split(items, counts):
    parts, start = [], 0
    for n in counts:
        parts.append(list(items[start:start + n]))
        start += n
    return parts


def _batch_as_last_neuron_dim(info, in_dims, tensors):
    """Neurons are independent, so a vmapped dim can be one more neuron dim: moved last, or added.

    Last keeps the channel (dim 2 of [T, B, C, ...]) where per-channel parameters expect it.
    A 0-d tensor (a constant state, a zero gradient) already reads the same everywhere.
    """
    moved = []
    for t, d in zip(tensors, in_dims):
        if d is not None:
            moved.append(t.movedim(d, -1))
        elif t.dim() == 0:
            moved.append(t)
        else:
            moved.append(t.unsqueeze(-1).expand(*t.shape, info.batch_size))
    return moved


def _with_batch_dim(learnable, step_shape):
    """Learnable parameters broadcasting against a step (not scalar, not per channel) with a trailing dim of
    size 1, so they broadcast against the step with the vmapped dim added last."""
    return [w.unsqueeze(-1) if broadcasts_per_neuron(w, step_shape) else w for w in learnable]


def _vmap_by_loop(function, info, in_dims, config, tensors):
    """One call per batch entry, results stacked along dim 0 (per-sample learnable parameters)."""
    results = []
    for i in range(info.batch_size):
        args = [t if d is None else t.select(d, i) for t, d in zip(tensors, in_dims[1:])]
        results.append(function.apply(config, *args))
    stacked = tuple(None if parts[0] is None else torch.stack(parts) for parts in zip(*results))
    return stacked, tuple(None if r is None else 0 for r in stacked)


def _fresh_zero(dtype, device):
    return torch.zeros((), dtype=dtype, device=device)


_SCALARS = {}


def cached_scalar(value, dtype, device):
    """A 0-d tensor holding `value`, made once per value, dtype and device, for eager calls.

    Expanded, it serves as a zero gradient or a constant initial state without
    a fill launch per call. Nothing writes into it (kernels only read states and
    gradients). Made fresh, never cached, while anything traces or transforms
    (torch.compile, export, fake tensors, torch.func: the tensor would be theirs)
    or a CUDA graph is captured (a tensor made then is only written at replay).
    """
    if tracing_or_transforming():
        return torch.full((), value, dtype=dtype, device=device)
    key = (value, dtype, device)
    t = _SCALARS.get(key)
    if t is None:
        t = torch.full((), value, dtype=dtype, device=device)
        if type(t) is torch.Tensor and (device.type != "cuda" or not torch.cuda.is_current_stream_capturing()):
            _SCALARS[key] = t
    return t


def tracing_or_transforming():
    """Whether tensors made now may belong to a tracer or transform rather than to this process's eager calls."""
    return (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or _get_current_dispatch_mode() is not None
    )


def cached_zero(dtype, device):
    return cached_scalar(0.0, dtype, device)


def _numel(shape):
    return math.prod(shape)


def _empty_forward(lay, inputs, states, state_seqs, save):
    """T = 0 or no neurons: empty outputs; states pass through unchanged."""
    shape = inputs[0].shape
    like = inputs[0]
    outputs = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in lay["outputs"]]
    finals = [torch.empty(shape, dtype=v.dtype, device=v.device) if state_seqs else v.expand(shape[1:]).clone() for v in states]
    buffers = _allocate_buffers(lay, shape, like.dtype, like.device) if save else []
    return outputs + finals + buffers
