"""`flexgen.DelayedLinear` as one matrix product per tap, on tensor cores: the "taps" backend.

With the dense kernel taps[k, j, i] = weight[j, i] * tap_k(delay[j, i]) (k = 0 .. K, K = max_delay) and the rows
r = t * B + b of [T, B, F] tensors flattened (a shift by k steps is a shift by k * B rows):

    forward:     y[r, j]     = sum_k sum_i x[r - k B, i] taps[k, j, i] (+ bias[j])
    input grad:  gx[r, i]    = sum_k sum_j g[r + k B, j] taps[k, j, i]
    taps grad:   gt[k, j, i] = sum_r g[r + k B, j] x[r, i]

(x and g are 0 outside [0, T B).) The forward and the input's gradient are one kernel, `shifted_taps_kernel`,
which sums K + 1 shifted products into one tile; the taps' gradient is K + 1 products of g's and x's rows. The
tap matrices are built from the weight and the delays by a kernel of their own, and the weight's and the delays'
gradients follow from the taps' by another (`flexgen.launch.delay.tap_matrices`); the layer saves x, the weight and the
delays, and builds the matrices again for the backward (transposed). Where the sparse two-tap kernels
(`delayed_linear`) do two multiply-adds per synapse and step on the CUDA cores, these do K + 1 on the tensor cores:
the faster of the two for short delays, and the only fused form of Gaussian taps, which have K + 1 taps anyway.

Every product reads both operands with the summed index contiguous ("K-major"), the only layout Hopper's TF32
tensor-core instructions take as they are (the taps' gradient took 3.1x as long reading x and g as stored): the
forward reads the taps as [K + 1, out, in], the input's gradient as [K + 1, in, out], and the
taps' gradient transposed copies of x and g, [in, T B] and [out, T B].
"""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .ops import DelayBackend, DelayFunction, TapOptions, register_ops, run
from .tap_matrices import tap_matrices, tap_matrices_gradient
from ..triton_path import SpecialisedLaunches, accumulator, cuda_index, launch_specialised, sm_count

__all__ = ["Tile", "TapsConfig", "DEFAULT", "taps_precision", "delay_taps"]


class Tile(NamedTuple):
    """A kernel's output tile (`rows` x `cols`), the slice it sums at a time (`reduce`), warps and pipeline
    stages. Tile sizes are powers of two, each capped at its dimension's padded size."""

    rows: int
    cols: int
    reduce: int
    warps: int
    stages: int


class TapsConfig(NamedTuple):
    """The tiles of the forward, of the input's gradient (both `shifted_taps_kernel`; rows of (t, b) x output
    features, summed over input features) and of the taps' gradient (`taps_gradient_kernel`; out x in features,
    summed over rows). Where the forward's tile would give fewer programs than half the GPU's multiprocessors (a
    short, narrow batch), it takes `forward_small`. The fastest of a probe on an H100 over T 100 and 250, B 32 and
    256, max_delay 25, 700 -> 256 (docs/perf/h100/delay_taps_probes.log)."""

    forward: Tile = Tile(64, 256, 32, 8, 3)
    forward_small: Tile = Tile(64, 128, 64, 4, 4)
    grad_input: Tile = Tile(128, 256, 32, 8, 3)
    correlation: Tile = Tile(128, 256, 32, 8, 3)


DEFAULT = TapsConfig()


def taps_precision(dtype):
    """`tl.dot`'s input_precision for products in `dtype`. fp32 takes TF32 where torch allows it for the
    convolution this layer is (`_convolutions_allow_tf32`, on by default), else 3xTF32 (about fp32's accuracy on
    the tensor cores); fp64 is exact."""
    if dtype == torch.float32:
        return "tf32" if _convolutions_allow_tf32() else "tf32x3"
    return "ieee"


def _convolutions_allow_tf32():
    """torch.backends.cudnn.allow_tf32, or where it cannot say (torch >= 2.9 raises when the newer per-operator
    flags differ, as after `torch.backends.cudnn.conv.fp32_precision = "ieee"`) the convolutions' own flag."""
    try:
        return torch.backends.cudnn.allow_tf32
    except RuntimeError:
        return torch.backends.cudnn.conv.fp32_precision == "tf32"


@triton.jit
def shifted_taps_kernel(a_ptr, taps_ptr, bias_ptr, out_ptr, rows, batch, n_reduce, n_out, n_taps,
                        SIGN: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """out[r, n] = sum_k sum_m a[r + SIGN k batch, m] taps[k, n, m] (+ bias[n]); a [rows, n_reduce], taps
    [n_taps, n_out, n_reduce] and out [rows, n_out], contiguous. A program: BLOCK_R rows x BLOCK_N columns; it
    skips the taps whose shifted rows all fall outside [0, rows)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    first = tl.program_id(0) * BLOCK_R
    if SIGN < 0:
        reaching = tl.minimum(n_taps, (tl.minimum(first + BLOCK_R, rows) - 1) // batch + 1)
    else:
        reaching = tl.minimum(n_taps, (rows - first + batch - 1) // batch)
    acc = tl.zeros((BLOCK_R, BLOCK_N), ACC)
    for k in range(0, reaching):
        source = r + SIGN * k * batch
        source_ok = (source >= 0) & (source < rows)
        a_rows = a_ptr + source.to(tl.int64)[:, None] * n_reduce
        tap_rows = taps_ptr + (k * n_out + n).to(tl.int64)[None, :] * n_reduce
        for m0 in range(0, n_reduce, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < n_reduce
            a = tl.load(a_rows + m[None, :], mask=source_ok[:, None] & m_ok[None, :], other=0.0)
            w = tl.load(tap_rows + m[:, None], mask=m_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a.to(ACC), w.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(ACC)[None, :]
    out = out_ptr + r.to(tl.int64)[:, None] * n_out + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(r < rows)[:, None] & n_ok[None, :])


def shifted_taps_grid(rows, n_out, tile):
    return (triton.cdiv(rows, tile.rows), triton.cdiv(n_out, tile.cols))


@triton.jit
def taps_gradient_kernel(g_ptr, x_ptr, out_ptr, rows, row_stride, batch, n_in, n_out, ACC: tl.constexpr,
                         BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
                         PRECISION: tl.constexpr):
    """out[k, j, i] = sum_r g[j, r + k batch] x[i, r] (r < rows) for g [n_out, row_stride] and x [n_in,
    row_stride] (transposed series, padded); out [K + 1, n_out, n_in]. A program: one tap k, BLOCK_J x BLOCK_I of
    its entries; it loops over the rows."""
    k = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    i = tl.program_id(2) * BLOCK_I + tl.arange(0, BLOCK_I)
    j_ok, i_ok = j < n_out, i < n_in
    end = rows - k * batch
    acc = tl.zeros((BLOCK_J, BLOCK_I), ACC)
    g_rows = g_ptr + j.to(tl.int64)[:, None] * row_stride + k * batch
    x_rows = x_ptr + i.to(tl.int64)[None, :] * row_stride
    for r0 in range(0, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < end
        g = tl.load(g_rows + r[None, :], mask=j_ok[:, None] & r_ok[None, :], other=0.0)
        x = tl.load(x_rows + r[:, None], mask=r_ok[:, None] & i_ok[None, :], other=0.0)
        acc = tl.dot(g.to(ACC), x.to(ACC), acc, input_precision=PRECISION, out_dtype=ACC)
    out = out_ptr + (k * n_out + j[:, None]).to(tl.int64) * n_in + i[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=j_ok[:, None] & i_ok[None, :])


def taps_gradient_grid(n_taps, n_in, n_out, tile):
    return (n_taps, triton.cdiv(n_out, tile.rows), triton.cdiv(n_in, tile.cols))


def _fitted(tile, rows, cols, reduce):
    """The tile capped at the problem's padded sizes (tl.dot needs at least 16 of each)."""
    def cap(size, dim):
        return max(16, min(size, triton.next_power_of_2(dim)))

    return tile._replace(rows=cap(tile.rows, rows), cols=cap(tile.cols, cols), reduce=cap(tile.reduce, reduce))


def _within_shared_memory(tile, element_size, device):
    """The tile with fewer pipeline stages, then halved, until its operands' slices in flight fit the GPU's shared
    memory (the defaults are sized for fp32 on an H100: fp64, or a GPU with less, needs this)."""
    limit = _shared_memory(device)
    while (tile.rows + tile.cols) * tile.reduce * element_size * tile.stages > limit:
        if tile.stages > 2:
            tile = tile._replace(stages=tile.stages - 1)
        elif max(tile.rows, tile.cols) > 16:
            tile = tile._replace(**{"cols" if tile.cols >= tile.rows else "rows": max(tile.rows, tile.cols) // 2})
        else:
            break
    return tile


@functools.lru_cache(maxsize=None)
def _shared_memory(device):
    """Bytes of shared memory a program may use (Triton's interpreter: no limit)."""
    if device.type != "cuda":
        return float("inf")
    return triton.runtime.driver.active.utils.get_device_properties(cuda_index(device))["max_shared_mem"]


def _forward_tile(config, rows, n_out, device):
    tile = config.forward
    programs = triton.cdiv(rows, tile.rows) * triton.cdiv(n_out, tile.cols)
    return config.forward_small if programs < _multiprocessors(device) // 2 else tile


def _multiprocessors(device):
    """The GPU's multiprocessors (Triton's interpreter: 1, so that nothing counts as small)."""
    return sm_count(cuda_index(device)) if device.type == "cuda" else 1


def _padded_rows(t):
    """t [..., n], contiguous, with its rows zero-padded to a multiple of 16 elements. Triton knows the alignment
    of an integer argument only when it is divisible by 16; rows of another length (SHD's 700 inputs) load in
    narrow pieces, and the forward took 2.4x as long (docs/perf/h100/delay_taps_probes.log). The padding adds
    zero products."""
    pad = -t.shape[-1] % 16
    return torch.nn.functional.pad(t, (0, pad)) if pad else t.contiguous()


def _shifted_product(a, taps, bias, batch, sign, tile, wrap=None, shape=None):
    """sum_k a[r + sign k batch] @ taps[k].T, [rows, n] in a's dtype, for taps [K + 1, n, a's columns]; made in
    `shape` (the same elements: [T, B, n]) where given, so that the result is a tensor of its own, not a view."""
    a, taps = _padded_rows(a), _padded_rows(taps)
    rows, n_reduce = a.shape
    n_taps, n_out = taps.shape[:2]
    tile = _within_shared_memory(_fitted(tile, rows, n_out, n_reduce), max(a.element_size(), taps.element_size()),
                                 a.device)
    out = torch.empty(shape or (rows, n_out), dtype=a.dtype, device=a.device)
    launch_specialised(
        _launch_shifted_taps, shifted_taps_grid(rows, n_out, tile),
        (a, taps, bias if bias is not None else taps, out.view(rows, n_out), rows, batch, n_reduce, n_out, n_taps),
        dict(SIGN=sign, HAS_BIAS=bias is not None, BLOCK_R=tile.rows, BLOCK_N=tile.cols, BLOCK_M=tile.reduce,
             ACC=accumulator(taps.dtype), PRECISION=taps_precision(taps.dtype)),
        wrap, num_warps=tile.warps, num_stages=tile.stages)
    return out


def _transposed(rows):
    """[R, F] -> [F, R], padded as `_padded_rows` pads."""
    return _padded_rows(rows.t())


def _taps_gradient(x, grad, batch, n_taps, dtype, tile, wrap=None):
    """[K + 1, out, in] of x [R, in] and the output's gradient [R, out]."""
    rows, n_in = x.shape
    n_out = grad.shape[1]
    tile = _within_shared_memory(_fitted(tile, n_out, n_in, rows), max(x.element_size(), grad.element_size()),
                                 x.device)
    g_series, x_series = _transposed(grad), _transposed(x)
    out = torch.empty(n_taps, n_out, n_in, dtype=dtype, device=x.device)
    launch_specialised(
        _launch_taps_gradient, taps_gradient_grid(n_taps, n_in, n_out, tile),
        (g_series, x_series, out, rows, g_series.shape[1], batch, n_in, n_out),
        dict(ACC=accumulator(dtype), BLOCK_J=tile.rows, BLOCK_I=tile.cols, BLOCK_R=tile.reduce,
             PRECISION=taps_precision(dtype)),
        wrap, num_warps=tile.warps, num_stages=tile.stages)
    return out


def _forward(x, weight, delay, bias, options, config, wrap):
    steps, batch, n_in = x.shape
    matrices = tap_matrices(weight, delay, options.max_delay, options.gaussian, options.sigma, wrap=wrap)
    tile = _forward_tile(config, steps * batch, weight.shape[0], x.device)
    return _shifted_product(x.view(steps * batch, n_in), matrices, bias, batch, -1, tile, wrap,
                            (steps, batch, weight.shape[0]))


def _grad_input(grad, x, weight, delay, options, config, wrap):
    steps, batch, _ = x.shape
    transposed = tap_matrices(weight, delay, options.max_delay, options.gaussian, options.sigma, transposed=True,
                              wrap=wrap)
    g = grad.view(steps * batch, -1)
    return _shifted_product(g, transposed, None, batch, 1, config.grad_input, wrap, x.shape)


def _grad_params(grad, x, weight, delay, options, config, wrap):
    steps, batch, n_in = x.shape
    dtype = torch.promote_types(weight.dtype, delay.dtype)
    grad_taps = _taps_gradient(x.view(steps * batch, n_in), grad.view(steps * batch, -1), batch,
                               options.max_delay + 1, dtype, config.correlation, wrap)
    return tap_matrices_gradient(grad_taps, weight, delay, options.max_delay, options.gaussian, options.sigma, wrap)


_launch_shifted_taps = SpecialisedLaunches(shifted_taps_kernel)
_launch_taps_gradient = SpecialisedLaunches(taps_gradient_kernel)


class DelayTapsFunction(DelayFunction):
    """The "taps" backend's eager forward and backward."""


BACKEND = DelayBackend("taps", DelayTapsFunction, _forward, _grad_input, _grad_params, DEFAULT)
OPS = register_ops(BACKEND)


def delay_taps(x, weight, delay, bias, max_delay, gaussian=False, sigma=1.0, config=DEFAULT):
    """y [T, B, out] of x [T, B, in], weight and delay [out, in] (delays clamped to [0, max_delay], the
    gradient passing straight through): sum_k x[t - k] @ taps[k].T + bias with linear or Gaussian taps (see
    `flexgen.launch.delay.tap_matrices`); differentiable in x, weight, delay and bias (once). The products run in the
    weight's and delay's promoted dtype, at `taps_precision`. The backward saves x, the weight and the delays,
    and builds the tap matrices again (transposed for the input's gradient). Under torch.compile: custom ops,
    with the default config."""
    return run(BACKEND, OPS, x, weight, delay, bias, TapOptions(int(max_delay), bool(gaussian), float(sigma)), config)
