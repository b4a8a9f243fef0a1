"""One step of an undelayed recurrent layer, for streams: the `step` kernel (templates/recurrent_step.py.j2) with
every argument fixed once over tensors the caller keeps, so that a CUDA graph can capture its launch.

The kernel reads the step before's output from a buffer no program of the launch writes, so its programs tile
[B, H] two ways (row tiles by slices of neurons) and never wait for each other; a fused forward over T steps keeps
a row tile's slices in step with a barrier instead. Optionally it also takes the product of the layer's input with
the weight of the `torch.nn.Linear` before the layer (`in_weight`, `in_bias`): one launch a layer a step.

On Hopper and later (`compat.dependent_launch`) it is a programmatic dependent launch: its recurrent product runs
while the launch before it (the layer feeding this one, in a stream's step) finishes; the kernel waits for that
launch before it reads the layer's input, and lets the launch after it start only then.
"""
from typing import NamedTuple

import torch

from ..abi import kernel_args
from ..compat import dependent_launch
from ..config import HALF_DTYPES
from ..scalars import cached_zero
from ..triton_path import cuda_index, on_device_of, sm_count
from .tiling import dot_precision

CORES_BATCH = 2  # fp32 batches of at most this many rows take the CUDA-core products (step_tiling)


class StepTiling(NamedTuple):
    """`block_b` batch rows by `block` neurons a program, of `warps` warps; the products in slices of `block_k`,
    each tile's slices shared by `k_split` programs; `cores`: the products summed on CUDA cores (any `block_b`),
    else with tl.dot (`block_b` at least 16)."""

    block_b: int
    block: int
    block_k: int
    warps: int = 4
    k_split: int = 1
    cores: bool = False

    def grid(self, batch, hidden):
        return (-(-batch // self.block_b), -(-hidden // self.block), self.k_split)

    def tiles(self, batch, hidden):
        return -(-batch // self.block_b) * -(-hidden // self.block)


def step_tiling(batch, hidden, n_in, dtype, device):
    """The one-step kernel's tiles: 16 neurons a program (the narrowest tensor-core product); batch rows in tiles of
    at least 16 (tl.dot's least) and at most 64; the products in slices of 128 (16-bit, 4 warps), 64 (fp32, 2
    warps) or 32 (fp64) neurons; on a GPU the slices split between as many programs a tile as fill the SMs (at
    least two slices each), since a step reads each weight once. In fp32 a batch of at most CORES_BATCH rows sums
    its products on CUDA cores instead, in slices of 128, a tile of its own rows (no padding to 16) and at least
    one slice a program: tf32x3's three tensor-core products a slice are what set an fp32 step's time there. From
    H200 sweeps of the 700 -> 3 x 512 recurrent model at B 1, 2, 4, 8 and 32 (docs/perf/NOTES.md, "One-step
    kernels for streams")."""
    cores = dtype == torch.float32 and batch <= CORES_BATCH
    block_b = max(batch, 1) if cores else min(64, max(16, 1 << (max(batch, 1) - 1).bit_length()))
    if dtype == torch.float64:
        tiling = StepTiling(block_b, 16, 32)
    elif dtype in HALF_DTYPES:
        tiling = StepTiling(block_b, 16, 128)
    else:
        tiling = StepTiling(block_b, 16, 128 if cores else 64, warps=2, cores=cores)
    if device.type != "cuda":
        return tiling
    slices = -(-max(n_in, hidden) // tiling.block_k)
    fill = sm_count(cuda_index(device)) // tiling.tiles(batch, hidden)
    return tiling._replace(k_split=max(1, min(fill, slices if cores else slices // 2, 8)))


def step_arguments(compiled, states, outputs, previous, learnable, hyper, weight, bias, inputs=None, in_x=None,
                   in_weight=None, in_bias=None):
    """The step kernel's (and its tile function's) leading arguments over these tensors, as `StepLaunch` takes
    them."""
    like = states[0]
    batch, hidden = like.shape
    dtype, device = like.dtype, like.device
    zero = cached_zero(dtype, device)
    if inputs is None:
        inputs = [zero.expand(batch, hidden)] * len(compiled.layout.layout.inputs)
    if (in_x is None) != (in_weight is None):
        raise ValueError("in_x and in_weight come together: the input and the weight of the Linear before")
    step = lambda t: t.unsqueeze(0)  # noqa: E731 -- [B, H] as the one step of [1, B, H]
    recurrent = (weight, zero if bias is None else bias, previous,
                 zero.reshape(1, 1) if in_weight is None else in_weight,
                 zero if in_bias is None else in_bias, zero if in_x is None else in_x)
    groups = ([step(x) for x in inputs], list(states), list(learnable), [step(o) for o in outputs], list(states), [],
              list(hyper), recurrent)
    return list(kernel_args(compiled.arguments["step"], groups, (batch, hidden), flatten_params=False, dtype=dtype,
                            device=device))


class StepLaunch:
    """The step kernel of `compiled` (a `flexgen.kinds.recurrent.CompiledRecurrent` without delays) over fixed
    tensors: `states` [B, H] (read and written in place), `outputs` [B, H] (this step's, one per neuron output),
    `previous` [B, H] (the fed-back output of the step before: another buffer than `outputs`), the neuron's
    `learnable` values and `hyper`-parameters, the recurrent `weight` [H, H] and `bias` [H] (or None); `inputs` the
    neuron's inputs [B, H] (None: zeros, where `in_x` is the whole input current); `in_x` [B, n_in], `in_weight`
    [H, n_in] and `in_bias` [H] (or None): the Linear before the layer. Calling it launches one step."""

    def __init__(self, compiled, states, outputs, previous, learnable, hyper, weight, bias, inputs=None, in_x=None,
                 in_weight=None, in_bias=None, tiling=None):
        like = states[0]
        batch, hidden = like.shape
        dtype, device = like.dtype, like.device
        self.n_in = 0 if in_x is None else in_x.shape[1]
        self.args = step_arguments(compiled, states, outputs, previous, learnable, hyper, weight, bias, inputs, in_x,
                                   in_weight, in_bias)
        self.tiling = tiling or step_tiling(batch, hidden, self.n_in, dtype, device)
        split = self.tiling.k_split
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        # each program's share of the products, and the arrivals a tile counts (zero between launches)
        self.partial = like.new_empty((split, batch, hidden) if split > 1 else (1,), dtype=wide)
        self.counts = torch.zeros(self.tiling.tiles(batch, hidden) if split > 1 else 1, dtype=torch.int32,
                                  device=device)
        self.shape, self.device = (batch, hidden), device
        self.kernel = compiled.kernel("step")
        pdl = device.type == "cuda" and dependent_launch(cuda_index(device))
        self.options = dict(num_warps=self.tiling.warps, **({"launch_pdl": True} if pdl else {}))
        self.constexprs = dict(GDC=pdl, F64=dtype == torch.float64, HALF_IO=dtype in HALF_DTYPES,
                               DOT_PRECISION=dot_precision(dtype), IN_WEIGHT=in_weight is not None,
                               IN_BIAS=in_bias is not None, BLOCK_B=self.tiling.block_b, BLOCK=self.tiling.block,
                               BLOCK_K=self.tiling.block_k, K_SPLIT=split, CORES=self.tiling.cores)

    def __call__(self):
        batch, hidden = self.shape
        with on_device_of(self.device):
            self.kernel[self.tiling.grid(batch, hidden)](*self.args, self.partial, self.counts, batch, hidden,
                                                         self.n_in, 1, **self.constexprs, **self.options)
