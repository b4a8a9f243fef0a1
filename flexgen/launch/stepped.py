"""A recurrent layer run step by step on its neuron's per-step kernels (the C target or the generated torch code),
as one autograd function over the whole sequence.

Per step the forward adds the fed-back product to the input (`torch.addmm`) and calls the neuron's forward for
that step, keeping what its backward reads; the backward walks the steps last to first, calling the neuron's
backward for each with the carried state gradients, and hands the recurrent input's gradient back one step
through the weight (dI_t W). The weight's gradient is one product over all steps afterwards,
dW = sum_t dI_t^T s_{t-1}, instead of T small products that autograd would sum one by one.
"""
from typing import NamedTuple

import torch

from ..layout import Kind, pick_saved
from .autograd import differentiable_once, saved_tensors


class SteppedRun(NamedTuple):
    """What the function needs besides tensors."""

    ops: object  # the neuron's `NeuronOps` (CPU: C kernels or generated torch code)
    hyper: list
    n_inputs: int
    n_states: int
    n_learnable: int
    input_index: int  # the input the recurrent current is added to
    output_index: int  # the output fed back
    has_bias: bool


def run_stepped(ops, hyper, inputs, states, learnable, weight, bias, input_index, output_index):
    """(outputs as [T, B, H] tensors, final states) of a recurrent layer, differentiable as one function."""
    run = SteppedRun(ops, hyper, len(inputs), len(states), len(learnable), input_index, output_index,
                     bias is not None)
    tensors = [*inputs, *states, *learnable, weight, *([bias] if bias is not None else [])]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        result = _Stepped.apply(run, *tensors)
    else:
        result = _forward(run, inputs, states, learnable, weight, bias, save=False)[0]
    n_out = len(ops.layout.outputs)
    return list(result[:n_out]), list(result[n_out:])


def _forward(run, inputs, states, learnable, weight, bias, save):
    """(outputs + final states, per step the values its backward reads (empty without `save`))."""
    layout = run.ops.layout
    n_out, n_states = len(layout.outputs), run.n_states
    steps = inputs[0].shape[0]
    drive = inputs[run.input_index] if bias is None else inputs[run.input_index] + bias  # one add for all steps
    weight_t = weight.t()
    outputs, per_step, previous = None, [], None
    for t in range(steps):
        xs = [x[t:t + 1] for x in inputs]
        # a tensor of its own at every step: a view would keep all of `drive` alive in what the step saves
        current = drive[t].clone() if previous is None else torch.addmm(drive[t], previous, weight_t)
        xs[run.input_index] = current.unsqueeze(0)
        result = run.ops.forward_impl(xs, states, learnable, run.hyper, False, save, False)
        if outputs is None:
            outputs = [o.new_empty((steps, *o.shape[1:])) for o in result[:n_out]]
        for sequence, o in zip(outputs, result[:n_out]):
            sequence[t] = o[0]
        if save:  # what the step's backward reads, as the neuron's own autograd wiring picks it (`NeuronOps`)
            sources = {Kind.INPUT: xs, Kind.STATE: states, Kind.OUTPUT: result}
            per_step.append(pick_saved(layout.saved, sources, result[n_out + n_states:]))
        states = list(result[n_out:n_out + n_states])
        previous = outputs[run.output_index][t]
    return [*outputs, *states], per_step


class _Stepped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *tensors):
        inputs, states, learnable, weight, bias = _split(run, tensors)
        result, per_step = _forward(run, inputs, states, learnable, weight, bias, save=True)
        ctx.run, ctx.n_saved = run, len(per_step[0]) if per_step else 0
        ctx.state_shapes = [v.shape for v in states]
        fed_back = result[run.output_index]
        ctx.save_for_backward(weight, fed_back, *learnable, *[v for step in per_step for v in step])
        return tuple(result)

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        run = ctx.run
        layout = run.ops.layout
        n_out = len(layout.outputs)
        weight, fed_back, *rest = saved_tensors(ctx)
        learnable, flat = rest[:run.n_learnable], rest[run.n_learnable:]
        steps = fed_back.shape[0]
        per_step = [flat[t * ctx.n_saved:(t + 1) * ctx.n_saved] for t in range(steps)]
        step_shape = fed_back.shape[1:]
        zeros = fed_back.new_zeros((1, *step_shape))
        grad_outputs = grads[:n_out]
        carried = [g if g is not None else fed_back.new_zeros(step_shape) for g in grads[n_out:]]
        grad_inputs = [fed_back.new_empty((steps, *step_shape)) for _ in range(run.n_inputs)]
        grad_learnable = [None] * run.n_learnable
        back = None  # the fed-back output's gradient at this step: its own plus what the next step's current sends
        for t in reversed(range(steps)):
            grad_step = [zeros if g is None else g[t:t + 1] for g in grad_outputs]
            if back is not None:
                grad_step[run.output_index] = back.unsqueeze(0)
            result = run.ops.backward_impl(per_step[t], grad_step, carried, learnable, run.hyper, False, False, True)
            for sequence, g in zip(grad_inputs, result[:run.n_inputs]):
                sequence[t] = g[0]
            carried = list(result[run.n_inputs:run.n_inputs + run.n_states])
            for k, g in enumerate(result[run.n_inputs + run.n_states:]):
                grad_learnable[k] = g if grad_learnable[k] is None else grad_learnable[k] + g
            if t > 0:
                own = grad_outputs[run.output_index]
                own = zeros[0] if own is None else own[t - 1]
                back = torch.addmm(own, grad_inputs[run.input_index][t], weight)
        grad_current = grad_inputs[run.input_index]
        width = grad_current.shape[-1]
        at_weight = 1 + run.n_inputs + run.n_states + run.n_learnable  # the weight's place among the arguments
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[at_weight]:
            grad_weight = grad_current[1:].reshape(-1, width).t() @ fed_back[:-1].reshape(-1, width)
        if run.has_bias and ctx.needs_input_grad[at_weight + 1]:
            grad_bias = grad_current.sum(dim=(0, 1))
        grad_states = [g.sum_to_size(shape) if g.shape != shape else g for g, shape in zip(carried, ctx.state_shapes)]
        return (None, *grad_inputs, *grad_states, *grad_learnable, grad_weight,
                *([grad_bias] if run.has_bias else []))


def _split(run, tensors):
    at = 0
    inputs = list(tensors[at:at + run.n_inputs])
    at += run.n_inputs
    states = list(tensors[at:at + run.n_states])
    at += run.n_states
    learnable = list(tensors[at:at + run.n_learnable])
    at += run.n_learnable
    weight = tensors[at]
    bias = tensors[at + 1] if run.has_bias else None
    return inputs, states, learnable, weight, bias
