"""The README's table of headline figures says what its records say: each range is recomputed here from the JSON
of the record the table cites (docs/perf/), with the GPU and date the record names, and must appear in the table
as written. A new record that changes a figure fails here until the README follows."""
import json
import pathlib
import re
from collections import defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "perf"


def record(name):
    return json.loads((PERF / name).read_text())


def table():
    """The README's figures table: from its heading to the next heading."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## Figures\n(.*?)(?=^## )", text, re.S | re.M)
    assert match, "README.md has no '## Figures' section"
    return match.group(1)


def num(x):
    """A ratio as the README writes it: two decimals below 10, one below 100, none above."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def span(values):
    lo, hi = min(values), max(values)
    return f"{num(lo)}–{num(hi)}x" if num(lo) != num(hi) else f"{num(lo)}x"


def lif_training():
    """LIF layer, forward + backward: the fastest peer's time over flexgen's (H200)."""
    data = record("bench_lif.json")
    cells = defaultdict(dict)
    for r in data["results"]:
        if r["bench"] == "lif" and "train_ms" in r:
            cells[(r["dtype"], r["T"])][r["impl"]] = r["train_ms"]
    peers = ("torch loop", "torch.compile", "SpikingJelly LIFNode", "FlexSN")
    ratios = [min(c[p] for p in peers) / c["flexgen"] for c in cells.values()]
    return data["gpu"], data["date"], span(ratios)


def lif_memory():
    """Standalone LIF: flexgen's peak over SpikingJelly's (both held in units of the input)."""
    data = record("bench_memory.json")
    cells = defaultdict(dict)
    for r in data["results"]:
        cells[(r["dtype"], r["steps"])][r["candidate"]] = r["peak_held"]
    ratios = [c["flexgen.LIF recompute=auto"] / c["SpikingJelly LIFNode"] for c in cells.values()]
    return data["meta"]["gpu"], data["meta"]["date"], span(ratios)


def _network_cells():
    data = record("bench_memory_network.json")
    cells = defaultdict(dict)
    for r in data["results"]:
        cells[(r["n"], r["layers"], r["precision"])][r["candidate"]] = r
    return data["meta"], cells


def network_time(precision):
    meta, cells = _network_cells()
    ratios = []
    for (n, layers, prec), c in cells.items():
        if prec != precision:
            continue
        mine = c.pop("flexgen Linear + LIF")
        ratios.append(min(r["fwd_bwd_ms"] for r in c.values() if r.get("fwd_bwd_ms")) / mine["fwd_bwd_ms"])
    return meta["gpu"], meta["date"], span(ratios)


def network_memory():
    meta, cells = _network_cells()
    ratios = []
    for c in cells.values():
        mine = c.pop("flexgen Linear + LIF")
        ratios.append(mine["peak_mib"] / min(r["peak_mib"] for r in c.values() if r.get("peak_mib") is not None))
    return meta["gpu"], meta["date"], span(ratios)


RECURRENT_PEERS = ("torch loop", "torch.compile", "snnTorch RLeaky")


def recurrent(quantity, dtype=None):
    """bench_recurrent.json: the fastest peer's time over the fused layer's ("ms"), or the fused layer's peak
    over the leanest peer's ("peak_mib")."""
    data = record("bench_recurrent.json")
    ratios = []
    for row in data["rows"]:
        if dtype is not None and row["dtype"] != dtype:
            continue
        c = row["candidates"]
        peers = [c[p][quantity] for p in RECURRENT_PEERS if quantity in c.get(p, {})]
        if peers and quantity in c["flexgen fused"]:
            mine = c["flexgen fused"][quantity]
            ratios.append(min(peers) / mine if quantity == "ms" else mine / min(peers))
    (date,) = set(data["dates"])
    return data["device"], date, span(ratios)


def recurrent_stream(dtype):
    """One step per call: flexgen's time over the fastest peer's (above 1: a peer is ahead)."""
    data = record("bench_recurrent_stream.json")
    ratios = [r["us_per_call"]["flexgen"] / min(v for k, v in r["us_per_call"].items() if k != "flexgen")
              for r in data["results"] if r["dtype"] == dtype]
    return data["meta"]["gpu"], data["meta"]["date"], span(ratios)


def stream_model(name="h200/bench_stream_model_2026-11-28.json", quantity="us_per_call"):
    """flexgen.Stream, whole models and one layer one step a call: the fastest peer's time over the stream's, back
    to back (`us_per_call`) or at p50 (`p50_us`) (H200; or the CPU record `name`)."""
    data = record(name)
    mine = "flexgen Stream"  # every flexgen candidate (no stream, input in place) is not a peer
    ratios = [min(v for k, v in r[quantity].items() if not k.startswith("flexgen")) / r[quantity][mine]
              for r in data["results"]]
    return data["meta"]["device"], data["meta"]["date"], span(ratios)


def weak_scaling():
    """Data parallelism on 2 GPUs: the weak-scaling efficiencies (1 GPU's step time over N's, the same batch per
    GPU), DDP and FSDP2, as a percentage range."""
    data = record("h200/bench_ddp_2026-11-28.json")
    values = [100 * r["efficiency"] for r in data["scaling"] if r["kind"] == "weak"]
    return data["machine"]["gpu"], data["machine"]["date"], f"{min(values):.1f}–{max(values):.1f} %"


def long_sequence(candidate, quantity):
    """Feed-forward network at T 10,000: the candidate's over SpikingJelly's (time or peak)."""
    data = record("bench_long_sequence.json")
    rows = {r["candidate"]: r for r in data["results"] if (r["network"], r["steps"]) == ("feed-forward", 10000)}
    ratio = rows[candidate][quantity] / rows["SpikingJelly Linear + LIFNode"][quantity]
    return data["meta"]["gpu"], data["meta"]["date"], span([ratio])


def delayed_linear(quantity):
    """DelayedLinear (backend chosen per call) against dcls's Dcls1d, fp32 with TF32 allowed: dcls's time over
    flexgen's, or flexgen's peak over dcls's."""
    data = record("h100/bench_delays_tap_kernels_fp32_tf32_run2.json")
    cells = defaultdict(dict)
    for r in data["results"]:
        cells[(r["steps"], r["max_delay"], r["batch"])][r["candidate"]] = r
    ratios = []
    for c in cells.values():
        mine, dcls = c["flexgen auto"], c["dcls v0"]
        ratios.append(dcls["fwd_bwd_ms"] / mine["fwd_bwd_ms"] if quantity == "fwd_bwd_ms"
                      else mine["peak_mb"] / dcls["peak_mb"])
    return data["meta"]["gpu"], data["meta"]["date"], span(ratios)


def _cpu_cells(name, skip=lambda r: False):
    data = record(name)
    cells = defaultdict(dict)
    for r in data["results"]:
        if not skip(r):
            cells[(r["neuron"], r["dtype"], r["steps"], r["threads"])][r["candidate"]] = r["ms"]
    return data["meta"], cells


def cpu_lif():
    """The C target's default (plain) design against the fastest peer, LIF, T 8-256: bench_cpu.json with its rows
    at T 8 and 32 from the idle repeat bench_cpu_lif_small_t.json."""
    meta, cells = _cpu_cells("bench_cpu.json", skip=lambda r: r["neuron"] == "LIF" and r["steps"] in (8, 32))
    cells.update(_cpu_cells("bench_cpu_lif_small_t.json")[1])
    ratios = [min(v for k, v in c.items() if not k.startswith("flexgen")) / c["flexgen backend=c recompute=False"]
              for key, c in cells.items() if key[0] == "LIF"]
    return f"{meta['cpu']} ({meta['cores']} cores)", meta["date"], span(ratios)


def cpu_recurrent():
    meta, cells = _cpu_cells("bench_cpu_synaptic_recurrent.json")
    ratios = [min(v for k, v in c.items() if not k.startswith("flexgen")) / c["flexgen backend=c"]
              for key, c in cells.items() if key[0] == "Recurrent"]
    return f"{meta['cpu']} ({meta['cores']} cores)", meta["date"], span(ratios)


def stream_host(name="h200/bench_stream_host_cores_2026-11-29.json"):
    """Host to host, one step a call: the fastest host-to-host peer's p50 over flexgen persistent's (the record's
    own speed-up column, recomputed from its cells)."""
    data = record(name)
    ratios = []
    for r in data["rows"]:
        peers = [c[0] for n, c in r["cells"].items() if n != "flexgen persistent" and "not host to host" not in n]
        ratios.append(min(peers) / r["cells"]["flexgen persistent"][0])
    return data["meta"]["gpu"], data["meta"]["date"], span(ratios)


# (what the README says, how it is computed): the cell text holds the range; the record's machine and date
# must be in the same table row.
FIGURES = {
    "LIF training, time": lif_training,
    "LIF, peak memory": lif_memory,
    "Linear + LIF, fp32 time": lambda: network_time("fp32"),
    "Linear + LIF, AMP time": lambda: network_time("AMP fp16"),
    "Linear + LIF, peak memory": network_memory,
    "recurrent, time": lambda: recurrent("ms"),
    "recurrent, fp32 peak memory": lambda: recurrent("peak_mib", "fp32"),
    "recurrent, bf16 peak memory": lambda: recurrent("peak_mib", "bf16"),
    "streaming, fp32": lambda: recurrent_stream("fp32"),
    "streaming, bf16": lambda: recurrent_stream("bf16"),
    "whole-model streaming, time": stream_model,
    "whole-model streaming on the CPU, time": lambda: stream_model("bench_stream_model_cpu_2026-11-29.json"),
    "whole-model streaming on the CPU, p50": lambda: stream_model("bench_stream_model_cpu_2026-11-29.json", "p50_us"),
    "data parallelism, weak scaling": weak_scaling,
    "long sequence, Chain time": lambda: long_sequence("flexgen Chain checkpoint_every=512", "fwd_bwd_ms"),
    "long sequence, Chain peak": lambda: long_sequence("flexgen Chain checkpoint_every=512", "peak_mb"),
    "DelayedLinear, time": lambda: delayed_linear("fwd_bwd_ms"),
    "DelayedLinear, peak memory": lambda: delayed_linear("peak_mb"),
    "CPU LIF, time": cpu_lif,
    "CPU recurrent, time": cpu_recurrent,
    "whole-model streaming host to host": stream_host,
}

SHORT_MACHINE = {"NVIDIA H100 80GB HBM3": "H100", "NVIDIA H200": "H200", "Intel(R) Xeon(R) Processor (2 cores)": "Xeon, 2 cores",
                 "CPU (2 cores)": "CPU, 2 cores"}


def rows_of_table():
    return [line for line in table().splitlines() if line.startswith("|") and not line.startswith("|---")]


@pytest.mark.parametrize("name", FIGURES)
def test_a_headline_figure_is_what_its_record_gives(name):
    machine, date, figure = FIGURES[name]()
    short = SHORT_MACHINE.get(machine, machine)
    rows = [row for row in rows_of_table() if figure in row and f"{short}, {date}" in row]
    assert rows, (f"README's figures table has no row with {figure} and '{short}, {date}' ({name}: recomputed "
                  f"from its record)")


def test_every_range_in_the_table_is_checked():
    """No range in the table is left unchecked: each 'a–bx' or 'ax' in it is one the records give."""
    computed = {FIGURES[name]()[2] for name in FIGURES}
    written = set(re.findall(r"\d[\d.]*(?:–\d[\d.]*)?x\b", table()))
    assert written <= computed, f"ranges in README's table that no record computes: {sorted(written - computed)}"
