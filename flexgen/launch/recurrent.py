"""A recurrent layer's fused kernels: launching them, and their autograd.

The forward kernel runs the whole sequence in one launch, one program per tile of batch rows, with the recurrent
product `s_{t-1} W^T` of every step inside its time loop (`tl.dot`). The backward kernel walks time in reverse and
adds `grad_I_{t+1} W` to the gradient of the output fed back; it stores every step's `grad_I_t` (the gradient of
the input, which it returns anyway), so the weight's gradient, `sum_t grad_I_t^T s_{t-1}`, is one matrix product
on the host over all steps and rows: no [T, H, H] intermediate, no partial sums per program, and exact in fp64.
"""
from typing import List, NamedTuple, Optional

import torch

from ..layout import Kind, pick_saved, recurrent_backward_arguments, recurrent_forward_arguments
from . import allocate
from .abi import kernel_args, reduce_to_param
from .autograd import differentiable_once, saved_tensors
from .config import HALF_DTYPES
from .scalars import cached_zero
from .triton_path import on_device_of


DEFAULT_MAX_HIDDEN = {"16-bit": 1024, "other": 512}


class RecurrentConfig(NamedTuple):
    """How the fused recurrent kernels are launched.

    `block_b`: batch rows per program (16, the smallest tile `tl.dot` takes on GPUs, leaves the most programs);
    `block_k`: hidden neurons per slice of the recurrent product (the weight's slice, `block_k` x H, goes through
    shared memory); `max_hidden`: the largest layer that runs fused, None for `DEFAULT_MAX_HIDDEN` by I/O dtype:
    every program keeps each state and value of its rows, `block_b` x H, in registers (at H = 1024 on an H100
    the fused bf16 layer took 0.12x to 0.29x the step-wise path's time in the recorded grid; fp32 keeps 512, its
    unrecorded H = 1024 trial having been slower than stepping at T = 100); `num_warps`: None for about 16 values
    of such a tile per thread (4 to 16 warps). Not tuned on a GPU yet: `benchmarks/bench_recurrent.py` takes them
    as options.
    """

    block_b: int = 16
    block_k: int = 32
    num_warps: Optional[int] = None
    num_stages: int = 2
    max_hidden: Optional[int] = None

    def hidden_limit(self, dtype):
        """The largest layer that runs fused in this I/O dtype."""
        if self.max_hidden is not None:
            return self.max_hidden
        return DEFAULT_MAX_HIDDEN["16-bit" if dtype in HALF_DTYPES else "other"]

    def block(self, hidden):
        """The hidden neurons padded to a power of two (at least 16, for `tl.dot`)."""
        return max(16, 1 << (hidden - 1).bit_length())

    def warps(self, hidden):
        if self.num_warps is not None:
            return self.num_warps
        return max(4, min(16, self.block_b * self.block(hidden) // (32 * 16)))

    def constexprs(self, hidden):
        block = self.block(hidden)
        return {"BLOCK_B": self.block_b, "BLOCK": block, "BLOCK_K": min(self.block_k, block)}

    def grid(self, batch):
        return (-(-batch // self.block_b),)


DEFAULT_RECURRENT = RecurrentConfig()


def dot_precision(dtype):
    """The recurrent product's `input_precision`. Operands are in the I/O dtype: fp16 and bf16 go to the tensor
    cores as they are (exact for spikes); fp32 takes 3xTF32 (about fp32's accuracy on tensor cores), or TF32 where
    torch allows it for its own matmuls; fp64 is exact."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"
    return "ieee"


class RecurrentCall(NamedTuple):
    """A fused recurrent forward over [T, B, H] inputs; `weight` (the effective [H, H] weight) and `bias` ([H], or
    a 0-d zero) are in the inputs' dtype."""

    inputs: List
    states: List
    learnable: List
    hyper: List[float]
    weight: torch.Tensor
    bias: torch.Tensor
    save: bool

    @property
    def shape(self):
        return tuple(self.inputs[0].shape)


def fused_forward(compiled, call, config=DEFAULT_RECURRENT):
    """Launch the recurrent forward (training, or inference without `save`); (outputs, finals, buffers)."""
    layout = compiled.layout.layout
    shape, first = call.shape, call.inputs[0]
    n_steps, batch, hidden = shape
    fresh = allocate.forward_results(layout, shape, first.dtype, first.device, [v.dtype for v in call.states],
                                     False, call.save)
    outputs, finals, buffers = fresh
    groups = (call.inputs, call.states, call.learnable, outputs, finals, buffers, call.hyper, (call.weight, call.bias))
    args = kernel_args(recurrent_forward_arguments(compiled.layout, call.save), groups, shape[1:],
                       dtype=first.dtype, device=first.device)
    with on_device_of(first.device):
        compiled.kernel("forward" if call.save else "inference")[config.grid(batch)](
            *args, n_steps, batch, hidden, F64=first.dtype == torch.float64, HALF_IO=first.dtype in HALF_DTYPES,
            DOT_PRECISION=dot_precision(first.dtype), **config.constexprs(hidden),
            num_warps=config.warps(hidden), num_stages=config.num_stages,
        )
    return outputs, finals, buffers


class RecurrentBackwardCall(NamedTuple):
    saved: List
    fed_back: torch.Tensor  # the output fed back, [T, B, H]
    grad_outputs: List
    grad_states: List
    learnable: List
    hyper: List[float]
    weight: torch.Tensor
    grad_init: bool

    @property
    def shape(self):
        return tuple(self.grad_outputs[0].shape)


def fused_backward(compiled, call, config=DEFAULT_RECURRENT):
    """Launch the recurrent backward; (input gradients, initial states' gradients or None, learnable parameters'
    gradients). The gradient of the input the product is added to is also the recurrent current's."""
    recurrent = compiled.layout
    layout, shape, like = recurrent.layout, call.shape, call.grad_outputs[0]
    n_steps, batch, hidden = shape
    fresh = allocate.backward_results(layout, shape, like.dtype, like.device, [g.dtype for g in call.grad_states],
                                      len(call.learnable), call.grad_init)
    grad_inputs, grad_prev, partials = fresh
    slots = grad_prev if grad_prev is not None else [grad_inputs[0]] * len(call.grad_states)  # unused without GRAD_INIT
    groups = (call.saved, call.grad_outputs, call.grad_states, call.learnable, grad_inputs, slots, partials,
              call.hyper, (call.weight,))
    args = kernel_args(recurrent_backward_arguments(recurrent), groups, shape[1:], dtype=like.dtype, device=like.device)
    with on_device_of(like.device):
        compiled.kernel("backward")[config.grid(batch)](
            *args, n_steps, batch, hidden, GRAD_INIT=call.grad_init, F64=like.dtype == torch.float64,
            DOT_PRECISION=dot_precision(like.dtype), **config.constexprs(hidden),
            num_warps=config.warps(hidden), num_stages=config.num_stages,
        )
    grad_learnable = [reduce_to_param(p, w, shape[1:]).to(w.dtype) for p, w in zip(partials, call.learnable)]
    return grad_inputs, grad_prev, grad_learnable


def weight_gradient(grad_current, fed_back):
    """dL/dW[j, k] = sum over steps t >= 1 and rows b of grad_I[t, b, j] * s[t - 1, b, k]: one matrix product."""
    hidden = fed_back.shape[-1]
    return grad_current[1:].reshape(-1, hidden).t() @ fed_back[:-1].reshape(-1, hidden)


class FusedRun(NamedTuple):
    """The non-tensor arguments of a fused recurrent call, and how many tensors of each group it has."""

    compiled: object
    hyper: List[float]
    n_inputs: int
    n_states: int
    n_learnable: int
    config: RecurrentConfig

    def split(self, tensors):
        """(inputs, states, learnable, weight, bias) of a call's flat tensors."""
        a, b = self.n_inputs, self.n_inputs + self.n_states
        c = b + self.n_learnable
        return list(tensors[:a]), list(tensors[a:b]), list(tensors[b:c]), tensors[c], tensors[c + 1]


class FusedRecurrentFunction(torch.autograd.Function):
    """Autograd around the fused kernels: inputs, states, learnable parameters, weight and bias in; the outputs and
    the final states out."""

    @staticmethod
    def forward(ctx, run, *tensors):
        inputs, states, learnable, weight, bias = run.split(tensors)
        call = RecurrentCall(inputs, states, learnable, run.hyper, weight, bias, save=True)
        outputs, finals, buffers = fused_forward(run.compiled, call, run.config)
        ctx.save_for_backward(*_saved_values(run.compiled.layout, inputs, outputs, buffers),
                              outputs[run.compiled.layout.output_index], *learnable, weight)
        ctx.run, ctx.state_dtypes = run, [v.dtype for v in states]
        ctx.set_materialize_grads(False)  # unused outputs (often the final states) are read as a stride-0 zero
        return (*outputs, *finals)

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        run = ctx.run
        layout = run.compiled.layout.layout
        n_out = len(layout.outputs)
        tensors = saved_tensors(ctx)
        n_saved = len(layout.saved)
        saved, fed_back = list(tensors[:n_saved]), tensors[n_saved]
        learnable, weight = list(tensors[n_saved + 1:-1]), tensors[-1]
        zero = cached_zero(fed_back.dtype, fed_back.device)
        grad_outputs = [g if g is not None else zero.expand(fed_back.shape) for g in grads[:n_out]]
        grad_states = [g if g is not None else cached_zero(dt, fed_back.device)
                       for g, dt in zip(grads[n_out:], ctx.state_dtypes)]
        first_state = 1 + run.n_inputs
        grad_init = any(ctx.needs_input_grad[first_state:first_state + run.n_states])
        call = RecurrentBackwardCall(saved, fed_back, grad_outputs, grad_states, learnable, run.hyper, weight, grad_init)
        grad_inputs, grad_prev, grad_learnable = fused_backward(run.compiled, call, run.config)
        grad_current = grad_inputs[run.compiled.layout.input_index]
        grad_weight = weight_gradient(grad_current, fed_back) if ctx.needs_input_grad[-2] else None
        grad_bias = grad_current.sum(dim=(0, 1)) if ctx.needs_input_grad[-1] else None
        return (None, *grad_inputs, *(grad_prev or [None] * run.n_states), *grad_learnable, grad_weight, grad_bias)


def _saved_values(layout, inputs, outputs, buffers):
    """The tensors the backward kernel reads, in the layout's order."""
    return pick_saved(layout.layout.saved, {Kind.INPUT: inputs, Kind.OUTPUT: outputs}, buffers)


def run_fused(compiled, inputs, states, learnable, hyper, weight, bias, save, config=DEFAULT_RECURRENT):
    """(outputs, final states) of the fused kernels; with `save`, differentiable through `FusedRecurrentFunction`.
    `bias` may be None."""
    first = inputs[0]
    bias = bias if bias is not None else cached_zero(first.dtype, first.device)
    if not save:
        call = RecurrentCall(inputs, states, learnable, hyper, weight, bias, save=False)
        outputs, finals, _ = fused_forward(compiled, call, config)
        return outputs, finals
    run = FusedRun(compiled, hyper, len(inputs), len(states), len(learnable), config)
    result = FusedRecurrentFunction.apply(run, *inputs, *states, *learnable, weight, bias)
    n_out = len(compiled.layout.layout.outputs)
    return list(result[:n_out]), list(result[n_out:])
