"""Runtime inputs: clear errors for what the kernels cannot take, correct results for edge cases.

Each case runs on every (device, backend) pair this machine has and is
compared with the eager oracle where a result is expected.
"""
import math

import pytest
import torch

from conftest import device_backends
from specs import adaptive_mix, lif, plif

PAIRS = device_backends()


def eager_and(backend, spec, inputs, states=None, **params):
    got = spec.apply(*inputs, states=states, backend=backend, **params)
    ref = spec.apply(*inputs, states=states, backend="eager", **params)
    return got, ref


def assert_same(got, ref):
    for a, b in zip(got[0] + got[1], ref[0] + ref[1]):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)


# ---- errors -----------------------------------------------------------------


@pytest.mark.parametrize("device,backend", PAIRS)
def test_inputs_of_different_shapes(device, backend):
    x, y = torch.zeros(3, 4, device=device), torch.zeros(3, 5, device=device)
    with pytest.raises(ValueError, match="share shape, dtype and device"):
        adaptive_mix.apply(x, y, backend=backend)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_inputs_of_different_dtypes(device, backend):
    x, y = torch.zeros(3, 4, device=device), torch.zeros(3, 4, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match="float64"):
        adaptive_mix.apply(x, y, backend=backend)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_inputs_on_different_devices(device, backend):
    x = torch.zeros(3, 4, device=device)
    y = torch.zeros(3, 4, device="meta")
    with pytest.raises(ValueError, match="meta"):
        adaptive_mix.apply(x, y, backend=backend)


@pytest.mark.parametrize("device,backend", PAIRS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_floating_inputs(device, backend, dtype):
    x = torch.zeros(3, 4, device=device).to(dtype)
    with pytest.raises(TypeError, match="floating-point"):
        lif.apply(x, backend=backend)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_scalar_input_needs_time_dimension(device, backend):
    with pytest.raises(ValueError, match="leading time dimension"):
        lif.apply(torch.tensor(1.0, device=device), backend=backend)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_missing_time_dimension_against_states(device, backend):
    """A [B, N] input given to a layer whose states are [B, N]: the T dimension is missing."""
    layer = lif(backend=backend).to(device)
    layer(torch.zeros(2, 3, 4, device=device))
    with pytest.raises(ValueError, match="leading time dimension missing"):
        layer(torch.zeros(3, 4, device=device))


@pytest.mark.parametrize("device,backend", PAIRS)
def test_wrong_number_of_inputs_and_states(device, backend):
    x = torch.zeros(2, 3, device=device)
    with pytest.raises(TypeError, match="takes 2 input"):
        adaptive_mix.apply(x, backend=backend)
    with pytest.raises(TypeError, match="has 1 state"):
        lif.apply(x, states=[torch.zeros(3, device=device)] * 2, backend=backend)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_learnable_param_on_wrong_device(device, backend):
    x = torch.zeros(2, 3, device=device)
    w = torch.tensor(-0.5, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match="learnable parameter 'w' is on meta"):
        plif.apply(x, backend=backend, w=w)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_learnable_param_must_be_scalar_per_channel_or_broadcast_float(device, backend):
    x = torch.zeros(2, 3, device=device)  # [T, B]: no channel dim; 2 values do not broadcast against [3]
    with pytest.raises(ValueError, match=r"one value, one per channel .* broadcasts against one step .*\(3,\)"):
        plif.apply(x, backend=backend, w=torch.zeros(2, device=device, requires_grad=True))
    x = torch.zeros(2, 1, 4, device=device)  # [T, B, C] with C = 4
    with pytest.raises(ValueError, match="one value, one per channel"):
        plif.apply(x, backend=backend, w=torch.zeros(3, device=device, requires_grad=True))
    with pytest.raises(ValueError, match="one value, one per channel"):  # more neurons than a step has
        plif.apply(x, backend=backend, w=torch.zeros(2, 1, 4, device=device, requires_grad=True))
    with pytest.raises(TypeError, match="floating-point"):
        plif.apply(x, backend=backend, w=torch.tensor(1, device=device))


@pytest.mark.parametrize("device,backend", PAIRS)
def test_integer_state(device, backend):
    x = torch.zeros(2, 3, device=device)
    with pytest.raises(TypeError, match="state 'v'"):
        lif.apply(x, states=[torch.zeros(3, dtype=torch.int64, device=device)], backend=backend)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_unknown_parameter(device, backend):
    with pytest.raises(TypeError, match="unknown parameter"):
        lif.apply(torch.zeros(2, 3, device=device), backend=backend, tau_m=2.0)


# ---- edge cases with results ------------------------------------------------


def _inputs(T, shape, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, *shape, generator=g) * 1.5 + 0.7).to(device)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_single_step(device, backend):
    x = _inputs(1, (5,), device).requires_grad_()
    got, ref = eager_and(backend, plif, [x])
    assert_same(got, ref)
    (gx,) = torch.autograd.grad(got[0][0].sum() + got[1][0].sum(), x)
    (rx,) = torch.autograd.grad(ref[0][0].sum() + ref[1][0].sum(), x)
    torch.testing.assert_close(gx, rx)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_zero_steps_leave_states_unchanged(device, backend):
    x = torch.zeros(0, 2, 3, device=device, requires_grad=True)
    v0 = torch.rand(2, 3, device=device, requires_grad=True)
    (out,), (v,) = lif.apply(x, states=[v0], backend=backend)
    assert out.shape == (0, 2, 3)
    assert torch.equal(v, v0)
    (gv,) = torch.autograd.grad(v.sum(), v0)
    assert torch.equal(gv, torch.ones_like(v0))


@pytest.mark.parametrize("device,backend", PAIRS)
def test_zero_steps_in_a_module(device, backend):
    layer = lif(backend=backend).to(device)
    layer(_inputs(3, (4,), device))
    before = layer.v.clone()
    out = layer(torch.zeros(0, 4, device=device))
    assert out.shape == (0, 4)
    assert torch.equal(layer.v, before)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_zero_size_batch(device, backend):
    x = torch.zeros(4, 0, 3, device=device, requires_grad=True)
    (out, h), (v, a) = adaptive_mix.apply(x, x, backend=backend)
    assert out.shape == h.shape == (4, 0, 3) and v.shape == a.shape == (0, 3)
    (gx,) = torch.autograd.grad(out.sum() + v.sum(), x)
    assert gx.shape == x.shape


@pytest.mark.parametrize("device,backend", PAIRS)
def test_non_contiguous_inputs(device, backend):
    base = _inputs(6, (5,), device).requires_grad_()
    x = base.t()  # [5, 6] with strides (1, 5): T = 5 steps of 6 neurons
    y = _inputs(6, (5,), device, seed=1).t()
    assert not x.is_contiguous()
    got, ref = eager_and(backend, adaptive_mix, [x, y])
    assert_same(got, ref)
    (g,) = torch.autograd.grad(got[0][1].sum(), base)
    (r,) = torch.autograd.grad(ref[0][1].sum(), base)
    torch.testing.assert_close(g, r)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_expanded_inputs_and_states(device, backend):
    one_step = _inputs(1, (2, 5), device).requires_grad_()
    x = one_step.expand(4, 2, 5)  # the same input at every step, stride 0 in time
    v0 = torch.full((5,), 0.25, device=device).expand(2, 5)  # stride 0 across the batch
    got, ref = eager_and(backend, plif, [x], states=[v0])
    assert_same(got, ref)
    (g,) = torch.autograd.grad(got[0][0].sum() + got[1][0].sum(), one_step)
    (r,) = torch.autograd.grad(ref[0][0].sum() + ref[1][0].sum(), one_step)
    torch.testing.assert_close(g, r)


@pytest.mark.parametrize("device,backend", PAIRS)
def test_nan_and_inf_propagate_like_eager(device, backend):
    x = _inputs(5, (6,), device)
    x[1, 0], x[2, 1], x[3, 2] = math.nan, math.inf, -math.inf
    got, ref = eager_and(backend, lif, [x])
    assert_same(got, ref)
    assert torch.equal(got[1][0].isnan(), ref[1][0].isnan())


def _layout(kind, t):
    """`t` ([T, B, C], contiguous) re-laid out in memory, same values."""
    if kind == "contiguous":
        return t
    if kind == "neurons transposed":  # neuron dims do not flatten: copied before the launch
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "time innermost":  # strides (1, C*T, T): neurons flatten with stride T
        return t.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    if kind == "every other neuron":  # a slice: neurons flatten with stride 2
        wide = torch.zeros(t.shape[0], t.shape[1], 2 * t.shape[2], dtype=t.dtype, device=t.device)
        wide[:, :, ::2] = t
        return wide[:, :, ::2]
    if kind == "same batch row":  # stride 0 across the batch only: does not flatten, copied
        return t[:, :1].expand(t.shape)
    raise ValueError(kind)


LAYOUTS = ["contiguous", "neurons transposed", "time innermost", "every other neuron", "same batch row"]


@pytest.mark.parametrize("device,backend", PAIRS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_memory_layouts_of_inputs_states_and_gradients(device, backend, layout):
    """Kernels read inputs, states and incoming gradients through one neuron stride, or a copy."""
    x = _layout(layout, _inputs(4, (3, 5), device, seed=2)).detach().requires_grad_()
    y = _layout(layout, _inputs(4, (3, 5), device, seed=3))
    states = [_layout(layout, _inputs(1, (3, 5), device, seed=s))[0].detach().requires_grad_() for s in (4, 5)]
    up = _layout(layout, _inputs(4, (3, 5), device, seed=6))
    results = []
    for b in (backend, "eager"):
        (s, h), finals = adaptive_mix.apply(x, y, states=states, backend=b)
        loss = (h * up).sum() + (s * up).sum() + (finals[0] * up[0]).sum()
        results.append([s, h, *finals, *torch.autograd.grad(loss, [x, *states])])
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device,backend", PAIRS)
@pytest.mark.parametrize("recompute", [False, True])
def test_saved_buffers_are_freed_after_backward(device, backend, recompute):
    """The forward's buffers are saved for the backward without being outputs; autograd frees them after it."""
    layer = lif(backend=backend, recompute=recompute)
    x = _inputs(9, (3, 5), device).requires_grad_()
    s = layer(x)
    node = s.grad_fn
    buffers = [t for t in node.saved_tensors if t is not x]
    if recompute:  # x, the initial state and the checkpoints of v before steps 4 and 8
        assert (2, 3, 5) in [tuple(t.shape) for t in buffers]
    else:  # the pre-spike potential h, an intermediate
        assert [tuple(t.shape) for t in buffers] == [(9, 3, 5)]
    s.sum().backward()
    with pytest.raises(RuntimeError, match="freed|second time"):
        node.saved_tensors
    with pytest.raises(RuntimeError, match="second time"):
        s.sum().backward()
