"""The delay lines of a recurrent layer's feedback, as the host runs them: what each step's product reads from the
outputs sent before it, where that product's gradient goes back to, and the gradients of the weight and the line.

    DelayLine:   linear taps, two per hidden neuron (lag + 1 and lag + 2 steps back), what the fused kernels read.
    TapLine:     any taps [H, max_delay + 1] (gaussian ones), tap j reading the output j + 1 steps back.
    SynapseLine: a delay per synapse: the weight is max_delay + 1 tap matrices side by side, [H, (max_delay + 1) H],
                 tap matrix j reading the outputs j + 1 steps back (`flexgen.SynapseDelay.tap_matrices`).

The fused kernels take a line's `forward_values` and `backward_values` after the weight (and bias), and its
`constexprs(tiling)`.
"""
import functools
from typing import NamedTuple

import torch

from ..delay.conv import causal_conv
from ..abi import summed_over_steps_and_rows

TAP_VALUES = 4096  # values of a TapLine's block of taps in a fused program (see TapLine.constexprs)


def line_of(values, max_delay, weight):
    """The line a delayed layer's call reads through: `values` are its delays ([H], linear taps: a `DelayLine`) or
    its taps ([H, max_delay + 1]: a `TapLine`); without them, a `SynapseLine` where `weight` holds tap matrices
    side by side ([H, n H], see `taps_of`), else None."""
    dtype = weight.dtype
    if values is None:
        n_taps = taps_of(weight)
        return None if n_taps is None else SynapseLine(n_taps)
    if values.dim() == 2:
        return TapLine(values.detach().to(dtype), torch.promote_types(values.dtype, dtype))
    return DelayLine.of(values, max_delay, dtype)


def weight_gradient(grad_current, fed_back, dtype=None):
    """dL/dW[j, k] = sum over steps t >= 1 and rows b of grad_I[t, b, j] * s[t - 1, b, k]: one matrix product, in
    the I/O dtype, or in `dtype` (the weight's) straight from cuBLAS where it gives 16-bit products an fp32 result
    (`_mm_gives`): no cast after, and no rounding of the sums to 16 bits."""
    hidden = fed_back.shape[-1]
    a, b = grad_current[1:].reshape(-1, hidden).t(), fed_back[:-1].reshape(-1, hidden)
    if dtype is not None and dtype != a.dtype and _mm_gives(a.device, a.dtype, dtype):
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a, b)


@functools.lru_cache(maxsize=None)
def _mm_gives(device, dtype, out_dtype):
    """Whether torch.mm takes `out_dtype` for `dtype` operands on `device` (CUDA, torch 2.8 and later), tried once."""
    if device.type != "cuda":
        return False
    try:
        ones = torch.ones(16, 16, dtype=dtype, device=device)
        return torch.mm(ones, ones, out_dtype=out_dtype).dtype == out_dtype
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def taps_of(weight):
    """How many tap matrices a recurrent weight holds side by side: n for [H, n H] with n > 1, None for [H, H]."""
    hidden, width = weight.shape[-2:]
    return None if width == hidden else width // hidden


class DelayLine(NamedTuple):
    """A delayed layer's delay line: per hidden neuron, the output reaches the product `lag` + 1 steps later with
    weight 1 - `frac` and `lag` + 2 steps later with weight `frac` (the later tap dropped at `max_delay`)."""

    lag: torch.Tensor  # int32 [H]
    frac: torch.Tensor  # [H], the inputs' dtype
    max_delay: int

    @classmethod
    def of(cls, delay, max_delay, dtype):
        """The line of delays `delay` ([H], a learnable value: used at the nearest bound outside [0, max_delay])."""
        clamped = delay.detach().clamp(0.0, float(max_delay))
        lag = clamped.floor()
        return cls(lag.to(torch.int32), (clamped - lag).to(dtype), int(max_delay))

    def operands(self, fed_back):
        """(near, far): the fed-back outputs each step's product reads, s[t - 1 - lag] and s[t - 2 - lag] per
        hidden neuron (zeros before the first step; far zero where the tap is past max_delay)."""
        near = _steps_back(fed_back, self.lag, 1)
        far = _steps_back(fed_back, self.lag, 2).mul_((self.lag < self.max_delay).to(fed_back.dtype))
        return near, far

    def constexprs(self, tiling):
        return {}

    def forward_values(self, shape, dtype, device):
        return (self.lag, self.frac)

    def backward_values(self, shape, dtype, device):
        """The lags, the fractions and the rows where the fed-back outputs' gradients collect (zero: the backward
        adds what every step sends back)."""
        return (self.lag, self.frac, torch.zeros(shape, dtype=dtype, device=device))

    def fed_back(self, sequence, t):
        """The operand of step t's product: the outputs lag + 1 and lag + 2 steps back mixed by frac (each neuron its
        own; zeros before the first step)."""
        near = _output_at(sequence, t - 1 - self.lag.to(torch.int64))
        far = _output_at(sequence, t - 2 - self.lag.to(torch.int64)) * (self.lag < self.max_delay).to(sequence.dtype)
        return near + self.frac * (far - near)

    def send_back(self, collected, grad_operand, t):
        """Add the gradient of step t's operand to the output steps it read (t - 1 - lag with 1 - frac, t - 2 - lag
        with frac) in `collected` [T, B, H]."""
        batch, hidden = grad_operand.shape
        lag = self.lag.to(torch.int64)
        far_weight = self.frac * (self.lag < self.max_delay).to(grad_operand.dtype)
        for steps, weight in ((t - 1 - lag, 1.0 - self.frac), (t - 2 - lag, far_weight)):
            index = steps.clamp_min(0)[None, None, :].expand(1, batch, hidden)
            collected.scatter_add_(0, index, (grad_operand * (weight * (steps >= 0).to(weight.dtype)))[None])

    def gradients(self, grad_current, fed_back, weight, want_weight, want_delay):
        """(weight's gradient, delays') over all steps: `delayed_gradients`."""
        return delayed_gradients(grad_current, fed_back, weight, self, want_weight, want_delay)


def _steps_back(seq, lag, extra):
    """seq[t - extra - lag[h], :, h] for every step t and column h of [T, B, H] `seq`, zero before step 0."""
    steps, batch, hidden = seq.shape
    source = torch.arange(steps, device=seq.device)[:, None] - extra - lag.to(torch.int64)[None, :]
    taken = seq.gather(0, source.clamp_min(0)[:, None, :].expand(steps, batch, hidden))
    return taken.masked_fill_((source < 0)[:, None, :], 0.0)


def delayed_gradients(grad_current, fed_back, weight, line, want_weight, want_delay):
    """A delayed layer's (weight gradient, delays' gradient), each None unless wanted: the product of step t reads
    o_t = (1 - frac) near_t + frac far_t (`DelayLine.operands`), so dL/dW = sum_t grad_I_t^T o_t and
    dL/d delay = sum over t and rows of (grad_I_t W) * (far_t - near_t) (straight through the clamp)."""
    hidden = fed_back.shape[-1]
    near, far = line.operands(fed_back)
    difference = far.sub_(near)  # far - near; far itself is not needed again
    grad_weight = grad_delay = None
    if want_weight:
        operand = near.add_(difference * line.frac)
        grad_weight = grad_current.reshape(-1, hidden).t() @ operand.reshape(-1, hidden)
    del near
    if want_delay:
        grad_delay = (grad_current.reshape(-1, hidden) @ weight).mul_(difference.reshape(-1, hidden)).sum(0)
    return grad_weight, grad_delay


def _output_at(sequence, steps):
    """sequence[steps[h], :, h] for every column h ([B, H]); zero where steps[h] < 0."""
    batch, hidden = sequence.shape[1:]
    taken = sequence.gather(0, steps.clamp_min(0)[None, None, :].expand(1, batch, hidden))[0]
    return taken * (steps >= 0).to(sequence.dtype)


class TapLine(NamedTuple):
    """A delay line of any taps: step t's product reads o_t = sum_j taps[h, j] s[t - 1 - j] per hidden neuron h."""

    taps: torch.Tensor  # [H, max_delay + 1], the inputs' dtype
    grad_dtype: torch.dtype  # the taps' gradient's: the wider of the taps' own dtype and the inputs'

    def constexprs(self, tiling):
        """N_TAPS, and TAP_BLOCK: how many taps the kernels load at once, as a [TAP_BLOCK, rows, neurons] block of
        independent loads (loaded one tap at a time, each step waited on N_TAPS loads in turn): a power of two, at
        most TAP_VALUES values a block so that it stays in registers."""
        n_taps = self.taps.shape[1]
        widest = tiling.block_b * max(tiling.block, tiling.block_k)
        block = max(1, min(TAP_VALUES // widest, 1 << (n_taps - 1).bit_length()))
        return {"N_TAPS": n_taps, "TAP_BLOCK": 1 << (block.bit_length() - 1)}

    def forward_values(self, shape, dtype, device):
        """The taps and a ring of [N_TAPS + 1, B, H] zeros, row r at r % (N_TAPS + 1), where each step's output
        adds, through the taps, to the later steps' operands (the backward's: each operand's gradient to the outputs
        it read). Zeros, because the first rows have no step N_TAPS before them whose store would clear them."""
        return (self.taps, torch.zeros((self.taps.shape[1] + 1, *shape[1:]), dtype=dtype, device=device))

    backward_values = forward_values

    def _window_weights(self, reach):
        """The taps of the last `reach` steps as [reach, 1, H], oldest step first."""
        return self.taps[:, :reach].flip(1).t()[:, None, :]

    def fed_back(self, sequence, t):
        """The operand of step t's product from the outputs of the steps before it (zeros before the first)."""
        reach = min(t, self.taps.shape[1])
        return (sequence[t - reach:t] * self._window_weights(reach)).sum(0)

    def send_back(self, collected, grad_operand, t):
        """Add the gradient of step t's operand to the output steps it read, in `collected` [T, B, H]."""
        reach = min(t, self.taps.shape[1])
        collected[t - reach:t] += grad_operand * self._window_weights(reach)

    def gradients(self, grad_current, fed_back, weight, want_weight, want_taps):
        """(weight's gradient, taps' gradient), each None unless wanted: dL/dW = sum_t grad_I_t^T o_t, and
        dL/d taps[h, j] = sum over t and rows of (grad_I_t W)[h] * s[t - 1 - j][h]."""
        steps, _, hidden = fed_back.shape
        reach = self.taps.shape[1]
        grad_weight = grad_taps = None
        if want_weight and steps < 2:  # the first step's product reads nothing
            grad_weight = fed_back.new_zeros((hidden, hidden))
        elif want_weight:
            # every step's operand at once: a causal depthwise convolution of the outputs, read one step later
            operands = causal_conv(fed_back[:-1].permute(1, 2, 0), self.taps[:, None, :], reach - 1, groups=hidden)
            grad_weight = grad_current[1:].reshape(-1, hidden).t() @ operands.permute(2, 0, 1).reshape(-1, hidden)
        if want_taps:  # summed in grad_dtype: a 16-bit sum, rounded call by call, would drift over chunked calls
            grad_operand = grad_current @ weight
            grad_taps = fed_back.new_zeros((hidden, reach), dtype=self.grad_dtype)
            for j in range(min(reach, steps - 1)):
                grad_taps[:, j] = summed_over_steps_and_rows(grad_operand[j + 1:] * fed_back[:steps - 1 - j],
                                                             self.grad_dtype)
        return grad_weight, grad_taps


class SynapseLine(NamedTuple):
    """Delays per synapse: the weight is `n_taps` matrices side by side, [H, n_taps H], where M_j[h, i] (columns
    j H + i) weighs neuron i's output j + 1 steps back into neuron h. A step's operand is those outputs side by
    side, [B, n_taps H] (zeros before the first step), so the product is one matrix product as without delays."""

    n_taps: int

    def constexprs(self, tiling):
        return {"N_TAPS": self.n_taps}

    def forward_values(self, shape, dtype, device):
        return ()

    backward_values = forward_values

    def fed_back(self, sequence, t):
        """The outputs of steps t - 1 .. t - n_taps side by side, [B, n_taps H]."""
        steps = [sequence[t - 1 - j] if t - 1 - j >= 0 else sequence.new_zeros(sequence.shape[1:])
                 for j in range(self.n_taps)]
        return torch.cat(steps, dim=-1)

    def send_back(self, collected, grad_operand, t):
        """Add the gradient of step t's operand, [B, n_taps H], to the output steps it read, in `collected`."""
        hidden = collected.shape[-1]
        for j in range(min(t, self.n_taps)):
            collected[t - 1 - j] += grad_operand[:, j * hidden:(j + 1) * hidden]

    def gradients(self, grad_current, fed_back, weight, want_weight, want_delay):
        """(the tap matrices' gradient, None): dL/dM_j = sum over t and rows of grad_I_t^T s[t - 1 - j], one product
        over all steps per tap, in the I/O dtype as the per-neuron lines' weight gradients are (the delays' gradient
        follows from the matrices' through autograd)."""
        if not want_weight:
            return None, None
        steps, _, hidden = fed_back.shape
        blocks = [weight_gradient(grad_current[j:], fed_back[:steps - j]) if j < steps - 1
                  else fed_back.new_zeros((hidden, hidden)) for j in range(self.n_taps)]
        return torch.cat(blocks, dim=1), None
