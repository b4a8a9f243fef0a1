"""EventProp on the CPU: one training step (forward + backward) of `flexgen.EventPropDense` on its C kernels and on
the torch reference, beside flexgen's BPTT (`flexgen.Dense` of the same ODE neuron on the dt grid), at small
SHD-like shapes (700 inputs, Poisson input spikes).

    python benchmarks/bench_eventprop.py [--out DIR] [--configs 64,8,100 128,16,300 ...] [--repeats 2]
        [--reference-budget 60]

Each config is `neurons,batch,steps`. The neuron is the current-based LIF (tau_m 10, tau_s 5, v_th 1, reset v to
0; `method="exact"` for BPTT's discrete step, dt = 1). Input: each of the 700 inputs spikes in each grid bin with
probability `--rate` (default 0.02), at a uniform time inside the bin; EventProp takes the times, BPTT the binned
raster [T, B, 700]. EventProp's loss: the sum of the spike times plus the sum of the recorded v; BPTT's: the sum of
the output spikes plus the sum of v (store_state_seqs). Time: the median of `--repeats` steps after one warm-up.
Peak memory: the rise of the peak resident set (VmHWM, reset before the step) over one step, in a
fresh process per candidate and config (glibc mapping each block of 64 KiB or more on its own), after a step on a
tiny input has loaded every code path; in MiB. The torch reference (a Python loop over every breakpoint) is run only where its estimated time (from the
config before) stays under `--reference-budget` seconds. With --out DIR, writes DIR/bench_eventprop_cpu_<date>.md
and .json (machine, torch, date).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import subprocess
import time

import torch

import flexgen
from bench_cpu import cpu_name  # (benchmarks/ is on sys.path when a script in it runs)

INPUTS = 700


@flexgen.ode(states=("v", "i"), method="exact")
def cuba(x, v, i, tau_m=10.0, tau_s=5.0, v_th=1.0):
    return flexgen.Dynamics({"v": (i - v) / tau_m, "i": -i / tau_s + x}, threshold=v >= v_th, reset={"v": 0.0})


def peak_rise(argv):
    """The rise of the peak resident set over one step, measured in a fresh process (`--child`): Linux's high-water
    mark (VmHWM) reset just before the step (/proc/self/clear_refs), read after it, less the resident set before;
    glibc maps every block of 64 KiB or more on its own there (MALLOC_MMAP_THRESHOLD_), so a freed block leaves the
    resident set. The code paths are loaded first by a step on a tiny input."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv], capture_output=True,
                         text=True, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1]) / 2 ** 10


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(candidate, neurons, batch, steps, rate):
    """Print the rise of the peak resident set (KiB) over one training step of `candidate` ("c", "torch" or "bptt")."""
    build = {"c": lambda n, s: eventprop_layer(n, s, "c"), "torch": lambda n, s: eventprop_layer(n, s, "torch"),
             "bptt": lambda n, s: flexgen.Dense(INPUTS, n, cuba, backend="auto").double()}[candidate]

    def stepper(n, b, s):
        times, raster = inputs(b, s, rate, seed=n + b + s)
        layer = build(n, s)
        return bptt_step(layer, raster) if candidate == "bptt" else eventprop_step(layer, times)

    stepper(2, 1, 2)()  # every code path loaded, on a tiny input
    step = stepper(neurons, batch, steps)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark from here
    before = _status_kib("VmRSS")
    step()
    print(_status_kib("VmHWM") - before)


def eventprop_layer(neurons, steps, backend):
    torch.manual_seed(0)
    layer = flexgen.EventPropDense(INPUTS, neurons, cuba, dt=1.0, steps=steps, backend=backend)
    with torch.no_grad():
        layer.weight.normal_(0.02, 0.05)
    return layer


def inputs(batch, steps, rate, seed):
    """(spike times [B, 700, K] inf-padded, raster [T, B, 700])."""
    gen = torch.Generator().manual_seed(seed)
    raster = (torch.rand(steps, batch, INPUTS, generator=gen) < rate).to(torch.float64)
    offsets = torch.rand(steps, batch, INPUTS, generator=gen, dtype=torch.float64)
    at = torch.arange(steps, dtype=torch.float64)[:, None, None] + offsets
    times = torch.where(raster > 0, at, torch.full_like(at, float("inf"))).permute(1, 2, 0)
    times = times.sort(-1).values
    width = max(1, int(raster.sum(0).max()))
    return times[..., :width].contiguous(), raster


def eventprop_step(layer, times):
    def step():
        layer.zero_grad(set_to_none=True)
        out = layer(times)
        t = torch.where(torch.isfinite(out.times), out.times, torch.zeros_like(out.times))
        (t.sum() + out.trace[..., 0].sum()).backward()
        return int(out.counts.sum())
    return step


def bptt_step(layer, raster):
    def step():
        layer.zero_grad(set_to_none=True)
        spikes = layer(raster)
        (spikes.sum() + layer.final_states["v"].sum()).backward()
        return int(spikes.sum())
    return step


def measure(step, repeats, memory_argv):
    step()  # warm-up (compiles the C library on the first call)
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "peak_rss_mib": peak_rise(memory_argv), "spikes": result}


def run_config(neurons, batch, steps, rate, repeats, reference_ok):
    times, raster = inputs(batch, steps, rate, seed=neurons + batch + steps)
    row = {"neurons": neurons, "batch": batch, "steps": steps, "events_per_sample": float((raster.sum((0, 2))).mean())}
    torch.manual_seed(0)
    shape = [str(neurons), str(batch), str(steps), str(rate)]
    for backend in ("c", "torch"):
        name = f"eventprop_{backend}"
        if backend == "torch" and not reference_ok:
            row[name] = None
            continue
        layer = eventprop_layer(neurons, steps, backend)
        row[name] = measure(eventprop_step(layer, times), repeats, [backend] + shape)
        assert layer.last_run.backend == backend
    dense = flexgen.Dense(INPUTS, neurons, cuba, backend="auto").double()
    row["bptt"] = measure(bptt_step(dense, raster), repeats, ["bptt"] + shape)
    row["bptt"]["backend"] = dense.last_run.backend if getattr(dense, "last_run", None) else None
    return row


def fmt(cell, key, scale=1.0, digits=3):
    return "n/a" if cell is None else f"{cell[key] * scale:.{digits}g}"


def table(rows):
    lines = ["| neurons | batch | T | events / sample | EventProp C (s) | EventProp torch ref (s) | BPTT (s) | "
             "EventProp C peak (MiB) | torch ref peak (MiB) | BPTT peak (MiB) | output spikes (C) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['neurons']} | {r['batch']} | {r['steps']} | {r['events_per_sample']:.0f} | "
                     f"{fmt(r['eventprop_c'], 'seconds')} | {fmt(r['eventprop_torch'], 'seconds')} | "
                     f"{fmt(r['bptt'], 'seconds')} | {fmt(r['eventprop_c'], 'peak_rss_mib')} | "
                     f"{fmt(r['eventprop_torch'], 'peak_rss_mib')} | {fmt(r['bptt'], 'peak_rss_mib')} | "
                     f"{r['eventprop_c']['spikes']} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        candidate, neurons, batch, steps, rate = argv[1:]
        child(candidate, int(neurons), int(batch), int(steps), float(rate))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--configs", nargs="+", default=["64,8,100", "128,16,100", "256,8,300", "64,8,1000"])
    parser.add_argument("--rate", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reference-budget", type=float, default=60.0)
    args = parser.parse_args(argv)
    if not flexgen.launch.c_path.available():
        print("bench_eventprop needs a C compiler for the EventProp C kernels", file=sys.stderr)
        return 2
    rows, per_breakpoint_row = [], None  # the reference's seconds per (breakpoint x row), from the last run
    for config in args.configs:
        neurons, batch, steps = (int(v) for v in config.split(","))
        breakpoints = steps * (1 + INPUTS * args.rate)
        estimate = None if per_breakpoint_row is None else per_breakpoint_row * breakpoints * (1 + batch * neurons / 4096)
        ok = estimate is None or estimate * (args.repeats + 1) < args.reference_budget
        row = run_config(neurons, batch, steps, args.rate, args.repeats, ok)
        if row["eventprop_torch"] is not None:
            per_breakpoint_row = row["eventprop_torch"]["seconds"] / (breakpoints * (1 + batch * neurons / 4096))
        rows.append(row)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "rate": args.rate,
            "repeats": args.repeats,
            "command": "python benchmarks/bench_eventprop.py " + " ".join(argv)}
    print(table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"bench_eventprop_cpu_{meta['date']}")
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(f"# EventProp on the CPU: C kernels, torch reference, BPTT\n\n{meta['cpu']} ({meta['cores']} "
                    f"cores, {meta['threads']} torch threads), {meta['date']}, torch {meta['torch']}. "
                    f"`{meta['command']}`.\nCuBa LIF, 700 inputs spiking with probability {args.rate} per input "
                    f"and dt bin, fp64; one training step (forward + backward), the median of {args.repeats}; peak "
                    "memory: the rise of the peak resident set over one step (a fresh process each). n/a: the torch reference was "
                    "not run (over the time budget).\n\n" + table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
