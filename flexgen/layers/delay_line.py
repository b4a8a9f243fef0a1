"""A neuron layer's delay line: the call that reads its first input through `layer.delay`, and what the line
holds between calls (the first input's last `max_delay` steps, oldest first).

Where the neuron's Triton or C kernels run, the delay line is fused into them (`delayed_neuron`): they read the
input `lag` and `lag` + 1 steps back (linear taps) or every step back weighed by the taps, and a call that
continues a line reads the steps before its first from it; elsewhere the `Delay` layer's output goes into the
neuron's own path.

After a call the layer holds a new line (`held_after`). While calls record no gradient (streaming inference, one
step at a time) the new line is made in place: its steps are appended to a buffer of 2 x `max_delay` rows whose
last `max_delay` the layer holds as a view, and once a call would run past the end the line moves to the front. A
step then costs one row (and a move of `max_delay` rows every `max_delay` steps), where a new line made by a copy
costs `max_delay` rows every call. A call that records a gradient (of anything: the delays' gradient reads the line
too) makes a new line by a copy, as the old one may be saved for its backward and a write into its buffer would
fail that backward.
"""
from typing import NamedTuple

import torch

from ..launch import tracing_or_transforming
from ..launch.backends import Run
from .checks import check_learnable


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


def delayed_call(layer, inputs, states, learnable):
    """A neuron layer's call whose first input goes through `layer.delay`, continuing what the line holds from
    earlier calls (`layer.line`), which it then updates."""
    first = inputs[0] if inputs else None
    layer.delay.check_input(first)
    line = checked_line(layer.line, layer.delay.max_delay, first)
    result = fused_delayed_call(layer, inputs, states, learnable, line)
    records = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (*inputs, *(states or ()), *learnable, *layer.delay.parameters(), line))
    held, buffer = held_after(line, first, layer.delay.max_delay, layer._line_buffer, records)
    object.__setattr__(layer, "line", held)
    object.__setattr__(layer, "_line_buffer", buffer)
    return result


def fused_delayed_call(layer, inputs, states, learnable, line):
    """A call with the delay line fused into the neuron's Triton kernels or C kernels where they run (the
    kernels read the input `lag` and `lag` + 1 steps back, or every step back weighed by the taps; the steps
    before this call's first from `line`, what the line holds from earlier calls, if any), else the `Delay`
    layer's output into the neuron's own path."""
    delay, first = layer.delay, inputs[0]
    neuron = delayed_neuron(layer, first, held=line is not None)
    if neuron is None:
        series = first if line is None else torch.cat([line, first])
        delayed = delay(series)[series.shape[0] - first.shape[0]:]
        result = layer._checked_call(None, (delayed, *inputs[1:]), states, learnable)
        layer._ran(Run(layer.last_run.backend, "delay layer first"))
        return result
    inputs, states, learnable = neuron.check(inputs, states, learnable)
    if delay.interpolation != "linear":  # the taps [C, max_delay + 1]: their gradient reaches the delays
        # in the delays' dtype: the kernels read them in their compute dtype, and a 16-bit copy would round the
        # taps and, call by call, their gradient
        learnable = learnable + [delay.taps()]
    else:
        learnable = learnable + [check_learnable("delay", delay.line_delays(), inputs[0])]
    if line is not None:
        learnable.append(full_line(line, delay.max_delay, inputs[0]))
    return neuron((inputs, states, learnable))


def delayed_kernels(layer, held=False):
    """The kernels with the layer's delay line (kept per max_delay, kind of taps and whether they continue a
    held line: the layer's `delay` and its interpolation may change), or None inside torch.compile's trace
    when they were not looked up before: reading the step's outside values there would break the graph, and
    the `Delay` layer runs instead."""
    line = (layer.delay.max_delay, layer.delay.interpolation != "linear", held)
    kernels = layer._delayed.get(line)
    if kernels is None and not torch.compiler.is_compiling():
        options = {"input": layer._signature.inputs[0], "max_delay": line[0], "tapped": line[1], "held": held}
        kernels = layer.spec.compiled("delayed", options, **layer.static)
        layer._delayed[line] = kernels
    return kernels


def delayed_neuron(layer, first, held=False):
    """The `NeuronCall` of the kernels with the delay line (continuing a held one if `held`) for a call whose
    first input is `first`, or None where they do not run it (the eager backend, the torch path)."""
    if layer.backend in ("eager", "torch") or not isinstance(first, torch.Tensor):
        return None
    compiled = delayed_kernels(layer, held)
    if compiled is None:
        return None
    neuron = layer._neuron_call()._replace(compiled=compiled, recompute=False)
    return neuron if neuron.backend_for(first).name in ("triton", "c") else None
