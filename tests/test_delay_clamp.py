"""One clamp rule for learnable delays outside [0, max_delay], on every path: the value of the nearest bound (huge
and infinite delays included), the gradient straight through. And a second backward through DelayedLinear: real
values on the convolution, the clear refusal on the Triton backends."""
import pytest
import torch

import flexgen
from flexgen.layers.delay_taps import clamped_delays
from conftest import HAS_C_COMPILER, HAS_CUDA, INTERPRETER, TRITON_DEVICE, max_rel_err

OUT_OF_RANGE = [1e9, 1e30, float("inf"), -1e9, float("-inf")]
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRETER), reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def _bound(value, max_delay):
    return min(max(value, 0.0), float(max_delay))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("value", OUT_OF_RANGE)
def test_clamped_delays_take_the_bound_exactly_with_the_gradient_straight_through(value, dtype):
    delay = torch.tensor([value, 1.5, -2.0], dtype=dtype, requires_grad=True)
    clamped = clamped_delays(delay, 3)
    assert clamped.tolist() == [_bound(value, 3), 1.5, 0.0]
    (clamped * torch.tensor([2.0, 3.0, 4.0], dtype=dtype)).sum().backward()
    assert delay.grad.tolist() == [2.0, 3.0, 4.0]


@pytest.mark.parametrize("interpolation", ["linear", "gaussian"])
@pytest.mark.parametrize("value", OUT_OF_RANGE)
def test_a_delay_layer_uses_the_bound_for_huge_and_infinite_delays(value, interpolation):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 2, 2, generator=g)
    outside = flexgen.Delay(2, max_delay=3, delay=torch.tensor([value, 1.0]), interpolation=interpolation)
    bound = flexgen.Delay(2, max_delay=3, delay=torch.tensor([_bound(value, 3), 1.0]), interpolation=interpolation)
    got, want = outside(x), bound(x)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    got.sum().backward()
    want.sum().backward()
    assert torch.equal(outside.delay.grad, bound.delay.grad)


@pytest.mark.parametrize("backend", ["conv", pytest.param("fused", marks=needs_triton),
                                     pytest.param("taps", marks=needs_triton)])
@pytest.mark.parametrize("value", [1e9, float("inf"), float("-inf")])
def test_delayed_linear_uses_the_bound_on_every_backend(value, backend):
    g = torch.Generator().manual_seed(1)
    device = "cpu" if backend == "conv" else TRITON_DEVICE
    x = torch.randn(8, 2, 3, generator=g, dtype=torch.float64).to(device)
    delays = torch.tensor([[value, 0.5, 2.0], [1.0, -value, 2.5]], dtype=torch.float64)
    layers = []
    for d in (delays, delays.clamp(0.0, 3.0)):
        torch.manual_seed(2)
        layers.append(flexgen.DelayedLinear(3, 2, max_delay=3, delay=d, dtype=torch.float64,
                                            backend=backend).to(device))
    outside, bound = layers
    got, want = outside(x), bound(x)
    assert torch.isfinite(got).all() and max_rel_err(got, want) <= 1e-12
    got.sum().backward()
    want.sum().backward()
    assert max_rel_err(outside.delay.grad, bound.delay.grad) <= 1e-12


def _neuron_backends():
    pairs = [("cpu", "torch")]
    if HAS_C_COMPILER:
        pairs.append(("cpu", "c"))
    if HAS_CUDA or INTERPRETER:
        pairs.append((TRITON_DEVICE, "triton"))
    return pairs


@pytest.mark.parametrize("device,backend", _neuron_backends())
@pytest.mark.parametrize("interpolation", ["linear", "gaussian"])
def test_a_neuron_layers_delay_line_uses_the_bound_on_every_backend(device, backend, interpolation):
    g = torch.Generator().manual_seed(3)
    x = (2.0 * torch.rand(10, 2, 3, generator=g, dtype=torch.float64)).to(device)

    def run(delays):
        delay = flexgen.Delay(3, max_delay=4, delay=delays, interpolation=interpolation, dtype=torch.float64)
        layer = flexgen.LIF(v_threshold=0.5, step_mode="m", backend=backend, delay=delay).to(device)
        out = layer(x)
        out.sum().backward()
        return out, layer.delay.delay.grad

    out, grad = run(torch.tensor([1e9, float("-inf"), 2.5], dtype=torch.float64))
    want_out, want_grad = run(torch.tensor([4.0, 0.0, 2.5], dtype=torch.float64))
    assert torch.equal(out, want_out)
    assert max_rel_err(grad, want_grad) <= 1e-12


def test_a_recurrent_layers_synapse_delays_use_the_bound():
    torch.manual_seed(4)
    delay = flexgen.SynapseDelay(2, max_delay=3, delay=torch.tensor([[1e9, 0.0], [float("inf"), 1.0]]))
    bound = flexgen.SynapseDelay(2, max_delay=3, delay=torch.tensor([[3.0, 0.0], [3.0, 1.0]]))
    weight = torch.randn(2, 2)
    assert torch.equal(delay(weight), bound(weight))


def _penalty(layer, x):
    (grad,) = torch.autograd.grad(layer(x).pow(2).sum(), x, create_graph=True)
    return grad.pow(2).sum()


def test_the_convolution_gives_second_order_gradients():
    torch.manual_seed(5)
    layer = flexgen.DelayedLinear(3, 2, max_delay=3, dtype=torch.float64, backend="conv")
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    penalty = _penalty(layer, x)
    assert penalty.requires_grad
    penalty.backward()
    assert layer.weight.grad.abs().max() > 0 and x.grad.abs().max() > 0


@needs_triton
@pytest.mark.parametrize("backend,interpolation", [("fused", "linear"), ("taps", "linear"), ("taps", "gaussian"),
                                                   ("auto", "linear")])
def test_the_triton_backends_refuse_a_second_backward(backend, interpolation):
    torch.manual_seed(6)
    layer = flexgen.DelayedLinear(3, 2, max_delay=3, dtype=torch.float64, backend=backend,
                                  interpolation=interpolation).to(TRITON_DEVICE)
    x = torch.randn(6, 2, 3, dtype=torch.float64, device=TRITON_DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="a gradient of a gradient") as info:
        _penalty(layer, x)
    assert "backend='conv'" in str(info.value)
    # an ordinary backward still runs
    layer(x).sum().backward()
    assert x.grad is not None and layer.delay.grad is not None
