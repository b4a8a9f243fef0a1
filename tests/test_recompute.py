"""recompute=True: the backward re-runs the forward steps from the inputs and checkpointed states."""
import warnings

import pytest
import torch

import flexgen
from conftest import TRITON_DEVICE, device_backends
from specs import ALL, lif, plif


def gradients(spec, inputs, states, params, recompute, store_state_seqs=False, backend="triton"):
    outputs, finals = spec.apply(*inputs, states=states, backend=backend, recompute=recompute,
                                 store_state_seqs=store_state_seqs, **params)
    g = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype).to(t.device)).sum() for t in outputs + finals)
    leaves = list(inputs) + list(states) + list(params.values())
    return outputs + finals, torch.autograd.grad(loss, leaves)


def random_call(spec, T, device, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    inputs = [(torch.randn(T, 3, 5, generator=g, dtype=dtype) * 1.5 + 0.7).to(device).requires_grad_() for _ in spec.signature.inputs]
    states = [(torch.rand(3, 5, generator=g, dtype=dtype) * 0.5).to(device).requires_grad_() for _ in spec.signature.states]
    params = {w: torch.tensor(-0.3, dtype=dtype, device=device, requires_grad=True) for w in spec.signature.learnable}
    return inputs, states, params


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("T,store_state_seqs", [(1, False), (7, False), (19, False), (19, True)])
def test_recompute_gives_the_plain_results(device, backend, name, T, store_state_seqs):
    """T = 19 runs several chunks (the last one partial) for every chunk length of these specs."""
    spec = ALL[name]
    inputs, states, params = random_call(spec, T, device)
    plain = gradients(spec, inputs, states, params, False, store_state_seqs, backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every backend has both designs: no fallback, no message
        recomputed = gradients(spec, inputs, states, params, True, store_state_seqs, backend)
    for a, b in zip(plain[0], recomputed[0]):
        assert torch.equal(a, b)
    for a, b in zip(plain[1], recomputed[1]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device,backend", device_backends())
def test_recompute_with_step_values_of_parameters_alone(device, backend):
    """ALIF's decays alpha = exp(-dt/tau) and rho are step values of hyper-parameters alone: the recompute
    backward computes them once before its loop, and its re-run forward and its backward stay apart."""
    from flexgen.neurons import zoo

    before_loop = zoo.alif.source("backward_recompute").split("    for ")[0]
    assert "alpha = tl.exp(-dt/tau)" in before_loop and "rho = tl.exp(-dt/tau_a)" in before_loop
    inputs, states, params = random_call(zoo.alif, 9, device)
    plain = gradients(zoo.alif, inputs, states, params, False, backend=backend)
    recomputed = gradients(zoo.alif, inputs, states, params, True, backend=backend)
    for a, b in zip(plain[0], recomputed[0]):
        assert torch.equal(a, b)
    for a, b in zip(plain[1], recomputed[1]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recompute_saves_inputs_initial_states_and_checkpoints_only(device, backend, dtype):
    T = 19
    chunk = lif.compiled().ops_for(True).layout.variant.chunk
    x = torch.randn(T, 4, 6, dtype=dtype, device=device, requires_grad=True)
    v0 = torch.rand(4, 6, dtype=dtype, device=device)
    (s,), _ = lif.apply(x, states=[v0], backend=backend, recompute=True)
    saved = s.grad_fn.saved_tensors
    per_step = [t for t in saved if t.dim() and t.shape[0] == T]
    assert len(per_step) == 1 and torch.equal(per_step[0], x)
    checkpoints = [t for t in saved if t.dim() == 3 and t.shape[0] != T]
    assert [t.shape for t in checkpoints] == [(-(-T // chunk) - 1, 4, 6)]
    assert checkpoints[0].dtype == torch.float32  # the compute dtype: the re-run is exact in fp16 too
    (s_plain,), _ = lif.apply(x, states=[v0], backend=backend)
    assert torch.equal(s, s_plain)


def test_chunk_length_follows_what_the_backward_reads():
    assert lif.compiled().ops_for(True).layout.variant.chunk == 4  # one value per step (h)
    assert ALL["adaptive_mix"].compiled().ops_for(True).layout.variant.chunk == 1  # three (y, a, h)
    assert ALL["plif"].compiled().ops_for(True).layout.variant.chunk == 2  # two (x, v)


@pytest.mark.parametrize("device,backend", device_backends())
def test_per_channel_parameters_and_module_state(device, backend):
    torch.manual_seed(3)
    x = torch.randn(10, 2, 3, 4, dtype=torch.float64, device=device)
    grads = {}
    for recompute in (False, True):
        layer = flexgen.PLIF(per_channel=3, step_mode="m", backend=backend, recompute=recompute).to(device=device, dtype=torch.float64)
        with torch.no_grad():
            layer.w.copy_(torch.tensor([-0.7, 0.1, 0.9]))
        xs = x.clone().requires_grad_()
        first = layer(xs[:6])
        second = layer(xs[6:])  # starts from the states the first call left
        (first.sum() + (second * torch.arange(4.0, dtype=torch.float64, device=device)).sum()).backward()
        grads[recompute] = (torch.cat([first, second]), xs.grad, layer.w.grad)
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_layers_and_functional_form_take_the_option():
    assert "recompute=True" in repr(lif(recompute=True))
    assert "recompute=False" in repr(lif(recompute=False))
    assert "recompute" not in repr(lif())
    assert lif().recompute == "auto" and flexgen.LIF().recompute == "auto"
    assert flexgen.LIF(recompute=True, backend="torch").recompute
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(TypeError, match="recompute must be True, False or 'auto'"):
            lif(recompute=bad)
    with pytest.raises(TypeError, match="recompute must be True, False or 'auto'"):
        lif.apply(torch.zeros(2, 3), recompute=1)


@pytest.mark.parametrize("dtype,expected", [
    (torch.float32, {"lif": (8, 6), "plif": (12, 8), "adaptive_mix": (16, 24)}),
    (torch.float16, {"lif": (4, 4), "plif": (6, 6), "adaptive_mix": (8, 20)}),
])
def test_auto_recomputes_where_that_moves_fewer_bytes(dtype, expected):
    """Bytes per neuron and step of keeping what the backward needs, plain against recompute: LIF saves h
    (written and read) or re-reads x and a fp32 checkpoint of v every 4 steps; PLIF also reads x in
    its plain backward and checkpoints every 2 steps; adaptive_mix saves three values (an input, a
    state, an output), so it checkpoints its two states every step. In fp16 the checkpoints' fp32
    rows cost what they save."""
    for name, (plain, recomputing) in expected.items():
        compiled = ALL[name].compiled()
        sizes = torch.finfo(dtype).bits // 8, 4
        assert compiled.ops.layout.saved_bytes_per_step(*sizes) == plain
        assert compiled.recompute_ops.layout.saved_bytes_per_step(*sizes) == recomputing
        assert compiled.recompute_pays(dtype) == (recomputing < plain)


def _saved_shapes(spec, x, backend, recompute):
    (s,), _ = spec.apply(x, backend=backend, recompute=recompute)
    return [tuple(t.shape) for t in s.grad_fn.saved_tensors]


@pytest.mark.parametrize("device,backend", device_backends())
def test_auto_runs_the_design_that_moves_fewer_bytes_on_cuda_only(device, backend):
    """The choice is for the GPU's memory-bound kernels: fp32 LIF recomputes there; on the CPU (the C kernels,
    the interpreter, the torch path) and for fp16 "auto" runs the plain design."""
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(6, 2, 3, dtype=dtype).to(device).requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # backend="c" says fp16 runs the torch path
            auto = _saved_shapes(lif, x, backend, "auto")
        chosen = device == "cuda" and backend != "torch" and dtype == torch.float32
        assert auto == _saved_shapes(lif, x, backend, chosen), (dtype, backend)
        assert auto != _saved_shapes(lif, x, backend, not chosen), (dtype, backend)


def test_no_grad_and_eager_backend_ignore_it():
    x = torch.randn(9, 5)
    with torch.no_grad():
        (s,), _ = lif.apply(x, backend="torch", recompute=True)
    (ref,), _ = lif.apply(x, backend="eager", recompute=True)
    assert torch.equal(s, ref)


def test_generated_sources_are_readable():
    forward = lif.source("forward_recompute")
    backward = lif.source("backward_recompute")
    assert "v_ckpt_ptr" in forward and "_buf_ptr" not in forward
    assert "v_ckpt_ptr" in backward and "_buf_ptr" not in backward
    assert backward.count("# forward step") == backward.count("# backward step") == 4
    assert "def lif_forward_recompute(" in lif.source("module")


@pytest.mark.parametrize("device,backend", [(TRITON_DEVICE, "triton")])
def test_empty_inputs(device, backend):
    for shape in [(0, 3), (4, 0)]:
        x = torch.zeros(shape, device=device, requires_grad=True)
        (s,), (v,) = lif.apply(x, backend=backend, recompute=True)
        s.sum().backward()
        assert s.shape == shape and x.grad.shape == shape


@pytest.mark.parametrize("device,backend", device_backends())
def test_per_sample_gradients_under_torch_func(device, backend):
    x = torch.randn(3, 9, 5, dtype=torch.float64, device=device) * 1.5 + 0.7  # 3 samples of [T=9, 5]
    weights = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64, device=device)

    def per_sample(recompute):
        def loss(sample):
            (s,), (v,) = lif.apply(sample, backend=backend, recompute=recompute)
            return (s * weights).sum() + v.sum()
        return torch.func.vmap(torch.func.grad(loss))(x)

    torch.testing.assert_close(per_sample(True), per_sample(False), rtol=1e-12, atol=1e-12)
