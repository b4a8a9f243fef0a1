"""`flexgen.EventPropDense`: a dense layer of `flexgen.ode` neurons driven by input spike times, trained with
exact EventProp gradients (Wunderlich & Pehle, Sci. Rep. 11:12829, 2021).

    >>> import torch, flexgen
    >>> @flexgen.ode(states=("v", "i"))
    ... def cuba(x, v, i, tau_m=10.0, tau_s=5.0, v_th=1.0):
    ...     return flexgen.Dynamics({"v": (i - v) / tau_m, "i": -i / tau_s + x}, threshold=v >= v_th,
    ...                             reset={"v": 0.0})
    >>> layer = flexgen.EventPropDense(2, 3, cuba, dt=1.0, steps=20)
    >>> with torch.no_grad():
    ...     _ = layer.weight.fill_(2.0)
    >>> out = layer(torch.tensor([[[1.0, 2.0], [1.5, float("inf")]]], dtype=torch.float64))
    >>> out.counts.tolist(), out.trace.shape
    ([[1, 1, 1]], torch.Size([20, 1, 3, 2]))
    >>> round(out.times[0, 0, 0].item(), 4)  # each neuron's spike times, ascending, inf-padded
    3.9051
    >>> out.times[0, :, 0].sum().backward()  # a loss on the first spike times
    >>> [round(g, 4) for g in layer.weight.grad[0].tolist()]  # exact dL/dW: larger weights, earlier spikes
    [-1.2197, -0.6176]

`backend`: "c" runs the generated C kernels (`flexgen.kinds.eventprop`, CPU tensors), "triton" the generated
Triton kernels (`flexgen.launch.eventprop_triton`: CUDA tensors, or CPU tensors in Triton's interpreter; recurrent
layers without recurrent delays), "torch" the torch reference of `flexgen.launch.eventprop` (any device; a Python
loop over the breakpoints), "auto" the Triton kernels on CUDA tensors where they take the layer (else, with a
warning, the reference), the C kernels on CPU tensors where they run the call (a C compiler), else the reference.
Every backend takes any neuron: exact flows where it is linear between events, `substeps` steps of its method per
piece where not (the C kernels take at most `flexgen.render.eventprop_c.max_substeps`). All give the same spike
times, states and gradients (to rounding). `layer.last_run` says which ran, and its path: "exact" or "substeps".

`delays`: learnable transmission delays, trained with exact gradients (every backend). "axon": one per input,
`delay` [in_features]: the layer sees input i's spike at t + delay[i]. "synapse": one per synapse, `delay` [out,
in]: neuron j sees input i's spike at t + delay[j, i] (each neuron its own arrival times). They start at 0 and
must lie in [0, max_delay]: call `clamp_delays_()` after each optimiser step.

`recurrent=True`: a learnable `weight_rec` [out, out]; neuron j receives every spike of neuron k of the same sample
at its time with weight weight_rec[j, k] (`flexgen.launch.eventprop_recurrent`: each sample in global time order,
spikes carried over at one time fire at that time, in waves; the Triton kernels take `MAX_NEURONS` at most).

`recurrent_delays` (with recurrent=True; the C kernels and the reference): learnable delays of the recurrent
connections, trained with exact gradients. "axon": one per neuron, `delay_rec` [out]: neuron k's spike reaches
every neuron at t + delay_rec[k]; "synapse": one per connection, `delay_rec` [out, out]: neuron k's spike reaches
neuron j at t + delay_rec[j, k] (`flexgen.launch.eventprop_recurrent_delays`: each sample's pending arrivals in a
queue). They start at 0 (the undelayed layer) in [0, max_delay]; `clamp_delays_()` clamps them with the input's.
"""
import functools
import math
import warnings
from typing import NamedTuple

import torch

from ..derive.eventprop_program import derive_program
from ..errors import SpecError
from ..kinds.eventprop import EVENTPROP
from ..launch import c_path
from ..launch.backends import REGISTRY, Run, choose
from ..launch.eventprop import Simulator
from ..launch.eventprop_c import CSimulator
from ..launch.eventprop_c_delays import DelayedCSimulator
from ..launch.eventprop_recurrent import RecurrentSimulator
from ..launch.eventprop_recurrent_delays import DelayedRecurrentSimulator
from ..launch.eventprop_triton import TritonSimulator
from ..launch.eventprop_triton_recurrent import MAX_NEURONS
from ..render.eventprop import load, module_source
from .ode_spec import check_divisors, divisor_checks
from .spec import NeuronSpec


class EventPropOutput(NamedTuple):
    """times [B, N, K]: each neuron's spike times, ascending, inf after the last (K grows with the most spikes);
    counts [B, N]; trace [T, B, N, S]: the states at the grid times (n+1) dt, after the events there; states:
    the state names (the order of trace's last axis)."""

    times: torch.Tensor
    counts: torch.Tensor
    trace: torch.Tensor
    states: tuple

    def state(self, name):
        """One state's trace, [T, B, N]."""
        if name not in self.states:
            raise KeyError(f"no state {name!r}; states: {', '.join(self.states)}")
        return self.trace[..., self.states.index(name)]


@functools.lru_cache(maxsize=None)
def _functions(spec):
    program = derive_program(spec.system, spec.method)
    source = module_source(program, spec.name)
    return program, source, load(source, spec.name)


@functools.lru_cache(maxsize=None)
def _c_kernels(spec, substeps=None):
    """The C kernels of `spec`'s layer, or the reason they cannot run it (a string, or a c_path.CompilerError).
    substeps: those of a neuron nonlinear between events (compiled in); None for a linear one."""
    from ..render.eventprop_c import max_substeps  # (jinja2 only here)

    program = _functions(spec)[0]
    if not program.linear and substeps > max_substeps(program):
        return (f"the C kernels take at most {max_substeps(program)} substeps for {spec.name} (a piece's substep "
                f"states are kept on the stack), the layer has {substeps}")
    kernels = EVENTPROP.kernels(program, substeps or EVENTPROP.options().substeps)
    try:
        kernels.library
    except c_path.CompilerError as exc:
        return exc
    return kernels


@functools.lru_cache(maxsize=None)
def _triton_kernels(spec, substeps=None):
    """The Triton kernels of `spec`'s layer. substeps: those of a neuron nonlinear between events (in the
    source); None for a linear one."""
    return EVENTPROP.triton_module(_functions(spec)[0], substeps or EVENTPROP.options().substeps)


def _rows(params, times, weight):
    """Each parameter with one value per row of the simulation: sample-major, [batch * out_features]."""
    return [p.expand(weight.shape[0]).repeat(times.shape[0]) for p in params]


class _EventProp(torch.autograd.Function):
    """(sim, times, weight, weight_rec, delay_rec, *params): weight_rec is None for a feed-forward layer,
    delay_rec (the recurrent delays [out, out]) None for undelayed recurrent connections."""

    @staticmethod
    def forward(ctx, sim, times, weight, weight_rec, delay_rec, *params):
        coupling = tuple(t for t in (weight_rec, delay_rec) if t is not None)
        with torch.no_grad():
            out, counts, trace, records = sim.forward(times, weight, _rows(params, times, weight), *coupling)
        ctx.sim, ctx.records, ctx.coupled = sim, records, len(coupling)
        ctx.save_for_backward(times, weight, *coupling, *params)
        ctx.mark_non_differentiable(counts)
        return out, counts, trace

    @staticmethod
    def backward(ctx, grad_times, grad_counts, grad_trace):
        times, weight, *params = ctx.saved_tensors
        coupling, params = params[:ctx.coupled], params[ctx.coupled:]
        # the C kernels skip the parameter integrals' quadrature where no parameter is trained
        wanted = any(ctx.needs_input_grad[5:])
        options = {"parameter_grads": wanted} if isinstance(ctx.sim, (CSimulator, TritonSimulator)) else {}
        with torch.no_grad():
            d_times, d_weight, d_params, *d_rec = ctx.sim.backward(
                times, weight, _rows(params, times, weight), ctx.records, grad_times, grad_trace, *coupling,
                **options)
        if not wanted:
            d_params = [None] * len(d_params)
        d_params = [None if d is None else d.view(times.shape[0], -1).sum(0) for d in d_params]
        d_params = [d.sum() if d is not None and p.dim() == 0 else d for d, p in zip(d_params, params)]
        d_rec += [None] * (2 - len(d_rec))
        return (None, d_times, d_weight, *d_rec, *d_params)


DELAYS = (None, "axon", "synapse")


class EventPropDense(torch.nn.Module):
    """Input spike times [B, in_features, K] -> weight [out, in] -> a layer of `neuron` (a `flexgen.ode` spec).

    dt and steps: the grid on which the states are recorded (the window is [0, steps dt); input spikes at or
    after its end do nothing). learnable: neuron parameters trained, one value per neuron; the others are fixed
    (one value); their values are the spec's defaults or `params`. spike_capacity: the first size of each
    neuron's spike buffer (it doubles as needed). substeps: for a neuron nonlinear between events, the steps of
    its spec's method per piece of trajectory (a piece is at most dt long; both backends), the C kernels' compiled
    in; a linear one is solved exactly.
    dtype: of the weight, parameters and times (float64: the reference is exact up to rounding for linear
    neurons; the C and Triton kernels compute in float64 whatever the dtype). backend: "auto", "c", "triton" or
    "torch" (see the module docstring); `last_run` records what the last call ran on, `source("c")` is the
    generated C source, `source("triton")` the Triton module. delays:
    None, "axon" (a learnable `delay` [in_features]) or "synapse" (a learnable `delay` [out, in]), each in
    [0, max_delay] (default: the window, steps dt); see `clamp_delays_`. recurrent: True adds a learnable
    `weight_rec` [out, out]: neuron j receives every spike of neuron k of the same sample at its time with weight
    weight_rec[j, k] (the diagonal, a self-connection, acts after the neuron's own reset; per-synapse delays are
    refused). recurrent_delays: None, "axon" (a learnable `delay_rec` [out]: neuron k's spikes reach the layer
    delay_rec[k] later) or "synapse" (`delay_rec` [out, out]: neuron k's spikes reach neuron j delay_rec[j, k]
    later), in [0, max_delay], with recurrent=True. Call with
    the input times (inf-padded, ascending per input) or an `EventPropOutput`; returns an `EventPropOutput`.
    """

    def __init__(self, in_features, out_features, neuron, dt=1.0, steps=100, learnable=(), spike_capacity=8,
                 substeps=8, dtype=torch.float64, backend="auto", delays=None, max_delay=None, recurrent=False,
                 recurrent_delays=None, **params):
        super().__init__()
        spec = getattr(neuron, "spec", neuron)
        if not isinstance(spec, NeuronSpec):
            raise SpecError(f"EventPropDense: neuron must be a flexgen.ode spec, got {type(neuron).__name__}")
        if backend not in ("auto", "c", "torch", "triton"):
            raise ValueError(f"EventPropDense: backend must be 'auto', 'c', 'triton' or 'torch', got {backend!r}")
        spec.adjoint()  # a SpecError for a neuron EventProp cannot take (a step function, no reset, ...)
        self.program, self.source_torch, fns = _functions(spec)
        for name, value in [("in_features", in_features), ("out_features", out_features), ("steps", steps),
                            ("spike_capacity", spike_capacity), ("substeps", substeps)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EventPropDense: {name} must be a positive int, got {value!r}")
        if not (isinstance(dt, (int, float)) and dt > 0 and dt < float("inf")):
            raise ValueError(f"EventPropDense: dt must be a positive number, got {dt!r}")
        self.recurrent = _recurrent_option(recurrent, delays)
        self.recurrent_delays = _recurrent_delays_option(recurrent_delays, recurrent)
        self.delays, self.max_delay = _delay_options(delays, max_delay, dt, steps, recurrent_delays)
        names = [str(p) for p in self.program.parameters]
        unknown = [n for n in list(params) + list(learnable) if n not in names]
        if unknown:
            raise ValueError(f"EventPropDense: {spec.name} has no parameter {unknown[0]!r}; parameters: "
                             f"{', '.join(names)}")
        self.spec, self.in_features, self.out_features = spec, in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        bound = 1.0 / in_features ** 0.5
        torch.nn.init.uniform_(self.weight, -bound, bound)
        self.parameter_names = tuple(names)
        if recurrent:
            self.weight_rec = torch.nn.Parameter(torch.empty(out_features, out_features, dtype=dtype))
            torch.nn.init.uniform_(self.weight_rec, -1.0 / out_features ** 0.5, 1.0 / out_features ** 0.5)
        if recurrent_delays is not None:
            shape = (out_features,) if recurrent_delays == "axon" else (out_features, out_features)
            self.delay_rec = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        if delays is not None:
            shape = (in_features,) if delays == "axon" else (out_features, in_features)
            self.delay = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        for name in names:
            value = torch.as_tensor(params.get(name, spec.signature.defaults[name]), dtype=dtype)
            if name in learnable:
                self.register_parameter(name, torch.nn.Parameter(value.expand(out_features).clone()))
            else:
                self.register_buffer(name, value.clone())
        states = tuple(str(s) for s in self.program.states)
        simulator = (Simulator if not recurrent else RecurrentSimulator if recurrent_delays is None
                     else DelayedRecurrentSimulator)
        self.sim = simulator(fns, states, names, spec.signature.init, float(dt), steps, spike_capacity,
                             self.program.linear, substeps)
        self.backend, self.last_run, self._c_sim, self._triton_sim = backend, None, None, None
        self._fallback_said = None  # the reason the Triton kernels last could not run a call (warned once)
        divisors = divisor_checks(self.program.singular)
        self._check_parameters(divisors)
        # each call checks again the factors that read a learnable parameter (training moves those)
        self._moving_divisors = [check for check in divisors if set(check[1]) & set(learnable)]

    def _check_parameters(self, divisors):
        """A ValueError where the parameters make the exact flow divide by zero (e.g. equal membrane and synaptic
        time constants of a current-based LIF, whose closed form divides by their difference): NaN otherwise.
        `divisors`: the `divisor_checks` to run."""
        if divisors:
            names = {n for check in divisors for n in check[1]}
            values = {n: getattr(self, n).detach().cpu().double().numpy() for n in names}
            check_divisors(f"EventPropDense ({self.spec.name})", "the exact flow between events", divisors,
                           values, advice="make the values differ (a relative difference of 1e-6 moves the "
                                          "states by about as much)")

    def source(self, target="c"):
        """The generated source: "c" (the C kernels), "triton" (the Triton kernels: a neuron linear between
        events) or "torch" (the reference's printed functions)."""
        if target == "torch":
            return self.source_torch
        if target == "triton":
            return _triton_kernels(self.spec, self._kernel_substeps()).source
        if target != "c":
            raise ValueError(f"EventPropDense.source: target must be 'c', 'triton' or 'torch', got {target!r}")
        return EVENTPROP.generate(self.program, EVENTPROP.options(self.sim.substeps))[0]

    def _kernel_substeps(self):
        """What keys the C and Triton kernels beside the neuron: the substeps of a nonlinear one (in their
        source), None for a linear one."""
        return None if self.program.linear else self.sim.substeps

    def _c_builds(self):
        found = _c_kernels(self.spec, self._kernel_substeps())
        return found if isinstance(found, (str, Exception)) else None

    def _triton_refusal(self, device):
        """Why the Triton kernels cannot run this layer's call on `device` (None where they can)."""
        if self.recurrent_delays is not None:
            return "they take recurrent layers without delays on the recurrent connections"
        if self.recurrent and self.out_features > MAX_NEURONS:
            return (f"a recurrent layer's neurons are one program's lanes, at most {MAX_NEURONS}; this one has "
                    f"{self.out_features}")
        return REGISTRY["triton"].unavailable(device, None)

    def _runner(self, times):
        """The simulator a call runs on (the Triton kernels', the C kernels' or the torch reference's), recorded
        in `last_run`."""
        path = "exact" if self.program.linear else "substeps"
        if self.backend == "triton" or (self.backend == "auto" and times.device.type == "cuda"):
            reason = self._triton_refusal(times.device)
            if reason is None:
                if self._triton_sim is None:
                    sim = self.sim
                    kernels = _triton_kernels(self.spec, self._kernel_substeps())
                    self._triton_sim = kernels.simulator(sim.states, sim.parameters, sim.init, sim.dt, sim.steps,
                                                         sim.capacity, self.recurrent)
                self.last_run = Run("triton", path)
                return self._triton_sim
            if self.backend == "triton":
                raise RuntimeError(f"EventPropDense: backend='triton' cannot run this call: {reason}; use "
                                   "backend='auto'")
            if reason != self._fallback_said:  # once per reason: the reference is far slower than the kernels
                self._fallback_said = reason
                warnings.warn(f"EventPropDense: the Triton kernels cannot run this layer ({reason}); it runs the "
                              "torch reference on these CUDA tensors, a Python loop over the breakpoints (slow)",
                              stacklevel=3)
        if self.backend == "torch" or (self.backend == "auto" and times.device.type != "cpu"):
            self.last_run = Run("torch", path)
            return self.sim
        if self.backend == "c" and times.device.type != "cpu":
            raise RuntimeError(f"EventPropDense: backend='c' runs on CPU tensors (got {times.device.type}); use "
                               "backend='auto' or 'torch' (the torch reference) on the GPU")
        chosen = choose(self.backend, times.device, times.dtype, c_builds=self._c_builds, owner="EventPropDense")
        if chosen is not REGISTRY["c"]:
            self.last_run = Run("torch", path)
            return self.sim
        if self._c_sim is None:
            sim, kernels = self.sim, _c_kernels(self.spec, self._kernel_substeps())
            if self.recurrent_delays is not None:
                self._c_sim = DelayedCSimulator(kernels.library, sim.states, sim.parameters, sim.init, sim.dt,
                                                sim.steps, sim.capacity)
            else:
                self._c_sim = kernels.simulator(sim.states, sim.parameters, sim.init, sim.dt, sim.steps,
                                                sim.capacity, self.recurrent)
        self.last_run = Run("c", path)
        return self._c_sim

    @property
    def states(self):
        return self.sim.states

    def forward(self, times):
        if isinstance(times, EventPropOutput):
            times = times.times
        self._check(times)
        self._check_parameters(self._moving_divisors)
        params = [getattr(self, n) for n in self.parameter_names]
        arrivals = times
        if self.delays is not None:
            self._check_delays()
            shift = self.delay[:, None] if self.delays == "axon" else self.delay[..., None]
            arrivals = (times if self.delays == "axon" else times[:, None]) + shift
        weight_rec = self._checked_weight_rec() if self.recurrent else None
        delay_rec = self._checked_delay_rec() if self.recurrent_delays is not None else None
        out, counts, trace = _EventProp.apply(self._runner(times), arrivals, self.weight, weight_rec, delay_rec,
                                              *params)
        return EventPropOutput(out, counts, trace, self.states)

    def _check(self, times):
        if not torch.is_tensor(times):
            raise TypeError(f"EventPropDense: the input spike times must be a tensor, got {type(times).__name__}")
        if times.dtype != self.weight.dtype:
            raise TypeError(f"EventPropDense: the input spike times are {times.dtype}, the layer is "
                            f"{self.weight.dtype}; convert one of them")
        if times.dim() != 3 or times.shape[1] != self.in_features:
            raise ValueError(f"EventPropDense: the input spike times must be [batch, {self.in_features}, spikes], "
                             f"got {list(times.shape)}")
        if bool(torch.isnan(times).any()):
            raise ValueError("EventPropDense: the input spike times hold NaN (pad with inf for no spike)")
        if bool((times < 0).any()):
            raise ValueError("EventPropDense: the input spike times must be >= 0 (the window starts at 0)")
        if times.shape[2] > 1 and bool((times[..., 1:] < times[..., :-1]).any()):
            raise ValueError("EventPropDense: each input's spike times must be ascending, inf-padded at the end")

    def _checked_weight_rec(self):
        v = self.weight_rec
        n = self.out_features
        if not torch.is_tensor(v) or list(v.shape) != [n, n] or v.dtype != self.weight.dtype:
            got = f"{v.dtype} {list(v.shape)}" if torch.is_tensor(v) else type(v).__name__
            raise ValueError(f"EventPropDense: recurrent=True takes a {self.weight.dtype} weight_rec of shape "
                             f"[{n}, {n}], got {got}")
        if not bool(torch.isfinite(v.detach()).all()):
            raise ValueError("EventPropDense: weight_rec holds NaN or inf")
        return v

    def _checked_delay_rec(self):
        """The recurrent delays checked, as the simulators take them: [out, out], D[j, k] from neuron k to j (an
        axonal delay_rec [out] expanded: D[j, k] = delay_rec[k])."""
        n = self.out_features
        axon = self.recurrent_delays == "axon"
        self._check_delay_values(self.delay_rec, "recurrent_delays", "delay_rec", [n] if axon else [n, n])
        return self.delay_rec[None, :].expand(n, n) if axon else self.delay_rec

    def _check_delays(self):
        shape = [self.in_features] if self.delays == "axon" else [self.out_features, self.in_features]
        self._check_delay_values(self.delay, "delays", "delay", shape)

    def _check_delay_values(self, value, option, name, shape):
        """A ValueError unless `value` (the parameter `name` of the option `option`) is a tensor of the layer's
        dtype and `shape` with every value in [0, max_delay]."""
        d = value.detach() if torch.is_tensor(value) else None
        if d is None or list(d.shape) != shape or d.dtype != self.weight.dtype:
            got = f"{d.dtype} {list(d.shape)}" if d is not None else type(value).__name__
            raise ValueError(f"EventPropDense: {option}={getattr(self, option)!r} takes a {self.weight.dtype} "
                             f"{name} of shape {shape}, got {got}")
        if not bool(torch.isfinite(d).all()) or bool((d < 0).any()) or bool((d > self.max_delay).any()):
            raise ValueError(f"EventPropDense: the {'recurrent ' if name == 'delay_rec' else ''}delays must lie in "
                             f"[0, max_delay = {self.max_delay:g}], got values in [{float(d.min()):g}, "
                             f"{float(d.max()):g}]; call clamp_delays_() after each optimiser step")

    @torch.no_grad()
    def clamp_delays_(self):
        """Clamp `delay` and `delay_rec` into [0, max_delay] in place (call after each optimiser step); returns
        the layer."""
        if self.delays is None and self.recurrent_delays is None:
            raise ValueError("EventPropDense.clamp_delays_: the layer has no delays (delays=None, "
                             "recurrent_delays=None)")
        for name in ("delay", "delay_rec"):
            if hasattr(self, name):
                getattr(self, name).clamp_(0.0, self.max_delay)
        return self

    def extra_repr(self):
        delays = "" if self.delays is None else f", delays={self.delays!r}"
        recurrent = ", recurrent=True" if self.recurrent else ""
        if self.recurrent_delays is not None:
            recurrent += f", recurrent_delays={self.recurrent_delays!r}"
        if self.max_delay is not None:
            recurrent += f", max_delay={self.max_delay:g}"
        return (f"{self.in_features}, {self.out_features}, neuron={self.spec.name}, dt={self.sim.dt:g}, "
                f"steps={self.sim.steps}{delays}{recurrent}")


def _recurrent_option(recurrent, delays):
    """recurrent checked against the other options: a bool; no per-synapse delays."""
    if not isinstance(recurrent, bool):
        raise ValueError(f"EventPropDense: recurrent must be True or False, got {recurrent!r}")
    if recurrent and delays == "synapse":
        raise ValueError("EventPropDense: recurrent=True takes delays=None or 'axon', not 'synapse'")
    return recurrent


def _recurrent_delays_option(recurrent_delays, recurrent):
    """recurrent_delays checked: None, 'axon' or 'synapse', and only with recurrent=True."""
    if recurrent_delays not in DELAYS:
        raise ValueError(f"EventPropDense: recurrent_delays must be None, 'axon' or 'synapse', got "
                         f"{recurrent_delays!r}")
    if recurrent_delays is not None and not recurrent:
        raise ValueError("EventPropDense: recurrent_delays needs recurrent=True")
    return recurrent_delays


def _delay_options(delays, max_delay, dt, steps, recurrent_delays=None):
    """(delays, max_delay) checked: max_delay (the input's and the recurrent connections' delays' bound) defaults
    to the window, steps dt."""
    if delays not in DELAYS:
        raise ValueError(f"EventPropDense: delays must be None, 'axon' or 'synapse', got {delays!r}")
    if delays is None and recurrent_delays is None:
        if max_delay is not None:
            raise ValueError("EventPropDense: max_delay is given without delays ('axon' or 'synapse')")
        return None, None
    if max_delay is None:
        max_delay = steps * dt
    if isinstance(max_delay, bool) or not isinstance(max_delay, (int, float)) or not 0 < max_delay < math.inf:
        raise ValueError(f"EventPropDense: max_delay must be a positive number, got {max_delay!r}")
    return delays, float(max_delay)
