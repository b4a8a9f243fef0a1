"""The EventProp C kernels (`flexgen.kinds.eventprop`, EventPropDense(backend="c")) against the torch reference
(backend="torch"), fp64, tiny sizes: the same spike times, grid states and every gradient to 1e-12, for LIF, CuBa
LIF and an adaptive LIF, a two-layer network and spike buffers that grow; the backend choice and bad inputs; the
generated source (neurons nonlinear between events: test_eventprop_c_nonlinear.py)."""
import math
import re

import pytest
import torch

import flexgen
from flexgen.launch import c_path
from flexgen.launch.backends import say_once
from flexgen.layers import eventprop as eventprop_layer
from flexgen.neurons import continuous

from test_eventprop_reference import adaptive, cuba, input_times, lif, smooth_loss

pytestmark = pytest.mark.skipif(not c_path.available(), reason="no C compiler")
F64 = torch.float64
CASES = [(lif, ("tau", "v_th")), (cuba, ("tau_m", "tau_s", "v_th")),
         (adaptive, ("tau_m", "tau_s", "tau_a", "v_th", "beta"))]


def same(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def layers(spec, learnable, sizes, capacity=8, steps=20, scale=1.5):
    """One network per backend ("c", "torch") with the same weights."""
    nets = {}
    for backend in ("c", "torch"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[
            flexgen.EventPropDense(a, b, spec, dt=1.0, steps=steps, learnable=learnable, spike_capacity=capacity,
                                   backend=backend) for a, b in zip(sizes, sizes[1:])])
        with torch.no_grad():
            for layer in net:
                layer.weight.uniform_(0.0, scale if layer is net[0] else 2.5)
        nets[backend] = net
    return nets


def run(net, times):
    times = times.clone().requires_grad_()
    out = net(times)
    smooth_loss(out, 20.0).backward()
    return out, times.grad


def check_same(nets, times):
    (out_c, grad_c), (out_t, grad_t) = run(nets["c"], times), run(nets["torch"], times)
    assert all(layer.last_run == ("c", "exact") for layer in nets["c"])
    assert all(layer.last_run == ("torch", "exact") for layer in nets["torch"])
    assert torch.equal(out_c.counts, out_t.counts) and int(out_c.counts.sum()) > 0
    assert out_c.times.shape == out_t.times.shape
    same(out_c.times, out_t.times)
    same(out_c.trace, out_t.trace)
    same(grad_c, grad_t)
    for (name, p_c), (_, p_t) in zip(nets["c"].named_parameters(), nets["torch"].named_parameters()):
        assert p_t.grad is not None and p_t.grad.abs().max() > 0 or name.endswith("v_th"), name
        same(p_c.grad, p_t.grad)
    return out_c


@pytest.mark.parametrize("spec, learnable", CASES, ids=[s.name for s, _ in CASES])
def test_the_c_kernels_equal_the_torch_reference(spec, learnable):
    check_same(layers(spec, learnable, (5, 4)), input_times(3, 5, 4, 15.0, seed=1))


def test_a_two_layer_network():
    out = check_same(layers(cuba, ("tau_m", "v_th"), (6, 5, 3)), input_times(2, 6, 4, 15.0, seed=2))
    assert int(out.counts.sum()) > 0  # the second layer fires too


def test_the_spike_buffer_grows_past_its_first_capacity():
    nets = layers(cuba, ("tau_m",), (5, 4), capacity=1)
    times = input_times(2, 5, 6, 18.0, seed=3)
    out = check_same(nets, times)
    assert int(out.counts.max()) > 2  # twice past the one slot: no spike dropped
    assert out.times.shape[-1] == int(out.counts.max())
    assert nets["c"][0]._c_sim.capacity == 1  # the layer's setting stays; the call grew its own buffer
    assert nets["c"][0]._c_sim.capacity_used >= int(out.counts.max())


def test_a_float32_layer_runs_the_float64_kernels():
    outs = {}
    for backend in ("c", "torch"):
        torch.manual_seed(0)
        layer = flexgen.EventPropDense(4, 3, cuba, dt=1.0, steps=12, backend=backend, dtype=torch.float32)
        with torch.no_grad():
            layer.weight.uniform_(0.0, 1.5)
        times = input_times(2, 4, 3, 10.0, seed=4).float().requires_grad_()
        out = layer(times)
        out.times.nan_to_num(posinf=0.0).sum().backward()
        outs[backend] = (out, times.grad, layer.weight.grad)
    (out_c, *grads_c), (out_t, *grads_t) = outs["c"], outs["torch"]
    assert out_c.times.dtype == torch.float32 and grads_c[1].dtype == torch.float32
    assert torch.equal(out_c.counts, out_t.counts) and int(out_c.counts.sum()) > 0
    for a, b in [(out_c.times, out_t.times), (out_c.trace, out_t.trace), *zip(grads_c, grads_t)]:
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the reference computes in float32


def test_events_at_grid_times_and_at_one_time():
    times = torch.tensor([[[1.0, 3.0, 3.0], [3.0, 5.0, math.inf]], [[0.0, 2.5, 20.0], [7.0, 7.0, 7.0]]], dtype=F64)
    check_same(layers(lif, ("tau",), (2, 3), scale=6.0), times)  # an event at t = 0 and one at the window's end, too


def test_auto_takes_the_c_kernels_on_the_cpu_for_linear_and_nonlinear_neurons():
    layer = flexgen.EventPropDense(3, 2, cuba, dt=1.0, steps=5)
    assert layer.last_run is None
    layer(input_times(1, 3, 2, 4.0, seed=0))
    assert layer.last_run == ("c", "exact")
    qif = flexgen.EventPropDense(3, 2, continuous.qif, dt=1.0, steps=5)  # test_eventprop_c_nonlinear.py: more
    qif(input_times(1, 3, 2, 4.0, seed=0))
    assert qif.last_run == ("c", "substeps")


def test_without_a_compiler_auto_runs_the_reference_with_one_warning(monkeypatch):
    @flexgen.ode(states=("v",), method="exact")
    def uncompiled(u, v, tau=4.0, v_th=1.0):
        return flexgen.Dynamics({"v": (-v + u) / tau}, threshold=v >= v_th, reset={"v": 0.0})

    def refuse(source):
        raise c_path.CompilerError("no C compiler found ($CC, cc or gcc)")

    monkeypatch.setattr(c_path, "load", refuse)
    say_once.cache_clear()
    layer = flexgen.EventPropDense(3, 2, uncompiled, dt=1.0, steps=5)
    with pytest.warns(UserWarning, match="not the faster C kernels"):
        layer(input_times(1, 3, 2, 4.0, seed=0))
    assert layer.last_run == ("torch", "exact")


def test_bad_inputs():
    with pytest.raises(ValueError, match="backend must be 'auto', 'c', 'triton' or 'torch'"):
        flexgen.EventPropDense(2, 2, cuba, backend="cuda")
    layer = flexgen.EventPropDense(2, 2, cuba, dt=1.0, steps=5, backend="c", v_th=-1.0)
    with pytest.raises(ValueError, match="starts at or above its threshold"):
        layer(input_times(1, 2, 2, 4.0, seed=0))

    @flexgen.ode(states=("v",), method="exact")
    def stuck(u, v, tau=4.0, v_th=1.0):
        return flexgen.Dynamics({"v": (-v + u) / tau}, threshold=v >= v_th, reset={"v": 2.0})

    layer = flexgen.EventPropDense(1, 1, stuck, dt=1.0, steps=5, backend="c")
    with torch.no_grad():
        layer.weight.fill_(20.0)
    with pytest.raises(ValueError, match="the threshold is still crossed"):
        layer(torch.tensor([[[1.0]]], dtype=F64))
    with pytest.raises(ValueError, match="must be 'c', 'triton' or 'torch'"):
        layer.source("cuda")


@pytest.mark.gpu
def test_cuda_tensors_run_the_triton_kernels_or_the_torch_reference():
    layer = flexgen.EventPropDense(3, 2, cuba, dt=1.0, steps=5).cuda()
    layer(input_times(1, 3, 2, 4.0, seed=0).cuda())
    assert layer.last_run == ("triton", "exact")
    recurrent = flexgen.EventPropDense(3, 2, cuba, dt=1.0, steps=5, recurrent=True).cuda()
    recurrent(input_times(1, 3, 2, 4.0, seed=0).cuda())
    assert recurrent.last_run == ("triton", "exact")
    delayed = flexgen.EventPropDense(3, 2, cuba, dt=1.0, steps=5, recurrent=True, recurrent_delays="axon").cuda()
    with pytest.warns(UserWarning, match="torch reference"):
        delayed(input_times(1, 3, 2, 4.0, seed=0).cuda())
    assert delayed.last_run == ("torch", "exact")
    forced = flexgen.EventPropDense(3, 2, cuba, dt=1.0, steps=5, backend="c").cuda()
    with pytest.raises(RuntimeError, match="backend='c' runs on CPU tensors"):
        forced(input_times(1, 3, 2, 4.0, seed=0).cuda())


def test_the_generated_source_prints_the_equations_and_holds_no_neuron_specific_branch():
    sources = {spec.name: flexgen.EventPropDense(2, 2, spec, steps=3).source("c") for spec, _ in CASES}
    cuba_source = sources["cuba"]
    assert "static inline void epf_flow(const scalar_t h" in cuba_source
    assert "exp(-h/tau_m)" in cuba_source and "ep_out0[0] = v - v_th;" in cuba_source
    marker = "/* EventProp (Wunderlich & Pehle 2021)"
    loops = {name: source[source.index(marker):] for name, source in sources.items()}
    assert len(set(loops.values())) == 1  # the event loop and the adjoint sweep: the same text for every neuron
    names = {"v", "i", "a", "tau", "tau_m", "tau_s", "tau_a", "v_th", "beta", "lif", "cuba", "adaptive"}
    code = re.sub(r"/\*.*?\*/", " ", loops["cuba"], flags=re.S)  # the code, not its comments
    words = set(re.findall(r"\b\w+\b", code))
    assert not names & words


@flexgen.ode(states=("v", "i"), method="exact")
def curved(u, v, i, tau_m=10.0, tau_s=5.0, v_th=1.0):
    """A threshold not affine in the states: the root search has no bound to skip pieces with."""
    return flexgen.Dynamics({"v": (i - v) / tau_m, "i": -i / tau_s + u}, threshold=v + 0.5 * v * v >= v_th,
                            reset={"v": 0.0})


@pytest.mark.parametrize("spec", [cuba, curved], ids=["affine-threshold", "curved-threshold"])
def test_without_learnable_parameters_the_gradients_equal_the_reference(spec):
    """No parameter trained: the C backward skips the parameter integrals; the weight and time gradients stay."""
    nets = layers(spec, (), (5, 4), steps=25)
    (out_c, grad_c), (out_t, grad_t) = run(nets["c"], input_times(3, 5, 5, 20.0, seed=5)), \
        run(nets["torch"], input_times(3, 5, 5, 20.0, seed=5))
    assert torch.equal(out_c.counts, out_t.counts) and int(out_c.counts.sum()) > 3
    same(out_c.times, out_t.times)
    same(out_c.trace, out_t.trace)
    same(grad_c, grad_t)
    same(nets["c"][0].weight.grad, nets["torch"][0].weight.grad)
    assert [n for n, _ in nets["c"].named_parameters()] == ["0.weight"]


def test_the_root_search_bound_is_printed_where_the_threshold_is_affine():
    from flexgen.render.eventprop_c import threshold_gradient

    program = eventprop_layer._functions(adaptive)[0]
    gradient = threshold_gradient(program)  # g = v - v_th - beta a: dg/d(v, i, a) = (1, 0, -beta)
    assert [str(s) for s in program.states] == ["v", "i", "a"]
    assert [str(e) for e in gradient.returns[0]] == ["1", "0", "-beta"]
    assert threshold_gradient(eventprop_layer._functions(curved)[0]) is None
    source = {spec.name: flexgen.EventPropDense(2, 2, spec, steps=3).source("c") for spec in (adaptive, curved)}
    printed = "static inline void epf_threshold_gradient("
    assert "#define EP_BOUND 1" in source["adaptive"] and printed in source["adaptive"]
    assert "#define EP_BOUND 0" in source["curved"] and printed not in source["curved"]


@pytest.mark.parametrize("peak", [1.0 - 1e-6, 1.0 + 1e-4, 1.0 + 1e-2])
def test_a_peak_just_below_or_above_the_threshold(peak):
    """One input spike of weight w drives v to w / 4 at 10 ln 2 after it (tau_m 10, tau_s 5): where the peak grazes
    the threshold the bound cannot rule a crossing out, and the C kernels must search the piece as the reference
    does (a skip there would lose the spike)."""
    outs = {}
    for backend in ("c", "torch"):
        layer = flexgen.EventPropDense(1, 1, cuba, dt=1.0, steps=12, backend=backend)
        with torch.no_grad():
            layer.weight.fill_(4.0 * peak)
        times = torch.tensor([[[0.5]]], dtype=F64, requires_grad=True)
        out = layer(times)
        (out.times.nan_to_num(posinf=0.0).sum() + out.state("v").sum()).backward()
        outs[backend] = (out, times.grad, layer.weight.grad)
    (out_c, *grads_c), (out_t, *grads_t) = outs["c"], outs["torch"]
    assert out_c.counts.tolist() == out_t.counts.tolist() == [[int(peak > 1.0)]]
    if peak > 1.0:  # the first crossing lies before the peak at 0.5 + 10 ln 2
        assert 0.5 + 10 * math.log(2) - 1.5 < out_c.times[0, 0, 0].item() < 0.5 + 10 * math.log(2)
    for a, b in [(out_c.times, out_t.times), (out_c.trace, out_t.trace), *zip(grads_c, grads_t)]:
        same(a, b)
