"""Printer for Triton kernels (`tl.*` calls)."""
from .base import StepPrinter


def is_literal(code):
    """True where printed code is a number literal."""
    try:
        float(code)
    except ValueError:
        return False
    return True


class TritonPrinter(StepPrinter):
    """Step code for a Triton kernel."""

    namespace = "tl"
    tile = "[BLOCK]"  # the shape of a value per neuron of the program

    def _where(self, cond, a, b):
        if is_literal(a) and is_literal(b):
            # two float literals would make an fp32 result; give one the kernel's compute dtype
            a = f"tl.full({self.tile}, {a}, COMPUTE)"
        return f"tl.where({cond}, {a}, {b})"

    def _print_Assignment(self, expr):
        if expr.rhs.is_Number:
            # a bare literal is an fp32 scalar: as a loop-carried value (a gradient that does not flow back,
            # say) it would change type inside the time loop, which Triton refuses under fp64
            return f"{self._print(expr.lhs)} = tl.full({self.tile}, {self._print(expr.rhs)}, COMPUTE)"
        return super()._print_Assignment(expr)

    def _print_And(self, expr):
        # nested selects rather than `&`: Triton's interpreter rejects `&` on some mixes of condition dtypes
        printed = self._print(expr.args[-1])
        for cond in reversed(expr.args[:-1]):
            printed = f"tl.where({self._print(cond)}, {printed}, False)"
        return printed

    def _print_Or(self, expr):
        printed = self._print(expr.args[-1])
        for cond in reversed(expr.args[:-1]):
            printed = f"tl.where({self._print(cond)}, True, {printed})"
        return printed

    def _print_Abs(self, expr):
        return f"tl.abs({self._print(expr.args[0])})"

    def _print_tanh(self, expr):
        # tl has no tanh in every supported Triton version; 2σ(2z) - 1 is exact and portable.
        return f"(2.0*tl.sigmoid(2.0*{self.parenthesize(expr.args[0], 50)}) - 1.0)"

    def _print_atan(self, expr):
        return f"libdevice.atan({self._print(expr.args[0])})"


class RecurrentTritonPrinter(TritonPrinter):
    """Step code for a recurrent layer's Triton kernels, whose programs hold tiles of batch rows by hidden neurons."""

    tile = "[BLOCK_B, BLOCK]"
