"""Recurrent EventProp layers (`flexgen.EventPropDense(..., recurrent=True)`), fp64, tiny sizes, on the torch
reference, the C kernels and the Triton kernels (in Triton's interpreter on the CPU; both equal the reference to
1e-12): the gradients of smooth losses w.r.t. the input weight,
the recurrent weight, learnable neuron parameters, axonal delays and input times equal central finite differences
where no spike appears or vanishes; a zero recurrent weight gives the feed-forward layer; hand-checkable cases (a
spike that drives another neuron over its threshold later, at the closed form's time, and spikes that carry
others over at one time, in waves); bad options."""
import math

import pytest
import torch

import flexgen
from flexgen.launch import c_path, eventprop_triton_recurrent
from flexgen.launch.backends import interpreter_on
from flexgen.layers import eventprop_losses as losses
from flexgen.neurons import continuous

from test_eventprop_reference import check_gradients, cuba, input_times, lif, smooth_loss

F64 = torch.float64
NEEDS_C = pytest.mark.skipif(not c_path.available(), reason="no C compiler")
NEEDS_INTERPRETER = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1 for CPU tensors")
BACKENDS = ["torch", pytest.param("c", marks=NEEDS_C)]
CASCADES = BACKENDS + [pytest.param("triton", marks=NEEDS_INTERPRETER)]  # (the interpreter is slow: fewer tests)


def recurrent_layer(spec, sizes, weight, weight_rec, steps=20, seed=0, **options):
    layer = flexgen.EventPropDense(*sizes, spec, dt=1.0, steps=steps, recurrent=True, **options)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param, bounds in ((layer.weight, weight), (layer.weight_rec, weight_rec)):
            param.copy_(torch.rand(param.shape, generator=gen, dtype=F64) * (bounds[1] - bounds[0]) + bounds[0])
    return layer


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_equal_finite_differences(backend):
    """CuBa LIF, 4 neurons coupled both ways (excitatory and inhibitory), a learnable time constant and axonal
    delays: spikes between events, each an event for every neuron of its sample."""
    layer = recurrent_layer(cuba, (3, 4), (1.0, 2.0), (-1.0, 1.0), seed=2, learnable=("tau_m",), delays="axon",
                            backend=backend)
    with torch.no_grad():
        layer.delay.copy_(torch.tensor([0.5, 1.75, 0.0], dtype=F64))
    times = input_times(2, 3, 2, 12.0, seed=2).requires_grad_()

    def run():
        out = layer(times)
        return smooth_loss(out, 20.0), out.counts

    counts = run()[1]
    assert int(counts.min()) >= 1 and int(counts.sum()) <= 30  # every neuron fires, a few times
    assert bool((layer.weight_rec < 0).any())  # inhibitory and excitatory
    entries = [(0, (0, 1)), (0, (3, 2)), (1, (0, 1)), (1, (2, 3)), (1, (3, 0)), (1, (1, 1)), (2, (2,)),
               (3, (1,)), (4, (0, 1, 0)), (4, (1, 2, 1))]
    tensors = [layer.weight, layer.weight_rec, layer.tau_m, layer.delay, times]
    assert check_gradients(run, tensors, entries) == len(entries)
    assert layer.last_run.backend == backend


def test_first_spike_and_voltage_losses_through_two_layers():
    """A recurrent hidden layer into a feed-forward readout: the readout's input-time errors reach the hidden
    spikes, whose adjoint jumps send them on through the recurrent weight."""
    hidden = recurrent_layer(cuba, (3, 4), (1.5, 3.0), (-0.5, 1.5), seed=2)
    readout = flexgen.EventPropDense(4, 2, cuba, dt=1.0, steps=20)
    with torch.no_grad():
        readout.weight.copy_(torch.tensor([[2.0, 0.5, 1.5, 0.8], [0.4, 1.8, 0.6, 2.2]], dtype=F64))
    times = input_times(2, 3, 2, 10.0, seed=2)
    labels = torch.tensor([1, 0])

    def run():
        h = hidden(times)
        out = readout(h)
        loss = (losses.first_spike_cross_entropy(out.times, labels, no_spike_time=20.0, tau=2.0)
                + losses.max_voltage_cross_entropy(out.state("v"), labels)
                + 0.1 * losses.voltage_sum_cross_entropy(h.state("v")[..., :2], labels, dt=1.0, tau=10.0))
        return loss, torch.cat([h.counts, out.counts], 1)

    assert int(run()[1][:, 4:].min()) >= 1  # every readout neuron fires
    entries = [(0, (0, 1)), (0, (2, 3)), (0, (3, 3)), (1, (1, 0)), (2, (1, 2))]
    assert check_gradients(run, [hidden.weight_rec, hidden.weight, readout.weight], entries) == len(entries)


@pytest.mark.parametrize("backend", CASCADES)
def test_spikes_that_carry_others_over_at_one_time(backend):
    """LIF (an input spike of weight w moves v by w / tau): wave by wave at one time. Neuron 0's input carries it
    over (wave 0); its spike carries neuron 1 over (wave 1), whose spike carries neuron 2 over (wave 2) against
    neuron 0's inhibition; neuron 1's self-connection acts after its own reset. Gradients through the cascade
    equal central differences."""
    tau = 4.0
    layer = flexgen.EventPropDense(1, 3, lif, dt=1.0, steps=8, recurrent=True, learnable=("tau",), tau=tau,
                                   backend=backend)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[8.0], [0.0], [1.0]], dtype=F64))
        layer.weight_rec.copy_(torch.tensor([[0.0, 0.0, 0.0], [6.0, 2.0, 0.0], [-4.0, 10.0, 0.0]], dtype=F64))
    t0 = 2.5
    times = torch.tensor([[[t0]]], dtype=F64, requires_grad=True)
    out = layer(times)
    assert out.counts.tolist() == [[1, 1, 1]] and out.times.flatten().tolist() == [t0] * 3
    v = out.state("v")[:, 0]
    after = torch.tensor([0.0, 2.0 / tau, 0.0], dtype=F64)  # neuron 1: its self-connection, after its reset
    for n in range(3, 8):
        torch.testing.assert_close(v[n], after * math.exp(-(n + 1 - t0) / tau), rtol=1e-14, atol=0)
    assert not v[:2].any()  # before the input

    def run():
        out = layer(times)
        return smooth_loss(out, 8.0), out.counts

    entries = [(0, (0, 0)), (1, (1, 1)), (1, (2, 1)), (1, (1, 0)), (2, (0,)), (2, (1,)), (3, (0, 0, 0))]
    assert check_gradients(run, [layer.weight, layer.weight_rec, layer.tau, times], entries) == len(entries)
    times.grad = None
    layer(times).times.sum().backward()
    assert times.grad.item() == pytest.approx(3.0, rel=1e-14)  # the three spike times are the input's


@pytest.mark.parametrize("backend", CASCADES)
def test_a_spike_drives_another_neuron_over_its_threshold_at_the_closed_form_time(backend):
    """CuBa LIF: one input spike of weight w0 at t0 into neuron 0, which fires at t1 = t0 + s(w0); its spike, of
    recurrent weight w1, drives neuron 1 (no input of its own) over the threshold at t1 + s(w1), where s(w) is the
    first root of w tau_s / (tau_s - tau_m) (exp(-s / tau_s) - exp(-s / tau_m)) = 1 (bisection, to rounding)."""
    tau_m, tau_s, w0, w1, t0 = 10.0, 5.0, 6.0, 5.0, 1.25
    layer = flexgen.EventPropDense(1, 2, cuba, dt=1.0, steps=30, recurrent=True, backend=backend)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[w0], [0.0]], dtype=F64))
        layer.weight_rec.copy_(torch.tensor([[0.0, 0.0], [w1, 0.0]], dtype=F64))
    out = layer(torch.tensor([[[t0]]], dtype=F64))
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
    assert out.times[0, 1, 0].item() == pytest.approx(t1 + s(w1), rel=1e-14, abs=1e-13)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_recurrent_weight_gives_the_feed_forward_layer(backend):
    times = input_times(2, 3, 3, 15.0, seed=3)
    results = []
    for recurrent in (False, True):
        layer = flexgen.EventPropDense(3, 4, cuba, dt=1.0, steps=20, learnable=("tau_s",), backend=backend,
                                       recurrent=recurrent)
        with torch.no_grad():
            layer.weight.uniform_(1.0, 4.0, generator=torch.Generator().manual_seed(3))
            if recurrent:
                layer.weight_rec.zero_()
        x = times.clone().requires_grad_()
        out = layer(x)
        smooth_loss(out, 20.0).backward()
        results.append((out, [x.grad, layer.weight.grad, layer.tau_s.grad]))
    (a, grads_a), (b, grads_b) = results
    assert torch.equal(a.counts, b.counts) and int(a.counts.sum()) > 0
    torch.testing.assert_close(b.times, a.times, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.trace, a.trace, rtol=1e-12, atol=1e-12)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, rtol=1e-12, atol=1e-12)
    assert layer.weight_rec.grad.abs().sum() > 0  # the recurrent weight still learns from zero


@pytest.mark.parametrize("backend", CASCADES)
def test_a_neuron_carried_over_again_at_the_time_it_fired_is_refused(backend):
    layer = flexgen.EventPropDense(1, 2, lif, dt=1.0, steps=5, recurrent=True, backend=backend)
    with torch.no_grad():
        layer.weight.fill_(8.0)
        layer.weight_rec.copy_(torch.tensor([[0.0, 4.5], [0.0, 0.0]], dtype=F64))
    where = "neuron 0 .sample 0. " if backend == "torch" else "a neuron "  # (the kernels name no neuron)
    with pytest.raises(ValueError, match=f"carries {where}over its threshold again at t"):
        layer(torch.tensor([[[1.0]]], dtype=F64))


def test_bad_options_and_recurrent_weights_are_refused():
    with pytest.raises(ValueError, match="recurrent must be True or False"):
        flexgen.EventPropDense(2, 3, cuba, recurrent="yes")
    with pytest.raises(ValueError, match="recurrent=True takes delays=None or 'axon'"):
        flexgen.EventPropDense(2, 3, cuba, recurrent=True, delays="synapse")
    layer = flexgen.EventPropDense(2, 3, cuba, recurrent=True)
    assert layer.weight_rec.shape == (3, 3) and "recurrent=True" in repr(layer)
    times = torch.tensor([[[1.0], [2.0]]], dtype=F64)
    layer(times)
    for bad, message in [(torch.zeros(3, 2, dtype=F64), r"weight_rec of shape \[3, 3\], got torch.float64 \[3, 2\]"),
                         (torch.zeros(3, 3), r"torch.float64 weight_rec .* got torch.float32"),
                         (torch.full((3, 3), math.nan, dtype=F64), "NaN or inf")]:
        layer.weight_rec = torch.nn.Parameter(bad)
        with pytest.raises(ValueError, match=message):
            layer(times)


def run_both(spec, sizes, weight, weight_rec, times, steps=20, backends=("c", "torch"), **options):
    """Spike times, counts, trace and every gradient of a smooth loss, on the kernels and the reference."""
    results = []
    for backend in backends:
        layer = recurrent_layer(spec, sizes, weight, weight_rec, steps=steps, backend=backend, **options)
        x = times.clone().requires_grad_()
        out = layer(x)
        smooth_loss(out, float(steps)).backward()
        assert layer.last_run.backend == backend
        results.append(([out.times, out.counts, out.trace], [x.grad] + [p.grad for p in layer.parameters()]))
    return results


@NEEDS_C
@pytest.mark.parametrize("spec, sizes, weight, weight_rec, options", [
    (cuba, (3, 4), (1.0, 2.0), (-1.0, 1.0), {"learnable": ("tau_m", "tau_s")}),
    (cuba, (3, 4), (1.0, 2.0), (-1.0, 1.0), {}),  # no parameter trained: the C backward skips their integrals
    (lif, (2, 5), (1.0, 6.0), (-2.0, 1.5), {"learnable": ("tau",)}),  # spikes at input events and carried over
    (continuous.alif, (3, 4), (0.5, 1.8), (-0.3, 0.6), {"learnable": ("tau", "beta"), "tau": 2.0, "tau_a": 5.0}),
], ids=["cuba", "cuba-fixed-parameters", "lif", "alif"])
def test_the_c_kernels_equal_the_reference(spec, sizes, weight, weight_rec, options):
    times = input_times(2, sizes[0], 3, 15.0, seed=7)
    (outs_c, grads_c), (outs_t, grads_t) = run_both(spec, sizes, weight, weight_rec, times, **options)
    assert torch.equal(outs_c[1], outs_t[1]) and int(outs_c[1].sum()) > 0
    for a, b in zip(outs_c[:1] + outs_c[2:] + grads_c, outs_t[:1] + outs_t[2:] + grads_t):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@NEEDS_INTERPRETER
@pytest.mark.parametrize("spec, sizes, weight, weight_rec, options", [
    (cuba, (3, 4), (1.0, 2.0), (-1.0, 1.0), {"learnable": ("tau_m",), "delays": "axon"}),
    (continuous.alif, (3, 4), (0.5, 1.8), (-0.3, 0.6), {"learnable": ("tau", "beta"), "tau": 2.0, "tau_a": 5.0}),
], ids=["cuba-axonal-delays", "alif"])
def test_the_triton_kernels_equal_the_reference(spec, sizes, weight, weight_rec, options):
    """In Triton's interpreter: one program a sample, its neurons as lanes (a block of 16 for 4)."""
    times = input_times(2, sizes[0], 2, 10.0, seed=7)
    (outs_k, grads_k), (outs_t, grads_t) = run_both(spec, sizes, weight, weight_rec, times, steps=12,
                                                    backends=("triton", "torch"), **options)
    assert torch.equal(outs_k[1], outs_t[1]) and int(outs_k[1].sum()) > 0
    for a, b in zip(outs_k[:1] + outs_k[2:] + grads_k, outs_t[:1] + outs_t[2:] + grads_t):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@NEEDS_INTERPRETER
def test_the_triton_kernels_grow_their_spike_buffers_and_log(monkeypatch):
    """A spike buffer of 1 and a log of one item: both grow (the calls run again) to the reference's results."""
    rooms = []
    room = eventprop_triton_recurrent.RecurrentTritonSimulator._room
    monkeypatch.setattr(eventprop_triton_recurrent.RecurrentTritonSimulator, "_room",
                        lambda self, *args: rooms.append(room(self, *args)) or 1)
    results, layers = [], {}
    for backend in ("triton", "torch"):
        layer = layers[backend] = flexgen.EventPropDense(1, 2, lif, dt=1.0, steps=4, recurrent=True,
                                                         spike_capacity=1, backend=backend)
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([[5.0], [0.0]], dtype=F64))
            layer.weight_rec.copy_(torch.tensor([[0.0, 0.0], [4.0, 0.0]], dtype=F64))
        x = torch.tensor([[[0.5, 1.0, 1.5, 2.0]]], dtype=F64, requires_grad=True)
        out = layer(x)
        smooth_loss(out, 4.0).backward()
        results.append([out.times, out.trace, x.grad, layer.weight.grad, layer.weight_rec.grad])
        assert out.counts.tolist() == [[4, 4]]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert rooms and min(rooms) > 1  # the count the host would have taken: one item was too few
    assert layers["triton"]._triton_sim.capacity_used >= 4  # the buffer of one slot grew


@NEEDS_C
def test_the_c_kernels_grow_their_spike_buffers():
    layer = flexgen.EventPropDense(1, 2, lif, dt=1.0, steps=10, recurrent=True, spike_capacity=1, backend="c")
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[5.0], [0.0]], dtype=F64))
        layer.weight_rec.copy_(torch.tensor([[0.0, 0.0], [4.0, 0.0]], dtype=F64))
    out = layer(torch.tensor([[[0.5, 1.0, 1.5, 2.0, 2.5]]], dtype=F64))
    assert out.counts.tolist() == [[5, 5]] and torch.equal(out.times[0, 0], out.times[0, 1])


@pytest.mark.gpu
def test_cuda_tensors_run_the_reference_as_on_the_cpu():
    times = input_times(2, 3, 2, 12.0, seed=2)
    results = []
    for device in ("cpu", "cuda"):
        layer = recurrent_layer(cuba, (3, 4), (1.0, 2.0), (-1.0, 1.0), seed=2, learnable=("tau_m",),
                                backend="torch").to(device)
        x = times.to(device).detach().requires_grad_()  # a leaf on each device (on the CPU .to gives times itself)
        out = layer(x)
        smooth_loss(out, 20.0).backward()
        assert layer.last_run.backend == "torch" and int(out.counts.sum()) > 0
        results.append([t.cpu() for t in (out.times, out.trace, x.grad, layer.weight.grad, layer.weight_rec.grad,
                                           layer.tau_m.grad)])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
