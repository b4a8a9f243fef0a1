"""Products over events in the CPU plan (`flexgen.launch.event_product`): `base + x W^T + b` summed over the
nonzero entries of x only equals the dense product (fp64 within 1e-12, fp32 as its rounding allows) for spikes,
for sparse values other than 0 and 1, and on the dense fallback; the plan built on them equals the multi-step call
(fp64: spikes equal, states within 1e-12; fp32 too) for sparse and dense inputs; rows spread over threads give the
same sums; weights updated in place (and by load_state_dict) between steps show in the next step; nothing is
allocated per step; bad operands are clear errors."""
import copy

import pytest
import torch

import flexgen
from conftest import HAS_C_COMPILER

pytestmark = pytest.mark.skipif(not HAS_C_COMPILER, reason="products over events run on the C target")

T, B = 8, 4


def product(weight, bias, x, base=None, by_inputs=None):
    """(the EventProduct's result at step 0, whether it ran over events)."""
    from flexgen.launch.event_product import EventProduct

    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype)
    call = EventProduct(weight, bias, [x], out, None if base is None else [base], by_inputs=by_inputs)
    return out, call(0)


def spikes(shape, share, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) < share).to(dtype)


@pytest.mark.parametrize("values", ["spikes", "sparse values"])
def test_a_product_over_events_equals_the_dense_product(values):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(37, 53, generator=g, dtype=torch.float64)
    bias = torch.randn(37, generator=g, dtype=torch.float64)
    base = torch.randn(B, 37, generator=g, dtype=torch.float64)
    x = spikes((B, 53), 0.1)
    if values == "sparse values":
        x = x * torch.randn(B, 53, generator=g, dtype=torch.float64)
    x[1] = 0  # a row without events
    assert 0 < int((x != 0).sum()) < 0.2 * x.numel()
    got, over_events = product(weight, bias, x)
    assert over_events
    assert torch.allclose(got, torch.addmm(bias, x, weight.t()), rtol=0, atol=1e-12)
    assert torch.equal(got[1], bias)
    got, over_events = product(weight, None, x, base)
    assert over_events and torch.allclose(got, base + x @ weight.t(), rtol=0, atol=1e-12)
    got32, _ = product(weight.float(), bias.float(), x.float())
    assert torch.allclose(got32.double(), torch.addmm(bias, x, weight.t()), rtol=0, atol=1e-5)


def test_rows_spread_over_threads_give_the_same_sums():
    """A product large enough for OpenMP ((tile, row) or (tile, chunk of rows) pairs spread over threads, each
    summed by one thread in the same order) equals the one-thread product exactly, by rows and by inputs."""
    from flexgen.launch.event_product import EventProduct

    g = torch.Generator().manual_seed(6)
    weight = torch.randn(512, 600, generator=g, dtype=torch.float64)
    x = spikes((45, 600), 0.1, seed=7) * torch.randn(45, 600, generator=g, dtype=torch.float64)
    outs = [torch.empty(45, 512, dtype=torch.float64) for _ in range(4)]
    for (threads, by_inputs), out in zip([(1, False), (2, False), (1, True), (2, True)], outs):
        assert EventProduct(weight, None, [x], out, threads=threads, by_inputs=by_inputs)(0)
    for out in outs[1:]:
        assert torch.equal(outs[0], out)
    assert torch.allclose(outs[1], x @ weight.t(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("by_inputs", [False, True], ids=["by rows", "by inputs"])
@pytest.mark.parametrize("batch", [1, B, 37, 70], ids=["one row", "one chunk", "a partial chunk", "three chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_output_adds_its_terms_in_the_order_of_the_inputs(dtype, batch, by_inputs):
    """Outputs in several 256-byte tiles and a partial one, a weight that is not contiguous: each output is
    ((0 + x_i1 w_i1) + x_i2 w_i2 + ...) + base, then + bias, over its nonzero inputs in order, to the bit, whether
    the product runs by rows or by inputs (in chunks of 32 rows)."""
    g = torch.Generator().manual_seed(8)
    n_out = 3 * (256 // torch.empty((), dtype=dtype).element_size()) + 5
    weight = torch.randn(23, n_out, generator=g, dtype=torch.float64).to(dtype).t()  # [n_out, 23], transposed
    bias, base = torch.randn(n_out, generator=g).to(dtype), torch.randn(batch, n_out, generator=g).to(dtype)
    x = spikes((batch, 23), 0.2, dtype, seed=9) * torch.randn(batch, 23, generator=g).to(dtype)
    if batch > 1:
        x[batch // 2] = 0  # a row without events
    assert int((x != 0).sum()) > batch  # events enough to sum
    got, over_events = product(weight, bias, x, base, by_inputs)
    assert over_events
    want = torch.zeros(batch, n_out, dtype=dtype)
    for b in range(batch):
        for i in x[b].nonzero()[:, 0].tolist():
            want[b] = want[b] + x[b, i] * weight[:, i]
    assert torch.equal(got, (base + want) + bias)


def test_large_weights_at_batches_of_four_and_more_go_by_inputs():
    from flexgen.launch.event_product import EventProduct

    def way(n_out, n_in, batch, dtype=torch.float32):
        out = torch.empty(batch, n_out, dtype=dtype)
        x = torch.zeros(batch, n_in, dtype=dtype)
        return EventProduct(torch.zeros(n_out, n_in, dtype=dtype), None, [x], out).by_inputs

    assert way(512, 700, 32) and way(512, 700, 4) and way(512, 512, 32, torch.float64)
    assert not way(512, 700, 3) and not way(512, 700, 1)
    assert not way(256, 256, 32)  # 256 KiB: stays in a core's L2 cache


def test_a_dense_operand_runs_the_dense_product():
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(9, 11, generator=g, dtype=torch.float64), torch.randn(9, generator=g).double()
    x = torch.randn(B, 11, generator=g, dtype=torch.float64)
    got, over_events = product(weight, bias, x)
    assert not over_events
    assert torch.allclose(got, torch.addmm(bias, x, weight.t()), rtol=0, atol=1e-12)
    base = torch.randn(B, 9, generator=g, dtype=torch.float64)
    got, over_events = product(weight, bias, x, base)
    assert not over_events and torch.allclose(got, base + x @ weight.t() + bias, rtol=0, atol=1e-12)
    one, over_events = product(weight, bias, x[:1])  # one row: always over events (a matrix-vector product)
    assert over_events and torch.allclose(one, torch.addmm(bias, x[:1], weight.t()), rtol=0, atol=1e-12)


def test_bad_operands_are_clear_errors():
    from flexgen.launch.event_product import EventProduct

    weight, out = torch.zeros(3, 5, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"fp32 or fp64 \(one dtype\), got a torch.float32 weight"):
        EventProduct(weight.float(), None, [torch.zeros(2, 5)], out)
    with pytest.raises(ValueError, match=r"fp32 or fp64"):
        EventProduct(weight.half(), None, [torch.zeros(2, 5).half()], out.half())
    with pytest.raises(ValueError, match=r"takes \[2, 5\] operands into \[2, 3\], got \(2, 4\)"):
        EventProduct(weight, None, [torch.zeros(2, 4, dtype=torch.float64)], out)
    with pytest.raises(ValueError, match=r"operand must be \[B, n\] with contiguous rows"):
        EventProduct(weight, None, [torch.zeros(5, 2, dtype=torch.float64).t()], out)
    with pytest.raises(ValueError, match=r"bias must be contiguous, \[3\]"):
        EventProduct(weight, torch.zeros(4, dtype=torch.float64), [torch.zeros(2, 5, dtype=torch.float64)], out)


def spiking_network(dtype=torch.float64):
    """Linear -> Recurrent LIF -> Linear -> LIF -> Linear -> LIF over 40 input channels, every layer spiking."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(40, 24), flexgen.Recurrent(flexgen.LIF, hidden=24, bias=True),
        torch.nn.Linear(24, 16), flexgen.LIF(tau=2.0, step_mode="m"),
        torch.nn.Linear(16, 8), flexgen.LIF(step_mode="m"))
    with torch.no_grad():
        model[0].weight.uniform_(-1.0, 1.6)
        model[1].weight.uniform_(-0.6, 0.2)
        model[2].weight.uniform_(-0.5, 1.2)
        model[4].weight.uniform_(-0.3, 1.5)
    return model.to(dtype).eval()


def sequence(kind, dtype=torch.float64):
    g = torch.Generator().manual_seed(4)
    if kind == "dense":
        return (torch.rand(T, B, 40, generator=g, dtype=torch.float64) * 0.25).to(dtype)
    x = spikes((T, B, 40), 0.1, seed=5)
    if kind == "sparse values":
        x = x * (torch.rand(T, B, 40, generator=g, dtype=torch.float64) * 4)
    return x.to(dtype)


def streamed(stream, x):
    return torch.stack([stream(x[t]).clone() for t in range(x.shape[0])])


def record_paths(stream):
    """Wrap each product of the stream's plan to record, per step, whether it ran over events."""
    paths = []
    for step in stream._plan.steps:
        if hasattr(step, "product"):
            paths.append([])
            step.product = lambda t, run=step.product, seen=paths[-1]: seen.append(run(t))
    return paths


@pytest.mark.parametrize("by_inputs", [False, True], ids=["by rows", "by inputs"])
@pytest.mark.parametrize("kind", ["spikes", "sparse values", "dense"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_plan_over_events_equals_the_multi_step_call(kind, dtype, by_inputs, monkeypatch):
    """By rows (these weights stay in a core's L2), and by inputs as larger weights go (every weight taken as
    larger here)."""
    from flexgen.launch import event_product

    if by_inputs:
        monkeypatch.setattr(event_product, "L2_BYTES", 0)
    x = sequence(kind, dtype)
    reference = spiking_network(dtype)
    with torch.no_grad():
        want = reference(x)
    assert 0.05 < want.mean().item() < 0.95
    stream = flexgen.Stream(spiking_network(dtype), x[0])
    assert stream.mode == "plan"
    products = [step.product for step in stream._plan.steps if hasattr(step, "product")]
    assert [p.by_inputs for p in products] == [by_inputs] * 4
    paths = record_paths(stream)
    assert torch.equal(streamed(stream, x), want)
    assert len(paths) == 4 and all(len(p) == T for p in paths)
    assert any(any(p) for p in paths[1:])  # products over the layers' spikes ran over events
    assert all(paths[0]) if kind != "dense" else not any(paths[0])
    atol = 1e-12 if dtype == torch.float64 else 1e-5
    states = stream.states()
    assert torch.allclose(states["1"]["v"], reference[1].final_states["v"], rtol=0, atol=atol)
    assert torch.equal(states["1"]["output"], reference[1].final_output)
    for k in ("3", "5"):
        assert torch.allclose(states[k]["v"], getattr(reference[int(k)], "v"), rtol=0, atol=atol)


def test_weights_updated_in_place_show_in_the_next_step():
    """The transposed copies follow the parameters: an in-place update (as an optimiser makes) and load_state_dict
    between steps; the reference is the eager stream of a copy given the same updates."""
    x = sequence("spikes")
    model = spiking_network()
    twin = copy.deepcopy(model)
    stream, eager = flexgen.Stream(model, x[0]), flexgen.Stream(twin, x[0], mode="eager")
    assert stream.mode == "plan"
    other = spiking_network()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.8)
    for t in range(T):
        if t == 3:
            for m in (model, twin):
                with torch.no_grad():
                    m[0].weight.mul_(1.3)
                    m[1].weight.add_(0.05)
                    m[2].bias.sub_(0.2)
        if t == 5:
            for m in (model, twin):
                m.load_state_dict(other.state_dict())
        got, want = stream(x[t]), eager(x[t])
        assert torch.equal(got, want), t
    for layer in ("1", "3", "5"):
        assert torch.allclose(stream.states()[layer]["v"], eager.states()[layer]["v"], rtol=0, atol=1e-12)


def _allocations(call, steps):
    """Tensors allocated (aten::empty, aten::empty_strided) during `steps` calls, as torch's profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            call()
    return sum(1 for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided"))


def test_the_plan_over_events_allocates_no_tensor_per_step():
    sparse, dense = sequence("spikes", torch.float32), sequence("dense", torch.float32)
    model = spiking_network(torch.float32)
    stream = flexgen.Stream(model, sparse[0])
    paths = record_paths(stream)
    steps = iter(range(10 ** 6))
    scaled = model[1].weight.detach() * 1.1

    def updated_step(x):  # a weight updated in place before the step: its transposed copy is refreshed
        with torch.no_grad():
            model[1].weight.copy_(scaled)
        stream(x)

    assert _allocations(lambda: stream(sparse[next(steps) % T]), 10) == 0
    assert _allocations(lambda: updated_step(sparse[next(steps) % T]), 2) == 0
    assert _allocations(lambda: stream(dense[next(steps) % T]), 10) == 0
    assert all(paths[0][:12]) and not any(paths[0][12:])  # the input's product: over events, then dense
