"""The math namespace a step function is written in.

Every function here accepts traced values (while flexgen derives kernels),
plain sympy expressions, torch tensors (the eager backend and oracle) and
Python numbers, so one step function serves all of them.

>>> import torch, flexgen
>>> flexgen.exp(torch.zeros(2))
tensor([1., 1.])
>>> import sympy
>>> flexgen.sigmoid(sympy.Symbol("z")).diff(sympy.Symbol("z"))
(1 - sigmoid(z))*sigmoid(z)
"""
import contextvars
import math
import numbers
import operator as _op
import sys

import torch

from ..errors import SpecError
from ..lazy import symbolic, sympy, trace
from .surrogate import Sigmoid, Surrogate


def _dispatch(args, on_sympy, on_torch, on_number):
    # A traced value or a sympy expression exists only once its module is imported: tensors and numbers need
    # neither (a layer loaded from the cache never imports sympy).
    if "flexgen.frontend.trace" in sys.modules and any(isinstance(a, trace.Var) for a in args):
        return trace.combine(on_sympy, *args)
    if "sympy" in sys.modules and any(isinstance(a, sympy.Basic) for a in args):
        return on_sympy(*[sympy.sympify(a) for a in args])
    if any(isinstance(a, torch.Tensor) for a in args):
        return on_torch(*args)
    if all(isinstance(a, numbers.Number) for a in args):
        return on_number(*args)
    names = ", ".join(type(a).__name__ for a in args)
    raise TypeError(f"flexgen math functions take traced values, sympy expressions, tensors or numbers, not ({names})")


def reject_condition(value, what, *why):
    """`flexgen.frontend.trace.reject_condition`, where `value` can be traced or a sympy expression."""
    if "sympy" in sys.modules:
        trace.reject_condition(value, what, *why)


def _unary(name, sympy_fn, torch_fn, number_fn, doc):
    def fn(z):
        reject_condition(z, f"flexgen.{name}()")
        return _dispatch((z,), sympy_fn, torch_fn, number_fn)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"{doc}\n\nOn a traced value it records a node; on tensors and numbers it computes.\n\n"
        f"    >>> import torch, flexgen\n"
        f"    >>> flexgen.{name}(torch.tensor([0.5])).shape\n"
        f"    torch.Size([1])\n"
    )
    return fn


exp = _unary("exp", lambda z: sympy.exp(z), torch.exp, math.exp, "Exponential e**z.")
log = _unary("log", lambda z: sympy.log(z), torch.log, math.log, "Natural logarithm.")
sqrt = _unary("sqrt", lambda z: sympy.sqrt(z), torch.sqrt, math.sqrt, "Square root.")
tanh = _unary("tanh", lambda z: sympy.tanh(z), torch.tanh, math.tanh, "Hyperbolic tangent.")
atan = _unary("atan", lambda z: sympy.atan(z), torch.atan, math.atan, "Arc tangent.")
abs = _unary("abs", lambda z: sympy.Abs(z), torch.abs, lambda z: -z if z < 0 else z, "Absolute value |z|.")
sigmoid = _unary("sigmoid", lambda z: symbolic.sigmoid(z), torch.sigmoid, lambda z: 1.0 / (1.0 + math.exp(-z)),
                 "Logistic function 1 / (1 + exp(-z)).")


# The dtype of the step the eager backend is running (set by flexgen.launch.eager): numbers that meet no floating tensor
# (both branches of a `where`) become tensors of it, not of torch's default float32.
STEP_DTYPE = contextvars.ContextVar("flexgen_step_dtype", default=None)


def _as_tensors(*values):
    """Numbers as tensors in the dtype and device of the floating tensor among `values` (else in `STEP_DTYPE`).

    torch.as_tensor alone would make them float32 (torch's default) and round
    a constant such as 1.93 before it meets a float64 operand.

    >>> import torch
    >>> _as_tensors(torch.zeros(1, dtype=torch.float64), 1.93)[1].dtype
    torch.float64
    """
    like = next((v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    if like is None:
        return [torch.as_tensor(v, dtype=None if isinstance(v, torch.Tensor) else STEP_DTYPE.get()) for v in values]
    return [v if isinstance(v, torch.Tensor) else torch.as_tensor(v, dtype=like.dtype, device=like.device)
            for v in values]


def where(cond, a, b):
    """`a` where `cond` holds, else `b` (Python `if` cannot branch on a traced value).

    >>> import torch, flexgen
    >>> flexgen.where(torch.tensor([1.0, -1.0]) > 0, 2.0, 3.0).tolist()
    [2.0, 3.0]
    """
    if isinstance(cond, bool):
        return a if cond else b
    for value in (a, b):
        reject_condition(value, "flexgen.where(cond, a, b) as a or b")
    return _dispatch(
        (cond, a, b),
        lambda c, x, y: sympy.Piecewise((x, c), (y, True)),
        lambda c, x, y: torch.where(c, *_as_tensors(x, y)),
        lambda c, x, y: x if c else y,
    )


def minimum(a, b):
    """Elementwise minimum; the gradient goes to `a` on ties.

    >>> import torch, flexgen
    >>> flexgen.minimum(torch.tensor([1.0, 3.0]), 2.0).tolist()
    [1.0, 2.0]
    """
    for value in (a, b):
        reject_condition(value, "flexgen.minimum()")
    return _dispatch(
        (a, b),
        lambda x, y: sympy.Piecewise((x, x <= y), (y, True)),
        lambda x, y: torch.minimum(*_as_tensors(x, y)),
        min,
    )


def maximum(a, b):
    """Elementwise maximum; the gradient goes to `a` on ties.

    >>> import torch, flexgen
    >>> flexgen.maximum(torch.tensor([1.0, 3.0]), 2.0).tolist()
    [2.0, 3.0]
    """
    for value in (a, b):
        reject_condition(value, "flexgen.maximum()")
    return _dispatch(
        (a, b),
        lambda x, y: sympy.Piecewise((x, x >= y), (y, True)),
        lambda x, y: torch.maximum(*_as_tensors(x, y)),
        max,
    )


def clamp(z, low, high):
    """`z` limited to [low, high].

    >>> import torch, flexgen
    >>> flexgen.clamp(torch.tensor([-2.0, 0.5, 2.0]), -1.0, 1.0).tolist()
    [-1.0, 0.5, 1.0]
    """
    return minimum(maximum(z, low), high)


def _comparison(sympy_op, torch_op, doc):
    name = torch_op.__name__

    def fn(a, b):
        for value in (a, b):
            reject_condition(value, f"flexgen.{name}()")
        return _dispatch((a, b), sympy_op, torch_op, torch_op)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"{doc}\n\n"
        f"    >>> import torch, flexgen\n"
        f"    >>> flexgen.where(flexgen.{name}(torch.tensor([1.0, 2.0]), 1.5), 1.0, 0.0).tolist()\n"
        f"    {[float(torch_op(v, 1.5)) for v in (1.0, 2.0)]}\n"
    )
    return fn


lt = _comparison(lambda a, b: sympy.StrictLessThan(a, b), _op.lt, "a < b, usable as a `where` condition.")
le = _comparison(lambda a, b: sympy.LessThan(a, b), _op.le, "a <= b, usable as a `where` condition.")
gt = _comparison(lambda a, b: sympy.StrictGreaterThan(a, b), _op.gt, "a > b, usable as a `where` condition.")
ge = _comparison(lambda a, b: sympy.GreaterThan(a, b), _op.ge, "a >= b, usable as a `where` condition.")
eq = _comparison(lambda a, b: sympy.Eq(a, b), _op.eq, "a == b, usable as a `where` condition.")
ne = _comparison(lambda a, b: sympy.Ne(a, b), _op.ne, "a != b, usable as a `where` condition.")


class _EagerSpike(torch.autograd.Function):
    generate_vmap_rule = True  # torch ops only: torch.func batches them itself

    @staticmethod
    def forward(z, surrogate):
        return (z >= 0).to(z.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        z, ctx.surrogate = inputs
        ctx.save_for_backward(z)

    @staticmethod
    def backward(ctx, grad):
        (z,) = ctx.saved_tensors
        return grad * ctx.surrogate.torch_grad(z), None


class _EagerSpikeLearnableAlpha(torch.autograd.Function):
    """Θ(z) whose backward treats the spike as the surrogate's primitive g(z; alpha), alpha a tensor."""

    generate_vmap_rule = True

    @staticmethod
    def forward(z, alpha, surrogate):
        return (z >= 0).to(z.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        z, alpha, ctx.surrogate = inputs
        ctx.save_for_backward(z, alpha)

    @staticmethod
    def backward(ctx, grad):
        z, alpha = ctx.saved_tensors
        bound = ctx.surrogate.with_alpha(alpha)
        grad_alpha = grad * bound.torch_alpha_grad(z)
        grad_alpha = grad_alpha.sum() if alpha.dim() == 0 else grad_alpha.sum_to_size(alpha.shape)
        return grad * bound.torch_grad(z), grad_alpha.to(alpha.dtype), None


def _learnable_alpha_spike(z, surrogate, cls):
    if not surrogate.bound:
        raise SpecError(
            f"spike: {surrogate!r} has a learnable alpha, which must belong to a layer: pass the surrogate to the "
            "step as a parameter default or layer option (e.g. `surrogate=...`), and flexgen adds the learnable "
            "parameter `<option>_alpha`; outside a neuron, use learnable_alpha=False"
        )
    alpha = surrogate.alpha

    def on_tensors(t, a):
        like = t if isinstance(t, torch.Tensor) else a
        t, a = (torch.as_tensor(v, dtype=like.dtype, device=like.device) for v in (t, a))
        return _EagerSpikeLearnableAlpha.apply(t, a, surrogate)

    return _dispatch((z, alpha), cls, on_tensors, lambda v, a: 1.0 if v >= 0 else 0.0)


SPIKE_TAKES_A_DIFFERENCE = (
    "spike(z) fires where z >= 0 and its surrogate gradient is a function of z, so it takes the difference, "
    "not the comparison: write spike(h - v_th), not spike(h > v_th) or spike(h >= v_th) "
    "(for a 0/1 value without a surrogate gradient, flexgen.where(h >= v_th, 1.0, 0.0))"
)


def _check_spike_argument(z):
    reject_condition(z, "spike()", SPIKE_TAKES_A_DIFFERENCE)
    if isinstance(z, torch.Tensor) and z.dtype == torch.bool:
        raise SpecError(f"spike() got a bool tensor (a comparison): {SPIKE_TAKES_A_DIFFERENCE}")


def spike(z, surrogate=None):
    """Fire: Θ(z), 1 where z >= 0, else 0; the backward uses `surrogate`'s gradient.

    The default surrogate is `flexgen.surrogate.Sigmoid(alpha=4.0)`. A
    surrogate with `learnable_alpha=True` must reach the step as a parameter
    (its alpha then becomes a learnable parameter of the layer).

    >>> import torch, flexgen
    >>> z = torch.tensor([-0.5, 0.0, 0.5], requires_grad=True)
    >>> s = flexgen.spike(z, surrogate=flexgen.surrogate.ATan())
    >>> s.tolist()
    [0.0, 1.0, 1.0]
    >>> s.sum().backward(); round(z.grad[1].item(), 6)  # ATan's (alpha/2) / (1 + (pi/2 alpha z)^2) at 0
    1.0
    """
    _check_spike_argument(z)
    surrogate = surrogate if surrogate is not None else Sigmoid()
    if not isinstance(surrogate, Surrogate):
        raise TypeError(f"spike: surrogate must be a flexgen.surrogate.Surrogate, got {surrogate!r}")

    def symbolic_spike(*args):
        return symbolic.spike_class(surrogate)(*args)

    if surrogate.learnable_alpha:
        return _learnable_alpha_spike(z, surrogate, symbolic_spike)
    return _dispatch((z,), symbolic_spike, lambda t: _EagerSpike.apply(t, surrogate), lambda v: 1.0 if v >= 0 else 0.0)


def detach(z):
    """Stop the gradient through `z` (its value passes unchanged), e.g. for a detached reset.

    >>> import torch, flexgen
    >>> z = torch.tensor(2.0, requires_grad=True)
    >>> flexgen.detach(z).requires_grad
    False
    """
    reject_condition(z, "flexgen.detach()")
    return _dispatch((z,), lambda e: symbolic.detach(e), lambda t: t.detach(), lambda v: v)
