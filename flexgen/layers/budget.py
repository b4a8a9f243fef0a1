"""A memory budget for the long-sequence mode: how many steps go between checkpoints, chosen from bytes.

`Dense(..., memory_budget=...)` and `Chain(..., memory_budget=...)` take the budget; this module reads it
(`parse_bytes`), measures what a network's layers save for their backward per step on a call's first steps
(`saved_bytes`, `_measure_footprint`) and picks the segment length for the call (`choose_every`, `every_for`).
The budget bounds what a training call keeps for its backward: at the end of the forward
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

from ..launch.bitpack import packed_bytes
from .long_sequence import replays, segmented

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


def every_for(owner, layers, x, bits, tensors):
    """The steps between checkpoints for this call: the owner's `checkpoint_every`, or under a memory budget the
    choice for this call's length (None: the default path), kept in `owner.checkpoint_choice`."""
    if owner.memory_budget is None:
        return owner.checkpoint_every
    every = None
    if segmented(1, tensors):
        needs_grad = tuple(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        key = (tuple(x.shape[1:]), x.dtype, x.device, autocast, needs_grad)
        footprint = _remembered(owner, key, lambda: _measure_footprint(layers, x, bits))

        def segment_bytes(steps):
            # a later segment starts from a fed-back output: it saves the product a first step skips
            first = _remembered(owner, (key, steps), lambda: _saved_by(layers, x[:steps])[0])
            return first + max(0.0, -footprint.fixed)

        every = choose_every(x.shape[0], footprint, owner.memory_budget, type(owner).__name__, segment_bytes)
    owner.checkpoint_choice = every
    return every


MAX_MEASURED = 64  # measurements a layer keeps (per batch size, dtype, device, autocast state and segment length)


def _remembered(owner, key, measure):
    if key not in owner._measured:
        if len(owner._measured) >= MAX_MEASURED:
            owner._measured.clear()
        owner._measured[key] = measure()
    return owner._measured[key]


PROBE_STEPS = (1, 33)  # the footprint's two lengths: the longer spans the chunks of kernels that checkpoint inside


def _measure_footprint(layers, x, bits):
    """What the default path of `layers` saves for the backward besides its input (the caller's), per step and once
    per call, fitted to what it saves on copies of the first 1 and 33 steps of `x` (fewer where x is shorter); a
    checkpoint's bytes; and the bytes per step the long-sequence mode adds to keep the input (packed bits, none
    where it keeps the caller's tensor) and the recurrent layers' fed-back outputs for their replays (bits), and
    while a segment runs (its input, rebuilt from bits or copied)."""
    short, longer = PROBE_STEPS[0], min(PROBE_STEPS[1], x.shape[0])
    sizes, finals = {}, None
    for steps in {short, longer}:
        sizes[steps], finals = _saved_by(layers, x[:steps])
    per_step = (sizes[longer] - sizes[short]) / (longer - short) if longer > short else sizes[short]
    fixed = sizes[short] - short * per_step
    checkpoint = sum(t.numel() * t.element_size() for states, last in finals
                     for t in (*states, *([] if last is None else [last])))
    values = math.prod(x.shape[1:])
    input_per_step = (packed_bytes(values) if bits else 0) + _replay_bytes_per_step(layers, x)
    output_per_step = math.prod(x.shape[1:-1]) * layers[-1].out_features * x.element_size()
    return Footprint(per_step, fixed, checkpoint, input_per_step, values * x.element_size(), output_per_step)


def _replay_bytes_per_step(layers, x):
    """Bytes per step that keeping the recurrent layers' fed-back outputs as bits for their replays takes
    (`flexgen.layers.long_sequence`), after the footprint's runs: they tell which path each layer takes."""
    if torch.is_autocast_enabled(x.device.type):  # the cells run in a 16-bit dtype, which does not replay
        return 0
    rows = math.prod(x.shape[1:-1])
    return sum(packed_bytes(rows * layer.out_features) for layer in layers if replays(layer, x.dtype))


def _saved_by(layers, x):
    """(bytes the default path of `layers` saves for the backward over a copy of `x`, besides the parameters and
    that input; [(final states, last output)] per layer)."""
    parameters = [p for layer in layers for p in layer.parameters()]
    piece = x.detach().clone().requires_grad_(x.requires_grad)
    return saved_bytes(lambda: _run_unkept(layers, piece), exclude=[*parameters, piece])


def _run_unkept(layers, x):
    """[(final states, last fed-back output)] per layer of the default path over `x`, from the initial states,
    leaving the layers' kept states and outputs as they were."""
    finals = []
    for layer in layers:
        kept = (layer.cell.final_states, layer.cell.final_output, layer.cell.sent) if layer.recurrent else None
        try:
            outputs, states, last = layer._run_on(x, None, None, None)
        finally:
            if kept is not None:
                layer.cell.final_states, layer.cell.final_output, layer.cell.sent = kept
        finals.append((states, last))
        x = outputs[0]
    return finals
