"""Per-channel (axonal) delays over time, with fractional, learnable delays.

    y_t[b, c, ...] = sum_k w_c[k] x_{t-k}[b, c, ...]        (x_t = 0 for t < 0, k = 0 .. max_delay)

The taps w_c spread a channel's delay d_c over the steps around it: "linear" puts 1 - frac(d_c) on floor(d_c) and
frac(d_c) on the step after (an integer delay is an exact shift), "gaussian" puts a Gaussian of width `sigma`
centred on d_c, normalised over the taps (dilated convolutions with learnable spacings, DCLS, train delays this
way, annealing sigma towards zero). Either way the output is differentiable in d_c: the linear taps give the
one-sided derivative x_{t-floor(d)-1} - x_{t-floor(d)}, defined at integer delays too. The taps run as one
depthwise convolution over time.
"""
import math
import numbers

import torch
import torch.nn.functional as F

__all__ = ["Delay", "INTERPOLATIONS"]

INTERPOLATIONS = ("linear", "gaussian")


class Delay(torch.nn.Module):
    """Delays each of `channels` channels (dim 2 of [T, B, C, ...] inputs) by its own number of steps, at most
    `max_delay`; steps before the start read zeros, so delays past T give zeros.

    `delay`: the initial delays, one number for all channels or one per channel (default 0). With `learnable=True`
    (the default) they are a parameter, `layer.delay`, that may leave [0, max_delay] as it trains: the forward then
    uses the nearest bound and passes the gradient on as if it were not clamped (so a delay can come back);
    `clamp_()` puts the values themselves back in range, `round_()` rounds them to whole steps (for inference
    after training with fractional delays). Fixed delays (`learnable=False`) outside [0, max_delay] are refused.
    `interpolation` is "linear" or "gaussian" (with `sigma`, in steps, > 0; set `layer.sigma` to anneal it).

    >>> import torch, flexgen
    >>> layer = flexgen.Delay(2, max_delay=3, delay=torch.tensor([0.0, 2.0]), learnable=False)
    >>> layer(torch.arange(1.0, 5.0).reshape(4, 1, 1).expand(4, 1, 2)).squeeze(1).T.tolist()
    [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 2.0]]
    """

    def __init__(self, channels, max_delay, delay=0.0, learnable=True, interpolation="linear", sigma=1.0,
                 dtype=None):
        super().__init__()
        if isinstance(channels, bool) or not isinstance(channels, numbers.Integral) or channels < 1:
            raise ValueError(f"channels must be a positive number of channels, got {channels!r}")
        if isinstance(max_delay, bool) or not isinstance(max_delay, numbers.Integral) or max_delay < 0:
            raise ValueError(f"max_delay must be a whole number of steps >= 0, got {max_delay!r}")
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        self.channels, self.max_delay, self.interpolation = int(channels), int(max_delay), interpolation
        self.sigma = sigma
        values = _initial_delays(delay, self.channels, dtype)
        if learnable:
            self.delay = torch.nn.Parameter(values)
        else:
            _check_range(values, self.max_delay)
            self.register_buffer("delay", values)

    @property
    def learnable(self):
        return isinstance(self.delay, torch.nn.Parameter)

    def extra_repr(self):
        items = [f"channels={self.channels}", f"max_delay={self.max_delay}", f"interpolation={self.interpolation!r}"]
        if self.interpolation == "gaussian":
            items.append(f"sigma={self.sigma!r}")
        return ", ".join(items) + ("" if self.learnable else ", learnable=False")

    @torch.no_grad()
    def clamp_(self):
        """Put the delays back in [0, max_delay] (after an optimizer step, say); returns the layer."""
        self.delay.clamp_(0.0, float(self.max_delay))
        return self

    @torch.no_grad()
    def round_(self):
        """Round the delays to whole steps (within range): with linear taps the layer then shifts exactly."""
        self.delay.clamp_(0.0, float(self.max_delay)).round_()
        return self

    def taps(self):
        """The taps [channels, max_delay + 1]: tap k of channel c weighs its input k steps back."""
        delay = self.delay
        if torch.isnan(delay).any():
            bad = torch.nonzero(torch.isnan(delay))[0].item()
            raise ValueError(f"the delay of channel {bad} is NaN")
        bound = float(self.max_delay)
        if not self.learnable:
            _check_range(delay, self.max_delay)
        clamped = delay + (delay.clamp(0.0, bound) - delay).detach()  # the bound's value, the gradient of delay
        if self.interpolation == "linear":
            return _linear_taps(clamped, self.max_delay)
        if self.interpolation == "gaussian":
            return _gaussian_taps(clamped, self.max_delay, self.sigma)
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")

    def forward(self, x):
        if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[2] != self.channels:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"Delay({self.channels}, ...) takes inputs [T, B, {self.channels}, ...], got {shape}")
        if not x.is_floating_point():
            raise TypeError(f"Delay takes floating-point inputs, got {x.dtype}")
        taps = self.taps().to(x.dtype)
        steps, rest = x.shape[0], x.shape[1:]
        # [T, B, C, ...] -> [B * ..., C, T]: channels as the convolution's groups, time as its length
        series = x.movedim(0, -1).movedim(1, -2).reshape(-1, self.channels, steps)
        padded = F.pad(series, (self.max_delay, 0))
        # conv1d correlates: output t reads padded t .. t + max_delay, so the taps go in reversed
        out = F.conv1d(padded, taps.flip(1).unsqueeze(1), groups=self.channels)
        moved = (rest[0], *rest[2:], rest[1], steps)
        return out.reshape(moved).movedim(-2, 1).movedim(-1, 0)


def _initial_delays(delay, channels, dtype):
    if isinstance(delay, torch.Tensor):
        values = delay.detach().to(dtype or (delay.dtype if delay.is_floating_point() else torch.get_default_dtype()))
    elif isinstance(delay, numbers.Real) and not isinstance(delay, bool):
        values = torch.full((), float(delay), dtype=dtype or torch.get_default_dtype())
    else:
        raise TypeError(f"delay must be a number or a tensor of one per channel, got {type(delay).__name__}")
    if values.numel() == 1:
        values = values.reshape(()).expand(channels)
    if values.shape != (channels,):
        raise ValueError(f"delay must hold one value or one per channel ({channels}), got shape {tuple(values.shape)}")
    if torch.isnan(values).any():
        raise ValueError(f"the initial delay of channel {torch.nonzero(torch.isnan(values))[0].item()} is NaN")
    return values.clone()


def _check_range(values, max_delay):
    outside = (values < 0) | (values > max_delay)
    if bool(outside.any()):
        c = torch.nonzero(outside)[0].item()
        raise ValueError(f"the fixed delay of channel {c} is {values[c].item()!r}, outside [0, max_delay={max_delay}]; "
                         "give delays in range, or a larger max_delay")


def _linear_taps(delay, max_delay):
    """1 - frac(d) on floor(d), frac(d) on floor(d) + 1 (dropped past max_delay, where frac is 0)."""
    whole = delay.detach().floor().long()
    frac = delay - whole.to(delay.dtype)
    here = F.one_hot(whole, max_delay + 2).to(delay.dtype)
    after = F.one_hot(whole + 1, max_delay + 2).to(delay.dtype)
    taps = here * (1.0 - frac)[:, None] + after * frac[:, None]
    return taps[:, :max_delay + 1]


def _gaussian_taps(delay, max_delay, sigma):
    if not (isinstance(sigma, numbers.Real) and not isinstance(sigma, bool) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a positive number of steps for gaussian taps, got {sigma!r}; anneal it "
                         "towards 0, then round_() the delays and use interpolation='linear'")
    k = torch.arange(max_delay + 1, dtype=delay.dtype, device=delay.device)
    logits = -((k[None, :] - delay[:, None]) ** 2) / (2.0 * sigma * sigma)
    return torch.softmax(logits, dim=1)  # exp(logits) normalised over the taps, without underflow to 0 / 0
