"""Host-to-host latency of one step of the 700 -> 3 x 512 recurrent model: the step's input starts in pinned host
memory and its output must be back in pinned host memory, as in a real-time loop (a sensor's frame in, an
actuator's command out). p50 and p99 of single steps, us.

Candidates (same weights and inputs, one process): flexgen's persistent stream (`mode="persistent"`: the input
written into `stream.input`, the output returned in pinned memory); flexgen's fused graph stream with the input
copied to the device and the output back (non-blocking copies, then a CUDA event's wait); the same graph stream
with the input already on the device and the output left there (not host to host: what `bench_stream_model.py`
measures); torch.compile(mode="reduce-overhead") of the model's step in torch ops, with the same copies. Every
candidate's spikes over the first 64 steps are compared with the graph stream's.
"""
import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_stream_model as model_bench  # noqa: E402

import flexgen  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class HostToHost:
    """A step from pinned `x` to pinned output through device buffers: copy in, `step(device x)`, copy out, wait."""

    def __init__(self, step, batch, n_in, hidden, dtype):
        self.step = step
        self.x = torch.zeros(batch, n_in, dtype=dtype, device="cuda")
        self.out = torch.zeros(batch, hidden, dtype=dtype).pin_memory()
        self.event = torch.cuda.Event()

    def prepare(self, x):
        pass

    def __call__(self, x):
        self.x.copy_(x, non_blocking=True)
        self.out.copy_(self.step(self.x), non_blocking=True)
        self.event.record()
        self.event.synchronize()
        return self.out

    def close(self):
        if isinstance(self.step, flexgen.Stream):
            self.step.close()


class OnDevice:
    """The graph stream on its device input written in place, output left on the device, an event's wait."""

    def __init__(self, stream):
        self.stream, self.event = stream, torch.cuda.Event()

    def prepare(self, x):  # not timed: the input is on the device before the step
        self.stream.input.copy_(x)
        torch.cuda.synchronize()

    def __call__(self, x):
        out = self.stream()
        self.event.record()
        self.event.synchronize()
        return out

    def close(self):
        self.stream.close()


class Persistent:
    """The persistent stream on its pinned input written in place (a memcpy, not timed)."""

    def __init__(self, stream):
        self.stream = stream

    def prepare(self, x):
        self.stream.input.copy_(x)

    def __call__(self, x):
        return self.stream()

    def close(self):
        self.stream.close()


def candidates(batch, dtype, seed):
    n_in, hidden, layers = model_bench.MODEL
    build = lambda: model_bench.flexgen_model(n_in, hidden, layers, torch.device("cuda"), dtype, seed)  # noqa: E731
    example = torch.zeros(batch, n_in, dtype=dtype, device="cuda")
    graph_model, graph_copy_model = build(), build()
    compiled = model_bench.TorchStream(model_bench.parameters_of(build()), batch, "reduce-overhead")
    return {
        "flexgen persistent": Persistent(flexgen.Stream(build(), example, mode="persistent")),
        "flexgen graph, copies": HostToHost(flexgen.Stream(graph_copy_model, example), batch, n_in, hidden, dtype),
        "torch.compile reduce-overhead, copies": HostToHost(compiled, batch, n_in, hidden, dtype),
        "flexgen graph, on the device (not host to host)": OnDevice(flexgen.Stream(graph_model, example)),
    }


def latencies(call, xs, samples, warmup):
    """Each sample: the step's input written where the candidate reads it (`prepare`), then one timed step."""
    times = []
    for k in range(warmup + samples):
        x = xs[k % len(xs)]
        call.prepare(x)
        start = time.perf_counter()
        call(x)
        if k >= warmup:
            times.append((time.perf_counter() - start) * 1e6)
    times.sort()
    return times[len(times) // 2], times[int(len(times) * 0.99)]


def measure(dtypes, batches, samples, warmup, rounds):
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for batch in batches:
            device_xs = model_bench.inputs_for("model", 512, batch, dtype, torch.device("cuda"))
            xs = [x.cpu().pin_memory() for x in device_xs]
            made = candidates(batch, dtype, seed=512 + batch)
            reference = None
            cells, differ = {}, {}
            for name, call in made.items():  # spikes over the 64 inputs, from the initial states
                spikes = []
                for x in xs:
                    call.prepare(x)
                    spikes.append(call(x).detach().cpu().clone())
                spikes = torch.stack(spikes)
                reference = spikes if reference is None else reference
                differ[name] = float((spikes != reference).float().mean())
            for name, call in made.items():
                runs = [latencies(call, xs, samples, warmup) for _ in range(rounds)]
                cells[name] = [round(min(r[0] for r in runs), 1), round(min(r[1] for r in runs), 1)]
            for call in made.values():
                call.close()
            base = cells["flexgen persistent"][0]
            host = [c[0] for n, c in cells.items() if "not host to host" not in n and n != "flexgen persistent"]
            rows.append({"dtype": dname, "batch": batch, "cells": cells, "differ": differ,
                         "speedup_p50": round(min(host) / base, 2)})
            print(dname, batch, cells, "speed-up", rows[-1]["speedup_p50"], flush=True)
    return rows


def write(meta, rows, out):
    names = list(rows[0]["cells"])
    lines = [f"# Host-to-host latency of one stream step ({meta['gpu']})", "",
             f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, Triton {meta['triton']}. `{meta['command']}`.",
             "Per cell: p50 / p99 us of single steps (the least of the rounds' figures), 700 -> 3 x 512 recurrent "
             "LIF model. Speed-up: the fastest host-to-host peer's p50 over flexgen persistent's. Differ: the share "
             "of output spikes over the first 64 steps unlike the first candidate's.", "",
             "| dtype | B | " + " | ".join(names) + " | speed-up (p50) | differ |",
             "|---|---|" + "---|" * len(names) + "---|---|"]
    for r in rows:
        cells = " | ".join(f"{r['cells'][n][0]} / {r['cells'][n][1]}" for n in names)
        differ = ", ".join(f"{n} {v:g}" for n, v in r["differ"].items() if n != names[0])
        lines.append(f"| {r['dtype']} | {r['batch']} | {cells} | {r['speedup_p50']} | {differ} |")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"bench_stream_host_{meta['date']}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "perf"))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    import triton

    meta = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
            "triton": triton.__version__, "host": platform.node(),
            "command": "python benchmarks/bench_stream_host.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write(meta, measure(args.dtypes, args.batches, args.samples, args.warmup, args.rounds), args.out)


if __name__ == "__main__":
    main()
