"""Streaming inference through a recurrent LIF layer: one step a call, no autograd, as a real-time model runs.

    python benchmarks/bench_recurrent_stream.py [--out DIR] [--shapes 256x1 256x32 ...] [--dtypes fp32 bf16]
                                                [--calls 2000] [--passes 3]
    python benchmarks/bench_recurrent_stream.py --dry-run [--out DIR]    # tiny sizes on the CPU (a temp folder)
    python benchmarks/bench_recurrent_stream.py --replot JSON [--out DIR]  # redraw a recorded table

Each candidate runs I_t = x_t + W s_{t-1} + b, h = v + (I_t - v) / 2, s_t = [h >= 1], v = h (1 - s_t) for [B, H]
inputs, one call per step under torch.no_grad, its parameters in the I/O dtype:
- flexgen: `Recurrent(LIF, hidden=H, bias=True, path="fused", step_mode="s")`, which keeps its states and last
  output between calls;
- torch eager: the step in torch ops (an addmm and the neuron's elementwise ops);
- torch.compile: the same step compiled (`dynamic=False`), once per configuration;
- snnTorch RLeaky (if installed): its own step, `RLeaky(beta=0.5, threshold=1.0, reset_mechanism="zero",
  linear_features=H)`, a neuron of the same cost but not the same one (its reset lags a step, and the input is not
  divided by tau), so its spikes differ; float32 parameters, under autocast for 16-bit inputs (as bench_recurrent.py
  runs it).
Per call: `--calls` calls back to back, then a synchronize, over the calls; the least of `--passes` passes (the GPU's
share of one step is microseconds: these are host times). Peak: the most memory allocated during a pass above what
was allocated before it, MiB. Every candidate's spikes over the first 64 steps are checked against flexgen's (the
same weights and inputs): the share that differ is recorded. Writes bench_recurrent_stream.json and .md to --out
(default docs/perf).
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch

import flexgen

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPES = ["256x1", "256x32", "1024x32"]  # hidden x batch
TAU, THRESHOLD = 2.0, 1.0


def lif_step(x, v, s, weight, bias):
    """One step of the recurrent LIF in torch ops: (spikes, membrane)."""
    h = v + (torch.addmm(x + bias, s, weight.t()) - v) / TAU
    spikes = (h >= THRESHOLD).to(x.dtype)
    return spikes, h * (1.0 - spikes)


class TorchStream:
    """The step in torch ops (or compiled), keeping its membrane and spikes between calls."""

    def __init__(self, weight, bias, batch, compiled):
        self.weight, self.bias = weight, bias
        self.step = torch.compile(lif_step, dynamic=False) if compiled else lif_step
        self.v = torch.zeros(batch, weight.shape[0], dtype=weight.dtype, device=weight.device)
        self.s = torch.zeros_like(self.v)

    def __call__(self, x):
        self.s, self.v = self.step(x, self.v, self.s, self.weight, self.bias)
        return self.s


class SnnTorchStream:
    """snnTorch's RLeaky, one step a call; for 16-bit inputs under autocast, as bench_recurrent.py runs it (its
    spikes and membrane are float32)."""

    def __init__(self, weight, bias, batch):
        import snntorch

        hidden = weight.shape[0]
        self.layer = snntorch.RLeaky(beta=1.0 - 1.0 / TAU, threshold=THRESHOLD, linear_features=hidden,
                                     reset_mechanism="zero").to(weight.device)
        with torch.no_grad():
            self.layer.recurrent.weight.copy_(weight)
            self.layer.recurrent.bias.copy_(bias)
        self.spk, self.mem = self.layer.init_rleaky()
        self.autocast = weight.dtype in (torch.bfloat16, torch.float16)
        self.dtype = weight.dtype

    def __call__(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=self.autocast):
            self.spk, self.mem = self.layer(x, self.spk, self.mem)
        return self.spk


def candidates(hidden, batch, dtype, device):
    torch.manual_seed(hidden + batch)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True, path="fused", step_mode="s",
                              backend="triton").to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.mul_(4.0)  # feedback strong enough to change the spikes
    weight, bias = layer.weight.detach(), layer.bias.detach()
    made = {"flexgen": layer, "torch eager": TorchStream(weight, bias, batch, compiled=False)}
    notes = {}
    if device.type == "cuda":
        made["torch.compile"] = TorchStream(weight, bias, batch, compiled=True)
    try:
        made["snnTorch RLeaky"] = SnnTorchStream(weight, bias, batch)
    except ImportError:
        notes["snnTorch RLeaky"] = "snntorch not installed"
    return made, notes


def per_call_us(call, xs, calls, passes, sync, device):
    best, peak = float("inf"), 0
    for _ in range(passes):
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
        start = time.perf_counter()
        for i in range(calls):
            call(xs[i % len(xs)])
        sync()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated() - start_bytes)
    return best, peak / 2**20


def measure(dtypes, shapes, calls, passes, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for name in dtypes:
        dtype = DTYPES[name]
        for shape in shapes:
            hidden, batch = map(int, shape.split("x"))
            xs = [(torch.rand(batch, hidden, device=device) * 1.5).to(dtype) for _ in range(64)]
            made, notes = candidates(hidden, batch, dtype, device)
            row = {"dtype": name, "hidden": hidden, "batch": batch, "us_per_call": {}, "peak_mib": {},
                   "spikes_differ": {}, "notes": notes}
            with torch.no_grad():
                reference = torch.stack([made["flexgen"](x) for x in xs]).float()
                for cand, call in made.items():
                    if cand != "flexgen":
                        got = torch.stack([call(x) for x in xs]).float()
                        row["spikes_differ"][cand] = round((got != reference).float().mean().item(), 6)
                    for i in range(50):
                        call(xs[i % len(xs)])  # warm-up, compilation
                    us, peak = per_call_us(call, xs, calls, passes, sync, device)
                    row["us_per_call"][cand], row["peak_mib"][cand] = round(us, 2), round(peak, 3)
            row["spike_rate"] = round(reference.mean().item(), 4)
            rows.append(row)
            print(row, flush=True)
    return rows


def table(meta, rows):
    names = list(dict.fromkeys(n for r in rows for n in r["us_per_call"]))
    lines = ["# Streaming inference: one step a call through a recurrent LIF layer",
             "",
             f"{meta['gpu']}, {meta['date']}, torch {meta['torch']}, Triton {meta['triton']}. `{meta['command']}`.",
             f"us per call: {meta['calls']} calls back to back, then a synchronize; the least of {meta['passes']} "
             "passes. Peak: MiB allocated during a pass above its start. Differ: the share of spikes over the first "
             "64 steps unlike flexgen's (same weights and inputs).",
             "",
             "| dtype | H | B | spike rate | " + " | ".join(f"{n} us (peak MiB)" for n in names)
             + " | flexgen / fastest peer | differ |",
             "|---|---|---|---|" + "---|" * len(names) + "---|---|"]
    for r in rows:
        cells = [f"{r['us_per_call'][n]:.1f} ({r['peak_mib'][n]:.2f})" if n in r["us_per_call"] else "n/a"
                 for n in names]
        peers = [v for n, v in r["us_per_call"].items() if n != "flexgen"]
        ratio = f"{r['us_per_call']['flexgen'] / min(peers):.2f}" if peers else "n/a"
        differ = ", ".join(f"{n} {v:g}" for n, v in r["spikes_differ"].items())
        lines.append(f"| {r['dtype']} | {r['hidden']} | {r['batch']} | {r['spike_rate']:.3f} | "
                     + " | ".join(cells) + f" | {ratio} | {differ} |")
    return "\n".join(lines) + "\n"


def write(meta, rows, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_recurrent_stream.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    text = table(meta, rows)
    with open(os.path.join(out, "bench_recurrent_stream.md"), "w") as f:
        f.write(text)
    print(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="where the record goes (default docs/perf; a temp folder dry)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (Triton's interpreter)")
    p.add_argument("--replot", metavar="JSON", help="redraw the table of a recorded run")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(__file__), "..", "docs", "perf")
    if args.replot:
        with open(args.replot) as f:
            record = json.load(f)
        write(record["meta"], record["results"], out)
        return out
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.dtypes, args.shapes, args.calls, args.passes = ["fp32"], ["16x2"], 3, 1
        out = args.out or tempfile.mkdtemp(prefix="bench_recurrent_stream_")
        device = torch.device("cpu")
    else:
        device = torch.device("cuda")
    import triton

    rows = measure(args.dtypes, args.shapes, args.calls, args.passes, device)
    given = sys.argv[1:] if argv is None else argv
    meta = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python benchmarks/bench_recurrent_stream.py", *given]),
            "calls": args.calls, "passes": args.passes}
    write(meta, rows, out)
    return out


if __name__ == "__main__":
    main()
