"""What each kind of flexgen layer keeps between steps, as a stream sees it.

A `Held` adapter names a layer's kept tensors (`read`), points the layer at a stream's buffers so its next call
continues from them (`bind`), and fills the buffers with what a fresh layer starts from (`fill_initial`). A neuron
layer keeps its states (and, with `delay=`, its delay line: the input's last `max_delay` steps), a `Recurrent`
layer its states and last output (and, with a delay, the outputs of its last `max_delay` + 1 steps), a `Dense`
layer nothing of its own: the stream passes it its states and previous output each step (`Dense.forward`'s
`states=` and `previous_output=`), through hooks it removes on `close()`.

`find_layers` walks a model for the flexgen layers a stream runs (not inside one another) and refuses the ones that
keep nothing between calls: a `Delay` or `DelayedLinear` layer on its own reads zeros before each call's first step,
so one step a call would never see a delay.
"""
import torch

from ..layers.delay import Delay, DelayedLinear, SynapseDelay
from ..layers.dense import Chain, Dense
from ..layers.neuron import NeuronModule, initial_states
from ..layers.recurrent import Recurrent


class StreamError(ValueError):
    """A model, input or call a stream cannot run (the message says why and what to do)."""


_CANNOT = {
    Delay: "a Delay layer on its own keeps no line between calls (each call reads zeros before its first step); "
           "give the neuron layer after it `delay=flexgen.Delay(...)`, whose line streams",
    DelayedLinear: "a DelayedLinear layer keeps no inputs between calls (each call reads zeros before its first "
                   "step), so one step a call would never see its delays",
    SynapseDelay: "a SynapseDelay outside a Recurrent layer has no steps of its own; pass it as "
                  "`Recurrent(..., delay=flexgen.SynapseDelay(...))`",
    Chain: "a Chain starts every call from its layers' initial states (it is the long-sequence training mode); "
           "stream its layers in a torch.nn.Sequential instead",
}


def find_layers(model):
    """[(qualified name, layer)] of the flexgen layers a stream runs in `model` (the model itself if it is one),
    outermost only: a `Recurrent` layer's cell or a neuron layer's `Delay` belong to it. A `StreamError` for a
    layer that cannot stream or a model without any."""
    found = []

    def visit(name, module):
        for kind, why in _CANNOT.items():
            if isinstance(module, kind):
                raise StreamError(f"{_label(name, module)} cannot stream: {why}")
        if isinstance(module, (NeuronModule, Recurrent, Dense)):
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    if not found:
        raise StreamError(f"{type(model).__name__} holds no flexgen layer (a neuron layer, Recurrent or Dense): a "
                          "stream keeps flexgen layers' states between steps; run a plain torch model as it is")
    return found


def _label(name, module):
    return f"{type(module).__name__} {name!r}" if name else f"the model ({type(module).__name__})"


def adapter(name, layer):
    """The `Held` adapter of a layer `find_layers` found."""
    if isinstance(layer, NeuronModule):
        return NeuronHeld(name, layer)
    if isinstance(layer, Recurrent):
        return RecurrentHeld(name, layer)
    return DenseHeld(name, layer)


class Held:
    """One layer's kept tensors: `read()` (name -> tensor, after a call), `bind(buffers)`, `fill_initial(buffers)`.
    `prepare()` makes the layer take one step a call; `restore()` undoes it."""

    def __init__(self, name, layer):
        self.name, self.layer = name, layer

    def prepare(self):
        self._step_mode = self.layer.step_mode
        self.layer.step_mode = "s"

    def restore(self):
        self.layer.step_mode = self._step_mode

    def buffers_like(self, read):
        """Buffers for what `read()` gave after one step (lines and histories grown to their full length)."""
        return {k: v.detach().clone() for k, v in read.items()}


def _initial_values(cell, names, buffers):
    """Fill `buffers[name]` for each state of a neuron layer `cell` with its declared initial value."""
    like = next(iter(buffers.values()))
    values = initial_states(cell.spec, cell.hyper, cell.static, like)
    for state, value in zip(cell.spec.signature.states, values):
        if state in names:
            buffers[state].copy_(value)


class NeuronHeld(Held):
    """A neuron layer: its states and, with `delay=`, its line [max_delay, B, ...] (zeros before the first step:
    a full line from the start, so every step runs the same kernels)."""

    def _delayed(self):
        return self.layer.delay is not None and self.layer.delay.max_delay > 0

    def read(self):
        kept = dict(self.layer._states)
        if self._delayed():
            kept["line"] = self.layer.line
        return kept

    def buffers_like(self, read):
        buffers = {k: v.detach().clone() for k, v in read.items() if k != "line"}
        if "line" in read:
            step = read["line"][-1]
            buffers["line"] = step.new_zeros((self.layer.delay.max_delay, *step.shape))
        return buffers

    def bind(self, buffers):
        states = {s: buffers[s] for s in self.layer.spec.signature.states}
        object.__setattr__(self.layer, "_states", states)
        if "line" in buffers:
            object.__setattr__(self.layer, "line", buffers["line"])
            object.__setattr__(self.layer, "_line_buffer", None)  # appended afresh each step: no Python offset

    def fill_initial(self, buffers):
        _initial_values(self.layer, self.layer.spec.signature.states, buffers)
        if "line" in buffers:
            buffers["line"].zero_()


class RecurrentHeld(Held):
    """A `Recurrent` layer: its states, its last output ("output") and, with a delay, the outputs of its last
    max_delay + 1 steps ("sent")."""

    def read(self):
        kept = dict(self.layer.final_states)
        kept["output"] = self.layer.final_output
        if self.layer.delay is not None:
            kept["sent"] = self.layer.sent
        return kept

    def buffers_like(self, read):
        buffers = {k: v.detach().clone() for k, v in read.items() if k != "sent"}
        if "sent" in read:
            buffers["sent"] = read["output"].new_zeros((self.layer.delay.max_delay + 1, *read["output"].shape))
        return buffers

    def bind(self, buffers):
        states = {s: buffers[s] for s in self.layer.spec.signature.states}
        sent = buffers.get("sent")
        self.layer._keep(final_states=states, final_output=buffers["output"], sent=sent)

    def fill_initial(self, buffers):
        _initial_values(self.layer.cell, self.layer.spec.signature.states, buffers)
        buffers["output"].zero_()
        if "sent" in buffers:
            buffers["sent"].zero_()


class DenseHeld(Held):
    """A `Dense` layer: it starts every call from the states passed to it, so the stream passes its buffers (the
    cell's states and, for a recurrent cell, its last output) through a forward pre-hook, which also adds the time
    dimension Dense takes ([1, B, in]); a forward hook takes it off the outputs."""

    def __init__(self, name, layer):
        super().__init__(name, layer)
        if layer.recurrent and layer.cell.delay is not None:
            raise StreamError(f"{_label(name, layer)} cannot stream: its recurrent cell has a delay, whose history "
                              "a Dense layer does not take between calls; stream the Recurrent layer after a "
                              "torch.nn.Linear instead")
        self._buffers, self._hooks = None, []

    def prepare(self):
        self._hooks = [self.layer.register_forward_pre_hook(self._before, with_kwargs=True),
                       self.layer.register_forward_hook(self._after)]

    def restore(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _before(self, module, args, kwargs):
        (x,) = args
        kwargs = dict(kwargs)
        if self._buffers is not None:
            kwargs["states"] = [self._buffers[s] for s in self.layer.cell.spec.signature.states]
            if self.layer.recurrent:
                kwargs["previous_output"] = self._buffers["output"]
        return (x.unsqueeze(0),), kwargs

    def _after(self, module, args, output):
        return tuple(o[0] for o in output) if isinstance(output, tuple) else output[0]

    def read(self):
        kept = dict(self.layer.final_states)
        if self.layer.recurrent:
            kept["output"] = self.layer.final_output
        return kept

    def bind(self, buffers):
        self._buffers = buffers

    def fill_initial(self, buffers):
        cell = self.layer.cell.cell if self.layer.recurrent else self.layer.cell
        _initial_values(cell, cell.spec.signature.states, buffers)
        if "output" in buffers:
            buffers["output"].zero_()


def same_tensor(a, b):
    """Whether two tensors are the same memory seen the same way (a step that handed a buffer back unchanged).
    Inside torch.compile only identity counts (Dynamo does not trace data pointers): a copy onto itself is harmless."""
    if a is b:
        return True
    if torch.compiler.is_compiling():
        return False
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                        and a.dtype == b.dtype)


def copy_into(buffers, kept):
    """Write what a step kept into the buffers, in one multi-tensor copy where torch has it."""
    pairs = [(buffers[k], v) for k, v in kept.items() if not same_tensor(buffers[k], v)]
    if not pairs:
        return
    dst, src = zip(*pairs)
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(list(dst), list(src))
    else:  # (torch < 2.1)
        for d, s in pairs:
            d.copy_(s)

