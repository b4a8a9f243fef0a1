"""How kernels are launched: block sizes, warps, and the dtypes the arithmetic runs in."""
import math
from typing import NamedTuple

import torch


class LaunchConfig(NamedTuple):
    """Neurons per program (`block`; `recompute_block` for the recompute backward, which keeps a chunk's values in
    registers, so fewer neurons per program leave room for them; `delayed_block` for kernels with a delay line,
    whose neurons each read another step, so that a program's working set of input rows stays in the L1 cache:
    on an H200, 128 neurons took 0.54-0.97x the time of 1024 for LIF fwd + bwd at 700 channels, docs/perf/NOTES.md)
    and warps per program."""

    block: int = 1024
    recompute_block: int = 512
    num_warps: int = 4
    delayed_block: int = 128

    def forward_block(self, layout):
        return self.delayed_block if layout.delayed else self.block

    def backward_block(self, layout):
        if layout.variant.recompute:
            return self.recompute_block
        return self.delayed_block if layout.delayed else self.block


DEFAULT = LaunchConfig()
MAX_PLANS = 64  # EagerPlans kept per neuron

# I/O dtypes narrower than the arithmetic: the forward rounds saved values to them (keeping the outcome of the
# backward's comparisons, see derive.decisions_on).
HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(dtype):
    """Arithmetic runs in fp32 for every I/O dtype except fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def numel(shape):
    return math.prod(shape)


def grid(n_elem, block):
    return ((n_elem + block - 1) // block,)
