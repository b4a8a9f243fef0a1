"""What a recurrent layer's call gets from the outputs before it, through the feedback weight.

An undelayed layer's output before the call adds its product to the first step's input (`with_previous_output`;
on the fused path without autograd the kernels take it themselves, `previous_for_kernels`). A layer with delay
lines keeps the fed-back outputs of its last max_delay + 1 steps between calls (`layer.sent`, `last_sent`), which
still feed the first steps of the next call (`with_sent`); its kernels read the delays themselves (`line_values`),
the other paths their taps (`line_taps`). `scaled` and `in_dtype` give the weight as the products read it.
"""
import torch

from ..launch import tracing_or_transforming
from .delay import fed_from_sent


def scaled(weight, scale):
    """The weight with its rows scaled by `scale` (None: the weight itself)."""
    return weight if scale is None else scale[:, None] * weight


def in_dtype(weight, bias, dtype):
    """The weight and bias (or None) in `dtype`."""
    return weight.to(dtype), bias.to(dtype) if bias is not None else None


def line_taps(layer, first):
    """The delay lines' taps [H, max_delay + 1] in the inputs' dtype (the paths that run them as products;
    the fused kernels read the delays themselves)."""
    return layer.delay.taps().to(first.dtype)


def last_sent(sent, fed_back, reach):
    """The fed-back outputs of the last `reach` steps, with the ones kept before this call if it was shorter (a
    copy: a view would keep the whole output sequence alive between calls)."""
    if sent is not None and fed_back.shape[0] < reach:
        fed_back = torch.cat([sent.to(fed_back.dtype), fed_back])
    return fed_back[-reach:].clone() if fed_back.shape[0] else None


def with_sent(layer, checked, sent, weight):
    """The call's inputs with what the outputs sent before it (`sent`, [S, B, H], oldest first) still feed back
    through the delay lines added to its first steps (`fed_from_sent`; in the wider of the taps' and the inputs'
    dtypes, so that a 16-bit call does not round the delays' gradient)."""
    inputs, states, learnable = checked
    current = inputs[layer.input_index]
    if layer._per_synapse():  # tap k's matrix [out, in] as a convolution's kernel [out, in, k]
        reach = layer.delay.max_delay + 1
        kernel, groups = weight.reshape(layer.hidden, reach, layer.hidden).permute(0, 2, 1), 1
    else:
        kernel, groups = layer.delay.taps().unsqueeze(1), layer.hidden
    if current.shape[0] == 0:
        return checked
    early = fed_from_sent(current, sent, kernel, groups)
    if not layer._per_synapse():  # the per-neuron lines' operand, through the weight
        early = early @ weight.to(current.dtype).t()
    inputs = list(inputs)
    inputs[layer.input_index] = torch.cat([current[:len(early)] + early, current[len(early):]])
    return inputs, states, learnable


def with_previous_output(layer, checked, previous_output, weight):
    """The call's inputs with the product of the output before its first step added to that step's input:
    the kernels start from a zero previous output, so a sequence run in chunks adds it here."""
    inputs, states, learnable = checked
    current = inputs[layer.input_index]
    previous = checked_previous_output(layer, previous_output, current)
    if current.shape[0] == 0:
        return checked
    first_step = torch.addmm(current[0], previous, weight.t()).unsqueeze(0)  # one kernel for the product and sum
    inputs = list(inputs)
    inputs[layer.input_index] = first_step if current.shape[0] == 1 else torch.cat([first_step, current[1:]])
    return inputs, states, learnable


def checked_history(layer, previous_output, current):
    """A delayed layer's `previous_output` as the outputs sent before the call, [S, B, H] oldest first: one
    [B, H] output (S = 1), or the history itself (`layer.sent` after a call)."""
    if isinstance(previous_output, torch.Tensor) and previous_output.dim() == 3:
        if previous_output.shape[0] == 0:
            raise ValueError("previous_output as a history [S, B, H] needs at least one step (S >= 1)")
        return torch.stack([checked_previous_output(layer, step, current) for step in previous_output.unbind(0)])
    return checked_previous_output(layer, previous_output, current)[None]


def checked_previous_output(layer, previous_output, current):
    """`previous_output` as [B, H] in the inputs' dtype, or a clear error."""
    if not isinstance(previous_output, torch.Tensor):
        raise TypeError(f"previous_output must be a tensor [B, {layer.hidden}] (e.g. layer.final_output), "
                        f"got {type(previous_output).__name__}")
    if previous_output.device != current.device:
        raise ValueError(f"previous_output is on {previous_output.device}, the inputs on {current.device}")
    try:
        return previous_output.to(current.dtype).expand(current.shape[1:])
    except RuntimeError:
        raise ValueError(f"previous_output must broadcast to [B, {layer.hidden}] = {list(current.shape[1:])}, "
                         f"got {list(previous_output.shape)}") from None


def previous_for_kernels(layer, previous_output, first, save):
    """The output before the call that the fused kernels take the first step's product of, as they take every
    later step's (a launch fewer, and chunks give what one call gives): in calls without autograd (its backward
    is the `addmm`'s), the layer's own kept output (0 or 1, as the product of spikes needs), [B, H] in the
    inputs' dtype, contiguous; else None. (Delayed layers pass none: their outputs before a call are `sent`.)"""
    if (previous_output is None or save or previous_output is not layer.final_output or tracing_or_transforming()
            or previous_output.dtype != first.dtype or previous_output.device != first.device
            or previous_output.shape != first.shape[1:] or not previous_output.is_contiguous()):
        return None
    return previous_output


def line_values(layer, first):
    """What the fused kernels read the delay lines from: the delays [H] with linear taps, in their own dtype
    (whole steps and fractions are taken from them before anything is rounded to a 16-bit I/O dtype: bf16 holds
    no fraction of a delay past 128), else the taps [H, max_delay + 1], also in the delays' dtype: the kernels
    read them in the I/O dtype, and their gradient, which reaches the delays through autograd, comes back
    unrounded; None without delays."""
    if layer.delay is None or layer._per_synapse():  # a delay per synapse is in the weight (its tap matrices)
        return None
    if layer.delay.interpolation == "linear":
        return layer.delay.line_delays()
    return layer.delay.taps()
