"""flexgen.Stream: a model of flexgen layers run one step a call equals the model's multi-step call (fp64: spikes
equal, states within 1e-12) on every backend this machine has, in the eager mode, the CPU plan and a compiled step;
a reset replays a fresh model; the CPU plan allocates no tensor per step; bad models, inputs and calls are clear
errors. On CUDA (marked gpu) the captured graph replays the eager steps and equals the multi-step call."""
import copy

import pytest
import torch

import flexgen
from conftest import HAS_C_COMPILER, HAS_CUDA, INTERPRETER, device_backends
from flexgen.streaming.held import StreamError

T, B = 6, 2


def network(backend, device="cpu", dtype=torch.float64, seed=0):
    """Linear -> Recurrent LIF -> Linear -> LIF reading its input through per-channel delays -> Dense LIF, in
    multi-step mode, weights strong enough that every layer spikes."""
    torch.manual_seed(seed)
    delays = flexgen.Delay(5, max_delay=3, delay=torch.tensor([0.0, 1.0, 2.0, 3.0, 1.5]), learnable=False)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8),
        flexgen.Recurrent(flexgen.LIF, hidden=8, bias=True, backend=backend),
        torch.nn.Linear(8, 5),
        flexgen.LIF(tau=2.0, step_mode="m", backend=backend, delay=delays),
        flexgen.Dense(5, 4, flexgen.LIF, backend=backend, tau=2.0),
    )
    with torch.no_grad():
        model[0].weight.uniform_(-0.3, 0.5)
        model[2].weight.uniform_(0.5, 2.0)
        model[4].weight.uniform_(0.5, 3.0)
    return model.to(device=device, dtype=dtype).eval()


def inputs(device="cpu", dtype=torch.float64, batch=B, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(T, batch, 6, generator=g, dtype=torch.float64) * 3.0).to(device=device, dtype=dtype)


def multi_step(model, x):
    """The reference: one call over all T steps, and each layer's final states then."""
    with torch.no_grad():
        out = model(x)
    finals = {"1": {**model[1].final_states, "output": model[1].final_output}, "3": {"v": model[3].v},
              "4": dict(model[4].final_states)}
    return out, finals


def streamed(stream, x):
    return torch.stack([stream(x[t]).clone() for t in range(x.shape[0])])


def assert_states_close(stream, finals):
    states = stream.states()
    for layer, kept in finals.items():
        for name, want in kept.items():
            assert torch.allclose(states[layer][name], want.expand_as(states[layer][name]), rtol=0, atol=1e-12), \
                (layer, name)


@pytest.mark.parametrize("device,backend", device_backends())
def test_streaming_one_step_a_call_equals_the_multi_step_call(device, backend):
    model = network(backend, device)
    x = inputs(device)
    want, finals = multi_step(network(backend, device), x)  # (the same seed: the same weights)
    assert 0.05 < want.mean().item() < 0.95  # the comparison sees spikes
    with flexgen.Stream(model, x[0]) as stream:
        got = streamed(stream, x)
        assert torch.equal(got, want)
        assert_states_close(stream, finals)
        line = stream.states()["3"]["line"]
        assert line.shape == (3, B, 5)
        stream.reset()  # a reset replays a fresh model
        assert torch.equal(streamed(stream, x), want)
        assert_states_close(stream, finals)
    assert model[1].step_mode == "m" and model[3].step_mode == "m"  # given back
    assert not model[4]._forward_pre_hooks and not model[4]._forward_hooks


def test_a_recurrent_layer_with_synapse_delays_streams():
    torch.manual_seed(3)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=6, bias=True, backend="torch",
                              delay=flexgen.SynapseDelay(6, max_delay=2, learnable=False))
    with torch.no_grad():
        layer.weight.mul_(4.0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), layer).double().eval()
    x = inputs()[..., :3]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        want = reference(x)
    assert 0.05 < want.mean().item() < 0.95
    stream = flexgen.Stream(model, x[0])
    assert torch.equal(streamed(stream, x), want)
    sent = stream.states()["1"]["sent"]
    assert sent.shape == (3, B, 6) and torch.equal(sent, want[-3:])
    assert torch.allclose(stream.states()["1"]["v"], reference[1].final_states["v"], rtol=0, atol=1e-12)


def test_states_stay_in_the_same_buffers():
    model = network("torch")
    x = inputs()
    stream = flexgen.Stream(model, x[0])
    before = {(layer, k): v.data_ptr() for layer, kept in stream.states().items() for k, v in kept.items()}
    streamed(stream, x)
    stream.reset()
    after = {(layer, k): v.data_ptr() for layer, kept in stream.states().items() for k, v in kept.items()}
    assert before == after
    assert model[1].final_states["v"].data_ptr() == before[("1", "v")]  # the layer reads the stream's buffer


def test_another_batch_size_or_dtype_is_a_clear_error():
    model = network("torch")
    x = inputs()
    stream = flexgen.Stream(model, x[0])
    with pytest.raises(StreamError, match=r"made for steps \[2, 6\] float64 on cpu, this one is \[3, 6\] float64"):
        stream(torch.zeros(3, 6, dtype=torch.float64))
    with pytest.raises(StreamError, match=r"this one is \[2, 6\] float32 on cpu.*make a new Stream"):
        stream(torch.zeros(2, 6))
    with pytest.raises(StreamError, match="requires grad"):
        stream(torch.zeros(2, 6, dtype=torch.float64, requires_grad=True))
    with pytest.raises(TypeError, match="takes 1 input"):
        stream(x[0], x[0])
    stream.close()
    with pytest.raises(StreamError, match="closed"):
        stream(x[0])


def test_bad_models_and_examples_are_clear_errors():
    x = torch.zeros(2, 4)
    with pytest.raises(StreamError, match="holds no flexgen layer"):
        flexgen.Stream(torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), x)
    delay = torch.nn.Sequential(flexgen.Delay(4, max_delay=2), flexgen.LIF(backend="torch")).eval()
    with pytest.raises(StreamError, match=r"Delay '0' cannot stream: .*delay=flexgen.Delay"):
        flexgen.Stream(delay, x)
    delayed = torch.nn.Sequential(flexgen.DelayedLinear(4, 3, max_delay=2), flexgen.LIF(backend="torch")).eval()
    with pytest.raises(StreamError, match="DelayedLinear '0' cannot stream"):
        flexgen.Stream(delayed, x)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), flexgen.LIF(backend="torch", step_mode="m"))
    with pytest.raises(StreamError, match=r"training mode.*model.eval\(\)"):
        flexgen.Stream(model, x)
    model.eval()
    with pytest.raises(StreamError, match="requires grad"):
        flexgen.Stream(model, x.requires_grad_())
    with pytest.raises(StreamError, match="floating-point"):
        flexgen.Stream(model, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(StreamError, match="mode='graph' captures a CUDA graph"):
        flexgen.Stream(model, torch.zeros(2, 4), mode="graph")
    with pytest.raises(ValueError, match="mode must be one of"):
        flexgen.Stream(model, torch.zeros(2, 4), mode="fast")
    assert model[1].step_mode == "m"  # a refused stream leaves the model as it was


def test_a_failing_first_step_gives_the_model_back():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), flexgen.LIF(backend="torch", step_mode="m")).eval()
    with pytest.raises(RuntimeError):
        flexgen.Stream(model, torch.zeros(2, 5))  # the Linear refuses 5 features
    assert model[1].step_mode == "m" and not model[1]._states


def plain_network(backend="auto", dtype=torch.float64):
    """Linear -> Recurrent LIF -> Linear -> LIF -> Linear -> LIF: what the CPU plan runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), flexgen.Recurrent(flexgen.LIF, hidden=8, bias=True, backend=backend),
        torch.nn.Linear(8, 5), flexgen.LIF(tau=2.0, step_mode="m", backend=backend),
        torch.nn.Linear(5, 4), flexgen.LIF(step_mode="m", backend=backend))
    with torch.no_grad():
        model[0].weight.uniform_(-0.3, 0.5)
        model[2].weight.uniform_(0.5, 2.0)
        model[4].weight.uniform_(0.5, 3.0)
    return model.to(dtype).eval()


needs_c = pytest.mark.skipif(not HAS_C_COMPILER, reason="the CPU plan runs the C kernels")


@needs_c
def test_the_cpu_plan_equals_the_multi_step_call():
    x = inputs()
    reference = plain_network()
    with torch.no_grad():
        want = reference(x)
    assert 0.05 < want.mean().item() < 0.95
    stream = flexgen.Stream(plain_network(), x[0])
    assert stream.mode == "plan"
    assert torch.equal(streamed(stream, x), want)
    states = stream.states()
    assert sorted(states) == ["1", "3", "5"] and sorted(states["1"]) == ["output", "v"]
    assert torch.allclose(states["1"]["v"], reference[1].final_states["v"], rtol=0, atol=1e-12)
    assert torch.equal(states["1"]["output"], reference[1].final_output)
    for k in ("3", "5"):
        assert torch.allclose(states[k]["v"], getattr(reference[int(k)], "v"), rtol=0, atol=1e-12)
    stream.reset()
    assert torch.equal(streamed(stream, x), want)


def _allocations(call, steps):
    """Tensors allocated (aten::empty, aten::empty_strided) during `steps` calls, as torch's profiler sees them."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            call()
    return sum(1 for e in prof.events() if e.name in ("aten::empty", "aten::empty_strided"))


@needs_c
def test_the_cpu_plan_allocates_no_tensor_per_step():
    x = inputs(dtype=torch.float32)
    plan = flexgen.Stream(plain_network(dtype=torch.float32), x[0])
    eager = flexgen.Stream(plain_network(dtype=torch.float32), x[0], mode="eager")
    for stream in (plan, eager):
        stream(x[0])
    assert _allocations(lambda: plan(x[1]), 10) == 0
    assert _allocations(lambda: eager(x[1]), 10) >= 10  # (the count sees allocations)


def in_place(stream, x):
    """Each step written into stream.input, then stream() with no argument."""
    outs = []
    for t in range(x.shape[0]):
        stream.input.copy_(x[t])
        outs.append(stream().clone())
    return torch.stack(outs)


@pytest.mark.parametrize("mode", ["plan", "eager"])
def test_a_step_on_the_input_written_in_place_equals_a_step_on_the_argument(mode):
    if mode == "plan" and not HAS_C_COMPILER:
        pytest.skip("the CPU plan runs the C kernels")
    x = inputs()
    model = plain_network() if mode == "plan" else network("torch")
    stream = flexgen.Stream(model, x[0], mode=mode)
    want = streamed(stream, x)
    assert want.sum() > 0
    stream.reset()
    buffer = stream.input
    assert stream.inputs == [buffer] and buffer.shape == x[0].shape and buffer.dtype == x.dtype
    assert torch.equal(in_place(stream, x), want)
    assert stream.input.data_ptr() == buffer.data_ptr()  # the same buffer every step
    stream.close()
    with pytest.raises(StreamError, match="closed"):
        stream.input
    with pytest.raises(StreamError, match="closed"):
        stream()


def test_a_stream_of_two_inputs_names_its_buffers():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lif = flexgen.LIF(tau=2.0, backend="torch")

        def forward(self, a, b):
            return self.lif(a + b)

    a = torch.rand(2, 3, dtype=torch.float64) * 3
    stream = flexgen.Stream(Two().eval(), (a, a))
    want = stream(a, 2 * a).clone()
    stream.reset()
    with pytest.raises(StreamError, match="takes 2 inputs per step: use stream.inputs"):
        stream.input
    first, second = stream.inputs
    first.copy_(a)
    second.copy_(2 * a)
    assert torch.equal(stream(), want)
    with pytest.raises(TypeError, match=r"takes 2 input\(s\) per step \(or none"):
        stream(a)


def test_the_plan_refuses_what_it_cannot_run():
    model = network("torch")
    with pytest.raises(StreamError, match=r"mode='plan' cannot run this model: module 1 runs on backend 'torch'"):
        flexgen.Stream(model, inputs()[0], mode="plan")
    assert flexgen.Stream(network("torch"), inputs()[0]).mode == "eager"  # "auto" falls back
    scaled = torch.nn.Sequential(flexgen.Recurrent(flexgen.LIF, hidden=6, scale=True)).eval()
    if HAS_C_COMPILER:
        with pytest.raises(StreamError, match=r"module 0 scales its recurrent current"):
            flexgen.Stream(scaled, inputs()[0], mode="plan")


# CUDA: the captured graph (run by the lead on an H200).

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="CUDA graphs")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_captured_graph_replays_the_eager_steps(dtype):
    model = network("triton", "cuda", dtype)
    x = inputs("cuda", dtype)
    eager = flexgen.Stream(network("triton", "cuda", dtype), x[0], mode="eager")
    want = streamed(eager, x)
    stream = flexgen.Stream(model, x[0])
    assert stream.mode == "graph" and stream._graph is not None
    assert torch.equal(streamed(stream, x), want)
    for layer, kept in eager.states().items():
        for name, value in kept.items():
            assert torch.equal(stream.states()[layer][name], value), (layer, name)
    stream.reset()
    assert torch.equal(streamed(stream, x), want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="CUDA graphs")
@pytest.mark.parametrize("fuse", [False, True])
def test_a_graph_step_on_the_input_written_in_place_equals_a_step_on_the_argument(fuse):
    x = inputs("cuda")
    model = network("triton", "cuda") if not fuse else plain_recurrent("cuda")
    stream = flexgen.Stream(model, x[0], fuse=fuse)
    assert stream.fused == fuse
    want = streamed(stream, x)
    stream.reset()
    assert torch.equal(in_place(stream, x), want)


def plain_recurrent(device):
    """Linear -> Recurrent LIF -> Linear -> Recurrent LIF: what a fused plan runs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), flexgen.Recurrent(flexgen.LIF, hidden=8, bias=True),
                                torch.nn.Linear(8, 5), flexgen.Recurrent(flexgen.LIF, hidden=5))
    with torch.no_grad():
        model[0].weight.uniform_(-0.3, 0.5)
        model[2].weight.uniform_(0.5, 2.0)
    return model.to(device=device, dtype=torch.float64).eval()


def assert_replays(stream, x, want, finals):
    """The stream gives the multi-step call's spikes and final states, and the same spikes again after a reset."""
    assert torch.equal(streamed(stream, x), want)
    assert_states_close(stream, finals)
    stream.reset()
    assert torch.equal(streamed(stream, x), want)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="CUDA graphs")
def test_the_captured_graph_equals_the_multi_step_call_in_fp64():
    model = network("triton", "cuda")
    x = inputs("cuda")
    want, finals = multi_step(network("triton", "cuda"), x)
    assert_replays(flexgen.Stream(model, x[0]), x, want, finals)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="CUDA graphs")
def test_a_reduce_overhead_compiled_stream_equals_the_multi_step_call():
    """fp64: under torch.compile a recurrent layer may take another path than the fused kernels (the spikes agree,
    the states within 1e-12)."""
    x = inputs("cuda")
    want, finals = multi_step(network("triton", "cuda"), x)
    assert_replays(flexgen.Stream(network("triton", "cuda"), x[0], mode="compile"), x, want, finals)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="CUDA graphs")
def test_a_graph_stream_refuses_another_batch_size():
    model = network("triton", "cuda", torch.float32)
    stream = flexgen.Stream(model, torch.zeros(1, 6, device="cuda"))
    with pytest.raises(StreamError, match=r"made for steps \[1, 6\] float32 on cuda"):
        stream(torch.zeros(32, 6, device="cuda"))


def test_a_compiled_step_equals_the_eager_one():
    """mode="compile" runs the step through torch.compile (here with the aot_eager backend, which needs no C++
    compiler; on CUDA the default is mode="reduce-overhead")."""
    model = network("torch")
    x = inputs()
    want, finals = multi_step(network("torch"), x)
    stream = flexgen.Stream(model, x[0], mode="compile", compile_options={"backend": "aot_eager"}, warmup=1)
    assert torch.equal(streamed(stream, x), want)
    assert_states_close(stream, finals)
    stream.reset()
    assert torch.equal(streamed(stream, x), want)
    with pytest.raises(ValueError, match="compile_options are for mode='compile'"):
        flexgen.Stream(model, x[0], compile_options={})


def test_the_benchmark_runs_dry_and_redraws_its_table(tmp_path):
    """benchmarks/bench_stream_model.py at tiny sizes on the CPU: every candidate measured, the peers' spikes those
    of flexgen where the neuron is the same one, and --replot redraws the same table."""
    import json
    import pathlib
    import subprocess
    import sys

    script = str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_stream_model.py")
    done = subprocess.run([sys.executable, script, "--dry-run", "--out", str(tmp_path), "--skip", "snnTorch",
                           "SpikingJelly"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (record,) = tmp_path.glob("bench_stream_model_cpu_*.json")
    rows = json.loads(record.read_text())["results"]
    assert [r["kind"] for r in rows] == ["model", "recurrent"]
    for row in rows:
        assert set(row["p50_us"]) == {"flexgen Stream", "flexgen Stream, input in place", "flexgen, no stream",
                                      "torch eager"}
        assert row["spikes_differ"] == {"flexgen Stream, input in place": 0.0, "flexgen, no stream": 0.0,
                                        "torch eager": 0.0}
        assert row["step_peak_kib"] == {}  # the CPU has no allocator statistics
        assert row["p99_us"]["flexgen Stream"] >= row["p50_us"]["flexgen Stream"] > 0
    assert rows[1]["spike_rate"] > 0.05
    redrawn = tmp_path / "again"
    done = subprocess.run([sys.executable, script, "--replot", str(record), "--out", str(redrawn)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    md = record.with_suffix(".md")
    assert (redrawn / md.name).read_text() == md.read_text()
