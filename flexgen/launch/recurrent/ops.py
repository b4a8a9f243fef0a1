"""A recurrent layer's fused kernels as torch.library custom ops: what torch.compile traces into its graph (eager
calls go through `flexgen.launch.recurrent.fused.FusedRecurrentFunction` instead)."""
from typing import List, Optional

import torch
from torch.library import wrap_triton

from ..autograd import saved_tensors
from .lines import line_of
from ..neuron.ops import _custom_op, _no_context, _refuse_second_order
from .fused import (FusedRun, RecurrentBackwardCall, RecurrentCall, _gradients, _saved_values, _unpacked, _Wanted,
                    fused_backward, fused_forward)
from .tiling import config_of


class RecurrentOps:
    """The fused kernels of one generated recurrent module as custom ops (`triton_op`s where Triton runs), which
    torch.compile traces into its graph, fullgraph included; the weight's, bias's and delays' gradients are torch
    ops around the backward op. Eager calls go through `FusedRecurrentFunction` (no dispatcher on the way)."""

    def __init__(self, compiled):
        self.compiled = compiled
        prefix = f"flexgen::{compiled.layout.layout.neuron}_{compiled.key[:12]}_recurrent"
        self.forward = _custom_op(prefix + "_forward", self._forward_op())
        self.backward = _custom_op(prefix + "_backward", self._backward_op())
        self.forward.register_autograd(self._backward_formula, setup_context=self._setup_context)
        self.backward.register_autograd(_refuse_second_order, setup_context=_no_context)

    def _forward_op(self):
        compiled = self.compiled

        def forward(inputs: List[torch.Tensor], states: List[torch.Tensor], learnable: List[torch.Tensor],
                    hyper: List[float], weight: torch.Tensor, bias: torch.Tensor, delay: Optional[torch.Tensor],
                    max_delay: int, save: bool, config: List[int]) -> List[torch.Tensor]:
            line = line_of(delay, max_delay, weight)
            call = RecurrentCall(inputs, states, learnable, hyper, weight, bias, save, line)
            outputs, finals, buffers = fused_forward(compiled, call, config_of(config), launch=wrap_triton)
            return [*outputs, *finals, *buffers]

        return forward

    def _backward_op(self):
        compiled = self.compiled

        def backward(saved: List[torch.Tensor], fed_back: torch.Tensor, grad_outputs: List[torch.Tensor],
                     grad_states: List[torch.Tensor], learnable: List[torch.Tensor], hyper: List[float],
                     weight: torch.Tensor, delay: Optional[torch.Tensor], max_delay: int, grad_init: bool,
                     config: List[int]) -> List[torch.Tensor]:
            line = line_of(delay, max_delay, weight)
            call = RecurrentBackwardCall(saved, fed_back, grad_outputs, grad_states, learnable, hyper, weight,
                                         grad_init, line)
            grad_inputs, grad_prev, grad_learnable = fused_backward(compiled, call, config_of(config),
                                                                    launch=wrap_triton)
            return [*grad_inputs, *(grad_prev or []), *grad_learnable]

        return backward

    def _setup_context(self, ctx, inputs, output):
        xs, states, learnable, hyper, weight, bias, delay, max_delay, save, config = inputs
        layout = self.compiled.layout
        n_out = len(layout.layout.outputs)
        outputs, buffers = output[:n_out], output[n_out + len(states):]
        ctx.save_for_backward(*_saved_values(layout, xs, states, outputs, buffers), outputs[layout.output_index],
                              *learnable, weight, *([] if delay is None else [delay]))
        ctx.run = FusedRun(self.compiled, hyper, len(xs), len(states), len(learnable), config_of(config),
                           None if delay is None else max_delay)
        ctx.config, ctx.state_dtypes = config, [v.dtype for v in states]
        ctx.wanted = _Wanted(any(v.requires_grad for v in states), weight.requires_grad, bias.requires_grad,
                             delay is not None and delay.requires_grad)

    def _backward_formula(self, ctx, grads):
        run = ctx.run
        tensors = saved_tensors(ctx)
        delay = tensors[-1] if run.max_delay is not None else None
        saved, fed_back, learnable, weight = _unpacked(run, tensors[:-1] if delay is not None else tensors)
        line = line_of(delay, run.max_delay, weight)
        n_out = len(self.compiled.layout.layout.outputs)
        grads = [grads[k] for k in range(n_out + run.n_states)]  # the buffers' gradients are not used

        def backward(call):
            result = self.backward(call.saved, call.fed_back, call.grad_outputs, call.grad_states, call.learnable,
                                   call.hyper, call.weight, delay, 0 if delay is None else run.max_delay,
                                   call.grad_init, ctx.config)
            n_in, n_states = run.n_inputs, run.n_states if call.grad_init else 0
            return result[:n_in], result[n_in:n_in + n_states] or None, result[n_in + n_states:]

        result = _gradients(run, line, saved, fed_back, learnable, weight, grads, ctx.state_dtypes, ctx.wanted,
                            backward)
        a, b = run.n_inputs, run.n_inputs + run.n_states
        c = b + run.n_learnable
        grad_delay = result[c + 2] if run.max_delay is not None else None
        return (list(result[:a]), list(result[a:b]), list(result[b:c]), None, result[c], result[c + 1], grad_delay,
                None, None, None)
