"""Products over events on the C target: `out = base + x @ weight.t() + bias` for an operand x that is mostly
zeros (spikes), one step a call over buffers made once (`flexgen.streaming.cpu_plan`'s Linear and Recurrent
products).

The C function (`templates/static/c_events.h`, in the frame `c_events.c.j2`; compiled and cached as the neuron
kernels are, by `c_path.load`) lists the nonzero entries, then adds x[b, i] * W[:, i] for those only, a tile of
256 bytes of outputs at a time, over a tiled transposed copy of the weight ([tiles, in, width]: each term one
contiguous 256-byte piece): by rows, each row's events gather their pieces into sums held in vector registers;
by inputs (batches of 4 rows and more, weights larger than a core's L2 cache), each tile's pieces are read in
order, once per chunk of 32 rows, and added to the sums of the rows that have each input: the tile comes at the
memory's streaming rate, not one latency per gathered piece, where it is in no cache (another process on the
machine evicts it). Both add each output's terms in the order of the inputs. It is exact for any values of x, not
only 0 and 1: only the zero terms are skipped (so an inf or nan in the weight where x is 0 does not turn the
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
CHUNK_ROWS = 32  # the rows of a chunk, by inputs (EV_CHUNK_ROWS in c_events.h)
# By inputs from this many batch rows on, for a weight above L2_BYTES: a smaller one stays in a core's L2 cache
# between steps, where the gathers by rows cost less than adding into sums kept in memory (700 -> 512 at B 32:
# 110-150 us by rows, 200-230 by inputs with the weight in L3; 480-590 against 330-380 with it in no cache).
BY_INPUTS_ROWS, L2_BYTES = 4, 256 * 1024
_ARGUMENTS = ([ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int])


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
    steps t with t % len(...) == k, made once; `out` [B, O]. No tensor is allocated per call. `by_inputs`: the
    C function's way through a tile (None: by inputs from `BY_INPUTS_ROWS` rows on where the weight is larger
    than `L2_BYTES`; the same sums either way)."""

    def __init__(self, weight, bias, operands, out, bases=None, threads=1, by_inputs=None):
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
        # the nonzero entries' columns by rows, or rows by columns a chunk of rows at a time (c_events.h)
        self.index = torch.empty(batch * n_in + max(batch, -(-batch // CHUNK_ROWS) * (n_in + 1)), dtype=torch.int32)
        self.dense_above = int(DENSE_SHARE * batch * n_in) if batch > 1 else batch * n_in
        if by_inputs is None:
            by_inputs = batch >= BY_INPUTS_ROWS and self.wt.numel() * self.wt.element_size() > L2_BYTES
        self.by_inputs = bool(by_inputs)
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
                               bias_ptr, out_ptr, out_stride, self.index.data_ptr(), self.dense_above, threads,
                               int(self.by_inputs)))
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
