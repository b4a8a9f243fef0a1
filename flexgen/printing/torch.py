"""Printer for the generated torch path (`torch.*` calls)."""
from .base import StepPrinter
from .triton import is_literal


class TorchPrinter(StepPrinter):
    """Step code for the torch path that runs where Triton does not."""

    namespace = "torch"

    def _where(self, cond, a, b):
        if is_literal(a) and is_literal(b):
            # torch.where of two Python floats is in the default dtype; `like` has the compute dtype
            a = f"torch.full_like(like, {a})"
        return f"torch.where({cond}, {a}, {b})"

    def _print_Abs(self, expr):
        return f"torch.abs({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        return f"torch.tanh({self._print(expr.args[0])})"

    def _print_atan(self, expr):
        return f"torch.atan({self._print(expr.args[0])})"
