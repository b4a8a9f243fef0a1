"""The kernel cache of a node's ranks: one FLEXGEN_CACHE_DIR shared by all, built once, and nothing a rank does on
import or build that another rank would have to avoid (no rank-0-only work)."""
import ast
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import flexgen
from conftest import HAS_C_COMPILER
from ranks import GLOO, run_ranks

PACKAGE = pathlib.Path(flexgen.__file__).resolve().parent
RANKS = 4


def build_at_once(rank, world):
    """Every rank makes the same new neuron's layer at the same moment (after a barrier), on the C target where
    there is a compiler, and runs it; (largest difference from the eager loop, the warnings it saw)."""
    import flexgen

    @flexgen.neuron(states=("v", "a"), learnable=("w",))
    def cache_race_alif(x, v, a, w=-0.4, v_th=0.6, beta=0.3):
        h = v + (x - v) * flexgen.sigmoid(w) - beta * a
        s = flexgen.spike(h - v_th)
        return s, h * (1.0 - s), 0.9 * a + s

    backend = "c" if HAS_C_COMPILER else "torch"
    x = torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    dist.barrier()  # all ranks reach the build together
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = []
        for name in (backend, "eager"):
            layer = cache_race_alif(backend=name, step_mode="m").double()
            xi = x.clone().requires_grad_()
            out = layer(xi)
            grads = torch.autograd.grad((out * torch.arange(7.0)[:, None, None]).sum(), [xi, layer.w])
            results.append((out.detach(), grads, layer.last_run.backend))
    (out, grads, ran), (want, want_grads, _) = results
    assert ran == backend, ran
    err = max([(out - want).abs().max().item()] + [((g - w).abs().max() / w.abs().max()).item()
                                                  for g, w in zip(grads, want_grads)])
    return err, [f"{w.category.__name__}: {w.message}" for w in caught], bool(want.sum() > 0)


@pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")
def test_ranks_build_one_new_neuron_at_once_into_one_cache(tmp_path):
    results = run_ranks(build_at_once, tmp_path, world=RANKS, timeout=400)
    for err, caught, spiked in results:
        assert err <= 1e-12 and spiked
        assert caught == []
    summary = flexgen.cache.info(str(tmp_path / "cache"))
    assert summary["marked"] and summary["count"] == 1, summary  # one entry: the ranks waited for one build
    assert summary["not_flexgen"] == [] and summary["working_files"] == []  # no temporaries or locks left behind
    assert len(summary["libraries"]) == (1 if HAS_C_COMPILER else 0)
    entry = tmp_path / "cache" / summary["entries"][0]["key"]
    assert flexgen.cache.read_entry(str(entry)) is not None  # whole: its files match their recorded digest


def test_importing_every_module_prints_and_writes_nothing(tmp_path):
    """No module prints or writes a file when imported (a rank-0-only guard would then be needed); the cache
    directory is made at the first build, not at import."""
    names = sorted(".".join(("flexgen",) + p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
                   for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "templates"
                   and p.name != "__main__.py")
    home, work, cache_dir = tmp_path / "home", tmp_path / "work", tmp_path / "cache"
    home.mkdir()
    work.mkdir()
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    env = dict(os.environ, HOME=str(home), FLEXGEN_CACHE_DIR=str(cache_dir), TMPDIR=str(work),
               PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "" and done.stderr == ""
    assert list(work.iterdir()) == [] and list(home.iterdir()) == [] and not cache_dir.exists()


def test_no_module_prints_or_writes_at_its_top_level():
    """The static side of the check above, for code an import runs only in some settings: no statement at a
    module's top level calls print or writes files; writes outside flexgen/cache/ are the C target's private build
    folder alone (a temporary directory of each process, removed at exit)."""
    writers = {"write_text", "write_bytes", "mkdir", "makedirs", "print"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "templates":
            continue
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)):
                continue
            for call in ast.walk(node):
                if isinstance(call, ast.Call):
                    name = getattr(call.func, "attr", getattr(call.func, "id", None))
                    if name in writers:
                        found.append(f"{path.relative_to(PACKAGE)}:{call.lineno} {name}")
        for call in ast.walk(tree):
            if (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "open" and len(call.args) > 1
                    and isinstance(call.args[1], ast.Constant) and "w" in str(call.args[1].value)
                    and path.relative_to(PACKAGE).parts[0] != "cache"):
                found.append(f"{path.relative_to(PACKAGE).as_posix()} opens a file for writing")
    assert sorted(set(found)) == ["launch/c_path.py opens a file for writing"]
