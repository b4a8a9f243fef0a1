"""Delay lines fused into the generated kernels, forward + backward on a GPU: a neuron layer with per-channel
delays on its input against the `Delay` layer run before the neuron, and a recurrent layer with per-neuron delays
in its feedback against the same layer without delays and step by step.

    python benchmarks/bench_delay_line.py [--out DIR] [--steps 250 1000] [--batch 32 256] [--max-delay 25 250]
                                          [--hidden 256] [--no-layer] [--interpolation linear gaussian]
                                          [--sigma 2] [--merge JSON] [--per-synapse]

Layer: 700 channels (SHD's inputs) of LIF neurons (tau 2), fp32, input spikes at rate 0.05, learnable fractional
delays drawn uniformly over [0, max_delay]. Candidates: `flexgen.LIF(step_mode="m", delay=flexgen.Delay(...))`
on the GPU (the delay line in the kernels' time loop: "fused"); `torch.nn.Sequential(flexgen.Delay(...),
flexgen.LIF(step_mode="m"))`, the same delays as the `Delay` layer's two shifted reads before the neuron ("delay
layer, then LIF"); and the LIF layer without delays, for what the delays add. No other library has delays inside
its neuron layers.

Time: `triton.testing.do_bench`'s median of forward + backward (a fresh random output gradient), over three
cycling inputs; the floor is the fused design's bytes (forward: read the input, write spikes and the saved h;
backward: read h, the input and the output gradient, write the input gradient; 28 bytes per neuron and step in
fp32) over the copy bandwidth measured in the same run. Memory: the peak of forward + backward in MiB above the
input and the layer. The fused layer's spikes and gradients are checked against the delay layer's before
anything is recorded.

Recurrent: `flexgen.Recurrent(flexgen.LIF, hidden=H, delay=flexgen.Delay(H, max_delay))` (fused: the kernels read
each neuron's delayed outputs in their time loop), the same layer without delays, and the delayed layer on its
step-by-step path (one matrix product and one neuron step per step, the delay lines as torch operations), inputs
[T, B, H] of fresh random currents, fp32 (TF32 products where torch allows them); the fused layer's spikes are
compared with the step-by-step path's over the sequence and its gradients over the first 16 steps (both recorded).
`--interpolation linear gaussian` measures both layers with gaussian taps of width `--sigma` steps too (fused:
the kernels read every step of the line, each weighed by its channel's tap; the delay layer convolves). Writes
bench_delay_line.json and .md to DIR (default docs/perf); `--replot JSON` redraws the table of a recorded run.

`--per-synapse` measures recurrent layers with a delay per synapse of the feedback instead,
`delay=flexgen.SynapseDelay(H, max_delay)` (fused: each step's product sums max_delay + 1 tap matrices' products
with the outputs of the last max_delay + 1 steps; step by step: one [B, (max_delay + 1) H] x [(max_delay + 1) H, H]
product per step), against the same layer without delays; it writes bench_delay_line_synapse.json and .md.
"""
import argparse
import datetime
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexgen  # noqa: E402

CHANNELS, RATE, BYTES_PER_STEP = 700, 0.05, 28


def copy_bandwidth():
    """Bytes read + written per second by a large device-to-device copy."""
    a = torch.rand(512 * 2**20 // 4, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 4 / (ms * 1e-3)


def taps_options(interpolation, sigma):
    return dict(interpolation="gaussian", sigma=sigma) if interpolation == "gaussian" else {}


def candidates(max_delay, interpolation="linear", sigma=2.0, undelayed=True):
    """name -> (layer, its delay parameter or None), every delay layer with the same starting delays."""
    start = torch.rand(CHANNELS, generator=torch.Generator().manual_seed(0)) * max_delay
    fused_delay = flexgen.Delay(CHANNELS, max_delay, delay=start.clone(), **taps_options(interpolation, sigma))
    layer_delay = flexgen.Delay(CHANNELS, max_delay, delay=start.clone(), **taps_options(interpolation, sigma))
    cands = {
        "fused": (flexgen.LIF(step_mode="m", delay=fused_delay).cuda(), fused_delay),
        "delay layer, then LIF": (torch.nn.Sequential(layer_delay, flexgen.LIF(step_mode="m")).cuda(), layer_delay),
    }
    if undelayed:
        cands["LIF without delays"] = (flexgen.LIF(step_mode="m").cuda(), None)
    return cands


def spikes(steps, batch, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.rand(steps, batch, CHANNELS, device="cuda", generator=g) < RATE).float().requires_grad_()


def fwd_bwd(layer, x, grad):
    flexgen.reset(layer)
    layer(x).backward(grad)


def median_ms(layer, inputs, grads):
    calls = iter(range(1 << 62))

    def step():
        k = next(calls) % len(inputs)
        fwd_bwd(layer, inputs[k], grads[k])

    ms = triton.testing.do_bench(step, grad_to_none=inputs, return_mode="median")
    layer.zero_grad(set_to_none=True)
    return ms


def peak_mb(layer, x, grad):
    fwd_bwd(layer, x, grad)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(layer, x, grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    layer.zero_grad(set_to_none=True)
    x.grad = None
    return peak / 2**20


def check_agreement(cands, x, grad):
    """The fused layer's spikes and gradients (input, delays) against the delay layer's."""
    results = {}
    for name in ("fused", "delay layer, then LIF"):
        layer, delay = cands[name]
        flexgen.reset(layer)
        out = layer(x)
        gx, gd = torch.autograd.grad(out, [x, delay.delay], grad)
        results[name] = (out, gx, gd)
    (a, gxa, gda), (b, gxb, gdb) = results.values()
    mismatch = (a != b).float().mean().item()
    err = max(((gxa - gxb).abs().max() / gxb.abs().max()).item(), ((gda - gdb).abs().max() / gdb.abs().max()).item())
    if mismatch > 1e-3 or err > 1e-3:
        raise AssertionError(f"fused and delay layer disagree: spikes {mismatch:.2e} of them, gradients {err:.2e}")
    return mismatch, err


def measure(steps, batch, max_delay, bandwidth, interpolation="linear", sigma=2.0, undelayed=True):
    cands = candidates(max_delay, interpolation, sigma, undelayed)
    inputs = [spikes(steps, batch, seed) for seed in range(3)]
    grads = [torch.randn(steps, batch, CHANNELS, device="cuda") for _ in inputs]
    mismatch, err = check_agreement(cands, inputs[0], grads[0])
    floor_ms = BYTES_PER_STEP * steps * batch * CHANNELS / bandwidth * 1e3
    rows = []
    for name, (layer, _) in cands.items():
        rows.append({"T": steps, "B": batch, "max_delay": max_delay, "candidate": name,
                     "ms": median_ms(layer, inputs, grads), "peak_mib": peak_mb(layer, inputs[0], grads[0]),
                     "floor_ms": floor_ms, "spike_mismatch": mismatch, "grad_rel_err": err,
                     **taps_label(interpolation, sigma)})
        print(rows[-1], flush=True)
    return rows


def recurrent_candidates(hidden, max_delay, interpolation="linear", sigma=2.0, per_synapse=False):
    line = flexgen.SynapseDelay if per_synapse else flexgen.Delay
    shape = (hidden, hidden) if per_synapse else (hidden,)
    start = torch.rand(shape, generator=torch.Generator().manual_seed(0)) * max_delay

    def layer(path, delayed):
        torch.manual_seed(0)
        taps = taps_options(interpolation, sigma)
        delay = line(hidden, max_delay, delay=start.clone(), **taps) if delayed else None
        return flexgen.Recurrent(flexgen.LIF, hidden=hidden, path=path, delay=delay, v_threshold=0.5).cuda()

    return {"fused": layer("fused", True), "fused, no delays": layer("fused", False),
            "step by step": layer("stepwise", True)}


def check_recurrent_agreement(cands, x, grad, prefix=16):
    """(share of spikes that differ, largest relative gradient error) between the fused and the step-by-step layer:
    the spikes over the whole sequence (their products round differently, so a few may flip, and a flipped spike
    changes every later gradient), the gradients (input, weight, delays) over its first `prefix` steps."""
    results = []
    for name in ("fused", "step by step"):
        layer = cands[name]
        flexgen.reset(layer)
        with torch.no_grad():
            full = layer(x)
        flexgen.reset(layer)
        head = x[:prefix].detach().requires_grad_()
        out = layer(head)
        results.append((full, *torch.autograd.grad(out, [head, layer.weight, layer.delay.delay], grad[:prefix])))
    (a, *ga), (b, *gb) = results
    mismatch = (a != b).float().mean().item()
    err = max(((u - v).abs().max() / v.abs().max()).item() for u, v in zip(ga, gb))
    if mismatch > 1e-2 or err > 1e-2:
        raise AssertionError(f"fused and step by step disagree: spikes {mismatch:.2e} of them, gradients {err:.2e}")
    return mismatch, err


def measure_recurrent(steps, batch, max_delay, hidden, interpolation="linear", sigma=2.0, per_synapse=False):
    cands = recurrent_candidates(hidden, max_delay, interpolation, sigma, per_synapse)
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = [(torch.rand(steps, batch, hidden, device="cuda", generator=g) * 1.2).requires_grad_() for _ in range(3)]
    grads = [torch.randn(steps, batch, hidden, device="cuda") for _ in inputs]
    mismatch, err = check_recurrent_agreement(cands, inputs[0], grads[0])
    rows = []
    for name, layer in cands.items():
        rows.append({"T": steps, "B": batch, "H": hidden, "max_delay": max_delay, "candidate": name,
                     "ms": median_ms(layer, inputs, grads), "peak_mib": peak_mb(layer, inputs[0], grads[0]),
                     "spike_mismatch": mismatch, "grad_rel_err": err, **taps_label(interpolation, sigma)})
        print(rows[-1], flush=True)
    return rows


def taps_label(interpolation, sigma):
    return {"interpolation": f"gaussian, sigma {sigma:g}"} if interpolation == "gaussian" else {}


def recurrent_table(results):
    lines = ["| T | B | H | max_delay | candidate | fwd+bwd ms | vs fused | peak MiB | spikes differing | grad err |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def point(r):
        return r["T"], r["B"], r["H"], r["max_delay"], r.get("interpolation")

    fused = {point(r): r["ms"] for r in results if r["candidate"] == "fused"}
    for r in results:
        ratio = r["ms"] / fused[point(r)]
        taps = f" ({r['interpolation']})" if "interpolation" in r else ""
        lines.append(f"| {r['T']} | {r['B']} | {r['H']} | {r['max_delay']}{taps} | {r['candidate']} | {r['ms']:.3f} | "
                     f"{ratio:.2f}x | {r['peak_mib']:.0f} | {r['spike_mismatch']:.1e} | {r['grad_rel_err']:.1e} |")
    return "\n".join(lines)


def table(results):
    lines = ["| T | B | max_delay | candidate | fwd+bwd ms | vs fused | floor ms | peak MiB |",
             "|---|---|---|---|---|---|---|---|"]

    def point(r):
        return r["T"], r["B"], r["max_delay"], r.get("interpolation")

    fused = {point(r): r["ms"] for r in results if r["candidate"] == "fused"}
    for r in results:
        ratio = r["ms"] / fused.get(point(r), fused.get(point(r)[:3] + (None,)))
        taps = f" ({r['interpolation']})" if "interpolation" in r else ""
        lines.append(f"| {r['T']} | {r['B']} | {r['max_delay']}{taps} | {r['candidate']} | {r['ms']:.3f} | "
                     f"{ratio:.2f}x | {r['floor_ms']:.3f} | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def write_outputs(meta, results, out):
    os.makedirs(out, exist_ok=True)
    stem = "bench_delay_line_synapse" if meta.get("per_synapse") else "bench_delay_line"
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    layer_rows = [r for r in results if "H" not in r]
    recurrent_rows = [r for r in results if "H" in r]
    with open(os.path.join(out, stem + ".md"), "w") as f:
        merged = f" With the {meta['merged']}." if "merged" in meta else ""
        f.write(f"# Delay lines in the kernels, forward + backward\n\n{meta['gpu']}, {meta['date']}, torch "
                f"{meta['torch']}, Triton {meta['triton']}, copy bandwidth {meta['copy_gb_s']:.0f} GB/s. "
                f"`{meta['command']}`.{merged} \"vs fused\": the candidate's time over the fused layer's.\n")
        if layer_rows:
            f.write(f"\n## A neuron layer\n\n{meta['layer']}.\n\n" + table(layer_rows) + "\n")
        if recurrent_rows:
            f.write(f"\n## A recurrent layer\n\n{meta['recurrent']}.\n\n" + recurrent_table(recurrent_rows) + "\n")


def _provenance(recorded, kind):
    """Where a merged record's rows of `kind` came from: the recorded run itself, or, where that run did not measure
    them (it had merged them in turn), the run it names."""
    if kind not in recorded.get("measured", [kind]) and "merged" in recorded:
        return recorded["merged"]
    return f"rows of the other kind from `{recorded['command']}` ({recorded['gpu']}, {recorded['date']})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    parser.add_argument("--steps", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--max-delay", type=int, nargs="+", default=[25, 250])
    parser.add_argument("--hidden", type=int, nargs="*", default=[256], help="recurrent layers' sizes (none: skip)")
    parser.add_argument("--no-layer", action="store_true", help="measure the recurrent layers only")
    parser.add_argument("--interpolation", nargs="+", choices=["linear", "gaussian"], default=["linear"],
                        help="the delay lines' taps (neuron and recurrent layers; the undelayed LIF is measured "
                        "with the first)")
    parser.add_argument("--sigma", type=float, default=2.0, help="the gaussian taps' width, in steps")
    parser.add_argument("--per-synapse", action="store_true", help="recurrent layers with a delay per synapse "
                        "(flexgen.SynapseDelay) only")
    parser.add_argument("--replot", metavar="JSON", help="redraw the table of a recorded run (no GPU needed)")
    parser.add_argument("--merge", metavar="JSON", help="keep the rows of the kind this run does not measure (with "
                        "--hidden and no sizes, or --no-layer) from a recorded run; the record names both")
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            recorded = json.load(f)
        write_outputs(recorded["meta"], recorded["results"], args.out)
        return 0
    if not torch.cuda.is_available():
        print("bench_delay_line needs a CUDA GPU", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    results = [] if args.no_layer or args.per_synapse else [
        row for k, interpolation in enumerate(args.interpolation) for steps in args.steps
        for batch in args.batch for max_delay in args.max_delay
        for row in measure(steps, batch, max_delay, bandwidth, interpolation, args.sigma, undelayed=k == 0)]
    results += [row for interpolation in args.interpolation for hidden in args.hidden for steps in args.steps
                for batch in args.batch for max_delay in args.max_delay
                for row in measure_recurrent(steps, batch, max_delay, hidden, interpolation, args.sigma,
                                             args.per_synapse)]
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton.__version__, "copy_gb_s": bandwidth / 1e9,
            "command": "python benchmarks/bench_delay_line.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "layer": f"{CHANNELS} LIF neurons, fp32, input spike rate {RATE}, learnable delays",
            "recurrent": "Recurrent LIF (v_threshold 0.5), fp32, inputs uniform in [0, 1.2), learnable delays"
                         + (", one per synapse (flexgen.SynapseDelay)" if args.per_synapse else ", one per neuron"),
            "per_synapse": args.per_synapse}
    meta["measured"] = (["layer"] if not (args.no_layer or args.per_synapse) else []) + (
        ["recurrent"] if args.hidden else [])
    if args.merge:
        with open(args.merge) as f:
            recorded = json.load(f)
        kept = [r for r in recorded["results"] if ("H" in r) != any("H" in mine for mine in results)]
        results = results + kept if kept and "H" in kept[0] else kept + results
        meta["merged"] = _provenance(recorded["meta"], "recurrent" if kept and "H" in kept[0] else "layer")
    write_outputs(meta, results, args.out)
    print(table([r for r in results if "H" not in r]))
    print(recurrent_table([r for r in results if "H" in r]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
