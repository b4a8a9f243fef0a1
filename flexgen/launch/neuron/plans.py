"""Per-signature plans: the host side of eager Triton calls, worked out once per shape, stride and dtype."""
import torch

from ...render.layout import Kind, backward_arguments, forward_arguments
from .. import allocate
from ..abi import fill, kernel_args, learnable_gradients
from ..autograd import PlannedFunction
from .calls import BackwardCall
from ..config import DEFAULT, grid, numel
from ..scalars import cached_zero
from ..triton_path import KernelCall, backward_constexprs, backward_groups, forward_constexprs, forward_groups, triton_backward

# where a saved tensor comes from: EagerPlan.saved's groups
SAVED_INPUT, SAVED_STATE, SAVED_OUTPUT, SAVED_BUFFER = range(4)
_SAVED_GROUPS = {Kind.INPUT: SAVED_INPUT, Kind.STATE: SAVED_STATE, Kind.OUTPUT: SAVED_OUTPUT}


def saved_slots(layout):
    """(group, index) of each saved tensor among (inputs, states, outputs, buffers); buffers (saved values
    or checkpoints) in the order written."""
    slots, n_buffers = [], 0
    for value in layout.saved:
        if value.kind in _SAVED_GROUPS:
            slots.append((_SAVED_GROUPS[value.kind], value.index))
        else:
            slots.append((SAVED_BUFFER, n_buffers))
            n_buffers += 1
    return slots


def pick_saved(slots, inputs, states, outputs, buffers):
    """The tensors the backward reads, in the layout's order."""
    groups = (inputs, states, outputs, buffers)
    return [groups[group][index] for group, index in slots]


def gradient_layouts(grads):
    """What a backward plan depends on of the incoming gradients: each one's shape, strides and dtype (None where
    autograd has none)."""
    return [None if g is None else (g.shape, g.stride(), g.dtype) for g in grads]


class EagerPlan:
    """The host side of eager Triton calls with one signature, worked out once.

    A signature is the shapes, strides, dtypes and devices of a call's tensors,
    with its hyper-parameters and flags. Everything a launch needs besides the
    tensors themselves (sizes, strides, stride-0 flags, the kernel, which
    buffers to allocate) follows from it, so a plan keeps the argument lists as
    templates and a call only allocates its outputs and fills in its tensors.
    Calls whose tensors need a copy first (a layout the kernels cannot index)
    get no plan and take the general path.
    """

    def __init__(self, ops, call):
        first = call.inputs[0]
        self.ops, self.layout = ops, ops.layout
        self.shape, self.dtype, self.device = tuple(first.shape), first.dtype, first.device
        self.hyper, self.state_seqs, self.save = list(call.hyper), call.state_seqs, call.save
        self.state_dtypes = [v.dtype for v in call.states]
        self.n_elem = numel(self.shape[1:])
        layout = self.layout
        self.n_inputs, self.n_states, self.n_outputs = len(layout.inputs), len(layout.states), len(layout.outputs)
        self.n_saved = len(layout.saved)
        self.saved_slots = saved_slots(layout)
        # Outputs and saved values take the first input's shape and dtype; empty_like keeps its layout, so only if
        # contiguous. Checkpoints (recompute) have shapes of their own.
        self.like_first = first.is_contiguous()
        self.buffers_like_first = self.like_first and not layout.variant.recompute and not any(
            b.binary for b in layout.buffers)
        self.n_buffers = len(layout.buffers) if call.save else 0
        self.final_shapes = [(self.shape if call.state_seqs else self.shape[1:], dt) for dt in self.state_dtypes]
        self.grad_dtypes = [self.dtype] * self.n_outputs + self.state_dtypes
        self.zero_grads = self._zero_grads()
        args = kernel_args(forward_arguments(layout, call.save), forward_groups(call, self._allocate_forward()),
                           self.shape[1:], flatten_params=False, dtype=self.dtype, device=self.device)
        args += [self.shape[0], self.n_elem]
        self.reusable, self.template, self.slots = args.reusable, args.template(), args.slots
        kernel = getattr(ops.module, layout.kernel_name("forward" if call.save else "inference"))
        constexprs = forward_constexprs(layout, self.dtype, call.state_seqs)
        self.kernel = KernelCall(kernel, grid(self.n_elem, constexprs["BLOCK"]), constexprs,
                                 [p for p, _, _ in self.slots], self.device)
        self.backward_plans = {}

    def _allocate_forward(self, first=None):
        if first is not None and self.like_first:  # empty_like parses fewer arguments than empty: ~1 µs less each
            outputs = [torch.empty_like(first) for _ in range(self.n_outputs)]
            finals = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.final_shapes]
            if self.buffers_like_first:
                return outputs, finals, [torch.empty_like(first) for _ in range(self.n_buffers)]
            buffers = allocate.buffers(self.layout, self.shape, self.dtype, self.device) if self.save else []
            return outputs, finals, buffers
        return allocate.forward_results(self.layout, self.shape, self.dtype, self.device, self.state_dtypes,
                                        self.state_seqs, self.save)

    def __call__(self, inputs, states, learnable):
        """The outputs and the final states (or their sequences), through autograd when the plan saves."""
        if self.save:
            return list(PlannedFunction.apply(self, *inputs, *states, *learnable))
        outputs, finals, _ = self.forward(inputs, states, learnable)
        return outputs + finals

    def forward(self, inputs, states, learnable):
        """outputs, final states (or their sequences) and buffers."""
        fresh = self._allocate_forward(inputs[0])
        self.kernel(fill(self.template, self.slots, (inputs, states, learnable, *fresh)))
        return fresh

    def saved(self, inputs, states, outputs, buffers):
        return pick_saved(self.saved_slots, inputs, states, outputs, buffers)

    def backward(self, saved, learnable, grads, grad_init):
        """Gradients of the inputs, the initial states (None unless `grad_init`) and the learnable parameters.

        grads: the incoming gradients of the outputs and the final states, None where autograd has none
        (read as a stride-0 zero).
        """
        key = (grad_init, *gradient_layouts(grads))
        plan = self.backward_plans.get(key)
        if plan is None:
            plan = self.backward_plans[key] = BackwardPlan(self, saved, learnable, self._with_zeros(grads), grad_init)
        return plan(saved, learnable, self._with_zeros(grads))

    def _zero_grads(self):
        """The stride-0 zeros read for missing incoming gradients, looked up once; None while a CUDA
        graph is captured (see `cached_scalar`: those are made per call)."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        return [cached_zero(dt, self.device) for dt in self.grad_dtypes]

    def _with_zeros(self, grads):
        if self.zero_grads is None:
            return [cached_zero(dt, self.device) if g is None else g for g, dt in zip(grads, self.grad_dtypes)]
        return [z if g is None else g for g, z in zip(grads, self.zero_grads)]


class BackwardPlan:
    """`EagerPlan`'s backward for one layout of the incoming gradients."""

    def __init__(self, forward, saved, learnable, grads, grad_init):
        self.forward, self.grad_init = forward, grad_init
        self.n_learnable = len(learnable)
        call = self._call(saved, learnable, grads)
        args = kernel_args(backward_arguments(forward.layout), backward_groups(call, self._allocate()),
                           forward.shape[1:], forward.state_seqs, flatten_params=False, dtype=forward.dtype,
                           device=forward.device)
        args += [forward.shape[0], forward.n_elem]
        self.reusable, self.template, self.slots = args.reusable, args.template(), args.slots
        constexprs = backward_constexprs(forward.layout, forward.dtype, forward.state_seqs, grad_init)
        kernel = getattr(forward.ops.module, forward.layout.kernel_name("backward"))
        self.kernel = KernelCall(kernel, grid(forward.n_elem, constexprs["BLOCK"]), constexprs,
                                 [p for p, _, _ in self.slots], forward.device)
        # A saved buffer (not one in bytes) has the input gradients' shape, dtype and contiguous layout: empty_like
        # it (cheaper).
        buffers = [i for i, ((group, _), s) in enumerate(zip(forward.saved_slots, forward.layout.saved))
                   if group == SAVED_BUFFER and not s.binary]
        plain = not forward.layout.variant.recompute
        self.like_saved = buffers[0] if plain and buffers and not grad_init and not self.n_learnable else None
        self.n_inputs, self.no_state_grads = len(forward.layout.inputs), [None] * forward.n_states

    def _call(self, saved, learnable, grads):
        f = self.forward
        n_out = f.n_outputs
        return BackwardCall(saved, grads[:n_out], grads[n_out:], learnable, f.hyper, f.state_seqs, self.grad_init)

    def _allocate(self, saved=None):
        f = self.forward
        if saved is not None and self.like_saved is not None:
            like = saved[self.like_saved]
            return [torch.empty_like(like) for _ in range(self.n_inputs)], None, []
        return allocate.backward_results(f.layout, f.shape, f.dtype, f.device, f.state_dtypes, self.n_learnable,
                                         self.grad_init)

    def __call__(self, saved, learnable, grads):
        f = self.forward
        if not self.reusable:  # a gradient in a layout the kernel cannot index: copied, call by call
            return triton_backward(f.ops.kernels, self._call(saved, learnable, grads), DEFAULT)
        grad_inputs, grad_prev, partials = self._allocate(saved)
        n_out = f.n_outputs
        prev_slots = grad_prev if grad_prev is not None else [grad_inputs[0]] * f.n_states  # see backward_groups
        groups = (saved, grads[:n_out], grads[n_out:], learnable, grad_inputs, prev_slots, partials)
        self.kernel(fill(self.template, self.slots, groups))
        if not partials:
            return grad_inputs + (grad_prev or self.no_state_grads)
        grad_learnable = learnable_gradients(f.layout, partials, learnable, f.shape[1:], held_grad=self.grad_init)
        return grad_inputs + (grad_prev or self.no_state_grads) + grad_learnable
