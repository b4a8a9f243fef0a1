"""Delays on the recurrent connections of EventProp layers (`flexgen.EventPropDense(..., recurrent=True,
recurrent_delays=...)`), fp64, tiny sizes: the gradients w.r.t. the recurrent delays, the recurrent and input
weights, a learnable time constant and the input times equal central finite differences where no spike appears or
vanishes (a nonlinear neuron by substeps too, and through a readout); zero delays give the undelayed layer (waves
included); a closed-form two-neuron case; an arrival past the window; the C kernels equal the reference to 1e-12;
the pending-arrival queue; bad input."""
import math

import pytest
import torch

import flexgen
from flexgen.launch import c_path
from flexgen.neurons import continuous
from flexgen.launch.eventprop_arrivals import ArrivalQueue
from flexgen.layers import eventprop_losses as losses

from test_eventprop_reference import check_gradients, cuba, input_times, lif, smooth_loss

F64 = torch.float64
NEEDS_C = pytest.mark.skipif(not c_path.available(), reason="no C compiler")
BACKENDS = ["torch", pytest.param("c", marks=NEEDS_C)]


def delayed_layer(kind, seed=2, delay=(0.5, 3.5), **options):
    if kind is not None:
        options.update(recurrent_delays=kind, max_delay=6.0)
    layer = flexgen.EventPropDense(3, 4, cuba, dt=1.0, steps=20, recurrent=True, learnable=("tau_m",), **options)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(layer.weight.shape, generator=gen, dtype=F64) + 1.0)
        layer.weight_rec.copy_(torch.rand(layer.weight_rec.shape, generator=gen, dtype=F64) * 2 - 1)
        if kind is not None:
            layer.delay_rec.copy_(torch.rand(layer.delay_rec.shape, generator=gen, dtype=F64)
                                  * (delay[1] - delay[0]) + delay[0])
    return layer


@pytest.mark.parametrize("kind, entries", [
    ("synapse", [(0, (0, 1)), (0, (2, 3)), (0, (1, 1)), (0, (3, 0)), (1, (1, 0)), (1, (2, 2)), (2, (0, 1)),
                 (3, (2,)), (4, (0, 1, 0)), (4, (1, 2, 1))]),
    ("axon", [(0, (0,)), (0, (1,)), (0, (2,)), (0, (3,)), (1, (3, 1)), (4, (1, 2, 1))]),
])
def test_gradients_equal_finite_differences(kind, entries):
    """CuBa LIF, 4 neurons coupled both ways through delays in [0.5, 3.5): every spike is N later events of its
    sample; a loss on all spike times and the recorded states (the torch reference; the C kernels equal it)."""
    layer = delayed_layer(kind, backend="torch")
    times = input_times(2, 3, 2, 12.0, seed=2).requires_grad_()

    def run():
        out = layer(times)
        return smooth_loss(out, 20.0), out.counts

    counts = run()[1]
    assert int(counts.min()) >= 1 and int(counts.sum()) >= 15
    assert bool((layer.weight_rec < 0).any()) and bool((layer.weight_rec > 0).any())
    tensors = [layer.delay_rec, layer.weight_rec, layer.weight, layer.tau_m, times]
    assert check_gradients(run, tensors, entries) == len(entries)
    assert layer.last_run.backend == "torch"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_delayed_recurrent_layer_into_a_readout(backend):
    """The readout's input-time errors reach the hidden spikes, and through their delayed arrivals earlier spikes
    and the delays: the gradients of the hidden layer's delays and weights equal central differences."""
    hidden = delayed_layer("synapse", seed=3, backend=backend)
    readout = flexgen.EventPropDense(4, 2, cuba, dt=1.0, steps=20, backend=backend)
    with torch.no_grad():
        readout.weight.copy_(torch.tensor([[2.0, 0.5, 1.5, 0.8], [0.4, 1.8, 0.6, 2.2]], dtype=F64))
    times = input_times(2, 3, 2, 10.0, seed=3)
    labels = torch.tensor([1, 0])

    def run():
        h = hidden(times)
        out = readout(h)
        loss = (losses.first_spike_cross_entropy(out.times, labels, no_spike_time=20.0, tau=2.0)
                + losses.max_voltage_cross_entropy(out.state("v"), labels))
        return loss, torch.cat([h.counts, out.counts], 1)

    assert int(run()[1][:, 4:].min()) >= 1  # every readout neuron fires
    entries = [(0, (0, 1)), (0, (2, 0)), (0, (3, 3)), (1, (1, 0)), (2, (2, 1))]
    tensors = [hidden.delay_rec, hidden.weight_rec, hidden.weight]
    assert check_gradients(run, tensors, entries) == len(entries)
    assert hidden.last_run.backend == backend


@pytest.mark.parametrize("backend", ["torch", pytest.param("c", marks=NEEDS_C)])
def test_a_nonlinear_neuron_by_substeps_of_its_method(backend):
    """QIF (RK4, 32 substeps per dt) on the torch reference and the C kernels: neuron 1's spike at 2.5 reaches
    neuron 0 1.3 later and carries it over there; the gradients agree with central differences to 1e-6 (the
    substeps' fourth order)."""
    layer = flexgen.EventPropDense(3, 2, continuous.qif, dt=1.0, steps=16, learnable=("tau",), substeps=32,
                                   recurrent=True, recurrent_delays="synapse", backend=backend)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.2, 0.9, 1.5], [1.0, 1.4, 0.8]], dtype=F64))
        layer.weight_rec.copy_(torch.tensor([[0.0, 0.4], [0.5, -0.2]], dtype=F64))
        layer.delay_rec.copy_(torch.tensor([[0.7, 1.3], [2.1, 0.9]], dtype=F64))
    times = torch.tensor([[[1.3, 6.1, 11.2], [2.5, 9.7, math.inf], [4.2, 13.1, 14.6]]], dtype=F64,
                         requires_grad=True)

    def run():
        out = layer(times)
        return smooth_loss(out, 16.0), out.counts

    out = layer(times)
    assert layer.last_run == (backend, "substeps") and out.times[0, 0, 0].item() == pytest.approx(3.8, abs=1e-12)
    entries = [(0, (0, 1)), (0, (1, 0)), (0, (1, 1)), (1, (1, 0)), (1, (0, 1)), (2, (0, 2)), (3, (1,)),
               (4, (0, 0, 0))]
    tensors = [layer.delay_rec, layer.weight_rec, layer.weight, layer.tau, times]
    assert check_gradients(run, tensors, entries) == len(entries)


def outputs_and_grads(layer, times):
    x = times.clone().requires_grad_()
    out = layer(x)
    smooth_loss(out, float(layer.sim.steps)).backward()
    grads = [x.grad, layer.weight.grad, layer.weight_rec.grad] + [getattr(layer, n).grad for n in ("tau_m", "tau")
                                                                   if isinstance(getattr(layer, n, None),
                                                                                 torch.nn.Parameter)]
    return out, grads


@pytest.mark.parametrize("kind", ["synapse", "axon"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_delays_give_the_undelayed_layer(kind, backend):
    """Against the undelayed recurrent layer, each on `backend`: spike times, states and gradients to 1e-12."""
    times = input_times(2, 3, 2, 12.0, seed=2)
    base = delayed_layer(None, backend=backend)
    layer = delayed_layer(kind, delay=(0.0, 0.0), backend=backend)
    assert not layer.delay_rec.any()
    (a, grads_a), (b, grads_b) = outputs_and_grads(base, times), outputs_and_grads(layer, times)
    assert base.last_run.backend == backend and layer.last_run.backend == backend
    assert torch.equal(a.counts, b.counts) and int(a.counts.sum()) >= 15
    for x, y in zip([a.times, a.trace] + grads_a, [b.times, b.trace] + grads_b):
        torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)
    assert layer.delay_rec.grad.abs().sum() > 0  # the delays learn from zero


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_delays_run_the_waves_of_one_time(backend):
    """Spikes carried over at one time (LIF: an input of weight w moves v by w / tau): neuron 0's input carries it
    over, its spike carries neuron 1 over, whose spike carries neuron 2 over against neuron 0's inhibition, as
    the undelayed layer's waves; then a delay of neuron 1's spike to neuron 2 moves neuron 2's spike by it."""
    results = []
    for kind in (None, "synapse"):
        layer = flexgen.EventPropDense(1, 3, lif, dt=1.0, steps=8, recurrent=True, learnable=("tau",), tau=4.0,
                                       recurrent_delays=kind, backend=backend)
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([[8.0], [0.0], [1.0]], dtype=F64))
            layer.weight_rec.copy_(torch.tensor([[0.0, 0.0, 0.0], [6.0, 2.0, 0.0], [-4.0, 10.0, 0.0]], dtype=F64))
        out, grads = outputs_and_grads(layer, torch.tensor([[[2.5]]], dtype=F64))
        assert out.counts.tolist() == [[1, 1, 1]] and out.times.flatten().tolist() == [2.5] * 3
        results.append([out.trace] + grads)
    for x, y in zip(*results):
        torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        layer.delay_rec[2, 1] = 1.25  # neuron 2 now sees neuron 0's inhibition 1.25 before neuron 1's spike
        layer.weight_rec[2, 0] = -1.0
    out = layer(torch.tensor([[[2.5]]], dtype=F64))
    assert out.times.flatten().tolist() == [2.5, 2.5, 3.75]


@pytest.mark.parametrize("kind", ["synapse", "axon"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_delayed_spike_drives_another_neuron_at_the_closed_form_time(kind, backend):
    """CuBa LIF: an input spike of weight w0 at t0 makes neuron 0 fire at t1 = t0 + s(w0); its spike of weight
    w1 reaches neuron 1 at t1 + d, which fires at t2 = t1 + d + s(w1), s(w) the first root of
    w tau_s / (tau_s - tau_m) (exp(-s / tau_s) - exp(-s / tau_m)) = 1. dt2/dd = dt2/dt0 = 1, and a delay that
    takes the arrival past the end of the window leaves neuron 1 silent, with no gradient."""
    tau_m, tau_s, w0, w1, t0, d = 10.0, 5.0, 6.0, 5.0, 1.25, 2.75
    layer = flexgen.EventPropDense(1, 2, cuba, dt=1.0, steps=30, recurrent=True, recurrent_delays=kind,
                                   backend=backend)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[w0], [0.0]], dtype=F64))
        layer.weight_rec.copy_(torch.tensor([[0.0, 0.0], [w1, 0.0]], dtype=F64))
        layer.delay_rec.fill_(d)
    times = torch.tensor([[[t0]]], dtype=F64, requires_grad=True)
    out = layer(times)
    assert out.counts.tolist() == [[1, 1]]

    def s(w):
        lo, hi = 0.0, tau_m * tau_s / (tau_m - tau_s) * math.log(tau_m / tau_s)  # v rises until its maximum
        for _ in range(200):
            mid = (lo + hi) / 2
            value = w * tau_s / (tau_s - tau_m) * (math.exp(-mid / tau_s) - math.exp(-mid / tau_m)) - 1.0
            lo, hi = (mid, hi) if value < 0 else (lo, mid)
        return hi

    t1 = t0 + s(w0)
    assert out.times[0, 0, 0].item() == pytest.approx(t1, rel=1e-14, abs=1e-13)
    assert out.times[0, 1, 0].item() == pytest.approx(t1 + d + s(w1), rel=1e-14, abs=1e-13)
    out.times[0, 1, 0].backward()
    along = layer.delay_rec.grad[1, 0] if kind == "synapse" else layer.delay_rec.grad[0]
    assert along.item() == pytest.approx(1.0, rel=1e-12) and times.grad.item() == pytest.approx(1.0, rel=1e-12)
    assert layer.delay_rec.grad.abs().sum().item() == pytest.approx(1.0, rel=1e-12)  # the other delays: no effect
    with torch.no_grad():
        layer.delay_rec.fill_(30.25 - t1)  # the arrival falls past the end of the window: it does nothing
    layer.delay_rec.grad = None
    out = layer(times)
    assert out.counts.tolist() == [[1, 0]]
    (out.times[0, 0, 0] + out.trace.sum()).backward()
    assert not layer.delay_rec.grad.any() and layer.last_run.backend == backend


@NEEDS_C
@pytest.mark.parametrize("spec, kind, weight_rec, options", [
    (cuba, "synapse", (-1.0, 1.0), {"learnable": ("tau_m", "tau_s")}),
    (cuba, "axon", (-1.0, 1.0), {}),  # no parameter trained: the C backward skips their integrals
    (lif, "synapse", (-2.0, 1.5), {"learnable": ("tau",)}),  # spikes at input events and carried over
    (continuous.alif, "synapse", (-0.3, 0.6), {"learnable": ("tau", "beta"), "tau": 2.0, "tau_a": 5.0}),
], ids=["cuba", "cuba-axon-fixed-parameters", "lif", "alif"])
def test_the_c_kernels_equal_the_reference(spec, kind, weight_rec, options):
    """Spike times, counts, states and every gradient (input times, weights, recurrent weights and delays,
    parameters) on both backends, with input axonal delays too, to 1e-12."""
    times = input_times(2, 3, 3, 15.0, seed=7)
    results = []
    for backend in ("c", "torch"):
        layer = flexgen.EventPropDense(3, 4, spec, dt=1.0, steps=20, recurrent=True, recurrent_delays=kind,
                                       delays="axon", max_delay=5.0, backend=backend, **options)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            layer.weight.copy_(torch.rand(layer.weight.shape, generator=gen, dtype=F64) * 3 + 0.5)
            layer.weight_rec.copy_(torch.rand(layer.weight_rec.shape, generator=gen, dtype=F64)
                                   * (weight_rec[1] - weight_rec[0]) + weight_rec[0])
            layer.delay_rec.copy_(torch.rand(layer.delay_rec.shape, generator=gen, dtype=F64) * 4)
            layer.delay.copy_(torch.rand(layer.delay.shape, generator=gen, dtype=F64) * 2)
        x = times.clone().requires_grad_()
        out = layer(x)
        smooth_loss(out, 20.0).backward()
        assert layer.last_run.backend == backend
        results.append(([out.counts, out.times, out.trace], [x.grad] + [p.grad for p in layer.parameters()]))
    (outs_c, grads_c), (outs_t, grads_t) = results
    assert torch.equal(outs_c[0], outs_t[0]) and int(outs_c[0].sum()) >= 10
    for a, b in zip(outs_c[1:] + grads_c, outs_t[1:] + grads_t):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@NEEDS_C
def test_the_c_kernels_grow_their_spike_buffers():
    layer = flexgen.EventPropDense(1, 2, lif, dt=1.0, steps=10, recurrent=True, recurrent_delays="synapse",
                                   spike_capacity=1, backend="c")
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[5.0], [0.0]], dtype=F64))
        layer.weight_rec.copy_(torch.tensor([[0.0, 0.0], [4.0, 0.0]], dtype=F64))
        layer.delay_rec[1, 0] = 0.25
    out = layer(torch.tensor([[[0.5, 1.0, 1.5, 2.0, 2.5]]], dtype=F64))
    assert out.counts.tolist() == [[5, 5]] and torch.equal(out.times[0, 0] + 0.25, out.times[0, 1])


def test_the_queue_hands_out_arrivals_in_time_order():
    queue = ArrivalQueue(end=10.0, device="cpu")
    queue.send(torch.tensor([3.0, 12.0, 1.5], dtype=F64), source=1, slot=0)
    queue.send(torch.tensor([1.5, 10.0, 2.0], dtype=F64), source=2, slot=4)
    assert len(queue) == 4 and queue.next_time() == 1.5  # those at or after the end are not queued
    first = queue.pop(1.5)
    assert first.target.tolist() == [2, 0] and first.source.tolist() == [1, 2] and first.slot.tolist() == [0, 4]
    assert [queue.pop(queue.next_time()).target.tolist() for _ in range(2)] == [[2], [0]]
    assert queue.next_time() == math.inf
    with pytest.raises(ValueError, match="no arrival at t = 3.0"):
        queue.pop(3.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_neuron_carried_over_again_at_the_time_it_fired_is_refused(backend):
    layer = flexgen.EventPropDense(1, 2, lif, dt=1.0, steps=5, recurrent=True, recurrent_delays="synapse",
                                   backend=backend)
    with torch.no_grad():
        layer.weight.fill_(8.0)
        layer.weight_rec.copy_(torch.tensor([[0.0, 4.5], [0.0, 0.0]], dtype=F64))
    where = r"neuron 0 \(sample 0\) over its threshold again at t = 1," if backend == "torch" else "a neuron over"
    with pytest.raises(ValueError, match=f"carries {where}"):
        layer(torch.tensor([[[1.0]]], dtype=F64))


def test_bad_options_and_delays_are_refused():
    with pytest.raises(ValueError, match="recurrent_delays needs recurrent=True"):
        flexgen.EventPropDense(2, 3, cuba, recurrent_delays="synapse")
    with pytest.raises(ValueError, match="recurrent_delays must be None, 'axon' or 'synapse', got 'soma'"):
        flexgen.EventPropDense(2, 3, cuba, recurrent=True, recurrent_delays="soma")
    layer = flexgen.EventPropDense(2, 3, cuba, steps=10, recurrent=True, recurrent_delays="synapse", max_delay=4.0)
    assert layer.delay_rec.shape == (3, 3) and not layer.delay_rec.any()
    assert "recurrent_delays='synapse', max_delay=4" in repr(layer)
    both = flexgen.EventPropDense(2, 3, cuba, steps=10, delays="axon", recurrent=True, recurrent_delays="axon")
    assert both.delay_rec.shape == (3,) and both.max_delay == 10.0  # the window by default, for both
    times = torch.tensor([[[1.0], [2.0]]], dtype=F64)
    for bad, message in [(torch.zeros(3, dtype=F64), r"a torch.float64 delay_rec of shape \[3, 3\], got .*\[3\]"),
                         (torch.zeros(3, 3), r"delay_rec .* got torch.float32"),
                         (torch.full((3, 3), -0.5, dtype=F64), r"recurrent delays must lie in \[0, max_delay = 4\]"),
                         (torch.full((3, 3), 4.5, dtype=F64), r"recurrent delays must lie in \[0, max_delay = 4\]"),
                         (torch.full((3, 3), math.nan, dtype=F64), "recurrent delays must lie in")]:
        layer.delay_rec = torch.nn.Parameter(bad)
        with pytest.raises(ValueError, match=message):
            layer(times)
    layer.delay_rec = torch.nn.Parameter(torch.tensor([[-1.0, 2.0, 5.0]] * 3, dtype=F64))
    assert layer.clamp_delays_() is layer and layer.delay_rec[0].tolist() == [0.0, 2.0, 4.0]
    layer(times)
    for sim in (layer.sim, layer._c_sim):  # the simulators check their delays too
        if sim is not None:
            with pytest.raises(ValueError, match="recurrent delays must be finite and >= 0"):
                sim.forward(times, layer.weight.detach(), [getattr(layer, n).expand(3) for n in layer.parameter_names],
                            layer.weight_rec.detach(), -layer.delay_rec.detach() - 1)


@pytest.mark.gpu
def test_cuda_tensors_equal_the_cpu():
    times = input_times(2, 3, 2, 12.0, seed=2)
    results = []
    for device in ("cpu", "cuda"):
        layer = delayed_layer("synapse").to(device)
        out, grads = outputs_and_grads(layer, times.to(device))
        assert int(out.counts.sum()) > 0
        results.append([t.cpu() for t in [out.times, out.trace, layer.delay_rec.grad] + grads])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
