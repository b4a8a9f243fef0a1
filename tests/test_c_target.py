"""The C target (backend="c"): generated C compiled with the system's compiler.

Its results against the eager oracle are checked for every bundled and test spec by the suites that run every
backend of `conftest.device_backends()` (test_backends, test_neurons, test_zoo, test_ode, ...). Here: that the
C kernels run where they should, what they are, and every way they can be unavailable.
"""
import shutil
import time
import warnings

import pytest
import torch

import flexgen
from flexgen.launch import c_path
from flexgen.launch.backends import choose

from conftest import HAS_C_COMPILER, max_rel_err

needs_compiler = pytest.mark.skipif(not HAS_C_COMPILER, reason="needs a C compiler")


def ops_of(layer, x):
    neuron = layer._neuron_call()
    ops, _, _ = neuron.ops(neuron.check([x], None, [getattr(layer, w) for w in neuron.signature.learnable]))
    return ops


def test_the_c_source_is_shown_and_readable():
    source = flexgen.neurons.spec("LIF").source("c")
    for name in ("lif_step_forward_f32", "lif_step_backward_f32", "lif_step_forward_f64", "lif_step_backward_f64"):
        assert f"void {name}(" in source
    assert "#pragma omp simd" in source and "h_buf_ptr[row + offs] = h;" in source
    assert "const scalar_t h = " in source  # the derived step, printed by the C printer


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backend_c_runs_the_c_kernels(dtype):
    layer = flexgen.PLIF(step_mode="m", backend="c", dtype=dtype)
    x = torch.rand(6, 2, 3, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, so no message
        assert ops_of(layer, x) is layer._compiled.c_ops_for("auto") is layer._compiled.c_ops_for(False)
        layer(x)


@needs_compiler
def test_the_c_source_of_every_bundled_test_and_peer_spec_compiles():
    """Both designs, float and double: a source the compiler refuses would send the layer to the torch path."""
    from flexgen.interop.peers import snntorch as peers
    from specs import ALL

    specs = [flexgen.neurons.spec(n) for n in flexgen.neurons.available()] + list(ALL.values())
    specs += [getattr(peers, n) for n in dir(peers) if n.startswith("snntorch_")]
    for spec in specs:
        c_path.load(spec.source("c"))


@needs_compiler
def test_recompute_true_runs_the_c_recompute_kernels():
    layer = flexgen.LIF(step_mode="m", backend="c", recompute=True)
    x = torch.rand(9, 2, 3, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops = ops_of(layer, x)
        out = layer(x)
    assert ops is layer._compiled.c_ops_for(True) and ops.layout.variant.recompute
    assert "lif_step_backward_recompute_f64" in ops.layout.kernel_name("backward") + "_f64"
    reference = flexgen.LIF(step_mode="m", backend="eager")(x)
    assert torch.equal(out, reference)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(reference.sum(), x)[0],
                               rtol=1e-12, atol=1e-12)


@needs_compiler
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_gradient_the_same_at_every_step_is_read_as_one_row(dtype, recompute):
    """An output gradient expanded over time (`sum()`'s, or a [B, C] weighting broadcast over T) reaches the C
    backward as one row read at every step, not T copies: the gradients equal those of the same gradient given
    dense (bit for bit), and the backward allocates no more [T, N] tensors than the dense one does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountRows(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.made = numel, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            given = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            self.made += (isinstance(out, torch.Tensor) and out.numel() >= self.numel
                          and out.untyped_storage().data_ptr() not in given)  # new memory, not a view
            return out

    x = torch.rand(7, 3, 5, dtype=dtype) * 2
    weighting = torch.rand(3, 5, dtype=dtype)
    for expanded in (torch.ones((), dtype=dtype).expand(7, 3, 5), weighting.expand(7, 3, 5)):
        runs = []
        for grad in (expanded, expanded.contiguous()):
            layer = flexgen.PLIF(step_mode="m", backend="c", recompute=recompute, dtype=dtype)
            given = x.clone().requires_grad_()
            out = layer(given)
            with CountRows(x.numel()) as counted:
                out.backward(grad)
            runs.append((counted.made, given.grad, layer.w.grad))
        (made_expanded, *grads_expanded), (made_dense, *grads_dense) = runs
        assert made_expanded == made_dense
        assert all(torch.equal(a, b) for a, b in zip(grads_expanded, grads_dense))


@needs_compiler
def test_the_expanded_gradient_probe_runs():
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "probe_expanded_gradient.py"
    done = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("T    2: one row: median ") and "T rows: median " in done.stdout


@needs_compiler
def test_c_matches_the_torch_path_in_fp32():
    """Same expressions with the same float rounding (no fused multiply-adds): the same spikes and states; the
    gradients differ where the C library's exp and torch's differ by an ulp (the sigmoid surrogate)."""
    x = (2.0 * torch.rand(9, 4, 33)).requires_grad_()
    g = torch.randn(9, 4, 33)
    results = []
    for backend in ("c", "torch"):
        layer = flexgen.neurons.spec("ALIF")(backend=backend, tau=3.0, tau_a=10.0)
        out = layer(x)
        results.append((out, layer.v, layer.a, *torch.autograd.grad(out, x, g)))
    (*c_forward, c_grad), (*torch_forward, torch_grad) = results
    assert all(torch.equal(a, b) for a, b in zip(c_forward, torch_forward))
    assert max_rel_err(c_grad, torch_grad) <= 4 * torch.finfo(torch.float32).eps


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_neurons_not_results(threads):
    x = (2.0 * torch.rand(5, 3, 1500, dtype=torch.float64)).requires_grad_()
    layer = flexgen.LIF(step_mode="m", backend="c")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = layer(x), torch.autograd.grad(layer(x).sum(), x)[0]
        layer.reset()
        torch.set_num_threads(threads)
        got = layer(x), torch.autograd.grad(layer(x).sum(), x)[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], want[0]) and max_rel_err(got[1], want[1]) == 0.0


@needs_compiler
@pytest.mark.parametrize("dtype,recompute", [(torch.float16, "auto"), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_16_bit_calls_run_the_fp32_c_kernels(dtype, recompute):
    """fp16 and bf16 run through the fp32 kernels: the values are those of the fp32 kernels on the inputs as fp32,
    rounded to the call's dtype (no warning, no torch path); what the backward keeps is fp32."""
    x = (torch.rand(6, 2, 5) * 2).to(dtype).requires_grad_()
    layer, reference = (flexgen.LIF(step_mode="m", backend="c", recompute=recompute) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = layer(x)
    assert out.dtype == dtype and type(out.grad_fn).__name__ == "EagerFunctionBackward"
    if recompute is not True:  # the plain design saves h per step (the recompute one the input and checkpoints)
        assert [t.dtype for t in out.grad_fn.saved_tensors if t.dim() and t.shape[0] == 6] == [torch.float32]
    (grad,) = torch.autograd.grad(out.sum(), x)
    x32 = x.detach().float().requires_grad_()
    out32 = reference(x32)
    (grad32,) = torch.autograd.grad(out32.sum(), x32)
    assert out.any() and torch.equal(out, out32.to(dtype))
    assert grad.dtype == dtype and torch.equal(grad, grad32.to(dtype))
    assert torch.equal(layer.v, reference.v.to(dtype))


@pytest.mark.parametrize("backend,message", [
    ("c", "backend='c' runs the torch path: no C compiler found"),
    ("auto", "the CPU layers run generated torch code, not the faster C kernels: no C compiler found.*set CC"),
])
def test_no_compiler_takes_the_torch_path(monkeypatch, backend, message):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    c_path.compiler.cache_clear()
    c_path.load.cache_clear()
    try:
        spec = flexgen.neuron(states=("v",))(_leaky)  # a spec of its own: no C library loaded for it yet
        layer = spec(backend=backend)
        x = torch.rand(4, 2, 3)
        with pytest.warns(UserWarning, match="CC='/nonexistent/cc' names no program found here; no cc or gcc"):
            with pytest.warns(UserWarning, match=message):
                out = layer(x)
        assert torch.equal(out, spec(backend="torch")(x))
    finally:
        c_path.compiler.cache_clear()
        c_path.load.cache_clear()


def _leaky(x, v, tau=4.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - 0.5)
    return s, h * (1.0 - s)


@pytest.fixture
def fresh_compiler():
    """c_path as a new process finds it (no compiler chosen, nothing loaded or probed), before and after."""
    def forget():
        for cached in (c_path.compiler, c_path.load, c_path._usable_options, c_path._machine):
            cached.cache_clear()
        c_path._TIMED_OUT.clear()

    forget()
    yield
    forget()


@needs_compiler
def test_a_compiler_that_hangs_is_stopped_and_the_torch_path_runs(tmp_path, monkeypatch, fresh_compiler):
    hanging = tmp_path / "cc"
    hanging.write_text("#!/bin/sh\nsleep 30\n")
    hanging.chmod(0o700)
    monkeypatch.setenv("CC", str(hanging))
    monkeypatch.setenv("FLEXGEN_CC_TIMEOUT", "0.5")
    spec = flexgen.neuron(states=("v",))(_leaky)  # a spec of its own: no C library loaded for it yet
    x = torch.rand(4, 2, 3)
    start = time.monotonic()
    with pytest.warns(UserWarning, match=r"not the faster C kernels: .*cc did not finish within 0.5 s .*"
                                         r"FLEXGEN_CC_TIMEOUT"):
        out = spec(backend="auto")(x)
    spec(backend="auto")(x)  # the compiler is not called again
    assert time.monotonic() - start < 20
    assert torch.equal(out, spec(backend="torch")(x))


@needs_compiler
def test_a_cc_that_names_no_compiler_is_said_once(monkeypatch, fresh_compiler):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(UserWarning, match=r"CC='/nonexistent/cc' names no program found here; using .*cc instead"):
        used = c_path.compiler()
    assert used == (shutil.which("cc") or shutil.which("gcc"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c_path.compiler() == used


def test_a_bad_compiler_timeout_setting_is_said(monkeypatch):
    monkeypatch.setenv("FLEXGEN_CC_TIMEOUT", "soon")
    with pytest.warns(UserWarning, match="FLEXGEN_CC_TIMEOUT='soon' is not a positive number of seconds"):
        assert c_path.timeout() == c_path.CC_TIMEOUT
    monkeypatch.setenv("FLEXGEN_CC_TIMEOUT", "2.5")
    assert c_path.timeout() == 2.5


@needs_compiler
def test_a_compiler_error_names_the_source_and_shows_the_message():
    with pytest.raises(c_path.CompilerError, match=r"failed on the generated C source \(.*kernels_.*\.c\)"):
        c_path.load("this is not C;\n")


@pytest.mark.parametrize("compiler,suggested", [(True, "backend='c'"), (False, "backend='torch'")])
def test_backend_triton_on_the_cpu_suggests_the_c_target_where_a_compiler_is(monkeypatch, compiler, suggested):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(c_path, "available", lambda: compiler)
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors") as error:
        choose("triton", torch.device("cpu"))
    assert f"or use {suggested}" in str(error.value)


def test_backend_c_is_for_cpu_tensors():
    with pytest.raises(RuntimeError, match="backend='c' runs the generated C kernels on CPU tensors"):
        choose("c", torch.device("cuda"))


@needs_compiler
def test_the_cpu_benchmark_runs(tmp_path):
    """benchmarks/bench_cpu.py end to end on a tiny configuration (its recorded run is docs/perf/bench_cpu.md): a row
    for every candidate of every neuron, the peers that compute flexgen's recurrence checked against it by the
    benchmark itself. The loops it has torch.compile compile run uncompiled here (compiling takes minutes)."""
    import importlib.util
    import json
    import pathlib

    # The peers' rows are checked below: without a peer the test skips, as the suite's peer tests do
    # (FLEXGEN_REQUIRE_PEERS=1 fails the run before any test instead: conftest.REQUIRED_PEERS).
    pytest.importorskip("snntorch")
    pytest.importorskip("spikingjelly.activation_based.neuron")
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cpu.py"
    spec = importlib.util.spec_from_file_location("bench_cpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.BATCH, bench.NEURONS, bench.HIDDEN = 2, 8, 4
    bench.COMPILED_LOOP, bench.COMPILED_SYNAPTIC_LOOP, bench.COMPILED_RECURRENT_LOOP = (
        bench.torch_lif_loop, bench.torch_synaptic_loop, bench.torch_recurrent_lif_loop)
    # 12 steps: Synaptic's neurons (threshold 10) fire from about the 6th on, so its spike checks check spikes.
    argv = ["--out", str(tmp_path), "--neurons", *bench.NEURON_ROWS, "--dtypes", "fp32", "fp64", "--steps", "12",
            "--threads", "1", "--repeats", "1"]
    assert bench.main(argv) == 0
    rows = json.loads((tmp_path / "bench_cpu.json").read_text())["results"]
    for neuron in bench.NEURON_ROWS:
        for dtype_name, dtype in bench.DTYPES.items():
            names = [r["candidate"] for r in rows if (r["neuron"], r["dtype"]) == (neuron, dtype_name)]
            assert names == list(bench.candidates(neuron, dtype, compile_peer=True))
            assert {"flexgen backend=c", "flexgen backend=torch"} <= set(names)
    peers = {r["candidate"] for r in rows if r["neuron"] in ("Synaptic", "Recurrent")}
    # Norse is an optional peer of the benchmark (CI does not install it): its rows where it is installed
    norse = importlib.util.find_spec("norse") is not None
    expected = {"snnTorch Synaptic loop", "torch.compile Synaptic loop", "snnTorch RLeaky loop",
                "torch.compile recurrent LIF loop", "SpikingJelly ElementWiseRecurrentContainer(LIFNode)"}
    expected |= {"Norse LIFCell loop", "Norse LIFBoxCell + recurrent product loop"} if norse else set()
    assert expected <= peers
    checked = {key for key in bench.SAME_SPIKES if norse or not key[1].startswith("Norse")}
    assert checked <= {(r["neuron"], r["candidate"]) for r in rows}, "a spike check never ran"
    table = (tmp_path / "bench_cpu.md").read_text()
    assert "| Synaptic | fp64 | 12 | 1 | flexgen backend=c |" in table
    assert "| Recurrent | fp32 | 12 | 1 | snnTorch RLeaky loop |" in table


@needs_compiler
def test_step_values_named_like_c_functions_or_keywords_still_compile():
    """A local `fabs` or `tanh` (or `default`, `long`) would shadow C's: the trace renames such locals."""
    @flexgen.neuron(states=("v",))
    def c_words(x, v):
        fabs = flexgen.abs(x)
        tanh = flexgen.tanh(v + fabs)
        default = tanh * 0.5
        h = v + (x - v) / 2.0 + 0.1 * default + 0.1 * flexgen.exp(-fabs)
        s = flexgen.spike(h - 1.0)
        return s, h * (1.0 - s)

    x = (2.0 * torch.rand(5, 2, 3, dtype=torch.float64)).requires_grad_()
    layer = c_words(backend="c")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # compiled and ran as C: no fallback message
        out = layer(x)
    want = c_words(backend="eager")(x)
    assert torch.equal(out, want)
    got_grad, want_grad = (torch.autograd.grad(o.sum(), x)[0] for o in (out, want))
    assert max_rel_err(got_grad, want_grad) <= 1e-12


def test_spec_names_that_c_reserves_are_refused():
    with pytest.raises(flexgen.SpecError, match="'default'"):
        @flexgen.neuron(states=("v",))
        def bad(x, v, default=1.0):
            return flexgen.spike(v + x - default), v
        bad.trace()
