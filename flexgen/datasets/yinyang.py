"""The Yin-Yang data set (Kriener, Göltz and Petrovici, "The Yin-Yang dataset", NICE 2022, arXiv:2102.08211),
generated here, and its encoding as input spike times for `flexgen.EventPropDense`.

    >>> from flexgen.datasets import yinyang
    >>> values, labels = yinyang.yin_yang("test")
    >>> values.shape, labels.shape, labels.bincount().tolist()
    (torch.Size([1000, 4]), torch.Size([1000]), [318, 351, 331])
    >>> yinyang.yin_yang_class(torch.tensor([0.75, 0.25, 0.5]), torch.tensor([0.5, 0.5, 0.9])).tolist()
    [2, 2, 0]
    >>> times = yinyang.spike_times(values)     # [1000, 5, 1]: x, y, 1 - x, 1 - y, then the bias spike
    >>> times[0, :, 0].tolist() == [30 * v for v in values[0].tolist()] + [0.0]
    True

The points lie in the unit square, inside the big circle of radius `r_big` centred at (r_big, r_big). Two dots
of radius `r_small` sit at (r_big / 2, r_big) and (3 r_big / 2, r_big). A point in either dot is class 2 ("dot").
Otherwise it is yin (class 0) where it lies within r_small of the right dot's centre, or in the left half-disc of
radius r_big / 2 (outside the left dot), or in the upper half of the big circle outside the right half-disc of
radius r_big / 2; else yang (class 1). The classes are balanced by rejection sampling: each sample first draws its
class uniformly, then draws uniform points in the square until one falls in the big circle with that class. Each
sample is (x, y, 1 - x, 1 - y): the mirrored pair lets neurons without a bias read the distance to both edges.
The default splits are the authors': 5000 training samples (seed 42), 1000 validation (41) and 1000 test (40);
the random generator is torch's, so the points are not the authors' own draws, only the same distribution.
"""
import torch

SPLITS = {"train": (5000, 42), "validation": (1000, 41), "test": (1000, 40)}  # split -> (size, seed)
CLASSES = ("yin", "yang", "dot")


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"yin_yang: {name} must be a positive number, got {value!r}")


def yin_yang_class(x, y, r_small=0.1, r_big=0.5):
    """The class of points (x, y) (tensors of one shape) inside the big circle: 0 yin, 1 yang, 2 dot."""
    d_right = torch.hypot(x - 1.5 * r_big, y - r_big)
    d_left = torch.hypot(x - 0.5 * r_big, y - r_big)
    yin = (d_right <= r_small) | ((d_left > r_small) & (d_left <= 0.5 * r_big)) | ((y > r_big) & (d_right > 0.5 * r_big))
    dot = (d_right < r_small) | (d_left < r_small)
    return torch.where(dot, 2, torch.where(yin, 0, 1)).long()


def yin_yang(split="train", size=None, seed=None, r_small=0.1, r_big=0.5, dtype=torch.float64):
    """(values [size, 4], labels [size]) of one split ("train", "validation" or "test"); `size` and `seed`
    replace the split's defaults (the same split, size and seed give the same samples on every machine)."""
    if split not in SPLITS:
        raise ValueError(f"yin_yang: split must be one of {', '.join(SPLITS)}; got {split!r}")
    default_size, default_seed = SPLITS[split]
    size = default_size if size is None else size
    seed = default_seed if seed is None else seed
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"yin_yang: size must be a positive int, got {size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"yin_yang: seed must be an int, got {seed!r}")
    _positive("r_small", r_small)
    _positive("r_big", r_big)
    if not r_small < 0.5 * r_big:
        raise ValueError(f"yin_yang: r_small must be below r_big / 2 (the dots inside their half-discs), got "
                         f"r_small {r_small!r}, r_big {r_big!r}")
    if 2 * r_big > 1:
        raise ValueError(f"yin_yang: r_big must be at most 0.5 (the circle inside the unit square), got {r_big!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"yin_yang: dtype must be torch.float32 or torch.float64, got {dtype!r}")
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(3, (size,), generator=generator)
    points = torch.empty(size, 2, dtype=torch.float64)
    for c in range(3):
        wanted = int((labels == c).sum())
        found = []
        while wanted > 0:  # candidates in batches; the dot class keeps about 1 in 12 of them
            xy = torch.rand(max(64, 16 * wanted), 2, dtype=torch.float64, generator=generator) * (2 * r_big)
            inside = torch.hypot(xy[:, 0] - r_big, xy[:, 1] - r_big) <= r_big
            keep = xy[inside & (yin_yang_class(xy[:, 0], xy[:, 1], r_small, r_big) == c)][:wanted]
            found.append(keep)
            wanted -= keep.shape[0]
        points[labels == c] = torch.cat(found)
    values = torch.cat([points, 1.0 - points], dim=1)
    return values.to(dtype), labels


def spike_times(values, t_min=0.0, t_max=30.0, bias=0.0):
    """Input spike times [B, n + 1, 1] for `flexgen.EventPropDense`: each value v in [0, 1] of values [B, n] fires
    once at t_min + v (t_max - t_min) (latency coding), and one more input fires at `bias` in every sample
    (None: no bias input, [B, n, 1]). Wunderlich & Pehle encode Yin-Yang so, with a bias spike at the start."""
    if not torch.is_tensor(values) or values.dim() != 2 or not values.is_floating_point():
        raise ValueError(f"spike_times: values must be a float tensor [batch, n], got "
                         f"{getattr(values, 'dtype', type(values).__name__)} {list(getattr(values, 'shape', []))}")
    if bool(torch.isnan(values).any()) or bool(((values < 0) | (values > 1)).any()):
        raise ValueError("spike_times: values must lie in [0, 1]")
    if not (isinstance(t_min, (int, float)) and isinstance(t_max, (int, float)) and 0 <= t_min < t_max < float("inf")):
        raise ValueError(f"spike_times: need 0 <= t_min < t_max (finite), got t_min {t_min!r}, t_max {t_max!r}")
    times = t_min + values * (t_max - t_min)
    if bias is not None:
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not 0 <= bias < float("inf"):
            raise ValueError(f"spike_times: bias must be a time >= 0 or None, got {bias!r}")
        times = torch.cat([times, torch.full_like(times[:, :1], float(bias))], dim=1)
    return times.unsqueeze(-1)
