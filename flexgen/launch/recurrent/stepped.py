"""A recurrent layer run step by step (`run_stepwise`, the layer's "stepwise" path): on the CPU on its neuron's
per-step kernels (the C target or the generated torch code) as one autograd function over the whole sequence;
elsewhere one call of the neuron per step.

Per step the forward adds the fed-back product to the input (`torch.addmm`) and calls the neuron's forward for
that step, keeping what its backward reads; the backward walks the steps last to first, calling the neuron's
backward for each with the carried state gradients, and hands the recurrent input's gradient back one step
through the weight (dI_t W). The weight's gradient is one product over all steps afterwards,
dW = sum_t dI_t^T s_{t-1}, instead of T small products that autograd would sum one by one.

On the C target (fp32, fp64) every sequence the steps read or write is allocated once, [T, N], and each step calls
the C kernels on its rows (`c_path.StepCall`): a ctypes call and a product written in place per step, no tensors
made per step. Otherwise each step goes through the neuron's ops, as one call of its own.
"""
import functools
from typing import NamedTuple, Optional

import torch

from ..eager import run_recurrent_loop
from ...render.layout import Backward, Forward, Kind, pick_saved
from .. import c_path
from ..abi import reduce_to_param, summed_over_steps_and_rows
from ..autograd import differentiable_once, saved_tensors
from .lines import line_of
from ..scalars import tracing_or_transforming


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
    max_delay: Optional[int] = None  # a delayed layer's: its delays (or taps) follow the weight and bias


def run_stepped(ops, hyper, inputs, states, learnable, weight, bias, input_index, output_index, delay=None,
                max_delay=None):
    """(outputs as [T, B, H] tensors, final states) of a recurrent layer, differentiable as one function. A delayed
    layer passes `max_delay` and its delays ([H], linear taps) or its taps ([H, max_delay + 1], any interpolation):
    each neuron's output reaches the product through its delay line (`flexgen.launch.recurrent.lines.line_of`)."""
    run = SteppedRun(ops, hyper, len(inputs), len(states), len(learnable), input_index, output_index,
                     bias is not None, None if delay is None else int(max_delay))
    tensors = [*inputs, *states, *learnable, weight, *([bias] if bias is not None else []),
               *([delay] if delay is not None else [])]
    on_rows = ops.c_library is not None and c_path.steps_one_at_a_time(ops.layout, inputs[0].dtype)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        result = (_SteppedRows if on_rows else _Stepped).apply(run, *tensors)
    elif on_rows:
        inputs, states, learnable, weight, bias, delay = _split(run, tensors)
        result = _forward_rows(run, inputs, states, learnable, weight, bias, _line(run, delay, weight), False).results
    else:
        inputs, states, learnable, weight, bias, delay = _split(run, tensors)
        result = _forward(run, inputs, states, learnable, weight, bias, _line(run, delay, weight), save=False)[0]
    n_out = len(ops.layout.outputs)
    return list(result[:n_out]), list(result[n_out:])


def _line(run, delay, weight):
    """The delay line the steps read through (`flexgen.launch.recurrent.lines`), or None."""
    return line_of(delay, run.max_delay, weight)


def _fed_back(line, sequence, t):
    """The operand of step t's product: the fed-back output of step t - 1, or what the delay line reads."""
    return sequence[t - 1] if line is None else line.fed_back(sequence, t)


def _forward(run, inputs, states, learnable, weight, bias, line, save):
    """(outputs + final states, per step the values its backward reads (empty without `save`))."""
    layout = run.ops.layout
    n_out, n_states = len(layout.outputs), run.n_states
    steps = inputs[0].shape[0]
    drive = inputs[run.input_index] if bias is None else inputs[run.input_index] + bias  # one add for all steps
    # MKL's product is slower on the transposed view; a call of one step (streaming) reads no product here
    weight_t = weight.t().contiguous() if steps > 1 else None
    outputs, per_step = None, []
    for t in range(steps):
        xs = [x[t:t + 1] for x in inputs]
        # a tensor of its own at every step: a view would keep all of `drive` alive in what the step saves
        if t == 0:
            current = drive[t].clone()
        else:
            current = torch.addmm(drive[t], _fed_back(line, outputs[run.output_index], t), weight_t)
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
                    ctx.line.send_back(collected, grad_inputs[run.input_index][t] @ weight, t)
                    back = own + collected[t - 1]
        grad_current = grad_inputs[run.input_index]
        grad_weight, grad_bias, grad_delay = _parameter_gradients(run, ctx, grad_current, fed_back, weight)
        grad_states = [g.sum_to_size(shape) if g.shape != shape else g for g, shape in zip(carried, ctx.state_shapes)]
        return (None, *grad_inputs, *grad_states, *grad_learnable, grad_weight,
                *([grad_bias] if run.has_bias else []), *grad_delay)


def _parameter_gradients(run, ctx, grad_current, fed_back, weight):
    """(weight's gradient, bias's, (the delays' or taps',) or ()) from the recurrent input's gradient over all
    steps."""
    at_weight = 1 + run.n_inputs + run.n_states + run.n_learnable  # the weight's place among the arguments
    at_delay = at_weight + 1 + run.has_bias
    grad_weight = grad_bias = None
    grad_delay = ()
    if ctx.line is not None:
        wants_delay = run.max_delay is not None and ctx.needs_input_grad[at_delay]
        grad_weight, delay = ctx.line.gradients(grad_current, fed_back, weight, ctx.needs_input_grad[at_weight],
                                                wants_delay)
        grad_delay = (delay,) if run.max_delay is not None else ()  # a SynapseLine's delays are in the weight
    elif ctx.needs_input_grad[at_weight]:
        width = grad_current.shape[-1]
        grad_weight = grad_current[1:].reshape(-1, width).t() @ fed_back[:-1].reshape(-1, width)
    if run.has_bias and ctx.needs_input_grad[at_weight + 1]:
        grad_bias = summed_over_steps_and_rows(grad_current)
    return grad_weight, grad_bias, grad_delay


class RowsForward(NamedTuple):
    """A forward on the C target's rows: its results, and the [T, N] arrays the backward reads."""

    results: list  # outputs as [T, B, H], then the final states
    inputs: list  # the recurrent input's entry is the current, with the product added
    outputs: list
    buffers: list


def _forward_rows(run, inputs, states, learnable, weight, bias, line, save):
    layout = run.ops.layout
    steps, batch, hidden = inputs[run.input_index].shape
    n, dtype = batch * hidden, inputs[0].dtype
    new = functools.partial(torch.empty, dtype=dtype, device=inputs[0].device)
    current = new(steps, n)  # the recurrent input plus the product, step by step
    rows = [current if k == run.input_index else x.detach().to(dtype).expand(steps, batch, hidden).reshape(steps, n)
            for k, x in enumerate(inputs)]
    drive = inputs[run.input_index].detach()
    drive = drive if bias is None else drive + bias.detach()
    state_rows = [new(2, n) for _ in states]  # step t reads row t % 2 and writes the other
    for seq, v in zip(state_rows, states):
        seq[0] = v.detach().expand(batch, hidden).reshape(n)
    outputs = [new(steps, n) for _ in layout.outputs]
    buffers = [new(steps, n) for _ in layout.buffers] if save else []
    ws, strides = c_path.learnable_data(learnable, (batch, hidden), dtype)
    groups = {Forward.INPUTS: [c_path.Rows(r) for r in rows],
              Forward.STATES: [c_path.Rows(v, 0, 2) for v in state_rows],
              Forward.LEARNABLE: ws, Forward.OUTPUTS: [c_path.Rows(o) for o in outputs],
              Forward.FINALS: [c_path.Rows(v, 1, 2) for v in state_rows],
              Forward.BUFFERS: [c_path.Rows(b) for b in buffers] if save else [None] * len(layout.buffers)}
    step = c_path.StepCall(run.ops.c_library, layout, "forward", dtype, groups, strides, run.hyper,
                           (1, n, torch.get_num_threads(), int(save), 0))
    currents, fed_back = current.view(steps, batch, hidden), outputs[run.output_index].view(steps, batch, hidden)
    # MKL's product is slower on the transposed view; a call of one step (streaming) reads no product here
    weight_t = weight.detach().t().contiguous() if steps > 1 else None
    currents[0] = drive[0]
    for t in range(steps):
        if t:
            torch.addmm(drive[t], _fed_back(line, fed_back, t), weight_t, out=currents[t])
        step(t)
    finals = [seq[steps % 2].view(batch, hidden) for seq in state_rows]
    return RowsForward([o.view(steps, batch, hidden) for o in outputs] + finals, rows, outputs, buffers)


class _SteppedRows(torch.autograd.Function):
    """`_Stepped` on the C target's rows (see the module's docstring)."""

    @staticmethod
    def forward(ctx, run, *tensors):
        inputs, states, learnable, weight, bias, delay = _split(run, tensors)
        line = _line(run, delay, weight)
        done = _forward_rows(run, inputs, states, learnable, weight, bias, line, save=True)
        ctx.run, ctx.line = run, line
        ctx.state_shapes = [v.shape for v in states]
        ctx.counts = [len(done.inputs), len(done.outputs), len(done.buffers), len(learnable)]
        ctx.save_for_backward(weight, *done.inputs, *done.outputs, *done.buffers, *learnable)
        return tuple(done.results)

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        run, layout = ctx.run, ctx.run.ops.layout
        weight, *rest = saved_tensors(ctx)
        inputs, outputs, buffers, learnable = _take(rest, ctx.counts)
        steps, n = outputs[0].shape
        hidden = weight.shape[0]
        batch = n // hidden
        new = functools.partial(torch.empty, dtype=outputs[0].dtype, device=outputs[0].device)
        sources = {Kind.INPUT: [c_path.Rows(r) for r in inputs], Kind.OUTPUT: [c_path.Rows(o) for o in outputs]}
        saved = pick_saved(layout.saved, sources, [c_path.Rows(b) for b in buffers])
        n_out = len(outputs)
        # the fed-back output's gradient: its own, to which each step adds what the next step's current sends
        own = grads[run.output_index]
        fed_back_grad = new(steps, n).zero_() if own is None else own.detach().reshape(steps, n).clone()
        no_grad = new(1, n).zero_()
        grad_outputs = [c_path.Rows(no_grad, sign=0) if g is None else c_path.Rows(g.detach().reshape(steps, n))
                        for g in grads[:n_out]]
        grad_outputs[run.output_index] = c_path.Rows(fed_back_grad)
        # the states' gradients in two rows used in turn: step t (walked from T - 1 down) reads row (T - 1 - t) % 2
        carried = [new(2, n) for _ in ctx.state_shapes]
        for rows_of, g in zip(carried, grads[n_out:]):
            rows_of[0] = 0.0 if g is None else g.detach().expand(batch, hidden).reshape(n)
        grad_inputs = [new(steps, n) for _ in inputs]
        partials = [new(steps, n) for _ in learnable]
        ws, strides = c_path.learnable_data(learnable, (batch, hidden), outputs[0].dtype)
        groups = {Backward.SAVED: saved, Backward.GRAD_OUTPUTS: grad_outputs,
                  Backward.GRAD_STATES: [c_path.Rows(c, steps - 1, 2, -1) for c in carried], Backward.LEARNABLE: ws,
                  Backward.GRAD_INPUTS: [c_path.Rows(g) for g in grad_inputs],
                  Backward.GRAD_PREV: [c_path.Rows(c, steps, 2, -1) for c in carried],
                  Backward.PARTIALS: [c_path.Rows(p) for p in partials]}
        step = c_path.StepCall(run.ops.c_library, layout, "backward", outputs[0].dtype, groups, strides, run.hyper,
                               (1, n, torch.get_num_threads(), 0))
        grad_current = grad_inputs[run.input_index].view(steps, batch, hidden)
        sent_back = fed_back_grad.view(steps, batch, hidden)
        weight = weight.detach()
        for t in reversed(range(steps)):
            step(t)
            if t and ctx.line is None:
                sent_back[t - 1].addmm_(grad_current[t], weight)
            elif t:
                ctx.line.send_back(sent_back, grad_current[t] @ weight, t)
        fed_back = outputs[run.output_index].view(steps, batch, hidden)
        grad_weight, grad_bias, grad_delay = _parameter_gradients(run, ctx, grad_current, fed_back, weight)
        grad_states = [c[steps % 2].view(batch, hidden).sum_to_size(shape)
                       for c, shape in zip(carried, ctx.state_shapes)]
        grad_learnable = [reduce_to_param(p.sum(0), w, (batch, hidden)) for p, w in zip(partials, learnable)]
        return (None, *[g.view(steps, batch, hidden) for g in grad_inputs], *grad_states, *grad_learnable, grad_weight,
                *([grad_bias] if run.has_bias else []), *grad_delay)


def _take(flat, counts):
    """`flat` cut into consecutive groups of the given sizes."""
    groups = []
    for count in counts:
        groups.append(list(flat[:count]))
        flat = flat[count:]
    return groups


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


def run_stepwise(neuron, checked, weight, bias, input_index, output_index, n_outputs, taps=None, line=None):
    """A recurrent layer step by step: per step, the recurrent current (`recurrent_input`) and one call of the
    neuron's generated kernels (or torch path) through `neuron`, a `flexgen.layers.neuron.NeuronCall`, on that step.
    On the CPU (C kernels or generated torch code) the whole loop is one autograd function (`run_stepped`),
    delay lines included: `line` (delays [H], max_delay) for linear taps, else `taps`
    ([H, max_delay + 1], see `run_recurrent_loop`). Elsewhere, and under torch.compile or torch.func, each step is
    its own call."""
    inputs, states, learnable = checked
    if inputs[0].shape[0] and not tracing_or_transforming():
        ops, _, use_triton = neuron.ops(checked)
        if not use_triton:
            delay, max_delay = line if line is not None else (taps, None if taps is None else taps.shape[1] - 1)
            return run_stepped(ops, list(neuron.hyper.values()), inputs, states, learnable, weight, bias,
                               input_index, output_index, delay, max_delay)

    def step(xs, states):
        return neuron((xs, states, learnable))

    return run_recurrent_loop(step, inputs, states, weight, bias, input_index, output_index, n_outputs, taps)
