"""Host time of a fused recurrent layer's eager training step against the GPU time of the same step.

    python benchmarks/bench_recurrent_host.py [--out DIR] [--dtypes fp32 bf16] [--shapes 128x32 256x32 ...]
                                              [--steps 100] [--calls 300] [--passes 2]
    python benchmarks/bench_recurrent_host.py --replot JSON [--out DIR]    # redraw a recorded table
    python benchmarks/bench_recurrent_host.py --dry-run [--out DIR]        # tiny sizes (a temp folder)

A step: `layer.reset()`, the gradients set to None, `layer(x).backward(g)` for `flexgen.Recurrent(flexgen.LIF,
hidden=H, bias=True, path="fused")` (float32 parameters) on inputs [T, B, H] in the given dtype (fresh uniform
currents in [0, 1.5), a fresh random output gradient). Host time: the median over `--calls` calls of the Python
call alone, each started after a synchronize (the GPU idle, so the call never waits for it). GPU time: the same step
captured in a CUDA graph and replayed (`triton.testing.do_bench` median): the kernels with no host time between
them. Eager: `do_bench`'s median of the step as users run it. The ratio host / GPU is the figure to keep low (at
most 1.3 is the aim). The host side moves between runs and machines, so every shape is measured `--passes` times, in turns; the
table gives each pass. The record also holds the host time of autograd's own floor on that machine: the backward
of `(a * 2).sum()` for a 4-element CUDA tensor. Writes bench_recurrent_host.json and .md to DIR (default
docs/perf).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import flexgen

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = ["128x32", "256x32", "256x256", "512x256"]  # hidden x batch


def make_step(hidden, batch, steps, dtype, device):
    torch.manual_seed(hidden + batch)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True, path="fused", backend="triton").to(device)
    x = (torch.rand(steps, batch, hidden, device=device) * 1.5).to(dtype).requires_grad_()
    g = torch.randn(steps, batch, hidden, device=device).to(dtype)

    def step():
        layer.reset()
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x).backward(g)

    return step


def host_ms(step, calls, sync):
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    sync()
    return statistics.median(times) * 1e3


def graph_ms(step, rep=100):
    """The step's GPU time: captured once (after warm-up on a side stream, as torch.cuda.graph asks) and replayed
    (do_bench's median over about `rep` ms)."""
    import triton

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return triton.testing.do_bench(graph.replay, rep=rep, return_mode="median")


def autograd_floor_ms(device, calls, sync):
    def tiny_backward():
        a = torch.ones(4, device=device, requires_grad=True)
        (a * 2).sum().backward()

    for _ in range(50):
        tiny_backward()
    return host_ms(tiny_backward, calls, sync)


def measure(dtypes, shapes, steps, calls, passes, device):
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    runs = {(d, s): make_step(*map(int, s.split("x")), steps, DTYPES[d], device) for d in dtypes for s in shapes}
    for step in runs.values():
        for _ in range(50 if cuda else 2):
            step()
    hosts = {key: [] for key in runs}
    for _ in range(passes):  # in turns: a slow spell of the host shows in every shape, not in one
        for key, step in runs.items():
            hosts[key].append(host_ms(step, calls, sync))
    results = []
    for (dtype, shape), step in runs.items():
        hidden, batch = map(int, shape.split("x"))
        row = {"dtype": dtype, "hidden": hidden, "batch": batch, "steps": steps,
               "host_ms": [round(h, 4) for h in hosts[dtype, shape]]}
        if cuda:
            import triton

            row["gpu_ms"] = round(graph_ms(step), 4)
            row["eager_ms"] = round(triton.testing.do_bench(step, return_mode="median"), 4)
        results.append(row)
        print(row, flush=True)
    return results, autograd_floor_ms(device, calls, sync)


def table(meta, results):
    lines = ["# Fused recurrent layer: host time of an eager training step against its GPU time",
             "",
             f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, Triton {meta['triton']}. `{meta['command']}`.",
             f"`Recurrent(LIF, bias=True, path=\"fused\")`, float32 parameters, T {meta['steps']}; host: median of "
             f"{meta['calls']} calls, each after a synchronize, per pass; GPU: the step's CUDA graph replayed. "
             "Autograd's floor on this machine (the host time of a 2-op backward on a 4-element tensor): "
             f"{meta['autograd_floor_ms']:.3f} ms.",
             "",
             "| dtype | H | B | host ms, per pass | GPU ms (graph) | host / GPU, per pass | eager ms |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        gpu = r.get("gpu_ms")
        hosts = " / ".join(f"{h:.3f}" for h in r["host_ms"])
        ratios = " / ".join(f"{h / gpu:.2f}" for h in r["host_ms"]) if gpu else "n/a"
        gpu_cell, eager_cell = (f"{gpu:.3f}", f"{r['eager_ms']:.3f}") if gpu else ("n/a", "n/a")
        lines.append(f"| {r['dtype']} | {r['hidden']} | {r['batch']} | {hosts} | {gpu_cell} | {ratios} "
                     f"| {eager_cell} |")
    return "\n".join(lines) + "\n"


def write_outputs(meta, results, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_recurrent_host.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out, "bench_recurrent_host.md"), "w") as f:
        f.write(table(meta, results))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="where the record goes (default docs/perf; with --dry-run a temporary folder)")
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="hidden x batch, e.g. 128x32")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--replot", metavar="JSON", help="redraw the table of a recorded run (no GPU needed)")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (on a machine without a GPU through "
                        "Triton's interpreter), a temporary folder unless --out: checks the script")
    args = parser.parse_args(argv)
    perf = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf")
    args.out = args.out or (tempfile.mkdtemp(prefix="bench_recurrent_host_") if args.dry_run else perf)
    if args.replot:
        with open(args.replot) as f:
            recorded = json.load(f)
        write_outputs(recorded["meta"], recorded["results"], args.out)
        return 0
    if args.dry_run:  # tiny sizes; on the CPU through Triton's interpreter
        args.dtypes, args.shapes, args.steps, args.calls, args.passes = ["fp32"], ["16x2"], 3, 3, 1
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            os.environ["TRITON_INTERPRET"] = "1"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("bench_recurrent_host needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    import triton

    results, floor = measure(args.dtypes, args.shapes, args.steps, args.calls, args.passes, device)
    meta = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton's interpreter)",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python benchmarks/bench_recurrent_host.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "steps": args.steps, "calls": args.calls, "autograd_floor_ms": round(floor, 4)}
    write_outputs(meta, results, args.out)
    print(table(meta, results))
    print(f"written to {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
