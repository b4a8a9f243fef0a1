"""Neurons without states (spiking activations) generate, cache and run; generated code that does not
import never stays in the cache, and the error names the spec, not a cache file."""
import sys

import pytest
import torch

import flexgen
import flexgen.compile
from conftest import device_backends
from flexgen import cache, spike


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(path))
    return path


@flexgen.neuron(states=())
def graded(x, y, k=0.5, gain=2.0):
    """Two inputs, two outputs, no state: a spike gate and a smooth nonlinearity."""
    s = spike(x - k)
    return s * y, flexgen.tanh(gain * x) * y


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("step_mode", ["m", "s"])
def test_stateless_layer_matches_eager(device, backend, recompute, step_mode):
    g = torch.Generator().manual_seed(0)
    shape = (5, 3, 7) if step_mode == "m" else (3, 7)
    x, y = (torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_() for _ in range(2))
    results = []
    for b in (backend, "eager"):
        layer = graded(backend=b, recompute=recompute, step_mode=step_mode, gain=1.5)
        out = layer(x, y)
        loss = (out[0] * torch.linspace(-1, 1, out[0].numel(), dtype=torch.float64, device=device).reshape(out[0].shape)).sum()
        loss = loss + (out[1] ** 2).sum()
        results.append((out, torch.autograd.grad(loss, (x, y))))
    (out, grads), (ref_out, ref_grads) = results
    assert torch.equal(out[0], ref_out[0])
    torch.testing.assert_close(out[1], ref_out[1], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_stateless_spec_is_cached_and_loaded_again(root):
    @flexgen.neuron()
    def gate_once(x, k=0.75):
        return spike(x - k) * x

    compiled = gate_once.compiled()
    assert gate_once.signature.states == () and compiled.layout.states == ()
    assert [e["neuron"] for e in cache.info()["entries"]] == ["gate_once"]
    assert "if STATE_SEQS" not in gate_once.source("forward")  # nothing to store per state
    sys.modules.pop(f"flexgen_generated_{compiled.key[:16]}", None)
    module, meta = cache.load_or_build(compiled.key, lambda: pytest.fail("the cached entry was not reused"))
    assert meta["layout"]["states"] == [] and hasattr(module, "gate_once_backward_recompute")


def _broken(generate):
    """`generate` with its module's last kernel cut short: the text no longer compiles."""
    def broken(*args):
        source, meta = generate(*args)
        return source + "\n\ndef unfinished():\n    if True:\n", meta
    return broken


def test_generated_code_that_does_not_compile_is_not_cached(root, monkeypatch):
    @flexgen.neuron()
    def doomed(x, k=0.25):
        return spike(x - k)

    monkeypatch.setattr(flexgen.compile, "generate", _broken(flexgen.compile.generate))
    with pytest.raises(flexgen.SpecError) as info:
        doomed()
    message = str(info.value)
    assert "'doomed'" in message and f"{__file__}:{doomed.fn.__code__.co_firstlineno}" in message
    assert "at generated line" in message and "`if True:`" in message and "IndentationError" in message
    assert str(root) not in message  # points at the spec, not at a cache file
    assert cache.info()["count"] == 0

    monkeypatch.undo()  # a fixed generator builds it (the failed entry is not found again)
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(root))
    layer = doomed(backend="torch")
    assert layer(torch.tensor([[0.2, 0.3]])).tolist() == [[0.0, 1.0]]
    assert cache.info()["count"] == 1


def test_module_that_fails_while_imported_leaves_the_cache(root):
    key = cache.make_key("test_stateless", "raises on import")
    calls = []

    def build():
        calls.append(1)
        return "VALUE = 1\nraise RuntimeError('boom')\n", {"neuron": "demo"}

    for attempt in (1, 2):
        with pytest.raises(cache.BrokenModule) as info:
            cache.load_or_build(key, build)
        assert info.value.lineno == 2 and info.value.line == "raise RuntimeError('boom')"
        assert info.value.reason == "RuntimeError: boom"
        assert cache.info()["count"] == 0 and len(calls) == attempt  # rebuilt: nothing was kept
