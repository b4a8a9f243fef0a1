"""Peak memory and time of a standalone LIF layer, forward + backward, against SpikingJelly's LIFNode, on a GPU.

    python benchmarks/bench_memory.py [--out DIR] [--steps 4 32 64]

The input is [T, 64, 65536] (fp32 and fp16, fresh uniform values in [0, 2)), the loss the output's sum.
Peak memory is `torch.cuda.max_memory_allocated()` above what was allocated before the call (the input and the
layer), in units of the input's size, in two ways a training loop holds the output: `held` (the output is
referenced while the backward runs, as when it feeds later layers) and `dropped` (`layer(x).sum().backward()`:
only what autograd saved stays). Time is the median of `triton.testing.do_bench` over forward + backward, each
call on the next of three random inputs (none reads what the previous call left in L2).
flexgen runs with each `recompute` choice ("auto" is the default). Spikes and input gradients are checked
against flexgen's default before anything is recorded. Writes bench_memory.json and bench_memory.md to DIR
(default docs/perf).

This is the standalone-neuron part of the memory benchmark (issue: "Memory: never above SpikingJelly"); the
Open Neuromorphic shape, snnTorch, Norse and the long-sequence mode are not in it yet.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexgen  # noqa: E402

BATCH, NEURONS = 64, 65536
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def candidates():
    """name -> a fresh layer (multi-step, LIF tau 2, hard reset to 0, threshold 1: the defaults of both)."""
    layers = {f"flexgen.LIF recompute={rc}": (lambda rc=rc: flexgen.LIF(step_mode="m", recompute=rc))
              for rc in ("auto", False, True)}
    try:
        from spikingjelly.activation_based import neuron
    except ImportError:
        print("SpikingJelly is not installed: flexgen only", file=sys.stderr)
    else:
        layers["SpikingJelly LIFNode"] = lambda: neuron.LIFNode(step_mode="m")
    return layers


def fwd_bwd(layer, x, hold):
    layer.reset()
    if hold:
        out = layer(x)
        out.sum().backward()
        return out
    layer(x).sum().backward()
    return None


def peak_above_input(layer, x, hold):
    fwd_bwd(layer, x, hold)  # warm: kernels compiled, caches filled
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(layer, x, hold)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    x.grad = None
    return peak / (x.numel() * x.element_size())


def spikes_and_grad(layer, x):
    layer.reset()
    out = layer(x)
    (grad,) = torch.autograd.grad(out.float().sum(), x)
    return out.detach(), grad


def measure(dtype, steps):
    g = torch.Generator(device="cuda").manual_seed(steps)
    x = (2.0 * torch.rand(steps, BATCH, NEURONS, device="cuda", generator=g)).to(dtype).requires_grad_()
    rows, reference = [], None
    for name, make in candidates().items():
        layer = make().cuda()
        spikes, grad = spikes_and_grad(layer, x)
        if reference is None:
            reference = spikes, grad
        agree = {"spikes_equal": bool(torch.equal(spikes, reference[0])),
                 "grad_max_abs_diff": float((grad - reference[1]).abs().max())}
        held = peak_above_input(layer, x, hold=True)
        dropped = peak_above_input(layer, x, hold=False)
        fresh = [x] + [(2.0 * torch.rand(x.shape, device="cuda", generator=g)).to(dtype).requires_grad_() for _ in range(2)]
        ms = median_ms(layer, fresh)
        rows.append({"candidate": name, "peak_held": round(held, 3), "peak_dropped": round(dropped, 3),
                     "fwd_bwd_ms": round(ms, 4), **agree})
        print(f"{dtype} T={steps} {name}: held {held:.3f}, dropped {dropped:.3f}, {ms:.3f} ms, {agree}", flush=True)
    return rows


def median_ms(layer, inputs):
    """do_bench's median of forward + backward, each call on the next of `inputs`."""
    calls = iter(range(1 << 62))
    ms = triton.testing.do_bench(lambda: fwd_bwd(layer, inputs[next(calls) % len(inputs)], hold=False),
                                 return_mode="median")
    for x in inputs:
        x.grad = None
    return ms


def table(results):
    lines = ["| dtype | T | candidate | peak, output held | peak, output dropped | fwd+bwd ms | spikes = flexgen's |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['dtype']} | {r['steps']} | {r['candidate']} | {r['peak_held']:.3f} | "
                     f"{r['peak_dropped']:.3f} | {r['fwd_bwd_ms']:.3f} | {'yes' if r['spikes_equal'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 32, 64])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_memory needs a CUDA GPU", file=sys.stderr)
        return 2
    results = [dict(dtype=name, steps=steps, **row) for name, dtype in DTYPES.items() for steps in args.steps
               for row in measure(dtype, steps)]
    try:
        sj_version = importlib.metadata.version("spikingjelly")
    except importlib.metadata.PackageNotFoundError:
        sj_version = None
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "spikingjelly": sj_version,
            "command": "python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "shape": [None, BATCH, NEURONS], "unit": "peak memory above the input, in units of the input's size"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_memory.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(args.out, "bench_memory.md"), "w") as f:
        f.write(f"# Standalone LIF, forward + backward: peak memory and time\n\n{meta['gpu']}, {meta['date']}, torch "
                f"{meta['torch']}, Triton {meta['triton']}, SpikingJelly {sj_version}. `{meta['command']}`.\n"
                f"Input [T, {BATCH}, {NEURONS}]; peak memory above the input in units of the input's size.\n\n"
                + table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
