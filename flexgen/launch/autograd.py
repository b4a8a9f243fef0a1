"""Autograd and torch.func wiring of eager calls: `autograd.Function`s around the ops' implementations,
vmap rules, and the backward as a function of its own under transforms."""
import functools
from typing import NamedTuple

import torch

from .abi import broadcasts_per_neuron
from .scalars import cached_zero


FREED_GRAPH = (
    "backward reached a flexgen neuron call whose saved values an earlier backward already freed. A layer keeps its "
    "states between calls, and with them the graph of the call that made them: call layer.reset() before each new "
    "sequence, or layer.detach() to keep the states' values without that graph (truncated backpropagation through "
    "time). To backpropagate through one graph a second time, pass retain_graph=True to the first backward"
)


SECOND_ORDER = (
    "a gradient of a gradient (create_graph=True, as in a gradient penalty) reached a flexgen neuron call whose "
    "backward runs generated kernels (backend 'triton' or 'torch'), which are differentiable once. backend='eager' "
    "(for layers and for flexgen.Recurrent) runs the step function itself with torch operations and gives "
    "higher-order gradients"
)


DELAYED_SECOND_ORDER = (
    "a gradient of a gradient (create_graph=True, as in a gradient penalty) reached a flexgen.DelayedLinear call "
    "run by its Triton backend ('fused' or 'taps'), whose gradient kernels are differentiable once. "
    "DelayedLinear(backend='conv') runs the convolution with torch operations and gives higher-order gradients"
)


def refusal(message):
    """A decorator: an autograd.Function's backward that refuses, with `message`, to build a graph of its
    gradients (see `differentiable_once`)."""

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled() and (
                    any(ctx.needs_input_grad) or any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads)):
                raise RuntimeError(message)
            return backward(ctx, *grads)

        return wrapper

    return decorate


def differentiable_once(backward):
    """An autograd.Function's backward that refuses, with `SECOND_ORDER`, to build a graph of its gradients.

    A backward asked for a graph (create_graph=True: grad mode is on inside it) whose gradients depend on tensors
    that require grad would otherwise return gradients that lack every second-order term through the kernels: wrong
    and silent. The check runs before the kernels and costs nothing on an ordinary backward.
    """
    return refusal(SECOND_ORDER)(backward)


def saved_tensors(ctx):
    """`ctx.saved_tensors`; if an earlier backward freed them, an error naming the usual cause and the fixes."""
    try:
        return ctx.saved_tensors
    except RuntimeError as exc:
        if "backward through the graph a second time" not in str(exc):
            raise
        raise RuntimeError(FREED_GRAPH) from exc


class EagerConfig(NamedTuple):
    """The non-tensor arguments of an eager forward (the tensors follow it in `Function.apply`)."""

    ops: object
    hyper: list
    state_seqs: bool
    use_triton: bool
    n_inputs: int
    n_states: int
    save: bool

    def split(self, tensors):
        """(inputs, states, learnable) of a call's flat tensors."""
        n_in, n_states = self.n_inputs, self.n_states
        return list(tensors[:n_in]), list(tensors[n_in:n_in + n_states]), list(tensors[n_in + n_states:])


class BackwardConfig(NamedTuple):
    """The non-tensor arguments of a backward run under torch.func, and how many tensors each group has."""

    ops: object
    hyper: list
    state_seqs: bool
    use_triton: bool
    grad_init: bool
    counts: tuple  # (saved, grad_outputs, grad_states, learnable)


def _eager_forward(config, tensors):
    inputs, states, learnable = config.split(tensors)
    return tuple(config.ops.forward_impl(inputs, states, learnable, config.hyper, config.state_seqs, config.save,
                                         config.use_triton))


def _eager_setup_context(ctx, config, tensors, output, buffers_returned=True):
    if not config.save:  # no gradient wanted (a torch.func transform without grad)
        return
    ops = config.ops
    xs, states, learnable = config.split(tensors)
    ops.setup_context(ctx, (xs, states, learnable, config.hyper, config.state_seqs, True, config.use_triton), output)
    ctx.ops = ops
    if buffers_returned:
        ctx.mark_non_differentiable(*output[len(ops.layout.outputs) + config.n_states:])
    # Unused outputs (often the final states) would otherwise get full-size zero gradients
    # written to memory; the backward reads a stride-0 zero instead.
    ctx.set_materialize_grads(False)


def wants_start_gradients(needs_input_grad, first_state, n_states, layout):
    """Whether a backward computes the gradients of what the call starts from (`grad_init`, the kernels'
    GRAD_INIT): the initial states' and a held delay line's (the last tensor), where autograd wants any of them."""
    return any(needs_input_grad[first_state:first_state + n_states]) or (layout.held and needs_input_grad[-1])


def _eager_backward(ctx, grads, backward):
    ops = ctx.ops
    n_in, n_states = len(ops.layout.inputs), len(ops.layout.states)
    grad_init = wants_start_gradients(ctx.needs_input_grad, 1 + n_in, n_states, ops.layout)
    grad_inputs, grad_states, grad_learnable, *_ = ops.backward_formula(ctx, grads, backward, cached_zero, grad_init)
    return (None, *grad_inputs, *grad_states, *grad_learnable)


class EagerFunction(torch.autograd.Function):
    """Eager-mode autograd around the same forward/backward implementations as the custom ops.

    Old-style (forward takes ctx): Function.apply of a setup_context-style
    Function inspects the forward's signature on every call, tens of
    microseconds; `TransformableFunction` is its twin for torch.func.
    """

    @staticmethod
    def forward(ctx, config, *tensors):
        output = _eager_forward(config, tensors)
        _eager_setup_context(ctx, config, tensors, output, buffers_returned=False)
        return output[:config.ops.n_visible]  # fewer outputs for autograd to wrap

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        return _eager_backward(ctx, grads, ctx.ops.backward_impl)


class PlannedFunction(torch.autograd.Function):
    """Eager autograd for calls that have an `EagerPlan` (Triton kernels, no transforms): the common case."""

    @staticmethod
    def forward(ctx, plan, *tensors):
        n_in, n_states = plan.n_inputs, plan.n_states
        inputs, states, learnable = tensors[:n_in], tensors[n_in:n_in + n_states], tensors[n_in + n_states:]
        outputs, finals, buffers = plan.forward(inputs, states, learnable)
        ctx.save_for_backward(*plan.saved(inputs, states, outputs, buffers), *learnable)
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # unused outputs (often the final states) are read as a stride-0 zero
        return (*outputs, *finals)

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        plan = ctx.plan
        tensors = saved_tensors(ctx)
        grad_init = wants_start_gradients(ctx.needs_input_grad, 1 + plan.n_inputs, plan.n_states, plan.layout)
        return (None, *plan.backward(tensors[:plan.n_saved], tensors[plan.n_saved:], grads, grad_init))


class TransformableFunction(torch.autograd.Function):
    """`EagerFunction` in the setup_context style with a vmap rule: used while torch.func transforms run."""

    @staticmethod
    def forward(config, *tensors):
        return _eager_forward(config, tensors)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _eager_setup_context(ctx, inputs[0], inputs[1:], output)

    @staticmethod
    def backward(ctx, *grads):
        # Under torch.func the incoming tensors are wrapped (grad levels, batches); the kernels need plain
        # tensors, which the backward gets as an autograd.Function of its own.
        transforms = torch._C._are_functorch_transforms_active()
        return _eager_backward(ctx, grads, _transformable_backward(ctx.ops) if transforms else ctx.ops.backward_impl)

    @staticmethod
    def vmap(info, in_dims, config, *tensors):
        n_neuron_tensors = config.n_inputs + config.n_states
        if any(d is not None for d in in_dims[1 + n_neuron_tensors:]):  # per-sample learnable parameters
            return _vmap_by_loop(TransformableFunction, info, in_dims, config, tensors)
        moved = _batch_as_last_neuron_dim(info, in_dims[1:1 + n_neuron_tensors], tensors[:n_neuron_tensors])
        learnable = _with_batch_dim(tensors[n_neuron_tensors:], moved[0].shape[1:-1])
        result = TransformableFunction.apply(config, *moved, *learnable)
        return result, tuple(r.dim() - 1 for r in result)


class BackwardFunction(torch.autograd.Function):
    """Base of the backward kernels run as functions of their tensors (under torch.func only): nothing to save,
    and a gradient of theirs is refused with `SECOND_ORDER`."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(SECOND_ORDER)


class EagerBackward(BackwardFunction):
    """The backward kernels as a function of their tensors, used only under torch.func transforms.

    torch.func unwraps the tensors for `forward` (plain tensors for the kernels)
    and batches through `vmap`. Differentiable once: a second backward raises `SECOND_ORDER`.
    """

    @staticmethod
    def forward(config, *tensors):
        saved, grad_outputs, grad_states, learnable = _split(tensors, config.counts)
        result = config.ops.backward_impl(saved, grad_outputs, grad_states, learnable, config.hyper, config.state_seqs,
                                          config.use_triton, config.grad_init)
        return tuple(result)

    @staticmethod
    def vmap(info, in_dims, config, *tensors):
        n_learnable = config.counts[-1]
        if n_learnable:  # per-sample parameter gradients: the kernels would sum them over the batch
            return _vmap_by_loop(EagerBackward, info, in_dims, config, tensors)
        result = EagerBackward.apply(config, *_batch_as_last_neuron_dim(info, in_dims[1:], tensors))
        return result, tuple(None if r is None else r.dim() - 1 for r in result)


def _transformable_backward(ops):
    """`ops.backward_impl`'s signature, running through `EagerBackward`."""
    def backward(saved, grad_outputs, grad_states, learnable, hyper, state_seqs, use_triton, grad_init):
        counts = (len(saved), len(grad_outputs), len(grad_states), len(learnable))
        config = BackwardConfig(ops, hyper, state_seqs, use_triton, grad_init, counts)
        return list(EagerBackward.apply(config, *saved, *grad_outputs, *grad_states, *learnable))

    return backward


def _split(items, counts):
    parts, start = [], 0
    for n in counts:
        parts.append(list(items[start:start + n]))
        start += n
    return parts


def _batch_as_last_neuron_dim(info, in_dims, tensors):
    """Neurons are independent, so a vmapped dim can be one more neuron dim: moved last, or added.

    Last keeps the channel (dim 2 of [T, B, C, ...]) where per-channel parameters expect it.
    A 0-d tensor (a constant state, a zero gradient) already reads the same everywhere.
    """
    moved = []
    for t, d in zip(tensors, in_dims):
        if d is not None:
            moved.append(t.movedim(d, -1))
        elif t.dim() == 0:
            moved.append(t)
        else:
            moved.append(t.unsqueeze(-1).expand(*t.shape, info.batch_size))
    return moved


def _with_batch_dim(learnable, step_shape):
    """Learnable parameters broadcasting against a step (not scalar, not per channel) with a trailing dim of
    size 1, so they broadcast against the step with the vmapped dim added last."""
    return [w.unsqueeze(-1) if broadcasts_per_neuron(w, step_shape) else w for w in learnable]


def _vmap_by_loop(function, info, in_dims, config, tensors):
    """One call per batch entry, results stacked along dim 0 (per-sample learnable parameters)."""
    results = []
    for i in range(info.batch_size):
        args = [t if d is None else t.select(d, i) for t, d in zip(tensors, in_dims[1:])]
        results.append(function.apply(config, *args))
    stacked = tuple(None if parts[0] is None else torch.stack(parts) for parts in zip(*results))
    return stacked, tuple(None if r is None else 0 for r in stacked)
