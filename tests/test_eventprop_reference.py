"""The EventProp reference (flexgen.EventPropDense, fp64, CPU): spike times are the exact roots of the threshold on
the closed-form trajectory, and the adjoint backward equals central finite differences of smooth losses where no
spike appears or vanishes under the perturbation (each check asserts the spike counts are unchanged)."""
import math

import pytest
import torch

import flexgen
from flexgen.layers import eventprop_losses as losses
from flexgen.neurons import continuous

F64 = torch.float64
EPS = 1e-6


@flexgen.ode(states=("v",), method="exact")
def lif(u, v, tau=4.0, v_th=1.0):
    return flexgen.Dynamics({"v": (-v + u) / tau}, threshold=v >= v_th, reset={"v": 0.0})


@flexgen.ode(states=("v", "i"), method="exact")
def cuba(u, v, i, tau_m=10.0, tau_s=5.0, v_th=1.0):
    return flexgen.Dynamics({"v": (-v + i) / tau_m, "i": -i / tau_s + u}, threshold=v >= v_th, reset={"v": 0.0})


@flexgen.ode(states=("v", "i", "a"), method="exact")
def adaptive(u, v, i, a, tau_m=10.0, tau_s=5.0, tau_a=30.0, v_th=1.0, beta=0.3):
    return flexgen.Dynamics({"v": (-v + i) / tau_m, "i": -i / tau_s + u, "a": -a / tau_a},
                            threshold=v >= v_th + beta * a, reset={"v": 0.0, "a": a + 1.0})


def input_times(batch, inputs, per_input, window, seed):
    gen = torch.Generator().manual_seed(seed)
    times = torch.rand(batch, inputs, per_input, generator=gen, dtype=F64) * window
    times[:, ::3, -1] = math.inf  # some inputs spike less often
    return times.sort(dim=-1).values


def smooth_loss(out, window):
    """Spike times (first and later ones, weighted) and every recorded state, all smooth where counts hold."""
    t = torch.where(torch.isfinite(out.times), out.times, torch.zeros_like(out.times))
    weights = torch.linspace(0.3, 1.0, t.shape[-1], dtype=F64, device=t.device)
    loss = (t * weights).sum() / window
    for k in range(out.trace.shape[-1]):
        across = torch.linspace(-1, 1, out.trace.shape[2], dtype=F64, device=t.device)
        loss = loss + 0.1 * (out.trace[..., k] * across).sum()
    return loss + 0.05 * (out.trace ** 2).sum()


def check_gradients(run, tensors, entries, times=None):
    """run() -> (loss, counts); the gradient of every (tensor, index) in `entries` against central differences."""
    loss, counts = run()
    assert int(counts.sum()) > 0
    grads = torch.autograd.grad(loss, tensors)
    checked = 0
    for k, index in entries:
        tensor = tensors[k]
        with torch.no_grad():
            old = tensor[index].item()
            tensor[index] = old + EPS
            up, c_up = run()
            tensor[index] = old - EPS
            down, c_down = run()
            tensor[index] = old
        assert torch.equal(c_up, counts) and torch.equal(c_down, counts), "a spike appeared or vanished"
        fd = (up - down).item() / (2 * EPS)
        got = grads[k][index].item()
        assert abs(got - fd) <= 1e-6 * abs(fd) + 1e-9, (k, index, got, fd)
        checked += 1
    return checked


@pytest.mark.parametrize("neuron, learnable, weight, seed", [
    (lif, "tau", (0.3, 1.2), 1),
    (cuba, "tau_m", (0.5, 4.0), 2),
    (adaptive, "tau_s", (1.0, 5.0), 3),
])
def test_gradients_equal_finite_differences(neuron, learnable, weight, seed):
    torch.manual_seed(seed)
    window = 24.0
    layer = flexgen.EventPropDense(4, 3, neuron, dt=1.0, steps=24, learnable=(learnable,))
    with torch.no_grad():
        layer.weight.uniform_(*weight)
    times = input_times(2, 4, 3, 20.0, seed).requires_grad_()
    tau = getattr(layer, learnable)

    def run():
        out = layer(times)
        return smooth_loss(out, window), out.counts

    entries = [(0, (0, 0)), (0, (2, 3)), (1, (1,)), (2, (0, 1, 0)), (2, (1, 2, 1))]
    assert check_gradients(run, [layer.weight, tau, times], entries) == len(entries)


def test_a_threshold_parameter_and_a_fixed_one_get_exact_gradients():
    layer = flexgen.EventPropDense(3, 2, adaptive, dt=1.0, steps=20, learnable=("v_th", "beta", "tau_a"))
    with torch.no_grad():
        layer.weight.uniform_(2.0, 5.0)
    times = input_times(1, 3, 3, 15.0, 7)

    def run():
        out = layer(times)
        return smooth_loss(out, 20.0), out.counts

    entries = [(0, (0,)), (0, (1,)), (1, (0,)), (2, (1,))]
    assert check_gradients(run, [layer.v_th, layer.beta, layer.tau_a], entries) == 4


def test_two_layers():
    torch.manual_seed(5)
    first = flexgen.EventPropDense(4, 5, cuba, dt=1.0, steps=30)
    second = flexgen.EventPropDense(5, 2, cuba, dt=1.0, steps=30, learnable=("tau_s",))
    with torch.no_grad():
        first.weight.uniform_(1.0, 4.0)
        second.weight.uniform_(0.5, 3.0)
    times = input_times(2, 4, 3, 15.0, 11).requires_grad_()

    def run():
        hidden = first(times)
        out = second(hidden)
        return smooth_loss(out, 30.0) + 0.1 * smooth_loss(hidden, 30.0), torch.cat([hidden.counts, out.counts], 1)

    assert int(run()[1][:, 5:].sum()) > 0  # the second layer fires
    entries = [(0, (0, 0)), (0, (3, 2)), (1, (1, 4)), (2, (0,)), (3, (0, 1, 0))]
    assert check_gradients(run, [first.weight, second.weight, second.tau_s, times], entries) == 5


def test_losses_reach_the_spike_times_and_states():
    torch.manual_seed(2)
    layer = flexgen.EventPropDense(4, 3, cuba, dt=1.0, steps=25)
    with torch.no_grad():
        layer.weight.uniform_(1.0, 4.0)
    times = input_times(2, 4, 3, 15.0, 3)
    labels = torch.tensor([0, 2])

    def run():
        out = layer(times)
        v = out.state("v")
        loss = (losses.first_spike_cross_entropy(out.times, labels, no_spike_time=25.0, tau=2.0)
                + losses.max_voltage_cross_entropy(v, labels)
                + losses.voltage_sum_cross_entropy(v, labels, dt=1.0, tau=10.0)
                + losses.spike_count_regularisation(out.times, out.counts, target=1.0, window=25.0, strength=0.1))
        return loss, out.counts

    assert check_gradients(run, [layer.weight], [(0, (0, 0)), (0, (1, 1)), (0, (2, 3))]) == 3


def test_a_silent_label_neuron_gets_a_gradient_through_its_voltage():
    """silent_label_voltage_push: threshold - max v of the label neuron in the samples where it does not fire;
    its gradient equals central differences there, and a firing label neuron (or one past the threshold) adds
    nothing."""
    torch.manual_seed(4)
    layer = flexgen.EventPropDense(4, 3, cuba, dt=1.0, steps=25)
    with torch.no_grad():
        layer.weight.uniform_(0.05, 0.3)  # weak: no neuron reaches the threshold
        layer.weight[1].uniform_(3.0, 6.0)  # but neuron 1 fires
    times = input_times(2, 4, 3, 15.0, 5)
    labels = torch.tensor([0, 1])

    def run():
        out = layer(times)
        loss = losses.silent_label_voltage_push(out.times, out.state("v"), labels, threshold=1.0)
        return loss + 1e-3 * out.times[torch.isfinite(out.times)].sum(), out.counts

    out = layer(times)
    assert int(out.counts[0, 0]) == 0 and int(out.counts[1, 1]) > 0
    push = losses.silent_label_voltage_push(out.times, out.state("v"), labels, threshold=1.0)
    peak = out.state("v")[:, 0, 0].max()
    assert torch.allclose(push, (1.0 - peak) / 2, rtol=0, atol=1e-12)  # the firing sample adds zero
    weight_grad = torch.autograd.grad(push, layer.weight, retain_graph=True)[0]
    assert weight_grad[0].abs().sum() > 0 and weight_grad[1:].abs().sum() == 0  # only the silent label's row
    assert check_gradients(run, [layer.weight], [(0, (0, 0)), (0, (0, 2)), (0, (1, 1))]) == 3
    with pytest.raises(ValueError, match="trace must be"):
        losses.silent_label_voltage_push(out.times, out.state("v")[:, :1], labels, threshold=1.0)
    with pytest.raises(ValueError, match="labels must be"):
        losses.silent_label_voltage_push(out.times, out.state("v"), labels.float(), threshold=1.0)


def test_spike_times_are_the_roots_of_the_closed_form_trajectory():
    """One input spike of weight w at t0 into the CuBa LIF: v = w tau_s/(tau_s - tau_m) (e^(-s/tau_s) -
    e^(-s/tau_m)), s = t - t0; the spike is where v = v_th first (bisection of that formula, to rounding)."""
    tau_m, tau_s, w, t0 = 10.0, 5.0, 6.0, 2.25
    layer = flexgen.EventPropDense(1, 1, cuba, dt=1.0, steps=20)
    with torch.no_grad():
        layer.weight.fill_(w)
    out = layer(torch.tensor([[[t0]]], dtype=F64))
    assert out.counts.tolist() == [[1]]

    def v(s):
        return w * tau_s / (tau_s - tau_m) * (math.exp(-s / tau_s) - math.exp(-s / tau_m)) - 1.0

    lo, hi = 0.0, tau_m * tau_s / (tau_m - tau_s) * math.log(tau_m / tau_s)  # v rises until its maximum
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if v(mid) < 0 else (lo, mid)
    assert out.times[0, 0, 0].item() == pytest.approx(t0 + hi, rel=1e-14, abs=1e-13)
    assert out.state("i")[0, 0, 0].item() == 0.0  # before the input
    assert out.state("i")[5, 0, 0].item() == pytest.approx(w * math.exp(-(6.0 - t0) / tau_s), rel=1e-14)


def test_spike_buffers_grow_and_keep_every_spike():
    times = torch.tensor([[[0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]]], dtype=F64)
    small = flexgen.EventPropDense(1, 2, lif, dt=1.0, steps=10, spike_capacity=1)
    large = flexgen.EventPropDense(1, 2, lif, dt=1.0, steps=10, spike_capacity=64)
    with torch.no_grad():
        small.weight.copy_(torch.tensor([[5.0], [2.5]], dtype=F64))
        large.weight.copy_(small.weight)
    a, b = small(times), large(times)
    assert a.counts.tolist() == [[8, 4]]
    assert torch.equal(a.times, b.times) and a.times.shape == (1, 2, 8)
    assert torch.isinf(a.times[0, 1, 4:]).all() and torch.isfinite(a.times[0, 1, :4]).all()


def test_bad_inputs_are_refused():
    layer = flexgen.EventPropDense(2, 3, cuba, dt=1.0, steps=10)
    good = torch.tensor([[[1.0, 2.0], [0.5, math.inf]]], dtype=F64)
    layer(good)
    with pytest.raises(ValueError, match=r"must be \[batch, 2, spikes\]"):
        layer(good[0])
    with pytest.raises(ValueError, match=r"must be \[batch, 2, spikes\]"):
        layer(torch.zeros(1, 3, 2, dtype=F64))
    with pytest.raises(ValueError, match="ascending"):
        layer(good.flip(-1))
    with pytest.raises(ValueError, match=">= 0"):
        layer(good - 1.5)
    with pytest.raises(ValueError, match="NaN"):
        layer(torch.full((1, 2, 1), math.nan, dtype=F64))
    with pytest.raises(TypeError, match="torch.float32.*torch.float64"):
        layer(good.float())
    with pytest.raises(TypeError, match="must be a tensor"):
        layer([[1.0]])
    with pytest.raises(flexgen.SpecError, match="step function"):
        flexgen.EventPropDense(2, 3, flexgen.LIF)
    @flexgen.ode(states=("v",))
    def two_inputs(x, y, v, tau=2.0):
        return flexgen.Dynamics({"v": (x + y - v) / tau}, threshold=v >= 1.0, reset={"v": 0.0})

    with pytest.raises(flexgen.SpecError, match="one input .* takes 2: x, y"):
        flexgen.EventPropDense(2, 3, two_inputs)
    with pytest.raises(ValueError, match="substeps must be a positive int"):
        flexgen.EventPropDense(2, 3, continuous.qif, substeps=0)
    with pytest.raises(ValueError, match="no parameter 'tau'"):
        flexgen.EventPropDense(2, 3, cuba, tau=3.0)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        flexgen.EventPropDense(2, 3, cuba, steps=0)
    with pytest.raises(ValueError, match="labels must be a long tensor"):
        losses.max_voltage_cross_entropy(torch.zeros(4, 2, 3, dtype=F64), torch.tensor([0.0, 1.0]))


def test_a_reset_that_leaves_the_threshold_crossed_is_refused():
    @flexgen.ode(states=("v",), method="exact")
    def stuck(u, v, tau=4.0, v_th=1.0):
        return flexgen.Dynamics({"v": (-v + u) / tau}, threshold=v >= v_th, reset={"v": v - 0.1})

    layer = flexgen.EventPropDense(1, 1, stuck, dt=1.0, steps=5)
    with torch.no_grad():
        layer.weight.fill_(10.0)
    with pytest.raises(ValueError, match="still crossed"):
        layer(torch.tensor([[[1.0]]], dtype=F64))


def test_the_bundled_adaptive_lif_whose_reset_reads_the_states():
    """OdeALIF: the input drives v directly (every spike is caused by an input's jump, at its time) and the reset
    v <- v - (v_th + beta a), a <- a + 1/tau_a reads the states before it."""
    layer = flexgen.EventPropDense(3, 2, continuous.alif, dt=1.0, steps=20, learnable=("tau", "beta"), tau=2.0,
                                   tau_a=5.0)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.8, generator=torch.Generator().manual_seed(4))
    times = input_times(2, 3, 4, 18.0, 4).requires_grad_()

    def run():
        out = layer(times)
        return smooth_loss(out, 20.0), out.counts

    entries = [(0, (0, 1)), (0, (1, 2)), (1, (0,)), (2, (1,)), (3, (0, 1, 1)), (3, (1, 2, 0))]
    assert check_gradients(run, [layer.weight, layer.tau, layer.beta, times], entries) == 6


def test_a_nonlinear_neuron_by_substeps_of_its_method():
    """QIF (RK4): the trajectory is substeps of the spec's method, the adjoint RK4 in reverse time on it, the
    integrals Simpson's: the continuous model's gradient to fourth order in the substep, which at 32 substeps per
    dt agrees with central differences of the computed forward to 1e-6. Spikes are crossings (v passes the
    unstable point v_c after an input's jump, then runs up to v_th) and jumps over v_th at an input's time."""
    layer = flexgen.EventPropDense(3, 2, continuous.qif, dt=1.0, steps=16, learnable=("tau",), substeps=32)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.2, 0.9, 1.5], [1.0, 1.4, 0.8]], dtype=F64))
    times = torch.tensor([[[1.3, 6.1, 11.2], [2.5, 9.7, math.inf], [4.2, 13.1, 14.6]]], dtype=F64,
                         requires_grad=True)

    def run():
        out = layer(times)
        return smooth_loss(out, 16.0), out.counts

    spikes = layer(times).times
    crossing = torch.isfinite(spikes) & ((spikes[..., None] - times.detach().flatten()).abs().amin(-1) > 1e-9)
    assert bool(crossing.any())  # at least one spike between events
    entries = [(0, (0, 1)), (0, (1, 2)), (1, (0,)), (1, (1,)), (2, (0, 0, 0)), (2, (0, 2, 1))]
    assert check_gradients(run, [layer.weight, layer.tau, times], entries) == 6


def test_parameters_where_the_exact_flow_divides_by_zero_are_refused():
    """The current-based LIF's closed form divides by tau_m - tau_s: equal time constants are a clear error when
    the layer is made, and when a learnable one reaches the other during training (NaN otherwise)."""
    with pytest.raises(ValueError, match=r"divides by tau_m - tau_s, which is 0 for tau_m=4.0, tau_s=4.0"):
        flexgen.EventPropDense(2, 3, cuba, tau_m=4.0, tau_s=4.0)
    layer = flexgen.EventPropDense(2, 3, cuba, learnable=("tau_m",), tau_m=4.0, tau_s=2.0, backend="torch")
    times = torch.tensor([[[1.0], [2.0]]], dtype=torch.float64)
    layer(times)
    with torch.no_grad():
        layer.tau_m[1] = 2.0
    with pytest.raises(ValueError, match=r"tau_m=\[4.0, 2.0, 4.0\], tau_s=2.0"):
        layer(times)


def test_bptt_of_the_exactly_integrated_neuron_tends_to_the_eventprop_gradient():
    """The limit the theory gives: BPTT through the exactly integrated current-based LIF on a grid of step h, each
    input spike a current w / h held over the step it starts, the reset detached and no output spike, is the
    gradient of a system whose jumps are spread over one step; its weight gradient tends to EventProp's at first
    order in h (a loss on v every 1 ms for 30 ms)."""
    g = torch.Generator().manual_seed(0)
    batch, inputs, neurons, t_obs = 2, 6, 4, 30
    times = (torch.randint(0, 250, (batch, inputs, 2), generator=g) * 0.1).sort(-1).values.double()
    weight = (torch.rand(neurons, inputs, generator=g, dtype=torch.float64) * 1.2 + 0.1) * 0.1
    c = torch.randn(t_obs, batch, neurons, generator=g, dtype=torch.float64)
    layer = flexgen.EventPropDense(inputs, neurons, cuba, dt=1.0, steps=t_obs)
    with torch.no_grad():
        layer.weight.copy_(weight)
    out = layer(times)
    (out.state("v") * c).sum().backward()
    assert int(out.counts.sum()) == 0
    errors = []
    for h in (0.1, 0.05, 0.025):
        steps = round(t_obs / h)
        drive = torch.zeros(steps, batch, inputs, dtype=torch.float64)
        for b, i, k in times.lt(float("inf")).nonzero().tolist():
            drive[round(times[b, i, k].item() / h), b, i] += 1 / h
        w = weight.clone().requires_grad_(True)
        bptt = cuba(dt=h, store_state_seqs=True, detach_reset=True)
        assert bptt(drive @ w.t()).sum() == 0
        observed = torch.tensor([round((k + 1) / h) - 1 for k in range(t_obs)])
        (bptt.state_seqs["v"][observed] * c).sum().backward()
        errors.append(float((w.grad - layer.weight.grad).norm() / layer.weight.grad.norm()))
    assert errors[-1] < 2e-3
    for coarse, fine in zip(errors, errors[1:]):
        assert 0.45 < fine / coarse < 0.55  # first order in h
