"""The forward and backward custom ops of one generated module variant (`torch.library.triton_op`s where Triton
kernels can run), and their entry point."""
import contextlib
import functools
import os
import types
from typing import List

import torch
from torch.library import triton_op, wrap_triton

from ...render.layout import Kind, pick_saved
from .. import allocate
from ..autograd import SECOND_ORDER, EagerConfig, EagerFunction, TransformableFunction, saved_tensors
from .fake import fake_backward, fake_forward, unsaved_backward
from .calls import BackwardCall, ForwardCall, Kernels
from .. import config
from ..config import numel
from .plans import EagerPlan
from ..scalars import fresh_zero
from ..torch_path import torch_backward, torch_forward
from ..triton_path import on_device_of, triton_backward, triton_forward


TORCH_PATHS = {}  # a forward op's name -> () -> its computation on the generated torch path


def _direct(kernel):
    return kernel


@functools.lru_cache(maxsize=None)
def triton_kernels_can_run():
    """Whether this process can run Triton kernels: a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1)."""
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _custom_op(name, fn, fake=None, triton=True):
    """The custom op running `fn`. Where Triton kernels can run it is a `triton_op`, which torch.compile traces
    into; elsewhere a plain custom op running the same function (the CPU paths launch no Triton kernel, and
    registering a triton_op imports Triton: 0.1-0.2 s of every CPU process's start). `fake` (default: `fn`
    itself) is the kernel tracing runs on fake tensors. `triton=False`: a plain custom op everywhere, opaque to
    the compiler (the C target's ops: a triton_op's body is traced, and the C launcher reads the tensors' data)."""
    if triton and triton_kernels_can_run():
        op = triton_op(name, mutates_args=())(_skip_kernel_scan(fn))
        if fake is not None:
            with contextlib.suppress(RuntimeError):  # a torch whose triton_op keeps its own fake: traces `fn`
                op.register_fake(fake)
        return op
    op = torch.library.custom_op(name, mutates_args=())(fn)
    op.register_fake(fake or fn)
    return op


def _skip_kernel_scan(fn):
    """Keep triton_op from scanning `fn`'s source for kernels.

    That best-effort scan imports torch._inductor (about a second of start-up
    for every process, compiled or not) and only feeds the AOTAutograd cache
    key, which the op names already pin: they carry the generated module's
    hash. The scan reads the source of `inspect.unwrap(fn)`; a partial has none,
    while the signature (schema inference follows __wrapped__ too) stays the
    one of a twin of `fn`.
    """
    twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__annotations__ = dict(fn.__annotations__)
    fn.__wrapped__ = functools.partial(twin)
    return fn


def _no_context(ctx, inputs, output):
    pass


def _refuse_second_order(ctx, grads):
    raise RuntimeError(SECOND_ORDER)


class NeuronOps:
    """The forward and backward custom ops of one generated module variant (plain or recompute).

    `call` is the entry point: inside `torch.compile` it calls the registered
    `triton_op`s (which the compiler traces into); in eager mode it runs the
    same implementations through a plain autograd.Function, which skips the
    dispatcher's per-call overhead and keeps torch._dynamo from being imported.
    """

    def __init__(self, module, layout, key, cpu=(torch_forward, torch_backward), target="", c_library=None):
        self.module, self.layout = module, layout
        self.cpu_forward, self.cpu_backward = cpu  # what runs where Triton does not: the torch path, or the C target
        self.c_library = c_library  # the C target's library where `cpu` is the C target
        self.kernels = Kernels(module, layout, _direct)
        self.n_visible = len(layout.outputs) + len(layout.states)  # outputs the caller sees: not the buffers
        prefix = f"flexgen::{layout.neuron}_{key[:12]}{layout.variant.suffix}{target}"
        # Eager calls launch the kernels directly; the ops go through wrap_triton so the compiler can trace them.
        self.forward_impl, self.backward_impl = self._forward_impl(_direct), self._backward_impl(_direct)
        forward, backward = self._forward_impl(wrap_triton), self._backward_impl(wrap_triton)
        TORCH_PATHS[prefix + "_forward"] = self.torch_path_forward
        # The fake kernels allocate the results (the C target's would read the fake tensors' data).
        fake = fake_forward(layout, target == "_c", forward)
        triton = target != "_c"
        self.forward = _custom_op(prefix + "_forward", forward, fake, triton)
        self.backward = _custom_op(prefix + "_backward", backward, fake_backward(layout, backward), triton)
        self.forward.register_autograd(self.backward_formula, setup_context=self.setup_context)
        # Under torch.compile a gradient of the gradient differentiates the backward op: refuse it by name.
        self.backward.register_autograd(_refuse_second_order, setup_context=_no_context)
        self._plans = {}

    def call(self, inputs, states, learnable, hyper, state_seqs, save, use_triton):
        if torch.compiler.is_compiling():
            return self.forward(inputs, states, learnable, hyper, state_seqs, save, use_triton)
        transforms = torch._C._are_functorch_transforms_active()  # wrapped tensors: unwrapped by the Function
        plan = self.plan(inputs, states, learnable, hyper, state_seqs, save) if use_triton and not transforms else None
        if plan is not None:
            return plan(inputs, states, learnable)
        config = EagerConfig(self, hyper, state_seqs, use_triton, len(inputs), len(states), save)
        with on_device_of(inputs[0].device) if use_triton else contextlib.nullcontext():
            if transforms:
                return list(TransformableFunction.apply(config, *inputs, *states, *learnable))
            if not save:
                return self.forward_impl(inputs, states, learnable, hyper, state_seqs, save, use_triton)
            return list(EagerFunction.apply(config, *inputs, *states, *learnable))

    def plan(self, inputs, states, learnable, hyper, state_seqs, save):
        """The `EagerPlan` for this call's signature; None when the call takes the general path."""
        tensors = (*inputs, *states, *learnable)
        key = (state_seqs, save, *hyper, *[(t.shape, t.stride(), t.dtype, t.device) for t in tensors])
        plan = self._plans.get(key)
        if plan is None:
            if inputs[0].shape[0] == 0 or inputs[0].numel() == 0:
                return None
            if len(self._plans) >= config.MAX_PLANS:  # shapes that keep changing: start over rather than grow
                self._plans.clear()
            call = ForwardCall(inputs, states, learnable, hyper, state_seqs, save)
            plan = self._plans[key] = EagerPlan(self, call)
        return plan if plan.reusable else None

    def torch_path_forward(self):
        """The forward op's computation on the generated torch path, whatever this variant's CPU kernel is: what
        an ONNX export decomposes the op into (`flexgen.interop.export.export_onnx`)."""
        return self._forward_impl(_direct, cpu_forward=torch_forward)

    def _forward_impl(self, launch, cpu_forward=None):
        kernels = Kernels(self.module, self.layout, launch)
        cpu_forward = cpu_forward or self.cpu_forward

        def forward(
            inputs: List[torch.Tensor],
            states: List[torch.Tensor],
            learnable: List[torch.Tensor],
            hyper: List[float],
            state_seqs: bool,
            save: bool,
            use_triton: bool,
        ) -> List[torch.Tensor]:
            call = ForwardCall(inputs, states, learnable, hyper, state_seqs, save)
            if call.shape[0] == 0 or call.n_elem == 0:
                return allocate.empty_forward(kernels.layout, call)
            return (triton_forward if use_triton else cpu_forward)(kernels, call)

        return forward

    def _backward_impl(self, launch):
        kernels = Kernels(self.module, self.layout, launch)

        def backward(
            saved: List[torch.Tensor],
            grad_outputs: List[torch.Tensor],
            grad_states: List[torch.Tensor],
            learnable: List[torch.Tensor],
            hyper: List[float],
            state_seqs: bool,
            use_triton: bool,
            grad_init: bool,
        ) -> List[torch.Tensor]:
            call = BackwardCall(saved, grad_outputs, grad_states, learnable, hyper, state_seqs, grad_init)
            return (triton_backward if use_triton else self.cpu_backward)(kernels, call)

        return backward

    def setup_context(self, ctx, inputs, output):
        xs, states, learnable, hyper, state_seqs, save, use_triton = inputs
        layout = self.layout
        n_out, n_states = len(layout.outputs), len(layout.states)
        ctx.saved_nothing = not save
        if not save:  # recorded under no_grad (an exported program traced there): no backward to run
            return
        sources = {Kind.INPUT: xs, Kind.STATE: states, Kind.OUTPUT: output}
        saved = pick_saved(layout.saved, sources, output[n_out + n_states:])
        # Buffers may be neither inputs nor outputs (eager calls do not return them): autograd saves
        # such intermediates too, and frees them after the backward like the rest.
        ctx.save_for_backward(*saved, *learnable)
        ctx.n_saved = len(saved)
        ctx.hyper, ctx.state_seqs, ctx.use_triton = hyper, state_seqs, use_triton
        ctx.shape, ctx.dtype, ctx.device = xs[0].shape, xs[0].dtype, xs[0].device
        ctx.state_dtypes = [v.dtype for v in states]

    def backward_formula(self, ctx, grads, backward=None, zero=None, grad_init=True):
        """Gradients for the op's inputs; a None incoming gradient reads as a stride-0 `zero(dtype, device)`.

        Without `grad_init` the initial states' gradients are not computed (None).
        """
        if getattr(ctx, "saved_nothing", False):
            unsaved_backward(ctx, grads)
        layout = self.layout
        n_out, n_states, n_in = len(layout.outputs), len(layout.states), len(layout.inputs)
        tensors = saved_tensors(ctx)
        saved, learnable = list(tensors[: ctx.n_saved]), list(tensors[ctx.n_saved:])
        shape = ctx.shape
        zero = zero or fresh_zero
        # Missing gradients read as zeros with stride 0; the outputs' keep their shape (the backward's
        # shape comes from them), the states' stay 0-d (see abi.neuron_stride): one expand less per call.
        grad_outputs = [g if g is not None else zero(ctx.dtype, ctx.device).expand(shape) for g in grads[:n_out]]
        grad_states = [
            g if g is not None else zero(dt, ctx.device)
            for g, dt in zip(grads[n_out:n_out + n_states], ctx.state_dtypes)
        ]
        no_hyper = None if ctx.hyper else []  # autograd wants an empty list back for an empty list input
        if shape[0] == 0 or numel(shape[1:]) == 0:
            grad_inputs = [torch.zeros(shape, dtype=ctx.dtype, device=ctx.device) for _ in range(n_in)]
            grad_init = [
                g.expand(shape[1:]) if not ctx.state_seqs else torch.zeros(shape[1:], dtype=g.dtype, device=ctx.device)
                for g in grad_states
            ]
            return grad_inputs, grad_init, [torch.zeros_like(w) for w in learnable], no_hyper, None, None, None
        backward = backward or self.backward
        result = backward(saved, grad_outputs, grad_states, learnable, ctx.hyper, ctx.state_seqs, ctx.use_triton,
                          grad_init)
        return result[:n_in], result[n_in:n_in + n_states], result[n_in + n_states:], no_hyper, None, None, None
