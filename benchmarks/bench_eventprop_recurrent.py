"""Recurrent EventProp layers on the CPU: the forward and the backward of `flexgen.EventPropDense(...,
recurrent=True)` against the same layer feed-forward (`recurrent=False`, the same input weights), on the C kernels
and, at a small shape (--reference: 50 inputs spiking 14 times as often), on the torch reference too; at SHD-like
input shapes (700 inputs, Poisson input spikes).

    python benchmarks/bench_eventprop_recurrent.py [--out DIR] [--configs 128,16,100 ...] [--repeats 3]
        [--reference 16,4,50 ...] [--learnable tau_m ...] [--recurrent-delays axon synapse]

Each config is `neurons,batch,steps` (dt = 1 ms). The neuron is the current-based LIF (tau_m 20, tau_s 5, v_th 1,
reset v to 0). Input: each of the 700 inputs spikes in each 1 ms bin with probability `--rate` (default 0.02), at
a uniform time inside the bin. Weights: input normal(0.03, 0.05), recurrent normal(0, 0.1) (seeded). Loss: the sum
of the spike times plus the sum of the recorded v; `--learnable` names neuron parameters trained too (their
gradients need the parameter integrals, which the C backward skips where none is trained); `--recurrent-delays`
names kinds of recurrent delays (`recurrent_delays=`) timed too, with delays uniform in [0, 5) ms (seeded). Time:
the median of `--repeats` calls after one warm-up, forward
and backward apart. With --out DIR, writes DIR/bench_eventprop_recurrent_cpu_<date>.md and .json (machine, torch,
date, command).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

import flexgen
from bench_cpu import cpu_name  # (benchmarks/ is on sys.path when a script in it runs)

INPUTS = 700
F64 = torch.float64


@flexgen.ode(states=("v", "i"), method="exact")
def cuba(x, v, i, tau_m=20.0, tau_s=5.0, v_th=1.0):
    return flexgen.Dynamics({"v": (i - v) / tau_m, "i": -i / tau_s + x}, threshold=v >= v_th, reset={"v": 0.0})


def inputs(batch, steps, rate, seed, inputs=INPUTS):
    """Spike times [B, inputs, K], ascending, inf-padded."""
    gen = torch.Generator().manual_seed(seed)
    spikes = torch.rand(batch, inputs, steps, generator=gen) < rate
    at = torch.arange(steps, dtype=F64) + torch.rand(batch, inputs, steps, generator=gen, dtype=F64)
    times = torch.where(spikes, at, torch.full_like(at, float("inf"))).sort(-1).values
    return times[..., :max(1, int(spikes.sum(-1).max()))].contiguous()


def layer_of(neurons, steps, recurrent, backend, inputs=INPUTS, learnable=(), recurrent_delays=None):
    gen = torch.Generator().manual_seed(0)
    extra = {} if recurrent_delays is None else {"recurrent_delays": recurrent_delays, "max_delay": 10.0}
    layer = flexgen.EventPropDense(inputs, neurons, cuba, dt=1.0, steps=steps, recurrent=recurrent,
                                   backend=backend, learnable=tuple(learnable), **extra)
    with torch.no_grad():
        layer.weight.normal_(0.03, 0.05, generator=gen)
        if recurrent:
            layer.weight_rec.normal_(0.0, 0.1, generator=gen)
        if recurrent_delays is not None:
            layer.delay_rec.uniform_(0.0, 5.0, generator=gen)
    return layer


def measure(layer, times, repeats):
    """(median forward seconds, median backward seconds, mean spikes per neuron)."""
    forward, backward, spikes = [], [], 0.0
    for k in range(repeats + 1):
        layer.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = layer(times)
        middle = time.perf_counter()
        loss = torch.where(torch.isfinite(out.times), out.times, torch.zeros_like(out.times)).sum()
        (loss + out.state("v").sum()).backward()
        end = time.perf_counter()
        if k:  # the first call is the warm-up (it compiles the C library)
            forward.append(middle - start)
            backward.append(end - middle)
        spikes = float(out.counts.double().mean())
    return statistics.median(forward), statistics.median(backward), spikes


def run_config(neurons, batch, steps, rate, repeats, backend, inputs_n=INPUTS, learnable=(), delay_kinds=()):
    times = inputs(batch, steps, rate, seed=neurons + batch + steps, inputs=inputs_n)
    row = {"backend": backend, "inputs": inputs_n, "neurons": neurons, "batch": batch, "steps": steps,
           "events_per_sample": float(torch.isfinite(times).sum((1, 2)).double().mean())}
    for recurrent in (True, False):
        layer = layer_of(neurons, steps, recurrent, backend, inputs_n, learnable)
        f, b, s = measure(layer, times, repeats)
        assert layer.last_run.backend == backend
        row["recurrent" if recurrent else "feed_forward"] = {"forward_s": f, "backward_s": b, "spikes_per_neuron": s}
    for kind in delay_kinds:
        layer = layer_of(neurons, steps, True, backend, inputs_n, learnable, recurrent_delays=kind)
        f, b, s = measure(layer, times, repeats)
        assert layer.last_run.backend == backend
        row[f"recurrent_delays_{kind}"] = {"forward_s": f, "backward_s": b, "spikes_per_neuron": s}
    return row


def table(rows):
    kinds = [k[len("recurrent_delays_"):] for k in rows[0] if k.startswith("recurrent_delays_")] if rows else []
    lines = ["| backend | inputs | neurons | batch | T | events / sample | recurrent: forward / backward (s) | "
             "spikes / neuron | feed-forward: forward / backward (s) | spikes / neuron |"
             + "".join(f" recurrent, {k} delays: forward / backward (s) | spikes / neuron |" for k in kinds),
             "|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(kinds)]
    for r in rows:
        rec, ff = r["recurrent"], r["feed_forward"]
        line = (f"| {r['backend']} | {r['inputs']} | {r['neurons']} | {r['batch']} | {r['steps']} | "
                f"{r['events_per_sample']:.0f} | {rec['forward_s']:.3g} / {rec['backward_s']:.3g} | "
                f"{rec['spikes_per_neuron']:.1f} | {ff['forward_s']:.3g} / {ff['backward_s']:.3g} | "
                f"{ff['spikes_per_neuron']:.1f} |")
        for k in kinds:
            d = r[f"recurrent_delays_{k}"]
            line += f" {d['forward_s']:.3g} / {d['backward_s']:.3g} | {d['spikes_per_neuron']:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--configs", nargs="+", default=["128,16,100", "256,16,100"])
    parser.add_argument("--reference", nargs="*", default=["16,4,50"],
                        help="configs also run on the torch reference, with 50 inputs spiking 14 times as often "
                             "(its Python loop is slow)")
    parser.add_argument("--rate", type=float, default=0.02)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--learnable", nargs="*", default=[], help="neuron parameters trained (e.g. tau_m)")
    parser.add_argument("--recurrent-delays", nargs="*", default=[], choices=["axon", "synapse"],
                        help="kinds of recurrent delays timed too (delays uniform in [0, 5) ms)")
    args = parser.parse_args(argv)
    if not flexgen.launch.c_path.available():
        print("bench_eventprop_recurrent needs a C compiler for the EventProp C kernels", file=sys.stderr)
        return 2
    rows = []
    for config in args.configs:
        rows.append(run_config(*(int(v) for v in config.split(",")), args.rate, args.repeats, "c",
                               learnable=args.learnable, delay_kinds=args.recurrent_delays))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    for config in args.reference:
        for backend in ("c", "torch"):
            rows.append(run_config(*(int(v) for v in config.split(",")), args.rate * INPUTS / 50, args.repeats,
                                   backend, 50, args.learnable, args.recurrent_delays))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "rate": args.rate,
            "repeats": args.repeats, "learnable": args.learnable, "recurrent_delays": args.recurrent_delays,
            "command": "python benchmarks/bench_eventprop_recurrent.py " + " ".join(argv)}
    print(table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"bench_eventprop_recurrent_cpu_{meta['date']}")
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(f"# Recurrent EventProp layers on the CPU, {meta['date']}\n\n"
                    f"{meta['cpu']}, {meta['cores']} cores ({meta['threads']} torch threads), torch {meta['torch']}; "
                    f"`{meta['command'].strip()}`. Current-based LIF, fp64, input spikes with probability "
                    f"{meta['rate']} per input and 1 ms bin; the median of {meta['repeats']} calls after a warm-up. "
                    "The rows of 50 inputs (the torch reference's, and the C kernels' at the same shape) spike "
                    f"{INPUTS / 50:g} times as often.\n\n" + table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
