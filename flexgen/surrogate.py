"""Surrogate gradients for `flexgen.spike`.

A surrogate replaces the derivative of the Heaviside step Θ(z) (zero almost
everywhere) by a smooth bump. Each class gives the bump twice: as a sympy
expression, which the generator differentiates through and prints into the
kernels, and as a hand-written torch formula, which the eager backend uses,
so the eager backend stays an independent check of the generated code.

>>> import sympy, flexgen
>>> z = sympy.Symbol("z")
>>> flexgen.surrogate.Sigmoid(alpha=4.0).derivative(z)
4.0*(1 - sigmoid(4.0*z))*sigmoid(4.0*z)
"""
import math

import sympy
import torch

from . import symbolic


class Surrogate:
    """Base class: subclasses define `name`, `derivative` and `torch_grad`."""

    name = "surrogate"

    def __init__(self, alpha):
        alpha = float(alpha)
        if not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"{type(self).__name__}: alpha must be a positive finite number, got {alpha!r}")
        self.alpha = alpha

    def key(self):
        """Identifies the surrogate in cache keys and sympy function classes."""
        return f"{self.name}(alpha={self.alpha!r})"

    def derivative(self, z):
        """dΘ/dz replaced by the surrogate, as a sympy expression in `z`."""
        raise NotImplementedError

    def torch_grad(self, z):
        """The same derivative on a tensor, written out by hand."""
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}(alpha={self.alpha!r})"

    def __eq__(self, other):
        return type(self) is type(other) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())


class Sigmoid(Surrogate):
    """σ'(αz)·α with σ the logistic function (SpikingJelly's default, α = 4)."""

    name = "sigmoid"

    def __init__(self, alpha=4.0):
        super().__init__(alpha)

    def derivative(self, z):
        a = sympy.Float(self.alpha)
        return a * symbolic.sigmoid(a * z) * (1 - symbolic.sigmoid(a * z))

    def torch_grad(self, z):
        s = torch.sigmoid(self.alpha * z)
        return self.alpha * s * (1 - s)


class ATan(Surrogate):
    """(α/2) / (1 + (π/2·α·z)²), the derivative of arctan(π/2·α·z)/π + 1/2 (α = 2)."""

    name = "atan"

    def __init__(self, alpha=2.0):
        super().__init__(alpha)

    def derivative(self, z):
        a = sympy.Float(self.alpha)
        return (a / 2) / (1 + (sympy.Float(math.pi / 2) * a * z) ** 2)

    def torch_grad(self, z):
        return (self.alpha / 2) / (1 + (math.pi / 2 * self.alpha * z) ** 2)
