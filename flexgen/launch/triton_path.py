"""Launching the generated Triton kernels: through Triton's `JITFunction.run`, or straight to the compiled
kernel's launcher once a plan has fixed every argument but the tensors."""
import contextlib
import functools

import torch

from ..render.layout import backward_arguments, forward_arguments
from . import allocate, compat
from .abi import kernel_args, learnable_gradients
from .config import DEFAULT, HALF_DTYPES, grid


def forward_constexprs(layout, dtype, state_seqs, config=DEFAULT):
    return {"STATE_SEQS": state_seqs, "F64": dtype == torch.float64, "HALF_IO": dtype in HALF_DTYPES,
            "BLOCK": config.forward_block(layout)}


def backward_constexprs(layout, dtype, state_seqs, grad_init, config=DEFAULT):
    return {"STATE_SEQS": state_seqs, "GRAD_INIT": grad_init, "F64": dtype == torch.float64,
            "BLOCK": config.backward_block(layout)}


def forward_groups(call, fresh):
    """The call's values by `layout.Forward` group; fresh: the (outputs, finals, buffers) the kernel writes."""
    outputs, finals, buffers = fresh
    return (call.inputs, call.states, call.learnable, outputs, finals, buffers, call.hyper)


def backward_groups(call, fresh):
    """The call's values by `layout.Backward` group; fresh: (grad_inputs, grad_prev, partials). Without
    `grad_init` the kernel stores nothing for the initial states: the first input gradient fills those slots."""
    grad_inputs, grad_prev, partials = fresh
    if grad_prev is None:
        grad_prev = [grad_inputs[0]] * len(call.grad_states)
    return (call.saved, call.grad_outputs, call.grad_states, call.learnable, grad_inputs, grad_prev, partials,
            call.hyper)


def triton_forward(kernels, call, config=DEFAULT):
    """Launch the forward (or inference) kernel; outputs, final states (or their sequences) and buffers."""
    layout, shape, first = kernels.layout, call.shape, call.inputs[0]
    fresh = allocate.forward_results(layout, shape, first.dtype, first.device, [v.dtype for v in call.states],
                                     call.state_seqs, call.save)
    args = kernel_args(forward_arguments(layout, call.save), forward_groups(call, fresh), shape[1:],
                       dtype=first.dtype, device=first.device)
    kernel = kernels.triton("forward" if call.save else "inference")
    constexprs = forward_constexprs(layout, first.dtype, call.state_seqs, config)
    kernel[grid(call.n_elem, constexprs["BLOCK"])](
        *args, shape[0], call.n_elem, **constexprs, num_warps=config.num_warps,
    )
    outputs, finals, buffers = fresh
    return outputs + finals + buffers


def triton_backward(kernels, call, config=DEFAULT):
    """Launch the backward kernel; gradients of the inputs, the initial states (None unless `grad_init`)
    and the learnable parameters."""
    layout, shape, like = kernels.layout, call.shape, call.grad_outputs[0]
    state_dtypes = [g.dtype for g in call.grad_states]
    fresh = allocate.backward_results(layout, shape, like.dtype, like.device, state_dtypes, len(call.learnable),
                                      call.grad_init)
    args = kernel_args(backward_arguments(layout), backward_groups(call, fresh), shape[1:], call.state_seqs,
                       dtype=like.dtype, device=like.device)
    constexprs = backward_constexprs(layout, like.dtype, call.state_seqs, call.grad_init, config)
    kernels.triton("backward")[grid(call.n_elem, constexprs["BLOCK"])](
        *args, shape[0], call.n_elem, **constexprs, num_warps=config.num_warps,
    )
    grad_inputs, grad_prev, partials = fresh
    grad_learnable = learnable_gradients(layout, partials, call.learnable, shape[1:], held_grad=call.grad_init)
    return grad_inputs + (grad_prev or [None] * len(call.grad_states)) + grad_learnable


def cuda_index(device):
    """The index of CUDA `device` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def sm_count(index):
    """The multiprocessors of CUDA device `index`."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def on_device_of(device):
    """Triton launches on the current CUDA device; make that the tensors' device, as torch ops do."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def current_stream(index):
    """The handle of CUDA device `index`'s current stream (what Triton launches on)."""
    return _driver().get_current_stream(index)


@functools.lru_cache(maxsize=None)
def _driver():
    import triton  # (imported here: the CPU paths never need it)

    return triton.runtime.driver.active


class KernelCall:
    """One generated kernel launched with fixed non-tensor arguments (an `EagerPlan`'s).

    Triton's `JITFunction.run` works out the compiled specialisation from every
    argument on every call, about 11 µs of host time per launch on an H200
    machine. Here every argument but the tensors is fixed, so what is left to
    key the specialisation on is whether each pointer is 16-byte aligned (what
    Triton specialises pointers on). The first call of each key goes through
    Triton's path, which compiles or finds the kernel and returns it; later
    calls hand the arguments straight to its launcher. Launches run on the
    plan's device, made current for the call when another one is.
    """

    def __init__(self, kernel, grid, constexprs, tensor_positions, device, num_warps=DEFAULT.num_warps, **options):
        self.kernel, self.grid, self.constexprs = kernel, tuple(grid), constexprs
        self.grid_3d = self.grid + (1,) * (3 - len(self.grid))
        self.constexpr_values = list(constexprs.values())
        self.num_warps, self.options = num_warps, options
        self.tensor_positions = tensor_positions
        self.device = device
        self.cuda_index = device.index if device.type == "cuda" else None
        self.direct = compat.direct_launch() and device.type == "cuda" and self._constexprs_come_last()
        self.compiled = {}

    def _constexprs_come_last(self):
        """Whether the constexprs are the kernel's last parameters (the launcher takes them after the others), put
        in the kernel's order."""
        names = getattr(self.kernel, "arg_names", None)
        trailing = None if names is None else list(names[len(names) - len(self.constexprs):])
        if trailing is None or sorted(trailing) != sorted(self.constexprs):
            return False
        self.constexpr_values = [self.constexprs[name] for name in trailing]
        return True

    def __call__(self, args):
        if not self.direct or compat.launch_hooks_set():
            with on_device_of(self.device):
                self.kernel[self.grid](*args, **self.constexprs, num_warps=self.num_warps, **self.options)
            return
        driver = _driver()
        device = driver.get_current_device()
        if device != self.cuda_index:
            with torch.cuda.device(self.cuda_index):
                return self(args)
        key = tuple(args[i].data_ptr() & 15 for i in self.tensor_positions)
        launcher = self.compiled.get(key)
        if launcher is None:
            compiled = self.kernel[self.grid](*args, **self.constexprs, num_warps=self.num_warps, **self.options)
            if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                self.compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, metadata = launcher
        run(*self.grid_3d, driver.get_current_stream(device), function, metadata, None, None, None,
            *args, *self.constexpr_values)


def accumulator(*dtypes):
    """The Triton dtype a hand-written kernel sums in for operands of `dtypes`: float64 where one is, else
    float32 (16-bit operands too)."""
    import triton.language as tl

    return tl.float64 if torch.float64 in dtypes else tl.float32


class SpecialisedLaunches:
    """A kernel's launches through its compiled launcher, one per specialisation key, for calls whose non-tensor
    arguments change (the recurrent kernels: no plan fixes them). The key holds what Triton specialises a compiled
    kernel on, and more: each integer's value (Triton keys on 1 and on multiples of 16), each tensor's dtype and
    16-byte alignment, the type of every other argument, the constexprs, the launch options and the device. A
    key's first call goes through Triton's path, which compiles or finds the kernel and hands back its launcher;
    later ones skip `JITFunction.run` (about 0.1 ms of host time per launch in a probe on an H100). At most
    `MAX_KEYS` launchers are kept: past that they are dropped and found again."""

    MAX_KEYS = 64

    def __init__(self, kernel):
        self.kernel = kernel
        self.launchers = {}
        self.orders = {}  # the constexprs' names as given -> in the kernel's order (None: Triton's own path)

    def __call__(self, grid, args, constexprs, **options):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        names = self._trailing(tuple(constexprs))
        if names is None or device is None or device.type != "cuda" or compat.launch_hooks_set():
            with on_device_of(device) if device is not None else contextlib.nullcontext():
                self.kernel[grid](*args, **constexprs, **options)
            return
        values = [constexprs[name] for name in names]
        key = (tuple(_specialisation(a) for a in args), tuple(values), tuple(sorted(options.items())), device.index)
        launcher = self.launchers.get(key)
        with on_device_of(device):
            if launcher is None:
                compiled = self.kernel[grid](*args, **constexprs, **options)
                if all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
                    if len(self.launchers) >= self.MAX_KEYS:
                        self.launchers.clear()
                    self.launchers[key] = (compiled.run, compiled.function, compiled.packed_metadata)
                return
            run, function, metadata = launcher
            grid = tuple(grid) + (1,) * (3 - len(grid))
            run(*grid, _driver().get_current_stream(device.index), function, metadata, None, None, None, *args,
                *values)

    def _trailing(self, given):
        """The constexprs in the kernel's order where they are its last parameters and the compiled launcher can
        take them (Triton >= 3.3), else None (Triton's own path)."""
        if given not in self.orders:
            names = getattr(self.kernel, "arg_names", None)
            trailing = None if names is None else list(names[len(names) - len(given):])
            usable = compat.direct_launch() and trailing is not None and sorted(trailing) == sorted(given)
            self.orders[given] = trailing if usable else None
        return self.orders[given]


def launch_specialised(launches, grid, args, constexprs, wrap=None, **options):
    """Launch `launches.kernel` (a `SpecialisedLaunches`) eagerly, or inside a custom op through `wrap` (torch's
    `wrap_triton`), which torch.compile traces into its graph."""
    if wrap is None:
        launches(grid, args, constexprs, **options)
    else:
        wrap(launches.kernel)[grid](*args, **constexprs, **options)


def _specialisation(arg):
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, (bool, int)):
        return (type(arg), arg)
    return type(arg)
