import atexit
import inspect
import os
import shutil
import tempfile

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors.
# It must be chosen before any generated kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if "FLEXGEN_CACHE_DIR" not in os.environ:
    # Each test process (each xdist worker too) compiles into its own cache and removes it when it exits.
    os.environ["FLEXGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexgen-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FLEXGEN_CACHE_DIR"], True)

HAS_CUDA = torch.cuda.is_available()
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Where backend="triton" runs here: CUDA if there is a GPU, else CPU tensors in the interpreter.
TRITON_DEVICE = "cuda" if HAS_CUDA else "cpu"

from flexgen.launch import c_path  # noqa: E402 (after TRITON_INTERPRET is chosen: this imports Triton)

HAS_C_COMPILER = c_path.available()  # backend="c": the generated C kernels


def device_backends():
    """(device, backend) pairs this machine can test."""
    pairs = [("cpu", "torch")]
    if HAS_C_COMPILER:
        pairs.append(("cpu", "c"))
    if INTERPRETER:
        pairs.append(("cpu", "triton"))
    if HAS_CUDA:
        pairs += [pytest.param("cuda", "triton", marks=pytest.mark.gpu), pytest.param("cuda", "torch", marks=pytest.mark.gpu)]
    return pairs


def plain_device_backends():
    """device_backends() as plain (device, backend) tuples, for loops inside a test."""
    return [tuple(p.values) if hasattr(p, "values") else p for p in device_backends()]


# `pytest -m quick`: a smoke test of every stage (spec errors, tracing, derivation, generated names, the cache,
# layers on each backend this machine has, the package's shape, the README's figures), a few minutes at most on a
# 2-core machine with an empty kernel cache (README: "Tests").
QUICK_MODULES = {
    "test_architecture.py", "test_packaging.py", "test_spec_errors.py", "test_usage_errors.py",
    "test_condition_errors.py", "test_step_mode_defaults.py", "test_stateless.py", "test_generated_names.py",
    "test_readme_figures.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in QUICK_MODULES:
            item.add_marker(pytest.mark.quick)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A cache of the test's own (files a test counts or breaks meet no other test's); its root."""
    root = tmp_path / "cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(root))
    return root


def line_of(fn, text):
    """The line number of the first line of `fn`'s source that holds `text`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(k for k, line in enumerate(lines) if text in line)


# What the suite compares flexgen against, and the tools and libraries some tests need. Without them the tests
# that need them skip; with FLEXGEN_REQUIRE_PEERS=1 (CI sets it) a missing one fails the run before any test.
REQUIRED_PEERS = {
    "snntorch": 'pip install ".[test]"',
    "spikingjelly.activation_based.neuron": 'pip install ".[test]" && pip install --no-deps spikingjelly',
    # SpikingJelly's NIR export (tests/test_nir.py): a submodule, which also needs nir
    "spikingjelly.activation_based.nir_exchange": 'pip install ".[test]" && pip install --no-deps spikingjelly',
    "nir": 'pip install ".[test]"',
    "nirtorch": 'pip install ".[test]"',
    "scipy": 'pip install ".[test]"',
    "sklearn": 'pip install ".[test]"',  # examples/ (tests/test_examples.py)
    "matplotlib": 'pip install ".[test]"',  # examples/, tests/test_benchmark_records.py
    "tqdm": 'pip install ".[test]"',  # examples/
    "h5py": 'pip install ".[test]"',  # examples/
    "pygments": 'pip install ".[test]"',  # `flexgen show --color` (tests/test_cli.py)
    "DCLS": 'pip install ".[test]"',  # the dcls package: DelayedLinear against its Dcls1d (tests/test_delayed_linear.py)
    "mkdocs": 'pip install ".[docs]"',
    "material": 'pip install ".[docs]"',  # mkdocs-material (tests/test_docs.py: mkdocs build --strict)
    "mkdocstrings_handlers": 'pip install ".[docs]"',
    "latex2mathml": 'pip install ".[docs]"',  # the docs' formulas (tests/test_docs.py)
}
C_COMPILER_MISSING = ("a C compiler for flexgen's C target (backend='c': $CC, cc or gcc that builds a shared library; "
                      "flexgen.launch.c_path.available() is False)")


def missing_peers():
    """'module (install line)' for each module in REQUIRED_PEERS that cannot be imported, and the C compiler if
    backend="c" cannot build here (HAS_C_COMPILER: a one-line library compiled when this file was loaded)."""
    import importlib

    missing = []
    for module, install in REQUIRED_PEERS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{module} ({install})")
    if not HAS_C_COMPILER:
        missing.append(C_COMPILER_MISSING)
    return missing


def pytest_sessionstart(session):
    if os.environ.get("FLEXGEN_REQUIRE_PEERS", "0") in ("", "0"):
        return
    missing = missing_peers()
    if missing:
        raise pytest.UsageError("FLEXGEN_REQUIRE_PEERS is set and these are missing:\n  " + "\n  ".join(missing))


def count_calls(monkeypatch, owner, name):
    """A list that grows by one for each call of `owner.name` (still called) while the test runs."""
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def recurrent_grads(layer, x, weight, chunks=(None,)):
    """Outputs and gradients (input, then every parameter by name) of a weighted output sum, the sequence given to
    the layer in `chunks` (slices of x) one call after the other."""
    x = x.detach().clone().requires_grad_()
    pieces = [x[c] if c is not None else x for c in chunks]
    out = torch.cat([layer(p) if layer.step_mode == "m" else layer(p[0])[None] for p in pieces])
    names, params = zip(*sorted(layer.named_parameters()))
    grads = torch.autograd.grad((out * weight).sum(), [x, *params])
    return out, dict(zip(("input", *names), grads))


def assert_recurrent_same(got, want, tolerance=1e-12):
    (out_g, grads_g), (out_w, grads_w) = got, want
    assert torch.equal(out_g, out_w)
    assert grads_g.keys() == grads_w.keys()
    for name in grads_w:
        assert max_rel_err(grads_g[name], grads_w[name]) <= tolerance, name


def func_grads(layer, x, weight):
    """(parameter gradients by name, input gradient) of sum(layer(x) * weight) through `torch.func.grad`, from a
    reset layer."""
    def loss(params, x):
        layer.reset()
        return (torch.func.functional_call(layer, params, (x,)) * weight).sum()

    return torch.func.grad(loss, argnums=(0, 1))(dict(layer.named_parameters()), x)


def assert_func_grads_fused_equal_eager(make_layer, x, weight):
    """`torch.func.grad` of sum(layer(x) * weight) through a fused layer (`make_layer("triton", "fused")`) equals
    the eager loop's (`make_layer("eager", "auto")`) within 1e-12, and the delays got a gradient."""
    grads = []
    for backend, path in (("triton", "fused"), ("eager", "auto")):
        layer = make_layer(backend, path)
        grads.append(func_grads(layer, x, weight))
        assert layer.path == ("fused" if backend == "triton" else "eager")
    (params_f, x_f), (params_e, x_e) = grads
    assert max_rel_err(x_f, x_e) <= 1e-12
    for key in params_e:
        assert max_rel_err(params_f[key], params_e[key]) <= 1e-12, key
    assert params_e["delay.delay"].abs().sum() > 0


def assert_budget_run_equals_the_default(make_model, budget):
    """A model from `make_model(memory_budget=budget)` (a `Dense` long-sequence model) gives the default model's
    spikes on 30 steps of random binary input, and its gradients within 1e-12; under "1GiB" it keeps every step."""
    x = (torch.rand(30, 2, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64) < 0.5).double()
    models, results = (make_model(memory_budget=budget), make_model()), []
    for model in models:
        xi = x.clone().requires_grad_()
        out = model(xi)
        results.append((out.detach(), torch.autograd.grad((out * torch.arange(30.0)[:, None, None]).sum(),
                                                          [xi, *model.parameters()])))
    assert (models[0].checkpoint_choice is None) == (budget == "1GiB")
    (a, ga), (b, gb) = results
    assert torch.equal(a, b) and 0 < b.sum() < b.numel()
    for u, v in zip(ga, gb):
        assert max_rel_err(u, v) <= 1e-12


def max_rel_err(got, want, floor=1e-30):
    """The largest elementwise difference, relative to the reference's largest magnitude (at least `floor`).

    Elementwise, so one bad element is not diluted by the others as it is in a ratio of norms.
    """
    if got.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def cuda_peak_bytes(step):
    """The most CUDA memory `step()` allocates above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
