"""Values that are 0 or 1 (spikes, flags) are saved for the backward in bytes, not floats: which values are,
what the saved-set choice makes of it, what every backend keeps, and gradients against the eager loop in float64."""
import pytest
import sympy
import torch

import flexgen
import test_delay_in_kernels
import test_recurrent
from conftest import HAS_C_COMPILER, INTERPRETER, TRITON_DEVICE
from flexgen.derive.cost import binary_values, is_binary
from flexgen.render.layout import Kind, Layout, SavedValue, plain_layout, recompute_layout
from flexgen.surrogate import Sigmoid
from flexgen.frontend.symbolic import detach, spike_class
from specs import gated_sum, refractory

TOL = 1e-12  # float64, the same expressions in another order
BACKENDS = ["torch"] + (["c"] if HAS_C_COMPILER else []) + (
    ["triton"] if INTERPRETER or TRITON_DEVICE == "cuda" else [])


def _spike(z):
    return spike_class(Sigmoid())(z)


def test_which_expressions_are_binary():
    a, b, z = sympy.symbols("a b z", real=True)
    known = {a, b}
    for expr in (_spike(z), 1 - a, a * b, detach(a), a ** 2, sympy.Piecewise((0, z > 1), (a, True)),
                 sympy.Max(a, b), sympy.Integer(1), sympy.Integer(0), 1 - _spike(z) * detach(b),
                 sympy.Float(1.0), sympy.Float(0.0), sympy.Float(1.0) - a, sympy.Float(1.0) - _spike(z)):
        assert is_binary(expr, known), expr
    for expr in (2 * a, a + b, a - b, z, sympy.Float(0.5), a ** -1, sympy.Piecewise((2, z > 1), (a, True)),
                 1 + a, -a, 1 - 2 * a, sympy.Float(1.0) + a, sympy.Float(2.0) - a, sympy.Float(1.0) - 1.5 * a):
        assert not is_binary(expr, known), expr


def test_a_state_is_binary_only_through_its_update():
    d = refractory.derivation()
    assert d.binary == {"r"}
    assert binary_values(d.trace, d.forward) >= {sympy.Symbol("r", real=True)}

    @flexgen.neuron(states=("v", "r"))
    def kept(x, v, r):  # r never changes: its initial value, whatever it is, at every step
        s = flexgen.spike(v + x - 1.0)
        return s, (v + x) * (1.0 - s) * (1.0 - flexgen.detach(r)), r

    assert kept.derivation().binary == frozenset()


def test_the_layout_keeps_binary_values_in_bytes_and_a_state_s_first_value_apart():
    layout = plain_layout(refractory.derivation())
    assert SavedValue("r", Kind.BUFFER, binary=True) in layout.saved
    assert SavedValue("r", Kind.STATE, 1) in layout.saved
    assert layout.saved_bytes_per_step(4, 4) == 2 * 1 + 2 * 4  # r written and read in bytes; tmp2 in fp32
    assert Layout.from_json(layout.to_json()) == layout
    recompute = recompute_layout(layout)
    assert recompute.variant.chunk == 2  # two values per step, as before: the initial state is not one


def test_the_saved_set_choice_counts_bytes():
    d = gated_sum.derivation()
    (saved,) = map(str, d.saved)  # the spike, a byte written and read: cheaper than reading x again in floats
    assert saved not in ("x", "v") and d.binary == {saved}
    assert f"{saved} (0 or 1: kept in bytes)" in gated_sum.equations()


def _run(spec, backend, recompute, x, states, dtype=torch.float64):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    leaves = [t.detach().to(device=device, dtype=dtype).clone().requires_grad_() for t in [x, *states]]
    (out,), finals = spec.apply(leaves[0], states=leaves[1:], backend=backend, recompute=recompute)
    saved = out.grad_fn.saved_tensors if backend != "eager" else ()
    g = torch.Generator().manual_seed(3)
    loss = (out * torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)).sum()
    loss = loss + sum((f * (k + 1.5)).sum() for k, f in enumerate(finals))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return out, finals, grads, saved


def _inputs(seed, binary_flag):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(9, 3, 10, generator=g, dtype=torch.float64) * 3
    v = torch.rand(3, 10, generator=g, dtype=torch.float64)
    r = (torch.rand(3, 10, generator=g, dtype=torch.float64) > 0.5).double() if binary_flag else \
        torch.rand(3, 10, generator=g, dtype=torch.float64)
    return x, [v, r]


def _assert_close(a, b):
    if a is None or b is None:
        assert a is None or not a.any(), "a gradient where the eager loop has none"
        return
    scale = b.abs().max().item() or 1.0
    assert (a.cpu() - b).abs().max().item() <= TOL * scale


@pytest.mark.parametrize("binary_flag", [False, True], ids=["any-initial-flag", "binary-initial-flag"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_equal_the_eager_loop_in_float64(backend, recompute, binary_flag):
    x, states = _inputs(7, binary_flag)
    out, finals, grads, _ = _run(refractory, backend, recompute, x, states)
    ref_out, ref_finals, ref_grads, _ = _run(refractory, "eager", False, x, states)
    assert torch.equal(out.cpu(), ref_out) and 0 < ref_out.sum() < ref_out.numel()
    flag = states[1]
    assert torch.equal(flag, (flag > 0.5).double()) == binary_flag
    for a, b in zip(finals, ref_finals):
        assert torch.equal(a.cpu(), b)
    for a, b in zip(grads, ref_grads):
        _assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_flag_is_saved_as_bytes_that_hold_the_last_step_s_spikes(backend):
    x, states = _inputs(11, binary_flag=False)
    for dtype in (torch.float32, torch.float64):
        out, _, _, saved = _run(refractory, backend, False, x, states, dtype)
        saved = [t for t in saved if t.dim() == 3]
        flags = [t for t in saved if t.dtype == torch.uint8]
        assert len(flags) == 1 and len(saved) == 2, [t.dtype for t in saved]
        assert torch.equal(flags[0][1:].cpu(), out[:-1].detach().cpu().to(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_flag_s_first_value_may_be_expanded(backend):
    x, (v, r) = _inputs(5, binary_flag=False)
    r0 = torch.tensor(0.25, dtype=torch.float64).expand(3, 10)
    got = _run(refractory, backend, False, x, [v, r0])
    ref = _run(refractory, "eager", False, x, [v, r0])
    assert torch.equal(got[0].cpu(), ref[0])
    for a, b in zip(got[2], ref[2]):
        _assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_binary_intermediate_is_saved_in_bytes(backend):
    g = torch.Generator().manual_seed(2)
    x = torch.rand(6, 4, 7, generator=g, dtype=torch.float64) * 2
    v = torch.rand(4, 7, generator=g, dtype=torch.float64)
    out, finals, grads, saved = _run(gated_sum, backend, False, x, [v])
    ref = _run(gated_sum, "eager", False, x, [v])
    assert torch.equal(out.cpu(), ref[0])
    assert [t.dtype for t in saved if t.dim() == 3] == [torch.uint8]
    for a, b in zip(grads, ref[2]):
        _assert_close(a, b)


@pytest.mark.parametrize("backend,path", test_recurrent.RUNS)
def test_a_recurrent_layer_reads_the_flag_s_first_value_from_its_initial_state(monkeypatch, backend, path):
    monkeypatch.setitem(test_recurrent.NEURONS, "refractory", (refractory, {"tau": 2.0}, 3.0))
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    g = torch.Generator().manual_seed(8)
    states = [torch.rand(3, 11, generator=g, dtype=torch.float64).to(device).requires_grad_() for _ in range(2)]
    test_recurrent.assert_matches_eager("refractory", backend, path, (6, 3, 11), states=states)
    saved = flexgen.Recurrent(refractory, hidden=11).compiled().layout.layout.saved
    assert SavedValue("r", Kind.BUFFER, binary=True) in saved and SavedValue("r", Kind.STATE, 1) in saved


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_gradients_keep_their_dtype_when_nothing_else_wants_a_gradient(backend):
    """Without gradients for the initial states or parameters, the eager Triton plan allocates the input gradient
    like a saved buffer: never like the one in bytes."""
    x, states = _inputs(13, binary_flag=False)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    for dtype in (torch.float32, torch.float64):
        got = x.to(device=device, dtype=dtype).requires_grad_()
        ref = x.to(dtype).requires_grad_()
        given = [v.to(device=device, dtype=dtype) for v in states]
        (out,), _ = refractory.apply(got, states=given, backend=backend, recompute=False)
        (ref_out,), _ = refractory.apply(ref, states=[v.to(dtype) for v in states], backend="eager")
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        (grad,) = torch.autograd.grad((out * weights.to(device)).sum(), got)
        (ref_grad,) = torch.autograd.grad((ref_out * weights).sum(), ref)
        assert grad.dtype == dtype
        assert (grad.cpu() - ref_grad).abs().max() <= (TOL if dtype == torch.float64 else 1e-5) * ref_grad.abs().max()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the probes run their measurements (minutes)")
@pytest.mark.parametrize("script", ["probe_binary_saved.py", "probe_network_peak.py"])
def test_the_memory_probes_say_they_need_a_gpu(script):
    import pathlib
    import subprocess
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / script
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("device,taps", test_delay_in_kernels.LINES)
def test_a_flag_in_bytes_beside_a_delay_line_in_the_kernels(device, taps):
    def make(backend, delay):
        return refractory(v_th=0.5, backend=backend, delay=delay)

    fused, reference = test_delay_in_kernels.layer_pair(make, device, **test_delay_in_kernels.TAPS[taps])
    x = test_delay_in_kernels.spiking_input((9, 2, 6), device) * 2.5
    test_delay_in_kernels.assert_same(fused, reference, [x.detach().requires_grad_()])
    assert fused.v.ne(0).any() and reference.r.eq(1).any()  # it fired, and its flag held


@pytest.mark.parametrize("backend,device", [("torch", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
def test_a_compiled_layer_with_a_flag_in_bytes_equals_the_eager_one_over_two_calls(backend, device):
    """torch.compile (fullgraph) runs the custom ops, whose saved values hold the flag's bytes and its initial
    state; a second call starts from the flag the first one left."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = (torch.rand(6, 2, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 3).to(device)
    call = torch.compile(lambda layer, x: layer(x), fullgraph=True, backend="aot_eager")
    results = []
    for run in (lambda layer, x: layer(x), call):
        layer = refractory(backend=backend)
        xs = x.clone().requires_grad_()
        first, second = run(layer, xs), run(layer, xs)
        (first.sum() + (2 * second).sum()).backward()
        results.append((first, second, xs.grad))
    assert results[0][1].sum() > 0 and layer.r.dtype == torch.float64
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("checkpoint_every", [None, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dense_layer_s_segments_start_their_flag_from_the_checkpointed_state(backend, checkpoint_every):
    """The long-sequence mode re-runs segments from checkpointed states: each one's first step reads its flag there."""
    x = (torch.rand(12, 3, 6, generator=torch.Generator().manual_seed(6)) < 0.4).double()
    torch.manual_seed(1)
    layer = flexgen.Dense(6, 5, refractory, checkpoint_every=checkpoint_every, backend=backend).double()
    reference = flexgen.Dense(6, 5, refractory, backend="torch").double()
    with torch.no_grad():
        layer.weight.mul_(12)
        layer.bias.fill_(0.6)
    reference.load_state_dict(layer.state_dict())
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    layer.to(device)
    weights = torch.randn(12, 3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out, ref_out = layer(x.to(device)), reference(x)
    (out * weights.to(device)).sum().backward()
    (ref_out * weights).sum().backward()
    assert torch.equal(out.cpu(), ref_out) and ref_out.sum() > 20
    for a, b in ((layer.weight.grad, reference.weight.grad), (layer.bias.grad, reference.bias.grad)):
        _assert_close(a, b)
