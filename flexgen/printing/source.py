"""Printer for step functions written by flexgen itself (the discretised equations of `flexgen.ode`).

The code it prints is ordinary step-function source: flexgen's math functions
(`exp`, `where`, `minimum`, ...) called by their bare names, so the same text
runs while tracing (on symbols) and in the eager backend (on tensors).
"""
import sympy
from sympy.printing.precedence import PRECEDENCE

from .base import StepPrinter


class StepSourcePrinter(StepPrinter):
    """Python source of an expression in the step-function language (`flexgen.exp`, `flexgen.where`, ...)."""

    namespace = None  # functions are called by their bare names, bound in the step's module namespace

    def _where(self, cond, a, b):
        return f"where({cond}, {a}, {b})"

    def _print_Pow(self, expr, rational=False):
        base, exponent = expr.args
        if exponent.is_Integer and 1 <= abs(int(exponent)) <= 16:
            return super()._print_Pow(expr)
        if exponent == sympy.S.Half:
            return f"sqrt({self._print(base)})"
        if exponent == -sympy.S.Half:
            return f"1.0/sqrt({self._print(base)})"
        b = self.parenthesize(base, PRECEDENCE["Pow"] + 1)
        if exponent.is_Integer:  # an integer exponent stays one: (-2.0)**3.0 is fine, but not for every target
            e = str(int(exponent))
        else:
            e = self.parenthesize(exponent, PRECEDENCE["Pow"] + 1)
        return f"{b}**({e})" if e.startswith("-") else f"{b}**{e}"

    def _print_exp(self, expr):
        return f"exp({self._print(expr.args[0])})"

    def _print_log(self, expr):
        return f"log({self._print(expr.args[0])})"

    def _print_sigmoid(self, expr):
        return f"sigmoid({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        return f"tanh({self._print(expr.args[0])})"

    def _print_atan(self, expr):
        return f"atan({self._print(expr.args[0])})"

    def _print_Abs(self, expr):
        return f"abs({self._print(expr.args[0])})"

    def _print_detach(self, expr):
        return f"detach({self._print(expr.args[0])})"

    def _print_Min(self, expr):
        printed = self._print(expr.args[-1])
        for arg in reversed(expr.args[:-1]):
            printed = f"minimum({self._print(arg)}, {printed})"
        return printed

    def _print_Max(self, expr):
        printed = self._print(expr.args[-1])
        for arg in reversed(expr.args[:-1]):
            printed = f"maximum({self._print(arg)}, {printed})"
        return printed

    def _print_Symbol(self, expr):
        return expr.name
