"""Generation stays a graph: time and size grow with the traced step, not exponentially
with its depth, and a step too large to compile is refused with a SpecError."""
import contextlib
import importlib.util
import pathlib
import re
import signal

import pytest
import torch

import flexgen
import flexgen.derive.derivation
import flexgen.frontend.trace
from conftest import plain_device_backends

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_benchmark():
    spec = importlib.util.spec_from_file_location("generation_time", ROOT / "benchmarks" / "generation_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generation_time = load_benchmark()


@contextlib.contextmanager
def time_limit(seconds):
    """Fail (rather than hang) when the block runs longer than `seconds`."""

    def expire(signum, frame):
        raise TimeoutError(f"generation took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# Depths at which expanding into trees took from minutes to hours: the where chain > 200 s from depth 5,
# exp/tanh > 60 s from depth 6, the power tower 240 KiB of source at depth 10 and minutes from 12.
@pytest.mark.parametrize("family,depth", [("where", 8), ("exp_tanh", 8), ("power", 16)])
def test_generation_grows_linearly_with_depth(family, depth):
    with time_limit(60):
        shallow = generation_time.measure(family, depth // 2)
        deep = generation_time.measure(family, depth)
    for key in ("backward_operations", "module_kib"):
        assert deep[key] <= 2.5 * shallow[key], (key, shallow, deep)
    assert deep["backward_operations"] <= 10 * deep["traced_operations"], deep


@pytest.mark.parametrize("device,backend", plain_device_backends())
# The power tower overflows from its second step on (the first leaves h close to 1): one step for it.
@pytest.mark.parametrize("family,depth,steps", [("where", 3, 4), ("exp_tanh", 3, 4), ("power", 8, 1)])
def test_backward_with_recomputed_variables_matches_eager(family, depth, steps, device, backend):
    spec = generation_time.step_family(family, depth)
    derivation = spec.derivation()
    forward_values = {a.target for a in derivation.forward}
    results = set(derivation.grad_inputs + derivation.grad_prev_states + derivation.grad_learnable)
    variables = [a.target for a in derivation.backward
                 if a.target in forward_values or (str(a.target).startswith("grad_") and a.target not in results)]
    assert variables, "the backward has no recomputed value or intermediate gradient as a variable"
    g = torch.Generator().manual_seed(depth)
    x = (torch.rand(steps, 6, generator=g, dtype=torch.float64) * 0.3).to(device)

    def run(backend, recompute=False):
        xs = x.clone().requires_grad_()
        (s,), (v,) = spec.apply(xs, backend=backend, recompute=recompute)
        (grad,) = torch.autograd.grad(s.sum() + (v * 0.3).sum(), xs)
        return s, v, grad

    ref = run("eager")
    for recompute in (False, True):
        for got, want in zip(run(backend, recompute), ref):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_backward_beyond_the_size_limit_is_a_spec_error(monkeypatch):
    spec = generation_time.step_family("where", 6)
    printed = generation_time.measure("where", 6)["backward_operations"]
    monkeypatch.setattr(flexgen.derive.derivation, "MAX_BACKWARD_OPERATIONS", 10)
    message = r"derived backward of 'where_6' has (\d+) operations .* up to 10"
    with pytest.raises(flexgen.SpecError, match=message) as info:
        spec.derivation()
    count = int(re.search(r"has (\d+) operations", str(info.value)).group(1))
    assert 0.8 * printed <= count <= 1.2 * printed  # counted before the CSE, about what it prints
    monkeypatch.setattr(flexgen.derive.derivation, "MAX_BACKWARD_OPERATIONS", count)
    spec.derivation()


def test_step_beyond_the_traced_size_limit_is_a_spec_error_naming_the_line(monkeypatch):
    monkeypatch.setattr(flexgen.frontend.trace, "MAX_TRACED_OPERATIONS", 50)

    @flexgen.neuron(states=("v",))
    def long_loop(x, v):
        for _ in range(1000):
            v = v * 0.5 + x
        return v, v

    with pytest.raises(flexgen.SpecError, match=r"more than 50 operations .*\n  at .*:\d+: +v = v \* 0.5 \+ x"):
        long_loop.trace()


def test_benchmark_table_lists_every_point():
    points = [generation_time.measure("power", 2), {"family": "where", "depth": 64, "timeout_s": 1.0}]
    table = generation_time.markdown(points).splitlines()
    assert len(table) == 4 and table[2].startswith("| power | 2 |") and "over 1.0 s" in table[3]
