"""The EventProp Triton kernels (EventPropDense(backend="triton"), `flexgen.launch.eventprop_triton`) against the
torch reference, fp64: the same spike times, grid states and every gradient to 1e-12. On the CPU they run in
Triton's interpreter (tiny sizes: a lane's root searches and quadratures are many small operations there); the
GPU tests run CUDA tensors against the C kernels at larger sizes."""
import re

import pytest
import torch

import flexgen
from flexgen.launch import c_path
from flexgen.launch import eventprop_triton
from flexgen.launch.backends import interpreter_on

from test_eventprop_reference import adaptive, cuba, input_times, lif, smooth_loss

F64 = torch.float64
interpreter = pytest.mark.skipif(not interpreter_on(), reason="needs TRITON_INTERPRET=1 for CPU tensors")


def same(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def nets(spec, learnable, sizes, backends, steps=8, scale=2.5, capacity=8, device="cpu", **options):
    """One network per backend with the same weights (drawn on the CPU, then moved to `device`)."""
    out = {}
    for backend in backends:
        torch.manual_seed(0)
        net = torch.nn.Sequential(*[
            flexgen.EventPropDense(a, b, spec, dt=1.0, steps=steps, learnable=learnable, spike_capacity=capacity,
                                   backend=backend, **options) for a, b in zip(sizes, sizes[1:])])
        with torch.no_grad():
            for layer in net:
                layer.weight.uniform_(0.5, scale)
        out[backend] = net.to(device)
    return out


def run(net, times):
    times = times.clone().requires_grad_()
    out = net(times)
    smooth_loss(out, 10.0).backward()
    return out, times.grad


def check_same(a, b, times_a, times_b=None, backend="triton", tolerance=1e-12):
    (out_a, grad_a), (out_b, grad_b) = run(a, times_a), run(b, times_a if times_b is None else times_b)
    assert all(layer.last_run.backend == backend for layer in a)
    assert torch.equal(out_a.counts.cpu(), out_b.counts.cpu()) and int(out_a.counts.sum()) > 0

    def close(x, y):
        torch.testing.assert_close(x.cpu(), y.cpu(), rtol=tolerance, atol=tolerance)

    close(out_a.times, out_b.times)
    close(out_a.trace, out_b.trace)
    close(grad_a, grad_b)
    for (name, p_a), (_, p_b) in zip(a.named_parameters(), b.named_parameters()):
        assert p_a.grad is not None, name
        close(p_a.grad, p_b.grad)
    return out_a


@interpreter
@pytest.mark.parametrize("spec, learnable", [(lif, ()), (cuba, ("tau_m",)), (adaptive, ())])
def test_interpreter_equals_the_reference(spec, learnable):
    """Spikes at crossings and at input events, a second layer fed by the first's spikes, parameter integrals."""
    pair = nets(spec, learnable, (3, 3, 2), ("triton", "torch"))
    times = input_times(1, 3, 2, 6.0, seed=1)
    out = check_same(pair["triton"], pair["torch"], times)
    assert int(out.counts.max()) >= 1


@interpreter
def test_interpreter_float32_layers_equal_float64_ones_to_float32s_rounding():
    """Weights, input times, outputs and the trace's gradient in float32 (the kernels read the gradient as it is,
    widening as they load; they compute in float64) against the same network in float64."""
    wide = nets(cuba, ("tau_m",), (3, 3, 2), ("triton",))["triton"]
    narrow = nets(cuba, ("tau_m",), (3, 3, 2), ("triton",))["triton"].float()  # the same weights, rounded
    times = input_times(1, 3, 2, 6.0, seed=1)
    (out_w, grad_w), (out_n, grad_n) = run(wide, times), run(narrow, times.float())
    assert out_n.trace.dtype == grad_n.dtype == torch.float32
    assert torch.equal(out_n.counts, out_w.counts) and int(out_w.counts.sum()) > 0

    def close(x, y):
        torch.testing.assert_close(x.double(), y, rtol=1e-5, atol=1e-6)

    close(out_n.times, out_w.times)
    close(out_n.trace, out_w.trace)
    close(grad_n, grad_w)
    for (name, p_n), (_, p_w) in zip(narrow.named_parameters(), wide.named_parameters()):
        close(p_n.grad, p_w.grad)


def test_event_lists_sort_a_chunk_of_lanes_at_a_time(monkeypatch):
    """Each lane's events in the window, in time order (input-major at equal times), whether the lanes are sorted
    all at once or one at a time."""
    from flexgen.launch import eventprop_events

    times = input_times(5, 4, 3, 9.0, seed=2)
    times[2, 1, 0] = times[2, 3, 0] = 4.0  # equal times: input 1 first
    times[3] = float("inf")  # a lane without events
    whole = eventprop_events.event_lists(times, 8, 1.0)  # the window [0, 8): some times fall past it
    monkeypatch.setattr(eventprop_events, "CHUNK_ELEMENTS", 1)
    parts = eventprop_events.event_lists(times, 8, 1.0)
    assert whole.M == parts.M and all(torch.equal(a, b) for a, b in zip(whole[:3], parts[:3]))
    for lane in range(5):
        flat = times[lane].reshape(-1)
        inside = [(float(t), k) for k, t in enumerate(flat.tolist()) if t < 8.0]
        expected = sorted(inside)
        n = int(whole.count[lane])
        assert n == len(expected)
        assert whole.time[lane, :n].tolist() == [t for t, _ in expected]
        assert whole.index[lane, :n].tolist() == [k for _, k in expected]


def test_event_lists_take_float32_times_against_the_window_in_float64():
    """A float32 time just below the window's end in float64 (0.7 in float32 is 0.69999999) is an event, counted
    as such, whatever the end rounds to in float32."""
    from flexgen.launch import eventprop_events

    times = torch.tensor([[[0.7, 0.2], [0.5, float("inf")]]], dtype=torch.float32)
    events = eventprop_events.event_lists(times, 1, 0.7)
    assert events.count.tolist() == [3] and events.M == 3
    assert events.time[0].tolist() == [float(torch.tensor(t, dtype=torch.float32)) for t in (0.2, 0.5, 0.7)]
    assert events.index[0].tolist() == [1, 2, 0]


@pytest.mark.parametrize("chunk", [None, 7], ids=["all lanes", "lanes in chunks"])
def test_the_backward_log_holds_the_most_spikes_of_one_interval(monkeypatch, chunk):
    """The log's room: the most spikes one neuron fired in one grid interval ((n dt, (n + 1) dt], as the kernels
    count them), from the forward's ascending spike times padded with inf."""
    if chunk is not None:
        monkeypatch.setattr(eventprop_triton, "CHUNK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(5)
    steps, dt = 6, 0.5
    spikes = (torch.rand(9, 8, generator=gen, dtype=F64) * steps * dt).sort(1).values
    spikes[2, 3:] = float("inf")
    spikes[4] = float("inf")  # a neuron that never fired
    spikes[5, :5] = torch.tensor([0.2, 0.3, 0.5, 0.9, 1.0], dtype=F64)  # three in (0, 0.5] (0.5 too), two next
    spikes[5, 5:] = float("inf")
    sim = eventprop_triton.TritonSimulator(None, ("v",), (), {"v": 0.0}, dt, steps, 4)
    grid = [(n + 1) * dt for n in range(steps)]
    most = max(max(sum(1 for t in row if t != float("inf") and sum(g < t for g in grid) == n)
                   for n in range(steps)) for row in spikes.tolist())
    assert sim._log_size(spikes) == most >= 3
    assert sim._log_size(torch.full((3, 2), float("inf"), dtype=F64)) == 1


@flexgen.ode(states=("v", "i"), method="exact")
def curved(u, v, i, tau_m=10.0, tau_s=5.0, v_th=1.0):
    """A threshold not affine in the states (g = v + v^2 / 4 - v_th): no linear-flow bound (BOUND 0)."""
    return flexgen.Dynamics({"v": (-v + i) / tau_m, "i": -i / tau_s + u}, threshold=v + v * v / 4 >= v_th,
                            reset={"v": 0.0})


@interpreter
def test_interpreter_a_threshold_without_the_bound():
    assert "BOUND = tl.constexpr(0)" in flexgen.EventPropDense(2, 2, curved, steps=3).source("triton")
    pair = nets(curved, (), (3, 2), ("triton", "torch"), steps=6)
    check_same(pair["triton"], pair["torch"], input_times(1, 3, 2, 5.0, seed=4))


@interpreter
def test_interpreter_grows_the_spike_buffer_and_the_backward_log(monkeypatch):
    """A buffer of one spike a neuron grows; a backward log counted too small for an interval's spikes (forced
    to one) is found full and doubled, never dropping a spike."""
    pair = nets(cuba, (), (2, 2), ("triton", "torch"), capacity=1, scale=20.0, steps=2)
    monkeypatch.setattr(eventprop_triton.TritonSimulator, "_log_size", lambda self, spike_times: 1)
    launched = []
    launch = eventprop_triton.TritonSimulator._launch

    def counting(self, kernel, *args, **kwargs):
        launched.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
        return launch(self, kernel, *args, **kwargs)

    monkeypatch.setattr(eventprop_triton.TritonSimulator, "_launch", counting)
    times = torch.tensor([[[0.2, 1.1], [0.5, float("inf")]]], dtype=F64)
    out = check_same(pair["triton"], pair["torch"], times)
    assert int(out.counts.max()) >= 3
    assert sum("forward" in name for name in launched) >= 2  # the buffer of one spike was too small
    assert sum("backward" in name for name in launched) >= 2  # and so was the log


@interpreter
def test_interpreter_axonal_delays_equal_the_reference():
    pair = nets(cuba, (), (3, 2), ("triton", "torch"), delays="axon", max_delay=3.0)
    with torch.no_grad():
        for net in pair.values():
            net[0].delay.copy_(torch.tensor([0.5, 1.25, 2.0], dtype=F64))
    check_same(pair["triton"], pair["torch"], input_times(1, 3, 2, 5.0, seed=2))
    same(pair["triton"][0].delay.grad, pair["torch"][0].delay.grad)


@interpreter
def test_interpreter_per_synapse_delays_equal_the_reference():
    """Each neuron walks its own arrival times: lanes with different numbers of events in an interval, a spike
    after a lane's last event, the arrival-time errors of each synapse."""
    pair = nets(cuba, ("tau_m",), (3, 2), ("triton", "torch"), delays="synapse", max_delay=3.0)
    with torch.no_grad():
        for net in pair.values():
            net[0].delay.copy_(torch.tensor([[0.5, 1.25, 2.0], [0.0, 2.75, 0.25]], dtype=F64))
    out = check_same(pair["triton"], pair["torch"], input_times(2, 3, 2, 5.0, seed=2))
    assert int(out.counts.max()) >= 1
    same(pair["triton"][0].delay.grad, pair["torch"][0].delay.grad)
    assert float(pair["triton"][0].delay.grad.abs().min()) > 0  # every synapse's delay moved the loss


@interpreter
def test_interpreter_errors_are_the_other_backends():
    @flexgen.ode(states=("v",), method="exact")
    def above(u, v, tau=4.0, v_th=-1.0):
        return flexgen.Dynamics({"v": (-v + u) / tau}, threshold=v >= v_th, reset={"v": -2.0})

    layer = flexgen.EventPropDense(2, 2, above, dt=1.0, steps=4, backend="triton")
    with pytest.raises(ValueError, match="starts at or above its threshold"):
        layer(torch.tensor([[[1.0], [2.0]]], dtype=F64))


def test_backend_choice_and_refusals():
    """auto: Triton on CUDA tensors where the kernels take the layer, C on the CPU; backend="triton" says why not."""
    if interpreter_on():
        layer = flexgen.EventPropDense(2, 2, lif, dt=1.0, steps=4, backend="triton")
        layer(torch.tensor([[[1.0], [2.0]]], dtype=F64))
        assert layer.last_run == ("triton", "exact")
    for options, match in [({"recurrent_delays": "axon"}, "without delays on the recurrent connections"),
                           ({"out": 2049}, "at most 2048; this one has 2049")]:
        layer = flexgen.EventPropDense(2, options.pop("out", 2), lif, dt=1.0, steps=4, backend="triton",
                                       recurrent=True, **options)
        with pytest.raises(RuntimeError, match=match):
            layer(torch.tensor([[[1.0], [2.0]]], dtype=F64))
    auto = flexgen.EventPropDense(2, 2, lif, dt=1.0, steps=4)
    auto(torch.tensor([[[1.0], [2.0]]], dtype=F64))
    assert auto.last_run.backend == ("c" if c_path.available() else "torch")
    with pytest.raises(ValueError, match="'triton'"):
        flexgen.EventPropDense(2, 2, lif, dt=1.0, steps=4, backend="cuda")


@interpreter
@pytest.mark.parametrize("recurrent", [False, True], ids=["feed-forward", "recurrent"])
def test_interpreter_a_neuron_nonlinear_between_events_equals_the_reference(recurrent):
    """QIF: substeps of its method for the flow, crossings between events, the stepped backward (RK4, Simpson's
    rule for a trained parameter)."""
    from flexgen.neurons import continuous

    pair = nets(continuous.qif, ("tau",), (3, 3), ("triton", "torch"), steps=5, scale=1.2, substeps=2,
                recurrent=recurrent)
    if recurrent:
        with torch.no_grad():
            for net in pair.values():
                net[0].weight_rec.copy_(torch.tensor([[0.0, 0.4, -0.3], [0.5, 0.0, 0.2], [-0.2, 0.6, 0.0]],
                                                     dtype=F64))
    out = check_same(pair["triton"], pair["torch"], input_times(1, 3, 2, 4.0, seed=4))
    assert pair["triton"][0].last_run == ("triton", "substeps") and int(out.counts.sum()) >= 1
    source = pair["triton"][0].source("triton")
    assert "SUBSTEPS = tl.constexpr(2)" in source and "def epf_step(" in source
    assert "def epf_adjoint_flow(" not in source  # no closed form printed


def test_triton_substeps_are_checked():
    from flexgen.kinds.eventprop import EVENTPROP
    from flexgen.neurons import continuous

    layer = flexgen.EventPropDense(2, 2, continuous.qif, dt=1.0, steps=4)
    with pytest.raises(flexgen.SpecError, match="positive number of substeps"):
        EVENTPROP.triton_module(layer.program, 0)


def test_generated_source_reads_the_printed_functions():
    source = flexgen.EventPropDense(2, 2, cuba, dt=1.0, steps=4).source("triton")
    (h,) = re.findall(r"def epf_flow\((h\d*), ep_in1, ep_in2\):", source)  # (the derivation names the length)
    assert f"tl.exp(-{h}/tau_s)" in source  # the closed-form flow, printed from the equations
    assert "def eventprop_backward(" in source and "BOUND = tl.constexpr(1)" in source


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not c_path.available(), reason="the oracle is the C kernels")
@pytest.mark.parametrize("spec, learnable", [(cuba, ("tau_m", "tau_s")), (adaptive, ("beta",)), (curved, ())])
def test_cuda_equals_the_c_kernels(spec, learnable):
    """Many neurons a program, several programs a sample, several samples, two layers, growing buffers. CUDA's exp
    and the C library's differ in the last bit, and a neuron's spike times and states after tens of spikes carry
    that rounding through each root search: 1e-11 (the CPU backends agree to 1e-12, test above)."""
    gpu = nets(spec, learnable, (12, 70, 5), ("auto",), steps=30, scale=0.8, capacity=2, device="cuda")["auto"]
    cpu = nets(spec, learnable, (12, 70, 5), ("c",), steps=30, scale=0.8, capacity=2)["c"]
    times = input_times(3, 12, 4, 25.0, seed=3)
    out = check_same(gpu, cpu, times.cuda(), times, tolerance=1e-11)
    assert int(out.counts.max()) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not c_path.available(), reason="the oracle is the C kernels")
def test_cuda_per_synapse_delays_equal_the_c_kernels():
    """Each of 70 neurons (three programs a sample) walks its own arrival times; the delays' gradients too."""
    def build(backend, device):
        net = nets(cuba, ("tau_m",), (12, 70, 5), (backend,), steps=30, scale=0.8, capacity=2, delays="synapse",
                   max_delay=8.0)[backend]
        with torch.no_grad():
            net[0].delay.copy_(torch.rand(70, 12, dtype=F64, generator=torch.Generator().manual_seed(5)) * 8.0)
        return net.to(device)

    gpu, cpu = build("auto", "cuda"), build("c", "cpu")
    times = input_times(3, 12, 4, 25.0, seed=3)
    out = check_same(gpu, cpu, times.cuda(), times, tolerance=1e-11)
    assert int(out.counts.max()) >= 2
    torch.testing.assert_close(gpu[0].delay.grad.cpu(), cpu[0].delay.grad, rtol=1e-11, atol=1e-11)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not c_path.available(), reason="the oracle is the C kernels")
@pytest.mark.parametrize("spec, learnable, hidden", [(cuba, ("tau_m",), 70), (adaptive, ("beta",), 300)])
def test_cuda_recurrent_layers_equal_the_c_kernels(spec, learnable, hidden):
    """One program a sample, its neurons as lanes (blocks of 128 and 512 lanes: several warps share the backward's
    log, written and read back by other threads), excitatory and inhibitory recurrent weights, a readout."""
    def build(backend, device):
        net = nets(spec, learnable, (12, hidden, 5), (backend,), steps=30, scale=0.8, capacity=2,
                   recurrent=True)[backend]
        with torch.no_grad():
            gen = torch.Generator().manual_seed(6)
            for layer in net:
                layer.weight_rec.copy_((torch.rand(layer.weight_rec.shape, dtype=F64, generator=gen) - 0.5)
                                       * (8.0 / layer.out_features))
        return net.to(device)

    gpu, cpu = build("auto", "cuda"), build("c", "cpu")
    times = input_times(3, 12, 4, 25.0, seed=3)
    out = check_same(gpu, cpu, times.cuda(), times, tolerance=1e-11)
    assert int(out.counts.max()) >= 2
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.weight_rec.grad.cpu(), b.weight_rec.grad, rtol=1e-11, atol=1e-11)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not c_path.available(), reason="the oracle is the C kernels")
@pytest.mark.parametrize("recurrent", [False, True], ids=["feed-forward", "recurrent"])
def test_cuda_a_neuron_nonlinear_between_events_equals_the_c_kernels(recurrent):
    """QIF by 4 substeps of its method a piece, a trained time constant (the stepped backward's integrals)."""
    from flexgen.neurons import continuous

    def build(backend, device):
        net = nets(continuous.qif, ("tau",), (12, 40, 5), (backend,), steps=20, scale=0.6, capacity=2, substeps=4,
                   recurrent=recurrent)[backend]
        if recurrent:
            with torch.no_grad():
                gen = torch.Generator().manual_seed(6)
                for layer in net:
                    layer.weight_rec.copy_((torch.rand(layer.weight_rec.shape, dtype=F64, generator=gen) - 0.5) * 0.2)
        return net.to(device)

    gpu, cpu = build("auto", "cuda"), build("c", "cpu")
    times = input_times(3, 12, 4, 16.0, seed=3)
    out = check_same(gpu, cpu, times.cuda(), times, tolerance=1e-11)
    assert gpu[0].last_run == ("triton", "substeps") and int(out.counts.sum()) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_layer_the_triton_kernels_cannot_run_says_so_once():
    """backend="auto" on CUDA tensors runs the torch reference where the kernels cannot (recurrent delays), with
    one warning that names why."""
    import warnings

    layer = flexgen.EventPropDense(2, 3, cuba, dt=1.0, steps=6, recurrent=True, recurrent_delays="axon").cuda()
    times = torch.tensor([[[1.0], [2.0]]], dtype=F64, device="cuda")
    with pytest.warns(UserWarning, match="recurrent connections.*torch reference"):
        layer(times)
    assert layer.last_run.backend == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(times)  # said once
