"""Exact LIF from its equations (flexgen.ode) against the hand-discretised LIF (flexgen.LIF), on a GPU.

    python benchmarks/bench_ode.py [--out DIR] [--quick]

The two layers compute the same neuron: tau dv/dt = -(v - v_reset) + x integrated exactly over dt is
SpikingJelly's charge with 1/tau_sj = 1 - exp(-dt/tau). flexgen derives the first from the equations
at generation time, so both kernels should move the same bytes and take the same time. Forward +
backward (training) and forward (inference) times are medians of three `triton.testing.do_bench`
medians, the two layers timed in turn, each call on the next of three fresh random inputs (so no run
reads an input the previous one left in L2). Writes bench_ode.json and bench_ode.md to DIR (default
docs/perf).
"""
import argparse
import json
import math
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexgen  # noqa: E402
from flexgen.neurons import continuous  # noqa: E402

N, C = 64, 65536
TAU, DT = 4.0, 1.0
ROUNDS = 3


def layers():
    """name -> layer; both start from v = 0 and keep the final state, as every flexgen layer does."""
    tau_sj = 1.0 / (1.0 - math.exp(-DT / TAU))
    return {
        "flexgen.LIF (hand-discretised)": flexgen.LIF(tau=tau_sj, step_mode="m"),
        "flexgen.ode exact LIF": continuous.lif(tau=TAU, dt=DT),
    }


def cycling(inputs):
    """A function returning the next of `inputs` at every call."""
    state = {"k": 0}

    def next_input():
        state["k"] = (state["k"] + 1) % len(inputs)
        return inputs[state["k"]]

    return next_input


def time_layer(layer, next_input, training):
    def run():
        layer.reset()
        x = next_input()
        if training:
            layer(x).sum().backward()
        else:
            with torch.no_grad():
                layer(x)

    return triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")


def check_same_kernels():
    """Both layers' kernels load as often per step and store as often (hyper-parameters, of which the exact LIF
    has more, are read once before the time loop)."""
    exact, hand = continuous.lif, flexgen.LIF.spec
    for kind in ("forward", "inference", "backward", "forward_recompute", "backward_recompute"):
        a, b = exact.source(kind), hand.source(kind)
        counts = {"tl.load( per step": [s.split("    for ", 1)[1].count("tl.load(") for s in (a, b)],
                  "tl.store(": [s.count("tl.store(") for s in (a, b)]}
        for op, (n_exact, n_hand) in counts.items():
            if n_exact != n_hand:
                print(f"# warning: {kind} has {n_exact} {op} in the exact LIF, {n_hand} in flexgen.LIF")


def spike_mismatch(cands, x):
    """The fraction of spikes on which the two layers differ (rounding near the threshold only)."""
    spikes = []
    with torch.no_grad():
        for layer in cands.values():
            layer.reset()
            spikes.append(layer(x))
    return (spikes[0] != spikes[1]).float().mean().item()


def run(Ts, dtypes):
    results = []
    cands = layers()
    check_same_kernels()
    for dtype in dtypes:
        for T in Ts:
            inputs = [(torch.rand(T, N, C, device="cuda", dtype=dtype) * 2.0).requires_grad_() for _ in range(3)]
            mismatch = spike_mismatch(cands, inputs[0])
            times = {name: {"train_ms": [], "infer_ms": []} for name in cands}
            for _ in range(ROUNDS):
                for name, layer in cands.items():
                    for mode, training in (("train_ms", True), ("infer_ms", False)):
                        times[name][mode].append(time_layer(layer, cycling(inputs), training))
            for name, t in times.items():
                row = {"impl": name, "T": T, "dtype": str(dtype).split(".")[-1], "spike_mismatch": mismatch}
                row.update({mode: statistics.median(ms) for mode, ms in t.items()})
                results.append(row)
                print(json.dumps(row))
    return results


def markdown(results, device):
    lines = [f"# Exact LIF (flexgen.ode) vs flexgen.LIF on {device}", "",
             f"[T, {N}, {C}] inputs, tau = {TAU}, dt = {DT}; ms, median of {ROUNDS} do_bench medians.", "",
             "| dtype | T | layer | train (fwd+bwd) | inference | spikes differing |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['T']} | {r['impl']} | {r['train_ms']:.3f} | {r['infer_ms']:.3f} | {r['spike_mismatch']:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    parser.add_argument("--quick", action="store_true", help="T=8 fp16 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_ode needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    Ts, dtypes = ([8], [torch.float16]) if args.quick else ([8, 32], [torch.float16, torch.float32])
    results = run(Ts, dtypes)
    device = torch.cuda.get_device_name()
    os.makedirs(args.out, exist_ok=True)
    meta = {"gpu": device, "torch": torch.__version__, "triton": triton.__version__,
            "command": "python benchmarks/bench_ode.py " + " ".join(sys.argv[1:]), "results": results}
    with open(os.path.join(args.out, "bench_ode.json"), "w") as f:
        json.dump(meta, f, indent=1)
    text = markdown(results, device)
    with open(os.path.join(args.out, "bench_ode.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
