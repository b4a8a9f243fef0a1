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

    name = sympy_fn.__name__.lower()
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"{doc}\n\nOn a traced value it records a node; on tensors and numbers it computes.\n\n"
        f"    >>> import torch, flexgen\n"
        f"    >>> flexgen.{name}(torch.tensor([0.5])).shape\n"
        f"    torch.Size([1])\n"
    )
    return fn


exp = _unary(sympy.exp, torch.exp, math.exp, "Exponential e**z.")
log = _unary(sympy.log, torch.log, math.log, "Natural logarithm.")
sqrt = _unary(sympy.sqrt, torch.sqrt, math.sqrt, "Square root.")
tanh = _unary(sympy.tanh, torch.tanh, math.tanh, "Hyperbolic tangent.")
atan = _unary(sympy.atan, torch.atan, math.atan, "Arc tangent.")
abs = _unary(sympy.Abs, torch.abs, lambda z: -z if z < 0 else z, "Absolute value |z|.")
sigmoid = _unary(symbolic.sigmoid, torch.sigmoid, lambda z: 1.0 / (1.0 + math.exp(-z)), "Logistic function 1 / (1 + exp(-z)).")


def where(cond, a, b):
    """`a` where `cond` holds, else `b` (Python `if` cannot branch on a traced value).

    >>> import torch, flexgen
    >>> flexgen.where(torch.tensor([1.0, -1.0]) > 0, 2.0, 3.0).tolist()
    [2.0, 3.0]
    """
    if isinstance(cond, bool):
        return a if cond else b
    return _dispatch(
        (cond, a, b),
        lambda c, x, y: sympy.Piecewise((x, c), (y, True)),
        lambda c, x, y: torch.where(c, torch.as_tensor(x), torch.as_tensor(y)),
        lambda c, x, y: x if c else y,
    )


def minimum(a, b):
    """Elementwise minimum; the gradient goes to `a` on ties.

    >>> import torch, flexgen
    >>> flexgen.minimum(torch.tensor([1.0, 3.0]), 2.0).tolist()
    [1.0, 2.0]
    """
    return _dispatch(
        (a, b),
        lambda x, y: sympy.Piecewise((x, x <= y), (y, True)),
        lambda x, y: torch.minimum(torch.as_tensor(x), torch.as_tensor(y)),
        min,
    )


def maximum(a, b):
    """Elementwise maximum; the gradient goes to `a` on ties.

    >>> import torch, flexgen
    >>> flexgen.maximum(torch.tensor([1.0, 3.0]), 2.0).tolist()
    [2.0, 3.0]
    """
    return _dispatch(
        (a, b),
        lambda x, y: sympy.Piecewise((x, x >= y), (y, True)),
        lambda x, y: torch.maximum(torch.as_tensor(x), torch.as_tensor(y)),
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
    def fn(a, b):
        return _dispatch((a, b), sympy_op, torch_op, torch_op)

    name = torch_op.__name__
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (
        f"{doc}\n\n"
        f"    >>> import torch, flexgen\n"
        f"    >>> flexgen.where(flexgen.{name}(torch.tensor([1.0, 2.0]), 1.5), 1.0, 0.0).tolist()\n"
        f"    {[float(torch_op(v, 1.5)) for v in (1.0, 2.0)]}\n"
    )
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

    >>> import torch, flexgen
    >>> z = torch.tensor([-0.5, 0.0, 0.5], requires_grad=True)
    >>> s = flexgen.spike(z, surrogate=flexgen.surrogate.ATan())
    >>> s.tolist()
    [0.0, 1.0, 1.0]
    >>> s.sum().backward(); round(z.grad[1].item(), 6)  # ATan's (alpha/2) / (1 + (pi/2 alpha z)^2) at 0
    1.0
    """
    from .surrogate import Sigmoid

    surrogate = surrogate if surrogate is not None else Sigmoid()
    cls = symbolic.spike_class(surrogate)
    return _dispatch((z,), cls, lambda t: _EagerSpike.apply(t, surrogate), lambda v: 1.0 if v >= 0 else 0.0)


def detach(z):
    """Stop the gradient through `z` (its value passes unchanged), e.g. for a detached reset.

    >>> import torch, flexgen
    >>> z = torch.tensor(2.0, requires_grad=True)
    >>> flexgen.detach(z).requires_grad
    False
    """
    return _dispatch((z,), symbolic.detach, lambda t: t.detach(), lambda v: v)
