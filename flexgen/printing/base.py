"""Printing shared by the Python-syntax targets: numbers, powers, logic."""
import math

import sympy
from sympy.printing.precedence import PRECEDENCE
from sympy.printing.str import StrPrinter

from ..errors import SpecError


def _printable_atom(atom):
    """Symbols, booleans and finite real numbers (pi and the like print as their value)."""
    if atom.is_Symbol or isinstance(atom, sympy.logic.boolalg.BooleanAtom):
        return True
    return bool(atom.is_number and atom.is_real and atom.is_finite)


def _literal(number):
    """A finite constant as a float literal."""
    try:
        value = float(number)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):  # constants folded beyond the float range (e.g. 1e308 * 10)
        raise SpecError(f"the derived step needs the constant {number}, which is beyond the float range; "
                        "use smaller constants in the step")
    return repr(value)


class StepPrinter(StrPrinter):
    """Python-syntax arithmetic with float literals; targets add their functions."""

    namespace = None  # "tl" or "torch"

    def _print(self, expr, **kwargs):
        if isinstance(expr, sympy.Basic) and expr.is_Atom and not _printable_atom(expr):
            # sympy's zoo, oo, nan, I... would print as names the generated module does not define (or, worse,
            # as a spec name that happens to match); flexgen keeps them out of derived steps, this is the backstop
            raise SpecError(f"flexgen cannot print {expr} ({type(expr).__name__}): the derived step holds a value "
                            "that is not a finite real number; please report the step that led here")
        # sympy keeps exact constants such as tanh(1) or sqrt(2) unevaluated; print their value, so no
        # target ever applies a function to a bare Python float (torch.tanh(1.0) is an error).
        if isinstance(expr, sympy.Expr) and expr.is_number and not expr.is_Number and expr.is_real:
            return self._print(sympy.Float(expr.evalf(17)))
        return super()._print(expr, **kwargs)

    def _print_Float(self, expr):
        return _literal(expr)

    def _print_Integer(self, expr):
        return _literal(expr)

    def _print_Rational(self, expr):
        return _literal(expr)

    def _print_Pow(self, expr, rational=False):
        base, exponent = expr.args
        b = self.parenthesize(base, PRECEDENCE["Mul"] + 1)
        if exponent.is_Integer and 1 <= abs(int(exponent)) <= 16:  # exp(n*log(b)) would be NaN for b < 0
            product = "*".join([b] * abs(int(exponent)))
            if exponent < 0:
                one = self._const("1.0")
                return f"{one}/({product})" if exponent < -1 else f"{one}/{product}"
            return f"({product})" if abs(int(exponent)) > 1 else product  # whole, also as a denominator
        if exponent.is_Integer:  # |b|^n, negated for odd n and b < 0
            magnitude = f"{self._fn('exp')}({self._print(exponent)}*{self._fn('log')}({self._print(sympy.Abs(base))}))"
            if int(exponent) % 2 == 0:
                return magnitude
            return self._where(f"({self._print(base)} < {self._const('0.0')})", f"-({magnitude})", magnitude)
        if exponent == 0.5:
            return f"{self._fn('sqrt')}({self._print(base)})"
        if exponent == -0.5:
            return f"{self._const('1.0')}/{self._fn('sqrt')}({self._print(base)})"
        return f"{self._fn('exp')}({self._print(exponent)}*{self._fn('log')}({self._print(base)}))"

    def _fn(self, name):
        """How the target calls the math function `name`."""
        return f"{self.namespace}.{name}"

    def _const(self, literal):
        """A constant the printer writes itself (`literal`: a float literal), in the target's syntax."""
        return literal

    def _print_exp(self, expr):
        return f"{self._fn('exp')}({self._print(expr.args[0])})"

    def _print_log(self, expr):
        return f"{self._fn('log')}({self._print(expr.args[0])})"

    def _print_sigmoid(self, expr):
        return f"{self._fn('sigmoid')}({self._print(expr.args[0])})"

    def _print_detach(self, expr):
        arg = expr.args[0]
        return self._print(arg) if arg.is_Atom else f"({self._print(arg)})"

    def _print_Assignment(self, expr):
        return f"{self._print(expr.lhs)} = {self._print(expr.rhs)}"

    def _print_AddAugmentedAssignment(self, expr):
        return f"{self._print(expr.lhs)} += {self._print(expr.rhs)}"

    def _print_ITE(self, expr):
        cond, then, otherwise = expr.args
        return self._where(self._print(cond), self._print(then), self._print(otherwise))

    def _print_Piecewise(self, expr):
        printed = None
        for value, cond in reversed(expr.args):
            if printed is None or cond == True:  # noqa: E712 (sympy true)
                printed = self._print(value)
            else:
                printed = self._where(self._print(cond), self._print(value), printed)
        return printed

    def _print_Relational(self, expr):
        lhs = self.parenthesize(expr.lhs, PRECEDENCE["Relational"])
        rhs = self.parenthesize(expr.rhs, PRECEDENCE["Relational"])
        return f"({lhs} {expr.rel_op} {rhs})"

    def _print_And(self, expr):
        return "(" + " & ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " | ".join(self._print(a) for a in expr.args) + ")"

    def _print_Equivalent(self, expr):
        return "(" + " == ".join(self._print(a) for a in expr.args) + ")"

    def _print_Not(self, expr):
        return f"(~{self._print(expr.args[0])})"

    def _print_BooleanTrue(self, expr):
        return "True"

    def _print_BooleanFalse(self, expr):
        return "False"

    def _print_sign(self, expr):
        z = self._print(expr.args[0])
        one, zero, minus_one = self._const("1.0"), self._const("0.0"), self._const("-1.0")
        return self._where(f"({z} > {zero})", one, self._where(f"({z} < {zero})", minus_one, zero))

    def _print_SpikeBase(self, expr):
        zero = self._const("0.0")
        return self._where(f"({self._print(expr.args[0])} >= {zero})", self._const("1.0"), zero)

    def _print_Function(self, expr):
        raise SpecError(f"flexgen cannot print the function {expr.func.__name__!r} for the {self.namespace} target")

    def emptyPrinter(self, expr):
        raise SpecError(f"flexgen cannot print {expr!r} ({type(expr).__name__})")
