"""Eager Triton calls go through `EagerPlan`s: argument templates per call signature, and on CUDA a
direct call of Triton's compiled launcher. Every case is checked against the eager oracle.
The plain kernels' plans are inspected (`recompute=False`: on CUDA the default trains fp32 with the
recompute kernels, which go through plans the same way)."""
import copy

import pytest
import torch

from conftest import HAS_CUDA, TRITON_DEVICE
from flexgen import launch
from flexgen.layers import neuron as module
from flexgen.launch import compat, config
from specs import adaptive_mix, lif, plif

DEVICE = TRITON_DEVICE
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _inputs(T, shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, *shape, generator=g) * 1.5 + 0.7).to(DEVICE, dtype)


def _plans(spec):
    return spec.compiled().ops._plans


def _run(spec, inputs, backend, grad_of=lambda outputs, finals: outputs[0].sum(), **params):
    """Outputs, final states and the gradients of the (grad-requiring) inputs."""
    leaves = [x for x in inputs if x.requires_grad]
    outputs, finals = spec.apply(*inputs, backend=backend, recompute=False, **params)
    grads = torch.autograd.grad(grad_of(outputs, finals), leaves) if leaves else []
    return [*outputs, *finals, *grads]


def _assert_matches_eager(spec, inputs, grad_of=lambda outputs, finals: outputs[0].sum(), **params):
    got = _run(spec, inputs, "triton", grad_of, **params)
    ref = _run(spec, inputs, "eager", grad_of, **params)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    return got


def test_one_plan_per_signature_reused_across_calls():
    _plans(lif).clear()
    for seed in range(3):  # new values, same signature
        _assert_matches_eager(lif, [_inputs(4, (3, 5), seed).requires_grad_()])
    assert len(_plans(lif)) == 1
    _assert_matches_eager(lif, [_inputs(4, (3, 5))])  # no gradient: the inference kernel, a plan of its own
    _assert_matches_eager(lif, [_inputs(6, (2, 7)).requires_grad_()])  # another shape
    _assert_matches_eager(lif, [_inputs(4, (3, 5)).requires_grad_()], tau=3.0)  # other hyper-parameters
    assert len(_plans(lif)) == 4
    plan = next(iter(_plans(lif).values()))
    assert plan.reusable and len(plan.backward_plans) == 1


def test_plans_for_every_backward_gradient_layout():
    """The incoming gradients' layouts key the backward's templates; a layout the kernel cannot index is copied."""
    x = _inputs(4, (3, 5)).requires_grad_()
    weights = {
        "sum (stride 0)": None,
        "dense": _inputs(4, (3, 5), seed=1),
        "neurons transposed": _inputs(4, (5, 3), seed=2).transpose(1, 2),
        "time innermost": _inputs(3, (5, 4), seed=3).permute(2, 0, 1),
    }
    _plans(lif).clear()
    for name, w in weights.items():
        def loss(outputs, finals, w=w):
            s = outputs[0]
            return s.sum() + finals[0].sum() if w is None else (s * w).sum()
        _assert_matches_eager(lif, [x], loss)
    (plan,) = _plans(lif).values()
    assert len(plan.backward_plans) == len(weights)
    reusable = sorted(p.reusable for p in plan.backward_plans.values())
    assert reusable == [False, True, True, True]  # the transposed gradient takes the general path


def test_states_and_per_channel_parameters_fill_the_templates():
    """Two inputs, two states from the caller; a per-channel learnable parameter and its gradient."""
    x, y = _inputs(5, (2, 3, 4)).requires_grad_(), _inputs(5, (2, 3, 4), seed=1)
    states = [_inputs(1, (2, 3, 4), seed=s)[0].requires_grad_() for s in (2, 3)]
    for _ in range(2):
        got = [*adaptive_mix.apply(x, y, states=states, backend="triton")]
        ref = [*adaptive_mix.apply(x, y, states=states, backend="eager")]
        for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        loss = lambda r: r[0][0].sum() + (r[0][1] * r[1][1][None]).sum()  # noqa: E731
        g = torch.autograd.grad(loss(got), [x, *states])
        r = torch.autograd.grad(loss(ref), [x, *states])
        for a, b in zip(g, r):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    layer = plif(per_channel=3).to(DEVICE)
    with torch.no_grad():
        layer.w.copy_(torch.tensor([0.1, -0.4, 0.9]))
    ref_layer = plif(per_channel=3, backend="eager").to(DEVICE)
    ref_layer.load_state_dict(layer.state_dict())
    x = _inputs(4, (2, 3, 6), seed=4)
    for _ in range(2):
        layer.reset(), ref_layer.reset()
        layer(x).sum().backward()
        ref_layer(x).sum().backward()
    torch.testing.assert_close(layer.w.grad, ref_layer.w.grad, rtol=1e-5, atol=1e-5)


def test_missing_gradients_read_the_plans_zeros():
    """Unused outputs (here the final state) get no gradient from autograd: the backward reads a zero
    looked up once per plan, or per call when the plan was made while a CUDA graph was captured."""
    _plans(lif).clear()
    x = _inputs(4, (3, 5)).requires_grad_()
    _assert_matches_eager(lif, [x])
    (plan,) = _plans(lif).values()
    assert [z.item() for z in plan.zero_grads] == [0.0, 0.0]
    assert all(z is launch.cached_zero(dt, x.device) for z, dt in zip(plan.zero_grads, plan.grad_dtypes))
    plan.zero_grads = None  # as if made during a capture
    _assert_matches_eager(lif, [_inputs(4, (3, 5), seed=1).requires_grad_()])


def test_plans_per_neuron_stay_bounded(monkeypatch):
    monkeypatch.setattr(config, "MAX_PLANS", 3)
    _plans(lif).clear()
    for n in range(1, 8):
        _assert_matches_eager(lif, [_inputs(2, (n,))])
        assert len(_plans(lif)) <= 3


def test_calls_that_need_a_copy_get_no_plan():
    """An input whose neurons do not flatten to one stride is copied per call: the general path."""
    x = _inputs(4, (5, 3)).transpose(1, 2).requires_grad_()
    _plans(lif).clear()
    _assert_matches_eager(lif, [x])
    assert [p.reusable for p in _plans(lif).values()] == [False]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_direct_launches_match_tritons_own_path(dtype, monkeypatch):
    """After the first call of a specialisation, launches skip JITFunction.run; results stay bit-identical."""
    available = compat.direct_launch()
    layer = lif(recompute=False).to(DEVICE)
    x = _inputs(4, (64, 129), dtype=dtype).requires_grad_()
    results = {}
    for direct in (False, True):
        monkeypatch.setattr(compat, "direct_launch", lambda direct=direct: direct and available)
        _plans(lif).clear()
        layer._known_calls.clear()  # the layer would keep going to the plan made before
        for _ in range(3):
            layer.reset()
            x.grad = None
            s = layer(x)
            s.sum().backward()
        results[direct] = (s, layer.v, x.grad)
        (plan,) = _plans(lif).values()
        (backward,) = plan.backward_plans.values()
        assert bool(plan.kernel.compiled) == bool(backward.kernel.compiled) == (direct and available)
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


@gpu
@pytest.mark.gpu
def test_misaligned_inputs_get_their_own_specialisation():
    """Triton specialises pointers on 16-byte alignment; a view at an odd offset must not reuse the aligned kernel."""
    base = _inputs(5, (3, 7), dtype=torch.float16)  # one step is 21 halves: 42 bytes
    _plans(lif).clear()
    for start in (0, 1, 0, 1):
        x = base[start:start + 4].detach().requires_grad_()
        aligned = x.detach().clone().requires_grad_()
        got, ref = _run(lif, [x], "triton"), _run(lif, [aligned], "triton")
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    (plan,) = _plans(lif).values()
    if compat.direct_launch():
        assert len(plan.kernel.compiled) == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("direct", [False, True])
def test_kernels_run_on_the_tensors_device_not_the_current_one(direct, monkeypatch):
    """With cuda:0 current, tensors on cuda:1 take every path there (as torch ops do): plans with and
    without direct launches, the general path (a copied input) and inference."""
    available = compat.direct_launch()
    monkeypatch.setattr(compat, "direct_launch", lambda: direct and available)
    _plans(lif).clear()
    other = torch.device("cuda", 1)
    cases = {
        "plan": _inputs(4, (3, 5)).to(other),
        "general path": _inputs(4, (5, 3)).to(other).transpose(1, 2),
    }
    with torch.cuda.device(0):
        for name, x in cases.items():
            for _ in range(2):  # the second call of a plan takes the direct launch
                got = _run(lif, [x.detach().requires_grad_()], "triton")
                ref = _run(lif, [x.detach().requires_grad_()], "eager")
                for a, b in zip(got, ref):
                    assert a.device == other, name
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            with torch.no_grad():
                torch.testing.assert_close(_run(lif, [x], "triton"), _run(lif, [x], "eager"), rtol=1e-5, atol=1e-5)
        assert torch.cuda.current_device() == 0


# ---- layers: a known call goes straight to its plan ----------------------------------------------


def _count_checked_calls(monkeypatch, layer):
    """A list that grows by one whenever `layer` takes the checked path."""
    calls = []
    checked = module.NeuronModule._checked_call

    def counted(self, *args):
        if self is layer:
            calls.append(1)
        return checked(self, *args)

    monkeypatch.setattr(module.NeuronModule, "_checked_call", counted)
    return calls


def _step(layer, x, y=None):
    """Outputs, states and (when x wants one) x's gradient of one call of `layer`, states carried."""
    s = layer(x)
    grads = torch.autograd.grad((s * (1 if y is None else y)).sum() + layer.v.sum(), [x]) if x.requires_grad else []
    return [s, layer.v, *grads]


def _assert_same_steps(layer, ref, x, y=None):
    for a, b in zip(_step(layer, x, y), _step(ref, x, y)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_layers_known_call_skips_the_checks_and_matches_eager(monkeypatch):
    """The first call of a signature is checked and remembered; later ones go straight to its plan:
    fresh and carried states, other values, inference and training each a signature of their own."""
    layer, ref = lif(backend="triton").to(DEVICE), lif(backend="eager").to(DEVICE)
    checked = _count_checked_calls(monkeypatch, layer)
    for seed in range(3):  # fresh states each time, new values
        layer.reset(), ref.reset()
        _assert_same_steps(layer, ref, _inputs(4, (3, 5), seed).requires_grad_())
    assert len(checked) == 1 and len(layer._known_calls) == 1
    for seed in range(3):  # states carried from the call before: a second signature
        _assert_same_steps(layer, ref, _inputs(4, (3, 5), seed).requires_grad_())
    assert len(checked) == 2
    with torch.no_grad():
        for seed in range(2):
            layer.reset(), ref.reset()
            _assert_same_steps(layer, ref, _inputs(4, (3, 5), seed))
        assert layer.v.grad_fn is None
    assert len(checked) == 3 and len(layer._known_calls) == 3
    single, single_ref = lif(backend="triton", step_mode="s").to(DEVICE), lif(backend="eager", step_mode="s").to(DEVICE)
    x = _inputs(5, (3, 5), seed=7)
    for t in range(5):
        _assert_same_steps(single, single_ref, x[t].clone().requires_grad_())
    assert len(single._known_calls) == 2  # the first step (initial states) and the rest


def test_a_known_call_follows_the_layers_options(monkeypatch):
    """Hyper-parameters and options changed on the layer after a call apply to the next one."""
    layer, ref = lif(backend="triton").to(DEVICE), lif(backend="eager").to(DEVICE)
    x = _inputs(4, (3, 5)).requires_grad_()
    for change in (lambda m: m.hyper.update(tau=3.5), lambda m: setattr(m, "store_state_seqs", True)):
        layer.reset(), ref.reset()
        _assert_same_steps(layer, ref, x)
        change(layer), change(ref)
        layer.reset(), ref.reset()
        _assert_same_steps(layer, ref, x)
    torch.testing.assert_close(layer.state_seqs["v"], ref.state_seqs["v"], rtol=1e-5, atol=1e-5)
    layer.recompute = True
    layer.reset(), ref.reset()
    _assert_same_steps(layer, ref, x)
    assert lif.compiled().ops_for(True)._plans  # the recompute kernels ran


def test_known_calls_still_reject_bad_inputs():
    layer = lif(backend="triton").to(DEVICE)
    x = _inputs(4, (3, 5)).requires_grad_()
    layer(x)
    with pytest.raises(ValueError, match="leading time dimension missing"):
        layer(x[0])  # carried states no longer fit
    layer.reset()
    layer(x)
    layer.reset()
    with pytest.raises(TypeError, match="floating-point"):
        layer(x.detach().int())
    with pytest.raises(TypeError, match="takes 1 input"):
        layer(x, x)
    with pytest.raises(TypeError, match="must be a tensor"):
        layer([0.5])


def test_calls_under_autocast_or_transforms_take_the_checked_path():
    layer = plif(backend="triton").to(DEVICE)
    x = _inputs(4, (3, 5)).to(torch.bfloat16).float().requires_grad_()
    layer(x)
    layer.reset()
    with torch.autocast(device_type=torch.device(DEVICE).type, dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16
    layer.reset()
    assert layer(x).dtype == torch.float32
    grad = torch.func.grad(lambda x: (layer.reset(), layer(x))[1].sum())(x)
    ref = plif(backend="eager").to(DEVICE)
    torch.testing.assert_close(grad, torch.autograd.grad(ref(x).sum(), [x])[0], rtol=1e-5, atol=1e-5)


def test_known_calls_stay_bounded_and_are_not_copied(monkeypatch):
    monkeypatch.setattr(config, "MAX_PLANS", 3)
    layer = lif(backend="triton").to(DEVICE)
    for n in range(1, 8):
        layer.reset()
        layer(_inputs(2, (n,)))
        assert len(layer._known_calls) <= 3
    twin = copy.deepcopy(layer)
    assert twin._known_calls == {}
    twin.reset(), layer.reset()
    x = _inputs(2, (4,))
    assert torch.equal(twin(x), layer(x))


def test_the_recurrent_kernels_launch_keys_follow_tritons_specialisation():
    """`SpecialisedLaunches` (the fused recurrent kernels' eager launches) keys each integer by its value and each
    tensor by dtype and 16-byte alignment, and takes the compiled launcher only where the given constexprs are the
    kernel's last parameters (in any order given)."""
    import triton
    import triton.language as tl

    from flexgen.launch.triton_path import SpecialisedLaunches, _specialisation

    @triton.jit
    def kernel(x_ptr, n, A: tl.constexpr, B: tl.constexpr):
        pass

    launches = SpecialisedLaunches(kernel)
    assert launches._trailing(("B", "A")) == (["A", "B"] if compat.direct_launch() else None)
    assert launches._trailing(("A",)) is None  # not the last parameter: Triton's own path
    base = torch.zeros(8)
    assert _specialisation(16) != _specialisation(32) and _specialisation(True) != _specialisation(1)
    assert _specialisation(base) != _specialisation(base[1:])  # 4 bytes in: not 16-byte aligned
    assert _specialisation(base) != _specialisation(base.double())
    assert _specialisation(2.0) == _specialisation(3.0)  # floats are not specialised on
