"""`flexgen.DelayedLinear` with linear taps as three Triton kernels, without the dense [out, in, max_delay + 1]
kernel that the convolution builds.

Per synapse j <- i, with d = clamp(delay[j, i], 0, K), n = floor(d), f = d - n, a0 = W (1 - f), a1 = W f:

    forward:      y[t, b, j]  = sum_i a0 x[t - n, b, i] + a1 x[t - n - 1, b, i] + bias[j]
    input grad:   gx[s, b, i] = sum_j a0 g[s + n, b, j] + a1 g[s + n + 1, b, j]
    correlations: C0 = sum_{t,b} g[t, b, j] x[t - n, b, i], C1 = sum_{t,b} g[t, b, j] x[t - n - 1, b, i]
                  (C1 = 0 where the tap n + 1 is past K); grad W = (1 - f) C0 + f C1, grad delay = W (C1 - C0)

x and g are 0 outside [0, T); the delay's gradient passes straight through the clamp, as `_Delays.taps` has it.

Each kernel reads a transposed copy of the operand it shifts, [features, T, B], so that the rows (t, b) a
synapse reads are one contiguous run per time step, and tiles over (time, batch) rows and blocks of features.
The two taps of a synapse read the same series one step apart, so the forward and the input's gradient load it
once per window of time steps into two accumulators (one per tap) and shift the second by one step at the end:
one load per two multiply-adds. A window spans many steps so that the synapses of a block, each shifted by its
own delay, read overlapping rows, which stay in the L1 cache. Arithmetic runs in fp32 (fp64 where the input or
the weight is fp64); fp16/bf16 inputs are read as they are.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .ops import DelayBackend, DelayFunction, TapOptions, register_ops, run
from ..triton_path import SpecialisedLaunches, accumulator, launch_specialised

__all__ = ["DelayedLinearConfig", "DEFAULT", "delayed_linear"]


class DelayedLinearConfig(NamedTuple):
    """Tile sizes (powers of two), each capped at the problem's own padded size, and loop unrolling.

    `window`: time steps a forward or input-gradient program reads (it writes window - 1 of them: the extra step
    only feeds the other tap); `block_batch`: batch rows per program; `block_features`: outputs per forward
    program, inputs per input-gradient program; `corr_time`, `corr_batch`, `corr_out`, `corr_in`: the
    correlation kernel's tile of rows (time x batch, looped over) and of synapses (out x in, one per program);
    `unroll`, `grad_input_unroll`, `corr_unroll`: each kernel's loop unrolling. The defaults were the fastest of
    the probe `benchmarks/bench_delays.py --variants` on an H200 (700 -> 256 synapses, T 100 and 250, B 32 and
    256; docs/perf/NOTES.md).
    """

    window: int = 16
    block_batch: int = 32
    block_features: int = 8
    corr_time: int = 8
    corr_batch: int = 16
    corr_out: int = 16
    corr_in: int = 4
    unroll: int = 4
    grad_input_unroll: int = 1
    corr_unroll: int = 2
    num_warps: int = 8


DEFAULT = DelayedLinearConfig()


@triton.jit
def _taps(w, d, max_delay):
    """(n, W (1 - f), W f, f) of delays d clamped to [0, max_delay]."""
    d = tl.minimum(tl.maximum(d, 0.0), max_delay)
    whole = tl.floor(d)
    frac = d - whole
    return whole.to(tl.int32), w * (1.0 - frac), w * frac, frac


@triton.jit
def _rows_shifted(acc, STEP: tl.constexpr, WINDOW: tl.constexpr):
    """acc[k - STEP] at row k of axis 0 (the rows that would come from outside repeat an edge: never stored)."""
    k = tl.arange(0, WINDOW)
    source = tl.minimum(tl.maximum(k - STEP, 0), WINDOW - 1)
    return tl.gather(acc, tl.broadcast_to(source[:, None, None], acc.shape), 0)


@triton.jit
def _two_tap_window(series_ptr, w_ptr, d_ptr, w_block_stride, w_loop_stride, d_block_stride, d_loop_stride,
                    n_loop, feature, feature_ok, t, b, b_ok, steps, batch, series_len, max_delay,
                    SIGN: tl.constexpr, WINDOW: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_F: tl.constexpr,
                    ACC: tl.constexpr, UNROLL: tl.constexpr):
    """(sum_k a0 s_k[t + SIGN n], sum_k a1 s_k[t + SIGN n]) over the n_loop series s_k ([n_loop, T, B]) for a
    window of steps t, batch rows b and a block of features (the tile's last axis), whose synapse with series k
    has its weight at w_ptr + feature * w_block_stride + k * w_loop_stride (its delay likewise).

    Pointers advance (64-bit) rather than k * series_len, which int32 may not hold. Unrolling lets the loads of
    several series be in flight at once: each series is new to the L1 cache, so its first load waits on L2."""
    rows = t[:, None, None] * batch + b[None, :, None]
    ok_rows = b_ok[None, :, None] & feature_ok[None, None, :]
    acc0 = tl.zeros((WINDOW, BLOCK_B, BLOCK_F), ACC)
    acc1 = tl.zeros((WINDOW, BLOCK_B, BLOCK_F), ACC)
    w_ptrs = w_ptr + feature * w_block_stride
    d_ptrs = d_ptr + feature * d_block_stride
    for _k in tl.range(0, n_loop, loop_unroll_factor=UNROLL):
        n, a0, a1, _frac = _taps(tl.load(w_ptrs, mask=feature_ok, other=0.0).to(ACC),
                                 tl.load(d_ptrs, mask=feature_ok, other=0.0).to(ACC), max_delay)
        shift = SIGN * n
        source_t = t[:, None, None] + shift[None, None, :]
        ok = ok_rows & (source_t >= 0) & (source_t < steps)
        u = tl.load(series_ptr + (rows + (shift * batch)[None, None, :]), mask=ok, other=0.0).to(ACC)
        acc0 += a0[None, None, :] * u
        acc1 += a1[None, None, :] * u
        series_ptr += series_len
        w_ptrs += w_loop_stride
        d_ptrs += d_loop_stride
    return acc0, acc1


@triton.jit
def delayed_linear_forward_kernel(x_ptr, w_ptr, d_ptr, bias_ptr, y_ptr, steps, batch, n_in, n_out, series_len,
                                  max_delay, stride_w_out, stride_w_in, stride_d_out, stride_d_in,
                                  HAS_BIAS: tl.constexpr, WINDOW: tl.constexpr, BLOCK_B: tl.constexpr,
                                  BLOCK_OUT: tl.constexpr, ACC: tl.constexpr, UNROLL: tl.constexpr):
    """y [T, B, out] from x as [in, T, B]. A program: steps t0 - 1 .. t0 + WINDOW - 2 (the first only for the
    tap n + 1 of the next), BLOCK_B batch rows, BLOCK_OUT outputs; it loops over the inputs."""
    t = tl.program_id(0) * (WINDOW - 1) - 1 + tl.arange(0, WINDOW)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    j = tl.program_id(2) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    b_ok, j_ok = b < batch, j < n_out
    here, before = _two_tap_window(x_ptr, w_ptr, d_ptr, stride_w_out, stride_w_in, stride_d_out, stride_d_in, n_in,
                                   j, j_ok, t, b, b_ok, steps, batch, series_len, max_delay, -1, WINDOW, BLOCK_B,
                                   BLOCK_OUT, ACC, UNROLL)
    y = here + _rows_shifted(before, 1, WINDOW)  # the tap n + 1 at step t is the tap n at step t - 1
    if HAS_BIAS:
        y += tl.load(bias_ptr + j, mask=j_ok, other=0.0).to(ACC)[None, None, :]
    first = tl.arange(0, WINDOW) == 0
    keep = (~first & (t >= 0) & (t < steps))[:, None, None] & b_ok[None, :, None] & j_ok[None, None, :]
    rows = (t[:, None, None] * batch + b[None, :, None]).to(tl.int64)
    tl.store(y_ptr + rows * n_out + j[None, None, :], y.to(y_ptr.dtype.element_ty), mask=keep)


def forward_grid(steps, batch, n_out, config):
    return (triton.cdiv(steps, config.window - 1), triton.cdiv(batch, config.block_batch),
            triton.cdiv(n_out, config.block_features))


@triton.jit
def delayed_linear_grad_input_kernel(g_ptr, w_ptr, d_ptr, gx_ptr, steps, batch, n_in, n_out, series_len,
                                     max_delay, stride_w_out, stride_w_in, stride_d_out, stride_d_in,
                                     WINDOW: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_IN: tl.constexpr,
                                     ACC: tl.constexpr, UNROLL: tl.constexpr):
    """grad x [T, B, in] from the output's gradient as [out, T, B]. A program: steps s0 .. s0 + WINDOW - 1 (the
    last only for the tap n + 1 of the one before), BLOCK_B batch rows, BLOCK_IN inputs; it loops over outputs."""
    s = tl.program_id(0) * (WINDOW - 1) + tl.arange(0, WINDOW)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    i = tl.program_id(2) * BLOCK_IN + tl.arange(0, BLOCK_IN)
    b_ok, i_ok = b < batch, i < n_in
    here, after = _two_tap_window(g_ptr, w_ptr, d_ptr, stride_w_in, stride_w_out, stride_d_in, stride_d_out, n_out,
                                  i, i_ok, s, b, b_ok, steps, batch, series_len, max_delay, 1, WINDOW, BLOCK_B,
                                  BLOCK_IN, ACC, UNROLL)
    gx = here + _rows_shifted(after, -1, WINDOW)  # the tap n + 1 at step s is the tap n at step s + 1
    last = tl.arange(0, WINDOW) == WINDOW - 1
    keep = (~last & (s < steps))[:, None, None] & b_ok[None, :, None] & i_ok[None, None, :]
    rows = (s[:, None, None] * batch + b[None, :, None]).to(tl.int64)
    tl.store(gx_ptr + rows * n_in + i[None, None, :], gx.to(gx_ptr.dtype.element_ty), mask=keep)


def grad_input_grid(steps, batch, n_in, config):
    return (triton.cdiv(steps, config.window - 1), triton.cdiv(batch, config.block_batch),
            triton.cdiv(n_in, config.block_features))


@triton.jit
def _correlation_tile(x_series, g_series, n, tile, batch_tiles, steps, batch, synapse_ok, j_ok,
                      BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr):
    """Tile `tile` of the (t, b) rows, as stored: g[t] and g[t + 1] [T, B, out], x[t - n] [T, B, out, in]."""
    t = (tile // batch_tiles) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = (tile % batch_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
    rows = (t[:, None] * batch + b[None, :])[:, :, None]  # [T, B, 1]
    row_ok = ((t < steps)[:, None] & (b < batch)[None, :])[:, :, None]
    g_now = tl.load(g_series[None, None, :] + rows, mask=row_ok & j_ok[None, None, :], other=0.0)
    next_ok = row_ok & (t + 1 < steps)[:, None, None] & j_ok[None, None, :]
    g_next = tl.load(g_series[None, None, :] + rows + batch, mask=next_ok, other=0.0)
    source_ok = (t[:, None, None] - n[None, :, :] >= 0)[:, None, :, :]
    u = tl.load(x_series[None, None, :, :] + rows[:, :, :, None],
                mask=row_ok[:, :, :, None] & source_ok & synapse_ok[None, None, :, :], other=0.0)
    return g_now, g_next, u


@triton.jit
def delayed_linear_correlation_kernel(x_ptr, g_ptr, w_ptr, d_ptr, gw_ptr, gd_ptr, steps, batch, n_in, n_out,
                                      series_len, max_delay, stride_w_out, stride_w_in, stride_d_out, stride_d_in,
                                      BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_OUT: tl.constexpr,
                                      BLOCK_IN: tl.constexpr, ACC: tl.constexpr, UNROLL: tl.constexpr):
    """grad W and grad delay [out, in] from x as [in, T, B] and the output's gradient as [out, T, B]. A program:
    BLOCK_OUT x BLOCK_IN synapses; it loops over every (t, b) in tiles of BLOCK_T x BLOCK_B. With u = x[t - n],
    C0 = sum g[t] u and C1 = sum g[t + 1] u: each gathered element of x feeds both."""
    j = tl.program_id(0) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    i = tl.program_id(1) * BLOCK_IN + tl.arange(0, BLOCK_IN)
    j_ok, i_ok = j < n_out, i < n_in
    synapse_ok = j_ok[:, None] & i_ok[None, :]
    w = tl.load(w_ptr + j[:, None] * stride_w_out + i[None, :] * stride_w_in, mask=synapse_ok, other=0.0).to(ACC)
    d = tl.load(d_ptr + j[:, None] * stride_d_out + i[None, :] * stride_d_in, mask=synapse_ok, other=0.0).to(ACC)
    n, _, _, frac = _taps(w, d, max_delay)
    x_series = x_ptr + i.to(tl.int64)[None, :] * series_len - n * batch  # [out, in]: x_i shifted by n steps
    g_series = g_ptr + j.to(tl.int64) * series_len
    c0 = tl.zeros((BLOCK_T, BLOCK_B, BLOCK_OUT, BLOCK_IN), ACC)
    c1 = tl.zeros((BLOCK_T, BLOCK_B, BLOCK_OUT, BLOCK_IN), ACC)
    batch_tiles = tl.cdiv(batch, BLOCK_B)
    tiles = tl.cdiv(steps, BLOCK_T) * batch_tiles
    for k in tl.range(0, tiles, loop_unroll_factor=UNROLL):
        g_now, g_next, u = _correlation_tile(x_series, g_series, n, k, batch_tiles, steps, batch, synapse_ok, j_ok,
                                             BLOCK_T, BLOCK_B)
        uf = u.to(ACC)
        c0 += g_now.to(ACC)[:, :, :, None] * uf
        c1 += g_next.to(ACC)[:, :, :, None] * uf
    c0_sum = tl.sum(tl.sum(c0, axis=0), axis=0)
    c1_sum = tl.where(n + 1 <= max_delay, tl.sum(tl.sum(c1, axis=0), axis=0), 0.0)  # the tap past K is dropped
    out = j[:, None] * n_in + i[None, :]
    tl.store(gw_ptr + out, ((1.0 - frac) * c0_sum + frac * c1_sum).to(gw_ptr.dtype.element_ty), mask=synapse_ok)
    tl.store(gd_ptr + out, (w * (c1_sum - c0_sum)).to(gd_ptr.dtype.element_ty), mask=synapse_ok)


def correlation_grid(n_in, n_out, config):
    return (triton.cdiv(n_out, config.corr_out), triton.cdiv(n_in, config.corr_in))


def _fitted(config, steps, batch, n_in, n_out):
    """The config with each tile capped at its dimension's padded size (tiny layers, tests)."""
    def cap(size, dim):
        return max(1, min(size, triton.next_power_of_2(dim)))

    return config._replace(window=max(2, cap(config.window, steps + 1)), block_batch=cap(config.block_batch, batch),
                           block_features=cap(config.block_features, max(n_in, n_out)),
                           corr_time=cap(config.corr_time, steps), corr_batch=cap(config.corr_batch, batch),
                           corr_out=cap(config.corr_out, n_out), corr_in=cap(config.corr_in, n_in))


_launch_forward = SpecialisedLaunches(delayed_linear_forward_kernel)
_launch_grad_input = SpecialisedLaunches(delayed_linear_grad_input_kernel)
_launch_correlation = SpecialisedLaunches(delayed_linear_correlation_kernel)


def _series(t):
    """[T, B, F] -> [F, T, B], contiguous: one feature's (t, b) rows in a row."""
    return t.permute(2, 0, 1).contiguous()


def _check_sizes(steps, batch):
    if steps * batch >= 2**31:
        raise ValueError(f"DelayedLinear's fused kernels index one feature's T x B rows in int32; T * B = "
                         f"{steps * batch} is too many (use backend='conv')")


def _forward(x, weight, delay, bias, options, config, wrap):
    steps, batch, n_in = x.shape
    n_out = weight.shape[0]
    cfg = _fitted(config, steps, batch, n_in, n_out)
    y = torch.empty(steps, batch, n_out, dtype=x.dtype, device=x.device)
    acc = accumulator(x.dtype, weight.dtype)
    launch_specialised(
        _launch_forward, forward_grid(steps, batch, n_out, cfg),
        (_series(x), weight, delay, bias if bias is not None else weight, y, steps, batch, n_in, n_out,
         steps * batch, int(options.max_delay), weight.stride(0), weight.stride(1), delay.stride(0), delay.stride(1)),
        dict(HAS_BIAS=bias is not None, WINDOW=cfg.window, BLOCK_B=cfg.block_batch, BLOCK_OUT=cfg.block_features,
             ACC=acc, UNROLL=cfg.unroll),
        wrap, num_warps=cfg.num_warps)
    return y


def _grad_input(grad, x, weight, delay, options, config, wrap):
    steps, batch, n_in = x.shape
    n_out = weight.shape[0]
    cfg = _fitted(config, steps, batch, n_in, n_out)
    gx = torch.empty_like(x)
    launch_specialised(
        _launch_grad_input, grad_input_grid(steps, batch, n_in, cfg),
        (_series(grad), weight, delay, gx, steps, batch, n_in, n_out, steps * batch, int(options.max_delay),
         weight.stride(0), weight.stride(1), delay.stride(0), delay.stride(1)),
        dict(WINDOW=cfg.window, BLOCK_B=cfg.block_batch, BLOCK_IN=cfg.block_features,
             ACC=accumulator(grad.dtype, weight.dtype), UNROLL=cfg.grad_input_unroll),
        wrap, num_warps=cfg.num_warps)
    return gx


def _grad_weight_delay(grad, x, weight, delay, options, config, wrap):
    steps, batch, n_in = x.shape
    n_out = weight.shape[0]
    cfg = _fitted(config, steps, batch, n_in, n_out)
    grad_weight = torch.empty(n_out, n_in, dtype=weight.dtype, device=weight.device)
    grad_delay = torch.empty(n_out, n_in, dtype=delay.dtype, device=delay.device)
    launch_specialised(
        _launch_correlation, correlation_grid(n_in, n_out, cfg),
        (_series(x), _series(grad), weight, delay, grad_weight, grad_delay, steps, batch, n_in, n_out,
         steps * batch, int(options.max_delay), weight.stride(0), weight.stride(1), delay.stride(0), delay.stride(1)),
        dict(BLOCK_T=cfg.corr_time, BLOCK_B=cfg.corr_batch, BLOCK_OUT=cfg.corr_out, BLOCK_IN=cfg.corr_in,
             ACC=accumulator(x.dtype, grad.dtype, weight.dtype), UNROLL=cfg.corr_unroll),
        wrap, num_warps=cfg.num_warps)
    return grad_weight, grad_delay


class DelayedLinearFunction(DelayFunction):
    """The "fused" backend's eager forward and backward."""


BACKEND = DelayBackend("fused", DelayedLinearFunction, _forward, _grad_input, _grad_weight_delay, DEFAULT)
OPS = register_ops(BACKEND)


def delayed_linear(x, weight, delay, bias, max_delay, config=DEFAULT):
    """y [T, B, out] of x [T, B, in]; differentiable in x, weight, delay and bias (once). The backward saves x,
    the weight and the delays. Under torch.compile: custom ops, with the default config."""
    _check_sizes(x.shape[0], x.shape[1])
    return run(BACKEND, OPS, x, weight, delay, bias, TapOptions(int(max_delay)), config)
