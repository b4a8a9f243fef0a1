"""flexgen.Delay: per-channel delays over time, integer (exact shifts) and fractional (learnable, interpolated)."""
import pytest
import torch

import flexgen
from conftest import HAS_CUDA, max_rel_err


def shifted(x, delays):
    """The reference: channel c of [T, B, C, ...] moved delays[c] whole steps later, zeros before."""
    y = torch.zeros_like(x)
    for c, d in enumerate(int(d) for d in delays):
        if d < x.shape[0]:
            y[d:, :, c] = x[:x.shape[0] - d, :, c]
    return y


def test_integer_delays_are_exact_shifts():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, 5, generator=g, dtype=torch.float64)
    delays = torch.tensor([0.0, 1.0, 4.0, 8.0, 12.0], dtype=torch.float64)  # 12 > T - 1: all zeros
    layer = flexgen.Delay(5, max_delay=12, delay=delays, learnable=False)
    assert torch.equal(layer(x), shifted(x, delays))
    assert torch.equal(layer(x)[:, :, 4], torch.zeros(9, 3, dtype=torch.float64))


def test_the_channel_is_dim_2_of_any_shape():
    x = torch.randn(6, 2, 3, 4, 5, dtype=torch.float64)
    delays = torch.tensor([2.0, 0.0, 5.0], dtype=torch.float64)
    layer = flexgen.Delay(3, max_delay=5, delay=delays, learnable=False)
    assert torch.equal(layer(x), shifted(x, delays))


@pytest.mark.parametrize("interpolation", ["linear", "gaussian"])
def test_fractional_gradients_match_finite_differences(interpolation):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    layer = flexgen.Delay(4, max_delay=6, delay=torch.tensor([0.3, 1.7, 2.5, 5.2], dtype=torch.float64),
                          interpolation=interpolation, sigma=0.8)

    def f(x, delay):
        return torch.func.functional_call(layer, {"delay": delay}, (x,))

    assert torch.autograd.gradcheck(f, (x, layer.delay.detach().clone().requires_grad_()), eps=1e-6, atol=1e-9)


def test_linear_gradient_at_an_integer_delay_is_the_step_ahead():
    """d y_t / d d = x_{t-d-1} - x_{t-d}: defined at whole delays too, where a delay often starts."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 1, 2, generator=g, dtype=torch.float64)
    layer = flexgen.Delay(2, max_delay=4, delay=torch.tensor([1.0, 3.0], dtype=torch.float64))
    w = torch.randn(8, 1, 2, generator=g, dtype=torch.float64)
    (layer(x) * w).sum().backward()
    delays = [1, 3]
    want = [((shifted(x, [d + 1, d + 1]) - shifted(x, [d, d]))[:, :, c] * w[:, :, c]).sum() for c, d in enumerate(delays)]
    assert max_rel_err(layer.delay.grad, torch.stack(want)) <= 1e-12


def test_gaussian_taps_are_normalised_and_centred():
    layer = flexgen.Delay(3, max_delay=10, delay=torch.tensor([2.0, 5.5, 10.0], dtype=torch.float64),
                          interpolation="gaussian", sigma=1.5)
    taps = layer.taps()
    assert max_rel_err(taps.sum(dim=1), torch.ones(3, dtype=torch.float64)) <= 1e-12
    assert taps[0].argmax() == 2 and torch.isclose(taps[1, 5], taps[1, 6], rtol=1e-12) and taps[2].argmax() == 10


def test_a_learnable_delay_out_of_range_acts_as_the_bound_and_can_come_back():
    x = torch.randn(7, 2, 2, dtype=torch.float64)
    outside = flexgen.Delay(2, max_delay=3, delay=torch.tensor([-0.5, 4.5], dtype=torch.float64))
    bound = flexgen.Delay(2, max_delay=3, delay=torch.tensor([0.0, 3.0], dtype=torch.float64))
    assert torch.equal(outside(x), bound(x))
    outside(x).sum().backward()
    bound(x).sum().backward()
    assert torch.equal(outside.delay.grad, bound.delay.grad) and outside.delay.grad.abs().sum() > 0
    assert outside.clamp_().delay.tolist() == [0.0, 3.0]


def test_round_gives_whole_steps():
    layer = flexgen.Delay(3, max_delay=4, delay=torch.tensor([0.4, 2.6, 9.0]))
    assert layer.round_().delay.tolist() == [0.0, 3.0, 4.0]


def count_host_checks(monkeypatch):
    """How often the layers read their delays on the host to check them."""
    from flexgen.layers.delay import _Delays

    calls = []
    real = _Delays._check
    monkeypatch.setattr(_Delays, "_check", lambda layer, delay: calls.append(1) or real(layer, delay))
    return calls


def test_the_delays_are_checked_again_only_when_they_change(monkeypatch):
    """The check waits for the GPU, so it runs once per change of the delays: a new tensor, an optimizer step,
    clamp_(), load_state_dict, assigning .data; each of these then finds a NaN put there."""
    layer = flexgen.Delay(3, max_delay=4, delay=torch.tensor([0.5, 1.0, 2.5]))
    x = torch.rand(6, 2, 3)
    calls = count_host_checks(monkeypatch)
    layer(x)
    layer(x)
    assert len(calls) == 1
    layer(x).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    layer(x)
    layer.clamp_()
    layer(x)
    assert len(calls) == 3
    state = {"delay": torch.tensor([0.5, float("nan"), 1.0])}
    for change in (lambda: layer.load_state_dict(state),
                   lambda: setattr(layer.delay, "data", torch.tensor([float("nan"), 1.0, 1.0])),
                   lambda: setattr(layer, "delay", torch.nn.Parameter(torch.tensor([1.0, 1.0, float("nan")]))),
                   lambda: torch.optim.SGD([layer.delay], lr=float("nan")).step()):
        layer.delay = torch.nn.Parameter(torch.tensor([0.5, 1.0, 2.5]))
        layer.delay.grad = torch.ones(3)
        layer(x)
        change()
        with pytest.raises(ValueError, match="is NaN"):
            layer(x)


def test_fixed_delays_are_checked_again_after_a_change(monkeypatch):
    layer = flexgen.Delay(2, max_delay=4, delay=torch.tensor([1.0, 2.0]), learnable=False)
    x = torch.rand(5, 1, 2)
    calls = count_host_checks(monkeypatch)
    layer(x)
    layer(x)
    assert len(calls) == 1
    layer.delay.copy_(torch.tensor([1.0, 6.0]))
    with pytest.raises(ValueError, match=r"fixed delay of channel 1 is 6.0, outside \[0, max_delay=4\]"):
        layer(x)


def test_copies_and_pickles_check_their_own_delays():
    import copy
    import pickle

    layer = flexgen.DelayedLinear(3, 2, max_delay=4)
    layer(torch.rand(5, 1, 3))
    for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        with torch.no_grad():
            twin.delay.data[0, 0] = float("nan")  # unseen by the version counter: a fresh copy checks anyway
        with pytest.raises(ValueError, match="is NaN"):
            twin(torch.rand(5, 1, 3))


def test_bad_delays_and_inputs():
    with pytest.raises(ValueError, match=r"fixed delay of channel 1 is 5.0, outside \[0, max_delay=4\]"):
        flexgen.Delay(2, max_delay=4, delay=torch.tensor([1.0, 5.0]), learnable=False)
    with pytest.raises(ValueError, match="initial delay of channel 0 is NaN"):
        flexgen.Delay(2, max_delay=4, delay=float("nan"))
    layer = flexgen.Delay(2, max_delay=4)
    with torch.no_grad():
        layer.delay[1] = float("nan")
    with pytest.raises(ValueError, match="delay of channel 1 is NaN"):
        layer(torch.zeros(3, 1, 2))
    with pytest.raises(ValueError, match="one value or one per channel"):
        flexgen.Delay(2, max_delay=4, delay=torch.zeros(3))
    with pytest.raises(ValueError, match="channels must be a positive"):
        flexgen.Delay(0, max_delay=4)
    with pytest.raises(ValueError, match="max_delay must be a whole number"):
        flexgen.Delay(2, max_delay=-1)
    with pytest.raises(ValueError, match="interpolation must be one of"):
        flexgen.Delay(2, max_delay=4, interpolation="cubic")
    layer = flexgen.Delay(2, max_delay=4)
    layer.interpolation = "cubic"  # an attribute, as annealing sets sigma: checked where it is used
    with pytest.raises(ValueError, match="interpolation must be one of"):
        layer(torch.zeros(3, 1, 2))
    with pytest.raises(ValueError, match="sigma must be a positive number"):
        flexgen.Delay(2, max_delay=4, interpolation="gaussian", sigma=0.0)(torch.zeros(3, 1, 2))
    with pytest.raises(ValueError, match=r"takes inputs \[T, B, 2, ...\], got \(3, 2\)"):
        flexgen.Delay(2, max_delay=4)(torch.zeros(3, 2))
    with pytest.raises(TypeError, match="floating-point"):
        flexgen.Delay(2, max_delay=4)(torch.zeros(3, 1, 2, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_equals_cpu():
    x = torch.randn(12, 4, 3, dtype=torch.float64)
    layer = flexgen.Delay(3, max_delay=5, delay=torch.tensor([0.2, 2.0, 4.9], dtype=torch.float64))
    want = layer(x)
    got = layer.cuda()(x.cuda()).cpu()
    assert max_rel_err(got, want) <= 1e-12


def delayed_linear_reference(x, weight, delays, bias):
    """y_t[b, j] = sum_i weight[j, i] x_{t - delays[j, i]}[b, i] + bias[j], whole delays, as loops."""
    steps, batch, n_in = x.shape
    y = torch.zeros(steps, batch, weight.shape[0], dtype=x.dtype)
    for j in range(weight.shape[0]):
        for i in range(n_in):
            d = int(delays[j, i])
            if d < steps:
                y[d:, :, j] += weight[j, i] * x[:steps - d, :, i]
    return y + bias


def test_delayed_linear_with_whole_delays_is_a_sum_of_shifts():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2, 4, generator=g, dtype=torch.float64)
    delays = torch.randint(0, 7, (3, 4), generator=g).double()
    layer = flexgen.DelayedLinear(4, 3, max_delay=6, delay=delays, dtype=torch.float64)
    want = delayed_linear_reference(x, layer.weight.detach(), delays, layer.bias.detach())
    assert max_rel_err(layer(x), want) <= 1e-12


def test_delayed_linear_with_one_delay_per_input_is_delay_then_linear():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, 5, generator=g, dtype=torch.float64)
    per_input = torch.tensor([0.0, 1.5, 3.25, 0.75, 5.0], dtype=torch.float64)
    layer = flexgen.DelayedLinear(5, 2, max_delay=5, delay=per_input.expand(2, 5), dtype=torch.float64)
    delay = flexgen.Delay(5, max_delay=5, delay=per_input)
    want = torch.nn.functional.linear(delay(x), layer.weight, layer.bias)
    assert max_rel_err(layer(x), want) <= 1e-12


@pytest.mark.parametrize("interpolation", ["linear", "gaussian"])
def test_delayed_linear_gradients_match_finite_differences(interpolation):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    layer = flexgen.DelayedLinear(3, 2, max_delay=4, dtype=torch.float64, interpolation=interpolation, sigma=0.7,
                                  delay=torch.tensor([[0.4, 2.3, 3.6], [1.2, 0.1, 2.8]], dtype=torch.float64))
    names = ["weight", "bias", "delay"]

    def f(x, weight, bias, delay):
        return torch.func.functional_call(layer, dict(zip(names, (weight, bias, delay))), (x,))

    params = [getattr(layer, n).detach().clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-9)


def test_delayed_linear_defaults_and_bad_values():
    layer = flexgen.DelayedLinear(6, 4, max_delay=9)
    assert layer.delay.shape == (4, 6) and 0.0 <= layer.delay.min() and layer.delay.max() <= 9.0
    assert layer.delay.std() > 0  # spread out, as DCLS starts
    with pytest.raises(ValueError, match=r"fixed delay of synapse 1 -> 0 \(delay\[0, 1\]\) is 4.0, outside"):
        flexgen.DelayedLinear(2, 1, max_delay=3, delay=torch.tensor([[0.0, 4.0]]), learnable=False)
    with pytest.raises(ValueError, match="one value or one per synapse"):
        flexgen.DelayedLinear(2, 1, max_delay=3, delay=torch.zeros(2))
    with pytest.raises(ValueError, match=r"takes inputs \[T, B, 2\], got \(3, 1, 2, 1\)"):
        flexgen.DelayedLinear(2, 1, max_delay=3)(torch.zeros(3, 1, 2, 1))
    with pytest.raises(ValueError, match="in_features must be a positive number"):
        flexgen.DelayedLinear(0, 1, max_delay=3)


def test_layers_pickle_with_their_delays():
    import pickle

    for layer in (flexgen.Delay(3, max_delay=4, delay=torch.tensor([0.5, 1.0, 4.0])),
                  flexgen.DelayedLinear(3, 2, max_delay=4, interpolation="gaussian", sigma=0.5)):
        again = pickle.loads(pickle.dumps(layer))
        x = torch.rand(6, 2, 3)
        assert torch.equal(again(x), layer(x)) and torch.equal(again.delay, layer.delay)
