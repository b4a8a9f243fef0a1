"""Peak memory and time, forward + backward, on a GPU: a standalone LIF layer against SpikingJelly's LIFNode, and
the Open Neuromorphic benchmark's shape (Linear + LIF) against SpikingJelly, snnTorch and Norse.

    python benchmarks/bench_memory.py [--out DIR] [--steps 4 32 64] [--sizes 512 4096 16384] [--layers 1 3]

The input is [T, 64, 65536] (fp32 and fp16, fresh uniform values in [0, 2)), the loss the output's sum.
Peak memory is `torch.cuda.max_memory_allocated()` above what was allocated before the call (the input and the
layer), in units of the input's size, in two ways a training loop holds the output: `held` (the output is
referenced while the backward runs, as when it feeds later layers) and `dropped` (`layer(x).sum().backward()`:
only what autograd saved stays). Time is the median of `triton.testing.do_bench` over forward + backward, each
call on the next of three random inputs (none reads what the previous call left in L2).
flexgen runs with each `recompute` choice ("auto" is the default). Spikes and input gradients are checked
against flexgen's default before anything is recorded. Writes bench_memory.json and bench_memory.md to DIR
(default docs/perf).

The network part is the shape of Open Neuromorphic's SNN library benchmark: `--layers` x (Linear(n, n) + LIF),
batch 16, T 500, input uniform in [0, 1), loss the output's sum, in fp32 and under AMP (autocast to fp16).
Candidates: flexgen (`nn.Linear` + `flexgen.LIF`), SpikingJelly (`nn.Linear` + `LIFNode`, its multi-step
kernels), snnTorch (`Leaky`, reset to zero) and Norse (`LIFBoxCell`, no synaptic current), the last two stepped
in a Python loop with their cell compiled by `torch.compile` once per configuration (the whole loop unrolled over
500 steps does not compile in reasonable time). Every model starts from the same weights (snnTorch's halved:
its `mem = 0.5 mem + W x` is LIF tau 2's `v + (W x - v) / 2`). SpikingJelly computes the same model as flexgen,
so its spikes and weight gradients are compared with flexgen's; for snnTorch (a reset one step later) and Norse
(a strict threshold, another surrogate) the share of equal spikes is reported. Peak memory is above the models
and the input, output dropped; time is do_bench's median over three inputs in turn. Writes
bench_memory_network.{json,md} and, with matplotlib, .png; `--replot JSON` redraws a recorded run without a GPU.
The long-sequence mode's memory against T is `bench_long_sequence.py`'s.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import sys

import torch
import triton
from torch import nn

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


def peak_bytes(step, before=lambda: None):
    """Bytes `step()` allocates at its peak above what was allocated before it, measured on its second call (the
    first one warms: kernels compiled, caches filled); `before()` runs ahead of each call."""
    before()
    step()
    before()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def peak_above_input(layer, x, hold):
    def clear():
        x.grad = None

    peak = peak_bytes(lambda: fwd_bwd(layer, x, hold), clear)
    clear()
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


# ---------------------------------------------------------------- the Open Neuromorphic shape

ON_BATCH, ON_STEPS = 16, 500


def _resettable(model):
    """`model` with `reset()` resetting every stateful neuron in it (flexgen and SpikingJelly layers)."""
    def reset():
        for m in model.modules():
            if m is not model and callable(getattr(m, "reset", None)):
                m.reset()

    model.reset = reset
    return model


class SteppedLoop(nn.Module):
    """Layers of Linear + a neuron cell stepped in a Python loop over T (snnTorch and Norse run this way)."""

    def __init__(self, linears, step, init):
        super().__init__()
        self.linears = nn.ModuleList(linears)
        self.step, self.init = step, init

    def forward(self, x):
        states = [self.init(x[0]) for _ in self.linears]
        out = []
        for t in range(x.shape[0]):
            h = x[t]
            for k, linear in enumerate(self.linears):
                h, states[k] = self.step(k, linear(h), states[k])
            out.append(h)
        return torch.stack(out)

    def reset(self):
        pass


def network_candidates(n, layers):
    """name -> (a fresh model on the GPU, whether its spikes and gradients should equal flexgen's)."""
    torch.manual_seed(n + layers)
    linears = [nn.Linear(n, n) for _ in range(layers)]

    def copies(scale=1.0):
        made = [nn.Linear(n, n) for _ in range(layers)]
        for new, old in zip(made, linears):
            new.load_state_dict({k: v * scale for k, v in old.state_dict().items()})
        return made

    def sequential(neuron):
        return _resettable(nn.Sequential(*[m for lin in copies() for m in (lin, neuron())]).cuda())

    made = {"flexgen Linear + LIF": (sequential(lambda: flexgen.LIF(step_mode="m")), True)}
    try:
        from spikingjelly.activation_based import neuron as sj
    except ImportError:
        print("SpikingJelly is not installed", file=sys.stderr)
    else:
        made["SpikingJelly Linear + LIFNode"] = (sequential(lambda: sj.LIFNode(step_mode="m")), True)
    try:
        import snntorch
    except ImportError:
        print("snnTorch is not installed", file=sys.stderr)
    else:
        cells = [torch.compile(snntorch.Leaky(beta=0.5, reset_mechanism="zero").cuda(), dynamic=False)
                 for _ in range(layers)]
        made["snnTorch Leaky (compiled step)"] = (SteppedLoop(
            copies(0.5), lambda k, cur, mem: cells[k](cur, mem), torch.zeros_like).cuda(), False)
    try:
        import norse.torch as norse
    except ImportError:
        print("Norse is not installed", file=sys.stderr)
    else:
        from norse.torch.functional.lif_box import LIFBoxFeedForwardState, lif_box_feed_forward_step

        p = norse.LIFBoxParameters(tau_mem_inv=torch.tensor(500.0, device="cuda"),
                                   v_leak=torch.tensor(0.0, device="cuda"), v_th=torch.tensor(1.0, device="cuda"),
                                   v_reset=torch.tensor(0.0, device="cuda"))

        @torch.compile(dynamic=False)
        def norse_step(cur, v):  # (dynamo cannot take Norse's state tuple as an input: the membrane alone)
            spikes, state = lif_box_feed_forward_step(cur, LIFBoxFeedForwardState(v), p, 0.001)
            return spikes, state.v

        made["Norse LIFBoxCell (compiled step)"] = (SteppedLoop(
            copies(), lambda k, cur, v: norse_step(cur, v), torch.zeros_like).cuda(), False)
    return made


def network_step(model, x, amp):
    model.reset()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
        out = model(x)
    out.float().sum().backward()
    return out


def network_peak_mib(model, x, amp):
    return peak_bytes(lambda: network_step(model, x, amp)) / 2**20


def measure_network(n, layers, amp):
    g = torch.Generator(device="cuda").manual_seed(n)
    inputs = [torch.rand(ON_STEPS, ON_BATCH, n, device="cuda", generator=g) for _ in range(3)]
    rows, reference = [], None
    for name, (model, same_model) in network_candidates(n, layers).items():
        out = network_step(model, inputs[0], amp).detach()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        if reference is None:
            reference = out, grads
        agree = {"spikes_agree": round(float((out == reference[0]).float().mean()), 6)}
        if same_model:  # the same weights, model and surrogate: the weight gradients agree to rounding
            agree["grad_max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max())
                                             for a, b in zip(grads, reference[1]))
        peak = network_peak_mib(model, inputs[0], amp)
        calls = iter(range(1 << 62))
        ms = triton.testing.do_bench(lambda: network_step(model, inputs[next(calls) % 3], amp), return_mode="median")
        rows.append({"n": n, "layers": layers, "precision": "AMP fp16" if amp else "fp32", "candidate": name,
                     "peak_mib": round(peak, 1), "fwd_bwd_ms": round(ms, 3), **agree})
        print(rows[-1], flush=True)
    return rows


def network_table(results):
    lines = ["| layers | n | precision | candidate | peak above model + input, MiB | fwd+bwd ms | equal spikes | "
             "weight grads, max rel. diff |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        grad = f"{r['grad_max_rel_diff']:.1e}" if "grad_max_rel_diff" in r else "(another model)"
        lines.append(f"| {r['layers']} | {r['n']} | {r['precision']} | {r['candidate']} | {r['peak_mib']:.1f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {100 * r['spikes_agree']:.2f} % | {grad} |")
    return "\n".join(lines)


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
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--only", choices=["standalone", "network"], help="run one part")
    parser.add_argument("--replot", metavar="JSON",
                        help="redraw the table and plot of a recorded network run (bench_memory_network.json; no GPU needed)")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            recorded = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        write_network_results(args.out, recorded["meta"], recorded["results"])
        return 0
    if not torch.cuda.is_available():
        print("bench_memory needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.only != "standalone":
        run_network_part(args, argv)
    if args.only == "network":
        return 0
    results = [dict(dtype=name, steps=steps, **row) for name, dtype in DTYPES.items() for steps in args.steps
               for row in measure(dtype, steps)]
    sj_version = _version("spikingjelly")
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


def run_network_part(args, argv):
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__,
            **{p: _version(p) for p in ("spikingjelly", "snntorch", "norse")},
            "command": "python benchmarks/bench_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "shape": [ON_STEPS, ON_BATCH, None]}
    os.makedirs(args.out, exist_ok=True)
    results = []
    for layers in args.layers:
        for n in args.sizes:
            for amp in (False, True):
                results += measure_network(n, layers, amp)
                write_network_results(args.out, meta, results)  # after each configuration: a cut run keeps its rows
    print(network_table(results))


def plot_network(meta, results, path):
    """Peak memory and time against n, one column per precision, one row per depth, log scales (matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    depths = sorted({r["layers"] for r in results})
    precisions = list(dict.fromkeys(r["precision"] for r in results))
    fig, axes = plt.subplots(2 * len(depths), len(precisions), figsize=(5.5 * len(precisions), 4.2 * 2 * len(depths)),
                             squeeze=False)
    for col, precision in enumerate(precisions):
        for d, layers in enumerate(depths):
            rows = [r for r in results if r["precision"] == precision and r["layers"] == layers]
            for k, (key, label) in enumerate((("peak_mib", "peak above model + input, MiB"),
                                              ("fwd_bwd_ms", "forward + backward, ms"))):
                ax = axes[2 * d + k][col]
                for name in dict.fromkeys(r["candidate"] for r in rows):
                    points = sorted((r["n"], r[key]) for r in rows if r["candidate"] == name)
                    ax.plot(*zip(*points), "o-" if name.startswith("flexgen") else "s:", label=name,
                            linewidth=2.5 if name.startswith("flexgen") else 1.2)
                ax.set(xscale="log", yscale="log", xlabel="n", ylabel=label,
                       title=f"{layers} x (Linear + LIF), {precision}")
                ax.grid(True, which="both", alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.suptitle(f"{meta['gpu']}: Linear + LIF, batch {ON_BATCH}, T {ON_STEPS}")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_network_results(out, meta, results):
    with open(os.path.join(out, "bench_memory_network.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out, "bench_memory_network.md"), "w") as f:
        f.write(f"# Linear + LIF at the Open Neuromorphic benchmark's shape: peak memory and time\n\n{meta['gpu']}, "
                f"{meta['date']}, torch {meta['torch']}, Triton {meta['triton']}, SpikingJelly {meta['spikingjelly']}, "
                f"snnTorch {meta['snntorch']}, Norse {meta['norse']}. `{meta['command']}`.\nInput [{ON_STEPS}, "
                f"{ON_BATCH}, n]; forward + backward of the output's sum.\n\n" + network_table(results) + "\n")
    plot_network(meta, results, os.path.join(out, "bench_memory_network.png"))


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
