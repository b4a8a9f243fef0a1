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
"""
import math
import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..launch.bitpack import all_spikes, check_binary, pack_spikes, packed_bytes, unpack_spikes
from .budget import Footprint, choose_every, parse_bytes, saved_bytes
from ..launch.autograd import differentiable_once, saved_tensors
from ..launch.recurrent.replay import REPLAYED_DTYPES
from .checks import BACKENDS
from .recurrent import Recurrent, cell_module

__all__ = ["Chain", "Dense"]


class Dense(torch.nn.Module):
    """`in_features` -> `out_features` dense synapses (`weight` [out, in], `bias` [out], initialised as
    `torch.nn.Linear`'s) whose currents drive `neuron` for every step of [T, B, in_features] inputs.

    `neuron` is a `NeuronSpec`, a bundled layer class (`flexgen.LIF`, built with `**params`), a configured layer
    (`flexgen.LIF(tau=3.0)`: its options and parameters; its step mode and state handling are not used) or a
    `flexgen.Recurrent` layer of `out_features` neurons; its neuron must take one input. Unlike a `Recurrent` layer
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
        self.checkpoint_choice, self._measured = None, {}
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
        items = [f"in_features={self.in_features}", f"out_features={self.out_features}",
                 f"bias={self.bias is not None}"]
        if self.checkpoint_every is not None:
            items.append(f"checkpoint_every={self.checkpoint_every}")
        if self.memory_budget is not None:
            items.append(f"memory_budget={self.memory_budget}")
        return ", ".join(items)

    def forward(self, x, states=None, previous_output=None):
        self._check_input(x)
        if previous_output is not None and not self.recurrent:
            raise TypeError("previous_output is for a recurrent cell (neuron=flexgen.Recurrent(...)); this layer's "
                            "neuron does not feed its output back")
        names, values = zip(*self.named_parameters())
        given_states = [] if states is None else list(states)
        every = _every_for(self, (self,), x, True, [x, *given_states, *values, previous_output])
        if _segmented(every, [x, *given_states, *values, previous_output]):
            plan = _plan((self,), every, (names,), len(given_states), previous_output is not None, True, x)
            prev = [] if previous_output is None else [previous_output]
            outputs, ((finals, last),) = _run_long(plan, x, [*given_states, *prev], values)
        else:
            current = projected(x, self.weight, self.bias)
            outputs, finals, last = self._run_cell(current, None, states, previous_output)
        self._keep_finals(finals, last)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _keep_finals(self, finals, last):
        """Keep where a call ended: the final states and, for a recurrent cell, what it feeds back (`last`: the last
        output, or a delayed cell's outputs of its last max_delay + 1 steps, `_fed_back`)."""
        self.final_states = dict(zip(_state_names(self), finals))
        self.final_output = None
        if self.recurrent:
            delayed = self.cell.delay is not None
            self.final_output = last[-1] if delayed and last is not None else last
            self.cell.final_states, self.cell.final_output = dict(self.final_states), self.final_output
            if delayed:
                self.cell.sent = last

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


def projected(x, weight, bias):
    """The synapses' current: `x` [T, B, in] times the weight's transpose, plus the bias, added as a [B, out] view.
    The bias's gradient then sums over T and then over B. F.linear's sums over the T B rows at once, which on CUDA
    stages a buffer of twice the gradient's size, up to 132 MiB, at the backward's peak
    (docs/perf/h100/dense_bias_probe_session33.log). In 16-bit dtypes the two sums round twice. The bias is read
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
        self.checkpoint_choice, self._measured = None, {}

    def extra_repr(self):
        items = [] if self.checkpoint_every is None else [f"checkpoint_every={self.checkpoint_every}"]
        items += [] if self.memory_budget is None else [f"memory_budget={self.memory_budget}"]
        return ", ".join(items)

    def forward(self, x):
        self.layers[0]._check_input(x)
        named = [tuple(layer.named_parameters()) for layer in self.layers]
        values = [v for layer in named for _, v in layer]
        every = _every_for(self, tuple(self.layers), x, False, [x, *values])
        if not _segmented(every, [x, *values]):
            for layer in self.layers:
                out = layer(x)
                x = out[0] if isinstance(out, tuple) else out
            return out
        names = tuple(tuple(n for n, _ in layer) for layer in named)
        plan = _plan(tuple(self.layers), every, names, 0, False, False, x)
        outputs, finals = _run_long(plan, x, [], values)
        for layer, (states, last) in zip(self.layers, finals):
            layer._keep_finals(states, last)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


class _Plan(NamedTuple):
    """What the long-sequence autograd function needs besides tensors."""

    layers: tuple  # Dense layers, each fed the first output of the one before
    every: int
    names: tuple  # per layer, its parameter names, in the order their values follow the states
    n_states: int  # initial states given for the first layer (0: the declared initial values)
    has_previous: bool  # a previous output given for the first layer
    bits: bool  # keep the input as bits (a Dense layer alone: it must be spikes), else the input tensor itself
    stop: int  # where the last segment starts: the function runs the segments before it


def _plan(layers, every, names, n_states, has_previous, bits, x):
    return _Plan(layers, every, names, n_states, has_previous, bits, (x.shape[0] - 1) // every * every)


def _run_long(plan, x, first, values):
    """(last layer's outputs, [(final states, last fed-back output or None)] per layer) of the long-sequence path
    from the first layer's given states and previous output `first`: the segments before the last through
    `_Segments`, which re-runs them in the backward; the last one with autograd, its graph kept from the forward to
    the backward (it would be the first segment re-run, so this is the same memory with one segment less to
    recompute)."""
    if plan.bits:
        check_binary(x, f"Dense(checkpoint_every={plan.every})")
    first_states, first_previous, params = _split(plan, [*first, *values])
    runs = [(first_states, first_previous)] + [(None, None)] * (len(plan.layers) - 1)
    outputs, last = None, x
    if plan.stop:
        *results, last = _Segments.apply(plan, x, *first, *values)
        outputs, runs = _split_finals(plan, results)
    pieces, finals, _ = _run_segment(plan, last, params, runs)
    if outputs is None:
        return pieces, finals
    return [_PlaceLast.apply(output, piece, plan.stop) for output, piece in zip(outputs, pieces)], finals


class _PlaceLast(torch.autograd.Function):
    """`output[stop:] = piece` in place, where `output` comes from `_Segments`: the gradient goes on whole to
    `_Segments`, which reads only its steps before `stop`, and its slice to `piece`. (Autograd's own in-place copy
    would hand `_Segments` a new [T, ...] gradient with zeros from `stop` on: the size of the whole output.)"""

    @staticmethod
    def forward(ctx, output, piece, stop):
        output[stop:] = piece
        ctx.mark_dirty(output)
        ctx.stop = stop
        return output

    @staticmethod
    def backward(ctx, grad):
        return grad, grad[ctx.stop:], None


class _Segments(torch.autograd.Function):
    """The long-sequence path of one Dense layer or a Chain of them: see the module's docstring."""

    @staticmethod
    def forward(ctx, plan, x, *tensors):
        first_states, first_previous, params = _split(plan, tensors)
        device_type = x.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        runs = [(first_states, first_previous)] + [(None, None)] * (len(plan.layers) - 1)
        checkpoints, sent, outputs = [], [], None
        for start in range(0, plan.stop, plan.every):
            checkpoints.append(runs)
            pieces, runs, fed = _run_segment(plan, x[start:start + plan.every], params, runs)
            sent.append([_kept_for_replay(layer, f) for layer, f in zip(plan.layers, fed)])
            if outputs is None:
                outputs = [p.new_empty((x.shape[0], *p.shape[1:])) for p in pieces]
            for output, piece in zip(outputs, pieces):
                output[start:start + plan.every] = piece
            # own copies: a state or fed-back output may be a view that would keep its segment's tensors alive
            runs = [([s.clone() for s in states], None if prev is None else prev.clone()) for states, prev in runs]
        values = [v for p in params for v in p.values()]
        kept_states, ctx.checkpoints = _flatten_checkpoints(checkpoints)
        kept_sent, ctx.sent = _flatten_sent(sent)
        ctx.plan, ctx.x_meta, ctx.n_values, ctx.n_kept_states = plan, (x.shape, x.dtype), len(values), len(kept_states)
        # the checkpoints too go through save_for_backward, which frees them after the backward (the function's
        # node lives on in the final states' graph)
        ctx.save_for_backward(pack_spikes(x[:plan.stop]) if plan.bits else x, *values, *kept_states, *kept_sent)
        finals = [t for states, prev in runs for t in (*states, *([] if prev is None else [prev]))]
        # the last segment's input, which it runs on with autograd: a copy, so that it keeps neither the caller's
        # whole input alive nor (as a slice taken outside) makes autograd build a [T, ...] gradient for it
        return (*outputs, *finals, x[plan.stop:].clone())

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        kept, *saved = saved_tensors(ctx)
        n_kept = ctx.n_values + ctx.n_kept_states
        params = _by_layer(ctx.plan, saved[:ctx.n_values])
        checkpoints = _unflatten_checkpoints(ctx.checkpoints, saved[ctx.n_values:n_kept])
        sent = _unflatten_sent(ctx.sent, saved[n_kept:])
        checks = []
        result = _backward_through_segments(ctx, grads, kept, params, checkpoints, sent, checks)
        if checks and not bool(torch.stack(checks).all()):
            # A replay's outputs were not the forward's (the neuron's plain kernels and the fused ones are compiled
            # apart: had they rounded otherwise, a value at a threshold would come out otherwise): all again, every
            # segment re-running the fused forward. One device sync for the whole backward.
            result = _backward_through_segments(ctx, grads, kept, params, checkpoints, None, None)
        return result


def _backward_through_segments(ctx, grads, kept, params, checkpoints, sent, checks):
    """The long-sequence function's gradients: the segments last to first, each re-run from its checkpoints (a
    recurrent layer replaying its outputs in `sent`, where given, and appending to `checks` whether they came out
    the same) and backpropagated, handing the gradients of its starting states to the segment before."""
    *grads, grad_last_input = grads
    plan = ctx.plan
    shape, dtype = ctx.x_meta
    grad_outputs, carried = _split_finals(plan, grads)
    grad_x = torch.empty(shape, dtype=dtype, device=kept.device) if ctx.needs_input_grad[1] else None
    if grad_x is not None:
        grad_x[plan.stop:] = 0 if grad_last_input is None else grad_last_input
    grad_params = [dict.fromkeys(names) for names in plan.names]
    first_need = any(ctx.needs_input_grad[2:2 + plan.n_states + plan.has_previous])
    for index in reversed(range(len(checkpoints))):
        start = index * plan.every
        stop = min(start + plan.every, plan.stop)
        with torch.enable_grad(), torch.autocast(ctx.autocast[0], dtype=ctx.autocast[2], enabled=ctx.autocast[1]):
            x = unpack_spikes(kept[start:stop], shape[1:], dtype) if plan.bits else kept[start:stop].detach()
            x.requires_grad_(grad_x is not None)
            leaves = [{n: v.detach().requires_grad_(v.requires_grad) for n, v in p.items()} for p in params]
            runs = _leaf_runs(checkpoints[index], index > 0 or first_need)
            pieces, finals, _ = _run_segment(plan, x, leaves, runs, None if sent is None else sent[index], checks)
        roots = [(o, g[start:stop]) for o, g in zip(pieces, grad_outputs) if g is not None]
        for (states, prev), (grad_states, grad_prev) in zip(finals, carried):
            roots += [(f, g) for f, g in zip(states, grad_states) if g is not None]
            roots += [(prev, grad_prev)] if grad_prev is not None else []
        got = _gradients(roots, x, leaves, runs)
        if grad_x is not None:
            grad_x[start:stop] = 0 if got.get("x") is None else got["x"]
        for i, names in enumerate(plan.names):
            for name in names:
                g = got.get(("param", i, name))
                if g is not None:
                    grad_params[i][name] = g if grad_params[i][name] is None else grad_params[i][name] + g
        carried = [([got.get(("state", i, j)) for j in range(len(_state_names(layer)))], got.get(("previous", i)))
                   for i, layer in enumerate(plan.layers)]
    first_states, first_previous = carried[0]
    grad_first = list(first_states[:plan.n_states]) if plan.n_states else []
    grad_first += [first_previous] if plan.has_previous else []
    return (None, grad_x, *grad_first, *(g[n] for g, names in zip(grad_params, plan.names) for n in names))


def _run_segment(plan, x, params, runs, sent=None, checks=None):
    """(last layer's outputs, [(final states, last fed-back output or None)] per layer, [the segment's fed-back
    outputs or None] per layer) of one segment through every layer, each from its (states, previous output) in
    `runs`; a recurrent layer replays its fed-back outputs kept in `sent` (a `_Sent` or None per layer) where
    given, appending its check to `checks` (`Recurrent.replaying`)."""
    finals, fed = [], []
    for layer, layer_params, (states, previous), kept in zip(plan.layers, params, runs, sent or [None] * len(runs)):
        current = projected(x, layer_params["weight"], layer_params.get("bias"))
        outputs, states, previous = layer._run_cell(current, _cell_params(layer_params), states, previous,
                                                    _replayed(kept), checks)
        finals.append((states, previous))
        fed.append(outputs[layer.cell.output_index] if layer.recurrent else None)
        x = outputs[0]
    return outputs, finals, fed


class _Sent(NamedTuple):
    """A recurrent layer's fed-back outputs over a segment, kept for its replay in the backward: packed bits, and
    whether they are spikes (a 0-d bool tensor until the backward reads it)."""

    bits: torch.Tensor
    binary: object


def _replays(layer, dtype):
    """Whether a segment's re-run of `layer`, in `dtype`, replays the spikes it fed back (`Recurrent.replaying`): an
    undelayed recurrent cell that took the fused path, in a dtype a replay takes."""
    return layer.recurrent and layer.cell.delay is None and layer.cell.path == "fused" and dtype in REPLAYED_DTYPES


def _kept_for_replay(layer, fed):
    """A `_Sent` of what a recurrent layer fed back over a segment, where the backward can replay it; else None. One
    bit per neuron and step: a fraction of a re-run's time for 1/32 of the outputs' bytes (float32)."""
    if fed is None or not _replays(layer, fed.dtype):
        return None
    return _Sent(pack_spikes(fed), all_spikes(fed))


def _flatten_sent(sent):
    """(tensors, structure) of the per-segment, per-layer `_Sent`s (or None): their bits, then one bool tensor of
    whether each is binary; the structure says which segment and layer has one."""
    kept = [k for row in sent for k in row if k is not None]
    structure = [[k is not None for k in row] for row in sent]
    if not kept:
        return [], structure
    return [k.bits for k in kept] + [torch.stack([k.binary for k in kept])], structure


def _unflatten_sent(structure, tensors):
    """The inverse of `_flatten_sent`, with `binary` as a bool (one device sync for all of them)."""
    binary = iter(tensors[-1].tolist() if tensors else [])
    bits = iter(tensors[:-1])
    return [[_Sent(next(bits), next(binary)) if kept else None for kept in row] for row in structure]


def _replayed(kept):
    """What a segment's re-run replays for a layer (`_Sent` or None): its fed-back spikes' bits, where they are
    spikes."""
    return kept.bits if kept is not None and kept.binary else None


def _flatten_checkpoints(checkpoints):
    """(tensors, structure) of per-segment checkpoints ([(states or None, previous output or None)] per layer): their
    tensors in one list, and per segment and layer the number of states (None: the declared initial values) and
    whether a previous output follows them."""
    tensors, structure = [], []
    for runs in checkpoints:
        structure.append([(None if states is None else len(states), prev is not None) for states, prev in runs])
        for states, prev in runs:
            tensors += list(states or []) + ([prev] if prev is not None else [])
    return tensors, structure


def _unflatten_checkpoints(structure, tensors):
    """The inverse of `_flatten_checkpoints`."""
    tensors, checkpoints = iter(tensors), []
    for row in structure:
        checkpoints.append([(None if n is None else [next(tensors) for _ in range(n)], next(tensors) if prev else None)
                            for n, prev in row])
    return checkpoints


def _leaf_runs(checkpoint, need):
    """A checkpoint's states and previous outputs as leaves for a segment's re-run: taking gradients where `need`
    (every segment but the first; the first where the caller's initial values want them)."""
    return [(None if states is None else [s.detach().requires_grad_(need) for s in states],
             None if prev is None else prev.detach().requires_grad_(need)) for states, prev in checkpoint]


def _gradients(roots, x, params, runs):
    """Gradients of a segment's `roots` ((tensor, incoming gradient) pairs) with respect to every leaf that takes
    them, by key: "x", ("param", layer, name), ("state", layer, index), ("previous", layer)."""
    leaves = {"x": x}
    for i, layer_params in enumerate(params):
        leaves.update({("param", i, n): p for n, p in layer_params.items()})
    for i, (states, prev) in enumerate(runs):
        leaves.update({("state", i, j): s for j, s in enumerate(states or [])})
        leaves[("previous", i)] = prev
    leaves = {k: v for k, v in leaves.items() if v is not None and v.requires_grad}
    roots = [(o, g) for o, g in roots if o.requires_grad]
    if not roots or not leaves:
        return {}
    got = torch.autograd.grad([o for o, _ in roots], list(leaves.values()), [g for _, g in roots], allow_unused=True)
    return dict(zip(leaves, got))


def _state_names(layer):
    return layer.cell.spec.signature.states


def _split(plan, tensors):
    """(first layer's initial states or None, its previous output or None, [name -> parameter] per layer) from the
    function's tensor arguments."""
    states = list(tensors[:plan.n_states]) or None
    previous = tensors[plan.n_states] if plan.has_previous else None
    return states, previous, _by_layer(plan, tensors[plan.n_states + plan.has_previous:])


def _by_layer(plan, values):
    params, at = [], 0
    for names in plan.names:
        params.append(dict(zip(names, values[at:at + len(names)])))
        at += len(names)
    return params


def _listed(result):
    return list(result) if isinstance(result, tuple) else [result]


def _segmented(every, tensors):
    """Whether a call takes the long-sequence path: checkpointing asked for, a gradient to keep, steps to run."""
    if every is None or not torch.is_grad_enabled() or tensors[0].shape[0] == 0:
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _split_finals(plan, results):
    """(last layer's outputs, [(final states, last fed-back output or None)] per layer) from what the function
    returns, or (their gradients, the same per layer) from what its backward receives."""
    n_finals = sum(len(_state_names(layer)) + layer.recurrent for layer in plan.layers)
    outputs, rest = list(results[:len(results) - n_finals]), list(results[len(results) - n_finals:])
    finals = []
    for layer in plan.layers:
        n = len(_state_names(layer))
        finals.append((rest[:n], rest[n] if layer.recurrent else None))
        rest = rest[n + layer.recurrent:]
    return outputs, finals


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


def _every_for(owner, layers, x, bits, tensors):
    """The steps between checkpoints for this call: the owner's `checkpoint_every`, or under a memory budget the
    choice for this call's length (None: the default path), kept in `owner.checkpoint_choice`."""
    if owner.memory_budget is None:
        return owner.checkpoint_every
    every = None
    if _segmented(1, tensors):
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


def _fed_back(cell):
    """What a recurrent cell's next segment continues from: its last output, or with delay lines the outputs of its
    last max_delay + 1 steps (`Recurrent.sent`, which its `previous_output=` takes back)."""
    return cell.sent if cell.delay is not None else cell.final_output


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
    """Bytes per step that keeping the recurrent layers' fed-back outputs as bits takes (`_kept_for_replay`), after
    the footprint's runs: they tell which path each layer takes."""
    if torch.is_autocast_enabled(x.device.type):  # the cells run in a 16-bit dtype, which does not replay
        return 0
    rows = math.prod(x.shape[1:-1])
    return sum(packed_bytes(rows * layer.out_features) for layer in layers if _replays(layer, x.dtype))


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
            outputs, states, last = layer._run_cell(projected(x, layer.weight, layer.bias), None, None, None)
        finally:
            if kept is not None:
                layer.cell.final_states, layer.cell.final_output, layer.cell.sent = kept
        finals.append((states, last))
        x = outputs[0]
    return finals
