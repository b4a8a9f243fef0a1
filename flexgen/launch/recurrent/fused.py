"""A recurrent layer's fused kernels: launching them, and their autograd.

The forward kernel runs the whole sequence in one launch, one program per tile of batch rows, with the recurrent
product `s_{t-1} W^T` of every step inside its time loop (`tl.dot`; for small batches CUDA cores on the slice of
the weight each program keeps, `tiling.Tiling.stationary`). The backward kernel walks time in reverse and adds
`grad_I_{t+1} W` to the gradient of the output fed back; it stores every step's `grad_I_t` (the gradient of the
input, which it returns anyway), so the weight's gradient, `sum_t grad_I_t^T s_{t-1}`, is one matrix product on the
host over all steps and rows: no [T, H, H] intermediate, no partial sums per program, and exact in fp64.
"""
from typing import List, NamedTuple, Optional, Union

import torch

from ...render.layout import Kind, pick_saved
from .. import allocate
from ..abi import fill, kernel_args, learnable_gradients, summed_over_steps_and_rows
from ..autograd import BackwardFunction, differentiable_once, saved_tensors
from ..config import HALF_DTYPES, MAX_PLANS, compute_dtype
from .lines import DelayLine, TapLine, line_of, weight_gradient
from ..neuron.plans import gradient_layouts
from ..scalars import cached_zero
from .tiling import (DEFAULT_RECURRENT, RecurrentConfig, Tiling, call_tiling, config_values, dot_precision,
                     resident_programs)
from ..triton_path import KernelCall, on_device_of


class RecurrentCall(NamedTuple):
    """A fused recurrent forward over [T, B, H] inputs; `weight` (the effective [H, H] weight) and `bias` ([H], or
    a 0-d zero) are in the inputs' dtype; `line` a delayed layer's `DelayLine` or `TapLine`, else None; `previous`
    the output [B, H] (contiguous, in the inputs' dtype) an undelayed layer's first step takes its product of,
    inside the kernels (calls without autograd), else None."""

    inputs: List
    states: List
    learnable: List
    hyper: List[float]
    weight: torch.Tensor
    bias: torch.Tensor
    save: bool
    line: Optional[Union[DelayLine, TapLine]] = None
    previous: Optional[torch.Tensor] = None

    @property
    def shape(self):
        return tuple(self.inputs[0].shape)


def fused_forward(compiled, call, config=DEFAULT_RECURRENT, launch=None, plan_key=None):
    """Launch the recurrent forward (training, or inference without `save`); (outputs, finals, buffers). `launch`
    wraps the kernel (`wrap_triton` inside the custom op); None launches it directly. `plan_key`: a key that fixes
    every argument but the tensors (a `KnownRecurrentCall`'s), in place of the call's signature."""
    layout = compiled.layout.layout
    shape, first = call.shape, call.inputs[0]
    n_steps, batch, hidden = shape
    fresh = allocate.forward_results(layout, shape, first.dtype, first.device, [v.dtype for v in call.states],
                                     False, call.save)
    outputs, finals, buffers = fresh
    weights, given = (call.weight, call.bias), ()
    if call.line is not None:
        weights += call.line.forward_values(shape, compute_dtype(first.dtype), first.device)
    elif compiled.layout.reads_previous:  # a 0-d stand-in where the call has no previous output
        weights += (cached_zero(first.dtype, first.device) if call.previous is None else call.previous,)
        given = (int(call.previous is not None),)
    groups = (call.inputs, call.states, call.learnable, outputs, finals, buffers, call.hyper, weights)
    flags = dict(F64=first.dtype == torch.float64, HALF_IO=first.dtype in HALF_DTYPES)
    _launch_kernel(compiled, "forward" if call.save else "inference", groups, first, config, call.line, launch, flags,
                   fresh=(3, 4, 5), plan_key=plan_key, trailing=given)
    return outputs, finals, buffers


class RecurrentBackwardCall(NamedTuple):
    saved: List
    fed_back: torch.Tensor  # the output fed back, [T, B, H]
    grad_outputs: List
    grad_states: List
    learnable: List
    hyper: List[float]
    weight: torch.Tensor
    grad_init: bool
    line: Optional[Union[DelayLine, TapLine]] = None

    @property
    def shape(self):
        return tuple(self.grad_outputs[0].shape)


def fused_backward(compiled, call, config=DEFAULT_RECURRENT, launch=None, plan_key=None):
    """Launch the recurrent backward; (input gradients, initial states' gradients or None, learnable parameters'
    gradients). The gradient of the input the product is added to is also the recurrent current's. `plan_key` as
    in `fused_forward`."""
    recurrent = compiled.layout
    layout, shape, like = recurrent.layout, call.shape, call.grad_outputs[0]
    n_steps, batch, hidden = shape
    fresh = allocate.backward_results(layout, shape, like.dtype, like.device, [g.dtype for g in call.grad_states],
                                      len(call.learnable), call.grad_init)
    grad_inputs, grad_prev, partials = fresh
    slots = grad_prev if grad_prev is not None else [grad_inputs[0]] * len(call.grad_states)  # unused without GRAD_INIT
    weights = (call.weight,)
    if call.line is not None:  # with the rows where the fed-back output's gradient collects from the later steps
        weights += call.line.backward_values(shape, compute_dtype(like.dtype), like.device)
    groups = (call.saved, call.grad_outputs, call.grad_states, call.learnable, grad_inputs, slots, partials,
              call.hyper, weights)
    flags = dict(GRAD_INIT=call.grad_init, F64=like.dtype == torch.float64)
    _launch_kernel(compiled, "backward", groups, like, config, call.line, launch, flags, fresh=(4, 5, 6),
                   plan_key=plan_key)
    grad_learnable = learnable_gradients(layout, partials, call.learnable, shape[1:])
    return grad_inputs, grad_prev, grad_learnable


def _launch_kernel(compiled, kind, groups, like, config, line, launch, flags, fresh, plan_key=None, trailing=()):
    """Launch the kernel of `kind` on a call's argument `groups`, `like` its [T, B, H] I/O; `flags` its constexprs
    besides the tiling's; `fresh` the groups the call allocated (their tensors follow from the others); `trailing`
    the numbers after the sizes (the forward's `rec_previous_given`: a plan key fixes it too). An eager call launches
    through the `RecurrentLaunch` kept for its signature (or `plan_key`), made by its first call; inside a custom op
    (`launch`: wrap_triton) every argument is worked out again, and parameters are passed flattened, for Inductor."""
    if launch is None:
        if plan_key is not None:
            key = (kind, plan_key)
        else:
            key = _signature(kind, [group for i, group in enumerate(groups) if i not in fresh], like, config, flags,
                             trailing)
        plan = compiled.argument_plans.get(key)
        if plan is not None:
            plan(groups, like.device)
            return
    n_steps, batch, hidden = like.shape
    tiling = call_tiling(config, batch, hidden, like.dtype, like.device, plain=line is None)
    constexprs = dict(**flags, DOT_PRECISION=dot_precision(like.dtype), **config.constexprs(tiling),
                      **(line.constexprs(tiling) if line is not None else {}))
    options = dict(num_warps=config.warps(tiling), num_stages=tiling.stages)
    if launch is not None:
        args = kernel_args(compiled.arguments[kind], groups, like.shape[1:], dtype=like.dtype, device=like.device)
        sync = tiling.sync(batch, like.device)
        with on_device_of(like.device):
            kernel = launch(compiled.kernel(kind))
            kernel[tiling.grid(batch)](*args, sync, n_steps, batch, hidden, *trailing, **constexprs, **options)
        return
    args = kernel_args(compiled.arguments[kind], groups, like.shape[1:], flatten_params=False, dtype=like.dtype,
                       device=like.device)
    if not args.reusable:  # an argument is a copy made for this call: no plan
        compiled.launches(kind)(tiling.grid(batch), [*args, tiling.kept_sync(batch, like.device), n_steps, batch,
                                                     hidden, *trailing], constexprs, **options)
        return
    tensors = [position for position, _, _ in args.slots] + [len(args)]  # and the counters after the arguments
    kernel = KernelCall(compiled.kernel(kind), tiling.grid(batch), constexprs, tensors, like.device, **options)
    plan = RecurrentLaunch(args.template(), args.slots, kernel, tiling, tuple(like.shape), tuple(trailing))
    if len(compiled.argument_plans) >= MAX_PLANS:  # shapes that keep changing: start over rather than grow
        compiled.argument_plans.clear()
    compiled.argument_plans[key] = plan
    plan(groups, like.device)


def _signature(kind, groups, like, config, flags, trailing=()):
    """What fixes an eager launch besides its tensors: the given tensors' shapes, strides, dtypes and devices (the
    allocated ones follow from them), the numbers, the flags, the configuration, the product's precision and the
    SMs the programs may use."""
    tensors = [(v.shape, v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else v
               for group in groups for v in group]
    return (kind, like.dtype, config, dot_precision(like.dtype), resident_programs(like.device),
            *flags.values(), trailing, *tensors)


class RecurrentLaunch(NamedTuple):
    """The eager launches of one signature (`_signature`): the kernel's arguments with the tensors left out
    (`abi.KernelArgs.template`), and the kernel with every other argument fixed (`KernelCall`); a call puts its
    tensors in and the counters (`Tiling.kept_sync`) after them."""

    template: list
    slots: list
    kernel: KernelCall
    tiling: Tiling
    shape: tuple
    trailing: tuple = ()

    def __call__(self, groups, device):
        n_steps, batch, hidden = self.shape
        args = fill(self.template, self.slots, groups)
        args += [self.tiling.kept_sync(batch, device), n_steps, batch, hidden, *self.trailing]
        self.kernel(args)


class FusedRun(NamedTuple):
    """The non-tensor arguments of a fused recurrent call, and how many tensors of each group it has."""

    compiled: object
    hyper: List[float]
    n_inputs: int
    n_states: int
    n_learnable: int
    config: RecurrentConfig
    max_delay: Optional[int] = None  # a delayed layer's: its delays follow the bias
    plan_key: Optional[tuple] = None  # a `KnownRecurrentCall`'s: fixes the launches' arguments but the tensors

    def split(self, tensors):
        """(inputs, states, learnable, weight, bias, delays or None) of a call's flat tensors."""
        a, b = self.n_inputs, self.n_inputs + self.n_states
        c = b + self.n_learnable
        delay = tensors[c + 2] if self.max_delay is not None else None
        return list(tensors[:a]), list(tensors[a:b]), list(tensors[b:c]), tensors[c], tensors[c + 1], delay


class FusedRecurrentFunction(torch.autograd.Function):
    """Autograd around the fused kernels: inputs, states, learnable parameters, weight and bias (and a delayed layer's
    delays) in; the outputs and the final states out."""

    @staticmethod
    def forward(ctx, run, *tensors):
        inputs, states, learnable, weight, bias, delay = run.split(tensors)
        weight, bias = read_parameters(ctx, weight, bias, inputs[0].dtype)
        line = line_of(delay, run.max_delay, weight)
        call = RecurrentCall(inputs, states, learnable, run.hyper, weight, bias, save=True, line=line)
        outputs, finals, buffers = fused_forward(run.compiled, call, run.config, plan_key=run.plan_key)
        ctx.save_for_backward(*_saved_values(run.compiled.layout, inputs, states, outputs, buffers),
                              outputs[run.compiled.layout.output_index], *learnable, weight)
        ctx.run, ctx.state_dtypes, ctx.line = run, [v.dtype for v in states], line
        ctx.set_materialize_grads(False)  # unused outputs (often the final states) are read as a stride-0 zero
        return (*outputs, *finals)

    @staticmethod
    @differentiable_once
    def backward(ctx, *grads):
        run = ctx.run
        saved, fed_back, learnable, weight = _unpacked(run, saved_tensors(ctx))
        wanted = _wanted(run, ctx.needs_input_grad)
        weight_dtype, bias_dtype = ctx.parameter_dtypes
        result = list(_gradients(run, ctx.line, saved, fed_back, learnable, weight, grads, ctx.state_dtypes, wanted,
                                 bias_dtype=bias_dtype, weight_dtype=weight_dtype))
        at_weight = run.n_inputs + run.n_states + run.n_learnable
        if result[at_weight] is not None:
            result[at_weight] = result[at_weight].to(weight_dtype)
        return (None, *result)


def read_parameters(ctx, weight, bias, dtype):
    """The weight in the I/O `dtype`, as the kernels' products read it, and the bias as it is (the kernels read it
    in their compute dtype). Cast here rather than by autograd, whose nodes for the cast would run in every
    backward besides the cast kernel; the backward gives the gradients in the parameters' dtypes
    (`ctx.parameter_dtypes`)."""
    ctx.parameter_dtypes = (weight.dtype, bias.dtype)
    return weight.to(dtype), bias


class TransformableRecurrentFunction(torch.autograd.Function):
    """`FusedRecurrentFunction` in the setup_context style, used while torch.func transforms run: its forward and
    backward (`RecurrentBackward`) get the plain tensors the kernels need. The forward returns the saved buffers
    too (not differentiable): a transform saves only inputs and outputs."""

    @staticmethod
    def forward(run, *tensors):
        inputs, states, learnable, weight, bias, delay = run.split(tensors)
        line = line_of(delay, run.max_delay, weight)
        call = RecurrentCall(inputs, states, learnable, run.hyper, weight, bias, save=True, line=line)
        outputs, finals, buffers = fused_forward(run.compiled, call, run.config)
        return (*outputs, *finals, *buffers)

    @staticmethod
    def setup_context(ctx, inputs, output):
        run = inputs[0]
        xs, states, learnable, weight, _, delay = run.split(inputs[1:])
        layout = run.compiled.layout
        n_out, n_visible = len(layout.layout.outputs), len(layout.layout.outputs) + run.n_states
        outputs, buffers = output[:n_out], output[n_visible:]
        ctx.save_for_backward(*_saved_values(layout, xs, states, outputs, buffers), outputs[layout.output_index],
                              *learnable, weight, *([] if delay is None else [delay]))
        ctx.mark_non_differentiable(*buffers)
        ctx.run, ctx.state_dtypes = run, [v.dtype for v in states]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        run = ctx.run
        tensors = saved_tensors(ctx)
        delay = tensors[-1] if run.max_delay is not None else None
        saved, fed_back, learnable, weight = _unpacked(run, tensors[:-1] if delay is not None else tensors)
        visible = list(grads[:len(run.compiled.layout.layout.outputs) + run.n_states])
        counts = (len(saved), len(learnable), len(visible))
        wanted = _wanted(run, ctx.needs_input_grad)
        config = (run, counts, [g is not None for g in visible], ctx.state_dtypes, wanted)
        present = [g for g in visible if g is not None]
        result = RecurrentBackward.apply(config, *saved, fed_back, *learnable, weight,
                                         *([] if delay is None else [delay]), *present)
        return (None, *[None if not want else g for g, want in zip(result, _argument_wants(run, wanted))])


class RecurrentBackward(BackwardFunction):
    """The fused backward as a function of its tensors, under torch.func transforms only: its forward gets them
    unwrapped. Every gradient is computed (a transform's outputs are tensors); differentiable once."""

    @staticmethod
    def forward(config, *tensors):
        run, (n_saved, n_learnable, n_visible), present, state_dtypes, wanted = config
        saved, fed_back = list(tensors[:n_saved]), tensors[n_saved]
        rest = tensors[n_saved + 1:]
        learnable, weight = list(rest[:n_learnable]), rest[n_learnable]
        rest = rest[n_learnable + 1:]
        delay = None
        if run.max_delay is not None:
            delay, rest = rest[0], rest[1:]
        line = line_of(delay, run.max_delay, weight)
        given = iter(rest)
        grads = [next(given) if here else None for here in present]
        everything = _Wanted(True, True, True, True)
        result = _gradients(run, line, saved, fed_back, learnable, weight, grads, state_dtypes, everything)
        return tuple(g if g is not None else fed_back.new_zeros(()) for g in result)


class _Wanted(NamedTuple):
    """Which gradients a backward computes: the initial states', the weight's, the bias's, the delays'."""

    states: bool
    weight: bool
    bias: bool
    delay: bool


def _wanted(run, needs_input_grad):
    first_state, first_weight = 1 + run.n_inputs, 1 + run.n_inputs + run.n_states + run.n_learnable
    delay = run.max_delay is not None and needs_input_grad[first_weight + 2]
    return _Wanted(any(needs_input_grad[first_state:first_state + run.n_states]), needs_input_grad[first_weight],
                   needs_input_grad[first_weight + 1], delay)


def _argument_wants(run, wanted):
    """Per argument after `run` of the fused function, whether its gradient is returned (the others are None)."""
    counts = [(run.n_inputs, True), (run.n_states, wanted.states), (run.n_learnable, True), (1, wanted.weight),
              (1, wanted.bias)] + ([(1, wanted.delay)] if run.max_delay is not None else [])
    return [want for n, want in counts for _ in range(n)]


def _unpacked(run, tensors):
    """(saved values, fed-back output, learnable values, weight) of what a fused forward saved."""
    n_saved = len(run.compiled.layout.layout.saved)
    return list(tensors[:n_saved]), tensors[n_saved], list(tensors[n_saved + 1:-1]), tensors[-1]


def _gradients(run, line, saved, fed_back, learnable, weight, grads, state_dtypes, wanted, backward=None,
               bias_dtype=None, weight_dtype=None):
    """The fused backward: gradients of the inputs, the initial states (None unless wanted), the learnable values,
    the weight, the bias (and a delayed layer's delays), each None where not wanted. `backward` runs the kernel on
    a `RecurrentBackwardCall` (the custom op under torch.compile); by default a direct launch. `bias_dtype`: the
    bias gradient's, if not the I/O dtype; `weight_dtype` the weight gradient's, where the product can give it."""
    layout = run.compiled.layout.layout
    n_out = len(layout.outputs)
    zero = cached_zero(fed_back.dtype, fed_back.device)
    grad_outputs = [g if g is not None else zero.expand(fed_back.shape) for g in grads[:n_out]]
    grad_states = [g if g is not None else cached_zero(dt, fed_back.device)
                   for g, dt in zip(grads[n_out:n_out + run.n_states], state_dtypes)]
    call = RecurrentBackwardCall(saved, fed_back, grad_outputs, grad_states, learnable, run.hyper, weight,
                                 wanted.states, line)
    if backward is None:
        plan_key = None
        if run.plan_key is not None:  # the forward's key fixes all but the incoming gradients' layouts
            plan_key = (run.plan_key, wanted.states, *gradient_layouts(grads))
        grad_inputs, grad_prev, grad_learnable = fused_backward(run.compiled, call, run.config, plan_key=plan_key)
    else:
        grad_inputs, grad_prev, grad_learnable = backward(call)
    grad_current = grad_inputs[run.compiled.layout.input_index]
    grad_delay = ()
    if line is None:
        grad_weight = weight_gradient(grad_current, fed_back, weight_dtype) if wanted.weight else None
    else:
        grad_weight, delay = line.gradients(grad_current, fed_back, weight, wanted.weight, wanted.delay)
        grad_delay = (delay,) if run.max_delay is not None else ()  # a SynapseLine's delays are in the weight
    grad_bias = summed_over_steps_and_rows(grad_current, bias_dtype) if wanted.bias else None
    return (*grad_inputs, *(grad_prev or [None] * run.n_states), *grad_learnable, grad_weight, grad_bias, *grad_delay)


def _saved_values(layout, inputs, states, outputs, buffers):
    """The tensors the backward kernel reads, in the layout's order."""
    return pick_saved(layout.layout.saved, {Kind.INPUT: inputs, Kind.STATE: states, Kind.OUTPUT: outputs}, buffers)


def run_fused(compiled, inputs, states, learnable, hyper, weight, bias, save, config=DEFAULT_RECURRENT, delay=None,
              max_delay=None, plan_key=None, previous=None):
    """(outputs, final states) of the fused kernels; with `save`, differentiable through `FusedRecurrentFunction`.
    `weight` and `bias` (None: none) in any dtype, read in the inputs'; a delayed layer passes its delays ([H]) and
    `max_delay`. `plan_key`: the layer's call key (see `KnownRecurrentCall`), which the launches keep their
    arguments under, in place of the call's signature. `previous`: a call without `save` may give the output before
    its first step, [B, H] (see `RecurrentCall`)."""
    first = inputs[0]
    bias = bias if bias is not None else cached_zero(first.dtype, first.device)
    if not save or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        weight = weight.to(first.dtype)  # (FusedRecurrentFunction casts its own; the kernels read the bias as it is)
    if not save:
        line = line_of(delay, max_delay, weight)
        call = RecurrentCall(inputs, states, learnable, hyper, weight, bias, save=False, line=line, previous=previous)
        outputs, finals, _ = fused_forward(compiled, call, config, plan_key=plan_key)
        return outputs, finals
    if torch.compiler.is_compiling():
        result = compiled.ops.forward(inputs, states, learnable, hyper, weight, bias, delay,
                                      0 if delay is None else int(max_delay), save, config_values(config))
        n_out = len(compiled.layout.layout.outputs)
        return result[:n_out], result[n_out:n_out + len(states)]
    run = FusedRun(compiled, hyper, len(inputs), len(states), len(learnable), config,
                   None if delay is None else int(max_delay), plan_key)
    tensors = (*inputs, *states, *learnable, weight, bias, *(() if delay is None else (delay,)))
    if torch._C._are_functorch_transforms_active():
        result = TransformableRecurrentFunction.apply(run, *tensors)[:len(compiled.layout.layout.outputs) + len(states)]
    else:
        result = FusedRecurrentFunction.apply(run, *tensors)
    n_out = len(compiled.layout.layout.outputs)
    return list(result[:n_out]), list(result[n_out:])
