"""EventProp on the GPU: one training step (forward + backward) of `flexgen.EventPropDense` on its Triton kernels,
beside flexgen's BPTT of the same neuron on the dt grid (`flexgen.Dense`, the default path and the long-sequence
mode `checkpoint_every=K`), at SHD-like shapes (700 inputs, Poisson input spikes, a feed-forward hidden layer, or
a recurrent one with --recurrent: `EventPropDense(recurrent=True)` against `flexgen.Dense` into `flexgen.Recurrent`).

    python benchmarks/bench_eventprop_gpu.py [--out DIR] [--configs 256,32,1000 ...] [--rate 0.01] [--every 128]
        [--recurrent] [--grid 1] [--suffix b]

Each config is `neurons,batch,steps`. The neuron is the current-based LIF (tau_m 10, tau_s 5, v_th 1, reset v to 0;
`method="exact"` for BPTT's discrete step, dt = 1). Input: each of the 700 inputs spikes in each grid bin with
probability `--rate`, at a uniform time inside the bin; EventProp takes the times (float64: its kernels compute in
it), BPTT the binned raster [T, B, 700] in float32. EventProp's loss: the sum of the spike times plus the sum of
the recorded v over its grid; BPTT's: the sum of the output spikes plus the sum of the final v. EventProp's grid
(`--grid G`: a point every G steps, `EventPropDense(dt=G, steps=T / G)`, the same window) is where it records the
states; its backward runs the forward again from each grid point to the next, so the grid sets its memory (the
states at every point and their gradient, the log of one interval's events), not its arithmetic, which is exact
between events whatever the grid. Time:
triton.testing.do_bench's median of whole training steps (each on the same input; the layers keep no state between calls). Memory: the peak of
torch.cuda.max_memory_allocated over one warm step, after empty_cache, less what was allocated before it (the
layer and its input), and the peak reserved; in MiB. With --out DIR, writes DIR/bench_eventprop_gpu_<date>.md and
.json (GPU, torch, Triton, date; `--suffix` after the date).
"""
import argparse
import datetime
import json
import os
import sys

import torch
import triton

import flexgen

INPUTS = 700


@flexgen.ode(states=("v", "i"), method="exact")
def cuba(x, v, i, tau_m=10.0, tau_s=5.0, v_th=1.0):
    return flexgen.Dynamics({"v": (i - v) / tau_m, "i": -i / tau_s + x}, threshold=v >= v_th, reset={"v": 0.0})


def inputs(batch, steps, rate, seed, device):
    """(spike times [B, 700, K] float64 inf-padded, raster [T, B, 700] float32)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    raster = torch.rand(steps, batch, INPUTS, generator=gen, device=device) < rate
    offsets = torch.rand(steps, batch, INPUTS, generator=gen, device=device, dtype=torch.float64)
    at = torch.arange(steps, dtype=torch.float64, device=device)[:, None, None] + offsets
    times = torch.where(raster, at, torch.full_like(at, float("inf"))).permute(1, 2, 0)
    width = max(1, int(raster.sum(0).max()))
    times = times.sort(-1).values[..., :width].contiguous()
    return times, raster.float()


def eventprop_step(layer, times):
    def step():
        layer.zero_grad(set_to_none=True)
        out = layer(times)
        t = torch.where(torch.isfinite(out.times), out.times, torch.zeros_like(out.times))
        (t.sum() + out.trace[..., 0].sum()).backward()
    return step


def bptt_step(layer, raster):
    def step():
        layer.zero_grad(set_to_none=True)
        spikes = layer(raster)
        (spikes.sum() + layer.final_states["v"].sum()).backward()
    return step


def memory(step):
    """(peak allocated rise, peak reserved) of one warm step, MiB."""
    step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return ((torch.cuda.max_memory_allocated() - base) / 2 ** 20, torch.cuda.max_memory_reserved() / 2 ** 20)


def measure(step):
    step()  # warm-up: compiles the kernels
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(step, warmup=1, rep=1, return_mode="median")
    peak, reserved = memory(step)
    return {"ms": ms, "peak_mib": peak, "reserved_mib": reserved}


def run_config(neurons, batch, steps, rate, every, device, recurrent=False, grid=1):
    times, raster = inputs(batch, steps, rate, seed=neurons + batch + steps, device=device)
    row = {"neurons": neurons, "batch": batch, "steps": steps,
           "events_per_sample": float(raster.sum((0, 2)).mean()), "recurrent": recurrent, "grid": grid}
    torch.manual_seed(0)
    layer = flexgen.EventPropDense(INPUTS, neurons, cuba, dt=float(grid), steps=steps // grid,
                                   recurrent=recurrent).to(device)
    with torch.no_grad():
        layer.weight.normal_(0.02, 0.05)
        if recurrent:
            layer.weight_rec.normal_(0.0, 0.02)
    row["eventprop"] = measure(eventprop_step(layer, times))
    assert layer.last_run.backend == "triton", layer.last_run
    with torch.no_grad():
        row["eventprop"]["spikes"] = int(layer(times).counts.sum())
    del layer
    for name, options in (("bptt", {}), ("bptt_long", {"checkpoint_every": every})):
        if recurrent:  # (without a bias, as EventPropDense; the feed-forward rows keep Dense's default)
            options = dict(options, bias=False)
        neuron = flexgen.Recurrent(cuba, hidden=neurons) if recurrent else cuba
        dense = flexgen.Dense(INPUTS, neurons, neuron, **options).to(device)
        with torch.no_grad():
            dense.weight.normal_(0.02, 0.05)
            if recurrent:
                for param in dense.parameters():  # the recurrent weight [H, H] (the input's is [H, 700])
                    if param.shape == (neurons, neurons):
                        param.normal_(0.0, 0.02)
        row[name] = measure(bptt_step(dense, raster))
        del dense
    torch.cuda.empty_cache()
    return row


def table(rows, every):
    lines = ["| neurons | batch | T | events / sample | EventProp Triton (ms) | BPTT (ms) | "
             f"BPTT checkpoint_every={every} (ms) | EventProp peak (MiB) | BPTT peak (MiB) | BPTT long peak (MiB) | "
             "EventProp output spikes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e, b, lo = r["eventprop"], r["bptt"], r["bptt_long"]
        lines.append(f"| {r['neurons']} | {r['batch']} | {r['steps']} | {r['events_per_sample']:.0f} | "
                     f"{e['ms']:.3g} | {b['ms']:.3g} | {lo['ms']:.3g} | {e['peak_mib']:.4g} | "
                     f"{b['peak_mib']:.4g} | {lo['peak_mib']:.4g} | {e['spikes']} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--configs", nargs="+", default=["256,32,1000", "512,32,1000", "256,128,1000",
                                                         "256,32,10000"])
    parser.add_argument("--rate", type=float, default=0.01)
    parser.add_argument("--every", type=int, default=128)
    parser.add_argument("--recurrent", action="store_true", help="a recurrent hidden layer (weight_rec ~ N(0, 0.02))")
    parser.add_argument("--grid", type=int, default=1, help="EventProp records the states every GRID steps (it "
                        "must divide each config's T)")
    parser.add_argument("--suffix", default="", help="added to the record's name after the date (a second run "
                        "of the day: b, c, ...)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_eventprop_gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for config in args.configs:
        neurons, batch, steps = (int(v) for v in config.split(","))
        if args.grid < 1 or steps % args.grid:
            parser.error(f"--grid {args.grid} must be a positive divisor of T = {steps}")
        rows.append(run_config(neurons, batch, steps, args.rate, args.every, "cuda", args.recurrent, args.grid))
        print(table(rows[-1:], args.every).splitlines()[-1], flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "rate": args.rate, "every": args.every,
            "grid": args.grid,
            "command": "python benchmarks/bench_eventprop_gpu.py " + " ".join(argv)}
    print(table(rows, args.every))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "bench_eventprop_gpu_recurrent" if args.recurrent else "bench_eventprop_gpu"
        stem = os.path.join(args.out, f"{name}_{meta['date']}{args.suffix}")
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            kind = "a recurrent layer" if args.recurrent else "a feed-forward layer"
            f.write(f"# EventProp on the GPU against BPTT, {kind} ({meta['gpu']}, {meta['date']})\n\n"
                    f"`{meta['command']}`; torch {meta['torch']}, Triton {meta['triton']}; input rate "
                    f"{args.rate} per input and step; EventProp's grid a point every {args.grid} step(s)."
                    f"\n\n{table(rows, args.every)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
