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
import math
import numbers
import operator as _op

import sympy
import torch

from . import symbolic
from .trace import Var, combine


def _dispatch(args, on_sympy, on_torch, on_number):
    if any(isinstance(a, Var) for a in args):
        return combine(on_sympy, *args)
    if any(isinstance(a, sympy.Basic) for a in args):
        return on_sympy(*[sympy.sympify(a) for a in args])
    if any(isinstance(a, torch.Tensor) for a in args):
        return on_torch(*args)
    if all(isinstance(a, numbers.Number) for a in args):
        return on_number(*args)
    names = ", ".join(type(a).__name__ for a in args)
    raise TypeError(f"flexgen math functions take traced values, sympy expressions, tensors or numbers, not ({names})")


def _unary(sympy_fn, torch_fn, number_fn, doc):
    def fn(z):
        return _dispatch((z,), sympy_fn, torch_fn, number_fn)

    fn.__doc__ = doc
    return fn


exp = _unary(sympy.exp, torch.exp, math.exp, "Exponential e**z.")
log = _unary(sympy.log, torch.log, math.log, "Natural logarithm.")
sqrt = _unary(sympy.sqrt, torch.sqrt, math.sqrt, "Square root.")
tanh = _unary(sympy.tanh, torch.tanh, math.tanh, "Hyperbolic tangent.")
atan = _unary(sympy.atan, torch.atan, math.atan, "Arc tangent.")
abs = _unary(sympy.Abs, torch.abs, lambda z: -z if z < 0 else z, "Absolute value |z|.")
sigmoid = _unary(symbolic.sigmoid, torch.sigmoid, lambda z: 1.0 / (1.0 + math.exp(-z)), "Logistic function 1 / (1 + exp(-z)).")


def where(cond, a, b):
    """`a` where `cond` holds, else `b` (Python `if` cannot branch on a traced value)."""
    if isinstance(cond, bool):
        return a if cond else b
    return _dispatch(
        (cond, a, b),
        lambda c, x, y: sympy.Piecewise((x, c), (y, True)),
        lambda c, x, y: torch.where(c, torch.as_tensor(x), torch.as_tensor(y)),
        lambda c, x, y: x if c else y,
    )


def minimum(a, b):
    """Elementwise minimum; the gradient goes to `a` on ties."""
    return _dispatch(
        (a, b),
        lambda x, y: sympy.Piecewise((x, x <= y), (y, True)),
        lambda x, y: torch.minimum(torch.as_tensor(x), torch.as_tensor(y)),
        min,
    )


def maximum(a, b):
    """Elementwise maximum; the gradient goes to `a` on ties."""
    return _dispatch(
        (a, b),
        lambda x, y: sympy.Piecewise((x, x >= y), (y, True)),
        lambda x, y: torch.maximum(torch.as_tensor(x), torch.as_tensor(y)),
        max,
    )


def clamp(z, low, high):
    """`z` limited to [low, high]."""
    return minimum(maximum(z, low), high)


def _comparison(sympy_op, torch_op, doc):
    def fn(a, b):
        return _dispatch((a, b), sympy_op, torch_op, torch_op)

    fn.__doc__ = doc
    return fn


lt = _comparison(sympy.StrictLessThan, _op.lt, "a < b, usable as a `where` condition.")
le = _comparison(sympy.LessThan, _op.le, "a <= b, usable as a `where` condition.")
gt = _comparison(sympy.StrictGreaterThan, _op.gt, "a > b, usable as a `where` condition.")
ge = _comparison(sympy.GreaterThan, _op.ge, "a >= b, usable as a `where` condition.")
eq = _comparison(sympy.Eq, _op.eq, "a == b, usable as a `where` condition.")
ne = _comparison(sympy.Ne, _op.ne, "a != b, usable as a `where` condition.")


class _EagerSpike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, surrogate):
        ctx.save_for_backward(z)
        ctx.surrogate = surrogate
        return (z >= 0).to(z.dtype)

    @staticmethod
    def backward(ctx, grad):
        (z,) = ctx.saved_tensors
        return grad * ctx.surrogate.torch_grad(z), None


def spike(z, surrogate=None):
    """Fire: Θ(z), 1 where z >= 0, else 0; the backward uses `surrogate`'s gradient.

    The default surrogate is `flexgen.surrogate.Sigmoid(alpha=4.0)`.
    """
    from .surrogate import Sigmoid

    surrogate = surrogate if surrogate is not None else Sigmoid()
    cls = symbolic.spike_class(surrogate)
    return _dispatch((z,), cls, lambda t: _EagerSpike.apply(t, surrogate), lambda v: 1.0 if v >= 0 else 0.0)


def detach(z):
    """Stop the gradient through `z` (its value passes unchanged)."""
    return _dispatch((z,), symbolic.detach, lambda t: t.detach(), lambda v: v)
