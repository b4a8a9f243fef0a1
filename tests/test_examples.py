"""Run every script in examples/ as a new user would: a subprocess, a fresh kernel cache, no Triton interpreter."""
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import flexgen
from flexgen.launch import c_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (pip install '.[test]')")


def run_example(name, *args, tmp_path, timeout=180, examples=EXAMPLES, returncode=0):
    """The example's standard output (with its standard error where it must fail: `returncode`)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the examples must run on the CPU without Triton's interpreter
    env["FLEXGEN_CACHE_DIR"] = str(tmp_path / "cache")
    env["MPLBACKEND"] = "Agg"
    # The flexgen under test (a checkout or the installed package) comes first on the path.
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(flexgen.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(examples / name), *map(str, args)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == returncode, f"{name} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    return proc.stdout if returncode == 0 else proc.stdout + proc.stderr


def test_every_example_is_tested():
    tested = {"quickstart.py", "custom_neuron.py", "train_digits.py", "plot_membrane.py", "explain_kernel.py",
              "adex_equations.py", "nir_roundtrip.py", "train_shd_recurrent.py", "train_shd_delays.py",
              "stream_model.py", "train_multi_gpu.py", "export_model.py", "train_yinyang_eventprop.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_quickstart(tmp_path):
    out = run_example("quickstart.py", tmp_path=tmp_path)
    assert "saved for the backward, per step: h" in out          # lif.equations()
    assert "def lif_backward(" in out and "@triton.jit" in out   # lif.source("backward")
    last = out.strip().splitlines()[-1]
    assert last.startswith("OK:") and "matches backend='eager'" in last
    assert list((tmp_path / "cache").iterdir()), "the generated kernels were not cached"


def test_stream_model(tmp_path):
    out = run_example("stream_model.py", "--steps", 12, "--hidden", 16, tmp_path=tmp_path)
    assert "layer 3: v [1, 16], line [4, 1, 16]" in out
    assert out.strip().splitlines()[-1] == "OK: 12 streamed steps equal the whole-sequence call, and again after reset()"


def test_custom_neuron(tmp_path):
    out = run_example("custom_neuron.py", tmp_path=tmp_path)
    assert "new states: v <- v_new, a <- a_new" in out
    assert "grad_w" in out
    assert out.strip().splitlines()[-1] == "OK: custom neuron matches backend='eager'"


def test_explain_kernel(tmp_path):
    out = run_example("explain_kernel.py", tmp_path=tmp_path)
    assert "h: written by the forward into a [T, N] buffer" in out
    for kernel in ("def lif_forward(", "def lif_inference(", "def lif_backward("):
        assert kernel in out


@needs("matplotlib")
def test_plot_membrane(tmp_path):
    png = tmp_path / "plots" / "membrane.png"
    png.parent.mkdir()
    out = run_example("plot_membrane.py", png, tmp_path=tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"saved {png}" in out
    counts = [int(line.split(", ")[1].split()[0]) for line in out.splitlines() if line.startswith("neuron ")]
    assert len(counts) == 3 and counts[0] < counts[1] < counts[2], "a stronger input current must give more spikes"


@needs("matplotlib")
def test_plot_membrane_writes_next_to_itself_by_default_not_into_the_working_directory(tmp_path):
    examples = tmp_path / "examples"
    examples.mkdir()
    shutil.copy(EXAMPLES / "plot_membrane.py", examples)
    out = run_example("plot_membrane.py", tmp_path=tmp_path, examples=examples)
    assert (examples / "membrane.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"saved {examples / 'membrane.png'}" in out and not (tmp_path / "membrane.png").exists()


@needs("sklearn", "tqdm")
@pytest.mark.slow
def test_train_digits(tmp_path):
    out = run_example("train_digits.py", tmp_path=tmp_path, timeout=300)
    final = [line for line in out.splitlines() if line.startswith("final test accuracy:")]
    assert final and float(final[0].split()[3]) > 0.85
    assert out.strip().splitlines()[-1] == "OK"


@needs("sklearn", "tqdm")
def test_train_digits_fails_below_bound(tmp_path):
    """The accuracy check can fail: one epoch cannot reach an accuracy above 1.0."""
    with pytest.raises(AssertionError, match="exited with 1"):
        run_example("train_digits.py", "--epochs", "1", "--min-accuracy", "1.0", tmp_path=tmp_path)


@pytest.mark.skipif(not c_path.available(), reason="no C compiler (the torch reference would take minutes)")
def test_train_yinyang_eventprop_quick_mode(tmp_path):
    """Two short epochs on 300 samples (the silent label neurons' voltage push on): above chance (1/3) on the test
    split, and the record it writes."""
    record = tmp_path / "record.json"
    out = run_example("train_yinyang_eventprop.py", "--epochs", 2, "--train", 300, "--test", 150, "--hidden", 100,
                      "--silent-push", 1.0, "--out", record, tmp_path=tmp_path)
    assert "Yin-Yang: 300 training samples, 5 -> 100 -> 3 CuBa LIF, EventProp" in out
    epochs = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and "validation accuracy" in epochs[0]
    final = [line for line in out.splitlines() if line.startswith("final test accuracy:")]
    assert final and float(final[0].split()[3]) > 0.45 and "backend c" in final[0]
    saved = json.loads(record.read_text())
    assert [e["epoch"] for e in saved["epochs"]] == [1, 2] and saved["final_test_accuracy"] > 0.45
    assert saved["settings"]["silent_push"] == 1.0
    assert out.strip().splitlines()[-1] == "OK"


@pytest.mark.skipif(not c_path.available(), reason="no C compiler (the torch reference would take minutes)")
def test_train_shd_eventprop_benchmark_quick_mode(tmp_path):
    """benchmarks/train_shd_eventprop.py, one short epoch of both models: the record it writes, and the same
    initial weights and data for both (the same hidden activity in the first epoch, to within BPTT's binning)."""
    out = run_example("train_shd_eventprop.py", "--epochs", 1, "--train", 32, "--test", 20, "--hidden", 16,
                      "--out", tmp_path / "record", tmp_path=tmp_path, examples=ROOT / "benchmarks", timeout=300)
    assert "synthetic SHD-shaped data: 32 training, 20 test samples" in out
    (path,) = (tmp_path / "record").glob("train_shd_eventprop_cpu_*.json")
    record = json.loads(path.read_text())
    assert record["meta"]["settings"]["hidden"] == 16 and "--epochs 1" in record["meta"]["command"]
    results = record["results"]
    assert results["eventprop"]["backend"] == "c" and set(results) == {"eventprop", "bptt"}
    for r in results.values():
        assert r["step_s_median"] > 0 and r["peak_rss_mib"] is not None and 0 <= r["test_accuracy"] <= 1
        assert [e["epoch"] for e in r["epochs"]] == [1] and r["epochs"][0]["hidden_spikes_per_neuron"] > 0
    rates = [r["epochs"][0]["hidden_spikes_per_neuron"] for r in results.values()]
    assert abs(rates[0] - rates[1]) < 0.5 * max(rates)
    assert "| EventProp (C kernels, fp64) |" in path.with_suffix(".md").read_text()
    assert out.strip().splitlines()[-1] == "OK"


@pytest.mark.skipif(not c_path.available(), reason="no C compiler")
def test_train_yinyang_eventprop_fails_below_bound(tmp_path):
    with pytest.raises(AssertionError, match="exited with 1"):
        run_example("train_yinyang_eventprop.py", "--epochs", 1, "--train", 32, "--test", 30, "--hidden", 20,
                    "--min-accuracy", 1.0, tmp_path=tmp_path)


def test_export_model(tmp_path):
    out = run_example("export_model.py", "--steps", "8", tmp_path=tmp_path)
    assert "flexgen ops in the program: flexgen::" in out and "T 16: equal to eager: True" in out
    assert "fresh process: equal to eager: True" in out
    assert out.strip().splitlines()[-1] == "OK"


def test_adex_equations(tmp_path):
    out = run_example("adex_equations.py", tmp_path=tmp_path)
    assert "dv/dt = " in out and "# discretised: method euler (requested)" in out and "# backward step" in out
    intervals = [float(i) for i in out.split("inter-spike intervals: ")[1].split(" ms")[0].split(", ")]
    assert intervals == sorted(intervals) and intervals[-1] > 2 * intervals[0]  # spike-frequency adaptation
    final = [line for line in out.splitlines() if line.startswith("final exact counts:")]
    assert final and int(final[0].split()[-1].rstrip("%")) >= 90
    assert out.strip().splitlines()[-1] == "OK"


def test_adex_equations_fails_below_bound(tmp_path):
    """The accuracy check can fail: no training cannot reach exact counts everywhere."""
    with pytest.raises(AssertionError, match="exited with 1"):
        run_example("adex_equations.py", "--iterations", "0", tmp_path=tmp_path)


@needs("nir", "nirtorch")
def test_nir_roundtrip(tmp_path):
    path = tmp_path / "network.nir"
    out = run_example("nir_roundtrip.py", path, tmp_path=tmp_path)
    assert path.is_file() and "(LIF) -> " in out and "(CubaLIF)" in out
    assert "flexgen -> NIR -> flexgen: " in out and ", identical" in out
    assert out.strip().splitlines()[-1] == "OK"


@needs("tqdm")
def test_train_shd_recurrent_on_synthetic_data(tmp_path):
    out = run_example("train_shd_recurrent.py", tmp_path=tmp_path)
    path = "fused" if torch.cuda.is_available() else "stepwise"
    assert "synthetic SHD-shaped data" in out and f"(recurrent layer: {path})" in out
    final = [line for line in out.splitlines() if line.startswith("final test accuracy:")]
    assert final and float(final[0].split()[3]) > 0.8
    assert out.strip().splitlines()[-1] == "OK"


@needs("tqdm")
@pytest.mark.parametrize("delays", [(), ("--recurrent-delay", "4")], ids=["", "recurrent-delays"])
def test_train_shd_recurrent_long_sequence_mode_trains_the_same(tmp_path, delays):
    """--checkpoint-every recomputes segments in the backward (carrying the delay lines from one to the next); the
    losses and accuracies it prints are the default path's (its gradients differ only in the order the weight
    gradient sums its segments)."""
    def epochs(out):
        return [line for line in out.splitlines() if line.startswith("epoch ") and ": loss " in line]

    args = ("--epochs", "2", "--min-accuracy", "-1", *delays)
    plain = run_example("train_shd_recurrent.py", *args, tmp_path=tmp_path)
    long = run_example("train_shd_recurrent.py", *args, "--checkpoint-every", "7", tmp_path=tmp_path)
    assert "long-sequence mode" in long and "long-sequence mode" not in plain
    assert len(epochs(plain)) == 2 and epochs(long) == epochs(plain)


def assert_trained_with_moving_delays(out):
    """The recurrent SHD example's output: test accuracy above 0.5, recurrent delays that moved, and OK last."""
    final = [line for line in out.splitlines() if line.startswith("final test accuracy:")]
    assert final and float(final[0].split()[3]) > 0.5
    moved = [line for line in out.splitlines() if line.startswith("the recurrent delays moved")]
    assert moved and float(moved[0].split()[4]) > 0.0
    assert out.strip().splitlines()[-1] == "OK"


@needs("tqdm")
def test_train_shd_recurrent_with_recurrent_delays(tmp_path):
    """--recurrent-delay trains the same network with learned delays on its recurrent spikes; they move."""
    out = run_example("train_shd_recurrent.py", "--epochs", "2", "--recurrent-delay", "6", "--min-accuracy", "0.5",
                      tmp_path=tmp_path)
    assert "recurrent delays: up to 6 steps per neuron" in out
    assert_trained_with_moving_delays(out)


@needs("tqdm")
def test_train_shd_recurrent_with_a_delay_per_recurrent_synapse(tmp_path):
    """--per-synapse: the recurrent layer's delays are one per synapse (flexgen.SynapseDelay); they train and move."""
    out = run_example("train_shd_recurrent.py", "--epochs", "2", "--recurrent-delay", "4", "--per-synapse",
                      "--min-accuracy", "0.5", tmp_path=tmp_path)
    assert "recurrent delays: up to 4 steps per synapse" in out
    assert_trained_with_moving_delays(out)
    bad = run_example("train_shd_recurrent.py", "--per-synapse", tmp_path=tmp_path, returncode=2)
    assert "--per-synapse needs --recurrent-delay K" in bad


@needs("tqdm")
def test_train_shd_recurrent_with_dcls_recipe_for_recurrent_delays(tmp_path):
    """--delay-sigma trains with gaussian taps annealed to 0.5, then tests with rounded delays and linear taps."""
    out = run_example("train_shd_recurrent.py", "--epochs", "2", "--recurrent-delay", "6", "--delay-sigma", "2",
                      "--min-accuracy", "0.5", tmp_path=tmp_path)
    assert "gaussian taps (sigma 0.50): test accuracy" in out and "now rounded delays, linear taps" in out
    final = [line for line in out.splitlines() if line.startswith("final test accuracy:")]
    assert final and float(final[0].split()[3]) > 0.5
    assert out.strip().splitlines()[-1] == "OK"
    bad = run_example("train_shd_recurrent.py", "--delay-sigma", "2", tmp_path=tmp_path, returncode=2)
    assert "--delay-sigma needs --recurrent-delay K" in bad


@needs("tqdm")
def test_train_shd_recurrent_fails_below_bound(tmp_path):
    with pytest.raises(AssertionError, match="exited with 1"):
        run_example("train_shd_recurrent.py", "--epochs", "1", "--min-accuracy", "1.0", tmp_path=tmp_path)


def fake_shd(folder, train=24, test=8):
    """Files laid out as SHD's (spikes/times in seconds, some past 1 s; spikes/units; labels) in `folder`."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    folder.mkdir()
    for split, n in (("train", train), ("test", test)):
        with h5py.File(folder / f"shd_{split}.h5", "w") as f:
            times = f.create_dataset("spikes/times", (n,), dtype=h5py.vlen_dtype(np.float32))
            units = f.create_dataset("spikes/units", (n,), dtype=h5py.vlen_dtype(np.uint16))
            for k in range(n):
                count = int(rng.integers(50, 200))
                times[k] = np.sort(rng.uniform(0.0, 1.2, count)).astype(np.float32)
                units[k] = rng.integers(0, 700, count).astype(np.uint16)
            f.create_dataset("labels", data=rng.integers(0, 20, n).astype(np.uint8))
    return folder


@needs("tqdm", "h5py", "numpy")
def test_train_shd_recurrent_reads_shd_files(tmp_path):
    """Files laid out as SHD's are read and binned (events past --duration 1.0 are left out)."""
    data = fake_shd(tmp_path / "shd")
    out = run_example("train_shd_recurrent.py", "--data", data, "--epochs", "1", "--steps", "10", "--hidden", "16",
                      "--min-accuracy", "-1", tmp_path=tmp_path)
    assert f"SHD from {data}" in out and out.strip().splitlines()[-1] == "OK"


def test_train_shd_delays_learns_what_needs_delays(tmp_path):
    """Classes that differ only in the lag between two channels: the network with learned (then rounded) delays
    must beat the same network without delays by the example's margin (it exits 1 otherwise)."""
    out = run_example("train_shd_delays.py", tmp_path=tmp_path)
    accuracy = {line.split(":")[0]: float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "test accuracy" in line}
    assert set(accuracy) == {"without delays", "with learned delays"}
    assert accuracy["with learned delays"] > 0.8 and accuracy["with learned delays"] - accuracy["without delays"] > 0.2
    assert out.strip().splitlines()[-1] == "OK"


def test_train_shd_delays_fails_below_bound(tmp_path):
    with pytest.raises(AssertionError, match="exited with 1"):
        run_example("train_shd_delays.py", "--epochs", "1", tmp_path=tmp_path)


@needs("tqdm", "h5py", "numpy")
def test_train_shd_delays_reads_shd_files(tmp_path):
    data = fake_shd(tmp_path / "shd", train=16)
    out = run_example("train_shd_delays.py", "--data", data, "--epochs", "1", "--steps", "10", "--hidden", "8",
                      "--max-delay", "3", "--min-accuracy", "-1", "--min-gain", "-2", tmp_path=tmp_path)
    assert f"SHD from {data}" in out and out.strip().splitlines()[-1] == "OK"


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_train_multi_gpu_under_torchrun_with_two_cpu_processes(tmp_path):
    """The documented command, `torchrun --nproc_per_node=2 examples/train_multi_gpu.py` (--standalone: a free
    port), on a machine without GPUs: two gloo ranks that each print their loss, and rank 0 the accuracy."""
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU fallback, also on a machine with GPUs
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(flexgen.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(EXAMPLES / "train_multi_gpu.py"), "--epochs", "5"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    found = re.findall(r"rank (\d): epoch (\d) loss (\d+\.\d+)", proc.stdout)  # the ranks share the one pipe
    for rank in "01":
        losses = [float(loss) for r, _, loss in found if r == rank]
        assert len(losses) == 5 and losses[-1] < losses[0] / 2, proc.stdout
    final = [line for line in lines if line.startswith("final accuracy:")]
    assert len(final) == 1 and "(2 ranks, DDP on cpu)" in final[0]
    assert float(final[0].split()[2].rstrip("%")) >= 90.0, final[0]
