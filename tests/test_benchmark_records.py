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
