"""What `flexgen.DelayedLinear`'s two Triton backends share: the eager autograd function, and the custom ops that
torch.compile traces (fullgraph included) in its place.

A backend is three computations over x [T, B, in], the weight and the delays [out, in] (`DelayBackend`): the
forward, the input's gradient, and the weight's and delays' gradients; the bias's gradient is a torch sum.
`TapOptions` carries what selects the taps. Eager calls run the computations inside `DelayFunction` (no
dispatcher on the way); under torch.compile each becomes a `triton_op` launching its kernels through
`wrap_triton`, with the forward op's autograd formula calling the two gradient ops.
"""
from typing import Callable, List, NamedTuple, Optional

import torch
from torch.library import wrap_triton

from ..abi import summed_over_steps_and_rows
from ..autograd import DELAYED_SECOND_ORDER, refusal
from ..neuron.ops import _custom_op, _no_context

__all__ = ["TapOptions", "DelayBackend", "DelayFunction", "register_ops", "run"]


class TapOptions(NamedTuple):
    """K = max_delay, and Gaussian taps of width sigma (else linear)."""

    max_delay: int
    gaussian: bool = False
    sigma: float = 1.0


class DelayBackend(NamedTuple):
    """A backend's computations, each `(..., options, config, wrap)`; `wrap` is None for eager launches, else
    torch's `wrap_triton` (inside a custom op). `name` names its custom ops (flexgen::delayed_linear_<name>_...),
    `function` is its `DelayFunction` (a subclass, so that autograd graphs name the backend) and `default` the
    config the custom ops run with."""

    name: str
    function: type
    forward: Callable  # (x, weight, delay, bias, options, config, wrap) -> y [T, B, out]
    grad_input: Callable  # (grad, x, weight, delay, options, config, wrap) -> grad x
    grad_params: Callable  # (grad, x, weight, delay, options, config, wrap) -> (grad weight, grad delay)
    default: object


def _gradients(grad, x, weight, delay, bias_dtype, needs, grad_input, grad_params):
    """(grad x, grad weight, grad delay, grad bias), None where not needed; `needs` as ctx.needs_input_grad."""
    grad = grad.contiguous()
    need_x, need_weight, need_delay, need_bias = needs[:4]
    grad_x = grad_input(grad, x, weight, delay) if need_x else None
    grad_weight = grad_delay = grad_bias = None
    if need_weight or need_delay:
        grad_weight, grad_delay = grad_params(grad, x, weight, delay)
    if bias_dtype is not None and need_bias:
        grad_bias = summed_over_steps_and_rows(grad, bias_dtype)
    return grad_x, grad_weight if need_weight else None, grad_delay if need_delay else None, grad_bias


class DelayFunction(torch.autograd.Function):
    """A backend's eager forward and backward; saves x, the weight and the delays (nothing [T, ...] of its own).
    Each backend names a subclass of its own."""

    @staticmethod
    def forward(ctx, x, weight, delay, bias, backend, options, config):
        ctx.save_for_backward(x, weight, delay)
        ctx.backend, ctx.options, ctx.config = backend, options, config
        ctx.bias_dtype = None if bias is None else bias.dtype
        return backend.forward(x, weight, delay, bias, options, config, None)

    @staticmethod
    @refusal(DELAYED_SECOND_ORDER)
    def backward(ctx, grad):
        x, weight, delay = ctx.saved_tensors
        backend, options, config = ctx.backend, ctx.options, ctx.config
        grads = _gradients(
            grad, x, weight, delay, ctx.bias_dtype, ctx.needs_input_grad,
            lambda *a: backend.grad_input(*a, options, config, None),
            lambda *a: backend.grad_params(*a, options, config, None))
        return (*grads, None, None, None)


class _Ops(NamedTuple):
    forward: object
    grad_input: object
    grad_params: object


def register_ops(backend):
    """The backend's three computations as custom ops (`triton_op`s where Triton runs), the forward's autograd
    formula calling the other two."""
    prefix = f"flexgen::delayed_linear_{backend.name}"

    def forward(x: torch.Tensor, weight: torch.Tensor, delay: torch.Tensor, bias: Optional[torch.Tensor],
                max_delay: int, gaussian: bool, sigma: float) -> torch.Tensor:
        options = TapOptions(max_delay, gaussian, sigma)
        return backend.forward(x.contiguous(), weight, delay, bias, options, backend.default, wrap_triton)

    def grad_input(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, delay: torch.Tensor, max_delay: int,
                   gaussian: bool, sigma: float) -> torch.Tensor:
        options = TapOptions(max_delay, gaussian, sigma)
        return backend.grad_input(grad.contiguous(), x.contiguous(), weight, delay, options, backend.default,
                                  wrap_triton)

    def grad_params(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, delay: torch.Tensor, max_delay: int,
                    gaussian: bool, sigma: float) -> List[torch.Tensor]:
        options = TapOptions(max_delay, gaussian, sigma)
        return list(backend.grad_params(grad.contiguous(), x.contiguous(), weight, delay, options,
                                        backend.default, wrap_triton))

    ops = _Ops(_custom_op(prefix + "_forward", forward), _custom_op(prefix + "_grad_input", grad_input),
               _custom_op(prefix + "_grad_params", grad_params))

    def setup_context(ctx, inputs, output):
        x, weight, delay, bias, max_delay, gaussian, sigma = inputs
        ctx.save_for_backward(x, weight, delay)
        ctx.options = (max_delay, gaussian, sigma)
        ctx.bias_dtype = None if bias is None else bias.dtype

    def formula(ctx, grad):
        x, weight, delay = ctx.saved_tensors
        grads = _gradients(grad, x, weight, delay, ctx.bias_dtype, ctx.needs_input_grad,
                           lambda *a: ops.grad_input(*a, *ctx.options),
                           lambda *a: ops.grad_params(*a, *ctx.options))
        return (*grads, None, None, None)

    def refuse_second_order(ctx, grads):
        raise RuntimeError(DELAYED_SECOND_ORDER)

    ops.forward.register_autograd(formula, setup_context=setup_context)
    ops.grad_input.register_autograd(refuse_second_order, setup_context=_no_context)
    ops.grad_params.register_autograd(refuse_second_order, setup_context=_no_context)
    return ops


def run(backend, ops, x, weight, delay, bias, options, config):
    """y of a backend: its custom op under torch.compile (with the default config), else its `DelayFunction`."""
    if torch.compiler.is_compiling():
        return ops.forward(x, weight, delay, bias, options.max_delay, options.gaussian, options.sigma)
    return backend.function.apply(x.contiguous(), weight, delay, bias, backend, options, config)
