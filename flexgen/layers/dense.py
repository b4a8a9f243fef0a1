"""Dense synapses feeding a neuron layer, and stacks of them, with a training mode for long sequences.

    I_t = s_t W^T + b
    outputs_t, states_t = cell(I_t, states_{t-1})

`Dense`'s cell is any flexgen neuron layer or a `flexgen.Recurrent` layer; `Chain` runs Dense layers one after
another. By default the products and the cells run once over the whole sequence and autograd keeps what each of
them saves. With `checkpoint_every=K` a training call keeps, before every segment of K steps, each layer's states
(and a recurrent cell's last output), and besides them only its input: a Dense layer alone packs its input spikes
one bit per value (`flexgen.launch.bitpack`), a Chain keeps its input tensor as it is. The backward takes the segments
last to first: it runs the segment again through every layer from its checkpoints, with autograd on, and
backpropagates through that segment alone, handing the gradients of its starting states to the segment before.
The last segment runs with autograd on in the forward already, so its graph waits for the backward instead of a
re-run: the same memory (one segment's values) and one segment less to recompute. One segment's per-step values
are in memory at a time, whatever T is. A recurrent cell on the fused path also keeps the spikes it fed back, one
bit per neuron and step, and its re-run replays them (`Recurrent.replaying`): every step's recurrent current at
once instead of the fused forward's step-by-step products.

This module holds the layers; the long-sequence mode's autograd function is in `long_sequence`, the choice of K
under a `memory_budget=` in `budget`.
"""
import math
import numbers

import torch
import torch.nn.functional as F

from ..launch.backends import Run, check_name
from .budget import every_for, parse_bytes
from .long_sequence import long_runner, plan_for, segmented, state_names
from .tracing import refuse_jit_trace
from .recurrent import Recurrent, cell_module

__all__ = ["Chain", "Dense"]


class Dense(torch.nn.Module):
    """`in_features` -> `out_features` dense synapses (`weight` [out, in], `bias` [out], initialised as
    `torch.nn.Linear`'s) whose currents drive `neuron` for every step of [T, B, in_features] inputs.

    `neuron` is a `NeuronSpec`, a bundled layer class (`flexgen.LIF`, built with `**params`), a configured layer
    (`flexgen.LIF(tau=3.0)`: its options and parameters; its step mode and state handling are not used) or a
    `flexgen.Recurrent` layer of `out_features` neurons; its neuron must take one input. A configured layer or a
    `Recurrent` runs on the backend it was built with (a different `backend=` here is refused). Unlike a `Recurrent` layer
    alone, every call starts from the neuron's initial states (or `states=[...]`, tensors broadcastable to
    [B, out_features], and for a recurrent cell `previous_output=`); afterwards the final states are in
    `layer.final_states` and, for a recurrent cell, the last fed-back output in `layer.final_output`, so a long
    sequence can be run in several calls by passing them.

    `checkpoint_every=K` (a positive number of steps; None, the default, keeps what autograd keeps) is the
    long-sequence training mode: the input must be spikes (0 and 1, checked), kept as one bit per value, with the
    cell's states every K steps (and a fused recurrent cell's spikes, one bit each, which its re-run replays); the
    backward recomputes each segment of K steps. Same results as the default path
    (equal in fp32 and fp64 up to the order of the weight gradient's sums; in fp16 and bf16 the states round to
    the I/O dtype at every checkpoint, as between two calls). Calls without gradients take the default path.
    `memory_budget=` (bytes, or a string such as "512MiB"; instead of `checkpoint_every`) chooses K per training
    call: the default path where it fits the budget, else the longest segments that fit (`flexgen.layers.budget`), else
    a `flexgen.layers.budget.MemoryBudgetError` saying what the call needs; `layer.checkpoint_choice` is the last call's K.
    `layer.last_run` says what the last call took: the backend its cell ran on and "checkpointed" or "default".

    >>> import torch, flexgen
    >>> layer = flexgen.Dense(6, 4, flexgen.LIF, checkpoint_every=3, backend="torch")
    >>> x = (torch.rand(8, 2, 6) < 0.3).float()
    >>> layer(x).shape, sorted(layer.final_states)
    (torch.Size([8, 2, 4]), ['v'])
    """

    def __init__(self, in_features, out_features, neuron, bias=True, per_neuron=False, checkpoint_every=None,
                 backend="auto", memory_budget=None, **params):
        super().__init__()
        self.in_features = _count("in_features", in_features)
        self.out_features = _count("out_features", out_features)
        self.checkpoint_every = _check_every(checkpoint_every)
        self.memory_budget = _check_budget(memory_budget, checkpoint_every)
        if checkpoint_every is not None or memory_budget is not None:
            long_runner()  # made now, outside any torch.compile trace that would have to make it
        self.checkpoint_choice, self._measured = None, {}
        self.last_run = None  # the `flexgen.launch.backends.Run` the last call took
        check_name(backend)
        self.cell = _dense_cell(neuron, self.out_features, per_neuron, backend, params)
        bound = 1.0 / math.sqrt(self.in_features)  # torch.nn.Linear's initialisation
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features).uniform_(-bound, bound))
        self.bias = torch.nn.Parameter(torch.empty(self.out_features).uniform_(-bound, bound)) if bias else None
        self.final_states, self.final_output = {}, None

    @property
    def recurrent(self):
        return isinstance(self.cell, Recurrent)

    def extra_repr(self):
        items = [f"in_features={self.in_features}", f"out_features={self.out_features}",
                 f"bias={self.bias is not None}"]
        if self.checkpoint_every is not None:
            items.append(f"checkpoint_every={self.checkpoint_every}")
        if self.memory_budget is not None:
            items.append(f"memory_budget={self.memory_budget}")
        return ", ".join(items)

    def forward(self, x, states=None, previous_output=None):
        refuse_jit_trace("flexgen.Dense")
        self._check_input(x)
        if previous_output is not None and not self.recurrent:
            raise TypeError("previous_output is for a recurrent cell (neuron=flexgen.Recurrent(...)); this layer's "
                            "neuron does not feed its output back")
        names, values = zip(*self.named_parameters())
        if self.cell.spec.finite_learnable and not self.recurrent:  # a recurrent cell checks its own
            self.cell._check_finite([getattr(self.cell, w) for w in self.cell._signature.learnable])
        given_states = [] if states is None else list(states)
        every = every_for(self, (self,), x, True, [x, *given_states, *values, previous_output])
        if segmented(every, [x, *given_states, *values, previous_output]):
            plan = plan_for((self,), every, (names,), len(given_states), previous_output is not None, True, x)
            prev = [] if previous_output is None else [previous_output]
            outputs, ((finals, last),) = long_runner()(plan, x, [*given_states, *prev], values)
        else:
            current = projected(x, self.weight, self.bias)
            outputs, finals, last = self._run_cell(current, None, states, previous_output)
        self._keep_finals(finals, last)
        self._keep_run(segmented(every, [x, *given_states, *values, previous_output]))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _keep_run(self, checkpointed):
        """`last_run`: the backend the cell's last call ran on, and "checkpointed" (the long-sequence mode) or
        "default"."""
        cell_run = self.cell.last_run
        backend = cell_run.backend if cell_run is not None else self.cell.backend
        object.__setattr__(self, "last_run", Run(backend, "checkpointed" if checkpointed else "default"))

    def _keep_finals(self, finals, last):
        """Keep where a call ended: the final states and, for a recurrent cell, what it feeds back (`last`: the last
        output, or a delayed cell's outputs of its last max_delay + 1 steps, `_fed_back`)."""
        self.final_states = dict(zip(state_names(self), finals))
        self.final_output = None
        if self.recurrent:
            delayed = self.cell.delay is not None
            self.final_output = last[-1] if delayed and last is not None else last
            self.cell.final_states, self.cell.final_output = dict(self.final_states), self.final_output
            if delayed:
                self.cell.sent = last

    def __getstate__(self):
        """Pickling and `copy.deepcopy` keep where the last call ended, detached from its autograd graph."""
        state = dict(super().__getstate__())
        state["final_states"] = {k: v.detach() for k, v in state.get("final_states", {}).items()}
        if state.get("final_output") is not None:
            state["final_output"] = state["final_output"].detach()
        return state

    def _check_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"Dense takes a tensor [T, B, {self.in_features}], got {type(x).__name__}")
        if x.dim() != 3 or x.shape[2] != self.in_features:
            raise ValueError(f"Dense({self.in_features}, {self.out_features}) takes inputs [T, B, {self.in_features}], "
                             f"got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"Dense takes floating-point inputs, got {x.dtype} (convert spikes with x.float())")
        if x.device != self.weight.device:
            raise ValueError(f"the input is on {x.device}, the layer on {self.weight.device}; move one of them")

    def _run_cell(self, current, cell_params, states, previous_output, sent=None, checks=None):
        """(outputs, final states, last fed-back output or None) of the cell over `current`, with the cell's own
        parameters or, in the backward of the long-sequence path, `cell_params` (name -> tensor) in their place; there
        a recurrent cell replays `sent`, the bits of the spikes the forward fed back, where it can, appending its
        check to `checks` (`Recurrent.replaying`)."""
        if self.recurrent:
            kwargs = {"states": states, "previous_output": previous_output}
            if cell_params is None:
                with self.cell.from_given():
                    result = self.cell(current, **kwargs)
                return _listed(result), list(self.cell.final_states.values()), _fed_back(self.cell)
            # A segment's ends stay out of the cell's attributes: there, a re-run's would hold its autograd graph
            # (and the segment's input, a leaf of it) after the backward.
            kept = self.cell.final_states, self.cell.final_output, self.cell.sent
            try:
                with self.cell.from_given(), self.cell.replaying(sent, checks):
                    result = torch.func.functional_call(self.cell, cell_params, (current,), kwargs)
                return _listed(result), list(self.cell.final_states.values()), _fed_back(self.cell)
            finally:
                self.cell.final_states, self.cell.final_output, self.cell.sent = kept
        neuron = self.cell._neuron_call()._replace(store_state_seqs=False)
        given = cell_params or {}
        learnable = [given[w] if w in given else getattr(self.cell, w) for w in neuron.signature.learnable]
        outputs, finals = neuron(neuron.check([current], states, learnable))
        return outputs, finals, None

    def _run_on(self, x, params, states, previous_output, sent=None, checks=None):
        """`_run_cell` over the synapses' current from `x`, with the layer's own weight, bias and cell parameters or,
        in the long-sequence path, those in `params` (name -> tensor, as `named_parameters` names them)."""
        if params is None:
            return self._run_cell(projected(x, self.weight, self.bias), None, states, previous_output, sent, checks)
        current = projected(x, params["weight"], params.get("bias"))
        return self._run_cell(current, _cell_params(params), states, previous_output, sent, checks)


def projected(x, weight, bias):
    """The synapses' current: `x` [T, B, in] times the weight's transpose, plus the bias, added as a [B, out] view.
    The bias's gradient then sums over T and then over B. F.linear's sums over the T B rows at once, which on CUDA
    stages a buffer of twice the gradient's size, up to 132 MiB, at the backward's peak
    (docs/perf/h100/dense_bias_probe_2026-11-27.log). In 16-bit dtypes the two sums round twice. The bias is read
    in the current's dtype, as F.linear under autocast reads it."""
    current = F.linear(x, weight)
    return current if bias is None else current + bias.to(current.dtype).expand(x.shape[1], bias.shape[0])


class Chain(torch.nn.Module):
    """`Dense` layers one after another, each fed the first output of the layer before; returns the last layer's
    output(s) for [T, B, in_features of the first] inputs.

    `checkpoint_every=K` trains the whole chain in bounded memory: the forward keeps the input tensor (which its
    caller holds anyway; any values, not only spikes) and every layer's states every K steps, nothing per step in
    between; the backward re-runs each segment of K steps through every layer and backpropagates through it, so
    neither the layers' outputs nor their gradients are ever in memory for more than one segment. None (the
    default) runs the layers as they are (each with its own `checkpoint_every`). `memory_budget=` chooses K per
    training call from bytes, as for `Dense` (the chain's input, which its caller holds, is outside the budget).
    Every call starts from the layers' initial states; afterwards each layer's `final_states` (and
    `final_output`) hold where it ended.

    >>> import torch, flexgen
    >>> chain = flexgen.Chain(flexgen.Dense(6, 8, flexgen.LIF, backend="torch"),
    ...                       flexgen.Dense(8, 4, flexgen.LIF, backend="torch"), checkpoint_every=5)
    >>> chain(torch.rand(12, 2, 6)).shape
    torch.Size([12, 2, 4])
    """

    def __init__(self, *layers, checkpoint_every=None, memory_budget=None):
        super().__init__()
        if not layers:
            raise ValueError("Chain needs at least one Dense layer")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Dense):
                raise TypeError(f"Chain takes flexgen.Dense layers; layer {i} is {type(layer).__name__}")
            if i and layers[i - 1].out_features != layer.in_features:
                raise ValueError(f"layer {i - 1} gives {layers[i - 1].out_features} outputs, layer {i} takes "
                                 f"{layer.in_features} inputs")
        self.layers = torch.nn.ModuleList(layers)
        self.checkpoint_every = _check_every(checkpoint_every)
        self.memory_budget = _check_budget(memory_budget, checkpoint_every)
        if checkpoint_every is not None or memory_budget is not None:
            long_runner()  # made now, outside any torch.compile trace that would have to make it
        self.checkpoint_choice, self._measured = None, {}

    def extra_repr(self):
        items = [] if self.checkpoint_every is None else [f"checkpoint_every={self.checkpoint_every}"]
        items += [] if self.memory_budget is None else [f"memory_budget={self.memory_budget}"]
        return ", ".join(items)

    def forward(self, x):
        refuse_jit_trace("flexgen.Chain")
        self.layers[0]._check_input(x)
        named = [tuple(layer.named_parameters()) for layer in self.layers]
        values = [v for layer in named for _, v in layer]
        every = every_for(self, tuple(self.layers), x, False, [x, *values])
        if not segmented(every, [x, *values]):
            for layer in self.layers:
                out = layer(x)
                x = out[0] if isinstance(out, tuple) else out
            return out
        names = tuple(tuple(n for n, _ in layer) for layer in named)
        plan = plan_for(tuple(self.layers), every, names, 0, False, False, x)
        outputs, finals = long_runner()(plan, x, [], values)
        for layer, (states, last) in zip(self.layers, finals):
            layer._keep_finals(states, last)
            layer._keep_run(True)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @property
    def last_run(self):
        """Each layer's `last_run`, in order (a Chain's layers may run on different backends)."""
        return tuple(layer.last_run for layer in self.layers)


def _listed(result):
    return list(result) if isinstance(result, tuple) else [result]


def _cell_params(params):
    return {n[len("cell."):]: p for n, p in params.items() if n.startswith("cell.")}


def _count(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive number of neurons, got {value!r}")
    return int(value)


def _check_every(every):
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, numbers.Integral):
        raise TypeError(f"checkpoint_every must be a positive number of steps or None, got {every!r}")
    if every < 1:
        raise ValueError(f"checkpoint_every must be a positive number of steps, got {every}")
    return int(every)


def _dense_cell(neuron, out_features, per_neuron, backend, params):
    """The neuron layer (or recurrent layer) a `Dense` layer's currents drive, checked to fit it."""
    if isinstance(neuron, Recurrent):
        if params or per_neuron:
            raise TypeError("Dense: a Recurrent layer brings its own parameters; pass them when building it, not here")
        if neuron.hidden != out_features:
            raise ValueError(f"Dense(..., {out_features}) feeds {out_features} currents to a Recurrent layer of "
                             f"{neuron.hidden} neurons; make them equal")
        cell = neuron
    else:
        cell = cell_module(neuron, "Dense", out_features, per_neuron, backend, params)
    if cell is neuron and backend != "auto" and backend != cell.backend:
        raise ValueError(f"Dense(..., backend={backend!r}) around a layer built with backend={cell.backend!r}: a "
                         f"configured layer runs on its own backend; build it with backend={backend!r}, or leave "
                         "Dense's at 'auto'")
    inputs = cell.spec.signature.inputs
    if len(inputs) != 1:
        raise ValueError(f"Dense feeds one current to its neuron; {cell.spec.__name__} takes {len(inputs)} inputs "
                         f"{inputs}")
    return cell


def _check_budget(budget, every):
    if budget is None:
        return None
    if every is not None:
        raise ValueError("give checkpoint_every (steps between checkpoints) or memory_budget (bytes, from which the "
                         "layer chooses them), not both")
    return parse_bytes(budget)


def _fed_back(cell):
    """What a recurrent cell's next segment continues from: its last output, or with delay lines the outputs of its
    last max_delay + 1 steps (`Recurrent.sent`, which its `previous_output=` takes back)."""
    return cell.sent if cell.delay is not None else cell.final_output
