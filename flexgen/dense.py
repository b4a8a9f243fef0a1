"""Dense synapses feeding a neuron layer, with a training mode whose memory grows by one bit per input per step.

    I_t = s_t W^T + b
    outputs_t, states_t = cell(I_t, states_{t-1})

The cell is any flexgen neuron layer or a `flexgen.Recurrent` layer. By default the product and the cell run once
over the whole sequence and autograd keeps what each of them saves. With `checkpoint_every=K` a training call keeps
only the input spikes, packed one bit per value (`flexgen.bitpack`), and the cell's states (and a recurrent cell's
last output) before every segment of K steps. The backward takes the segments last to first: it rebuilds a
segment's input from its bits, runs the product and the cell over the segment again from its checkpoint, with
autograd on, and backpropagates through that segment alone, handing the gradients of its starting states to the
segment before. One segment's per-step values are in memory at a time, whatever T is.
"""
import math
import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .bitpack import check_binary, pack_spikes, unpack_spikes
from .launch.autograd import differentiable_once
from .module import BACKENDS
from .recurrent import Recurrent, neuron_layer

__all__ = ["Dense"]


class Dense(torch.nn.Module):
    """`in_features` -> `out_features` dense synapses (`weight` [out, in], `bias` [out], initialised as
    `torch.nn.Linear`'s) whose currents drive `neuron` for every step of [T, B, in_features] inputs.

    `neuron` is a `NeuronSpec`, a bundled layer class (`flexgen.LIF`, built with `**params`), a configured layer
    (`flexgen.LIF(tau=3.0)`) or a `flexgen.Recurrent` layer of `out_features` neurons; its neuron must take one
    input. Every call starts from the neuron's initial states (or `states=[...]`, tensors broadcastable to
    [B, out_features], and for a recurrent cell `previous_output=`); afterwards the final states are in
    `layer.final_states` and, for a recurrent cell, the last fed-back output in `layer.final_output`, so a long
    sequence can be run in several calls.

    `checkpoint_every=K` (a positive number of steps; None, the default, keeps what autograd keeps) is the
    long-sequence training mode: the input must be spikes (0 and 1, checked), kept as one bit per value, with the
    cell's states every K steps; the backward recomputes each segment of K steps. Same results as the default path
    (equal in fp32 and fp64 up to the order of the weight gradient's sums; in fp16 and bf16 the states round to
    the I/O dtype at every checkpoint, as between two calls). Calls without gradients take the default path.

    >>> import torch, flexgen
    >>> layer = flexgen.Dense(6, 4, flexgen.LIF, checkpoint_every=3, backend="torch")
    >>> x = (torch.rand(8, 2, 6) < 0.3).float()
    >>> layer(x).shape, sorted(layer.final_states)
    (torch.Size([8, 2, 4]), ['v'])
    """

    def __init__(self, in_features, out_features, neuron, bias=True, per_neuron=False, checkpoint_every=None,
                 backend="auto", **params):
        super().__init__()
        self.in_features = _count("in_features", in_features)
        self.out_features = _count("out_features", out_features)
        self.checkpoint_every = _check_every(checkpoint_every)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.cell = _dense_cell(neuron, self.out_features, per_neuron, backend, params)
        bound = 1.0 / math.sqrt(self.in_features)  # torch.nn.Linear's initialisation
        self.weight = torch.nn.Parameter(torch.empty(self.out_features, self.in_features).uniform_(-bound, bound))
        self.bias = torch.nn.Parameter(torch.empty(self.out_features).uniform_(-bound, bound)) if bias else None
        self.final_states, self.final_output = {}, None

    @property
    def recurrent(self):
        return isinstance(self.cell, Recurrent)

    def extra_repr(self):
        items = [f"in_features={self.in_features}", f"out_features={self.out_features}", f"bias={self.bias is not None}"]
        if self.checkpoint_every is not None:
            items.append(f"checkpoint_every={self.checkpoint_every}")
        return ", ".join(items)

    def forward(self, x, states=None, previous_output=None):
        self._check_input(x)
        if previous_output is not None and not self.recurrent:
            raise TypeError("previous_output is for a recurrent cell (neuron=flexgen.Recurrent(...)); this layer's "
                            "neuron does not feed its output back")
        names, values = zip(*self.named_parameters())
        given_states = [] if states is None else list(states)
        if self._segmented(x, given_states, previous_output, values):
            plan = _Plan(self, self.checkpoint_every, names, len(given_states), previous_output is not None)
            prev = [] if previous_output is None else [previous_output]
            results = _Segments.apply(plan, x, *given_states, *prev, *values)
            n_outputs = len(results) - len(self._state_names())
            outputs, finals = list(results[:n_outputs]), list(results[n_outputs:])
            last = outputs[self.cell.output_index][-1] if self.recurrent and x.shape[0] else previous_output
        else:
            current = F.linear(x, self.weight, self.bias)
            outputs, finals, last = self._run_cell(current, None, states, previous_output)
        self.final_states = dict(zip(self._state_names(), finals))
        self.final_output = last if self.recurrent else None
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _state_names(self):
        return self.cell.spec.signature.states

    def _segmented(self, x, states, previous_output, params):
        """Whether a call takes the long-sequence path: checkpointing asked for, a gradient to keep, steps to run."""
        if self.checkpoint_every is None or not torch.is_grad_enabled() or x.shape[0] == 0:
            return False
        tensors = [x, *states, *params] + ([previous_output] if previous_output is not None else [])
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)

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

    def _run_cell(self, current, cell_params, states, previous_output):
        """(outputs, final states, last fed-back output or None) of the cell over `current`, with the cell's own
        parameters or, in the backward of the long-sequence path, `cell_params` (name -> tensor) in their place."""
        if self.recurrent:
            kwargs = {"states": states, "previous_output": previous_output}
            if cell_params is None:
                result = self.cell(current, **kwargs)
            else:
                result = torch.func.functional_call(self.cell, cell_params, (current,), kwargs)
            outputs = list(result) if isinstance(result, tuple) else [result]
            return outputs, list(self.cell.final_states.values()), self.cell.final_output
        neuron = self.cell._neuron_call()._replace(store_state_seqs=False)
        learnable = [(cell_params or {}).get(w, None) for w in neuron.signature.learnable]
        learnable = [getattr(self.cell, w) if p is None else p for w, p in zip(neuron.signature.learnable, learnable)]
        outputs, finals = neuron(neuron.check([current], states, learnable))
        return outputs, finals, None


class _Plan(NamedTuple):
    """What the long-sequence autograd function needs besides tensors."""

    layer: Dense
    every: int
    names: tuple  # the layer's parameter names, in the order their values follow the states
    n_states: int  # initial states given by the caller (0: the declared initial values)
    has_previous: bool


class _Segments(torch.autograd.Function):
    """The long-sequence path: see the module's docstring."""

    @staticmethod
    def forward(ctx, plan, x, *tensors):
        layer = plan.layer
        states, previous, params = _split(plan, tensors)
        check_binary(x, f"Dense(checkpoint_every={plan.every})")
        device_type = x.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        checkpoints, outputs = [], None
        for start in range(0, x.shape[0], plan.every):
            checkpoints.append((states, previous))
            current = F.linear(x[start:start + plan.every], params["weight"], params.get("bias"))
            pieces, states, previous = layer._run_cell(current, _cell_params(params), states, previous)
            if outputs is None:
                outputs = [p.new_empty((x.shape[0], *p.shape[1:])) for p in pieces]
            for output, piece in zip(outputs, pieces):
                output[start:start + plan.every] = piece
            # own copies: a state or fed-back output may be a view that would keep its segment's tensors alive
            states = [s.clone() for s in states]
            previous = None if previous is None else previous.clone()
        ctx.plan, ctx.checkpoints, ctx.x_meta = plan, checkpoints, (x.shape, x.dtype)
        ctx.save_for_backward(pack_spikes(x), *params.values())
        return (*outputs, *states)

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        plan = ctx.plan
        packed, *values = ctx.saved_tensors
        shape, dtype = ctx.x_meta
        n_outputs = len(grads) - len(plan.layer._state_names())
        grad_outputs, carried = grads[:n_outputs], list(grads[n_outputs:])
        carried_previous = None
        grad_x = torch.empty(shape, dtype=dtype, device=packed.device) if ctx.needs_input_grad[1] else None
        grad_params = dict.fromkeys(plan.names)
        first_states_need = ctx.needs_input_grad[2:2 + plan.n_states + plan.has_previous]
        for index in reversed(range(len(ctx.checkpoints))):
            start = index * plan.every
            stop = min(start + plan.every, shape[0])
            states, previous = ctx.checkpoints[index]
            needs_start = any(first_states_need) if index == 0 else True
            with torch.enable_grad(), torch.autocast(ctx.autocast[0], dtype=ctx.autocast[2], enabled=ctx.autocast[1]):
                x = unpack_spikes(packed[start:stop], shape[1:], dtype).requires_grad_(grad_x is not None)
                params = {n: v.detach().requires_grad_(v.requires_grad) for n, v in zip(plan.names, values)}
                states = None if states is None else [s.detach().requires_grad_(needs_start) for s in states]
                previous = None if previous is None else previous.detach().requires_grad_(needs_start)
                current = F.linear(x, params["weight"], params.get("bias"))
                outputs, finals, last = plan.layer._run_cell(current, _cell_params(params), states, previous)
            roots = [(o, g[start:stop]) for o, g in zip(outputs, grad_outputs) if g is not None]
            roots += [(f, g) for f, g in zip(finals, carried) if g is not None]
            roots += [(last, carried_previous)] if carried_previous is not None else []
            roots = [(o, g) for o, g in roots if o.requires_grad]
            leaves = {"x": x, **{n: p for n, p in params.items() if p.requires_grad}}
            leaves.update({f"state {i}": s for i, s in enumerate(states or []) if s.requires_grad})
            if previous is not None and previous.requires_grad:
                leaves["previous"] = previous
            leaves = {k: v for k, v in leaves.items() if v.requires_grad}
            got = dict.fromkeys(leaves)
            if roots and leaves:
                got = dict(zip(leaves, torch.autograd.grad([o for o, _ in roots], list(leaves.values()),
                                                           [g for _, g in roots], allow_unused=True)))
            if grad_x is not None:
                grad_x[start:stop] = 0 if got.get("x") is None else got["x"]
            for name in plan.names:
                g = got.get(name)
                if g is not None:
                    grad_params[name] = g if grad_params[name] is None else grad_params[name] + g
            n = len(plan.layer._state_names())
            carried = [got.get(f"state {i}") for i in range(n)] if states is not None else [None] * n
            carried_previous = got.get("previous")
        first_states = carried[:plan.n_states] if plan.n_states else []
        first_previous = [carried_previous] if plan.has_previous else []
        return (None, grad_x, *first_states, *first_previous, *(grad_params[n] for n in plan.names))


def _split(plan, tensors):
    """(initial states or None, previous output or None, name -> parameter) from the function's tensor arguments."""
    states = list(tensors[:plan.n_states]) or None
    previous = tensors[plan.n_states] if plan.has_previous else None
    params = dict(zip(plan.names, tensors[plan.n_states + plan.has_previous:]))
    return states, previous, params


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
        cell = neuron_layer(neuron, "Dense", out_features, per_neuron, backend, params)
    inputs = cell.spec.signature.inputs
    if len(inputs) != 1:
        raise ValueError(f"Dense feeds one current to its neuron; {cell.spec.__name__} takes {len(inputs)} inputs "
                         f"{inputs}")
    return cell
