"""A recurrent layer run step by step on its neuron's per-step kernels (the C target or the generated torch code),
as one autograd function over the whole sequence.

Per step the forward adds the fed-back product to the input (`torch.addmm`) and calls the neuron's forward for
that step, keeping what its backward reads; the backward walks the steps last to first, calling the neuron's
backward for each with the carried state gradients, and hands the recurrent input's gradient back one step
through the weight (dI_t W). The weight's gradient is one product over all steps afterwards,
dW = sum_t dI_t^T s_{t-1}, instead of T small products that autograd would sum one by one.
"""
from typing import NamedTuple, Optional

import torch

from ..layout import Kind, pick_saved
from .autograd import differentiable_once, saved_tensors
from .recurrent import DelayLine, delayed_gradients


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
    max_delay: Optional[int] = None  # a delayed layer's (linear taps): its delays follow the weight and bias


def run_stepped(ops, hyper, inputs, states, learnable, weight, bias, input_index, output_index, delay=None,
                max_delay=None):
    """(outputs as [T, B, H] tensors, final states) of a recurrent layer, differentiable as one function. A delayed
    layer passes its delays ([H], linear taps) and `max_delay`: each neuron's output reaches the product through its
    delay line (`flexgen.launch.recurrent.DelayLine`)."""
    run = SteppedRun(ops, hyper, len(inputs), len(states), len(learnable), input_index, output_index,
                     bias is not None, None if delay is None else int(max_delay))
    tensors = [*inputs, *states, *learnable, weight, *([bias] if bias is not None else []),
               *([delay] if delay is not None else [])]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        result = _Stepped.apply(run, *tensors)
    else:
        inputs, states, learnable, weight, bias, delay = _split(run, tensors)
        result = _forward(run, inputs, states, learnable, weight, bias, _line(run, delay, weight), save=False)[0]
    n_out = len(ops.layout.outputs)
    return list(result[:n_out]), list(result[n_out:])


def _line(run, delay, weight):
    return None if delay is None else DelayLine.of(delay, run.max_delay, weight.dtype)


def _fed_back(line, sequence, t):
    """The operand of step t's product: the fed-back output of step t - 1, or through a delay line the outputs
    lag + 1 and lag + 2 steps back mixed by frac (each neuron its own; zeros before the first step)."""
    if line is None:
        return sequence[t - 1]
    near = _output_at(sequence, t - 1 - line.lag.to(torch.int64))
    far = _output_at(sequence, t - 2 - line.lag.to(torch.int64)) * (line.lag < line.max_delay).to(sequence.dtype)
    return near + line.frac * (far - near)


def _output_at(sequence, steps):
    """sequence[steps[h], :, h] for every column h ([B, H]); zero where steps[h] < 0."""
    batch, hidden = sequence.shape[1:]
    taken = sequence.gather(0, steps.clamp_min(0)[None, None, :].expand(1, batch, hidden))[0]
    return taken * (steps >= 0).to(sequence.dtype)


def _send_back(line, collected, grad_operand, t):
    """Add the gradient of step t's operand to the output steps it read (t - 1 - lag with 1 - frac, t - 2 - lag with
    frac) in `collected` [T, B, H]."""
    batch, hidden = grad_operand.shape
    lag = line.lag.to(torch.int64)
    far_weight = line.frac * (line.lag < line.max_delay).to(grad_operand.dtype)
    for steps, weight in ((t - 1 - lag, 1.0 - line.frac), (t - 2 - lag, far_weight)):
        index = steps.clamp_min(0)[None, None, :].expand(1, batch, hidden)
        collected.scatter_add_(0, index, (grad_operand * (weight * (steps >= 0).to(weight.dtype)))[None])


def _forward(run, inputs, states, learnable, weight, bias, line, save):
    """(outputs + final states, per step the values its backward reads (empty without `save`))."""
    layout = run.ops.layout
    n_out, n_states = len(layout.outputs), run.n_states
    steps = inputs[0].shape[0]
    drive = inputs[run.input_index] if bias is None else inputs[run.input_index] + bias  # one add for all steps
    weight_t = weight.t()
    outputs, per_step = None, []
    for t in range(steps):
        xs = [x[t:t + 1] for x in inputs]
        # a tensor of its own at every step: a view would keep all of `drive` alive in what the step saves
        current = drive[t].clone() if t == 0 else torch.addmm(drive[t], _fed_back(line, outputs[run.output_index], t),
                                                               weight_t)
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
    return [*outputs, *states], per_step


class _Stepped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *tensors):
        inputs, states, learnable, weight, bias, delay = _split(run, tensors)
        line = _line(run, delay, weight)
        result, per_step = _forward(run, inputs, states, learnable, weight, bias, line, save=True)
        ctx.run, ctx.line, ctx.n_saved = run, line, len(per_step[0]) if per_step else 0
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
        collected = None if ctx.line is None else fed_back.new_zeros(fed_back.shape)  # what later steps sent back
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
                if ctx.line is None:
                    back = torch.addmm(own, grad_inputs[run.input_index][t], weight)
                else:
                    _send_back(ctx.line, collected, grad_inputs[run.input_index][t] @ weight, t)
                    back = own + collected[t - 1]
        grad_current = grad_inputs[run.input_index]
        width = grad_current.shape[-1]
        at_weight = 1 + run.n_inputs + run.n_states + run.n_learnable  # the weight's place among the arguments
        at_delay = at_weight + 1 + run.has_bias
        grad_weight = grad_bias = None
        grad_delay = ()
        if ctx.line is not None:
            grad_weight, delay = delayed_gradients(grad_current, fed_back, weight, ctx.line,
                                                   ctx.needs_input_grad[at_weight], ctx.needs_input_grad[at_delay])
            grad_delay = (delay,)
        elif ctx.needs_input_grad[at_weight]:
            grad_weight = grad_current[1:].reshape(-1, width).t() @ fed_back[:-1].reshape(-1, width)
        if run.has_bias and ctx.needs_input_grad[at_weight + 1]:
            grad_bias = grad_current.sum(dim=(0, 1))
        grad_states = [g.sum_to_size(shape) if g.shape != shape else g for g, shape in zip(carried, ctx.state_shapes)]
        return (None, *grad_inputs, *grad_states, *grad_learnable, grad_weight,
                *([grad_bias] if run.has_bias else []), *grad_delay)


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
    delay = tensors[at + 1 + run.has_bias] if run.max_delay is not None else None
    return inputs, states, learnable, weight, bias, delay
