"""Stage 7, module: the `torch.nn.Module` a user puts in a network, and the functional `run`.

Takes a spec and its `CompiledNeuron`; checks a call's tensors and hands them to the launch stage's ops.
"""
import functools
import os
import warnings
from typing import Any, NamedTuple

import torch

from ..launch.eager import run_eager
from .held_line import checked_line, full_line, held_after
from ..frontend.hyper import hyper_value
from ..launch import broadcasts_per_neuron, cached_scalar, tracing_or_transforming
from ..launch import c_path, config as launch_config

BACKENDS = ("auto", "triton", "torch", "c", "eager")


def triton_interpreter_on():
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _use_triton(backend, device):
    if backend == "c" and device.type != "cpu":
        raise RuntimeError(f"backend='c' runs the generated C kernels on CPU tensors (got {device.type}); "
                           "use backend='auto' or 'triton' on the GPU")
    if backend in ("torch", "c"):
        return False
    if device.type == "cuda":
        return True
    if backend == "triton":
        if not triton_interpreter_on():
            instead = ("backend='c' (the generated C kernels)" if device.type == "cpu" and c_path.available()
                       else "backend='torch' (the generated torch code)")
            raise RuntimeError(
                f"backend='triton' needs CUDA tensors (got {device.type}); on the CPU set TRITON_INTERPRET=1 "
                f"to run the kernels in Triton's interpreter, or use {instead}"
            )
        return True
    return False


def check_inputs(spec, inputs, multi_step=True):
    """Clear errors (not kernel crashes) for per-step inputs the kernels cannot take."""
    sig = spec.signature
    if len(inputs) != len(sig.inputs):
        raise TypeError(f"{spec.fn.__name__} takes {len(sig.inputs)} input(s) {sig.inputs}, got {len(inputs)}")
    first = inputs[0]
    for name, x in zip(sig.inputs, inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(
                f"input {name!r} has dtype {x.dtype}; neurons take floating-point tensors "
                "(convert with x.float(), or x.to(dtype))"
            )
        if x is not first and (x.shape != first.shape or x.dtype != first.dtype or x.device != first.device):
            raise ValueError(
                f"all inputs must share shape, dtype and device: {sig.inputs[0]!r} is "
                f"{tuple(first.shape)} {first.dtype} {first.device}, {name!r} is {tuple(x.shape)} {x.dtype} {x.device}"
            )
    if multi_step and first.dim() < 1:
        raise ValueError(
            f"multi-step input {sig.inputs[0]!r} needs a leading time dimension [T, ...], got a scalar; "
            "use step_mode='s' for one step at a time, or x.unsqueeze(0) for T = 1"
        )


def _any_autocast_enabled():
    """One cheap check before the per-device ones (torch < 2.4 lacks it: assume enabled)."""
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    return True if check is None else check()


def autocast_inputs(inputs):
    """Under `torch.autocast` for the inputs' device, floating inputs in the autocast dtype.

    Kernels compute in fp32 whatever their I/O dtype, so a layer under autocast
    reads and writes the low-precision dtype like the layers around it.
    fp64 inputs are left alone (autocast does not lower them either).

    >>> import torch
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_inputs([torch.zeros(2)])[0].dtype
    torch.bfloat16
    """
    if not _any_autocast_enabled():
        return list(inputs)
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor) or not first.is_floating_point() or first.dtype == torch.float64:
        return list(inputs)
    device_type = first.device.type
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu") or not torch.is_autocast_enabled(device_type):
        return list(inputs)
    dtype = torch.get_autocast_dtype(device_type)
    return [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 else x
            for x in inputs]


def initial_states(spec, hyper, static, like):
    """Each state's declared initial value as a 0-d tensor (the kernels read it with stride 0)."""
    result = []
    for s in spec.signature.states:
        value = spec.signature.init[s]
        if isinstance(value, str):
            value = hyper[value] if value in hyper else static[value]
        result.append(cached_scalar(float(value), like.dtype, like.device))
    return result


class Resolved(NamedTuple):
    """A layer's (or a `run`'s) parameters sorted by role: static options, the signature they give,
    hyper-parameters (name -> float) and learnable values (name -> tensor or number, the default if not given)."""

    static: dict
    signature: Any
    hyper: dict
    learnable: dict


def resolve_parameters(spec, params, static=None):
    """`params` (hyper-parameters, learnable values and static options by name) sorted by role."""
    params = dict(params)
    static = dict(static or {})
    for k in list(params):
        if k in spec.signature.static:
            static[k] = params.pop(k)
    static = spec.static_values(static)
    sig = spec.signature_for(static)
    unknown = set(params) - set(sig.hyper) - set(sig.learnable)
    if unknown:
        raise TypeError(f"{spec.fn.__name__}: unknown parameter(s) {sorted(unknown)}; "
                        f"hyper-parameters are {sig.hyper}, learnable {sig.learnable}")
    hyper = {h: hyper_value(h, params[h], owner=spec.__name__) if h in params else sig.defaults[h] for h in sig.hyper}
    learnable = {w: params.get(w, sig.defaults[w]) for w in sig.learnable}
    return Resolved(static, sig, hyper, learnable)


def run(spec, inputs, states, params, backend="auto", store_state_seqs=False, static=None, compiled=None,
        recompute="auto"):
    """Run the neuron over [T, ...] inputs; returns (outputs list, states list).

    `params` holds hyper-parameters, learnable parameters (tensors or numbers)
    and static options by name; `compiled` (the spec's `CompiledNeuron`
    for `static`) skips looking it up again. `recompute`: see `NeuronModule`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _check_recompute(recompute)
    resolved = resolve_parameters(spec, params, static)
    if compiled is None and backend != "eager":
        compiled = spec.compiled(**resolved.static)
    neuron = NeuronCall(spec, resolved.signature, resolved.static, resolved.hyper, compiled, backend, store_state_seqs,
                        recompute)
    return neuron(neuron.check(inputs, states, list(resolved.learnable.values())))


def _check_recompute(recompute):
    if not (isinstance(recompute, bool) or (isinstance(recompute, str) and recompute == "auto")):
        raise TypeError(f"recompute must be True, False or 'auto', got {recompute!r}")


class NeuronCall(NamedTuple):
    """Everything a call of a neuron needs besides its tensors. `signature`: `spec.signature_for(static)`;
    `hyper`: name -> float in its order."""

    spec: Any
    signature: Any
    static: dict
    hyper: dict
    compiled: Any
    backend: str
    store_state_seqs: bool
    recompute: Any

    def check(self, inputs, states, learnable):
        """A call's tensors as the kernels take them: inputs checked (and in the autocast dtype), learnable
        parameters checked, states checked or, when None, the declared initial values."""
        check_inputs(self.spec, inputs)
        inputs = autocast_inputs(inputs)
        first = inputs[0]
        learnable = [_check_learnable(w, value, first) for w, value in zip(self.signature.learnable, learnable)]
        if states is None:
            states = initial_states(self.spec, self.hyper, self.static, first)
        else:
            states = _check_states(self.spec, states, first)
        return inputs, states, learnable

    def ops(self, checked):
        """The ops a checked call runs through (plain or recompute, generated torch code or C on the CPU),
        whether it saves for a backward, and whether it runs Triton kernels."""
        first = checked[0][0]
        save = torch.is_grad_enabled() and _any_requires_grad(checked)
        use_triton = _use_triton(self.backend, first.device)
        if self.backend in ("c", "auto") and not use_triton and self._c_runs(first):
            return self.compiled.c_ops_for(self.recompute), save, False
        return self.compiled.ops_for_call(self.recompute, use_triton, first), save, use_triton

    def _c_runs(self, first):
        """Whether a CPU call runs the C kernels, else the torch path. The C target has both designs in fp32 and
        fp64, and runs fp16 and bf16 calls through its fp32 kernels (recompute="auto" runs the plain one: see
        `CompiledNeuron.c_ops_for`), outside torch.compile and torch.func; backend="c" says once why a call runs
        the torch path instead, "auto" only that there is no C compiler."""
        reason = None
        if not c_path.takes(first.dtype):
            reason = f"the C kernels take float32, float64, float16 and bfloat16 (got {first.dtype})"
        elif torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            reason = "torch.compile and torch.func trace the torch path, not the C kernels"
        else:
            try:
                self.compiled.c_library
                return True
            except c_path.CompilerError as exc:
                if self.backend == "auto":
                    _say_once(f"flexgen: the CPU layers run generated torch code, not the faster C kernels: {exc}. "
                              "Install a C compiler or set CC (or TMPDIR, where the libraries are built, if that "
                              "directory does not allow programs); backend='torch' chooses the torch code silently")
                    return False
                reason = str(exc)
        if self.backend == "c":
            _say_once(f"flexgen: {self.spec.__name__} with backend='c' runs the torch path: {reason}")
        return False

    def __call__(self, checked):
        """(outputs, final states or their sequences) of a checked call."""
        inputs, states, learnable = checked
        first = inputs[0]
        if self.backend == "eager":
            params = {w: _broadcastable(p, first) for w, p in zip(self.signature.learnable, learnable)}
            states = [v.expand(first.shape[1:]) for v in states]
            return run_eager(self.spec, self.static, inputs, states, params, self.hyper, self.store_state_seqs)
        ops, save, use_triton = self.ops(checked)
        result = ops.call(inputs, states, learnable, list(self.hyper.values()), self.store_state_seqs, save, use_triton)
        n_out, n_states = len(ops.layout.outputs), len(states)
        return list(result[:n_out]), list(result[n_out:n_out + n_states])


@functools.lru_cache(maxsize=None)
def _say_once(message):
    warnings.warn(message, stacklevel=4)


def _any_requires_grad(groups):
    for group in groups:
        for t in group:
            if t.requires_grad:
                return True
    return False


def _check_learnable(name, value, like):
    """A learnable parameter as a floating tensor on the inputs' device: one value, one per channel, or any
    shape that broadcasts against one step of the inputs.

    The channel is dim 2 of the [T, B, C, ...] inputs (dim 1 of a step).
    """
    if not isinstance(value, torch.Tensor):
        return torch.full((), float(value), dtype=like.dtype, device=like.device)  # no host copy: capturable
    if value.device != like.device:
        raise ValueError(
            f"learnable parameter {name!r} is on {value.device}, the inputs on {like.device}; "
            "move the layer with .to(device) (or pass the parameter on the inputs' device)"
        )
    if not value.is_floating_point():
        raise TypeError(f"learnable parameter {name!r} has dtype {value.dtype}; it must be floating-point")
    channels = like.shape[2] if like.dim() > 2 else None
    per_channel = value.dim() == 1 and value.numel() == channels
    if value.numel() != 1 and not per_channel and not _broadcasts_to(value.shape, like.shape[1:]):
        raise ValueError(
            f"learnable parameter {name!r} has shape {tuple(value.shape)}; it must hold one value, one per channel "
            f"(dim 2 of the [T, B, C, ...] inputs, here {channels if channels is not None else 'absent'}) or a shape "
            f"that broadcasts against one step of the inputs (here {tuple(like.shape[1:])})"
        )
    return value


def _broadcasts_to(shape, target):
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def _broadcastable(param, like):
    """A per-channel parameter shaped [C, 1, ...] so it broadcasts against one step [B, C, ...] (eager); other
    shapes broadcast as they are."""
    if param.numel() == 1 or broadcasts_per_neuron(param, like.shape[1:]):
        return param
    return param.reshape([-1] + [1] * (like.dim() - 3))


def _check_states(spec, states, like):
    states = list(states)
    if len(states) != len(spec.signature.states):
        raise TypeError(f"{spec.fn.__name__} has {len(spec.signature.states)} state(s), got {len(states)}")
    step_shape = like.shape[1:]
    result = []
    for name, v in zip(spec.signature.states, states):
        v = torch.as_tensor(v, dtype=like.dtype, device=like.device) if not isinstance(v, torch.Tensor) else v
        if v.device != like.device:
            raise ValueError(f"state {name!r} is on {v.device}, the inputs on {like.device}")
        if not v.is_floating_point():
            raise TypeError(f"state {name!r} has dtype {v.dtype}; states must be floating-point")
        if v.shape != step_shape:
            try:
                v = v.expand(step_shape)
            except RuntimeError:
                raise ValueError(
                    f"state {name!r} has shape {tuple(v.shape)}, one step of the inputs is {tuple(step_shape)} "
                    f"(inputs {tuple(like.shape)} are [T, ...]); is the leading time dimension missing, "
                    "or did the batch shape change without reset()?"
                ) from None
        result.append(v if v.dtype == like.dtype else v.to(like.dtype))
    return result


# What a layer keeps as attributes of its own besides the class's and nn.Module's: a learnable parameter or a
# state of the same name would be hidden by them (or overwrite them).
_LAYER_ATTRIBUTES = frozenset({"spec", "step_mode", "store_state_seqs", "backend", "recompute", "static", "hyper",
                               "delay", "line", "state_seqs"})


def _check_attribute_names(layer, spec):
    """An error for a learnable parameter or state whose name the layer uses for something else."""
    taken = _LAYER_ATTRIBUTES | set(dir(type(layer))) | set(vars(torch.nn.Module()))
    for role, names in (("learnable parameter", spec.signature.learnable), ("state", spec.signature.states)):
        for name in names:
            if name in taken:
                raise TypeError(f"{spec.fn.__name__}: the {role} {name!r} would be hidden by the layer's own "
                                f"attribute {name!r} (layer.{name}); rename it")


def _check_delay(delay, spec):
    """`delay` as a layer option: None or a `flexgen.Delay` on the first input."""
    if delay is None:
        return None
    from .delay import Delay

    if "delay" in spec.signature.parameters:
        raise TypeError(f"{spec.fn.__name__} has a parameter named 'delay', which the layer option delay= (a "
                        "flexgen.Delay on the input) would hide; rename the parameter")
    if not isinstance(delay, Delay):
        raise TypeError(f"delay must be a flexgen.Delay (per-channel delays of the first input), got "
                        f"{type(delay).__name__}; e.g. delay=flexgen.Delay(channels, max_delay=25)")
    return delay


def _check_dtype(dtype):
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (the learnable parameters' dtype), got {dtype!r}")


def _initial_value(value, dtype):
    """A learnable parameter's initial value as a tensor: in `dtype`, else a floating tensor's own dtype, else
    torch's default dtype; a number is taken exactly in that dtype (no float32 round trip)."""
    if dtype is None:
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        dtype = value.dtype if floating else torch.get_default_dtype()
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype)
    return torch.as_tensor(value, dtype=dtype)


def _same(tensors, checked):
    return len(tensors) == len(checked) and all(a is b for a, b in zip(tensors, checked))


def handed_on_unchanged(given, checked):
    """Whether a call's checks handed its (inputs, states, learnable) on as they were (states None: the initial
    ones, made by the checks)."""
    (inputs, states, learnable), (c_inputs, c_states, c_learnable) = given, checked
    return _same(inputs, c_inputs) and _same(learnable, c_learnable) and (states is None or _same(states, c_states))


def tensor_keys(tensors):
    """What a known call's key holds of each tensor (None stays None): its type, shape, strides, dtype, device and
    whether it requires grad. Raises AttributeError for an argument not a tensor."""
    return [None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors]


def capturing_on(device):
    """Whether a CUDA graph is being captured on `device`'s current stream (made for it, not kept: no known calls)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def keep_known_call(known_calls, key, call):
    """Keep `call` under `key`; calls whose keys keep changing start the dict over rather than grow it."""
    if len(known_calls) >= launch_config.MAX_PLANS:
        known_calls.clear()
    known_calls[key] = call


class _KnownCall:
    """A call signature a layer has run through an `EagerPlan`, with the initial states the plan reads
    (None when the call passes its own states)."""

    def __init__(self, plan, initial_states):
        self.plan, self.initial_states, self.n_outputs = plan, initial_states, plan.n_outputs

    def __call__(self, inputs, states, learnable):
        result = self.plan(inputs, self.initial_states if states is None else states, learnable)
        return result[:self.n_outputs], result[self.n_outputs:]


class NeuronModule(torch.nn.Module):
    """A layer of neurons defined by a `NeuronSpec` (see `flexgen.neuron`).

    Multi-step (`step_mode="m"`, inputs [T, ...]) or single-step ("s", one step
    per call). States persist between calls until `reset()`; read them as
    attributes (`layer.v`) and, with `store_state_seqs=True`, their sequences
    from `layer.state_seqs`. Learnable parameters are `nn.Parameter`s (in
    `state_dict()`); states are not, but `.to()`/`.half()` convert them too.
    With `per_channel=C` every learnable parameter holds one value per channel
    (dim 2 of [T, B, C, ...] inputs) and gets its gradient per channel. A
    learnable value given as a tensor may have any other shape that broadcasts
    against one step [B, C, ...] (e.g. one value per neuron, [C, H, W]); its
    gradient is summed to that shape. Learnable parameters are made in `dtype`
    (default: a tensor value's own dtype, else `torch.get_default_dtype()`),
    numbers taken exactly: `dtype=torch.float64` keeps `beta=0.9` as 0.9.
    With `recompute=True` a training forward keeps no per-step values for the
    backward, only the states every few steps; the backward re-runs the forward
    steps from the inputs. Same results, less memory. The default, "auto",
    recomputes on CUDA where that moves fewer bytes than saving the values
    (fp32 LIF and PLIF; not fp16, where the checkpoints' fp32 rows cost what
    they save); False never does (`backend="eager"` ignores it: autograd saves what
    it saves there). `delay=flexgen.Delay(C, max_delay, ...)` reads the first
    input through per-channel delays: in the Triton kernels and the C target
    (linear taps) the delay line lives in the kernels' time loop, which read
    the input `d` steps back; elsewhere the `Delay` layer runs before the neuron. Its
    delays (`layer.delay.delay`) learn like the layer's other parameters. The
    line keeps the last `max_delay` steps of the input between calls
    (`layer.line`), like the states, so calls on consecutive chunks of a
    sequence (one step each with step_mode="s") equal one call on all of it; the
    kernels of a call that continues a line read its steps before the call's
    first from the line. Calls that record no gradient append to it in place
    (`layer.line` is then a view that later calls overwrite: clone it to keep it).

    >>> import torch, flexgen
    >>> @flexgen.neuron(states=("v",))
    ... def if_neuron(x, v, v_th=1.0):
    ...     s = flexgen.spike(v + x - v_th)
    ...     return s, (v + x) * (1.0 - s)
    >>> layer = if_neuron(v_th=0.5, backend="torch")
    >>> layer(torch.tensor([[0.2], [0.4]])).flatten().tolist(), layer.v.tolist()
    ([0.0, 1.0], [0.0])
    """

    def __init__(self, spec, step_mode="m", store_state_seqs=False, backend="auto", per_channel=None, recompute="auto",
                 dtype=None, delay=None, **params):
        super().__init__()
        if step_mode not in ("m", "s"):
            raise ValueError(f"step_mode must be 'm' or 's', got {step_mode!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if per_channel is not None and (isinstance(per_channel, bool) or not isinstance(per_channel, int)
                                        or per_channel < 1):
            raise ValueError(f"per_channel must be a positive number of channels, got {per_channel!r}")
        _check_recompute(recompute)
        _check_attribute_names(self, spec)
        self.spec, self.step_mode, self.store_state_seqs, self.backend = spec, step_mode, store_state_seqs, backend
        self.recompute = recompute
        resolved = resolve_parameters(spec, params)
        self.static, self._signature, self.hyper = resolved.static, resolved.signature, resolved.hyper
        _check_dtype(dtype)
        for w, default in resolved.learnable.items():
            value = _initial_value(default, dtype)
            if per_channel is not None and value.numel() == 1:
                value = value.reshape(()).expand(int(per_channel))
            self.register_parameter(w, torch.nn.Parameter(value.clone()))
        self.delay = _check_delay(delay, spec)
        self._states = {}
        self.line = None  # with delay=: the first input's last max_delay steps, [<= max_delay, B, ...], oldest first
        # (zeros before the sequence began where a LineBuffer holds it)
        self._line_buffer = None  # a held_line.LineBuffer that `line` is a view of, while calls stream in place
        self.state_seqs = {}
        self._known_calls = {}  # call key -> _KnownCall, see _remember
        # Generate (or load) the kernels and register the ops now, not inside a compiled graph.
        self._compiled = None if backend == "eager" else spec.compiled(**self.static)
        self._delayed = {}  # (max_delay, tapped, held) -> the kernels with such a delay line
        if self.delay is not None and backend not in ("eager", "torch"):
            self._delayed_kernels()
            if self.delay.max_delay:  # the calls after the first continue the line
                self._delayed_kernels(held=True)

    def _call_key(self, inputs, states, learnable):
        """What the checks and the plan of a call depend on; None for calls that take the checked path
        every time (compiling, under torch.func or autocast, the eager backend, an argument not a tensor)."""
        if (
            self.backend == "eager"
            or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()
            or _any_autocast_enabled()
        ):
            return None
        try:
            tensors = tensor_keys((*inputs, *(states or ()), *learnable))
        except (AttributeError, RuntimeError, TypeError):
            return None
        options = (torch.is_grad_enabled(), states is None, self.backend, self.recompute, self.store_state_seqs)
        return (*options, *self.hyper.values(), *tensors)

    def _neuron_call(self):
        return NeuronCall(self.spec, self._signature, self.static, self.hyper, self._compiled, self.backend,
                          self.store_state_seqs, self.recompute)

    def _checked_call(self, key, inputs, states, learnable):
        neuron = self._neuron_call()
        checked = neuron.check(inputs, states, learnable)
        result = neuron(checked)
        if key is not None:
            self._remember(neuron, key, (inputs, states, learnable), checked)
        return result

    def _remember(self, neuron, key, given, checked):
        """Keep the plan a call ran through for later calls with its key, which skip the checks (they would
        pass again) and go straight to it: about 10 µs less host time per call, most of a small layer's.
        Only when the checks handed the tensors on unchanged and the plan is the call's every time: nothing
        traces, transforms or captures a CUDA graph (the initial states it keeps would be theirs)."""
        states = given[1]
        c_inputs, c_states, c_learnable = checked
        if not handed_on_unchanged(given, checked):
            return
        if tracing_or_transforming() or capturing_on(c_inputs[0].device):
            return
        ops, save, use_triton = neuron.ops(checked)
        if not use_triton:
            return
        plan = ops.plan(c_inputs, c_states, c_learnable, list(self.hyper.values()), self.store_state_seqs, save)
        if plan is None:
            return
        keep_known_call(self._known_calls, key, _KnownCall(plan, c_states if states is None else None))

    def extra_repr(self):
        items = [f"neuron={self.spec.__name__}"]
        items += [f"{k}={v!r}" for k, v in {**self.hyper, **self.static}.items()]
        items += [f"step_mode={self.step_mode!r}", f"backend={self.backend!r}"]
        if self.store_state_seqs:
            items.append("store_state_seqs=True")
        if self.recompute != "auto":
            items.append(f"recompute={self.recompute!r}")
        return ", ".join(items)

    def _apply(self, fn, recurse=True):
        """`.to()`, `.half()`, `.cuda()`... also convert the current states (they are not buffers)."""
        result = super()._apply(fn, recurse)
        self._states = {k: fn(v) for k, v in self._states.items()}
        self.line = None if self.line is None else fn(self.line)
        self._line_buffer = None
        self.state_seqs = {k: fn(v) for k, v in self.state_seqs.items()}
        return result

    def __getstate__(self):
        """Pickling and `copy.deepcopy` keep the states' values, detached from any autograd graph."""
        state = super().__getstate__()
        state = dict(state)
        state["_states"] = {k: v.detach() for k, v in state.get("_states", {}).items()}
        state["state_seqs"] = {k: v.detach() for k, v in state.get("state_seqs", {}).items()}
        state["line"] = None if state.get("line") is None else state["line"].detach().clone()  # not a buffer's view
        state["_line_buffer"] = None
        state["_compiled"] = None  # loaded kernels and ops stay in this process; looked up again on use
        state["_delayed"] = {}
        state["_known_calls"] = {}
        return state

    def reset(self):
        """Forget the states (and what a delay line holds): the next call starts from the declared initial values."""
        object.__setattr__(self, "_states", {})
        object.__setattr__(self, "state_seqs", {})
        object.__setattr__(self, "line", None)
        object.__setattr__(self, "_line_buffer", None)

    def detach(self):
        """Keep the states' values but cut them from the autograd graph of the calls that made them: the next
        backward stops at this call (truncated backpropagation through time; SpikingJelly's `detach()`)."""
        object.__setattr__(self, "_states", {k: v.detach() for k, v in self._states.items()})
        object.__setattr__(self, "state_seqs", {k: v.detach() for k, v in self.state_seqs.items()})
        object.__setattr__(self, "line", None if self.line is None else self.line.detach())

    def __getattr__(self, name):
        states = self.__dict__.get("_states")
        spec = self.__dict__.get("spec")
        if spec is not None and name in spec.signature.states:
            if name in states:
                return states[name]
            value = spec.signature.init[name]
            return self.hyper.get(value, value) if isinstance(value, str) else value
        return super().__getattr__(name)

    def _delayed_call(self, inputs, states, learnable):
        """A call whose first input goes through `self.delay`, continuing what the line holds from earlier calls
        (`self.line`), which it then updates."""
        first = inputs[0] if inputs else None
        self.delay.check_input(first)
        line = checked_line(self.line, self.delay.max_delay, first)
        result = self._fused_delayed_call(inputs, states, learnable, line)
        records = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (*inputs, *(states or ()), *learnable, *self.delay.parameters(), line))
        held, buffer = held_after(line, first, self.delay.max_delay, self._line_buffer, records)
        object.__setattr__(self, "line", held)
        object.__setattr__(self, "_line_buffer", buffer)
        return result

    def _fused_delayed_call(self, inputs, states, learnable, line):
        """A call with the delay line fused into the neuron's Triton kernels or C kernels where they run (the
        kernels read the input `lag` and `lag` + 1 steps back, or every step back weighed by the taps; the steps
        before this call's first from `line`, what the line holds from earlier calls, if any), else the `Delay`
        layer's output into the neuron's own path."""
        delay, first = self.delay, inputs[0]
        neuron = self._delayed_neuron(first, held=line is not None)
        if neuron is None:
            series = first if line is None else torch.cat([line, first])
            delayed = delay(series)[series.shape[0] - first.shape[0]:]
            return self._checked_call(None, (delayed, *inputs[1:]), states, learnable)
        inputs, states, learnable = neuron.check(inputs, states, learnable)
        if delay.interpolation != "linear":  # the taps [C, max_delay + 1]: their gradient reaches the delays
            # in the delays' dtype: the kernels read them in their compute dtype, and a 16-bit copy would round the
            # taps and, call by call, their gradient
            learnable = learnable + [delay.taps()]
        else:
            learnable = learnable + [_check_learnable("delay", delay.line_delays(), inputs[0])]
        if line is not None:
            learnable.append(full_line(line, delay.max_delay, inputs[0]))
        return neuron((inputs, states, learnable))

    def _delayed_kernels(self, held=False):
        """The kernels with this layer's delay line (kept per max_delay, kind of taps and whether they continue a
        held line: the layer's `delay` and its interpolation may change), or None inside torch.compile's trace
        when they were not looked up before: reading the step's outside values there would break the graph, and
        the `Delay` layer runs instead."""
        line = (self.delay.max_delay, self.delay.interpolation != "linear", held)
        kernels = self._delayed.get(line)
        if kernels is None and not torch.compiler.is_compiling():
            options = {"input": self._signature.inputs[0], "max_delay": line[0], "tapped": line[1], "held": held}
            kernels = self.spec.compiled("delayed", options, **self.static)
            self._delayed[line] = kernels
        return kernels

    def _delayed_neuron(self, first, held=False):
        """The `NeuronCall` of the kernels with the delay line (continuing a held one if `held`) for a call whose
        first input is `first`, or None where they do not run it (the eager backend, the torch path)."""
        if self.backend in ("eager", "torch") or not isinstance(first, torch.Tensor):
            return None
        compiled = self._delayed_kernels(held)
        if compiled is None:
            return None
        neuron = NeuronCall(self.spec, self._signature, self.static, self.hyper, compiled, self.backend,
                            self.store_state_seqs, False)
        if _use_triton(self.backend, first.device):
            return neuron
        return neuron if self.backend in ("c", "auto") and neuron._c_runs(first) else None

    def _check_finite(self, learnable):
        """A ValueError naming a learnable parameter of `spec.finite_learnable` that is NaN or infinite. The check
        reads the values on the host, so it runs only when they changed since the last one (another tensor, or an
        in-place update); writes through `.data` are not seen until then."""
        from .delay import _CheckedDelays

        checked = self.__dict__.setdefault("_checked_finite", {})
        for name, value in zip(self._signature.learnable, learnable):
            why = self.spec.finite_learnable.get(name)
            if why is None or not isinstance(value, torch.Tensor):
                continue
            if torch.compiler.is_compiling():  # a check on the host would break the graph: the device asserts
                torch._assert_async(torch.isfinite(value).all(), f"flexgen: the parameter {name!r} is not finite")
                continue
            if torch._C._are_functorch_transforms_active():
                continue
            seen = checked.setdefault(name, _CheckedDelays())
            if seen.holds(value):
                continue
            if not torch.isfinite(value).all():
                what = "NaN" if torch.isnan(value).any() else "infinite"
                raise ValueError(f"{self.spec.name}: the learnable parameter {name!r} is {what}; it must be a finite "
                                 f"number ({why})")
            seen.remember(value)

    def _learnable_values(self, inputs):
        """The learnable values a call passes, in signature order (a subclass may adapt them to the inputs)."""
        return [getattr(self, w) for w in self._signature.learnable]  # not _parameters: functional_call swaps them

    def forward(self, *inputs):
        sig = self.spec.signature
        if self.step_mode == "s":
            inputs = tuple(x.unsqueeze(0) if isinstance(x, torch.Tensor) else x for x in inputs)
        states = [self._states[s] for s in sig.states] if self._states else None
        learnable = self._learnable_values(inputs)
        if self.spec.finite_learnable:
            self._check_finite(learnable)
        if self._compiled is None and self.backend != "eager":
            self._compiled = self.spec.compiled(**self.static)
        if self.delay is not None:
            outputs, finals = self._delayed_call(inputs, states, learnable)
        else:
            key = self._call_key(inputs, states, learnable)
            known = self._known_calls.get(key) if key is not None else None
            if known is not None:
                outputs, finals = known(inputs, states, learnable)
            else:
                outputs, finals = self._checked_call(key, inputs, states, learnable)
        # Plain attributes, set without nn.Module.__setattr__'s parameter/buffer/module checks (per call).
        if self.store_state_seqs:
            object.__setattr__(self, "state_seqs", dict(zip(sig.states, finals)))
            finals = [f[-1] for f in finals]
        object.__setattr__(self, "_states", dict(zip(sig.states, finals)))
        if self.step_mode == "s":
            outputs = [o[0] for o in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
