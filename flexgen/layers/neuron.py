"""Neuron layers: the `torch.nn.Module` a user puts in a network (`NeuronModule`), the functional `run`, and
`NeuronCall`, what a call of a neuron needs besides its tensors.

Takes a spec and its `CompiledNeuron`; a call's tensors go through the checks (`flexgen.layers.checks`) to the
launch stage's ops. Known calls skip the checks (`flexgen.layers.known_calls`); a layer with `delay=` reads its
first input through its delay line (`flexgen.layers.delay_line`).
"""
from typing import Any, NamedTuple

import torch

from ..launch.eager import run_eager
from ..frontend.hyper import hyper_value
from ..launch import broadcasts_per_neuron, cached_scalar, tracing_or_transforming
from ..launch import c_path
from ..launch.backends import Run, check_name, choose
from .checks import (any_autocast_enabled, autocast_inputs, check_attribute_names, check_delay,
                     check_dtype, check_inputs, check_learnable, check_recompute, check_states)
from .tracing import c_prepared, refuse_jit_trace
from .delay_line import delayed_call, delayed_kernels
from .known_calls import KnownCall, capturing_on, handed_on_unchanged, keep_known_call, tensor_keys


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
    check_name(backend)
    check_recompute(recompute)
    refuse_jit_trace(spec.__name__)
    resolved = resolve_parameters(spec, params, static)
    if compiled is None and backend != "eager":
        compiled = spec.compiled(**resolved.static)
    neuron = NeuronCall(spec, resolved.signature, resolved.static, resolved.hyper, compiled, backend, store_state_seqs,
                        recompute)
    return neuron(neuron.check(inputs, states, list(resolved.learnable.values())))


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
    report: Any = None  # called with the `Run` a call takes (a layer records it as `last_run`)

    def check(self, inputs, states, learnable):
        """A call's tensors as the kernels take them: inputs checked (and in the autocast dtype), learnable
        parameters checked, states checked or, when None, the declared initial values."""
        check_inputs(self.spec, inputs)
        inputs = autocast_inputs(inputs)
        first = inputs[0]
        learnable = [check_learnable(w, value, first) for w, value in zip(self.signature.learnable, learnable)]
        if states is None:
            states = initial_states(self.spec, self.hyper, self.static, first)
        else:
            states = check_states(self.spec, states, first)
        return inputs, states, learnable

    def ops(self, checked):
        """The ops a checked call runs through (plain or recompute, on the backend `backend_for` chooses),
        whether it saves for a backward, and whether it runs Triton kernels. Tells `report` (if any) the `Run`."""
        first = checked[0][0]
        save = torch.is_grad_enabled() and _any_requires_grad(checked)
        backend = self.backend_for(first)
        if backend.name == "c":
            ops, triton = self.compiled.c_ops_for(self.recompute), False
        else:
            triton = backend.name == "triton"
            ops = self.compiled.ops_for_call(self.recompute, triton, first)
        if self.report is not None:
            self.report(Run(backend.name, _design(ops.layout)))
        return ops, save, triton

    def backend_for(self, first):
        """The backend (`flexgen.launch.backends.choose`) a call whose first input is `first` runs on: on the CPU
        the C target where it runs the call (fp32 and fp64, fp16 and bf16 through its fp32 kernels, outside
        torch.compile and torch.func, with a C compiler), else the generated torch code."""
        return choose(self.backend, first.device, first.dtype, c_builds=self.c_builds, owner=self.spec.__name__)

    def c_builds(self):
        """None where the C target's library of these kernels loads (built at the first use), else why not."""
        if torch.compiler.is_compiling():  # built outside the trace, which then reads the loaded ops
            return c_prepared(self.compiled)
        try:
            self.compiled.c_library
        except c_path.CompilerError as exc:
            return exc
        return None

    def __call__(self, checked):
        """(outputs, final states or their sequences) of a checked call."""
        inputs, states, learnable = checked
        first = inputs[0]
        if self.backend == "eager":
            if self.report is not None:
                self.report(Run("eager", "step by step"))
            params = {w: _broadcastable(p, first) for w, p in zip(self.signature.learnable, learnable)}
            states = [v.expand(first.shape[1:]) for v in states]
            return run_eager(self.spec, self.static, inputs, states, params, self.hyper, self.store_state_seqs)
        ops, save, triton = self.ops(checked)
        result = ops.call(inputs, states, learnable, list(self.hyper.values()), self.store_state_seqs, save, triton)
        n_out, n_states = len(ops.layout.outputs), len(states)
        return list(result[:n_out]), list(result[n_out:n_out + n_states])


def _design(layout):
    """A neuron layer's path, from the layout its kernels ran: "recompute", "delay line" or "plain"."""
    if layout.variant.recompute:
        return "recompute"
    return "delay line" if layout.delayed else "plain"


def _any_requires_grad(groups):
    for group in groups:
        for t in group:
            if t.requires_grad:
                return True
    return False


def _broadcastable(param, like):
    """A per-channel parameter shaped [C, 1, ...] so it broadcasts against one step [B, C, ...] (eager); other
    shapes broadcast as they are."""
    if param.numel() == 1 or broadcasts_per_neuron(param, like.shape[1:]):
        return param
    return param.reshape([-1] + [1] * (like.dim() - 3))


def _initial_value(value, dtype):
    """A learnable parameter's initial value as a tensor: in `dtype`, else a floating tensor's own dtype, else
    torch's default dtype; a number is taken exactly in that dtype (no float32 round trip)."""
    if dtype is None:
        floating = isinstance(value, torch.Tensor) and value.is_floating_point()
        dtype = value.dtype if floating else torch.get_default_dtype()
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype)
    return torch.as_tensor(value, dtype=dtype)


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
    `backend` is "auto" (Triton on CUDA tensors; on the CPU the C kernels where a
    C compiler is, else the generated torch code), "triton", "c", "torch" or
    "eager" (`flexgen.launch.backends`); `layer.last_run` says what the last call
    took: a `Run` with the backend's name and the path ("plain", "recompute",
    "delay line" in the kernels, "delay layer first", or "step by step").

    >>> import torch, flexgen
    >>> @flexgen.neuron(states=("v",))
    ... def if_neuron(x, v, v_th=1.0):
    ...     s = flexgen.spike(v + x - v_th)
    ...     return s, (v + x) * (1.0 - s)
    >>> layer = if_neuron(v_th=0.5, backend="torch")
    >>> layer(torch.tensor([[0.2], [0.4]])).flatten().tolist(), layer.v.tolist()
    ([0.0, 1.0], [0.0])
    >>> layer.last_run
    Run(backend='torch', path='plain')
    """

    def __init__(self, spec, step_mode="m", store_state_seqs=False, backend="auto", per_channel=None, recompute="auto",
                 dtype=None, delay=None, **params):
        super().__init__()
        if step_mode not in ("m", "s"):
            raise ValueError(f"step_mode must be 'm' or 's', got {step_mode!r}")
        check_name(backend)
        if per_channel is not None and (isinstance(per_channel, bool) or not isinstance(per_channel, int)
                                        or per_channel < 1):
            raise ValueError(f"per_channel must be a positive number of channels, got {per_channel!r}")
        check_recompute(recompute)
        check_attribute_names(self, spec)
        self.spec, self.step_mode, self.store_state_seqs, self.backend = spec, step_mode, store_state_seqs, backend
        spec.finite_learnable  # (a cached property: computed now, never inside a compiled trace)
        self.recompute = recompute
        resolved = resolve_parameters(spec, params)
        self.static, self._signature, self.hyper = resolved.static, resolved.signature, resolved.hyper
        check_dtype(dtype)
        for w, default in resolved.learnable.items():
            value = _initial_value(default, dtype)
            if per_channel is not None and value.numel() == 1:
                value = value.reshape(()).expand(int(per_channel))
            self.register_parameter(w, torch.nn.Parameter(value.clone()))
        self.delay = check_delay(delay, spec)
        self._states = {}
        self.line = None  # with delay=: the first input's last max_delay steps, [<= max_delay, B, ...], oldest first
        # (zeros before the sequence began where a LineBuffer holds it)
        self._line_buffer = None  # a delay_line.LineBuffer that `line` is a view of, while calls stream in place
        self.state_seqs = {}
        self._known_calls = {}  # call key -> KnownCall, see _remember
        self.last_run = None  # the `flexgen.launch.backends.Run` (backend and path) the last call took
        # Generate (or load) the kernels and register the ops now, not inside a compiled graph.
        self._compiled = None if backend == "eager" else spec.compiled(**self.static)
        self._delayed = {}  # (max_delay, tapped, held) -> the kernels with such a delay line
        if self.delay is not None and backend not in ("eager", "torch"):
            delayed_kernels(self)
            if self.delay.max_delay:  # the calls after the first continue the line
                delayed_kernels(self, held=True)

    def _call_key(self, inputs, states, learnable):
        """What the checks and the plan of a call depend on; None for calls that take the checked path
        every time (compiling, under torch.func or autocast, the eager backend, an argument not a tensor)."""
        if (
            self.backend == "eager"
            or torch.compiler.is_compiling()
            or torch._C._are_functorch_transforms_active()
            or any_autocast_enabled()
        ):
            return None
        try:
            tensors = tensor_keys((*inputs, *(states or ()), *learnable))
        except (AttributeError, RuntimeError, TypeError):
            return None
        options = (torch.is_grad_enabled(), states is None, self.backend, self.recompute, self.store_state_seqs)
        return (*options, *self.hyper.values(), *tensors)

    def _neuron_call(self):
        if self._compiled is None and self.backend != "eager":  # a copy or an unpickled layer looks them up again
            self._compiled = self.spec.compiled(**self.static)
        return NeuronCall(self.spec, self._signature, self.static, self.hyper, self._compiled, self.backend,
                          self.store_state_seqs, self.recompute, self._ran)

    def _ran(self, run):
        """Record the `Run` a call took as `last_run` (a plain attribute: set on every call)."""
        object.__setattr__(self, "last_run", run)

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
        ops, save, triton = neuron.ops(checked)
        if not triton:
            return
        plan = ops.plan(c_inputs, c_states, c_learnable, list(self.hyper.values()), self.store_state_seqs, save)
        if plan is None:
            return
        keep_known_call(self._known_calls, key, KnownCall(plan, c_states if states is None else None, self.last_run))

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
        refuse_jit_trace(self.spec.__name__)
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
            outputs, finals = delayed_call(self, inputs, states, learnable)
        else:
            key = self._call_key(inputs, states, learnable)
            known = self._known_calls.get(key) if key is not None else None
            if known is not None:
                outputs, finals = known(inputs, states, learnable)
                object.__setattr__(self, "last_run", known.run)
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
