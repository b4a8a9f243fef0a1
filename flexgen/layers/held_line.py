"""What a neuron layer's delay line holds between calls: the first input's last `max_delay` steps, oldest first.

A call that continues a line passes it to the kernels, which read the steps before its first from it, and then
holds a new line. While calls record no gradient (streaming inference, one step at a time) the new line is made
in place: its steps are appended to a buffer of 2 x `max_delay` rows whose last `max_delay`
the layer holds as a view, and once a call would run past the end the line moves to the front. A step then costs
one row (and a move of `max_delay` rows every `max_delay` steps), where a new line made by a copy costs
`max_delay` rows every call. A call that records a gradient (of anything: the delays' gradient reads the line
too) makes a new line by a copy, as the old one may be saved for its backward and a write into its buffer would
fail that backward.
"""
from typing import NamedTuple

import torch

from ..launch import tracing_or_transforming


class LineBuffer(NamedTuple):
    """A streamed line: `rows` [2 max_delay, ...], of which rows `start` .. `start` + max_delay are the line."""

    rows: torch.Tensor
    start: int

    @property
    def line(self):
        return self.rows[self.start:self.start + self.rows.shape[0] // 2]

    def holds(self, line):
        """Whether `line` (a `checked_line`: in the call's dtype and step shape) is this buffer's line."""
        view = self.line
        return (line is not None and line.dtype == view.dtype and line.shape == view.shape
                and line.device == view.device and line.data_ptr() == view.data_ptr()
                and line.stride() == view.stride())


def checked_line(line, max_delay, first):
    """What the line holds from earlier calls, in the input's dtype, or None; an error if this call's steps
    do not continue them (another batch or shape, another device)."""
    if line is None or not max_delay:  # (a layer whose delay was replaced by one of no steps)
        return None
    if line.shape[1:] != first.shape[1:]:
        raise ValueError(f"the delay line holds inputs of shape {list(line.shape[1:])} per step from earlier "
                         f"calls, this call's are {list(first.shape[1:])}: call layer.reset() before a new "
                         "sequence")
    if line.device != first.device:
        raise ValueError(f"the delay line holds inputs on {line.device} from earlier calls, this call's are on "
                         f"{first.device}: move the layer with .to() (its line moves too) or call layer.reset()")
    return line.to(first.dtype)


def full_line(line, max_delay, first):
    """The held line as the kernels read it: max_delay steps (the last ones, if the layer's delay was replaced by
    a shorter one), zeros before the sequence began, contiguous."""
    missing = max_delay - line.shape[0]
    if missing > 0:
        line = torch.cat([line.new_zeros((missing, *line.shape[1:])), line])
    elif missing < 0:
        line = line[-max_delay:]
    return line.to(first.dtype).contiguous()


def held_after(line, first, max_delay, buffer, records):
    """(line, buffer) after a call whose first input is `first` and which continued `line` (None: none): the
    input's last max_delay steps, with the ones held before if the call was shorter, and the `LineBuffer` it is a
    view of (None where it is a tensor of its own). `records`: whether the call recorded a gradient."""
    steps = first.shape[0]
    if not max_delay or (line is None and not steps):
        return line, None
    if steps >= max_delay:
        return first[-max_delay:].clone(), None  # a copy: a view would keep the whole input alive between calls
    if not records and not tracing_or_transforming():  # (a buffer kept between calls must be this process's)
        return _appended(line, first, max_delay, buffer)
    if line is None:
        return first.clone(), None
    return torch.cat([line[steps - max_delay:], first]), None  # one copy of max_delay steps at most


def _appended(line, first, max_delay, buffer):
    """The line with `first`'s steps (fewer than max_delay) appended in `buffer`, made from `line` if the buffer
    does not hold it."""
    if buffer is None or buffer.rows.shape[0] != 2 * max_delay or not buffer.holds(line):
        rows = first.new_zeros((2 * max_delay, *first.shape[1:]))
        if line is not None:
            kept = line[-max_delay:]
            rows[max_delay - kept.shape[0]:max_delay] = kept
        buffer = LineBuffer(rows, 0)
    rows, start, steps = buffer.rows, buffer.start, first.shape[0]
    if start + max_delay + steps > rows.shape[0]:  # to the front (the two ranges may overlap: through a copy)
        rows[:max_delay] = rows[start:start + max_delay].clone()
        start = 0
    rows[start + max_delay:start + max_delay + steps] = first
    buffer = LineBuffer(rows, start + steps)
    return buffer.line, buffer
