"""The long-sequence training mode of `Dense` and `Chain` (`checkpoint_every=`): the segments' autograd function.

A training call keeps, before every segment of K steps, each layer's states (and a recurrent cell's last output),
and besides them only its input: a Dense layer alone packs its input spikes one bit per value
(`flexgen.launch.bitpack`), a Chain keeps its input tensor as it is. The backward takes the segments last to first:
it runs the segment again through every layer from its checkpoints, with autograd on, and backpropagates through
that segment alone, handing the gradients of its starting states to the segment before (`_Segments`). The last
segment runs with autograd on in the forward already, so its graph waits for the backward instead of a re-run
(`run_long`). A recurrent cell on the fused path also keeps the spikes it fed back, one bit per neuron and step, and
its re-run replays them (`Recurrent.replaying`).
"""
from typing import NamedTuple

import torch

from ..launch.autograd import differentiable_once, saved_tensors
from ..launch.bitpack import all_spikes, check_binary, pack_spikes, unpack_spikes
from ..launch.recurrent.replay import REPLAYED_DTYPES


class _Plan(NamedTuple):
    """What the long-sequence autograd function needs besides tensors."""

    layers: tuple  # Dense layers, each fed the first output of the one before
    every: int
    names: tuple  # per layer, its parameter names, in the order their values follow the states
    n_states: int  # initial states given for the first layer (0: the declared initial values)
    has_previous: bool  # a previous output given for the first layer
    bits: bool  # keep the input as bits (a Dense layer alone: it must be spikes), else the input tensor itself
    stop: int  # where the last segment starts: the function runs the segments before it


def plan_for(layers, every, names, n_states, has_previous, bits, x):
    return _Plan(layers, every, names, n_states, has_previous, bits, (x.shape[0] - 1) // every * every)


_EAGER = []  # run_long wrapped by torch.compiler.disable, made by the first layer that takes the mode


def long_runner():
    """`run_long` as torch.compile runs it: eagerly, a graph break (under `fullgraph=True` an error). Dynamo traced
    `_Segments`, whose backward runs autograd inside it, into wrong weight gradients (Dense weights 0.45 off in
    float64). Made at the first `Dense` or `Chain` that takes the mode, not at import: `torch.compiler.disable`
    imports torch._dynamo (about a second, and a folder of Inductor's in the temporary directory)."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(run_long))
    return _EAGER[0]


def run_long(plan, x, first, values):
    """(last layer's outputs, [(final states, last fed-back output or None)] per layer) of the long-sequence path
    from the first layer's given states and previous output `first`: the segments before the last through
    `_Segments`, which re-runs them in the backward; the last one with autograd, its graph kept from the forward to
    the backward (it would be the first segment re-run, so this is the same memory with one segment less to
    recompute)."""
    if plan.bits:
        check_binary(x, f"Dense(checkpoint_every={plan.every})")
    _check_gathered(plan, values)
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


def _check_gathered(plan, values):
    """Refuse parameters that FSDP2 left sharded: the mode reads every layer's parameters itself, without calling
    the layers' forward, so a `fully_shard` unit inside it (a Chain's Dense layer, a Dense layer's cell) is never
    gathered."""
    for params in _by_layer(plan, values):
        for name, value in params.items():
            if type(value).__name__ == "DTensor":
                owner = "Dense layer" if plan.bits else "Chain"
                raise RuntimeError(
                    f"parameter {name!r} of this {owner} is still sharded (a DTensor): FSDP2's fully_shard was "
                    f"applied to a module inside the {owner}, whose forward the long-sequence mode "
                    f"(checkpoint_every / memory_budget) does not call, so FSDP never gathers it. Apply "
                    f"fully_shard to the {owner} as one unit (docs/multi-gpu.md)")


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
        carried = [([got.get(("state", i, j)) for j in range(len(state_names(layer)))], got.get(("previous", i)))
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
        outputs, states, previous = layer._run_on(x, layer_params, states, previous, _replayed(kept), checks)
        finals.append((states, previous))
        fed.append(outputs[layer.cell.output_index] if layer.recurrent else None)
        x = outputs[0]
    return outputs, finals, fed


class _Sent(NamedTuple):
    """A recurrent layer's fed-back outputs over a segment, kept for its replay in the backward: packed bits, and
    whether they are spikes (a 0-d bool tensor until the backward reads it)."""

    bits: torch.Tensor
    binary: object


def replays(layer, dtype):
    """Whether a segment's re-run of `layer`, in `dtype`, replays the spikes it fed back (`Recurrent.replaying`): an
    undelayed recurrent cell that took the fused path, in a dtype a replay takes."""
    return layer.recurrent and layer.cell.delay is None and layer.cell.path == "fused" and dtype in REPLAYED_DTYPES


def _kept_for_replay(layer, fed):
    """A `_Sent` of what a recurrent layer fed back over a segment, where the backward can replay it; else None. One
    bit per neuron and step: a fraction of a re-run's time for 1/32 of the outputs' bytes (float32)."""
    if fed is None or not replays(layer, fed.dtype):
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


def state_names(layer):
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


def exporting():
    """Whether torch.export traces this call (where torch.compiler.is_exporting exists; elsewhere False, and an
    exported checkpointed call keeps its segments, whose outputs are the same)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting()) if is_exporting is not None else False


def segmented(every, tensors):
    """Whether a call takes the long-sequence path: checkpointing asked for, a gradient to keep, steps to run, and
    no `torch.export` tracing the call (an exported program holds the forward alone, which the default path
    computes alike: checkpoints only save memory in training)."""
    if every is None or not torch.is_grad_enabled() or exporting() or tensors[0].shape[0] == 0:
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _split_finals(plan, results):
    """(last layer's outputs, [(final states, last fed-back output or None)] per layer) from what the function
    returns, or (their gradients, the same per layer) from what its backward receives."""
    n_finals = sum(len(state_names(layer)) + layer.recurrent for layer in plan.layers)
    outputs, rest = list(results[:len(results) - n_finals]), list(results[len(results) - n_finals:])
    finals = []
    for layer in plan.layers:
        n = len(state_names(layer))
        finals.append((rest[:n], rest[n] if layer.recurrent else None))
        rest = rest[n + layer.recurrent:]
    return outputs, finals
