"""A memory budget for the long-sequence mode: how many steps go between checkpoints, chosen from bytes.

`Dense(..., memory_budget=...)` and `Chain(..., memory_budget=...)` take the budget; this module reads it
(`parse_bytes`), measures what a network saves for its backward per step (`saved_bytes`) and picks the segment
length (`choose_every`). The budget bounds what a training call keeps for its backward: at the end of the forward
(every checkpoint, the kept input) plus, during the backward, the values of the one segment it re-runs. The
parameters, their gradients, the call's input and output and the kernels' own scratch are not in it.

    held(K) = (ceil(T / K) - 2) * checkpoint + input + K * (per_step + unpacked + output) + fixed + checkpoint

The default path holds T * per_step + fixed. It runs when that fits (it recomputes nothing), else the largest K
whose held(K) fits: the fewest segments, so the fewest re-run launches.
"""
import math
import numbers
import re
from typing import NamedTuple

import torch

__all__ = ["MemoryBudgetError", "Footprint", "parse_bytes", "saved_bytes", "choose_every"]

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class MemoryBudgetError(ValueError):
    """A memory budget too small for a call: the message says how much the call needs and what to change."""


class Footprint(NamedTuple):
    """Bytes a training call of a network holds for its backward, measured on a few of its steps."""

    per_step: float  # saved per step on the default path (all layers)
    fixed: float  # saved once per call whatever its length (negative where a layer saves one step less, as a
    # recurrent product that has no previous output at the first step)
    checkpoint: int  # one checkpoint: every layer's states and fed-back output at a segment's start
    input_per_step: float  # the input the long-sequence mode keeps, per step (bits for a Dense layer alone)
    unpacked_per_step: float  # a segment's own input (rebuilt from the bits, or the last one's copy), per step
    output_per_step: float = 0.0  # a segment's output through the last layer, which a re-run keeps while it runs


def parse_bytes(value, name="memory_budget"):
    """A number of bytes from an int or float (bytes) or a string with a unit: "512MiB", "2 GB", "1.5GiB"."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of bytes or a string such as '2GiB', got {value!r}")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if match is None or match.group(2).lower() not in UNITS:
            raise ValueError(f"{name}={value!r} is not a size: give bytes (an int) or a number with one of the units "
                             f"{', '.join(u for u in UNITS if u)} (e.g. '512MiB', '2GB')")
        size = float(match.group(1)) * UNITS[match.group(2).lower()]
    elif isinstance(value, numbers.Real):
        size = float(value)
    else:
        raise TypeError(f"{name} must be a number of bytes or a string such as '2GiB', got {type(value).__name__}")
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"{name} must be a positive, finite number of bytes, got {value!r}")
    return int(size)


def saved_bytes(run, exclude=()):
    """(bytes of the distinct storages autograd saves for the backward while `run()` runs, its result), leaving
    out the storages of the tensors in `exclude` (the parameters: they are held whatever the mode)."""
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return sum(seen.values()), result


def held(every, steps, footprint, segment=None):
    """Bytes a call of `steps` steps holds for its backward with a checkpoint every `every` steps, at its most:
    the checkpoints (not the first segment's start, the initial states, nor the last one's, which that segment's
    graph holds: it runs with autograd in the forward), the kept input of the segments before the last, and one
    segment's values (the last one's graph, or a re-run): `segment` bytes where measured, else the footprint's
    estimate."""
    every = min(every, steps)
    stop = (steps - 1) // every * every  # where the last segment starts
    kept = max(stop // every - 1, 0) * footprint.checkpoint + stop * footprint.input_per_step
    if segment is None:
        segment = every * footprint.per_step + max(footprint.fixed, 0.0)
    # a segment but the first also saves the states it starts from, which the footprint's probe (from the
    # initial values, often broadcast numbers) does not: at most a checkpoint's bytes
    starts = footprint.checkpoint if stop else 0
    return kept + segment + starts + every * (footprint.unpacked_per_step + footprint.output_per_step)


def choose_every(steps, footprint, budget, owner, segment_bytes=None):
    """None (the default path fits the budget, as the footprint estimates it) or the largest number of steps between
    checkpoints whose call fits; a `MemoryBudgetError` saying what the call needs where none does.

    `segment_bytes(K)`, where given, measures what a segment of K steps saves: the choice is then shortened until
    that measurement fits, for kernels whose saved bytes grow in steps (checkpoints every few steps inside them)
    rather than by the same bytes every step."""
    if steps * footprint.per_step + footprint.fixed <= budget:
        return None
    best = _least_held(steps, footprint)
    if held(best, steps, footprint) > budget:
        raise MemoryBudgetError(_too_small(steps, footprint, budget, best, owner))
    low, high = best, steps  # held() grows with the segment length past `best`: the last K that fits
    while low < high:
        middle = (low + high + 1) // 2
        if held(middle, steps, footprint) <= budget:
            low = middle
        else:
            high = middle - 1
    return low if segment_bytes is None else _measured_fit(low, steps, footprint, budget, owner, segment_bytes)


MEASURED_TRIES = 8


def _measured_fit(every, steps, footprint, budget, owner, segment_bytes):
    """The largest K up to `every` whose measured segment fits, found by shortening `every` by the excess."""
    for _ in range(MEASURED_TRIES):
        segment = segment_bytes(every)
        total = held(every, steps, footprint, segment)
        if total <= budget:
            return every
        per_step = segment / every + footprint.unpacked_per_step
        every -= max(1, math.ceil((total - budget) / per_step))
        if every < 1:
            break
    raise MemoryBudgetError(_too_small(steps, footprint, budget, max(every, 1), owner))


def _least_held(steps, footprint):
    """The segment length that holds the least: about sqrt(T * checkpoint / per_step), checked around it."""
    guess = math.sqrt(steps * footprint.checkpoint / footprint.per_step) if footprint.per_step else steps
    candidates = {max(1, min(steps, k)) for k in (math.floor(guess), math.ceil(guess), 1, steps)}
    candidates |= {max(1, min(steps, math.ceil(steps / math.ceil(steps / k)))) for k in list(candidates)}
    return min(sorted(candidates), key=lambda k: held(k, steps, footprint))


def _too_small(steps, footprint, budget, best, owner):
    least = held(best, steps, footprint)
    one = footprint.checkpoint + footprint.per_step + footprint.fixed
    what = "to hold one checkpoint and one step" if budget < one else f"for {steps} steps at this batch size"
    kept_input = size_text(steps * footprint.input_per_step)
    per_step = size_text(footprint.per_step + footprint.unpacked_per_step + footprint.output_per_step)
    checkpoints = max(math.ceil(steps / best) - 2, 0)
    return (f"{owner}: memory_budget={size_text(budget)} is too small {what}. The long-sequence mode holds at least "
            f"{size_text(least, up=True)} here (a checkpoint every {best} steps: {checkpoints} checkpoints of "
            f"{size_text(footprint.checkpoint)}, the kept input {kept_input}, one segment's values at {per_step} per "
            f"step). Raise memory_budget to at least {size_text(least, up=True)}, or run the sequence in shorter "
            "calls (passing each call's final_states to "
            "the next), or a smaller batch")


def size_text(size, up=False):
    """Bytes for a message, in B, KiB, MiB or GiB with two decimals (rounded up where `up`: a minimum)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            value = size / scale
            return f"{math.ceil(value * 100) / 100 if up else value:,.2f} {unit}"
    return f"{math.ceil(size)} B"
