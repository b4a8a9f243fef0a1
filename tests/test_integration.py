"""PyTorch integration: module hygiene, functional use, AMP, determinism, step modes, conversion."""
import copy
import pickle

import pytest
import torch

import flexgen
from conftest import device_backends, max_rel_err
from specs import adaptive_mix, lif, plif

PAIRS = device_backends()


def make_net(backend, device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 6), lif(tau=3.0, backend=backend), torch.nn.Linear(6, 4), plif(v_th=0.8, backend=backend)
    ).to(device)


def reset(net):
    for m in net.modules():
        if isinstance(m, flexgen.NeuronModule):
            m.reset()


def inputs(T=5, batch=2, features=3, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, batch, features, generator=g) * 2.0 + 0.5).to(device)


# ---- module hygiene -------------------------------------------------------------


def test_state_dict_has_learnable_params_not_states():
    net = make_net("torch")
    net(inputs())
    assert set(net.state_dict()) == {"0.weight", "0.bias", "2.weight", "2.bias", "3.w"}
    other = make_net("torch")
    with torch.no_grad():
        other[3].w.fill_(1.25)
    other.load_state_dict(net.state_dict())
    assert torch.equal(other[3].w, net[3].w)
    reset(net)
    assert torch.equal(other(inputs()), net(inputs()))


def test_to_dtype_and_half_convert_params_and_states():
    net = make_net("torch")
    net(inputs())
    net.double()
    assert net[3].w.dtype == torch.float64 and net[1].v.dtype == torch.float64
    assert net(inputs().double()).dtype == torch.float64
    net.half()
    assert net[3].w.dtype == torch.float16 and net[3].v.dtype == torch.float16
    reset(net)
    out = net[3](inputs().half())  # the neuron alone: fp16 I/O, fp32 compute
    assert out.dtype == torch.float16


def test_to_device_moves_states_to_meta_and_back():
    net = make_net("torch")
    net(inputs())
    net.to("meta")
    assert net[1].v.device.type == "meta" and net[3].w.device.type == "meta"


def test_deepcopy_is_independent():
    net = make_net("torch")
    net(inputs()).sum().backward()  # states now carry an autograd graph
    twin = copy.deepcopy(net)
    assert twin[1].spec is lif and not twin[1].v.requires_grad
    assert torch.equal(twin[1].v, net[1].v)
    with torch.no_grad():
        twin[3].w.add_(1.0)
    assert not torch.equal(twin[3].w, net[3].w)


def test_pickle_model_round_trip():
    net = make_net("torch")
    expected = net(inputs())
    reset(net)
    loaded = pickle.loads(pickle.dumps(net))
    assert loaded[1].spec is lif and loaded[3].spec is plif
    assert torch.equal(loaded(inputs()), expected)


def test_spec_pickles_by_reference():
    assert pickle.loads(pickle.dumps(adaptive_mix)) is adaptive_mix
    assert copy.deepcopy(adaptive_mix) is adaptive_mix


def test_local_spec_cannot_pickle_with_clear_error():
    @flexgen.neuron(states=("v",))
    def local_if(x, v, v_th=1.0):
        s = flexgen.spike(v + x - v_th)
        return s, (v + x) * (1.0 - s)

    with pytest.raises(pickle.PicklingError, match="module level"):
        pickle.dumps(local_if(backend="torch"))
    assert copy.deepcopy(local_if(backend="torch")).spec is local_if  # deepcopy still works


def test_repr_shows_hyper_parameters():
    text = repr(lif(tau=3.0, v_th=0.5, backend="torch", step_mode="s"))
    for part in ("neuron=lif", "tau=3.0", "v_th=0.5", "step_mode='s'", "backend='torch'"):
        assert part in text


# ---- functional use ------------------------------------------------------------


def test_apply_with_functional_call_matches_module():
    net = make_net("torch")
    x = inputs()
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    reset(net)
    out = torch.func.functional_call(net, params, (x,))
    out.sum().backward()
    reset(net)
    net(x).sum().backward()
    for k, p in net.named_parameters():
        torch.testing.assert_close(params[k].grad, p.grad, rtol=0, atol=0)


# torch.func: grad, vjp, jacrev and vmap on the eager path (no torch.compile involved).
# In float64 each backend computes the eager path's expressions, in another order at most: they agree to rounding,
# within FP64_TOL of the reference's largest magnitude, elementwise (measured on the CPU: at most 2.9e-16).
FP64_TOL = 1e-12


def assert_fp64_close(got, want):
    for a, b in zip(got, want) if isinstance(want, (tuple, list)) else [(got, want)]:
        assert a.dtype == b.dtype == torch.float64 and a.shape == b.shape
        assert max_rel_err(a, b) <= FP64_TOL, max_rel_err(a, b)


def _loss(spec, backend, **params):
    def loss(x, v0):
        outputs, finals = spec.apply(x, x * 0.5, states=[v0, v0 * 0.0 + 0.2], backend=backend, **params)
        return sum((o * o.new_tensor([1.0, -2.0, 0.5])).sum() for o in outputs) + (finals[0] ** 2).sum()
    return loss


@pytest.mark.parametrize("device,backend", PAIRS)
def test_torch_func_grad_and_jacrev_match_eager(device, backend):
    x = inputs(T=4, batch=2, features=3, device=device, seed=3).double()
    v0 = torch.rand(2, 3, dtype=torch.float64, device=device)
    got = torch.func.grad(_loss(adaptive_mix, backend), argnums=(0, 1))(x, v0)
    want = torch.func.grad(_loss(adaptive_mix, "eager"), argnums=(0, 1))(x, v0)
    assert_fp64_close(got, want)
    assert got[0].abs().sum() > 0

    def final_v(backend):
        return lambda x: lif.apply(x, backend=backend)[1][0]
    small = x[:, :1, :2]
    assert_fp64_close(torch.func.jacrev(final_v(backend))(small), torch.func.jacrev(final_v("eager"))(small))


@pytest.mark.parametrize("device,backend", PAIRS)
@pytest.mark.parametrize("x_dim,state_batched", [(0, True), (1, False), (2, True)])
def test_torch_func_vmap_matches_a_loop(device, backend, x_dim, state_batched):
    """vmap over inputs (any dim) and states (or shared states); forward and vmap(grad)."""
    xb = inputs(T=4 * 5, batch=2, features=3, device=device, seed=4).double().reshape(4, 5, 2, 3).movedim(1, x_dim)
    v0 = torch.rand(5, 2, 3, dtype=torch.float64, device=device)
    v_arg, v_dim = (v0, 0) if state_batched else (v0[0], None)

    def step(backend):
        return lambda x, v: adaptive_mix.apply(x, x * 0.5, states=[v, v], backend=backend, store_state_seqs=True)
    (outs, finals) = torch.func.vmap(step(backend), in_dims=(x_dim, v_dim))(xb, v_arg)
    for i in range(5):
        ref_outs, ref_finals = step("eager")(xb.select(x_dim, i), v0[i] if state_batched else v0[0])
        for a, b in zip(outs + finals, ref_outs + ref_finals):
            assert_fp64_close(a[i], b)
    grads = torch.func.vmap(torch.func.grad(_loss(adaptive_mix, backend), argnums=(0, 1)), in_dims=(x_dim, v_dim))(xb, v_arg)
    for i in range(5):
        ref = torch.func.grad(_loss(adaptive_mix, "eager"), argnums=(0, 1))(xb.select(x_dim, i), v0[i] if state_batched else v0[0])
        assert_fp64_close(grads[0][i], ref[0])
        assert_fp64_close(grads[1][i], ref[1])


@pytest.mark.parametrize("device,backend", PAIRS)
def test_per_sample_gradients_of_learnable_parameters(device, backend):
    """vmap(grad) over a batch with shared parameters gives each sample's own parameter gradient."""
    layer = flexgen.PLIF(init_tau=2.5, per_channel=3, step_mode="m", backend=backend)
    layer = layer.to(device=device, dtype=torch.float64)
    params = {k: v.detach() for k, v in layer.named_parameters()}
    xb = inputs(T=4 * 5, batch=2, features=3, device=device, seed=5).double().reshape(4, 5, 2, 3).movedim(1, 0)

    def loss(params, x, module):
        module.reset()
        return (torch.func.functional_call(module, params, (x,)) * torch.arange(3.0, device=x.device)).sum()
    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(params, xb, layer)["w"]
    eager = flexgen.PLIF(init_tau=2.5, per_channel=3, step_mode="m", backend="eager")
    eager = eager.to(device=device, dtype=torch.float64)
    want = torch.stack([torch.func.grad(loss)(params, xb[i], eager)["w"] for i in range(5)])
    assert got.shape == (5, 3)
    assert_fp64_close(got, want)
    assert (want[0] - want[1]).abs().sum() > 0  # really per sample

    ws = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64, device=device)  # vmap over the parameter itself
    outs = torch.func.vmap(lambda w: plif.apply(xb[0], w=w, backend=backend)[0][0])(ws)
    for i in range(5):
        assert_fp64_close(outs[i], plif.apply(xb[0], w=ws[i], backend="eager")[0][0])


@pytest.mark.parametrize("device,backend", PAIRS)
def test_torch_func_leaves_nothing_behind_for_eager_calls(device, backend):
    """Tensors made under a transform (zero gradients, constant initial states) are not reused afterwards."""
    from flexgen.launch import scalars

    scalars._SCALARS.clear()  # the first zero gradient and initial state are made under the transforms below
    x = inputs(T=3, batch=2, features=3, device=device, seed=6).double()
    loss = _loss(adaptive_mix, backend)
    torch.func.grad(loss)(x, torch.zeros(2, 3, dtype=torch.float64, device=device))
    torch.func.vmap(lambda x: lif.apply(x, backend=backend)[0][0])(x)
    x.requires_grad_()
    (s,), (v,) = lif.apply(x, backend=backend)
    (s_ref,), (v_ref,) = lif.apply(x, backend="eager")
    grads = torch.autograd.grad((s * x).sum() + v.sum(), x)
    assert_fp64_close(grads, torch.autograd.grad((s_ref * x).sum() + v_ref.sum(), x))
    from torch._C._functorch import is_functorch_wrapped_tensor

    assert scalars._SCALARS and not any(is_functorch_wrapped_tensor(t) for t in scalars._SCALARS.values())


def test_torch_func_double_backward_is_a_clear_error():
    x = inputs(T=3, batch=1, features=2).double()
    first = torch.func.grad(lambda x: lif.apply(x, backend="torch")[1][0].pow(2).sum())
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.func.grad(lambda x: first(x).sum())(x)


def test_apply_is_stateless():
    x = inputs()
    w = torch.tensor(-0.2, requires_grad=True)
    first = plif.apply(x, backend="torch", w=w)
    second = plif.apply(x, backend="torch", w=w)
    assert torch.equal(first[0][0], second[0][0]) and torch.equal(first[1][0], second[1][0])
    (out,), (v,) = plif.apply(x[2:], states=[first[1][0] * 0 + 0.1], backend="torch", w=w)
    assert out.shape == (3, 2, 3) and v.shape == (2, 3)


# ---- AMP --------------------------------------------------------------------


@pytest.mark.parametrize("device,backend", PAIRS)
def test_autocast_bf16_runs_in_autocast_dtype(device, backend):
    x32 = inputs(device=device).to(torch.bfloat16).float().requires_grad_()  # exactly representable in bf16
    w32 = torch.tensor(-0.4, device=device, requires_grad=True)
    (ref,), _ = plif.apply(x32, backend=backend, w=w32)
    ref_grads = torch.autograd.grad(ref.sum(), [x32, w32])
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        (out,), (v,) = plif.apply(x32, backend=backend, w=w32)
    assert out.dtype == torch.bfloat16 and v.dtype == torch.bfloat16
    assert torch.equal(out.float(), ref)  # fp32 internal compute: the same spikes
    grads = torch.autograd.grad(out.float().sum(), [x32, w32])
    assert grads[0].dtype == torch.float32 and grads[1].dtype == torch.float32
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


def _each_layer(net, x):
    """Every module's output of one call, in order."""
    outputs = []
    handles = [m.register_forward_hook(lambda m, args, out: outputs.append(out)) for m in net]
    try:
        net(x)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def test_autocast_in_a_network_matches_fp32():
    net = make_net("torch")
    with torch.no_grad():
        net[0].bias.fill_(0.8)  # enough current for both neuron layers to fire
        net[2].weight.abs_().mul_(2.0)
    x = inputs(T=16, batch=8, seed=3)
    reset(net)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        got = _each_layer(net, x)
    assert got[-1].dtype == torch.bfloat16
    # What autocast computes: each Linear on bf16-rounded operands (exact products, float32 sums) rounded to bf16;
    # flexgen's neurons take those currents and compute in float32. Stepped the same way by hand, every layer's
    # output is the same, bit for bit.
    reset(net)
    current = x
    with torch.no_grad():
        for module, out in zip(net, got):
            if isinstance(module, torch.nn.Linear):
                operands = [t.to(torch.bfloat16).float() for t in (current, module.weight, module.bias)]
                current = torch.nn.functional.linear(*operands).to(torch.bfloat16).float()
            else:
                current = module(current)
                assert 0 < current.sum() < current.numel(), "each neuron layer should both fire and not fire"
            assert torch.equal(out.float(), current)
    reset(net)
    fp32 = _each_layer(net, x)
    assert not all(torch.equal(a, b.float()) for a, b in zip(fp32, got))  # bf16 changed something: the check has teeth


# ---- determinism ---------------------------------------------------------------


@pytest.mark.parametrize("device,backend", PAIRS)
def test_learnable_grads_bit_identical_under_deterministic_algorithms(device, backend):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        grads = []
        for _ in range(2):
            w = torch.tensor(-0.3, device=device, requires_grad=True)
            x = inputs(T=4, batch=3, features=700, device=device).requires_grad_()  # more than one program
            (out,), (v,) = plif.apply(x, backend=backend, w=w)
            grads.append(torch.autograd.grad((out * x).sum() + v.sum(), [w, x]))
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    finally:
        torch.use_deterministic_algorithms(previous)


# ---- single-step mode ---------------------------------------------------------


@pytest.mark.parametrize("device,backend", PAIRS)
def test_single_step_mode_equals_multi_step(device, backend):
    x = inputs(T=4, device=device)
    multi = plif(backend=backend).to(device)
    single = plif(backend=backend, step_mode="s").to(device)
    out_m = multi(x)
    out_s = torch.stack([single(x[t]) for t in range(x.shape[0])])
    assert torch.equal(out_m, out_s)
    torch.testing.assert_close(single.v, multi.v)
    out_m.sum().backward()
    out_s.sum().backward()
    torch.testing.assert_close(single.w.grad, multi.w.grad)


# ---- drop-in conversion ------------------------------------------------------


def test_convert_leaves_other_modules_alone():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    assert flexgen.convert(net) is net and isinstance(net[1], torch.nn.ReLU)


def test_convert_snntorch_leaky_matches_snntorch():
    snn = pytest.importorskip("snntorch")
    from snntorch import surrogate

    for mechanism, grad in (("subtract", None), ("zero", surrogate.atan(alpha=3.0)), ("none", surrogate.sigmoid(slope=5))):
        torch.manual_seed(1)
        leaky = snn.Leaky(beta=0.8, threshold=0.7, init_hidden=True, learn_beta=True, reset_mechanism=mechanism, spike_grad=grad)
        ref = torch.nn.Sequential(torch.nn.Linear(3, 4), leaky)
        net = flexgen.convert(copy.deepcopy(ref), backend="torch")
        assert isinstance(net[1], flexgen.NeuronModule) and net[1].beta.requires_grad and not net[1].threshold.requires_grad
        x = inputs(T=6)
        a = torch.stack([ref(x[t]) for t in range(6)])
        b = torch.stack([net(x[t]) for t in range(6)])
        assert torch.equal(a, b) and a.sum() > 0
        a.sum().backward()
        b.sum().backward()
        torch.testing.assert_close(net[1].beta.grad, ref[1].beta.grad.reshape(()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(net[0].weight.grad, ref[0].weight.grad, rtol=1e-5, atol=1e-5)


def test_convert_snntorch_rejects_unsupported_options():
    snn = pytest.importorskip("snntorch")
    with pytest.raises(ValueError, match="inhibition"):
        flexgen.convert(torch.nn.Sequential(snn.Leaky(beta=0.9, inhibition=True)))


def _spikingjelly_neuron():
    pytest.importorskip("spikingjelly.activation_based.neuron")
    from spikingjelly.activation_based import neuron

    return neuron


@pytest.mark.parametrize("kind", ["IFNode", "LIFNode", "ParametricLIFNode"])
def test_convert_spikingjelly_matches_spikingjelly(kind):
    neuron = _spikingjelly_neuron()
    from spikingjelly.activation_based import functional, surrogate

    options = {"IFNode": {}, "LIFNode": {"tau": 3.0, "decay_input": False}, "ParametricLIFNode": {"init_tau": 3.0}}[kind]
    node = getattr(neuron, kind)(
        v_threshold=0.8, v_reset=None, surrogate_function=surrogate.ATan(alpha=3.0), step_mode="m", **options
    )
    torch.manual_seed(2)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), node)
    net = flexgen.convert(copy.deepcopy(ref), backend="torch")
    assert not any(isinstance(m, getattr(neuron, kind)) for m in net.modules())
    x = inputs(T=6)
    a, b = ref(x), net(x)
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    torch.testing.assert_close(net[0].weight.grad, ref[0].weight.grad, rtol=1e-5, atol=1e-5)
    if kind == "ParametricLIFNode":
        (w,) = [p for n, p in net[1].named_parameters()]
        torch.testing.assert_close(w.grad.reshape(()), ref[1].w.grad.reshape(()), rtol=1e-5, atol=1e-5)
    functional.reset_net(ref)
