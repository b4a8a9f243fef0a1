"""Long sequences: peak memory and time of a 3-layer network at SHD's shapes, forward + backward, on a GPU.

    python benchmarks/bench_long_sequence.py [--out DIR] [--steps 100 1000 5000 10000] [--every 128 512]
                                             [--budget 256] [--networks recurrent feed-forward]

Networks: 700 input spikes -> 3 x 512 neurons, batch 32, fp32; every layer a `flexgen.Dense` (dense synapses
feeding LIF neurons, tau 2), feed-forward or with a recurrent cell (`flexgen.Recurrent`, LIF, fused kernels),
run as a `flexgen.Chain`. Candidates: flexgen's default path (autograd keeps what the products and the cells
save); every layer in its own long-sequence mode (`Dense(checkpoint_every=K)`, the largest K given: each layer
keeps its input spikes as bits and its states every K steps); the whole chain in the long-sequence mode
(`Chain(checkpoint_every=K)`: the input and every layer's states every K steps); the chain under a memory budget
(`Chain(memory_budget=N MiB)`: the default path where it fits, else the K it chooses, shown in the table); for the
feed-forward network
also SpikingJelly (`nn.Linear` + `LIFNode`, multi-step, its Triton kernels) and, up to T = 1,000, snnTorch
(`nn.Linear` + `Leaky`, a Python loop over the steps).

Inputs are fresh spikes (rate 0.1); weights are drawn so that every layer fires (the recurrent weights at a
quarter of the input weights' scale: at the same scale the gradients through 5,000 steps overflow); the loss is the
last layer's output sum. Memory, in MiB above what was allocated before the call (model and input): what the
forward keeps for the backward besides its output (allocated after the forward, less the output), and the peak of
forward + backward (`torch.cuda.max_memory_allocated()`). Time is `triton.testing.do_bench`'s median of forward + backward
over three cycling inputs. The long-sequence modes' gradients are checked against the default path's before
anything is recorded (finite, and within 1e-4 of each parameter's largest gradient; the table gives the largest
difference).
Writes bench_long_sequence.json, .md and (with matplotlib) .png to DIR (default docs/perf); `--replot JSON`
redraws the table and plot of a recorded run.
"""
import argparse
import datetime
import importlib.metadata
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexgen  # noqa: E402

INPUTS, HIDDEN, LAYERS, BATCH, RATE = 700, 512, 3, 32, 0.1
SNNTORCH_MAX_STEPS = 1000
RECURRENT_GAIN = 0.5


def _init(weight, fan_in, gain=2.0):
    """Weights with which a layer driven at RATE fires: the current's spread about `gain` / 2 thresholds."""
    with torch.no_grad():
        weight.normal_(0.0, gain / math.sqrt(fan_in * RATE))


def flexgen_layers(recurrent, every=None):
    layers = []
    for i in range(LAYERS):
        fan_in = INPUTS if i == 0 else HIDDEN
        cell = flexgen.Recurrent(flexgen.LIF, hidden=HIDDEN) if recurrent else flexgen.LIF()
        layer = flexgen.Dense(fan_in, HIDDEN, cell, checkpoint_every=every)
        _init(layer.weight, fan_in)
        if recurrent:  # at the input weights' scale the gradients through time overflow to inf by T = 5,000
            _init(cell.weight, HIDDEN, RECURRENT_GAIN)
        layers.append(layer)
    return layers


def spikingjelly_net():
    from spikingjelly.activation_based import functional, neuron

    def lif():
        try:  # SpikingJelly 2.0 picks its Triton multi-step kernel itself; older versions took backend="triton"
            return neuron.LIFNode(step_mode="m", backend="triton")
        except TypeError:
            return neuron.LIFNode(step_mode="m")

    layers = []
    for i in range(LAYERS):
        linear = torch.nn.Linear(INPUTS if i == 0 else HIDDEN, HIDDEN)
        _init(linear.weight, linear.in_features)
        layers += [linear, lif()]
    net = torch.nn.Sequential(*layers)
    return net, lambda: functional.reset_net(net)


class SnnTorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        import snntorch

        self.linears = torch.nn.ModuleList(torch.nn.Linear(INPUTS if i == 0 else HIDDEN, HIDDEN) for i in range(LAYERS))
        for linear in self.linears:
            _init(linear.weight, linear.in_features)
        self.neurons = torch.nn.ModuleList(snntorch.Leaky(beta=0.5, reset_mechanism="zero") for _ in range(LAYERS))

    def forward(self, x):
        for linear, lif in zip(self.linears, self.neurons):
            mem = lif.init_leaky()
            current, out = linear(x), []
            for t in range(x.shape[0]):
                spk, mem = lif(current[t], mem)
                out.append(spk)
            x = torch.stack(out)
        return x


def candidates(recurrent, steps, everies, budgets=()):
    """name -> (model, reset or None), made on the CPU."""
    made = {"flexgen default path": (flexgen.Chain(*flexgen_layers(recurrent)), None)}
    made[f"flexgen Dense checkpoint_every={max(everies)}"] = (flexgen.Chain(*flexgen_layers(recurrent, max(everies))),
                                                              None)
    for every in everies:
        made[f"flexgen Chain checkpoint_every={every}"] = (flexgen.Chain(*flexgen_layers(recurrent),
                                                                         checkpoint_every=every), None)
    for budget in budgets:
        made[f"flexgen Chain memory_budget={budget}MiB"] = (flexgen.Chain(*flexgen_layers(recurrent),
                                                                          memory_budget=f"{budget}MiB"), None)
    if recurrent:
        return made
    try:
        made["SpikingJelly Linear + LIFNode"] = spikingjelly_net()
    except ImportError:
        print("SpikingJelly is not installed: left out", file=sys.stderr)
    if steps <= SNNTORCH_MAX_STEPS:
        try:
            made["snnTorch Linear + Leaky"] = (SnnTorchNet(), None)
        except ImportError:
            print("snnTorch is not installed: left out", file=sys.stderr)
    return made


def fwd_bwd(model, reset, x):
    if reset is not None:
        reset()
    model(x).sum().backward()


def memory_mb(model, reset, x):
    """(what the forward keeps for the backward beside its output, peak of forward + backward), MiB above the
    model and the input."""
    fwd_bwd(model, reset, x)  # warm: kernels compiled, caches filled
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if reset is not None:
        reset()
    out = model(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    out.sum().backward()
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    return kept / 2**20, peak / 2**20


def median_ms(model, reset, inputs):
    calls = iter(range(1 << 62))
    ms = triton.testing.do_bench(lambda: fwd_bwd(model, reset, inputs[next(calls) % len(inputs)]),
                                 return_mode="median")
    model.zero_grad(set_to_none=True)
    return ms


def grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    result = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return result


def measure(recurrent, steps, everies, budgets=()):
    g = torch.Generator(device="cuda").manual_seed(steps)
    inputs = [(torch.rand(steps, BATCH, INPUTS, device="cuda", generator=g) < RATE).float() for _ in range(3)]
    made = candidates(recurrent, steps, everies, budgets)
    reference = None  # the default path, made first: the others' gradients are checked against its gradients
    rows = []
    for name, (model, reset) in made.items():
        model = model.cuda()
        checked = name.startswith("flexgen") and reference is not None
        if checked:
            model.load_state_dict(reference.state_dict())
        try:
            err = check_grads(name, model, reference, inputs[0]) if checked else None
            row = measure_one(model, reset, inputs)
        except flexgen.layers.budget.MemoryBudgetError as exc:  # a budget too small for this T: said, not measured
            print(f"{name}, T = {steps}: {exc}", file=sys.stderr)
            continue
        finally:
            torch.cuda.empty_cache()
        row = {"network": "recurrent" if recurrent else "feed-forward", "steps": steps, "candidate": name, **row}
        if err is not None:
            row["grad_rel_err"] = err
        if getattr(model, "memory_budget", None) is not None:
            row["checkpoint_choice"] = model.checkpoint_choice
        rows.append(row)
        print(row, flush=True)
        if reference is None:
            reference = model
    return rows


def check_grads(name, model, reference, x):
    """The largest difference of `model`'s parameter gradients from the default path's, relative to each one's
    largest magnitude; an error where one is not finite or the difference exceeds 1e-4."""
    want, got = grads(reference, x), grads(model, x)
    if not all(bool(g.isfinite().all()) for g in want):
        raise AssertionError("the default path's gradients are not finite: the benchmark's weights need rescaling")
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(got, want))
    if not err <= 1e-4:  # NaN too
        raise AssertionError(f"{name}: gradients differ from the default path's by {err:.2e} (relative)")
    return err


def measure_one(model, reset, inputs):
    with torch.no_grad():
        rate = float(model(inputs[0]).mean()) if reset is None else (reset(), float(model(inputs[0]).mean()))[1]
    kept, peak = memory_mb(model, reset, inputs[0])
    ms = median_ms(model, reset, inputs)
    return {"kept_mb": round(kept, 1), "peak_mb": round(peak, 1), "fwd_bwd_ms": round(ms, 3),
            "output_rate": round(rate, 4)}


def table(results):
    """The rows, each with its kept memory, peak and time as fractions or multiples of the default path's (same
    network and T)."""
    lines = ["| network | T | candidate | kept for the backward, MiB | peak, MiB | fwd+bwd ms | kept / default | "
             "peak / default | time / default | output spike rate | gradients vs default |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    default = {(r["network"], r["steps"]): r for r in results if r["candidate"] == "flexgen default path"}
    for r in results:
        base = default.get((r["network"], r["steps"]))
        ratios = ["", "", ""] if base is None else [
            f"{r['kept_mb'] / base['kept_mb']:.3f}", f"{r['peak_mb'] / base['peak_mb']:.3f}",
            f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x"]
        lines.append(f"| {r['network']} | {r['steps']} | {_candidate(r)} | {r['kept_mb']:.1f} | {r['peak_mb']:.1f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {' | '.join(ratios)} | {r['output_rate']:.3f} | "
                     f"{'' if r.get('grad_rel_err') is None else format(r['grad_rel_err'], '.1e')} |")
    return "\n".join(lines)


def _candidate(row):
    """The candidate's name, and under a budget what it chose."""
    if "checkpoint_choice" not in row:
        return row["candidate"]
    chose = "the default path" if row["checkpoint_choice"] is None else f"K = {row['checkpoint_choice']}"
    return f"{row['candidate']} (chose {chose})"


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def plot(meta, results, path):
    """Peak memory and time against T, one column per network, log scales (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    networks = list(dict.fromkeys(r["network"] for r in results))
    panels = (("peak_mb", "peak memory of forward + backward, MiB"), ("fwd_bwd_ms", "forward + backward, ms"))
    fig, axes = plt.subplots(len(panels), len(networks), figsize=(5.5 * len(networks), 8), squeeze=False)
    for col, network in enumerate(networks):
        rows = [r for r in results if r["network"] == network]
        for row, (key, label) in enumerate(panels):
            ax = axes[row][col]
            for name in dict.fromkeys(r["candidate"] for r in rows):
                points = sorted((r["steps"], r[key]) for r in rows if r["candidate"] == name)
                ax.plot(*zip(*points), "o-" if name.startswith("flexgen") else "s:", label=name,
                        linewidth=2.5 if "Chain" in name else 1.2)
            ax.set(xscale="log", yscale="log", xlabel="T (steps)", ylabel=label, title=f"{network} network")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.suptitle(f"{meta['gpu']}: {meta['network']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(meta, results, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_long_sequence.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out, "bench_long_sequence.md"), "w") as f:
        f.write(f"# Long sequences: a 3-layer network at SHD's shapes, forward + backward\n\n{meta['gpu']}, {meta['date']}, "
                f"torch {meta['torch']}, Triton {meta['triton']}, SpikingJelly {meta['spikingjelly']}, snnTorch "
                f"{meta['snntorch']}. `{meta['command']}`.\n{meta['network']}.\n\n" + table(results) + "\n")
    plot(meta, results, os.path.join(out, "bench_long_sequence.png"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000, 5000, 10000])
    parser.add_argument("--every", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--budget", type=int, nargs="*", default=[256], help="memory budgets of a Chain, MiB")
    parser.add_argument("--networks", nargs="+", choices=("recurrent", "feed-forward"),
                        default=["recurrent", "feed-forward"])
    parser.add_argument("--replot", metavar="JSON", help="redraw the table and plot of a recorded run (no GPU needed)")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            recorded = json.load(f)
        write_outputs(recorded["meta"], recorded["results"], args.out)
        return 0
    if not torch.cuda.is_available():
        print("bench_long_sequence needs a CUDA GPU", file=sys.stderr)
        return 2
    results = [row for recurrent in [n == "recurrent" for n in args.networks] for steps in args.steps
               for row in measure(recurrent, steps, args.every, args.budget)]
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "spikingjelly": _version("spikingjelly"),
            "snntorch": _version("snntorch"),
            "command": "python benchmarks/bench_long_sequence.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "network": f"{INPUTS} -> {LAYERS} x {HIDDEN}, batch {BATCH}, fp32, input spike rate {RATE}"}
    write_outputs(meta, results, args.out)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
