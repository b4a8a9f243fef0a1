"""Spike tensors kept as one bit per value: what a long-sequence layer saves of its input for the backward.

A [T, ...] tensor of zeros and ones becomes [T, ceil(n / 8)] bytes (n values per step, the first value in the
lowest bit), and back. Packing refuses anything but 0 and 1: a float that is not a spike cannot be rebuilt from a bit.
"""
import functools
import math

import torch

BITS = 8


@functools.lru_cache(maxsize=None)
def _bit_weights(device):
    # made once per device: torch.tensor from a list on a GPU is a copy that waits for the device's queued work
    return torch.tensor([1 << i for i in range(BITS)], dtype=torch.uint8, device=device)


def packed_bytes(values):
    """Bytes a step of `values` values takes packed (`pack_spikes`)."""
    return math.ceil(values / BITS)


def all_spikes(x):
    """Whether `x` holds only 0 and 1, as a 0-d bool tensor (no device sync)."""
    return (x == 0).logical_or_(x == 1).all()


def check_binary(x, owner):
    """Raise a ValueError naming the first value of `x` that is neither 0 nor 1 (one device sync)."""
    bad = (x != 0) & (x != 1)
    if bool(bad.any()):
        index = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"{owner} keeps its input as one bit per value for the backward, so the input must hold only 0 and 1 "
            f"(spikes); x{list(index)} = {x[index].item()!r}. Give this layer spikes, or run it without "
            "checkpoint_every (the default path keeps its input as it is)"
        )


def pack_spikes(x):
    """[T, ...] zeros and ones -> [T, ceil(n / 8)] uint8, n the values per step (8 per byte, first value lowest)."""
    steps, per_step = x.shape[0], math.prod(x.shape[1:])
    padded = torch.zeros(steps, packed_bytes(per_step) * BITS, dtype=torch.uint8, device=x.device)
    padded[:, :per_step] = x.reshape(steps, per_step)
    return (padded.view(steps, -1, BITS) * _bit_weights(x.device)).sum(dim=2, dtype=torch.uint8)


def unpack_spikes(packed, step_shape, dtype):
    """The inverse of `pack_spikes`: [T, *step_shape] in `dtype` from [T, ceil(n / 8)] bytes."""
    steps, per_step = packed.shape[0], math.prod(step_shape)
    bits = (packed.unsqueeze(2) & _bit_weights(packed.device)) != 0
    return bits.reshape(steps, -1)[:, :per_step].to(dtype).reshape(steps, *step_shape)
