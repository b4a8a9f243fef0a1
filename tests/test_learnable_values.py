"""Learnable values: any shape that broadcasts against one step, and the dtype they are made in."""
import pytest
import torch

import flexgen
from conftest import device_backends, max_rel_err
from reference import RefSpike, sigmoid_grad
from specs import plif

BACKENDS = device_backends() + [("cpu", "eager")]


def reference_plif(x, w):
    """specs.plif by hand: h = v + (x - v) sigmoid(w), spike on h >= 1, hard reset; w broadcast by torch."""
    v = torch.zeros_like(x[0])
    spikes = []
    for t in range(x.shape[0]):
        h = v + (x[t] - v) * torch.sigmoid(w)
        s = RefSpike.apply(h - 1.0, sigmoid_grad)
        v = h * (1.0 - s)
        spikes.append(s)
    return torch.stack(spikes), v


# Step [B, C, H] = [2, 4, 3]: none of these is one value or one per channel (a [4] tensor would be).
SHAPES = [(4, 3), (3,), (4, 1), (1, 4, 3), (2, 4, 3), (2, 1, 1)]


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_broadcast_shaped_learnable_matches_reference(shape, device, backend):
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    x = (torch.rand(4, 2, 4, 3, generator=g, dtype=torch.float64) * 2.4 - 0.2).to(device).requires_grad_()
    w = (torch.randn(shape, generator=g, dtype=torch.float64)).to(device).requires_grad_()
    up = torch.randn(4, 2, 4, 3, generator=g, dtype=torch.float64).to(device)
    (s,), (v,) = plif.apply(x, w=w, backend=backend)
    grads = torch.autograd.grad((s * up).sum() + v.sum(), [x, w])

    w_ref = w.detach().clone().requires_grad_()
    s_ref, v_ref = reference_plif(x, w_ref)
    ref = torch.autograd.grad((s_ref * up).sum() + v_ref.sum(), [x, w_ref])
    assert torch.equal(s, s_ref) and 0 < s.sum() < s.numel()
    # float64, the reference's expressions up to the order of operations and sums: elementwise within 1e-12 of the
    # largest magnitude (measured on the CPU: at most 8.1e-16)
    assert max_rel_err(v, v_ref) <= 1e-12
    assert grads[1].shape == w.shape
    for got, want in zip(grads, ref):
        assert want.abs().max() > 0 and max_rel_err(got, want) <= 1e-12, max_rel_err(got, want)


def test_broadcast_shaped_parameter_of_a_layer_learns_per_neuron():
    layer = flexgen.PLIF(backend="torch")
    layer.w = torch.nn.Parameter(torch.zeros(4, 3))
    x = torch.rand(3, 2, 4, 3) * 3.0
    layer(x).sum().backward()
    assert layer.w.grad.shape == (4, 3) and layer.w.grad.abs().sum() > 0
    assert not torch.equal(layer.w.grad[0], layer.w.grad[1])  # one gradient per neuron, not shared


def test_broadcast_shaped_learnable_under_vmap():
    """torch.func.vmap adds its dim as one more neuron dim; a [C, H] parameter still lines up with the step."""
    g = torch.Generator().manual_seed(5)
    xs = torch.rand(3, 4, 2, 4, 3, generator=g, dtype=torch.float64) * 2.4 - 0.2  # vmapped over dim 0
    w = torch.randn(4, 3, generator=g, dtype=torch.float64)
    batched = torch.func.vmap(lambda x: plif.apply(x, w=w, backend="torch")[0][0])(xs)
    for i in range(xs.shape[0]):
        assert torch.equal(batched[i], reference_plif(xs[i], w)[0])


# ---- dtype ------------------------------------------------------------------


def test_learnable_takes_the_dtype_argument_exactly():
    layer = plif(w=0.9, dtype=torch.float64)
    assert layer.w.dtype == torch.float64 and layer.w.item() == 0.9
    assert flexgen.PLIF(init_tau=3.0, dtype=torch.float64).w.item() == -0.6931471805599453  # -log(2), exactly


def test_learnable_follows_the_default_dtype():
    assert plif(w=0.9).w.dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = plif(w=0.9)
    finally:
        torch.set_default_dtype(previous)
    assert layer.w.dtype == torch.float64 and layer.w.item() == 0.9


def test_learnable_tensor_value_keeps_its_dtype_and_values():
    value = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    layer = plif(w=value)
    assert layer.w.dtype == torch.float64 and torch.equal(layer.w.detach(), value)
    assert plif(w=value, dtype=torch.float32).w.dtype == torch.float32


@pytest.mark.parametrize("bad", ["float64", torch.int64, 64])
def test_learnable_dtype_must_be_a_floating_dtype(bad):
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        plif(dtype=bad)


def test_broadcast_shaped_learnable_under_torch_compile():
    layer = plif(backend="torch")
    layer.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 12).reshape(4, 3))
    x = torch.rand(3, 2, 4, 3) * 3.0

    def run(x):
        layer.reset()
        return layer(x)

    ref = run(x)
    (ref_grad,) = torch.autograd.grad(ref.sum() + layer.v.sum(), layer.w)
    out = torch.compile(run, fullgraph=True, backend="aot_eager")(x)
    (grad,) = torch.autograd.grad(out.sum() + layer.v.sum(), layer.w)
    assert torch.equal(out, ref)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
