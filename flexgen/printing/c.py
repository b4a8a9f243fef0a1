"""Printer for the C target (the CPU kernels): C99 arithmetic on `scalar_t`, type-generic math from <tgmath.h>."""
from sympy.printing.precedence import PRECEDENCE

from .base import StepPrinter, _literal


class CPrinter(StepPrinter):
    """Step code for the generated C loops. Every constant is cast to `scalar_t`, so float kernels compute in
    float as the other targets do, and every value is a `const scalar_t` of the loop body."""

    namespace = None

    def _fn(self, name):
        return {"sigmoid": "flexgen_sigmoid"}.get(name, name)

    def _const(self, literal):
        return f"(scalar_t){literal}"

    def _where(self, cond, a, b):
        return f"(({cond}) ? ({a}) : ({b}))"

    def _print_Float(self, expr):
        return self._const(_literal(expr))

    def _print_Integer(self, expr):
        return self._const(_literal(expr))

    def _print_Rational(self, expr):
        return self._const(_literal(expr))

    def _print_Assignment(self, expr):
        return f"const scalar_t {self._print(expr.lhs)} = {self._print(expr.rhs)};"

    def _print_AddAugmentedAssignment(self, expr):
        return f"{self._print(expr.lhs)} += {self._print(expr.rhs)};"

    def _print_Relational(self, expr):
        lhs = self.parenthesize(expr.lhs, PRECEDENCE["Relational"])
        rhs = self.parenthesize(expr.rhs, PRECEDENCE["Relational"])
        return f"({lhs} {expr.rel_op} {rhs})"

    def _print_And(self, expr):
        return "(" + " && ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " || ".join(self._print(a) for a in expr.args) + ")"

    def _print_Not(self, expr):
        return f"(!{self._print(expr.args[0])})"

    def _print_BooleanTrue(self, expr):
        return "1"

    def _print_BooleanFalse(self, expr):
        return "0"

    def _print_Abs(self, expr):
        return f"fabs({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        return f"tanh({self._print(expr.args[0])})"

    def _print_atan(self, expr):
        return f"atan({self._print(expr.args[0])})"
