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

The forward and the backward are the torch reference of `flexgen.launch.eventprop` (fp64 by default, the math
printed from the derived equations); fused kernels are not written yet.
"""
import functools
from typing import NamedTuple

import torch

from ..derive.eventprop_program import derive_program
from ..errors import SpecError
from ..launch.eventprop import Simulator
from ..render.eventprop import load, module_source
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


def _rows(params, times, weight):
    """Each parameter with one value per row of the simulation: sample-major, [batch * out_features]."""
    return [p.expand(weight.shape[0]).repeat(times.shape[0]) for p in params]


class _EventProp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sim, times, weight, *params):
        with torch.no_grad():
            out, counts, trace, records = sim.forward(times, weight, _rows(params, times, weight))
        ctx.sim, ctx.records = sim, records
        ctx.save_for_backward(times, weight, *params)
        ctx.mark_non_differentiable(counts)
        return out, counts, trace

    @staticmethod
    def backward(ctx, grad_times, grad_counts, grad_trace):
        times, weight, *params = ctx.saved_tensors
        with torch.no_grad():
            d_times, d_weight, d_params = ctx.sim.backward(
                times, weight, _rows(params, times, weight), ctx.records, grad_times, grad_trace)
        d_params = [d.view(times.shape[0], -1).sum(0) for d in d_params]
        d_params = [d.sum() if p.dim() == 0 else d for d, p in zip(d_params, params)]
        return (None, d_times, d_weight, *d_params)


class EventPropDense(torch.nn.Module):
    """Input spike times [B, in_features, K] -> weight [out, in] -> a layer of `neuron` (a `flexgen.ode` spec).

    dt and steps: the grid on which the states are recorded (the window is [0, steps dt); input spikes at or
    after its end do nothing). learnable: neuron parameters trained, one value per neuron; the others are fixed
    (one value); their values are the spec's defaults or `params`. spike_capacity: the first size of each
    neuron's spike buffer (it doubles as needed). substeps: for a neuron nonlinear between events, the steps of
    its spec's method per piece of trajectory (a piece is at most dt long); a linear one is solved exactly.
    dtype: of the weight, parameters and times (float64: the reference is exact up to rounding for linear
    neurons). Call with the input times (inf-padded, ascending per input) or an `EventPropOutput`; returns an
    `EventPropOutput`.
    """

    def __init__(self, in_features, out_features, neuron, dt=1.0, steps=100, learnable=(), spike_capacity=8,
                 substeps=8, dtype=torch.float64, **params):
        super().__init__()
        spec = getattr(neuron, "spec", neuron)
        if not isinstance(spec, NeuronSpec):
            raise SpecError(f"EventPropDense: neuron must be a flexgen.ode spec, got {type(neuron).__name__}")
        spec.adjoint()  # a SpecError for a neuron EventProp cannot take (a step function, no reset, ...)
        self.program, self.source, fns = _functions(spec)
        for name, value in [("in_features", in_features), ("out_features", out_features), ("steps", steps),
                            ("spike_capacity", spike_capacity), ("substeps", substeps)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EventPropDense: {name} must be a positive int, got {value!r}")
        if not (isinstance(dt, (int, float)) and dt > 0 and dt < float("inf")):
            raise ValueError(f"EventPropDense: dt must be a positive number, got {dt!r}")
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
        for name in names:
            value = torch.as_tensor(params.get(name, spec.signature.defaults[name]), dtype=dtype)
            if name in learnable:
                self.register_parameter(name, torch.nn.Parameter(value.expand(out_features).clone()))
            else:
                self.register_buffer(name, value.clone())
        states = tuple(str(s) for s in self.program.states)
        self.sim = Simulator(fns, states, names, spec.signature.init, float(dt), steps, spike_capacity,
                             self.program.linear, substeps)

    @property
    def states(self):
        return self.sim.states

    def forward(self, times):
        if isinstance(times, EventPropOutput):
            times = times.times
        self._check(times)
        params = [getattr(self, n) for n in self.parameter_names]
        out, counts, trace = _EventProp.apply(self.sim, times, self.weight, *params)
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

    def extra_repr(self):
        return (f"{self.in_features}, {self.out_features}, neuron={self.spec.name}, dt={self.sim.dt:g}, "
                f"steps={self.sim.steps}")
