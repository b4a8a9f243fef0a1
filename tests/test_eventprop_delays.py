"""Learnable delays of flexgen.EventPropDense (fp64, tiny sizes): axonal (one per input) and per-synapse (one per
neuron and input), on the C kernels and the torch reference. Zero delays give the undelayed layer exactly, a
delay moves a single-input neuron's spikes by that much, a spike delayed past the window does nothing, and the
gradients of delays, weights and input times equal central finite differences where no spike appears or
vanishes; bad options and delays are refused."""
import pytest
import torch

import flexgen
from flexgen.launch import c_path

from test_eventprop_reference import check_gradients, cuba, input_times, lif, smooth_loss

F64 = torch.float64
NEEDS_C = pytest.mark.skipif(not c_path.available(), reason="no C compiler")
CASES = [("axon", "torch"), pytest.param("axon", "c", marks=NEEDS_C),
         ("synapse", "torch"), pytest.param("synapse", "c", marks=NEEDS_C)]


def layer_of(delays, backend, spec=cuba, sizes=(4, 3), weight=(0.5, 4.0), seed=0, **options):
    torch.manual_seed(seed)
    layer = flexgen.EventPropDense(*sizes, spec, dt=1.0, steps=24, backend=backend, delays=delays,
                                   learnable=("tau_m",) if spec is cuba else (), **options)
    with torch.no_grad():
        layer.weight.uniform_(*weight)
    return layer


def outputs_and_grads(layer, times):
    times = times.clone().requires_grad_()
    out = layer(times)
    smooth_loss(out, 24.0).backward()
    grads = [times.grad] + [p.grad for name, p in layer.named_parameters() if name != "delay"]
    return out, grads


@pytest.mark.parametrize("delays, backend", CASES)
def test_zero_delays_give_the_undelayed_layer(delays, backend):
    times = input_times(2, 4, 3, 20.0, seed=4)
    plain, delayed = layer_of(None, backend), layer_of(delays, backend)
    assert delayed.delay.shape == ((4,) if delays == "axon" else (3, 4)) and not delayed.delay.detach().any()
    (a, grads_a), (b, grads_b) = outputs_and_grads(plain, times), outputs_and_grads(delayed, times)
    assert delayed.last_run.backend == backend and int(a.counts.sum()) > 0
    assert torch.equal(a.times, b.times) and torch.equal(a.counts, b.counts) and torch.equal(a.trace, b.trace)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("delays, backend", CASES)
def test_gradients_equal_finite_differences(delays, backend):
    layer = layer_of(delays, backend, seed=5)
    with torch.no_grad():
        layer.delay.uniform_(0.0, 3.0)
    times = input_times(2, 4, 3, 18.0, seed=5).requires_grad_()

    def run():
        out = layer(times)
        return smooth_loss(out, 24.0), out.counts

    d_entries = [(0, (1,)), (0, (3,))] if delays == "axon" else [(0, (0, 1)), (0, (2, 3)), (0, (1, 0))]
    entries = d_entries + [(1, (0, 2)), (2, (1,)), (3, (0, 1, 0)), (3, (1, 2, 1))]
    tensors = [layer.delay, layer.weight, layer.tau_m, times]
    assert check_gradients(run, tensors, entries) == len(entries)
    assert layer.last_run.backend == backend


@NEEDS_C
@pytest.mark.parametrize("delays", ["axon", "synapse"])
def test_the_c_kernels_equal_the_reference(delays):
    times = input_times(2, 4, 3, 18.0, seed=6)
    results = []
    for backend in ("c", "torch"):
        layer = layer_of(delays, backend, seed=6)
        with torch.no_grad():
            layer.delay.copy_(torch.tensor([0.5, 2.25, 0.0, 7.0], dtype=F64) * (1 + torch.arange(
                3, dtype=F64)[:, None] / 4 if delays == "synapse" else 1))
        out, grads = outputs_and_grads(layer, times)
        results.append((out, grads + [layer.delay.grad]))
    (a, grads_a), (b, grads_b) = results
    assert torch.equal(a.counts, b.counts) and int(a.counts.sum()) > 0
    torch.testing.assert_close(a.times, b.times, rtol=1e-12, atol=1e-12)
    for ga, gb in zip(grads_a, grads_b):
        assert gb.abs().max() > 0
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("delays, backend", CASES)
def test_a_delay_moves_the_spikes_of_a_single_input_neuron(delays, backend):
    """One input spike at t = 2 drives two CuBa neurons; each fires later by its delay (to rounding)."""
    layer = layer_of(delays, backend, sizes=(1, 2), weight=(5.0, 5.0))
    times = torch.tensor([[[2.0]]], dtype=F64)
    before = layer(times).times
    shift = torch.tensor([[1.75], [4.5]], dtype=F64) if delays == "synapse" else torch.tensor([3.25], dtype=F64)
    with torch.no_grad():
        layer.delay.copy_(shift)
    after = layer(times).times
    assert torch.isfinite(before).all() and before.shape == after.shape == (1, 2, 1)
    moved = shift.view(1, -1, 1) if delays == "synapse" else shift.view(1, 1, 1)
    torch.testing.assert_close(after, before + moved, rtol=0, atol=1e-12)


@pytest.mark.parametrize("delays, backend", CASES)
def test_a_spike_delayed_past_the_window_does_nothing(delays, backend):
    layer = layer_of(delays, backend, seed=7, max_delay=40.0)
    times = input_times(2, 4, 3, 18.0, seed=7)
    with torch.no_grad():
        if delays == "axon":
            layer.delay[2] = 30.0
        else:
            layer.delay[:, 2] = 30.0
    times_g = times.clone().requires_grad_()
    out = layer(times_g)
    smooth_loss(out, 24.0).backward()
    without = layer_of(None, backend, seed=7)
    removed = times.clone()
    removed[:, 2] = float("inf")
    ref = without(removed)
    assert int(ref.counts.sum()) > 0 and torch.equal(out.counts, ref.counts)
    torch.testing.assert_close(out.times, ref.times, rtol=1e-13, atol=1e-13)
    dead = layer.delay.grad[2] if delays == "axon" else layer.delay.grad[:, 2]
    assert not dead.any() and not times_g.grad[:, 2].any() and layer.delay.grad.abs().max() > 0


def test_clamp_delays_keeps_them_in_range():
    layer = layer_of("synapse", "torch", max_delay=5.0)
    with torch.no_grad():
        layer.delay.copy_(torch.tensor([-1.0, 2.0, 9.0, 0.5]).repeat(3, 1))
    with pytest.raises(ValueError, match=r"delays must lie in \[0, max_delay = 5\].*clamp_delays_"):
        layer(input_times(1, 4, 2, 10.0, seed=8))
    assert layer.clamp_delays_() is layer
    assert layer.delay[0].tolist() == [0.0, 2.0, 5.0, 0.5]
    layer(input_times(1, 4, 2, 10.0, seed=8))
    assert "delays='synapse', max_delay=5" in repr(layer)
    assert layer_of("axon", "torch").max_delay == 24.0  # the window by default


def test_bad_delay_options_are_refused():
    def make(**options):
        return flexgen.EventPropDense(2, 3, lif, dt=1.0, steps=10, **options)

    with pytest.raises(ValueError, match="delays must be None, 'axon' or 'synapse'"):
        make(delays="dendrite")
    with pytest.raises(ValueError, match="max_delay is given without delays"):
        make(max_delay=3.0)
    for bad in (0.0, -1.0, float("inf"), "2", True):
        with pytest.raises(ValueError, match="max_delay must be a positive number"):
            make(delays="axon", max_delay=bad)
    with pytest.raises(ValueError, match="the layer has no delays"):
        make().clamp_delays_()
    layer = make(delays="axon")
    with pytest.raises(ValueError, match="delays must lie in"):
        with torch.no_grad():
            layer.delay[0] = float("nan")
        layer(torch.zeros(1, 2, 1, dtype=F64))
    layer.delay = torch.nn.Parameter(torch.zeros(3, 2, dtype=F64))
    with pytest.raises(ValueError, match=r"delays='axon' takes a torch.float64 delay of shape \[2\]"):
        layer(torch.zeros(1, 2, 1, dtype=F64))


@pytest.mark.parametrize("backend", ["torch", pytest.param("c", marks=NEEDS_C)])
def test_two_layers_with_both_kinds_of_delay(backend):
    """Per-synapse delays in the hidden layer, axonal ones in the readout: every delay's gradient, and the input
    times', reach through both layers."""
    hidden = layer_of("synapse", backend, sizes=(4, 3), weight=(1.0, 4.0), seed=10)
    readout = layer_of("axon", backend, sizes=(3, 2), weight=(2.0, 5.0), seed=11)
    with torch.no_grad():
        hidden.delay.uniform_(0.0, 2.0)
        readout.delay.copy_(torch.tensor([1.5, 0.25, 3.0], dtype=F64))
    times = input_times(2, 4, 3, 14.0, seed=10).requires_grad_()

    def run():
        out = readout(hidden(times))
        return smooth_loss(out, 24.0), out.counts

    entries = [(0, (0, 1)), (0, (2, 2)), (1, (0,)), (1, (2,)), (2, (0, 1, 0))]
    assert check_gradients(run, [hidden.delay, readout.delay, times], entries) == len(entries)


@pytest.mark.gpu
@pytest.mark.parametrize("delays", ["axon", "synapse"])
def test_delays_on_cuda_tensors_equal_the_cpu_reference(delays):
    times = input_times(2, 4, 3, 18.0, seed=12)
    results = []
    for device in ("cpu", "cuda"):
        layer = layer_of(delays, "torch", seed=12).to(device)
        with torch.no_grad():
            layer.delay.copy_(torch.linspace(0.0, 3.0, layer.delay.numel(), dtype=F64).view(layer.delay.shape))
        out, grads = outputs_and_grads(layer, times.to(device))
        assert layer.last_run.backend == "torch"
        results.append([out.times, out.trace] + grads + [layer.delay.grad])
    assert int(torch.isfinite(results[0][0]).sum()) > 0
    for a, b in zip(*results):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-12, atol=1e-12)
