"""A process that finds its layers' kernels in the cache does not trace them: no sympy, and on the CPU no Triton
or jinja2 either. What lets it skip tracing is a record keyed by everything the trace
depends on, so a changed constant must still give new kernels."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flexgen
from flexgen.frontend.captured import lasting_key

from conftest import HAS_C_COMPILER

PROGRAM = textwrap.dedent("""
    import sys, torch, flexgen
    V_TH = float(sys.argv[1])

    @flexgen.neuron(states=("v",))
    def step(x, v, tau=2.0):
        h = v + (x - v) / tau
        s = flexgen.spike(h - V_TH)
        return s, h * (1.0 - s)

    x = torch.linspace(0.5, 2.5, 12, dtype=torch.float64).reshape(4, 1, 3).requires_grad_()
    out = step()(x)
    out.sum().backward()
    print(out.flatten().tolist(), x.grad.flatten().tolist())
    print(sorted(m for m in ("sympy", "triton", "jinja2") if m in sys.modules))
""")


def run(program, argument, cache):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a CPU process, as users run it
    env["FLEXGEN_CACHE_DIR"] = str(cache)
    done = subprocess.run([sys.executable, "-c", program, argument], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    results, imported = done.stdout.strip().splitlines()[-2:]
    return results, eval(imported)


@pytest.mark.skipif(not HAS_C_COMPILER, reason="the CPU's default path, the C target, needs a C compiler")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only process: with a GPU, Triton is registered")
def test_a_cached_layer_runs_without_sympy_triton_or_jinja2_and_a_changed_constant_retraces(tmp_path):
    cold, imported = run(PROGRAM, "1.0", tmp_path)
    assert "sympy" in imported and "jinja2" in imported  # traced, derived and rendered
    warm, imported = run(PROGRAM, "1.0", tmp_path)
    assert warm == cold and imported == []
    other, imported = run(PROGRAM, "2.0", tmp_path)  # another threshold: another trace, other kernels
    assert other != cold and "sympy" in imported
    assert run(PROGRAM, "2.0", tmp_path) == (other, [])


def test_a_step_reading_an_object_by_identity_has_no_lasting_key():
    class Config:
        gain = 2.0

    config = Config()

    def step(x, v):
        return x * config.gain, v

    def plain(x, v, tau=2.0):
        return flexgen.exp(x) / tau + 0.5, v

    assert lasting_key(step) is None  # an instance: known only by identity, so traced in every process
    assert lasting_key(plain) is not None


def test_lasting_keys_follow_code_defaults_and_outside_values():
    def make(scale, default):
        def step(x, v, tau=default):
            return x * scale / tau, v
        return step

    assert lasting_key(make(2.0, 1.0)) == lasting_key(make(2.0, 1.0))
    assert lasting_key(make(2.0, 1.0)) != lasting_key(make(3.0, 1.0))  # a closure value
    assert lasting_key(make(2.0, 1.0)) != lasting_key(make(2.0, 4.0))  # a default


def test_the_kept_key_is_the_traced_key(private_cache):
    from flexgen.compile import cache_key, lasting_fingerprint

    @flexgen.neuron(states=("v",))
    def kept(x, v, tau=3.0):  # a spec of its own: nothing compiled it earlier in this process
        h = v + (x - v) / tau
        s = flexgen.spike(h - 1.0)
        return s, h * (1.0 - s)

    spec = kept
    static = spec.static_values({})
    fingerprint = lasting_fingerprint(spec, static)
    traced = cache_key(spec, static)
    assert cache_key(spec, static, fingerprint) == traced and flexgen.cache.info()["records"] == []  # nothing kept yet
    spec.compiled()  # the entry exists: its key is kept
    assert flexgen.cache.recalled("trace-key", fingerprint) == traced
    assert cache_key(spec, static, fingerprint) == traced


COMPILED = textwrap.dedent("""
    import sys, torch, flexgen
    layer = flexgen.LIF(step_mode="m", backend="torch")
    x = (2.0 * torch.rand(5, 2, 3, generator=torch.Generator().manual_seed(0))).requires_grad_()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    layer.reset()
    eager = flexgen.LIF(step_mode="m", backend="eager")(x)
    (eager_grad,) = torch.autograd.grad(eager.sum(), x)
    print(bool(torch.equal(out, eager)), float((grad - eager_grad).abs().max()))
    print([flexgen.launch.neuron.ops.triton_kernels_can_run()])
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only process: with a GPU, Triton is registered")
def test_without_triton_kernels_the_ops_are_plain_custom_ops_that_torch_compile_traces(tmp_path):
    """Where no Triton kernel can run (no GPU, no interpreter) the ops are registered without Triton; a compiled
    graph (fullgraph) still runs the generated torch code and equals the eager step."""
    results, can_run_triton = run(COMPILED, "", tmp_path)
    equal, grad_diff = results.split()
    assert equal == "True" and can_run_triton == [False]  # (torch.compile itself may import Triton)
    assert float(grad_diff) <= 1e-6  # float32: the generated code and the eager step may round the surrogate apart


def test_a_lasting_key_does_not_change_when_flexgens_names_load(monkeypatch):
    """`flexgen.spike` read through the package: the package binds its names lazily, which must not change the
    key between the process that keeps a record and the one that looks it up."""
    namespace = {}
    exec("def step(x, v):\n    return flexgen.spike(x), v\n", {"flexgen": flexgen}, namespace)
    step = namespace["step"]
    monkeypatch.delitem(vars(flexgen), "spike", raising=False)  # as in a process that has not traced yet
    before = lasting_key(step)
    assert flexgen.spike is flexgen.frontend.functions.spike  # binds the name in the package again, as a trace does
    assert lasting_key(step) == before


def test_dir_shows_the_public_names_only():
    names = dir(flexgen)
    assert {"LIF", "Recurrent", "neuron", "surrogate", "__version__"} <= set(names)
    assert not {"importlib", "lazy", "frames", "_load", "_PUBLIC"} & set(names)
