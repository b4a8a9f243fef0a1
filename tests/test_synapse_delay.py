"""A delay per synapse in a recurrent layer's feedback (`Recurrent(..., delay=flexgen.SynapseDelay(...))`): the eager
loop against hand-written equations, every path against the eager loop in float64 (spikes equal, gradients within
1e-12), finite differences for fractional delays, calls in chunks, the long-sequence mode, and bad input."""
import pytest
import torch

import flexgen
from conftest import (HAS_C_COMPILER, HAS_CUDA, INTERPRETER, assert_budget_run_equals_the_default,
                      assert_func_grads_fused_equal_eager, assert_recurrent_same, max_rel_err, recurrent_grads)

HIDDEN, MAX_DELAY = 5, 3
TAPS = {"linear": {}, "gaussian": {"interpolation": "gaussian", "sigma": 0.8}}

# (backend, path, the path a call takes) of the float64 comparisons with the eager loop
RUNS = [("torch", "auto", "stepwise")] + ([("c", "auto", "stepwise")] if HAS_C_COMPILER else [])
if INTERPRETER:
    RUNS += [("triton", "fused", "fused"), ("triton", "stepwise", "stepwise")]


def synapse_delays(hidden=HIDDEN, max_delay=MAX_DELAY, seed=2, whole=False, dtype=torch.float64):
    values = torch.rand(hidden, hidden, generator=torch.Generator().manual_seed(seed), dtype=dtype) * max_delay
    return values.round() if whole else values


def recurrent_layer(backend, path="auto", neuron="LIF", taps="linear", delay=None, step_mode="m", hidden=HIDDEN,
                    max_delay=MAX_DELAY, learnable=True, **layer_options):
    torch.manual_seed(1)  # the same weight and bias for every layer of a test
    line = flexgen.SynapseDelay(hidden, max_delay, delay=synapse_delays(hidden, max_delay) if delay is None else delay,
                                learnable=learnable, dtype=torch.float64, **TAPS[taps])
    spec = flexgen.LIF if neuron == "LIF" else flexgen.neurons.alif
    options = dict(v_threshold=0.5) if neuron == "LIF" else dict(tau=2.0, v_threshold=0.5)
    layer = flexgen.Recurrent(spec, hidden=hidden, backend=backend, path=path, bias=True, delay=line,
                              step_mode=step_mode, **options, **layer_options).double()
    with torch.no_grad():
        layer.weight.mul_(2.0)  # enough feedback that the delays change the spikes
    return layer


def inputs(seed=0, steps=10, hidden=HIDDEN):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(steps, 3, hidden, generator=g, dtype=torch.float64) * 1.2
    return x, torch.rand(steps, 3, hidden, generator=g, dtype=torch.float64)


def test_tap_matrices_put_each_synapse_in_its_delays_taps():
    delay = torch.tensor([[0.0, 2.0], [1.25, 3.0]], dtype=torch.float64)
    line = flexgen.SynapseDelay(2, 3, delay=delay, dtype=torch.float64)
    weight = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    matrices = line.tap_matrices(weight).reshape(2, 4, 2)  # [out, tap, in]
    want = torch.zeros(2, 4, 2, dtype=torch.float64)
    want[0, 0, 0], want[0, 2, 1], want[1, 3, 1] = 1.0, 2.0, 4.0
    want[1, 1, 0], want[1, 2, 0] = 3.0 * 0.75, 3.0 * 0.25  # 1.25 steps: between the taps 1 and 2
    assert torch.equal(matrices, want)
    assert torch.equal(line(weight), line.tap_matrices(weight))


@pytest.mark.parametrize("neuron", ["LIF", "ALIF"])
def test_the_eager_loop_feeds_each_synapse_its_delayed_output(neuron):
    """With whole-step delays, step t's input is x_t + b + sum_i W[j, i] s_{t-1-d[j, i]}[i] (zero before the first
    step): the currents so built from the layer's own spikes give those spikes again through the neuron alone."""
    delay = synapse_delays(whole=True)
    layer = recurrent_layer("eager", neuron=neuron, delay=delay)
    x, _ = inputs(3, steps=12)
    spikes = layer(x).detach()
    steps = x.shape[0]
    current = x + layer.bias.detach()
    for t in range(steps):
        for j in range(HIDDEN):
            for i in range(HIDDEN):
                source = t - 1 - int(delay[j, i])
                if source >= 0:
                    current[t, :, j] += layer.weight.detach()[j, i] * spikes[source, :, i]
    layer.cell.reset()  # the layer's neuron alone, from its initial states
    assert torch.equal(layer.cell(current), spikes)
    assert 0 < spikes.sum() < spikes.numel()


@pytest.mark.parametrize("taps", TAPS)
@pytest.mark.parametrize("neuron", ["LIF", "ALIF"])
def test_every_path_matches_the_eager_loop(neuron, taps):
    """The fused kernels (interpreter), the step-wise path on the CPU (one autograd function over the neuron's torch
    code or C kernels) and on Triton's per-step kernels, against the eager loop."""
    x, weight = inputs()
    want = recurrent_grads(recurrent_layer("eager", neuron=neuron, taps=taps), x, weight)
    for backend, path, taken in RUNS:
        layer = recurrent_layer(backend, path, neuron=neuron, taps=taps)
        assert_recurrent_same(recurrent_grads(layer, x, weight), want)
        assert layer.path == taken
    assert want[1]["delay.delay"].abs().sum() > 0 and 0 < want[0].sum() < want[0].numel()
    cpu = recurrent_layer("torch", taps=taps)
    assert type(cpu(x.requires_grad_()).grad_fn).__name__ == "_SteppedBackward"  # one function, not a step each


@flexgen.neuron(states=("v",))
def leaky(x, v, beta=0.7):
    """No spikes: the fed-back output is smooth in the delays, which finite differences need."""
    h = beta * v + x
    return h, h


@pytest.mark.parametrize("taps", TAPS)
@pytest.mark.parametrize("backend,path", [("eager", "auto")] + ([("triton", "fused")] if INTERPRETER else []) +
                         [("torch", "stepwise")])
def test_fractional_delays_gradients_match_finite_differences(backend, path, taps):
    delay = synapse_delays(3, seed=4) * 0.9 + 0.05  # away from whole steps, where linear taps have a kink
    line = flexgen.SynapseDelay(3, MAX_DELAY, delay=delay, dtype=torch.float64, **TAPS[taps])
    layer = flexgen.Recurrent(leaky, hidden=3, backend=backend, path=path, delay=line).double()
    x, weight = inputs(5, steps=7, hidden=3)

    def loss(values):
        layer.reset()
        output = torch.func.functional_call(layer, {"delay.delay": values}, (x,))
        return (output * weight).sum()

    assert torch.autograd.gradcheck(loss, (line.delay.detach().clone().requires_grad_(),), eps=1e-6, atol=1e-8)


CHUNKINGS = {
    "halves": [slice(0, 5), slice(5, 10)],
    "short-chunks": [slice(0, 1), slice(1, 3), slice(3, 4), slice(4, 9), slice(9, 10)],
}


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("backend,path", [("eager", "auto")] + [run[:2] for run in RUNS])
@pytest.mark.parametrize("taps", TAPS)
def test_calls_on_consecutive_chunks_equal_one_call(backend, path, chunking, taps):
    """The layer keeps the outputs of its last max_delay + 1 steps (`sent`): chunks that continue them give one
    call's spikes, and (left connected) its gradients within 1e-12."""
    x, weight = inputs(6)
    want = recurrent_grads(recurrent_layer("eager", taps=taps), x, weight)
    layer = recurrent_layer(backend, path, taps=taps)
    assert_recurrent_same(recurrent_grads(layer, x, weight, CHUNKINGS[chunking]), want)
    assert layer.sent.shape == (MAX_DELAY + 1, 3, HIDDEN)


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRETER else []))
def test_streaming_one_step_at_a_time_equals_one_call(backend):
    x, weight = inputs(7)
    want = recurrent_grads(recurrent_layer("eager"), x, weight)
    layer = recurrent_layer(backend, step_mode="s")
    assert_recurrent_same(recurrent_grads(layer, x, weight, [slice(t, t + 1) for t in range(10)]), want)


def test_a_history_given_as_previous_output_continues_the_lines():
    x, _ = inputs(8)
    whole = recurrent_layer("torch")
    out = whole(x)
    part = recurrent_layer("torch")
    part(x[:6])
    history = part.sent
    fresh = recurrent_layer("torch")
    states = list(part.final_states.values())
    assert torch.equal(fresh(x[6:], states=states, previous_output=history), out[6:])


def test_reset_and_detach():
    layer = recurrent_layer("torch")
    x, _ = inputs(9)
    layer(x.requires_grad_())
    assert layer.sent.requires_grad
    layer.detach()
    assert not layer.sent.requires_grad and layer.sent.shape[0] == MAX_DELAY + 1
    layer.reset()
    assert layer.sent is None and layer.final_output is None


def test_delays_past_the_sequence_feed_back_nothing():
    """max_delay larger than T: every delay reaches past the end, so the feedback is zero and the layer is its
    neuron on x + b."""
    layer = recurrent_layer("torch", delay=torch.full((HIDDEN, HIDDEN), 12.0, dtype=torch.float64), max_delay=12)
    x, _ = inputs(10, steps=8)
    out = layer(x)
    layer.cell.reset()
    assert torch.equal(out, layer.cell(x + layer.bias.detach()))


def test_max_delay_zero_is_the_layer_without_delays():
    """One tap matrix, the weight itself: every path runs it as the undelayed layer (the fused path its kernels)."""
    x, weight = inputs(17)
    for backend, path, taken in [("eager", "auto", "eager")] + RUNS:
        torch.manual_seed(1)
        plain = flexgen.Recurrent(flexgen.LIF, hidden=HIDDEN, backend=backend, path=path, bias=True,
                                  v_threshold=0.5).double()
        layer = recurrent_layer(backend, path, max_delay=0, delay=torch.zeros(HIDDEN, HIDDEN, dtype=torch.float64))
        with torch.no_grad():
            plain.weight.copy_(layer.weight)
            plain.bias.copy_(layer.bias)
        got, want = recurrent_grads(layer, x, weight), recurrent_grads(plain, x, weight)
        assert torch.equal(got[0], want[0]) and layer.path == taken
        for name in want[1]:
            assert max_rel_err(got[1][name], want[1][name]) <= 1e-12, name


def test_learnable_delays_outside_the_range_are_used_at_the_nearest_bound():
    outside = synapse_delays() * 2.0 - 1.0  # from -1 to 2 max_delay - 1
    x, weight = inputs(11)
    got = recurrent_grads(recurrent_layer("torch", delay=outside), x, weight)
    want = recurrent_grads(recurrent_layer("torch", delay=outside.clamp(0.0, MAX_DELAY)), x, weight)
    assert torch.equal(got[0], want[0])
    assert max_rel_err(got[1]["weight"], want[1]["weight"]) <= 1e-12


def test_bad_delays_are_clear_errors():
    with pytest.raises(ValueError, match=r"SynapseDelay of 4 neurons; a recurrent layer of 5 neurons needs "
                                         r"flexgen.SynapseDelay\(5, max_delay=...\)"):
        flexgen.Recurrent(flexgen.LIF, hidden=5, delay=flexgen.SynapseDelay(4, 2))
    with pytest.raises(TypeError, match="or a flexgen.SynapseDelay"):
        flexgen.Recurrent(flexgen.LIF, hidden=5, delay=flexgen.DelayedLinear(5, 5, 2))
    with pytest.raises(ValueError, match=r"the fixed delay of synapse 1 -> 0 \(delay\[0, 1\]\) is 4.0, outside"):
        flexgen.SynapseDelay(2, 3, delay=torch.tensor([[0.0, 4.0], [1.0, 1.0]]), learnable=False)
    with pytest.raises(ValueError, match=r"delays a weight \[3, 3\], got \[3, 4\]"):
        flexgen.SynapseDelay(3, 2).tap_matrices(torch.ones(3, 4))
    layer = flexgen.Recurrent(flexgen.LIF, hidden=3, backend="torch", delay=flexgen.SynapseDelay(3, 2))
    with torch.no_grad():
        layer.delay.delay[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"the delay of synapse 1 -> 2 \(delay\[2, 1\]\) is NaN"):
        layer(torch.rand(4, 1, 3))


def test_the_generated_kernels_show_the_tap_matrices():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=4, delay=flexgen.SynapseDelay(4, 2))
    forward, backward, module = layer.source("forward"), layer.source("backward"), layer.source("module")
    assert "N_TAPS: tl.constexpr," in forward and "rec_src = row - 1 - rec_tap" in forward
    assert "rec_src = row + 1 + rec_tap" in backward and "rec_ring_ptr" not in backward
    assert "tap matrices side by side" in module
    with pytest.raises(ValueError, match="kind must be one of"):
        layer.source("replay")  # the long-sequence mode replays layers without delays only


@pytest.mark.parametrize("budget", ["7KiB", "1GiB"])
def test_the_long_sequence_mode_carries_the_lines_across_segments(budget):
    def layer(**options):
        torch.manual_seed(3)
        cell = flexgen.Recurrent(flexgen.LIF, hidden=4, backend="torch", v_threshold=0.5,
                                 delay=flexgen.SynapseDelay(4, 5, delay=synapse_delays(4, 5)))
        made = flexgen.Dense(3, 4, cell, backend="torch", **options).double()
        with torch.no_grad():
            made.weight.mul_(3.0)
            cell.weight.mul_(2.0)
        return made

    assert_budget_run_equals_the_default(layer, budget)


def test_copies_keep_the_delays_and_the_history():
    import copy

    layer = recurrent_layer("torch")
    x, _ = inputs(12)
    layer(x[:4])
    twin = copy.deepcopy(layer)
    assert torch.equal(twin(x[4:]), layer(x[4:]))


@pytest.mark.skipif(not INTERPRETER, reason="float64 fused recurrent kernels run in Triton's interpreter only")
@pytest.mark.parametrize("taps", TAPS)
def test_torch_func_grad_through_the_fused_kernels(taps):
    x, weight = inputs(15)
    assert_func_grads_fused_equal_eager(lambda backend, path: recurrent_layer(backend, path, taps=taps), x, weight)


def test_inference_without_a_gradient_gives_the_training_calls_spikes():
    x, _ = inputs(16)
    runs = [("eager", "auto")] + [run[:2] for run in RUNS]
    trained = recurrent_layer("eager")(x.clone().requires_grad_()).detach()
    for backend, path in runs:
        with torch.no_grad():
            assert torch.equal(recurrent_layer(backend, path)(x), trained), backend


def norm_err(got, truth):
    return ((got.double() - truth).norm() / truth.norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="needs a CUDA GPU")
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("taps", TAPS)
def test_fused_synapse_delays_in_float64_on_the_gpu_match_the_eager_loop(taps, split):
    from flexgen.launch.compat import fp64_dot_error
    from flexgen.launch.recurrent.fused import RecurrentConfig

    if fp64_dot_error(torch.cuda.current_device()) is not None:
        pytest.skip("this Triton has no float64 tl.dot on the GPU")
    hidden = 64
    x, weight = inputs(13, steps=12, hidden=hidden)
    results = []
    for backend, device in (("triton", "cuda"), ("eager", "cpu")):
        layer = recurrent_layer(backend, taps=taps, hidden=hidden, config=RecurrentConfig(split=split)).to(device)
        out, grads = recurrent_grads(layer, x.to(device), weight.to(device))
        results.append((out.cpu(), {k: v.cpu() for k, v in grads.items()}))
        assert layer.path == ("fused" if backend == "triton" else "eager")
    assert 0 < results[1][0].sum() < results[1][0].numel() and results[1][1]["delay.delay"].abs().sum() > 0
    assert_recurrent_same(*results)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("taps", TAPS)
def test_fused_synapse_delays_on_the_gpu_match_a_float64_truth(taps, dtype):
    """fp32 and bf16 against the float64 step-wise truth on the same input. fp32 (3xTF32 products): few spikes
    flip and the gradients stay within 1e-2. bf16 rounds the tap matrices and the operands, and a flipped spike
    changes every later gradient, so the fused path is held to the step-wise path's own error in that dtype."""
    hidden = 64
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(40, 16, hidden, generator=g) * 1.2).to("cuda", dtype)
    weight = torch.rand(40, 16, hidden, device="cuda").to(dtype)

    def grads(backend, path, dtype_of_layer):
        layer = recurrent_layer(backend, path, taps=taps, hidden=hidden).to(dtype_of_layer).cuda()
        result = recurrent_grads(layer, x.to(dtype_of_layer), weight.to(dtype_of_layer))
        assert layer.path == path
        return result

    truth = grads("torch", "stepwise", torch.float64)
    paths = {"fused": grads("triton", "fused", dtype), "stepwise": grads("triton", "stepwise", dtype)}
    flips = {path: (out.double() != truth[0]).float().mean().item() for path, (out, _) in paths.items()}
    errors = {path: {name: norm_err(got[name], truth[1][name]) for name in truth[1]}
              for path, (_, got) in paths.items()}
    if dtype == torch.float32:
        assert flips["fused"] < 1e-2 and max(errors["fused"].values()) < 1e-2, (flips, errors)
        return
    assert flips["fused"] <= max(1.5 * flips["stepwise"], 1e-2), flips
    for name in truth[1]:
        assert errors["fused"][name] <= 1.5 * errors["stepwise"][name] + 1e-2, (name, errors)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="needs a CUDA GPU")
def test_torch_compile_fullgraph_runs_synapse_delays_fused():
    x, weight = inputs(14, hidden=32)
    x, weight = x.float().cuda(), weight.float().cuda()
    eager = recurrent_layer("triton", "fused", hidden=32).float().cuda()
    compiled_layer = recurrent_layer("triton", "fused", hidden=32).float().cuda()
    want = recurrent_grads(eager, x, weight)
    compiled = torch.compile(compiled_layer, fullgraph=True)
    xi = x.clone().requires_grad_()
    out = compiled(xi)
    names, params = zip(*sorted(compiled_layer.named_parameters()))
    grads = dict(zip(("input", *names), torch.autograd.grad((out * weight).sum(), [xi, *params])))
    assert torch.equal(out, want[0])
    for name in want[1]:
        assert max_rel_err(grads[name], want[1][name]) <= 1e-5, name
