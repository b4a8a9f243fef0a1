"""Stage 3, print: sympy printers, one class per target language.

Takes the derived programs' expressions; hands render the code text of each step.

`TritonPrinter` writes the step for the Triton kernels, `TorchPrinter` for the
generated torch path that runs on the CPU. Both print constants as float
literals, so the arithmetic runs in the kernels' compute dtype.
"""
from .torch import TorchPrinter
from .triton import TritonPrinter

__all__ = ["TritonPrinter", "TorchPrinter"]
