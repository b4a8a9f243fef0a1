"""Surrogate gradients for `flexgen.spike`.

A surrogate replaces the derivative of the Heaviside step Θ(z) (zero almost
everywhere) by a bump. Each class gives the bump twice: as a sympy expression,
which the generator differentiates through and prints into the kernels, and as
a hand-written torch formula, which the eager backend uses, so the eager
backend stays an independent check of the generated code.

The formulas and default parameters follow SpikingJelly's
`activation_based.surrogate` (Sigmoid, ATan, PiecewiseQuadratic, SoftSign,
Erf, SuperSpike, Rect, PiecewiseLeakyReLU) and snnTorch's `fast_sigmoid`
(FastSigmoid). `Custom` (`flexgen.frontend.custom_surrogate`) takes any smooth primitive g(z) and uses g'(z).

Learnable alpha: a surrogate built with `learnable_alpha=True` reads its
alpha from a learnable parameter of the layer instead of a constant. The
spike is then treated as its primitive g(z; alpha) in the backward, so the
parameter's gradient is dg/dalpha; each surrogate gives that derivative twice
too (`alpha_derivative`, `torch_alpha_grad`). A layer whose static
option `surrogate` holds such a surrogate gets an `nn.Parameter` named
`surrogate_alpha`, initialised to the surrogate's alpha.

>>> import sympy, flexgen
>>> z = sympy.Symbol("z")
>>> flexgen.surrogate.Sigmoid(alpha=4.0).derivative(z)
4.0*(1 - sigmoid(4.0*z))*sigmoid(4.0*z)
>>> flexgen.surrogate.SuperSpike().derivative(z)
1.0/(Abs(z) + 1)**2
"""
import copy
import math

import torch

from ..lazy import symbolic, sympy

__all__ = [
    "Surrogate", "Sigmoid", "ATan", "PiecewiseQuadratic", "SoftSign", "Erf", "SuperSpike", "Rect",
    "PiecewiseLeakyReLU", "FastSigmoid", "available",
]


def _check_parameter(owner, name, value, allow_zero):
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{owner}: {name} must be a {kind} finite number, got {value!r}")
    return value


class Surrogate:
    """Base class: subclasses set `name` and define `derivative` and `torch_grad`.

    Constructor keyword arguments are the surrogate's parameters (positive
    finite floats, validated here; those named in `may_be_zero` may be 0);
    they are stored as attributes and make up the surrogate's `key()`.
    Subclasses with an `alpha` also define `alpha_derivative` and
    `torch_alpha_grad` and accept `learnable_alpha`.

    >>> Sigmoid(alpha=2.0).key()
    'sigmoid(alpha=2.0)'
    >>> Sigmoid(alpha=2.0, learnable_alpha=True).key()  # alpha is a parameter: its value is not baked in
    'sigmoid(alpha=learnable)'
    """

    name = "surrogate"
    may_be_zero = ()

    def __init__(self, learnable_alpha=False, **params):
        owner = type(self).__name__
        self._params = {k: _check_parameter(owner, k, v, k in self.may_be_zero) for k, v in params.items()}
        for k, v in self._params.items():
            setattr(self, k, v)
        if not isinstance(learnable_alpha, bool):
            raise TypeError(f"{owner}: learnable_alpha must be True or False, got {learnable_alpha!r}")
        if learnable_alpha and "alpha" not in self._params:
            raise ValueError(f"{owner} has no alpha parameter, so learnable_alpha is not available for it")
        self.learnable_alpha = learnable_alpha
        self.bound = False

    def with_alpha(self, alpha):
        """A copy whose formulas read `alpha` (a sympy expression, traced value or tensor) in place of the constant.

        This is how a learnable alpha reaches the formulas: the generator binds
        the parameter's symbol, the eager backend its tensor.
        """
        bound = copy.copy(self)
        bound.alpha, bound.bound = alpha, True
        return bound

    def params(self):
        """The surrogate's parameters, name -> float."""
        return dict(self._params)

    def key(self):
        """Identifies the surrogate in cache keys and sympy function classes."""
        args = ", ".join(f"{k}={'learnable' if self._is_learnable(k) else repr(v)}" for k, v in self._params.items())
        return f"{self.name}({args})"

    def _is_learnable(self, param):
        return param == "alpha" and self.learnable_alpha

    def derivative(self, z):
        """dΘ/dz replaced by the surrogate, as a sympy expression in `z`."""
        raise NotImplementedError(f"{type(self).__name__} does not define derivative(z)")

    def torch_grad(self, z):
        """The same derivative on a tensor, written out by hand."""
        raise NotImplementedError(f"{type(self).__name__} does not define torch_grad(z)")

    def alpha_derivative(self, z):
        """d g(z; alpha) / d alpha of the surrogate's primitive g, as a sympy expression (learnable alpha)."""
        raise NotImplementedError(f"{type(self).__name__} does not define alpha_derivative(z)")

    def torch_alpha_grad(self, z):
        """The same alpha derivative on a tensor, written out by hand."""
        raise NotImplementedError(f"{type(self).__name__} does not define torch_alpha_grad(z)")

    def __repr__(self):
        args = [f"{k}={v!r}" for k, v in self._params.items()]
        args += ["learnable_alpha=True"] if self.learnable_alpha else []
        return f"{type(self).__name__}({', '.join(args)})"

    def __eq__(self, other):
        return isinstance(other, Surrogate) and type(self) is type(other) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())


def _float(value):
    """A constant parameter as a sympy Float; a bound (symbolic) alpha passes through."""
    if isinstance(value, sympy.Basic):
        return value
    return sympy.Float(float(value))


class Sigmoid(Surrogate):
    """α·σ(αz)·(1 - σ(αz)), σ the logistic function (SpikingJelly's default, α = 4).

    >>> Sigmoid().torch_grad(torch.zeros(1)).item()
    1.0
    """

    name = "sigmoid"

    def __init__(self, alpha=4.0, learnable_alpha=False):
        super().__init__(alpha=alpha, learnable_alpha=learnable_alpha)

    def derivative(self, z):
        a = _float(self.alpha)
        return a * symbolic.sigmoid(a * z) * (1 - symbolic.sigmoid(a * z))

    def torch_grad(self, z):
        s = torch.sigmoid(self.alpha * z)
        return self.alpha * s * (1 - s)

    def alpha_derivative(self, z):  # g = sigmoid(alpha z)
        a = _float(self.alpha)
        return z * symbolic.sigmoid(a * z) * (1 - symbolic.sigmoid(a * z))

    def torch_alpha_grad(self, z):
        s = torch.sigmoid(self.alpha * z)
        return z * s * (1 - s)


class ATan(Surrogate):
    """(α/2) / (1 + (π/2·α·z)²), the derivative of arctan(π/2·α·z)/π + 1/2 (α = 2).

    >>> ATan().torch_grad(torch.zeros(1)).item()
    1.0
    """

    name = "atan"

    def __init__(self, alpha=2.0, learnable_alpha=False):
        super().__init__(alpha=alpha, learnable_alpha=learnable_alpha)

    def derivative(self, z):
        a = _float(self.alpha)
        return (a / 2) / (1 + (_float(math.pi / 2) * a * z) ** 2)

    def torch_grad(self, z):
        return (self.alpha / 2) / (1 + (math.pi / 2 * self.alpha * z) ** 2)

    def alpha_derivative(self, z):  # g = atan(pi/2 alpha z) / pi + 1/2
        a = _float(self.alpha)
        return (z / 2) / (1 + (_float(math.pi / 2) * a * z) ** 2)

    def torch_alpha_grad(self, z):
        return (z / 2) / (1 + (math.pi / 2 * self.alpha * z) ** 2)


class PiecewiseQuadratic(Surrogate):
    """α - α²|z| for |z| <= 1/α, else 0 (Esser et al. 2016; α = 1).

    >>> PiecewiseQuadratic(alpha=2.0).torch_grad(torch.tensor([0.25, 0.6])).tolist()
    [1.0, 0.0]
    """

    name = "piecewise_quadratic"

    def __init__(self, alpha=1.0, learnable_alpha=False):
        super().__init__(alpha=alpha, learnable_alpha=learnable_alpha)

    def derivative(self, z):
        a = _float(self.alpha)
        return sympy.Piecewise((sympy.S.Zero, sympy.Abs(z) > 1 / a), (a - a**2 * sympy.Abs(z), True))

    def torch_grad(self, z):
        inside = z.abs() <= 1 / self.alpha
        return torch.where(inside, self.alpha - self.alpha**2 * z.abs(), torch.zeros_like(z))

    def alpha_derivative(self, z):  # g = -alpha^2/2 z|z| + alpha z + 1/2 inside, 0 or 1 outside
        a = _float(self.alpha)
        return sympy.Piecewise((sympy.S.Zero, sympy.Abs(z) > 1 / a), (z - a * z * sympy.Abs(z), True))

    def torch_alpha_grad(self, z):
        inside = z.abs() <= 1 / self.alpha
        return torch.where(inside, z - self.alpha * z * z.abs(), torch.zeros_like(z))


class SoftSign(Surrogate):
    """α / (2(1 + α|z|)²), the derivative of (softsign(αz) + 1)/2 (α = 2).

    >>> SoftSign().torch_grad(torch.tensor([0.0, 0.5])).tolist()
    [1.0, 0.25]
    """

    name = "soft_sign"

    def __init__(self, alpha=2.0, learnable_alpha=False):
        super().__init__(alpha=alpha, learnable_alpha=learnable_alpha)

    def derivative(self, z):
        a = _float(self.alpha)
        return a / (2 * (1 + a * sympy.Abs(z)) ** 2)

    def torch_grad(self, z):
        return self.alpha / (2 * (1 + self.alpha * z.abs()) ** 2)

    def alpha_derivative(self, z):  # g = (alpha z / (1 + alpha |z|) + 1) / 2
        return z / (2 * (1 + _float(self.alpha) * sympy.Abs(z)) ** 2)

    def torch_alpha_grad(self, z):
        return z / (2 * (1 + self.alpha * z.abs()) ** 2)


class Erf(Surrogate):
    """(α/√π)·exp(-α²z²), the derivative of erfc(-αz)/2 (α = 2); no erf in the kernels.

    >>> round(Erf().torch_grad(torch.zeros(1)).item(), 6)
    1.128379
    """

    name = "erf"

    def __init__(self, alpha=2.0, learnable_alpha=False):
        super().__init__(alpha=alpha, learnable_alpha=learnable_alpha)

    def derivative(self, z):
        a = _float(self.alpha)
        return a / _float(math.sqrt(math.pi)) * sympy.exp(-(a**2) * z**2)

    def torch_grad(self, z):
        return self.alpha / math.sqrt(math.pi) * torch.exp(-((self.alpha * z) ** 2))

    def alpha_derivative(self, z):  # g = erfc(-alpha z) / 2
        a = _float(self.alpha)
        return z / _float(math.sqrt(math.pi)) * sympy.exp(-(a**2) * z**2)

    def torch_alpha_grad(self, z):
        return z / math.sqrt(math.pi) * torch.exp(-((self.alpha * z) ** 2))


class SuperSpike(Surrogate):
    """α / (1 + |z|)² (Zenke & Ganguli 2018, in SpikingJelly's form; α = 1).

    >>> SuperSpike().torch_grad(torch.tensor([1.0])).item()
    0.25
    """

    name = "super_spike"

    def __init__(self, alpha=1.0, learnable_alpha=False):
        super().__init__(alpha=alpha, learnable_alpha=learnable_alpha)

    def derivative(self, z):
        return _float(self.alpha) / (1 + sympy.Abs(z)) ** 2

    def torch_grad(self, z):
        return self.alpha / (1 + z.abs()) ** 2

    def alpha_derivative(self, z):  # g = alpha z / (1 + |z|)
        return z / (1 + sympy.Abs(z))

    def torch_alpha_grad(self, z):
        return z / (1 + z.abs())


class Rect(Surrogate):
    """α for |z| < 1/(2α), else 0: the derivative of clamp(αz + 1/2, 0, 1) (α = 1).

    >>> Rect().torch_grad(torch.tensor([0.4, 0.5])).tolist()
    [1.0, 0.0]
    """

    name = "rect"

    def __init__(self, alpha=1.0, learnable_alpha=False):
        super().__init__(alpha=alpha, learnable_alpha=learnable_alpha)

    def derivative(self, z):
        a = _float(self.alpha)
        return sympy.Piecewise((a, sympy.Abs(z) < 1 / (2 * a)), (sympy.S.Zero, True))

    def torch_grad(self, z):
        return self.alpha * (z.abs() < 0.5 / self.alpha).to(z.dtype)

    def alpha_derivative(self, z):  # g = clamp(alpha z + 1/2, 0, 1)
        a = _float(self.alpha)
        return sympy.Piecewise((z, sympy.Abs(z) < 1 / (2 * a)), (sympy.S.Zero, True))

    def torch_alpha_grad(self, z):
        return z * (z.abs() < 0.5 / self.alpha).to(z.dtype)


class PiecewiseLeakyReLU(Surrogate):
    """1/(2w) for |z| < w, else c (SpikingJelly's PiecewiseLeakyReLU; w = 1, c = 0.01).

    >>> PiecewiseLeakyReLU().torch_grad(torch.tensor([0.0, 2.0], dtype=torch.float64)).tolist()
    [0.5, 0.01]
    """

    name = "piecewise_leaky_relu"
    may_be_zero = ("c",)

    def __init__(self, w=1.0, c=0.01):
        super().__init__(w=w, c=c)

    def derivative(self, z):
        w, c = _float(self.w), _float(self.c)
        return sympy.Piecewise((1 / (2 * w), sympy.Abs(z) < w), (c, True))

    def torch_grad(self, z):
        inside = z.abs() < self.w
        return torch.where(inside, torch.full_like(z, 0.5 / self.w), torch.full_like(z, self.c))


class FastSigmoid(Surrogate):
    """1 / (1 + slope·|z|)² (snnTorch's fast_sigmoid; slope = 25).

    >>> FastSigmoid().torch_grad(torch.tensor([0.0, 0.04])).tolist()
    [1.0, 0.25]
    """

    name = "fast_sigmoid"

    def __init__(self, slope=25.0):
        super().__init__(slope=slope)

    def derivative(self, z):
        return 1 / (1 + _float(self.slope) * sympy.Abs(z)) ** 2

    def torch_grad(self, z):
        return 1 / (1 + self.slope * z.abs()) ** 2


def available():
    """Names of the bundled surrogate classes, name -> class.

    >>> sorted(available())[:3]
    ['ATan', 'Erf', 'FastSigmoid']
    """
    classes = (Sigmoid, ATan, PiecewiseQuadratic, SoftSign, Erf, SuperSpike, Rect, PiecewiseLeakyReLU, FastSigmoid)
    return {cls.__name__: cls for cls in classes}
