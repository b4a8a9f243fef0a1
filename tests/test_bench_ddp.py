"""benchmarks/bench_ddp.py runs end to end on the CPU (2 gloo processes, tiny shapes) and writes its record."""
import importlib
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

import flexgen

ROOT = pathlib.Path(__file__).resolve().parent.parent
FSDP2 = importlib.util.find_spec("torch.distributed.fsdp") is not None and hasattr(
    importlib.import_module("torch.distributed.fsdp"), "fully_shard")  # torch >= 2.6


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_bench_ddp_on_the_cpu_writes_a_record_with_both_wrappers_and_both_scalings(tmp_path):
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(flexgen.__file__).resolve().parent.parent),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ddp.py"), "--cpu", "--batch", "2", "4",
                           "--steps", "6", "--hidden", "8", "--layers", "2", "--warmup", "1", "--repeats", "2",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (record_path,) = tmp_path.glob("bench_ddp_*.json")
    record = json.loads(record_path.read_text())
    assert record["machine"]["gpu"] == "CPU" and record["machine"]["torch"] and record["machine"]["triton"]
    wrappers = ("ddp", "fsdp2") if FSDP2 else ("ddp",)
    measured = {(r["world"], r["wrapper"], r["batch_per_gpu"]) for r in record["rows"] if r.get("ms", 0) > 0}
    assert measured == {(1, "none", 2), (1, "none", 4)} | {(2, w, b) for w in wrappers for b in (2, 4)}
    kinds = {(s["kind"], s["wrapper"]) for s in record["scaling"]}
    assert kinds == {(k, w) for k in ("weak", "strong") for w in wrappers}
    assert (tmp_path / record_path.name.replace(".json", ".md")).read_text().startswith("# Data-parallel training")
