"""The EventProp C kernels for neurons nonlinear between events (EventPropDense(backend="c") with QIF, an
AdEx-like neuron, the bundled EIF), fp64, tiny sizes: the flow is `substeps` steps of the spec's method per piece,
the backward recomputes each piece by substeps and integrates the adjoint by RK4 on it (the torch reference's
`Simulator._stepped_back`). The C kernels give the reference's spike times, grid states and every gradient to
1e-12, feed-forward and recurrent; their gradients equal central differences of the computed (substepped) forward;
the substeps reach the source as a define; bad settings are refused clearly."""
import math

import pytest
import torch

import flexgen
from flexgen.kinds.eventprop import EVENTPROP
from flexgen.launch import c_path
from flexgen.launch.backends import say_once
from flexgen.layers import eventprop as eventprop_layer
from flexgen.neurons import continuous
from flexgen.render import eventprop_c
from flexgen.render.eventprop_c import max_substeps

from test_eventprop_reference import check_gradients, cuba, input_times, smooth_loss

pytestmark = pytest.mark.skipif(not c_path.available(), reason="no C compiler")
F64 = torch.float64


@flexgen.ode(states=("v", "w"), method="rk4")
def adex_like(u, v, w, tau_m=5.0, tau_w=20.0, a=0.3, b=0.4, delta=0.5, v_t=1.0, v_th=2.5):
    """Adaptive exponential integrate-and-fire in dimensionless units, by RK4: past v ~ 1.57 (with w = 0) the
    exponential runs v up to v_th between events."""
    return flexgen.Dynamics({"v": (-v + delta * flexgen.exp((v - v_t) / delta) - w + u) / tau_m,
                             "w": (a * v - w) / tau_w}, threshold=v >= v_th, reset={"v": 0.0, "w": w + b})


def same(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def crossings(out, times):
    """How many output spikes lie between input events (not at an input's time: a crossing of the trajectory)."""
    spikes, inputs = out.times.detach(), times.detach().flatten(1)[:, None, None, :]
    return int((torch.isfinite(spikes) & ((spikes[..., None] - inputs).abs().amin(-1) > 1e-9)).sum())


def run_both(spec, sizes, weight, times, steps, seed=0, **options):
    """[times, trace, d times, d every parameter] of a smooth loss and the counts, on the C kernels and the
    reference, from the same weights."""
    results = {}
    for backend in ("c", "torch"):
        torch.manual_seed(seed)
        layer = flexgen.EventPropDense(*sizes, spec, dt=1.0, steps=steps, backend=backend, **options)
        with torch.no_grad():
            layer.weight.uniform_(*weight)
        x = times.clone().requires_grad_()
        out = layer(x)
        smooth_loss(out, float(steps)).backward()
        assert layer.last_run == (backend, "substeps")
        results[backend] = out, [out.times, out.trace, x.grad] + [p.grad for p in layer.parameters()]
    (out_c, got_c), (out_t, got_t) = results["c"], results["torch"]
    assert torch.equal(out_c.counts, out_t.counts)
    for a, b in zip(got_c, got_t):
        same(a, b)
    return out_c


@pytest.mark.parametrize("spec, weight, options", [
    (continuous.qif, (0.8, 1.6), {"learnable": ("tau", "v_c"), "substeps": 8}),
    (adex_like, (2.0, 6.0), {"learnable": ("tau_m", "a", "v_t", "b"), "substeps": 8}),
    (continuous.eif, (0.6, 1.4), {"substeps": 3}),  # Euler steps; no parameter trained: no integrals in C
], ids=["qif", "adex-like", "eif-fixed-parameters"])
def test_the_c_kernels_equal_the_torch_reference(spec, weight, options):
    times = input_times(2, 4, 3, 14.0, seed=3)
    out = run_both(spec, (4, 3), weight, times, steps=18, **options)
    assert crossings(out, times) > 0 and int(out.counts.sum()) > crossings(out, times)  # crossings and jumps


def test_a_recurrent_layer_of_a_nonlinear_neuron_equals_the_reference():
    times = input_times(2, 3, 3, 12.0, seed=7)
    results = {}
    for backend in ("c", "torch"):
        layer = flexgen.EventPropDense(3, 4, continuous.qif, dt=1.0, steps=14, recurrent=True, learnable=("tau",),
                                       substeps=4, backend=backend)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            layer.weight.copy_(torch.rand(4, 3, generator=gen, dtype=F64) * 0.8 + 0.8)
            layer.weight_rec.copy_(torch.rand(4, 4, generator=gen, dtype=F64) * 1.2 - 0.4)
        x = times.clone().requires_grad_()
        out = layer(x)
        smooth_loss(out, 14.0).backward()
        assert layer.last_run == (backend, "substeps")
        results[backend] = out, [out.times, out.trace, x.grad, layer.weight.grad, layer.weight_rec.grad,
                                 layer.tau.grad]
    (out_c, got_c), (out_t, got_t) = results["c"], results["torch"]
    assert torch.equal(out_c.counts, out_t.counts) and crossings(out_c, times) > 0
    assert bool((out_c.counts > 0).all())
    for a, b in zip(got_c, got_t):
        same(a, b)


@pytest.mark.parametrize("spec, learnable, weight, times", [
    (continuous.qif, ("tau",), [[1.2, 0.9, 1.5], [1.0, 1.4, 0.8]],
     [[[1.3, 6.1, 11.2], [2.5, 9.7, math.inf], [4.2, 13.1, 14.6]]]),
    (adex_like, ("tau_m", "a"), [[4.5, 3.0, 5.5], [3.5, 5.0, 2.5]],
     [[[1.15, 5.5, 11.2], [2.35, 9.7, math.inf], [3.2, 12.1, 13.6]]]),
], ids=["qif", "adex-like"])
def test_gradients_equal_central_differences_of_the_substepped_forward(spec, learnable, weight, times):
    """What is differentiated by the differences is the computed forward (substeps of RK4); the backward is the
    continuous adjoint by RK4 on its trajectory, so the two agree to fourth order in the substep: at 32 substeps
    per dt, to a relative 1e-6."""
    layer = flexgen.EventPropDense(3, 2, spec, dt=1.0, steps=16, learnable=learnable, substeps=32, backend="c")
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight, dtype=F64))
    times = torch.tensor(times, dtype=F64, requires_grad=True)

    def run():
        out = layer(times)
        assert layer.last_run == ("c", "substeps")
        return smooth_loss(out, 16.0), out.counts

    assert crossings(layer(times), times) > 0
    tensors = [layer.weight, *(getattr(layer, n) for n in learnable), times]
    entries = [(0, (0, 1)), (0, (1, 2)), (1, (0,)), (1, (1,)), (len(tensors) - 1, (0, 0, 0)),
               (len(tensors) - 1, (0, 2, 1))] + [(2, (1,))] * (len(learnable) > 1)
    assert check_gradients(run, tensors, entries) == len(entries)


def test_auto_takes_the_c_kernels_for_a_nonlinear_neuron():
    layer = flexgen.EventPropDense(3, 2, continuous.qif, dt=1.0, steps=5)
    layer(input_times(1, 3, 2, 4.0, seed=0))
    assert layer.last_run == ("c", "substeps")


def test_the_substeps_are_a_define_of_the_source():
    """One library per substeps (the source keys the disk cache); a linear neuron's source does not depend on them;
    the event loop and the adjoint sweep are the same text for every neuron."""
    def source(spec, substeps):
        return flexgen.EventPropDense(2, 2, spec, steps=3, substeps=substeps).source("c")

    five, nine = source(continuous.qif, 5), source(continuous.qif, 9)
    assert "#define EP_LINEAR 0\n#define EP_SUBSTEPS 5\n" in five and "#define EP_SUBSTEPS 9\n" in nine
    assert five.replace("EP_SUBSTEPS 5", "EP_SUBSTEPS 9") == nine
    assert "#define EP_BOUND 0" in five  # QIF's threshold is affine, but the bound needs the linear flow
    assert "static inline void epf_step(const scalar_t h" in five and "epf_adjoint_rate(" in five
    assert "void epf_threshold_gradient(" not in five and "void epf_jacobian(" not in five
    assert source(cuba, 5) == source(cuba, 9) and "EP_SUBSTEPS" not in source(cuba, 5).split("#include")[0]
    assert "#define EP_LINEAR 1" in source(cuba, 5)
    marker = "/* EventProp (Wunderlich & Pehle 2021)"
    loops = {s[s.index(marker):] for s in (five, source(adex_like, 3), source(cuba, 5))}
    assert len(loops) == 1


def test_too_many_substeps_for_the_c_kernels(monkeypatch):
    """A piece's substep states are kept on the stack: past `max_substeps` the source is refused, "auto" runs the
    torch reference and "c" warns that it does."""
    program = eventprop_layer._functions(continuous.qif)[0]
    assert max_substeps(program) == 8191  # 8192 doubles of substep states, one state
    with pytest.raises(flexgen.SpecError, match="take 1 to 8191 substeps .* got 8192"):
        flexgen.EventPropDense(2, 2, continuous.qif, steps=3, substeps=8192).source("c")
    with pytest.raises(flexgen.SpecError, match="got 0"):
        EVENTPROP.generate(program, EVENTPROP.options(0))
    monkeypatch.setattr(eventprop_c, "STACK_DOUBLES", 8)  # at most 7 substeps: the reference's runs stay short
    eventprop_layer._c_kernels.cache_clear()
    try:
        times = input_times(1, 2, 2, 2.0, seed=0)
        auto = flexgen.EventPropDense(2, 2, continuous.qif, dt=1.0, steps=3, substeps=8)
        auto(times)
        assert auto.last_run == ("torch", "substeps")
        say_once.cache_clear()
        forced = flexgen.EventPropDense(2, 2, continuous.qif, dt=1.0, steps=3, substeps=8, backend="c")
        with pytest.warns(UserWarning, match="at most 7 substeps for qif .* the layer has 8"):
            forced(times)
        assert forced.last_run == ("torch", "substeps")
        fewer = flexgen.EventPropDense(2, 2, continuous.qif, dt=1.0, steps=3, substeps=7, backend="c")
        fewer(times)
        assert fewer.last_run == ("c", "substeps")
    finally:
        eventprop_layer._c_kernels.cache_clear()  # no reason of the patched limit outlives the test


def test_bad_states_are_refused_by_the_c_kernels():
    times = torch.tensor([[[1.0]]], dtype=F64)
    above = flexgen.EventPropDense(1, 1, continuous.qif, dt=1.0, steps=4, backend="c", v_reset=1.5)
    with pytest.raises(ValueError, match="starts at or above its threshold"):  # v starts at v_reset
        above(times)
    @flexgen.ode(states=("v",), method="rk4")
    def stuck(u, v, tau=2.0, v_th=1.0):
        return flexgen.Dynamics({"v": (v * v + u) / tau}, threshold=v >= v_th, reset={"v": v - 0.1})

    layer = flexgen.EventPropDense(1, 1, stuck, dt=1.0, steps=4, backend="c")
    with torch.no_grad():
        layer.weight.fill_(10.0)
    with pytest.raises(ValueError, match="the threshold is still crossed"):
        layer(times)
