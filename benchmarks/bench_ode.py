"""Exact LIF from its equations (flexgen.ode) against the hand-discretised LIF (flexgen.LIF), on a GPU.

    python benchmarks/bench_ode.py [--out DIR] [--quick]

The two layers compute the same neuron: tau dv/dt = -(v - v_reset) + x integrated exactly over dt is
SpikingJelly's charge with 1/tau_sj = 1 - exp(-dt/tau). flexgen derives the first from the equations
at generation time, so both kernels should move the same bytes and take the same time. Forward +
backward (training) and forward (inference) times are medians of three `triton.testing.do_bench`
medians, the two layers timed in turn, each call on the next of three fresh random inputs (so no run
reads an input the previous one left in L2). Those times include the host's work per call; the bar is
about the kernels, so each layer's generated kernels are also timed alone (torch.profiler's device
time per call, summed over the kernels whose names start with the spec's name). Writes bench_ode.json
and bench_ode.md to DIR (default docs/perf).
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
    """name -> (layer, the prefix of its kernels' names); both start from v = 0 and keep the final state."""
    tau_sj = 1.0 / (1.0 - math.exp(-DT / TAU))
    return {
        "flexgen.LIF (hand-discretised)": (flexgen.LIF(tau=tau_sj, step_mode="m"), "lif_step_"),
        "flexgen.ode exact LIF": (continuous.lif(tau=TAU, dt=DT), "lif_"),
    }


def cycling(inputs):
    """A function returning the next of `inputs` at every call."""
    state = {"k": 0}

    def next_input():
        state["k"] = (state["k"] + 1) % len(inputs)
        return inputs[state["k"]]

    return next_input


def one_call(layer, next_input, training):
    """A function running the layer once from v = 0 on the next input: forward + backward, or inference."""
    def run():
        layer.reset()
        x = next_input()
        if training:
            layer(x).sum().backward()
        else:
            with torch.no_grad():
                layer(x)

    return run


def time_layer(layer, next_input, training):
    return triton.testing.do_bench(one_call(layer, next_input, training), warmup=25, rep=200, return_mode="median")


def device_us(event):
    """An averaged profiler event's device time in µs (older torch releases name it self_cuda_time_total)."""
    total = getattr(event, "self_device_time_total", None)
    return total if total is not None else event.self_cuda_time_total


def kernel_us(layer, kernel_prefix, next_input, training, calls=20):
    """µs per call that the layer's own generated kernels run on the GPU (no host time, no `sum()`)."""
    from torch.profiler import ProfilerActivity, profile

    run = one_call(layer, next_input, training)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    ours = [e for e in prof.key_averages() if e.key.startswith(kernel_prefix)]
    if not ours:
        raise RuntimeError(f"no kernel named {kernel_prefix}* in the profile: {[e.key for e in prof.key_averages()]}")
    return sum(device_us(e) for e in ours) / calls


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
        for layer, _ in cands.values():
            layer.reset()
            spikes.append(layer(x))
    return (spikes[0] != spikes[1]).float().mean().item()


MODES = (("train", True), ("infer", False))


def measure_all(cands, inputs, measure, unit):
    """{layer name: {"<mode>_<unit>": median over the rounds}}; the layers and modes interleaved in every round."""
    times = {name: {f"{mode}_{unit}": [] for mode, _ in MODES} for name in cands}
    for _ in range(ROUNDS):
        for name, (layer, prefix) in cands.items():
            for mode, training in MODES:
                times[name][f"{mode}_{unit}"].append(measure(layer, prefix, cycling(inputs), training))
    return {name: {key: statistics.median(values) for key, values in t.items()} for name, t in times.items()}


def run(Ts, dtypes):
    cands = layers()
    check_same_kernels()
    points = [(dtype, T) for dtype in dtypes for T in Ts]
    inputs = {p: [(torch.rand(p[1], N, C, device="cuda", dtype=p[0]) * 2.0).requires_grad_() for _ in range(3)]
              for p in points}
    rows = {}
    for point in points:
        dtype, T = point
        for name in cands:
            rows[point, name] = {"impl": name, "T": T, "dtype": str(dtype).split(".")[-1],
                                 "spike_mismatch": spike_mismatch(cands, inputs[point][0])}
    # every call timing before the first profile: a profiler session slows the launches after it
    for unit, measure in (("ms", lambda layer, _, nxt, training: time_layer(layer, nxt, training)),
                          ("kernel_us", kernel_us)):
        for point in points:
            for name, values in measure_all(cands, inputs[point], measure, unit).items():
                rows[point, name].update(values)
    for row in rows.values():
        print(json.dumps(row))
    return list(rows.values())


def markdown(results, device):
    lines = [f"# Exact LIF (flexgen.ode) vs flexgen.LIF on {device}", "",
             f"[T, {N}, {C}] inputs, tau = {TAU}, dt = {DT}. Call: ms per call with the host's work, median of "
             f"{ROUNDS} do_bench medians. Kernels: µs per call of the layer's generated kernels alone "
             "(torch.profiler device time, median of the rounds).", "",
             "| dtype | T | layer | train call ms | train kernels µs | inference call ms | inference kernels µs "
             "| spikes differing |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['T']} | {r['impl']} | {r['train_ms']:.3f} | {r['train_kernel_us']:.1f} "
                     f"| {r['infer_ms']:.3f} | {r['infer_kernel_us']:.1f} | {r['spike_mismatch']:.1e} |")
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
