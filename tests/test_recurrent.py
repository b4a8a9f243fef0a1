"""Recurrent layers (`flexgen.Recurrent`): the fused kernels and the step-wise path against the eager loop of the
step function in float64, the eager loop against hand-written equations, path choice, bad arguments, and
snnTorch's RLeaky."""
import re
import warnings
import zlib

import pytest
import torch

import flexgen
from conftest import HAS_C_COMPILER, HAS_CUDA, INTERPRETER, TRITON_DEVICE
from flexgen.launch.compat import direct_launch, fp64_dot_error
from flexgen.launch.recurrent.fused import RecurrentConfig, Tiling
from flexgen.neurons import alif
from reference import RefSpike, sigmoid_grad
from specs import adaptive_mix

# float64 against the eager loop: the same expressions in another order (the product, the fused backward's sums), so
# rounding only: elementwise within TOL of the reference's largest magnitude (measured: 1.1e-15 CPU, 9.3e-16 H200).
TOL = 1e-12


@flexgen.neuron(states=("v", "i"), learnable=("k",))
def current_lif(x, v, i, k=0.4, tau=2.0, v_th=1.0):
    """Two states and a learnable parameter: a synaptic current that decays at rate sigmoid(k) drives a LIF."""
    i_new = i - flexgen.sigmoid(k) * i + x
    h = v + (i_new - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h - flexgen.detach(s) * v_th, i_new


# (neuron, layer options, input scale). fp64 runs pass hyper-parameters at fp64, so a value fp32 cannot hold
# (alif's beta 1.8) compares at TOL too.
NEURONS = {
    "LIF": (flexgen.LIF, {"tau": 2.0}, 3.0),
    "alif": (alif, {"tau": 4.0, "tau_a": 16.0, "beta": 1.8}, 6.0),
    "current_lif": (current_lif, {"per_neuron": True}, 1.5),
    "adaptive_mix": (adaptive_mix, {"output_name": "h"}, 2.0),  # two inputs; the membrane potential is fed back
}

# (backend, path) of the float64 comparisons: the torch path step by step, and the Triton kernels fused and step by
# step. The fused kernels' float64 products need a Triton whose tl.dot takes float64 on the GPU (FP64_FUSED); the
# tests that also run under torch.compile or compare launch paths use FUSED_DTYPE, fp32 on CUDA.
FP64_FUSED = INTERPRETER or (HAS_CUDA and fp64_dot_error(torch.cuda.current_device()) is None)
RUNS = [("torch", "stepwise")] + ([("c", "stepwise")] if HAS_C_COMPILER else [])
if FP64_FUSED:
    RUNS += [("triton", "fused")]
if INTERPRETER or HAS_CUDA:
    RUNS += [("triton", "stepwise")]
FUSED_DTYPE = torch.float64 if INTERPRETER else torch.float32
FUSED_TOL = {torch.float64: TOL, torch.float32: 1e-5}[FUSED_DTYPE]
needs_triton = pytest.mark.skipif(not (INTERPRETER or HAS_CUDA), reason="needs Triton (CUDA or TRITON_INTERPRET=1)")


def make_layer(name, backend, path, hidden, bias=True, scale=False, seed=0, dtype=torch.float64, config=None):
    neuron, options, _ = NEURONS[name]
    if config is not None:
        options = dict(options, config=config)
    layer = flexgen.Recurrent(neuron, hidden=hidden, bias=bias, scale=scale, backend=backend, path=path, **options)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():  # recurrent weights large enough that the feedback changes the spikes
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 if p is layer.weight else 0.5))
    return layer.to(device=TRITON_DEVICE if backend == "triton" else "cpu", dtype=dtype)


def make_inputs(name, shape, device, seed):
    neuron, _, magnitude = NEURONS[name]
    spec = neuron.spec if isinstance(neuron, type) else neuron
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(shape, generator=g, dtype=torch.float64) * magnitude).to(device).requires_grad_()
            for _ in spec.signature.inputs]


def as_list(result):
    return list(result) if isinstance(result, tuple) else [result]


def run_and_grad(layer, inputs, states=None, seed=1):
    """Outputs, final states and the gradients of a random linear loss of both: inputs, initial states, every
    parameter (None where unused)."""
    outputs = as_list(layer(*inputs, states=states))
    finals = list(layer.final_states.values())
    g = torch.Generator().manual_seed(seed)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)).sum() for t in outputs + finals)
    leaves = list(inputs) + list(states or []) + list(layer.parameters())
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return outputs, finals, grads


def max_rel_err(a, b):
    """The largest elementwise difference over the largest magnitude of `b` (one bad element is not diluted)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else (a if b is None else b).abs().max().item()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


def assert_matches_eager(name, backend, path, shape, bias=True, scale=False, states=None, config=None):
    hidden = shape[2]
    layer = make_layer(name, backend, path, hidden, bias, scale, config=config)
    oracle = make_layer(name, "eager", "auto", hidden, bias, scale)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    inputs = make_inputs(name, shape, device, seed=zlib.crc32(name.encode()) % 1000)
    got = run_and_grad(layer, inputs, states)
    ref = run_and_grad(oracle, [x.detach().cpu().requires_grad_() for x in inputs],
                       [v.detach().cpu().requires_grad_() for v in states] if states else None)
    assert layer.path == path and oracle.path == "eager"
    assert torch.equal(got[0][0].cpu(), ref[0][0]), "spikes differ from the eager loop"
    assert got[0][0].sum() > 0, "no spikes: the comparison would not test the feedback"
    for a, b in zip(got[0][1:] + got[1], ref[0][1:] + ref[1]):
        assert max_rel_err(a.cpu(), b) <= TOL
    names = [f"input {k}" for k in range(len(inputs))] + [f"state {k}" for k in range(len(states or []))]
    names += [n for n, _ in layer.named_parameters()]
    for what, a, b in zip(names, got[2], ref[2]):
        assert max_rel_err(a.cpu() if a is not None else None, b) <= TOL, f"gradient of {what}"
    return dict(zip(names, got[2]))


@pytest.mark.parametrize("backend,path", RUNS)
@pytest.mark.parametrize("name", sorted(NEURONS))
@pytest.mark.parametrize("shape", [(5, 3, 37), (4, 1, 20), (1, 2, 9)], ids=["H37", "B1", "T1"])
def test_matches_eager_loop_in_float64(backend, path, name, shape):
    grads = assert_matches_eager(name, backend, path, shape)
    if shape[0] == 1:  # nothing was fed back yet
        assert grads["weight"] is None or not grads["weight"].any()


@pytest.mark.parametrize("backend,path", RUNS)
def test_initial_states_scale_and_no_bias(backend, path):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(5)
    states = [(torch.rand(3, 21, generator=g, dtype=torch.float64) * 0.5).to(device).requires_grad_() for _ in range(2)]
    assert_matches_eager("alif", backend, path, (4, 3, 21), bias=False, scale=True, states=states)


@pytest.mark.parametrize("backend,path", RUNS + [("eager", "auto")])
@pytest.mark.parametrize("name", ["alif", "adaptive_mix"])
@pytest.mark.parametrize("how", ["kept", "given"])
def test_a_sequence_run_in_chunks_equals_the_whole(backend, path, name, how):
    """Two calls continue a sequence, from the states and output the layer kept ("kept") or from the ones passed
    back to it ("given"): the same outputs and, the chunks left connected, the same gradients (adaptive_mix feeds
    back its membrane potential, not spikes)."""
    layer = make_layer(name, backend, path, hidden=13)
    inputs = make_inputs(name, (8, 3, 13), TRITON_DEVICE if backend == "triton" else "cpu", seed=4)
    params = list(layer.parameters())
    whole = as_list(layer(*inputs))
    g = [torch.randn(w.shape, generator=torch.Generator().manual_seed(k), dtype=w.dtype).to(w.device)
         for k, w in enumerate(whole)]
    expected = torch.autograd.grad(sum((w * gk).sum() for w, gk in zip(whole, g)), inputs + params, allow_unused=True)
    layer.reset()
    first = as_list(layer(*[x[:4] for x in inputs]))
    if how == "kept":
        rest = as_list(layer(*[x[4:] for x in inputs]))
    else:
        states, previous = list(layer.final_states.values()), layer.final_output
        layer.reset()
        rest = as_list(layer(*[x[4:] for x in inputs], states=states, previous_output=previous))
    chunked = [torch.cat([a, b]) for a, b in zip(first, rest)]
    for c, w in zip(chunked, whole):  # the first chunk's product is added in another order: equal up to rounding
        assert max_rel_err(c, w) <= 1e-12
    if name == "alif":
        assert torch.equal(chunked[0], whole[0]), "spikes differ"
    assert whole[0][4:].sum() > 0 and layer.final_output.abs().sum() > 0, "nothing fed across the chunks"
    got = torch.autograd.grad(sum((c * gk).sum() for c, gk in zip(chunked, g)), inputs + params, allow_unused=True)
    for a, b in zip(got, expected):
        assert max_rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("backend,path", RUNS + [("eager", "auto")])
def test_one_step_per_call_equals_the_sequence(backend, path):
    """step_mode="s" (streaming inference, or training one step at a time) continues from the kept states: the
    spikes of the multi-step call, and the same gradients."""
    layer = make_layer("alif", backend, path, hidden=11)
    stepper = make_layer("alif", backend, path, hidden=11)
    stepper.step_mode = "s"
    x = make_inputs("alif", (6, 2, 11), TRITON_DEVICE if backend == "triton" else "cpu", seed=8)[0]
    whole = layer(x)
    steps = torch.stack([stepper(x[t]) for t in range(x.shape[0])])
    assert torch.equal(steps, whole) and whole[3:].sum() > 0
    g = torch.randn(whole.shape, generator=torch.Generator().manual_seed(2), dtype=whole.dtype).to(whole.device)
    params = list(layer.parameters())
    expected = torch.autograd.grad((whole * g).sum(), [x, *params], allow_unused=True)
    got = torch.autograd.grad((steps * g).sum(), [x, *stepper.parameters()], allow_unused=True)
    for a, b in zip(got, expected):
        assert max_rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("backend,path", RUNS + [("eager", "auto")])
def test_reset_starts_over_and_detach_cuts_the_gradient(backend, path):
    layer = make_layer("alif", backend, path, hidden=9)
    x = make_inputs("alif", (5, 2, 9), TRITON_DEVICE if backend == "triton" else "cpu", seed=9)[0]
    first = layer(x)
    layer.reset()
    assert layer.final_states == {} and layer.final_output is None
    assert torch.equal(layer(x), first), "after reset() the call starts from the initial states"
    second = layer(x)
    assert not torch.equal(second, first), "without reset() the call continues (and the feedback changes it)"
    layer.reset()
    layer(x).sum().backward()
    x.grad = None
    layer.detach()
    assert all(not v.requires_grad for v in layer.final_states.values()) and not layer.final_output.requires_grad
    kept = {k: v.clone() for k, v in layer.final_states.items()}
    layer(x).sum().backward()  # stops at the detached states: the first call's freed graph is not reached
    assert x.grad is not None
    third = make_layer("alif", backend, path, hidden=9)
    third(x)
    assert all(torch.equal(third.final_states[k], kept[k]) for k in kept)


@pytest.mark.parametrize("backend,path", RUNS)
def test_a_second_backward_into_a_freed_call_says_reset_or_detach(backend, path):
    layer = make_layer("alif", backend, path, hidden=9)
    x = make_inputs("alif", (5, 2, 9), TRITON_DEVICE if backend == "triton" else "cpu", seed=9)[0]
    layer(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"layer.reset\(\) before each new sequence, or layer.detach\(\)"):
        layer(x).sum().backward()


def test_kept_states_from_another_batch_or_device_are_refused():
    layer = flexgen.Recurrent(alif, hidden=4, backend="torch")
    layer(torch.rand(3, 2, 4))
    with pytest.raises(ValueError, match=r"whose batch had 2 rows; this call has 5. Call layer.reset\(\)"):
        layer(torch.rand(3, 5, 4))
    layer.final_states = {k: v.to("meta") for k, v in layer.final_states.items()}
    with pytest.raises(ValueError, match="whose states are on meta; this call's inputs are on cpu"):
        layer(torch.rand(3, 2, 4))
    layer.reset()
    assert layer(torch.rand(3, 5, 4)).shape == (3, 5, 4)


def test_given_states_override_the_kept_ones_and_reset_reaches_nested_layers():
    layer = flexgen.Recurrent(alif, hidden=4, backend="torch").double()
    net = torch.nn.Sequential(layer)
    x = torch.rand(6, 2, 4, dtype=torch.float64) * 4
    fresh = net(x)
    net(x)
    zeros = [torch.zeros(2, 4, dtype=torch.float64)] * 2
    assert torch.equal(layer(x, states=zeros), fresh), "given states start there, with a zero previous output"
    flexgen.reset(net)
    assert layer.final_states == {} and torch.equal(net(x), fresh)


def test_kept_states_follow_to_and_copies_hold_their_values():
    import copy
    import pickle

    layer = flexgen.Recurrent(alif, hidden=4, backend="torch")
    x = torch.rand(3, 2, 4, requires_grad=True)
    layer(x)
    assert layer.final_states["v"].requires_grad
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert all(torch.equal(other.final_states[k], v.detach()) and not other.final_states[k].requires_grad
                   for k, v in layer.final_states.items())
        assert torch.equal(other.final_output, layer.final_output)
    layer.double()
    assert layer.final_states["v"].dtype == torch.float64 and layer.final_output.dtype == torch.float64


def test_a_stateless_neuron_continues_from_its_output():
    @flexgen.neuron(states=())
    def gate(x, k=0.5):
        return flexgen.spike(x - k)

    layer = flexgen.Recurrent(gate, hidden=5, backend="torch").double()
    with torch.no_grad():
        layer.weight.copy_(torch.eye(5) * 2.0)
    x = torch.zeros(4, 1, 5, dtype=torch.float64)
    x[0, 0, 0] = 1.0  # one spike, then kept alive by the feedback alone
    whole = layer(x)
    layer.reset()
    chunked = torch.cat([layer(x[:2]), layer(x[2:])])
    assert torch.equal(chunked, whole) and whole[:, 0, 0].tolist() == [1.0] * 4


@pytest.mark.parametrize("backend", ["torch", pytest.param("c", marks=pytest.mark.skipif(
    not HAS_C_COMPILER, reason="needs a C compiler"))])
def test_the_cpu_steps_run_as_one_function_and_torch_func_still_differentiates(backend):
    """On the CPU the step-wise loop is one autograd function (`flexgen.launch.recurrent.stepped`; on the C target the one
    that calls the kernels on rows of whole-sequence arrays); under torch.func, which it does not support, each step
    is its own call, and the gradients agree."""
    layer = make_layer("alif", backend, "stepwise", hidden=7)
    x = make_inputs("alif", (5, 2, 7), "cpu", seed=11)[0]
    out = layer(x)
    assert type(out.grad_fn).__name__ == {"torch": "_SteppedBackward", "c": "_SteppedRowsBackward"}[backend]
    expected = torch.autograd.grad(out.sum(), x)[0]

    def loss(x):
        layer.reset()
        return layer(x).sum()

    got = torch.func.grad(loss)(x.detach())
    assert max_rel_err(got, expected) <= 1e-12


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="custom ops of Triton kernels are traced on CUDA (the "
                    "interpreter runs kernels on fake tensors)")
@pytest.mark.parametrize("path,delayed,hidden,config", [
    ("fused", False, 6, RecurrentConfig()), ("fused", "linear", 6, RecurrentConfig()),
    ("stepwise", False, 6, RecurrentConfig()), ("fused", "linear", 64, RecurrentConfig(split=4)),
    ("fused", "gaussian", 64, RecurrentConfig(split=4)), ("fused", False, 64, RecurrentConfig(stationary=True))],
    ids=["fused", "fused-delayed", "stepwise", "fused-delayed-in-slices", "fused-gaussian-in-slices",
         "fused-stationary"])
def test_torch_compile_fullgraph_runs_the_fused_kernels_as_custom_ops(path, delayed, hidden, config):
    """Under torch.compile(fullgraph=True) a fused layer stays fused: its kernels are custom ops in the graph (no
    graph break), and the outputs, final states and every gradient equal the eager fused call's. A step-wise layer
    compiles whole too (its first call inside the compiler, before any eager call)."""
    import torch._dynamo

    neuron, options, _ = NEURONS["alif"]
    torch.manual_seed(0)
    layers = [flexgen.Recurrent(neuron, hidden=hidden, backend="triton", path=path, config=config,
                                delay=flexgen.Delay(hidden, 3, interpolation=delayed) if delayed else None, **options)
              for _ in range(2)]
    with torch.no_grad():
        layers[0].weight.mul_(6.0)  # a feedback strong enough to change the spikes
    layers[1].load_state_dict(layers[0].state_dict())
    layers = [layer.to(TRITON_DEVICE, FUSED_DTYPE) for layer in layers]
    x = make_inputs("alif", (7, 2, hidden), TRITON_DEVICE, seed=3)[0].to(FUSED_DTYPE).detach()
    weight = torch.rand(x.shape, dtype=FUSED_DTYPE, device=TRITON_DEVICE)

    def run(layer, x):
        layer.reset()
        out = layer(x)
        return out, *layer.final_states.values()

    results = []
    for layer, fn in ((layers[1], torch.compile(run, fullgraph=True)), (layers[0], run)):
        xs = x.clone().requires_grad_()
        out, *finals = fn(layer, xs)
        loss = (out * weight).sum() + sum(f.sum() for f in finals)
        grads = torch.autograd.grad(loss, [xs, *layer.parameters()])
        assert layer.path == path
        results.append((out.detach(), [f.detach() for f in finals], grads))
    (out1, finals1, grads1), (out0, finals0, grads0) = results
    assert torch.equal(out1, out0) and out0.sum() > 0
    for a, b in zip(finals1 + list(grads1), finals0 + list(grads0)):
        assert max_rel_err(a, b) <= FUSED_TOL
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda x: run(layers[1], x))(x)
    assert explained.graph_break_count == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="custom ops of Triton kernels are traced on CUDA")
def test_a_changed_interpolation_inside_torch_compile_runs_step_by_step_without_a_graph_break():
    """DCLS's recipe switches a trained layer's gaussian taps to linear ones: the first call inside
    torch.compile(fullgraph=True) after the switch cannot look its kernels up (that would break the graph), so it
    runs step by step and equals the eager fused call; after an eager call the compiled call is fused again."""
    import torch._dynamo

    torch.manual_seed(0)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=16, backend="triton", v_threshold=0.5,
                              delay=flexgen.Delay(16, 3, interpolation="gaussian", sigma=1.0)).to("cuda")
    x = (torch.rand(9, 2, 16, device="cuda") * 1.2)

    def run(x):
        layer.reset()
        return layer(x)

    layer.delay.interpolation = "linear"
    torch._dynamo.reset()
    assert torch._dynamo.explain(run)(x).graph_break_count == 0
    compiled = torch.compile(run, fullgraph=True)
    got = compiled(x)
    assert layer.path == "stepwise"
    want = run(x)  # eager: looks the linear kernels up
    assert layer.path == "fused"
    assert (got != want).float().mean() < 1e-2 and want.sum() > 0  # fp32 products round differently on the paths
    torch._dynamo.reset()
    assert torch.equal(torch.compile(run, fullgraph=True)(x), want) and layer.path == "fused"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="compiled launchers are CUDA's")
def test_fused_calls_through_the_compiled_launcher_equal_tritons_own_path():
    """After the first call of each specialisation (batch size, dtype, ...) the fused kernels launch through their
    compiled launcher; outputs and gradients are bitwise those of a call that goes through Triton's path."""
    layer = make_layer("alif", "triton", "fused", hidden=24, dtype=torch.float32)
    compiled = layer.compiled()
    for batch, dtype in [(16, torch.float32), (33, torch.float32), (16, torch.bfloat16), (16, torch.float32)]:
        x = make_inputs("alif", (9, batch, 24), "cuda", seed=batch)[0].detach().to(dtype).requires_grad_()
        results = []
        for cached in (False, True, True):
            if not cached:
                compiled.argument_plans.clear()
            layer.reset()
            out = layer(x)
            grads = torch.autograd.grad((out.float() * torch.arange(9, device="cuda")[:, None, None]).sum(),
                                        [x, *layer.parameters()])
            results.append([out, *grads])
        plans = compiled.argument_plans.values()
        assert sorted(kind for kind, *_ in compiled.argument_plans) == ["backward", "forward"]
        assert all(plan.kernel.direct == direct_launch() for plan in plans)  # Triton >= 3.3
        assert all(plan.kernel.compiled for plan in plans if plan.kernel.direct)
        for got in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


@needs_triton
def test_parameters_in_another_dtype_are_cast_inside_the_fused_function():
    """fp32 parameters with inputs in the kernels' dtype: the fused function casts the weight and bias itself (no
    autograd node of their own between them and their gradients), and the gradients come in the parameters' dtype,
    equal to the step-wise path's (where autograd casts), to the parameters' precision."""
    if not FP64_FUSED:
        pytest.skip("this Triton has no float64 tl.dot on the GPU")
    x = make_inputs("alif", (6, 3, 5), "cpu", seed=4)[0].detach().to(TRITON_DEVICE)
    grads = {}
    for backend, path in (("triton", "fused"), ("torch", "stepwise")):
        layer = make_layer("alif", backend, path, hidden=5, dtype=torch.float32).to(x.device)
        given = x.clone().requires_grad_()
        out = layer(given)
        assert out.dtype == torch.float64 and layer.path == path
        if path == "fused":
            reached = {type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None}
            assert reached == {"AccumulateGrad"}  # the input, the weight, the bias, the ALIF's parameters
        grads[path] = torch.autograd.grad((out * torch.arange(6.0, device=x.device)[:, None, None]).sum(),
                                          [given, layer.weight, layer.bias])
    for fused, stepwise, dtype in zip(grads["fused"], grads["stepwise"], (torch.float64, torch.float32, torch.float32)):
        assert fused.dtype == stepwise.dtype == dtype
        torch.testing.assert_close(fused, stepwise, rtol=1e-6, atol=1e-6)


@needs_triton
def test_eager_fused_calls_reuse_the_argument_plan_of_their_signature():
    """An eager fused call keeps its kernels' arguments per call signature (shapes, strides, dtypes, numbers) and
    later calls of that signature only put their tensors in, with the results of arguments built afresh; a call
    of another signature gets plans of its own."""
    layer = make_layer("alif", "triton", "fused", hidden=6, dtype=FUSED_DTYPE)
    plans = layer.compiled().argument_plans
    x = make_inputs("alif", (5, 3, 6), "cpu", seed=8)[0].detach().to(TRITON_DEVICE, FUSED_DTYPE)
    weight = torch.rand(x.shape, dtype=FUSED_DTYPE, device=TRITON_DEVICE)

    def run(given, fresh):
        if fresh:
            plans.clear()
        layer.reset()
        given = given.clone().requires_grad_()
        out = layer(given)
        return [out, *torch.autograd.grad((out * weight[:, :given.shape[1]]).sum(), [given, *layer.parameters()])]

    first = run(x, fresh=True)
    assert sorted(kind for kind, *_ in plans) == ["backward", "forward"]
    for got in (run(x, fresh=False), run(x, fresh=False)):
        assert all(torch.equal(a, b) for a, b in zip(got, first))
    assert len(plans) == 2
    narrower = run(x[:, :2], fresh=False)
    assert len(plans) == 4
    assert all(torch.equal(a, b) for a, b in zip(narrower, run(x[:, :2], fresh=True)))


@needs_triton
@pytest.mark.parametrize("name", ["alif", "current_lif"])
def test_torch_func_grad_runs_the_fused_kernels_and_matches_the_eager_loop(name):
    """Under torch.func the fused path runs through an autograd function in the setup_context style whose
    backward gets plain tensors; the gradients of the input and of every parameter equal the eager loop's."""
    if not FP64_FUSED:
        pytest.skip("this Triton has no float64 tl.dot on the GPU")
    layers = [make_layer(name, backend, path, hidden=6) for backend, path in (("triton", "fused"), ("eager", "auto"))]
    x = make_inputs(name, (7, 2, 6), "cpu", seed=5)[0].detach()
    weight = torch.rand(7, 2, 6, dtype=torch.float64)
    grads = []
    for layer in layers:
        device = layer.weight.device
        params = dict(layer.named_parameters())

        def loss(params, x, layer=layer, weight=weight.to(device)):
            layer.reset()
            out = torch.func.functional_call(layer, params, (x,))
            return ((out[0] if isinstance(out, tuple) else out) * weight).sum()

        grads.append(torch.func.grad(loss, argnums=(0, 1))(params, x.to(device)))
    assert layers[0].path == "fused"
    (params_f, x_f), (params_e, x_e) = grads
    assert max_rel_err(x_f.cpu(), x_e) <= 1e-12
    for key in params_e:
        assert max_rel_err(params_f[key].cpu(), params_e[key]) <= 1e-12, key


def test_previous_output_is_checked():
    layer = flexgen.Recurrent(alif, hidden=4, backend="torch")
    x = torch.rand(3, 2, 4)
    assert layer.final_output is None
    with pytest.raises(ValueError, match=r"previous_output must broadcast to \[B, 4\] = \[2, 4\], got \[3, 4\]"):
        layer(x, previous_output=torch.zeros(3, 4))
    with pytest.raises(TypeError, match="previous_output must be a tensor"):
        layer(x, previous_output=[0.0] * 4)
    layer(x, previous_output=torch.ones(4))  # broadcast over the batch
    assert layer.final_output.shape == (2, 4)
    assert torch.equal(layer(x[:0], previous_output=torch.ones(2, 4)), x[:0]) and torch.equal(layer.final_output, torch.ones(2, 4))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_the_layer_keeps_only_the_last_step_between_calls(backend):
    """final_output is the last step alone: a view of it would hold the whole [T, B, H] output after the call."""
    layer = flexgen.Recurrent(alif, hidden=4, backend=backend).to(TRITON_DEVICE if backend == "triton" else "cpu")
    x = torch.rand(50, 2, 4, device=layer.weight.device, requires_grad=True)
    layer(x).sum().backward()
    out = layer.final_output
    assert out.shape == (2, 4) and out.untyped_storage().nbytes() == 2 * 4 * out.element_size()


@pytest.mark.parametrize("backend,path", [("torch", "stepwise"), pytest.param("triton", "fused", marks=needs_triton)])
def test_learnable_parameters_get_gradients_per_neuron(backend, path):
    dtype = FUSED_DTYPE if backend == "triton" else torch.float64
    layer = make_layer("current_lif", backend, path, hidden=6, dtype=dtype)
    assert layer.cell.k.shape == (6,)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    x = make_inputs("current_lif", (3, 2, 6), device, seed=3)[0].to(dtype)
    layer(x).sum().backward()
    assert layer.cell.k.grad.shape == (6,) and layer.cell.k.grad.abs().sum() > 0


def test_eager_loop_is_the_recurrent_lif_equations():
    """The oracle itself, against the recurrence written out by hand: h = v + (x + W s - v) / tau, s = Θ(h - 1)."""
    layer = make_layer("LIF", "eager", "auto", hidden=7)
    x = make_inputs("LIF", (6, 2, 7), "cpu", seed=4)[0]
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    v, s, spikes = torch.zeros(2, 7, dtype=torch.float64), None, []
    for t in range(6):
        current = x[t] + b if s is None else x[t] + s @ w.t() + b
        h = v + (current - v) / 2.0
        s = RefSpike.apply(h - 1.0, sigmoid_grad)
        v = h * (1.0 - s)
        spikes.append(s)
    expected = torch.stack(spikes)
    got = layer(x)
    assert torch.equal(got, expected) and expected.sum() > 0
    g = torch.randn(expected.shape, dtype=torch.float64)
    ref = torch.autograd.grad((expected * g).sum(), [x, w, b])
    mine = torch.autograd.grad((got * g).sum(), [x, layer.weight, layer.bias])
    for a, r in zip(mine, ref):
        assert max_rel_err(a, r) <= TOL


@needs_triton
def test_inference_kernel_matches_training_forward():
    layer = make_layer("alif", "triton", "fused", hidden=18, dtype=FUSED_DTYPE)
    x = make_inputs("alif", (4, 2, 18), TRITON_DEVICE, seed=6)[0].to(FUSED_DTYPE)
    trained = layer(x)
    layer.reset()
    with torch.no_grad():
        inferred = layer(x)
    assert not inferred.requires_grad and torch.equal(inferred, trained)


# Triton's interpreter multiplies bf16 dot operands as their raw bits; bf16 runs on CUDA only.
LOW_PRECISION = [(torch.float32, 1e-5), (torch.float16, 5e-3),
                 pytest.param(torch.bfloat16, 3e-2, marks=pytest.mark.skipif(not HAS_CUDA, reason="bf16 tl.dot needs CUDA"))]


@needs_triton
@pytest.mark.parametrize("dtype,tol", LOW_PRECISION)
def test_fused_in_low_precision_follows_the_fp64_loop(dtype, tol):
    """Low-precision I/O: the step runs in fp32 and the product takes its operands in the I/O dtype (spikes are
    exact in all of them), so the spikes are the fp64 loop's on the same rounded inputs and parameters; the
    gradients are within the I/O dtype's rounding of the saved values."""
    layer = make_layer("alif", "triton", "fused", hidden=12).to(dtype)
    oracle = make_layer("alif", "eager", "auto", hidden=12)
    oracle.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    x = make_inputs("alif", (5, 3, 12), TRITON_DEVICE, seed=7)[0].detach().to(dtype).requires_grad_()
    got = layer(x)
    x64 = x.detach().double().cpu().requires_grad_()
    expected = oracle(x64)
    assert got.dtype == dtype and expected.sum() > 0
    assert torch.equal(got.cpu().double(), expected)
    g = torch.randn(expected.shape, dtype=torch.float64)
    mine = torch.autograd.grad((got * g.to(dtype).to(got.device)).sum(), [x, layer.weight])
    ref = torch.autograd.grad((expected * g.to(dtype).double()).sum(), [x64, oracle.weight])
    for a, r in zip(mine, ref):
        assert max_rel_err(a.double().cpu(), r) <= tol


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_weight_gradient_of_16_bit_steps_comes_in_the_weights_dtype_where_cublas_gives_it(device):
    """weight_gradient(..., dtype): on CUDA (torch 2.8 and later) cuBLAS's bf16 product with an fp32 result, equal to
    the fp32 product of the same bf16 operands up to fp32 rounding; elsewhere the I/O dtype's product (the caller
    casts it). The fused layer's weight gradient comes back in the weight's dtype either way."""
    from flexgen.launch.recurrent.lines import _mm_gives, weight_gradient
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(0)
    grad_current = torch.randn(9, 4, 8, generator=g).to(device, torch.bfloat16)
    fed_back = (torch.rand(9, 4, 8, generator=g) < 0.5).to(device, torch.bfloat16)
    got = weight_gradient(grad_current, fed_back, torch.float32)
    exact = weight_gradient(grad_current.float(), fed_back.float())
    if _mm_gives(torch.device(device), torch.bfloat16, torch.float32):
        assert got.dtype == torch.float32 and max_rel_err(got, exact) <= 1e-6
    else:
        assert device == "cpu" or tuple(map(int, torch.__version__.split(".")[:2])) < (2, 8)
        assert got.dtype == torch.bfloat16 and max_rel_err(got.float(), exact) <= 1e-2
    if device == "cuda":
        layer = flexgen.Recurrent(flexgen.LIF, hidden=8, bias=True, path="fused").cuda()
        layer(torch.rand(6, 2, 8, device="cuda", dtype=torch.bfloat16) * 2).sum().backward()
        assert layer.weight.grad.dtype == layer.bias.grad.dtype == torch.float32


def test_cpu_auto_runs_stepwise_without_a_warning():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=4, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(torch.rand(2, 1, 4))
    assert layer.path == "stepwise"


@needs_triton
def test_too_large_for_fused_falls_back_once_with_a_warning():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=20, backend="triton", config=RecurrentConfig(max_hidden=16))
    layer = layer.to(TRITON_DEVICE)
    x = torch.rand(2, 1, 20, device=TRITON_DEVICE)
    with pytest.warns(UserWarning, match="hidden=20 is above RecurrentConfig.max_hidden=16"):
        layer(x)
    assert layer.path == "stepwise"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per layer
        layer(x)
    forced = flexgen.Recurrent(flexgen.LIF, hidden=20, backend="triton", path="fused", config=RecurrentConfig(max_hidden=16))
    forced = forced.to(TRITON_DEVICE)
    with pytest.raises(ValueError, match="path='fused' cannot run this call: hidden=20"):
        forced(x)


H100_SMS = 132


@pytest.mark.parametrize("dtype,hidden,batch,expected", [
    (torch.float32, 512, 32, (16, 32, 16, 128, 3)),  # 2 row tiles: slices of 32 neurons, 32 programs
    (torch.float32, 512, 256, (16, 32, 16, 128, 3)),  # 16 row tiles x 16 four-warp programs: two per SM
    (torch.float32, 1024, 256, (16, 64, 16, 64, 3)),
    (torch.float32, 2048, 256, (16, 128, 16, 32, 3)),  # fp32's product in slices of 32 past 64 neurons a program
    (torch.float32, 4096, 256, (16, 512, 8, 32, 3)),  # the fewest slices that fit the tile already fill the GPU
    (torch.float32, 300, 1000, (16, 128, 4, 32, 3)),  # 63 row tiles: 252 programs of four warps
    (torch.bfloat16, 4096, 1, (16, 32, 128, 128, 3)),  # 16-bit tiles of 16 rows keep 32 neurons; sums of 128
    (torch.bfloat16, 1024, 32, (16, 32, 32, 128, 3)),
    (torch.bfloat16, 256, 256, (64, 16, 16, 128, 3)),  # a wide 16-bit batch: 64 rows by as few as 16 neurons
    (torch.bfloat16, 512, 256, (64, 16, 32, 128, 3)),  # one program per SM at most: 128 programs
    (torch.bfloat16, 1024, 256, (64, 32, 32, 128, 4)),  # a sum of 8 slices or more: 4 in flight
    (torch.float16, 1024, 128, (64, 16, 64, 128, 4)),
    (torch.bfloat16, 2048, 256, (64, 64, 32, 128, 3)),
    (torch.bfloat16, 4096, 256, (64, 128, 32, 128, 3)),
    (torch.float16, 8192, 1024, (64, 256, 32, 64, 3)),  # 16 row tiles x 32 slices: in waves
])
def test_the_tiling_fits_the_tile_limit_and_spreads_small_batches(dtype, hidden, batch, expected):
    config = RecurrentConfig()
    tiling = config.tiling(batch, hidden, dtype, H100_SMS)
    assert tuple(tiling) == expected + (False, False)  # the weight in slices (batches of 9 rows and more, 16-bit)
    assert tiling.block * tiling.split >= hidden and tiling.block_b * tiling.block <= config.tile_limit(dtype)
    assert tiling.grid(batch) == (-(-batch // tiling.block_b) * tiling.split,)
    assert config.constexprs(tiling) == {"BLOCK_B": expected[0], "BLOCK": expected[1], "SPLIT": expected[2],
                                         "BLOCK_K": expected[3], "STATIONARY_WEIGHT": False, "ROW_BY_ROW": False}
    assert tiling.split <= H100_SMS  # a row tile's programs wait for each other: they must run at once


def test_the_interpreter_runs_a_row_tile_as_one_program_whatever_its_width():
    assert RecurrentConfig().tiling(3, 4096, torch.float64, None) == (16, 4096, 1, 32, 3, False, False)
    assert RecurrentConfig(split=1, block_k=16).tiling(3, 40, torch.float64, None) == (16, 64, 1, 16, 3, False, False)
    assert "needs a GPU" in RecurrentConfig(split=2).tiling(3, 40, torch.float64, None)


def test_the_products_slices_of_the_weight_stay_within_64_kib_in_16_bit():
    from flexgen.launch.recurrent.tiling import _chosen_block_k
    assert [_chosen_block_k(block, 16, 2048, torch.bfloat16) for block in (64, 512, 1024)] == [128, 64, 32]
    assert [_chosen_block_k(block, 64, 2048, torch.bfloat16) for block in (64, 128, 512, 1024)] == [128, 128, 64, 32]
    assert [_chosen_block_k(block, 16, 2048, torch.float32) for block in (32, 64, 128, 512)] == [128, 64, 32, 32]
    assert _chosen_block_k(32, 16, 64, torch.float32) == _chosen_block_k(64, 16, 64, torch.bfloat16) == 64  # H <= 64


def test_given_settings_override_the_chosen_ones():
    tiling = RecurrentConfig(block_b=32, block_k=16, split=4, num_stages=2).tiling(256, 512, torch.bfloat16, H100_SMS)
    assert tiling == (32, 128, 4, 16, 2, False, False)
    assert RecurrentConfig(num_stages=5).tiling(256, 1024, torch.bfloat16, H100_SMS).stages == 5


@pytest.mark.parametrize("config", [
    RecurrentConfig(), RecurrentConfig(block_b=64, block_k=32, num_warps=8, num_stages=4, max_tile=2048, split=8),
    RecurrentConfig(stationary=True, split=4), RecurrentConfig(stationary=False)])
def test_custom_ops_get_the_launch_settings_back(config):
    from flexgen.launch.recurrent.tiling import config_of, config_values
    assert config_of(config_values(config)) == config


@pytest.mark.parametrize("config,hidden,programs,match", [
    (RecurrentConfig(split=3), 512, H100_SMS, "split=3 must be a power of two from 1"),
    (RecurrentConfig(split=1), 1024, H100_SMS, "split=1 must be a power of two from 2"),
    (RecurrentConfig(split=64), 512, H100_SMS, "to 32 \\(16 neurons a program\\)"),
    (RecurrentConfig(), 8192, 8, "hidden=8192 needs 16 programs in step with each other, and this GPU holds 8"),
    (RecurrentConfig(max_hidden=256), 300, H100_SMS, "hidden=300 is above RecurrentConfig.max_hidden=256"),
    (RecurrentConfig(block_b=8), 64, H100_SMS, "block_b=8 must be a power of two of at least 16"),
    (RecurrentConfig(block_k=48), 64, H100_SMS, "block_k=48 must be a power of two"),
    (RecurrentConfig(num_stages=0), 64, H100_SMS, "num_stages=0 must be at least 1"),
])
def test_tilings_that_cannot_run_say_why(config, hidden, programs, match):
    reason = config.tiling(4, hidden, torch.float32, programs)
    assert isinstance(reason, str) and re.search(match, reason), reason


@pytest.mark.parametrize("percentage,usable", [(None, 132), ("", 132), ("100", 132), ("25", 33), ("0.5", 1),
                                              ("150", 132), ("lots", 132)])
def test_under_cuda_mps_slices_in_step_fit_the_share_of_sms_the_process_may_use(percentage, usable):
    from flexgen.launch.recurrent.tiling import usable_sms
    assert usable_sms(132, percentage) == usable
    config = RecurrentConfig()
    assert config.tiling(1, 4096, torch.bfloat16, usable_sms(132, "25"))[:5] == (16, 128, 32, 64, 3)  # 33 SMs
    assert "this GPU holds 6 at once" in config.tiling(1, 8192, torch.float32, usable_sms(132, "5"))


def test_the_counters_the_programs_wait_on_start_at_zero():
    # a ticket, 3 row tiles' arrivals, the exits
    assert torch.equal(Tiling(16, 64, 4, 32).sync(40, "cpu"), torch.zeros(5, dtype=torch.int32))
    assert Tiling(16, 512, 1, 32).sync(40, "cpu").shape == (1,)
    assert torch.equal(Tiling(16, 64, 4, 32).kept_sync(40, torch.device("cpu")), torch.zeros(5, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="slices in step need a GPU")
def test_kept_counters_are_zero_after_every_launch_and_graphs_get_their_own():
    """Eager launches of slices in step reuse counters kept per device and stream, which the kernels leave at zero;
    a CUDA graph's launches get counters of their own, so replays never touch the kept ones."""
    from flexgen.launch.recurrent.tiling import _KEPT_COUNTERS
    torch.manual_seed(0)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=256, bias=True, path="fused", config=RecurrentConfig(split=4)).cuda()
    x = (torch.rand(20, 40, 256, device="cuda") * 1.5).requires_grad_()
    results = []
    for _ in range(3):
        layer.reset()
        out = layer(x)
        results.append([out, *torch.autograd.grad(out.sum(), [x, *layer.parameters()])])
        torch.cuda.synchronize()
        assert _KEPT_COUNTERS and all(int(c.abs().sum()) == 0 for c in _KEPT_COUNTERS.values())
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))
    kept = {key: c.data_ptr() for key, c in _KEPT_COUNTERS.items()}
    static = x.detach().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        layer.reset()
        want = layer(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        layer.reset()
        replayed = layer(static)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, want)
    assert all(_KEPT_COUNTERS[key].data_ptr() == ptr for key, ptr in kept.items())
    assert all(int(c.abs().sum()) == 0 for c in _KEPT_COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="float64 products on a GPU")
def test_float64_steps_where_triton_has_no_float64_dot(monkeypatch):
    import flexgen.layers.recurrent_paths as recurrent

    monkeypatch.setattr(recurrent, "fp64_dot_error", lambda index: "CompilationError: no f64 mma")
    layer = flexgen.Recurrent(flexgen.LIF, hidden=8).to("cuda", torch.float64)
    with pytest.warns(UserWarning, match=r"cannot compile float64 products \(tl.dot\) for this GPU "
                                         r"\(CompilationError: no f64 mma\)"):
        layer(torch.rand(3, 2, 8, device="cuda", dtype=torch.float64))
    assert layer.path == "stepwise"


@needs_triton
def test_fused_kernels_out_of_resources_fall_back_and_are_remembered(monkeypatch):
    from triton.runtime.errors import OutOfResources
    import flexgen.layers.recurrent_paths as recurrent

    calls = []

    def no_room(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(recurrent, "run_fused", no_room)
    layer = make_layer("LIF", "triton", "auto", hidden=10, dtype=FUSED_DTYPE)
    oracle = make_layer("LIF", "eager", "auto", hidden=10)
    oracle.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    x = make_inputs("LIF", (3, 2, 10), TRITON_DEVICE, seed=8)[0].detach().to(FUSED_DTYPE)
    with pytest.warns(UserWarning, match="need more than the GPU has"):
        got = layer(x)
    assert layer.path == "stepwise" and torch.equal(got.double().cpu(), oracle(x.double().cpu()))
    layer(x)
    assert len(calls) == 1, "a layer that did not fit must not try the fused kernels again"
    forced = make_layer("LIF", "triton", "fused", hidden=10, dtype=FUSED_DTYPE)
    with pytest.raises(OutOfResources):
        forced(x)


def test_torch_backend_refuses_the_fused_path():
    with pytest.raises(ValueError, match="path='fused' runs Triton kernels"):
        flexgen.Recurrent(flexgen.LIF, hidden=4, backend="torch", path="fused")


@pytest.mark.parametrize("kwargs,error,match", [
    ({"hidden": 0}, ValueError, "hidden must be a positive number"),
    ({"hidden": 4, "path": "fast"}, ValueError, "path must be one of"),
    ({"hidden": 4, "backend": "cuda"}, ValueError, "backend must be one of"),
    ({"hidden": 4, "input_name": "i"}, ValueError, r"has no input 'i'; its inputs are \('x',\)"),
    ({"hidden": 4, "output_name": "v"}, ValueError, r"has no output 'v'; its outputs are \('s',\)"),
    ({"hidden": 4, "output_name": 1}, ValueError, "out of range"),
    ({"hidden": 4, "tau_typo": 2.0}, TypeError, "unknown parameter"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        flexgen.Recurrent(flexgen.LIF, **kwargs)


def test_bad_neuron_and_configured_layer_with_parameters():
    with pytest.raises(TypeError, match="Recurrent needs a flexgen neuron"):
        flexgen.Recurrent(torch.nn.ReLU, hidden=4)
    with pytest.raises(TypeError, match="a configured layer brings its own parameters"):
        flexgen.Recurrent(flexgen.LIF(tau=3.0), hidden=4, tau=2.0)


def test_configured_layer_brings_its_options_and_parameters():
    cell = flexgen.PLIF(init_tau=3.0, v_reset=None, backend="eager")
    layer = flexgen.Recurrent(cell, hidden=5, backend="torch")
    assert layer.cell is cell and layer.cell.static["soft_reset"] is True
    assert {n for n, _ in layer.named_parameters()} == {"cell.w", "weight"}
    layer(torch.rand(3, 2, 5)).sum().backward()  # its kernels are generated although the cell was built eager
    assert cell.w.grad is not None and layer.weight.grad is not None


def test_output_by_position_and_input_of_a_two_input_neuron():
    layer = flexgen.Recurrent(adaptive_mix, hidden=4, input_name="y", output_name=1, backend="torch")
    assert (layer.input_name, layer.output_name) == ("y", "h")
    s, h = layer(torch.rand(3, 2, 4), torch.rand(3, 2, 4))
    assert s.shape == h.shape == (3, 2, 4)


@pytest.mark.parametrize("backend,path", [("torch", "stepwise"), ("eager", "auto"),
                                          pytest.param("c", "stepwise", marks=pytest.mark.skipif(
                                              not HAS_C_COMPILER, reason="needs a C compiler")),
                                          pytest.param("triton", "fused", marks=needs_triton)])
def test_the_named_output_is_fed_back_into_the_named_input(backend, path):
    """adaptive_mix's h, times the weight, goes into its second input y: checked against the neuron stepped by hand
    (the wrong input or output would give the same shapes and different values)."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    dtype = torch.float32 if device == "cuda" else torch.float64  # no fp64 tl.dot on every GPU
    torch.manual_seed(5)
    layer = flexgen.Recurrent(adaptive_mix, hidden=4, input_name="y", output_name="h", path=path, backend=backend)
    layer = layer.to(device=device, dtype=dtype)
    x, y = (torch.rand(5, 2, 4, dtype=dtype, device=device) * 2.0 for _ in range(2))
    s, h = layer(x, y)
    weight = layer.weight.detach()
    states, previous_h, want_s, want_h = None, torch.zeros(2, 4, dtype=dtype, device=device), [], []
    for t in range(5):
        (s_t, h_t), states = adaptive_mix.apply(x[t:t + 1], y[t:t + 1] + previous_h @ weight.t(), states=states,
                                                backend="eager")
        previous_h = h_t[0]
        want_s.append(s_t)
        want_h.append(h_t)
    assert torch.equal(s, torch.cat(want_s)) and 0 < s.sum() < s.numel()
    assert max_rel_err(h, torch.cat(want_h)) <= (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("shape", [(3, 2, 5), (3, 10), (3, 2, 4, 2)])
def test_inputs_must_be_time_batch_hidden(shape):
    layer = flexgen.Recurrent(flexgen.LIF, hidden=4, backend="torch")
    with pytest.raises(ValueError, match=r"takes inputs \[T, B, 4\]"):
        layer(torch.rand(shape))


def test_empty_sequence_gives_empty_outputs_and_initial_states():
    layer = flexgen.Recurrent(alif, hidden=4, backend="torch")
    out = layer(torch.rand(0, 2, 4))
    assert out.shape == (0, 2, 4) and set(layer.final_states) == {"v", "a"}


def test_source_shows_the_product_inside_the_time_loop():
    layer = flexgen.Recurrent(alif, hidden=4)
    forward = layer.source("forward")
    loop = forward.index("for step in range(n_steps):")
    assert forward.index("tl.dot(") > loop and "def alif_recurrent_forward(" in forward
    assert "def alif_recurrent_backward(" in layer.source("module")
    with pytest.raises(ValueError, match="kind must be one of"):
        layer.source("torch_forward")


def test_source_shows_the_replay_of_known_outputs():
    """An undelayed layer's module has the replay kernel (every step's recurrent current from known outputs, for
    the long-sequence mode); a delayed layer's has none."""
    replay = flexgen.Recurrent(alif, hidden=4).source("replay")
    assert "def alif_recurrent_replay(" in replay and "tl.dot(" in replay and "for step in" not in replay
    delayed = flexgen.Recurrent(alif, hidden=4, delay=flexgen.Delay(4, 3))
    with pytest.raises(ValueError, match=r"kind must be one of \['backward', 'forward', 'inference', 'module'\]"):
        delayed.source("replay")


@needs_triton
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_the_replay_kernel_adds_the_known_outputs_product_to_every_step(bias, dtype):
    """`replayed_current`: current_t + fed_{t-1} W^T (nothing at t = 0) + bias for all steps at once, with the spikes
    fed given as bits (19 x 37 a step: rows start inside bytes, the step's last byte not full), to rounding, for
    several row tiles and an input given as an expanded tensor."""
    from flexgen.launch.bitpack import pack_spikes
    from flexgen.launch.recurrent.replay import replayed_current

    torch.manual_seed(3)
    device = TRITON_DEVICE
    hidden, batch, steps = 37, 19, 6
    layer = flexgen.Recurrent(alif, hidden=hidden, bias=bias).to(device, dtype)
    current = torch.randn(steps, 1, hidden, dtype=dtype, device=device).expand(steps, batch, hidden)
    fed = (torch.rand(steps, batch, hidden, device=device) < 0.3).to(dtype)
    weight = layer.effective_weight()
    rec_bias = layer.bias if bias else torch.zeros((), dtype=dtype, device=device)
    with torch.no_grad():
        total = replayed_current(layer.compiled(), current, pack_spikes(fed), weight, rec_bias, layer.config)
    want = current.clone()
    want[1:] += fed[:-1] @ weight.t()
    want += rec_bias
    assert max_rel_err(total, want) <= (TOL if dtype == torch.float64 else 1e-6)


def snntorch_sequence(cell, x):
    """snnTorch's recurrent neuron `cell` run over x [T, B, H], its own way: states in, states out, step by step."""
    states = cell.init_rleaky() if hasattr(cell, "init_rleaky") else cell.init_rsynaptic()
    spikes = []
    for t in range(x.shape[0]):
        spk, *rest = cell(x[t], *states)
        states = (spk, *rest)
        spikes.append(spk)
    return torch.stack(spikes)


@pytest.mark.parametrize("kind", ["RLeaky", "RSynaptic"])
def test_snntorch_recurrent_neurons_are_reachable(kind):
    """snnTorch's RLeaky and RSynaptic (all-to-all recurrent nn.Linear with bias, reset by subtraction from the
    previous membrane, ATan surrogate) = Recurrent(snntorch_leaky or the zoo's synaptic, bias=True) with the
    Linear's weight and bias. In fp32: snnTorch's spikes are fp32 whatever the input's dtype."""
    snn = pytest.importorskip("snntorch")
    from flexgen.interop.peers.snntorch import snntorch_leaky

    torch.manual_seed(0)
    T, B, H = 5, 3, 10
    if kind == "RLeaky":
        cell, neuron, params = snn.RLeaky(beta=0.8, linear_features=H), snntorch_leaky, {"beta": 0.8, "threshold": 1.0}
    else:
        cell, neuron, params = snn.RSynaptic(alpha=0.8, beta=0.7, linear_features=H), flexgen.neurons.synaptic, {
            "alpha": 0.8, "beta": 0.7}
    with torch.no_grad():
        cell.recurrent.weight.mul_(4.0)
    x = (torch.rand(T, B, H) * 0.8).requires_grad_()
    expected = snntorch_sequence(cell, x)
    g = torch.randn(T, B, H)
    ref = torch.autograd.grad((expected * g).sum(), [x, cell.recurrent.weight, cell.recurrent.bias])
    runs = [("torch", "stepwise")] + ([("triton", "fused")] if INTERPRETER or HAS_CUDA else [])
    for backend, path in runs:
        layer = flexgen.Recurrent(neuron, hidden=H, bias=True, backend=backend, path=path, **params)
        with torch.no_grad():
            layer.weight.copy_(cell.recurrent.weight)
            layer.bias.copy_(cell.recurrent.bias)
        device = TRITON_DEVICE if backend == "triton" else "cpu"
        got = layer.to(device)(x.to(device))
        assert torch.equal(got.cpu(), expected) and expected.sum() > 0
        mine = torch.autograd.grad((got * g.to(device)).sum(), [x, layer.weight, layer.bias])
        for a, r in zip(mine, ref):
            assert max_rel_err(a.cpu(), r) <= 1e-5


@needs_triton
def test_weight_is_read_through_its_strides():
    """A transposed weight (a view) goes to the kernels as it is, read through its two strides."""
    layer = make_layer("LIF", "triton", "fused", hidden=11, dtype=FUSED_DTYPE)
    oracle = make_layer("LIF", "eager", "auto", hidden=11)
    oracle.load_state_dict({k: v.double().cpu() for k, v in layer.state_dict().items()})
    transposed = torch.randn(11, 11, dtype=FUSED_DTYPE).t() * 2.0
    layer.weight = torch.nn.Parameter(transposed.to(TRITON_DEVICE))
    oracle.weight = torch.nn.Parameter(transposed.double().contiguous())
    assert not layer.weight.is_contiguous()
    x = make_inputs("LIF", (4, 2, 11), TRITON_DEVICE, seed=9)[0].detach().to(FUSED_DTYPE)
    got, expected = layer(x), oracle(x.double().cpu())
    assert torch.equal(got.double().cpu(), expected) and expected.sum() > 0
    got.sum().backward()
    expected.sum().backward()
    assert max_rel_err(layer.weight.grad.double().cpu(), oracle.weight.grad) <= FUSED_TOL


def test_host_benchmark_dry_run(tmp_path):
    """benchmarks/bench_recurrent_host.py runs end to end at tiny sizes (on a GPU where there is one, else on the
    CPU through Triton's interpreter) and records its row."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(flexgen.__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_recurrent_host.py"), "--dry-run", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "bench_recurrent_host.json").read_text())
    (row,) = record["results"]
    assert (row["dtype"], row["hidden"], row["batch"], row["steps"]) == ("fp32", 16, 2, 3)
    assert len(row["host_ms"]) == 1 and row["host_ms"][0] > 0 and record["meta"]["autograd_floor_ms"] > 0
    assert "| fp32 | 16 | 2 | " in (tmp_path / "bench_recurrent_host.md").read_text()
    assert ("gpu_ms" in row) == torch.cuda.is_available()


def test_benchmark_dry_run(tmp_path):
    """benchmarks/bench_recurrent.py runs end to end on the CPU at tiny sizes and records every candidate."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(flexgen.__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_recurrent.py"), "--dry-run", "--steps", "3",
                           "--hidden", "20", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "bench_recurrent.json").read_text())
    (row,) = record["rows"]
    assert (row["batch"], row["steps"], row["hidden"]) == (2, 3, 20)
    if "only 0-dimensional arrays" in row["candidates"]["flexgen fused"].get("note", ""):
        pytest.skip("this Triton's interpreter cannot run with this NumPy (see docs/troubleshooting.md)")
    for name in ("flexgen fused", "flexgen stepwise", "torch loop", "torch.compile"):
        assert row["candidates"][name].get("ms", 0) > 0, (name, row["candidates"][name], proc.stdout[-2000:])
    assert row["candidates"]["flexgen fused"]["path"] == "fused"
    assert all(share == 0.0 for share in row["agreement"].values()), "the candidates compute different spikes"
    assert "| 2 | 3 | 20 | fp32 |" in (tmp_path / "bench_recurrent.md").read_text()


def test_benchmark_without_peers_times_the_fused_layer_alone(tmp_path):
    """bench_recurrent.py --no-peers runs the fused layer's columns only and notes the others as not run."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(flexgen.__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_recurrent.py"), "--dry-run", "--steps", "2",
                           "--hidden", "16", "--no-peers", "--out", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "bench_recurrent.json").read_text())["rows"]
    if "only 0-dimensional arrays" in row["candidates"]["flexgen fused"].get("note", ""):
        pytest.skip("this Triton's interpreter cannot run with this NumPy (see docs/troubleshooting.md)")
    assert row["candidates"]["flexgen fused"]["ms"] > 0
    others = {name: c for name, c in row["candidates"].items() if name != "flexgen fused"}
    assert set(others) == {"flexgen stepwise", "torch loop", "torch.compile", "snnTorch RLeaky"}
    assert all(c == {"note": "not run (--no-peers)"} for c in others.values())
    assert row["matmul"]["layer_ms"] > 0 and row["matmul"]["graph_ms"] is None  # (no CUDA graph on the CPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol,hidden", [(torch.float32, 1e-4, h) for h in (128, 300, 512)]
                         + [(torch.bfloat16, 3e-2, h) for h in (128, 300, 512, 1024)])
def test_fused_on_gpu_follows_the_fp64_loop_at_larger_sizes(dtype, tol, hidden):
    """On a GPU, the fused kernels at SHD-like widths against the fp64 loop on the same rounded inputs and
    parameters: the same spikes (the product of spikes and rounded weights is exact up to fp32 accumulation)."""
    assert_fused_on_gpu_follows_the_fp64_loop(dtype, tol, (20, 16, hidden), RecurrentConfig(), seed=0)


def assert_fused_on_gpu_follows_the_fp64_loop(dtype, tol, shape, config, seed):
    """ALIF's fused kernels in `dtype` against the eager fp64 loop on the same rounded inputs and parameters: the
    same spikes, and the gradients of the input, weight and bias within `tol`."""
    torch.manual_seed(seed)
    hidden = shape[2]
    fused = flexgen.Recurrent(alif, hidden=hidden, bias=True, path="fused", beta=1.75, config=config).to("cuda", dtype)
    oracle = flexgen.Recurrent(alif, hidden=hidden, bias=True, backend="eager", beta=1.75).to("cuda", torch.float64)
    oracle.load_state_dict({k: v.double() for k, v in fused.state_dict().items()})
    x = (torch.rand(shape, device="cuda") * 4.0).to(dtype).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    got, expected = fused(x), oracle(x64)
    assert fused.path == "fused" and expected.sum() > 0
    assert torch.equal(got.double(), expected)
    g = torch.randn(expected.shape, device="cuda").to(dtype)
    mine = torch.autograd.grad((got * g).sum(), [x, fused.weight, fused.bias])
    ref = torch.autograd.grad((expected * g.double()).sum(), [x64, oracle.weight, oracle.bias])
    for a, b in zip(mine, ref):
        assert max_rel_err(a.double(), b) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="slices of the hidden neurons wait for each other: GPU only")
@pytest.mark.parametrize("dtype,tol,hidden,batch,split", [
    (torch.float32, 1e-4, 300, 3, 4),  # padded slices, a partial row tile
    (torch.float32, 1e-4, 512, 40, 8),  # three row tiles of eight programs each
    (torch.float32, 1e-4, 1024, 16, None),  # wider than one fp32 tile: the chosen split
    (torch.float32, 1e-4, 2048, 1, None),
    (torch.bfloat16, 3e-2, 4096, 2, None),
    (torch.bfloat16, 3e-2, 1024, 33, 16),
])
def test_hidden_slices_in_step_on_the_gpu_follow_the_fp64_loop(dtype, tol, hidden, batch, split):
    """Programs that each own a slice of the hidden neurons exchange every step's outputs (forward) and input
    gradients (backward) through memory: the same spikes as the fp64 loop, and its gradients."""
    from flexgen.launch.recurrent.fused import resident_programs
    config = RecurrentConfig(split=split)
    assert config.tiling(batch, hidden, dtype, resident_programs(torch.device("cuda"))).split > 1
    assert_fused_on_gpu_follows_the_fp64_loop(dtype, tol, (12, batch, hidden), config, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="slices of the hidden neurons wait for each other: GPU only")
def test_a_delayed_layer_in_slices_equals_one_program_per_row_tile():
    """The delay line's reads (forward) and its gradient's collection (backward) by slices of hidden neurons."""
    torch.manual_seed(2)
    layers = []
    for split in (1, 4):
        layer = flexgen.Recurrent(flexgen.LIF, hidden=256, bias=True, path="fused",
                                  delay=flexgen.Delay(256, max_delay=6, delay=torch.rand(256) * 6.0),
                                  config=RecurrentConfig(split=split)).cuda()
        layers.append(layer)
    layers[1].load_state_dict(layers[0].state_dict())
    x = (torch.rand(15, 20, 256, device="cuda") * 3.0).requires_grad_()
    g = torch.randn(15, 20, 256, device="cuda")
    results = []
    for layer in layers:
        out = layer(x)
        grads = torch.autograd.grad((out * g).sum(), [x, layer.weight, layer.delay.delay])
        results.append((out, grads))
    assert results[0][0].sum() > 0 and torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert max_rel_err(b, a) <= 1e-5
