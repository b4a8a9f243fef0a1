"""The dense tap matrices of `flexgen.DelayedLinear`'s "taps" backend, and their gradient, as two Triton kernels.

For the synapse j <- i with weight w and delay d (clamped to [0, K], K = max_delay):

    taps[k, j, i] = w tap_k(d),   k = 0 .. K
    linear:    tap_n = 1 - f, tap_(n+1) = f (n = floor(d), f = d - n; the tap past K is dropped), others 0
    gaussian:  tap_k = e_k / sum_m e_m,  e_k = exp(-(k - d)^2 s + (p - d)^2 s),  s = 1 / (2 sigma^2)

(p is the tap nearest d, where the exponent peaks: subtracting it keeps e_p = 1, as a softmax does.) From the
taps' gradient G[k, j, i]:

    linear:    grad w = (1 - f) G_n + f G_(n+1),           grad d = w (G_(n+1) - G_n)
    gaussian:  grad w = sum_k G_k tap_k = A,                grad d = 2 s w (sum_k G_k tap_k (k - d) - A c),
               c = sum_k tap_k (k - d)

The delay's gradient passes straight through the clamp, as `flexgen.layers.delay._Delays.taps` has it. One program
holds a tile of synapses and loops over the taps: the matrices are written once, in any layout (the forward's
[K + 1, out, in], the input gradient's [K + 1, in, out]), zero-padded to a given extent; nothing of the torch
code this replaces (a dozen elementwise ops forward and back, each a launch) is left on the host.
"""
import struct

import torch
import triton
import triton.language as tl

from ..triton_path import SpecialisedLaunches, accumulator, launch_specialised

__all__ = ["tap_matrices", "tap_matrices_gradient"]

BLOCK_OUT, BLOCK_IN, WARPS = 32, 32, 4


@triton.jit
def _synapse_tile(weight_ptr, delay_ptr, n_out, n_in, max_delay, COMPUTE: tl.constexpr, BLOCK_J: tl.constexpr,
                  BLOCK_I: tl.constexpr):
    """This program's synapses: indices j, i, their weights, and their delays clamped to [0, max_delay] (zero
    weight and delay outside [0, n_out) x [0, n_in))."""
    j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    inside = (j < n_out)[:, None] & (i < n_in)[None, :]
    at = j.to(tl.int64)[:, None] * n_in + i[None, :]
    w = tl.load(weight_ptr + at, mask=inside, other=0.0).to(COMPUTE)
    d = tl.load(delay_ptr + at, mask=inside, other=0.0).to(COMPUTE)
    return j, i, w, tl.minimum(tl.maximum(d, 0.0), max_delay)


@triton.jit
def _scale(scale_hi, scale_lo, d):
    """scale_hi + scale_lo in d's dtype (each added to a tensor of it: an fp32 sum would round it; the cast: under
    Inductor float arguments arrive as fp64)."""
    return ((tl.zeros_like(d) + scale_hi) + scale_lo).to(d.dtype)


@triton.jit
def _gaussian_exponent(k, d, peak, scale):
    """-(k - d)^2 s + (p - d)^2 s: 0 at the nearest tap, negative elsewhere."""
    return ((peak - d) * (peak - d) - (k - d) * (k - d)) * scale


@triton.jit
def _gaussian_total(d, peak, scale, n_taps):
    total = tl.zeros(d.shape, d.dtype)
    k = tl.zeros(d.shape, d.dtype)
    for _ in range(0, n_taps):
        total += tl.exp(_gaussian_exponent(k, d, peak, scale))
        k += 1.0
    return total


@triton.jit
def _linear_tap(k, d):
    whole = tl.floor(d)
    frac = d - whole
    return tl.where(k == whole, 1.0 - frac, tl.where(k == whole + 1.0, frac, 0.0))


@triton.jit
def tap_matrices_kernel(weight_ptr, delay_ptr, out_ptr, n_out, n_in, extent_out, extent_in, n_taps, max_delay,
                        scale_hi, scale_lo, stride_k, stride_j, stride_i, GAUSSIAN: tl.constexpr,
                        COMPUTE: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr):
    """out[k, j, i] (at k stride_k + j stride_j + i stride_i) = weight[j, i] tap_k(delay[j, i]) for j <
    extent_out, i < extent_in: zero past n_out, n_in. weight, delay [n_out, n_in] contiguous; the gaussian's
    s = 1 / (2 sigma^2) comes as scale_hi + scale_lo (two fp32 numbers: one would round an fp64 s)."""
    j, i, w, d = _synapse_tile(weight_ptr, delay_ptr, n_out, n_in, max_delay, COMPUTE, BLOCK_J, BLOCK_I)
    out = out_ptr + j.to(tl.int64)[:, None] * stride_j + i.to(tl.int64)[None, :] * stride_i
    store_ok = (j < extent_out)[:, None] & (i < extent_in)[None, :]
    if GAUSSIAN:
        scale = _scale(scale_hi, scale_lo, d)
        peak = tl.floor(d + 0.5)
        w = w / _gaussian_total(d, peak, scale, n_taps)
    k = tl.zeros(d.shape, COMPUTE)
    for _ in range(0, n_taps):
        if GAUSSIAN:
            tap = tl.exp(_gaussian_exponent(k, d, peak, scale))
        else:
            tap = _linear_tap(k, d)
        tl.store(out, (w * tap).to(out_ptr.dtype.element_ty), mask=store_ok)
        out += stride_k
        k += 1.0


@triton.jit
def tap_matrices_gradient_kernel(grad_ptr, weight_ptr, delay_ptr, grad_weight_ptr, grad_delay_ptr, n_out, n_in,
                                 tap_stride, n_taps, max_delay, scale_hi, scale_lo, GAUSSIAN: tl.constexpr,
                                 COMPUTE: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr):
    """grad_weight, grad_delay [n_out, n_in] of the taps' gradient grad [n_taps, n_out, n_in] (all contiguous;
    tap_stride = n_out n_in)."""
    j, i, w, d = _synapse_tile(weight_ptr, delay_ptr, n_out, n_in, max_delay, COMPUTE, BLOCK_J, BLOCK_I)
    inside = (j < n_out)[:, None] & (i < n_in)[None, :]
    at = j.to(tl.int64)[:, None] * n_in + i[None, :]
    if GAUSSIAN:
        scale = _scale(scale_hi, scale_lo, d)
        peak = tl.floor(d + 0.5)
        norm = 1.0 / _gaussian_total(d, peak, scale, n_taps)
        weighted = tl.zeros(d.shape, COMPUTE)  # sum_k G_k tap_k
        weighted_lag = tl.zeros(d.shape, COMPUTE)  # sum_k G_k tap_k (k - d)
        mean_lag = tl.zeros(d.shape, COMPUTE)  # sum_k tap_k (k - d)
        k = tl.zeros(d.shape, COMPUTE)
        grad_k = grad_ptr + at
        for _ in range(0, n_taps):
            tap = tl.exp(_gaussian_exponent(k, d, peak, scale)) * norm
            g = tl.load(grad_k, mask=inside, other=0.0).to(COMPUTE)
            weighted += g * tap
            weighted_lag += g * tap * (k - d)
            mean_lag += tap * (k - d)
            grad_k += tap_stride
            k += 1.0
        grad_w = weighted
        grad_d = 2.0 * scale * w * (weighted_lag - weighted * mean_lag)
    else:
        whole = tl.floor(d)
        frac = d - whole
        n = whole.to(tl.int64)
        here = tl.load(grad_ptr + n * tap_stride + at, mask=inside, other=0.0).to(COMPUTE)
        after = tl.load(grad_ptr + (n + 1) * tap_stride + at, mask=inside & (n + 1 < n_taps), other=0.0)
        after = after.to(COMPUTE)
        grad_w = (1.0 - frac) * here + frac * after
        grad_d = w * (after - here)
    tl.store(grad_weight_ptr + at, grad_w.to(grad_weight_ptr.dtype.element_ty), mask=inside)
    tl.store(grad_delay_ptr + at, grad_d.to(grad_delay_ptr.dtype.element_ty), mask=inside)


def tap_matrices_grid(extent_out, extent_in):
    return (triton.cdiv(extent_out, BLOCK_OUT), triton.cdiv(extent_in, BLOCK_IN))


_launch_tap_matrices = SpecialisedLaunches(tap_matrices_kernel)
_launch_tap_matrices_gradient = SpecialisedLaunches(tap_matrices_gradient_kernel)


def _split_scale(sigma):
    """1 / (2 sigma^2) as two fp32 numbers whose sum carries about 48 bits (Triton passes floats as fp32)."""
    scale = 0.5 / (float(sigma) * float(sigma))
    try:
        high = _to_fp32(scale)
    except OverflowError:
        raise ValueError(f"sigma={sigma!r} is too small for gaussian taps: 1 / (2 sigma^2) overflows float32") from None
    return high, _to_fp32(scale - high)


def _to_fp32(value):
    return struct.unpack("f", struct.pack("f", value))[0]


def tap_matrices(weight, delay, max_delay, gaussian, sigma, transposed=False, multiple=16, wrap=None):
    """The taps [K + 1, out, in] of weight and delay [out, in] (transposed: [K + 1, in, out]) in the weight's
    and delay's promoted dtype, the last dimension zero-padded to a multiple of `multiple`. Not differentiable
    (`tap_matrices_gradient` is the backward). `wrap`: see `launch_specialised`."""
    n_out, n_in = weight.shape
    rows, cols = (n_in, n_out) if transposed else (n_out, n_in)
    width = cols + -cols % multiple
    out = torch.empty(max_delay + 1, rows, width, dtype=torch.promote_types(weight.dtype, delay.dtype),
                      device=weight.device)
    strides = (out.stride(0), 1, width) if transposed else (out.stride(0), width, 1)
    extent_out, extent_in = (width, n_in) if transposed else (n_out, width)
    launch_specialised(
        _launch_tap_matrices, tap_matrices_grid(extent_out, extent_in),
        (weight.contiguous(), delay.contiguous(), out, n_out, n_in, extent_out, extent_in, max_delay + 1,
         int(max_delay), *_split_scale(sigma if gaussian else 1.0), *strides),
        dict(GAUSSIAN=bool(gaussian), COMPUTE=accumulator(weight.dtype, delay.dtype), BLOCK_J=BLOCK_OUT,
             BLOCK_I=BLOCK_IN),
        wrap, num_warps=WARPS)
    return out


def tap_matrices_gradient(grad, weight, delay, max_delay, gaussian, sigma, wrap=None):
    """(grad weight, grad delay) of the taps' gradient grad [K + 1, out, in] (contiguous)."""
    n_out, n_in = weight.shape
    grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format)
    grad_delay = torch.empty_like(delay, memory_format=torch.contiguous_format)
    launch_specialised(
        _launch_tap_matrices_gradient, tap_matrices_grid(n_out, n_in),
        (grad, weight.contiguous(), delay.contiguous(), grad_weight, grad_delay, n_out, n_in, n_out * n_in,
         max_delay + 1, int(max_delay), *_split_scale(sigma if gaussian else 1.0)),
        dict(GAUSSIAN=bool(gaussian), COMPUTE=accumulator(grad.dtype, weight.dtype, delay.dtype),
             BLOCK_J=BLOCK_OUT, BLOCK_I=BLOCK_IN),
        wrap, num_warps=WARPS)
    return grad_weight, grad_delay
