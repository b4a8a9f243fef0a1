"""`flexgen.surrogate.Custom`: a surrogate gradient from a user's smooth primitive g(z), differentiated by sympy
for the generated kernels and by torch autograd for the eager backend (the bundled ones are in
`flexgen.frontend.surrogate`; `flexgen.surrogate` lists them all)."""
import torch

from ..lazy import sympy
from .surrogate import Surrogate, _float


class Custom(Surrogate):
    """The derivative of a smooth primitive g(z) written with the flexgen math functions.

    sympy differentiates g for the generated kernels; the eager backend
    differentiates g with torch autograd, independently of sympy. Given
    `alpha=`, the primitive takes it as a second argument, g(z, alpha), so
    it can be learnable too.

    >>> import math, flexgen
    >>> s = flexgen.surrogate.Custom(lambda z: flexgen.atan(math.pi * z) / math.pi + 0.5)
    >>> s.torch_grad(torch.zeros(1)).item()
    1.0
    >>> s = flexgen.surrogate.Custom(lambda z, a: flexgen.sigmoid(a * z), alpha=4.0, learnable_alpha=True)
    >>> s.alpha_derivative(sympy.Symbol("z"))
    z*(1 - sigmoid(4.0*z))*sigmoid(4.0*z)
    """

    name = "custom"

    def __init__(self, primitive, alpha=None, learnable_alpha=False):
        if not callable(primitive):
            raise TypeError(f"Custom surrogate needs a callable primitive g(z), got {primitive!r}")
        params = {} if alpha is None else {"alpha": alpha}
        super().__init__(learnable_alpha=learnable_alpha, **params)
        self.primitive = primitive
        z = sympy.Symbol("z", real=True)
        a = sympy.Symbol("alpha", positive=True)
        args = (z,) if alpha is None else (z, a)
        try:
            expr = sympy.sympify(primitive(*args))
        except Exception as exc:
            shape = "g(z)" if alpha is None else "g(z, alpha)"
            raise ValueError(
                f"Custom surrogate: calling the primitive {shape} on sympy symbols failed ({type(exc).__name__}: "
                f"{exc}); write it with the flexgen math functions (flexgen.atan, flexgen.sigmoid, ...) and operators"
            ) from exc
        if isinstance(expr, (sympy.core.relational.Relational, sympy.logic.boolalg.Boolean)):
            raise ValueError(
                f"Custom surrogate: the primitive returned a comparison ({expr}); it must be a smooth function of z, "
                "the step whose derivative is the surrogate gradient, e.g. lambda z: flexgen.sigmoid(4.0 * z)"
            )
        if not isinstance(expr, sympy.Expr) or expr.free_symbols - set(args):
            names = " and ".join(str(x) for x in args)
            raise ValueError(f"Custom surrogate: the primitive must be an expression in {names} alone, got {expr!r}")
        if expr.diff(z) == 0:
            raise ValueError(f"Custom surrogate: the primitive {expr} does not depend on z, so its gradient is zero")
        self._symbols, self.expression = args, expr

    def key(self):
        alpha = ("" if "alpha" not in self._params
                 else f", alpha={'learnable' if self.learnable_alpha else repr(self.alpha)}")
        return f"custom({sympy.srepr(self.expression)}{alpha})"

    def _in(self, expr, z):
        """`expr` (over the primitive's symbols) at z and this surrogate's alpha."""
        values = {self._symbols[0]: z}
        if len(self._symbols) == 2:
            values[self._symbols[1]] = _float(self.alpha)
        return expr.xreplace(values)

    def derivative(self, z):
        return self._in(self.expression.diff(self._symbols[0]), z)

    def alpha_derivative(self, z):
        if len(self._symbols) == 1:
            raise ValueError("Custom surrogate: the primitive has no alpha argument (build it with alpha=...)")
        return self._in(self.expression.diff(self._symbols[1]), z)

    def _torch_grads(self, z):
        """(dg/dz, dg/dalpha or None) at every element of z, by torch autograd through the primitive."""
        with torch.enable_grad():
            z_leaf = z.detach().requires_grad_(True)
            if len(self._symbols) == 1:
                (dz,) = torch.autograd.grad(self.primitive(z_leaf).sum(), z_leaf)
                return dz, None
            alpha = torch.as_tensor(self.alpha, dtype=z.dtype, device=z.device).detach()
            a_leaf = alpha.expand_as(z).clone().requires_grad_(True)  # one alpha per element: per-element dg/dalpha
            dz, da = torch.autograd.grad(self.primitive(z_leaf, a_leaf).sum(), (z_leaf, a_leaf))
            return dz, da

    def torch_grad(self, z):
        return self._torch_grads(z)[0]

    def torch_alpha_grad(self, z):
        if len(self._symbols) == 1:
            raise ValueError("Custom surrogate: the primitive has no alpha argument (build it with alpha=...)")
        return self._torch_grads(z)[1]

    def __repr__(self):
        alpha = "" if "alpha" not in self._params else f", alpha={self._params['alpha']!r}"
        return f"Custom({self.expression}{alpha}{', learnable_alpha=True' if self.learnable_alpha else ''})"
