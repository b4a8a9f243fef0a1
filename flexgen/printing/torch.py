"""Printer for the generated torch path (`torch.*` calls)."""
from .base import StepPrinter


class TorchPrinter(StepPrinter):
    """Step code for the torch path that runs where Triton does not."""

    namespace = "torch"

    def _where(self, cond, a, b):
        return f"torch.where({cond}, {a}, {b})"

    def _print_Abs(self, expr):
        return f"torch.abs({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        return f"torch.tanh({self._print(expr.args[0])})"

    def _print_atan(self, expr):
        return f"torch.atan({self._print(expr.args[0])})"
