"""The `flexgen` command line, run as a user runs it: subprocesses (`python -m flexgen`, the console script)."""
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import flexgen
from flexgen import cli

ROOT = pathlib.Path(flexgen.__file__).resolve().parent.parent


def run_cli(*args, cache, command=None, timeout=300):
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(cache))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    command = command or [sys.executable, "-m", "flexgen"]
    return subprocess.run([*command, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def test_list(cache):
    proc = run_cli("list", cache=cache)
    assert proc.returncode == 0, proc.stderr
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == list(flexgen.neurons.available())
    assert {"IF", "LIF", "PLIF"} <= set(names)


def test_show_equations_and_kernel(cache):
    spec = flexgen.neurons.spec("LIF")
    proc = run_cli("show", "LIF", "--equations", "--kernel", "backward", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == spec.equations().rstrip("\n") + "\n\n" + spec.source("backward").rstrip("\n") + "\n"
    assert "\x1b[" not in proc.stdout  # not a terminal: no colour codes
    info = flexgen.cache.info(str(cache))
    assert info["count"] == 1 and info["entries"][0]["neuron"]


def test_show_user_file_in_colour(tmp_path, cache):
    pytest.importorskip("pygments")
    path = tmp_path / "my_neurons.py"
    path.write_text(textwrap.dedent("""
        import flexgen

        @flexgen.neuron(states=("v",))
        def leaky(x, v, beta=0.9):
            s = flexgen.spike(v - 1.0)
            return s, beta * v + x - s
    """))
    proc = run_cli("show", f"{path}:leaky", "--kernel", "forward", "--color", "always", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" in proc.stdout and "leaky_forward" in proc.stdout
    plain = run_cli("show", f"{path}:leaky", "--kernel", "forward", cache=cache)
    assert plain.stdout.startswith("@triton.jit\ndef leaky_forward(")


def test_show_errors(tmp_path, cache):
    proc = run_cli("show", "NoSuchNeuron", cache=cache)
    assert proc.returncode == 1
    assert "unknown neuron 'NoSuchNeuron'; bundled neurons: IF, LIF" in proc.stderr
    bad = tmp_path / "bad.py"
    bad.write_text("import flexgen\n@flexgen.neuron(states=('v',))\ndef bad(x, v):\n    return (x, v) if x > v else (v, x)\n")
    proc = run_cli("show", f"{bad}:bad", cache=cache)
    assert proc.returncode == 1
    assert "SpecError" in proc.stderr and "flexgen.where" in proc.stderr
    proc = run_cli("show", "LIF", "--kernel", "nonsense", cache=cache)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_cache_info_and_clear(cache):
    assert run_cli("show", "IF", cache=cache).returncode == 0
    flexgen.cache.remembered("demo", "d" * 64, lambda: "value", str(cache))
    proc = run_cli("cache", "info", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert f"cache: {cache}" in proc.stdout and "entries: 1," in proc.stdout
    key = flexgen.cache.info(str(cache))["entries"][0]["key"]
    assert key[:16] in proc.stdout
    assert "records: 1" in proc.stdout and flexgen.cache.record_name("demo", "d" * 64) in proc.stdout
    proc = run_cli("cache", "clear", cache=cache)
    assert proc.returncode == 0 and proc.stdout.strip() == f"removed 1 entry from {cache}"
    assert flexgen.cache.info(str(cache))["count"] == 0
    after = run_cli("cache", "info", cache=cache).stdout
    assert "entries: 0," in after and "records" not in after


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_without_gpu(cache):
    proc = run_cli("bench", "LIF", cache=cache)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and proc.stdout == ""


@pytest.mark.gpu
def test_bench_on_gpu(cache):
    proc = run_cli("bench", "LIF", "--steps", "8", "--neurons", "4096", "--warmup", "5", "--rep", "20", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "flexgen (triton)" in proc.stdout and "torch loop (eager)" in proc.stdout


def test_usage_and_version(cache):
    proc = run_cli(cache=cache)
    assert proc.returncode == 2 and "usage: flexgen" in proc.stderr
    proc = run_cli("--version", cache=cache)
    assert proc.returncode == 0 and proc.stdout.strip() == f"flexgen {flexgen.__version__}"


def test_main_in_process(capsys, tmp_path, monkeypatch):
    """`flexgen.cli.main` returns the exit status instead of exiting (what the console script calls)."""
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(tmp_path))
    assert cli.main(["show", "lif"]) == 0  # bundled names are case-insensitive
    assert capsys.readouterr().out == flexgen.neurons.spec("LIF").equations().rstrip("\n") + "\n"
    assert cli.main(["show", "missing"]) == 1
    assert "unknown neuron 'missing'" in capsys.readouterr().err


def test_console_script(cache):
    """The `flexgen` script that `pip install` creates (skipped when running from a checkout that is not installed)."""
    try:
        scripts = importlib.metadata.distribution("flexgen-snn").entry_points
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("flexgen-snn is not installed")
    assert any(ep.name == "flexgen" and ep.value == "flexgen.cli:main" for ep in scripts)
    exe = shutil.which("flexgen", path=os.path.dirname(sys.executable)) or shutil.which("flexgen")
    if exe is None:
        pytest.skip("the flexgen script is not on PATH")
    proc = run_cli("list", cache=cache, command=[exe])
    assert proc.returncode == 0 and proc.stdout.split()[0] == "IF"
