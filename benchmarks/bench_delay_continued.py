"""A neuron layer's delay line across calls, forward + backward on a GPU: a call that continues the line (a long
sequence in chunks, as truncated backpropagation through time runs it) against the first call of a sequence.

    python benchmarks/bench_delay_continued.py [--out DIR] [--steps 100 250] [--batch 32 256]
                                               [--max-delay 25 250] [--interpolation linear gaussian] [--sigma 2]

Layer: 700 channels (SHD's inputs) of LIF neurons with learnable delays drawn uniformly over [0, max_delay], fp32,
input spikes at rate 0.05 (`bench_delay_line.py`'s layer). Each timed call runs one chunk of `--steps` steps.
Candidates:
- "continued": the layer holds the line and states an earlier chunk left (detached, as after `layer.detach()`),
  restored before every call; its kernels read the held steps.
- "first call": the same chunk after `reset()` (no line: zeros before the first step).
- "Delay layer over line + chunk": what a continued call ran before the kernels read held lines (commit
  b5d4778 and earlier): the `Delay` layer over the held steps and the chunk, its last `--steps` rows into the same
  LIF layer without delays.
Time: `triton.testing.do_bench`'s median over three cycling chunks with fresh random output gradients. Memory: the
peak of forward + backward in MiB above what the call starts with (input, layer, held line). The continued call's
spikes and gradients (input, delays) are checked against the `Delay` layer's before anything is recorded. Writes
bench_delay_continued.json and .md to DIR (default docs/perf); `--replot JSON` redraws the table of a recorded run
(no GPU needed).
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
from bench_delay_line import CHANNELS, spikes, taps_options, taps_label  # noqa: E402


def held_after(layer, earlier):
    """(states, line) the layer holds after a call on `earlier`, detached."""
    flexgen.reset(layer)
    with torch.no_grad():
        layer(earlier)
    return {k: v.detach().clone() for k, v in layer._states.items()}, layer.line.detach().clone()


def restore(layer, held):
    """Put back what an earlier chunk left (the layer's own attributes: no public setter holds a line)."""
    states, line = held
    object.__setattr__(layer, "_states", dict(states))
    object.__setattr__(layer, "line", line)


class Candidates:
    """The three ways to run one chunk, each a function of (chunk, output gradient)."""

    def __init__(self, max_delay, interpolation, sigma, earlier):
        start = torch.rand(CHANNELS, generator=torch.Generator().manual_seed(0)) * max_delay
        taps = taps_options(interpolation, sigma)
        self.fused = flexgen.LIF(step_mode="m", delay=flexgen.Delay(CHANNELS, max_delay, delay=start.clone(),
                                                                    **taps)).cuda()
        self.delay = flexgen.Delay(CHANNELS, max_delay, delay=start.clone(), **taps).cuda()
        self.lif = flexgen.LIF(step_mode="m").cuda()
        self.held = held_after(self.fused, earlier)

    def continued(self, x, grad):
        restore(self.fused, self.held)
        self.fused(x).backward(grad)

    def first_call(self, x, grad):
        flexgen.reset(self.fused)
        self.fused(x).backward(grad)

    def delay_layer(self, x, grad):
        states, line = self.held
        flexgen.reset(self.lif)
        object.__setattr__(self.lif, "_states", dict(states))
        delayed = self.delay(torch.cat([line, x]))[line.shape[0]:]
        self.lif(delayed).backward(grad)

    def parameters(self):
        return [self.fused.delay.delay, self.delay.delay]

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None


def check_agreement(cands, x, grad):
    """(share of spikes that differ, largest relative gradient error) of the continued call against the Delay
    layer's, on the same held line and states."""
    restore(cands.fused, cands.held)
    out_f = cands.fused(x)
    gx_f, gd_f = torch.autograd.grad(out_f, [x, cands.fused.delay.delay], grad)
    states, line = cands.held
    object.__setattr__(cands.lif, "_states", dict(states))
    out_r = cands.lif(cands.delay(torch.cat([line, x]))[line.shape[0]:])
    gx_r, gd_r = torch.autograd.grad(out_r, [x, cands.delay.delay], grad)
    mismatch = (out_f != out_r).float().mean().item()
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in ((gx_f, gx_r), (gd_f, gd_r)))
    if mismatch > 1e-3 or err > 1e-3:
        raise AssertionError(f"continued call and Delay layer disagree: spikes {mismatch:.2e}, gradients {err:.2e}")
    return mismatch, err


def median_ms(run, inputs, grads, cands):
    calls = iter(range(1 << 62))

    def step():
        k = next(calls) % len(inputs)
        run(inputs[k], grads[k])

    ms = triton.testing.do_bench(step, grad_to_none=inputs + cands.parameters(), return_mode="median")
    cands.zero_grad()
    return ms


def peak_mib(run, x, grad, cands):
    run(x, grad)
    cands.zero_grad()
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run(x, grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    cands.zero_grad()
    x.grad = None
    return peak / 2**20


def measure(steps, batch, max_delay, interpolation, sigma):
    inputs = [spikes(steps, batch, seed) for seed in range(3)]
    grads = [torch.randn(steps, batch, CHANNELS, device="cuda") for _ in inputs]
    cands = Candidates(max_delay, interpolation, sigma, spikes(max(steps, max_delay), batch, 7).detach())
    mismatch, err = check_agreement(cands, inputs[0], grads[0])
    rows = []
    for name, run in (("continued", cands.continued), ("first call", cands.first_call),
                      ("Delay layer over line + chunk", cands.delay_layer)):
        rows.append({"T": steps, "B": batch, "max_delay": max_delay, "candidate": name,
                     "ms": median_ms(run, inputs, grads, cands), "peak_mib": peak_mib(run, inputs[0], grads[0], cands),
                     "spike_mismatch": mismatch, "grad_rel_err": err, **taps_label(interpolation, sigma)})
        print(rows[-1], flush=True)
    return rows


def table(results):
    lines = ["| T per call | B | max_delay | candidate | fwd+bwd ms | vs continued | peak MiB | spikes differing | "
             "grad err |", "|---|---|---|---|---|---|---|---|---|"]

    def point(r):
        return r["T"], r["B"], r["max_delay"], r.get("interpolation")

    continued = {point(r): r["ms"] for r in results if r["candidate"] == "continued"}
    for r in results:
        taps = f" ({r['interpolation']})" if "interpolation" in r else ""
        lines.append(f"| {r['T']} | {r['B']} | {r['max_delay']}{taps} | {r['candidate']} | {r['ms']:.3f} | "
                     f"{r['ms'] / continued[point(r)]:.2f}x | {r['peak_mib']:.1f} | {r['spike_mismatch']:.1e} | "
                     f"{r['grad_rel_err']:.1e} |")
    return "\n".join(lines)


def write_outputs(meta, results, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_delay_continued.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out, "bench_delay_continued.md"), "w") as f:
        f.write(f"# A neuron layer's delay line across calls: forward + backward of one chunk\n\n{meta['gpu']}, "
                f"{meta['date']}, torch {meta['torch']}, Triton {meta['triton']}. `{meta['command']}`. 700 LIF "
                "neurons, fp32, input spike rate 0.05, learnable delays; \"vs continued\": the candidate's time over "
                "the continued call's; peak: above what the call starts with.\n\n" + table(results) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "perf"))
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 250])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--max-delay", type=int, nargs="+", default=[25, 250])
    parser.add_argument("--interpolation", nargs="+", default=["linear", "gaussian"], choices=["linear", "gaussian"])
    parser.add_argument("--sigma", type=float, default=2.0)
    parser.add_argument("--replot", metavar="JSON", help="redraw the table of a recorded run into --out")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            recorded = json.load(f)
        write_outputs(recorded["meta"], recorded["results"], args.out)
        return
    if not torch.cuda.is_available():
        sys.exit("bench_delay_continued.py needs a CUDA GPU")
    results = [row for interpolation in args.interpolation for steps in args.steps for batch in args.batch
               for max_delay in args.max_delay for row in measure(steps, batch, max_delay, interpolation, args.sigma)]
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": triton.__version__,
            "command": "python benchmarks/bench_delay_continued.py " + " ".join(sys.argv[1:])}
    write_outputs(meta, results, args.out)
    print(table(results))


if __name__ == "__main__":
    main()
