"""Recorded GPU benchmark runs agree with their own data: the tables under docs/perf/ are redrawn from the
recorded JSON by the benchmark scripts' `--replot` (no GPU needed), and must come out identical."""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "perf"


@pytest.mark.parametrize("script,recorded,plotted", [
    ("bench_memory.py", "bench_memory_network", True),
    ("bench_long_sequence.py", "bench_long_sequence", True),
    ("bench_delay_line.py", "bench_delay_line", False),
    ("bench_delay_continued.py", "bench_delay_continued", False),
    ("bench_recurrent_host.py", "bench_recurrent_host", False),
    ("bench_recurrent_stream.py", "bench_recurrent_stream", False),
    ("bench_stream_model.py", "bench_stream_model_cpu_2026-11-28", False),
    ("bench_stream_model.py", "bench_stream_model_cpu_2026-11-29", False),
    ("bench_stream_model.py", "bench_stream_model_cpu_default_threads_2026-11-29", False),
])
def test_a_recorded_table_is_what_its_data_gives(tmp_path, script, recorded, plotted):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--replot", str(PERF / f"{recorded}.json"),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / f"{recorded}.md").read_text() == (PERF / f"{recorded}.md").read_text()
    if not plotted:
        return
    pytest.importorskip("matplotlib")
    assert (tmp_path / f"{recorded}.png").stat().st_size > 10_000


def test_a_merged_delay_line_record_names_the_run_that_measured_the_rows_it_keeps():
    """bench_delay_line's --merge of a record that had itself merged the kept rows names that earlier run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_delay_line", ROOT / "benchmarks" / "bench_delay_line.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    layer_run = {"command": "bench --hidden", "gpu": "G", "date": "D", "measured": ["layer"]}
    recurrent_run = {"command": "bench --no-layer --merge", "gpu": "G", "date": "D", "measured": ["recurrent"],
                     "merged": bench._provenance(layer_run, "layer")}
    assert bench._provenance(recurrent_run, "layer") == "rows of the other kind from `bench --hidden` (G, D)"
    itself = "rows of the other kind from `bench --no-layer --merge` (G, D)"
    assert bench._provenance(recurrent_run, "recurrent") == itself
    older = {"command": "bench", "gpu": "G", "date": "D"}  # records from before "measured": the run itself
    assert bench._provenance(older, "layer") == "rows of the other kind from `bench` (G, D)"


def _recurrent_record(command, date, dtype, triton="3.6.0", graph_ms=None):
    matmul = {"layer_ms": 0.9, "floor_ms": 1.0, "batch": 32, "tiling": {"block_b": 16, "block": 32, "split": 8}}
    if graph_ms is not None:  # records from 2026-11-27 on time the layer in a CUDA graph too
        matmul["graph_ms"] = graph_ms
    row = {"batch": 32, "steps": 100, "hidden": 256, "dtype": dtype,
           "candidates": {"flexgen fused": {"ms": 1.0, "peak_mib": 10.0}, "torch loop": {"ms": 30.0, "peak_mib": 9.0}},
           "matmul": matmul}
    return {"command": command, "date": date, "device": "G", "neuron": "leaky", "config": {}, "torch": "2.11",
            "triton": triton, "flexgen": "0", "rows": [row]}


def _merge_recurrent(tmp_path, records):
    import json

    paths = []
    for i, record in enumerate(records):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(record))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_recurrent.py"), "--merge", *map(str, paths),
                           "--out", str(tmp_path / "merged")], capture_output=True, text=True, timeout=300)


def test_merged_recurrent_records_keep_every_row_and_name_their_runs(tmp_path):
    import json

    done = _merge_recurrent(tmp_path, [_recurrent_record("bench --dtype fp32", "2026-11-27", "fp32"),
                                       _recurrent_record("bench --dtype bf16", "2026-11-28", "bf16", graph_ms=0.45)])
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "merged" / "bench_recurrent.json").read_text())
    assert [row["dtype"] for row in record["rows"]] == ["fp32", "bf16"]
    assert record["commands"] == ["bench --dtype fp32", "bench --dtype bf16"]
    assert record["dates"] == ["2026-11-27", "2026-11-28"]
    table = (tmp_path / "merged" / "bench_recurrent.md").read_text()
    assert "`bench --dtype fp32`; `bench --dtype bf16` (2026-11-27, 2026-11-28; torch 2.11, Triton 3.6.0)" in table
    same = "1.00 (10) | 30.00 (9) | 30.0x |  | 0.90 | 1.00 | 0.90"
    assert f"| 32 | 100 | 256 | fp32 | {same} |  |  | 16 (32) |" in table  # no time in a CUDA graph
    assert f"| 32 | 100 | 256 | bf16 | {same} | 0.45 | 0.45 | 16 (32) |" in table


def test_recurrent_records_of_other_setups_do_not_merge(tmp_path):
    done = _merge_recurrent(tmp_path, [_recurrent_record("a", "d", "fp32"),
                                       _recurrent_record("b", "d", "bf16", triton="3.2.0")])
    assert done.returncode != 0
    assert "the records differ in triton (3.2.0, 3.6.0): merge runs of one setup only" in done.stderr
    assert not (tmp_path / "merged").exists()


def test_the_recorded_recurrent_table_is_what_its_data_gives(tmp_path):
    """docs/perf/bench_recurrent.md, merged from several runs, is redrawn identically from its JSON."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_recurrent.py"), "--merge",
                           str(PERF / "bench_recurrent.json"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "bench_recurrent.md").read_text() == (PERF / "bench_recurrent.md").read_text()
