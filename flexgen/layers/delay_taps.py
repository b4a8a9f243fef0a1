"""The delays' values and their taps, for `flexgen.layers.delay`: the initial delays and the checks of their range
(`initial_delays`, `check_range`), the one clamp rule for a delay outside [0, max_delay] (`clamped_delays`), and the
taps that spread a delay over the steps around it (`linear_taps`, `gaussian_taps`)."""
import math
import numbers

import torch
import torch.nn.functional as F


def clamped_delays(delay, max_delay):
    """The rule every path uses for a delay outside [0, max_delay]: the value of the nearest bound (+-inf
    included; NaN is refused before), the gradient passed on as if there were no clamp, so that a learnable delay
    that left the range can come back. The generated C and Triton kernels clamp the same way (fmin/fmax,
    tl.minimum/tl.maximum) with the same straight-through gradient.

    The value is the clamp's exactly: `d + (clamp(d) - d).detach()` would round, in fp32 to 0 for d = 1e9."""
    return _StraightThroughClamp.apply(delay, float(max_delay))


class _StraightThroughClamp(torch.autograd.Function):
    generate_vmap_rule = True  # torch ops only

    @staticmethod
    def forward(delay, max_delay):
        return delay.clamp(0.0, max_delay)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def first_index(mask):
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def initial_delays(delay, shape, dtype, where):
    if isinstance(delay, torch.Tensor):
        values = delay.detach().to(dtype or (delay.dtype if delay.is_floating_point() else torch.get_default_dtype()))
    elif isinstance(delay, numbers.Real) and not isinstance(delay, bool):
        values = torch.full((), float(delay), dtype=dtype or torch.get_default_dtype())
    else:
        raise TypeError(f"delay must be a number or a tensor, got {type(delay).__name__}")
    if values.numel() == 1:
        values = values.reshape(()).expand(shape)
    if values.shape != shape:
        raise ValueError(f"delay must hold one value or one per {where((0,) * len(shape)).split()[0]} "
                         f"{list(shape)}, got shape {tuple(values.shape)}")
    if torch.isnan(values).any():
        raise ValueError(f"the initial delay of {where(first_index(torch.isnan(values)))} is NaN")
    return values.clone()


def check_range(values, max_delay, where):
    outside = (values < 0) | (values > max_delay)
    if bool(outside.any()):
        index = first_index(outside)
        raise ValueError(f"the fixed delay of {where(index)} is {values[index].item()!r}, outside [0, "
                         f"max_delay={max_delay}]; give delays in range, or a larger max_delay")


def linear_taps(delay, max_delay):
    """1 - frac(d) on floor(d), frac(d) on floor(d) + 1 (dropped past max_delay, where frac is 0)."""
    whole = delay.detach().floor().long()
    frac = (delay - whole.to(delay.dtype)).unsqueeze(-1)
    here = F.one_hot(whole, max_delay + 2).to(delay.dtype)
    after = F.one_hot(whole + 1, max_delay + 2).to(delay.dtype)
    return (here * (1.0 - frac) + after * frac)[..., :max_delay + 1]


def gaussian_taps(delay, max_delay, sigma):
    """Gaussian taps of width sigma around each delay, normalised over the taps (the last dimension)."""
    sigma = checked_sigma(sigma)
    k = torch.arange(max_delay + 1, dtype=delay.dtype, device=delay.device)
    logits = -((k - delay.unsqueeze(-1)) ** 2) / (2.0 * sigma * sigma)
    return torch.softmax(logits, dim=-1)  # exp(logits) normalised over the taps, without underflow to 0 / 0


def checked_sigma(sigma):
    if not (isinstance(sigma, numbers.Real) and not isinstance(sigma, bool) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a positive number of steps for gaussian taps, got {sigma!r}; anneal it "
                         "towards 0, then round_() the delays and use interpolation='linear'")
    return sigma
