"""Stage 3, print: sympy printers, one class per target language.

Takes the derived programs' expressions; hands render the code text of each step.

`TritonPrinter` writes the step for the Triton kernels (`RecurrentTritonPrinter`
for a recurrent layer's tiles), `TorchPrinter` for the generated torch path that
runs on the CPU, `CPrinter` for the C kernels of the CPU target. All print
constants in the kernels' compute dtype.
"""
from .c import CPrinter
from .torch import TorchPrinter
from .triton import RecurrentTritonPrinter, TritonPrinter

__all__ = ["CPrinter", "RecurrentTritonPrinter", "TritonPrinter", "TorchPrinter"]
