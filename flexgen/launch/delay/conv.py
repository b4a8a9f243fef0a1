"""A causal convolution over time: what a `Delay` with gaussian taps, `DelayedLinear`'s "conv" backend and the
host's delay lines of a recurrent layer's feedback compute with torch's conv1d."""
import torch.nn.functional as F

__all__ = ["causal_conv"]


def causal_conv(series, taps, max_delay, groups=1, bias=None):
    """sum_k taps[..., k] series[..., t - k] (+ bias[c]) over [N, C, T] series, zeros before t = 0."""
    padded = F.pad(series, (max_delay, 0))
    # conv1d correlates: output t reads padded t .. t + max_delay, so the taps go in reversed
    return F.conv1d(padded, taps.flip(-1), bias, groups=groups)
