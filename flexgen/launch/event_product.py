"""Products over events on the C target: `out = base + x @ weight.t() + bias` for an operand x that is mostly
zeros (spikes), one step a call over buffers made once (`flexgen.streaming.cpu_plan`'s Linear and Recurrent
products).

The C function (`templates/static/c_events.h`, in the frame `c_events.c.j2`; compiled and cached as the neuron
kernels are, by `c_path.load`) lists each batch row's nonzero entries, then adds x[b, i] * W[:, i] for those i
only, a tile of 256 bytes of outputs at a time, over a tiled transposed copy of the weight ([tiles, in, width]:
each term one contiguous 256-byte piece, the tile's sums in vector registers, a tile's pieces of every input
together so that they stay in the L2 cache while every batch row runs over them). It is exact for any values of
x, not only 0 and 1: only the zero terms are skipped (so an inf or nan in the weight where x is 0 does not turn the
sum into nan, as it does in the dense product). Where more than
`DENSE_SHARE` of the operand's entries are nonzero in a call (batches above one), the C function writes nothing
and the dense product (`torch.addmm`) runs instead: a blocked matrix product then costs less than one row per
event. The transposed copy is refreshed when the weight's version counter moves (in-place updates of the
parameter: optimiser steps, `load_state_dict`), checked every call; a parameter replaced by another tensor is not
seen (the stream keeps the one it was made with).
"""
import ctypes
import functools
import math

import torch

from .. import frames
from . import c_path

# The share of an operand's entries nonzero above which a batch of more than one row runs the dense product: the
# crossover measured for 512 and 1024 wide layers at B 32, 1 thread (docs/streaming.md). One row always runs over
# events: a matrix-vector product reads the whole weight anyway.
DENSE_SHARE = 0.25
TILE_BYTES = 256  # the C function's tile of outputs (EV_TILE_BYTES in c_events.h)
_ARGUMENTS = ([ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int])


@functools.lru_cache(maxsize=None)
def _function(dtype):
    """The compiled C function for fp32 or fp64 (the library compiled once, then from the disk cache)."""
    source = frames.frame("c_events.c.j2").render()
    fn = getattr(c_path.load(source), f"flexgen_event_product_{c_path.DTYPES[dtype][0]}")
    fn.argtypes, fn.restype = _ARGUMENTS, ctypes.c_int
    return fn


def _rows(t, what):
    """The pointer and row stride of a [B, n] tensor whose rows are contiguous (ValueError otherwise)."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"the product's {what} must be [B, n] with contiguous rows, got shape {tuple(t.shape)} "
                         f"and strides {t.stride()}")
    return t.data_ptr(), t.stride(0)


class EventProduct:
    """`out = base + x @ weight.t() + bias` one step a call. `weight` [O, I] and `bias` [O] (or None): the
    parameters (read through detached views); `operands` [B, I] and `bases` [B, O] (or None): the buffers read at
    steps t with t % len(...) == k, made once; `out` [B, O]. No tensor is allocated per call."""

    def __init__(self, weight, bias, operands, out, bases=None, threads=1):
        self.weight = weight.detach()  # shares the parameter's version counter: in-place updates show in it
        self.bias = None if bias is None else bias.detach()
        dtype = out.dtype
        if dtype not in c_path.DTYPES or self.weight.dtype != dtype:
            raise ValueError(f"products over events run fp32 or fp64 (one dtype), got a {self.weight.dtype} weight "
                             f"and a {dtype} output")
        n_out, n_in = self.weight.shape
        batch = out.shape[0]
        if n_in >= 2 ** 31 - 1:
            raise ValueError(f"products over events take fewer than 2**31 - 1 inputs, got {n_in}")
        self.fn = _function(dtype)
        width = TILE_BYTES // self.weight.element_size()
        # W^T in tiles of `width` outputs, [tiles, in, width]; columns past n_out stay zero; filled at the first call
        self.wt = torch.zeros((-(-n_out // width), n_in, width), dtype=dtype)
        self.version = None
        self.index = torch.empty((batch, n_in + 1), dtype=torch.int32)
        self.dense_above = int(DENSE_SHARE * batch * n_in) if batch > 1 else batch * n_in
        bases = bases or [None]
        out_ptr, out_stride = _rows(out, "output")
        if self.bias is not None and (self.bias.shape != (n_out,) or self.bias.stride(0) != 1):
            raise ValueError(f"the product's bias must be contiguous, [{n_out}], got {tuple(self.bias.shape)}")
        bias_ptr = None if self.bias is None else self.bias.data_ptr()
        self.calls, self.dense = [], []
        period = len(operands) * len(bases) // math.gcd(len(operands), len(bases))
        for k in range(period):
            x, base = operands[k % len(operands)], bases[k % len(bases)]
            if x.shape != (batch, n_in) or out.shape != (batch, n_out) or (
                    base is not None and base.shape != out.shape):
                raise ValueError(f"a product of a [{n_out}, {n_in}] weight takes [{batch}, {n_in}] operands into "
                                 f"[{batch}, {n_out}], got {tuple(x.shape)} -> {tuple(out.shape)}")
            x_ptr, x_stride = _rows(x, "operand")
            base_ptr, base_stride = (None, 0) if base is None else _rows(base, "base")
            self.calls.append((batch, n_in, n_out, x_ptr, x_stride, self.wt.data_ptr(), base_ptr, base_stride,
                               bias_ptr, out_ptr, out_stride, self.index.data_ptr(), self.dense_above, threads))
            self.dense.append(functools.partial(self._dense, x, base, out))

    def _tile(self):
        """Copy the weight into the tiles (through views where the weight is contiguous)."""
        tiles, n_in, width = self.wt.shape
        full = self.weight.shape[0] // width
        self.wt[:full].copy_(self.weight[:full * width].reshape(full, width, n_in).transpose(1, 2))
        if full < tiles:
            self.wt[full, :, :self.weight.shape[0] - full * width].copy_(self.weight[full * width:].t())

    def _dense(self, x, base, out):
        weight_t = self.weight.t()
        if base is None:
            if self.bias is None:
                torch.mm(x, weight_t, out=out)
            else:
                torch.addmm(self.bias, x, weight_t, out=out)
            return
        torch.addmm(base, x, weight_t, out=out)
        if self.bias is not None:
            out.add_(self.bias)

    def __call__(self, t):
        """Step t's product; True where it ran over events, False where the operand was dense (`torch.addmm`)."""
        if self.weight._version != self.version:
            self._tile()
            self.version = self.weight._version
        k = t % len(self.calls)
        if self.fn(*self.calls[k]):
            self.dense[k]()
            return False
        return True
