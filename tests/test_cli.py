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


LEAKY = textwrap.dedent("""
    import flexgen

    @flexgen.neuron(states=("v",))
    def leaky(x, v, beta=0.9):
        s = flexgen.spike(v - 1.0)
        return s, beta * v + x - s
""")


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
    path.write_text(LEAKY)
    proc = run_cli("show", f"{path}:leaky", "--kernel", "forward", "--color", "always", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" in proc.stdout and "leaky_forward" in proc.stdout
    plain = run_cli("show", f"{path}:leaky", "--kernel", "forward", cache=cache)
    assert plain.stdout.startswith("@triton.jit\ndef leaky_forward(")


def test_show_the_c_target(cache):
    spec = flexgen.neurons.spec("LIF")
    proc = run_cli("show", "LIF", "--kernel", "c", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == spec.source("c").rstrip("\n") + "\n" and "void lif_step_backward_f64(" in proc.stdout
    pytest.importorskip("pygments")
    coloured = run_cli("show", "LIF", "--kernel", "c", "--color", "always", cache=cache).stdout
    assert "\x1b[" in coloured and "int64_t" in coloured


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
    assert f"cache: {cache}" in proc.stdout and "entries: 1," in proc.stdout and "not marked" not in proc.stdout
    total = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    assert f"total: {cli._size(total)}" in proc.stdout and "not flexgen's" not in proc.stdout
    key = flexgen.cache.info(str(cache))["entries"][0]["key"]
    assert key[:16] in proc.stdout
    assert "records: 1" in proc.stdout and flexgen.cache.record_name("demo", "d" * 64) in proc.stdout
    proc = run_cli("cache", "clear", cache=cache)
    assert proc.returncode == 0 and proc.stdout.strip() == f"removed 1 entry from {cache}"
    assert flexgen.cache.info(str(cache))["count"] == 0
    after = run_cli("cache", "info", cache=cache).stdout
    assert "entries: 0," in after and "records" not in after


def test_cache_clear_leaves_what_is_not_flexgens_and_refuses_an_unmarked_directory(tmp_path, cache):
    assert run_cli("show", "IF", cache=cache).returncode == 0
    (cache / ("e" * 64)).mkdir()
    (cache / ("e" * 64) / "data.bin").write_text("the user's")
    proc = run_cli("cache", "info", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "not flexgen's, left alone: 1" in proc.stdout and f"  {'e' * 64}  holds 'data.bin'" in proc.stdout
    proc = run_cli("cache", "clear", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"removed 1 entry from {cache}\nnot flexgen's, left alone: 1\n")
    assert (cache / ("e" * 64) / "data.bin").read_text() == "the user's"

    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("mine")
    info = run_cli("cache", "info", cache=shared)
    assert "not marked as flexgen's cache" in info.stdout and "notes.txt  not a name flexgen writes" in info.stdout
    proc = run_cli("cache", "clear", cache=shared)
    assert proc.returncode == 1 and "not marked as flexgen's cache" in proc.stderr and "--force" in proc.stderr
    proc = run_cli("cache", "clear", "--force", cache=shared)
    assert proc.returncode == 0 and proc.stdout.startswith(f"removed 0 entries from {shared}\n")
    assert (shared / "notes.txt").read_text() == "mine"


def test_cache_clear_older_than(cache):
    assert run_cli("show", "IF", cache=cache).returncode == 0
    proc = run_cli("cache", "clear", "--older-than", "1.5", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"removed 0 entries from {cache}\nkept 1 entry used in the last 1.5 days\n"
    assert flexgen.cache.info(str(cache))["count"] == 1
    for bad in ("-1", "soon", "nan", "inf"):
        proc = run_cli("cache", "clear", "--older-than", bad, cache=cache)
        assert proc.returncode == 2 and "expected a number of days >= 0" in proc.stderr
    proc = run_cli("cache", "clear", "--older-than", "0", cache=cache)
    assert proc.stdout.startswith(f"removed 1 entry from {cache}\n")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_cache_commands_do_not_wait_on_a_fifo(cache):
    """A FIFO where meta.json belongs: each command finishes (the timeout fails the test instead of hanging)."""
    assert run_cli("show", "IF", cache=cache).returncode == 0
    key = flexgen.cache.info(str(cache))["entries"][0]["key"]
    (cache / key / "meta.json").unlink()
    os.mkfifo(cache / key / "meta.json")
    proc = run_cli("cache", "info", cache=cache, timeout=120)
    assert proc.returncode == 0 and f"{key}  its meta.json is a FIFO, not a regular file" in proc.stdout
    proc = run_cli("cache", "clear", cache=cache, timeout=120)
    assert proc.returncode == 0 and "removed 0 entries" in proc.stdout and "its meta.json is a FIFO" in proc.stdout
    proc = run_cli("show", "IF", cache=cache, timeout=120)  # builds the layer again, replacing the entry
    assert proc.returncode == 0 and "is a FIFO, not a regular file; regenerating it" in proc.stderr


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


def test_show_of_a_script_does_not_run_its_main_part(tmp_path, cache):
    script = tmp_path / "train.py"
    script.write_text(LEAKY + '\nif __name__ == "__main__":\n    raise SystemExit("training ran")\n')
    proc = run_cli("show", f"{script}:leaky", "--equations", cache=cache)
    assert proc.returncode == 0 and "training ran" not in proc.stderr, proc.stderr
    assert "leaky" in proc.stdout
    assert "__name__" in run_cli("show", "--help", cache=cache).stdout


def test_import_help_and_cache_commands_load_neither_torch_nor_sympy_nor_triton(tmp_path):
    probe = textwrap.dedent("""
        import contextlib, io, sys
        import flexgen
        from flexgen import cli
        with contextlib.redirect_stdout(io.StringIO()):
            cli.main(["cache", "info"])
            try:
                cli.main(["--help"])
            except SystemExit:
                pass
        print(sorted(m for m in ("torch", "sympy", "triton", "jinja2") if m in sys.modules))
        flexgen.LIF  # the first public name loads the package
        print(sorted(m for m in ("torch", "sympy") if m in sys.modules))
    """)
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "['sympy', 'torch']"]
