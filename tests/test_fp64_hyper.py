"""float64 runs compute with the hyper-parameters' float64 values on every path (a Python float reaches a Triton
kernel as fp32: fp64 runs pass them as fp64 tensors), while other dtypes keep passing numbers."""
import pytest
import torch

import flexgen
from conftest import TRITON_DEVICE, device_backends
from flexgen import spike
from flexgen.launch.abi import kernel_args
from flexgen.render.layout import forward_arguments


@flexgen.neuron(states=("v", "a"))
def alif(x, v, a, tau=3.0, v_th=1.0, v_reset=-0.2, beta=0.6, tau_a=7.0):
    """Two states whose updates read hyper-parameters that fp32 cannot hold (0.6, -0.2, 1/3, 1/7)."""
    h = v + (x - (v - v_reset)) / tau
    theta = v_th + beta * a
    s = spike(h - theta)
    return s, h - s * (h - v_reset), a + (s - a) / tau_a


def run(backend, x, **options):
    layer = alif(backend=backend, **options)
    s = layer(x)
    weights = torch.linspace(-1.0, 1.0, s.numel(), dtype=s.dtype, device=s.device).reshape(s.shape)
    loss = (s * weights).sum() + (layer.v * layer.v).sum() + 1.3 * layer.a.sum()
    return [s, layer.v, layer.a, *torch.autograd.grad(loss, x)]


def inputs(device, transposed=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, 8, generator=g, dtype=torch.float64) * 1.5 + 0.7
    x = x.transpose(1, 2) if transposed else x  # neurons that do not flatten: copied, no plan (the general path)
    return x.to(device).requires_grad_()


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_float64_states_and_gradients_match_a_float64_reference(device, backend, transposed, recompute):
    x = inputs(device, transposed)
    got = run(backend, x, recompute=recompute, beta=0.6, v_reset=-0.2)
    ref = run("eager", x, beta=0.6, v_reset=-0.2)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:]):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_hyper_parameters_are_numbers_in_float32_and_fp64_tensors_in_float64():
    layout = alif.compiled().layout
    arguments = forward_arguments(layout, training=False)
    for dtype, expected in ((torch.float32, float), (torch.float64, torch.Tensor)):
        x = torch.zeros(2, 3, dtype=dtype)
        v = torch.zeros(3, dtype=dtype)
        groups = ([x], [v, v], [], [x], [v, v], [], [3.0, 1.0, -0.2, 0.6, 7.0])
        args = kernel_args(arguments, groups, (3,), flatten_params=False, dtype=dtype, device=x.device)
        hyper = args[-len(layout.hyper):]
        assert all(isinstance(p, expected) for p in hyper)
        if dtype == torch.float64:
            assert [p.dtype for p in hyper] == [torch.float64] * 5 and hyper[2].item() == -0.2
            assert args.reusable  # kept tensors: the plan's template holds them


def test_float64_plan_is_reused_across_calls():
    layer = alif(backend="triton", beta=0.6)
    x = inputs(TRITON_DEVICE)
    first = layer(x)
    layer.reset()
    assert len(layer._known_calls) == 1
    assert torch.equal(layer(x), first)


@pytest.mark.gpu
def test_float64_compiled_matches_eager():
    import torch._dynamo

    torch._dynamo.reset()
    x = inputs("cuda")
    layer = alif(beta=0.6, v_reset=-0.2).cuda()

    def forward(x):
        layer.reset()
        s = layer(x)
        return s, layer.v, layer.a

    s, v, a = torch.compile(forward, fullgraph=True)(x)
    ref = run("eager", x, beta=0.6, v_reset=-0.2)
    assert torch.equal(s, ref[0])
    torch.testing.assert_close(v, ref[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a, ref[2], rtol=1e-12, atol=1e-12)
