"""Second-order gradients: backend="eager" gives them; every path that runs generated kernels refuses them with
one clear error instead of returning gradients that silently lack the terms through the neuron."""
import pytest
import torch

import flexgen
from conftest import TRITON_DEVICE, plain_device_backends
from flexgen.launch.autograd import SECOND_ORDER

REFUSAL = "a gradient of a gradient"


def _sigmoid_spike(x, alpha=4.0):
    """Heaviside forward, sigmoid surrogate backward, written with differentiable torch ops only."""
    surrogate = torch.sigmoid(alpha * x)
    return (x >= 0).to(x.dtype) + surrogate - surrogate.detach()


def _lif_by_hand(x, tau=2.0, v_th=1.0):
    """SpikingJelly's LIF (decay_input, hard reset to 0, reset not detached), one op at a time."""
    v, spikes = torch.zeros_like(x[0]), []
    for x_t in x:
        h = v + (x_t - v) / tau
        s = _sigmoid_spike(h - v_th)
        v = h * (1.0 - s)
        spikes.append(s)
    return torch.stack(spikes)


def _gradient_penalty(layer, x):
    """d/dx of |d(sum of spikes * x)/dx|^2: a second backward through the layer."""
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad((out * x).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(grad.pow(2).sum(), x)
    return second


def _input(device="cpu"):
    torch.manual_seed(0)
    return (2.0 * torch.randn(4, 3, 5, dtype=torch.float64, device=device)).requires_grad_()


def test_eager_backend_gives_the_second_order_gradient_of_the_step_function():
    x = _input()
    got = _gradient_penalty(flexgen.LIF(step_mode="m", backend="eager"), x)
    expected = _gradient_penalty(_lif_by_hand, x)
    assert got.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_eager_recurrent_layer_gives_a_second_order_gradient():
    torch.manual_seed(1)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=5, backend="eager").double()
    second = _gradient_penalty(layer, _input())
    assert torch.isfinite(second).all() and second.abs().max() > 0


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_generated_kernels_refuse_a_second_backward(device, backend):
    layer = flexgen.LIF(step_mode="m", backend=backend)
    with pytest.raises(RuntimeError, match=REFUSAL) as info:
        _gradient_penalty(layer, _input(device))
    assert "backend='eager'" in str(info.value)


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_refused_even_when_the_loss_is_linear_in_the_spikes(device, backend):
    # The incoming gradient (ones) does not require grad; the dependence runs through the saved values alone.
    x = _input(device)
    out = flexgen.LIF(step_mode="m", backend=backend)(x)
    with pytest.raises(RuntimeError, match=REFUSAL):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.parametrize("path", ["stepwise", "fused"])
def test_recurrent_kernels_refuse_a_second_backward(path):
    backend = "torch" if path == "stepwise" and TRITON_DEVICE == "cpu" else "triton"
    dtype = torch.float64 if TRITON_DEVICE == "cpu" else torch.float32
    torch.manual_seed(2)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=5, path=path, backend=backend).to(TRITON_DEVICE, dtype)
    x = _input(TRITON_DEVICE).detach().to(dtype).requires_grad_()
    with pytest.raises(RuntimeError, match=REFUSAL):
        _gradient_penalty(layer, x)
    assert layer.path == path


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_torch_func_grad_of_grad_is_refused_with_the_same_message(device, backend):
    layer = flexgen.LIF(step_mode="m", backend=backend)
    x = _input(device).detach()

    def loss(x):
        return (layer(x) * x).sum()

    with pytest.raises(RuntimeError, match=REFUSAL) as info:
        torch.func.grad(lambda x: torch.func.grad(loss)(x).pow(2).sum())(x)
    assert str(info.value) == SECOND_ORDER
