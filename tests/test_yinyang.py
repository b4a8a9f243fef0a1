"""The Yin-Yang data set generated in the package (`flexgen.datasets.yinyang`): its geometry, class balance,
determinism by seed and spike-time encoding, and the first-spike regulariser of the Yin-Yang example's loss."""
import math

import pytest
import torch

from flexgen.datasets import yinyang
from flexgen.layers import eventprop_losses as losses


def test_label_geometry_on_known_points():
    points = {(0.75, 0.5): 2, (0.25, 0.5): 2, (0.8, 0.5): 2, (0.25, 0.41): 2,  # in a dot (radius 0.1)
              (0.5, 0.9): 0, (0.1, 0.5): 0, (0.25, 0.69): 0,  # yin: the upper half, the left half-disc
              (0.5, 0.1): 1, (0.9, 0.5): 1, (0.75, 0.31): 1,  # yang: the lower half, the right half-disc
              (0.75, 0.62): 1, (0.25, 0.38): 0}  # just outside a dot, inside its half-disc
    x, y = (torch.tensor(c, dtype=torch.float64) for c in zip(*points))
    assert yinyang.yin_yang_class(x, y).tolist() == list(points.values())


def test_yin_and_yang_swap_under_the_half_turn_and_the_areas_are_the_shapes():
    """Rotating by 180 degrees about the centre maps yin onto yang; a uniform point of the big disc is a dot with
    probability 2 pi r_small^2 / (pi r_big^2) = 0.08."""
    xy = torch.rand(200_000, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xy = xy[torch.hypot(xy[:, 0] - 0.5, xy[:, 1] - 0.5) <= 0.5]
    c = yinyang.yin_yang_class(xy[:, 0], xy[:, 1])
    turned = yinyang.yin_yang_class(1 - xy[:, 0], 1 - xy[:, 1])
    assert torch.equal(turned[c == 2], c[c == 2]) and torch.equal(turned[c < 2], 1 - c[c < 2])
    share = c.bincount(minlength=3).double() / c.numel()
    assert abs(share[2].item() - 0.08) < 0.003 and abs(share[0].item() - share[1].item()) < 0.01


def test_the_splits_are_balanced_consistent_and_deterministic():
    for split, (size, seed) in yinyang.SPLITS.items():
        values, labels = yinyang.yin_yang(split)
        assert values.shape == (size, 4) and values.dtype == torch.float64 and labels.dtype == torch.long
        counts = labels.bincount(minlength=3)
        assert int(counts.sum()) == size and bool((abs(counts - size / 3) < 4 * math.sqrt(size * 2 / 9)).all())
        x, y = values[:, 0], values[:, 1]
        assert torch.equal(values[:, 2:], 1 - values[:, :2])  # the mirrored pair
        assert bool((torch.hypot(x - 0.5, y - 0.5) <= 0.5).all())  # inside the big circle
        assert torch.equal(yinyang.yin_yang_class(x, y), labels)  # each sample has its point's class
        again = yinyang.yin_yang(split)
        assert torch.equal(again[0], values) and torch.equal(again[1], labels)
    train, test = yinyang.yin_yang("train", size=1000)[0], yinyang.yin_yang("test")[0]
    assert not torch.equal(train, test)  # distinct seeds
    assert torch.equal(yinyang.yin_yang("train", size=300, seed=7)[0], yinyang.yin_yang("test", size=300, seed=7)[0])
    assert yinyang.yin_yang("test", dtype=torch.float32)[0].dtype == torch.float32


def test_spike_time_encoding():
    values = torch.tensor([[0.0, 1.0, 0.25], [0.5, 0.75, 1.0]], dtype=torch.float64)
    times = yinyang.spike_times(values, t_min=2.0, t_max=10.0, bias=1.5)
    assert times.shape == (2, 4, 1)
    assert times[..., 0].tolist() == [[2.0, 10.0, 4.0, 1.5], [6.0, 8.0, 10.0, 1.5]]
    assert yinyang.spike_times(values, bias=None)[..., 0].tolist() == [[0.0, 30.0, 7.5], [15.0, 22.5, 30.0]]
    encoded = yinyang.spike_times(yinyang.yin_yang("test")[0])
    assert encoded.shape == (1000, 5, 1) and float(encoded.min()) == 0.0 and float(encoded.max()) <= 30.0
    assert bool((encoded[:, 4] == 0.0).all())


@pytest.mark.parametrize("kwargs, match", [
    ({"split": "dev"}, "split must be one of train, validation, test"),
    ({"size": 0}, "size must be a positive int"), ({"size": True}, "size must be a positive int"),
    ({"seed": 1.5}, "seed must be an int"), ({"r_small": -0.1}, "r_small must be a positive number"),
    ({"r_small": 0.3}, "r_small must be below r_big / 2"), ({"r_big": 0.6}, "r_big must be at most 0.5"),
    ({"dtype": torch.int64}, "dtype must be torch.float32 or torch.float64")])
def test_bad_arguments_to_the_generator(kwargs, match):
    with pytest.raises(ValueError, match=match):
        yinyang.yin_yang(**kwargs)


@pytest.mark.parametrize("values, kwargs, match", [
    (torch.tensor([[0.5, 1.5]]), {}, "values must lie in"), (torch.tensor([[float("nan")]]), {}, "values must lie in"),
    (torch.tensor([0.5]), {}, "values must be a float tensor"), (torch.tensor([[1]]), {}, "values must be a float"),
    (torch.tensor([[0.5]]), {"t_min": 5.0, "t_max": 5.0}, "need 0 <= t_min < t_max"),
    (torch.tensor([[0.5]]), {"t_max": float("inf")}, "need 0 <= t_min < t_max"),
    (torch.tensor([[0.5]]), {"bias": -1.0}, "bias must be a time >= 0 or None")])
def test_bad_arguments_to_the_encoding(values, kwargs, match):
    with pytest.raises(ValueError, match=match):
        yinyang.spike_times(values, **kwargs)


def test_label_first_spike_penalty_and_its_gradient():
    times = torch.tensor([[[1.0, 3.0], [2.0, float("inf")]], [[float("inf"), float("inf")], [0.5, 4.0]]],
                         dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, 0])
    penalty = losses.label_first_spike_penalty(times, labels, no_spike_time=10.0, tau=2.0)
    assert penalty.item() == pytest.approx((math.expm1(1.0) + math.expm1(5.0)) / 2, rel=1e-15)
    penalty.backward()
    expected = torch.zeros_like(times)
    expected[0, 1, 0] = math.exp(1.0) / 4  # d/dt (exp(t / 2) - 1) / 2 at t = 2; the missing spike: no gradient
    torch.testing.assert_close(times.grad, expected, rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="labels must be a long tensor"):
        losses.label_first_spike_penalty(times, torch.tensor([1.0, 0.0]), 10.0, 2.0)
