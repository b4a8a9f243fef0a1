"""Streaming inference through whole models, one step a call: `flexgen.Stream` against the peers' steps.

    python benchmarks/bench_stream_model.py [--out DIR]                 # GPU: the model and the recurrent table
    python benchmarks/bench_stream_model.py --device cpu [--out DIR]    # the same on the CPU (fp32)
    python benchmarks/bench_stream_model.py --dry-run [--out DIR]       # tiny sizes on the CPU (a temp folder)
    python benchmarks/bench_stream_model.py --replot JSON [--out DIR]   # redraw a recorded table

Two kinds of rows, each in fp32 and bf16 (fp32 only on the CPU):
- "model": an SHD-shaped recurrent network, 700 -> 3 x 512 (Linear then a recurrent LIF layer, three times),
  B 1 and 32, input spikes (10 % of the 700 channels a step);
- "recurrent": one recurrent LIF layer of H neurons fed [B, H] currents, the rows of bench_recurrent_stream.py
  (H x B: 256 x 1, 256 x 32, 1024 x 32).
Every layer runs I_t = x_t + W s_{t-1} + b, h = v + (I_t - v) / 2, s_t = [h >= 1], v = h (1 - s_t), in the I/O
dtype (snnTorch under autocast, as bench_recurrent_stream.py runs it). Candidates:
- flexgen Stream: `flexgen.Stream(model, x)` over `torch.nn.Linear` + `flexgen.Recurrent(LIF, bias=True)` layers
  (a CUDA graph on the GPU; eager with the C kernels on the CPU);
- flexgen Stream, input in place: the same stream, each step's input written into `stream.input` (as a producer
  writing there would) and `stream()` called with no argument; the write is outside the timed single steps (a
  peer's step too reads an input already made) and inside the back-to-back loop;
- flexgen, no stream: the same model called one step at a time (`step_mode="s"`), for reference (not a peer);
- torch eager: the step in torch ops (addmm and the neuron's elementwise ops), states passed along;
- torch.compile: that step compiled (`dynamic=False`); on the GPU also with `mode="reduce-overhead"` (CUDA graphs,
  `torch.compiler.cudagraph_mark_step_begin()` before each step, and the carried states cloned after it, as torch
  asks of outputs that outlive the next replay);
- snnTorch: `Linear` + `RLeaky(linear_features=H, reset_mechanism="zero")` per layer (its reset lags a step and
  its input is not divided by tau: the same cost, other spikes);
- SpikingJelly: `Linear` + `LinearRecurrentContainer(LIFNode(tau=2, v_reset=0))` per layer in step mode "s", its
  recurrent weight [I | W] (the same neuron and feedback; the product over the concatenation [x, s]).
Per step, two measures: `--calls` calls back to back, then a synchronize, over the calls (the least of `--passes`
passes: throughput, bench_recurrent_stream's measure), and the latency of single steps, each call followed by a
synchronize (`--samples` of them: p50 and p99, the time until the step's output is ready). The peers' spikes over
the first 64 steps are compared with flexgen's (the share that differ). On CUDA, the rise of the allocator's peaks over
one warm step (allocated and reserved). Writes
bench_stream_model[_cpu]_<date>.json and .md to --out (default docs/perf).
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
MODEL = (700, 512, 3)  # inputs, hidden, layers
MODEL_BATCHES = (1, 32)
RECURRENT = ("256x1", "256x32", "1024x32")  # hidden x batch
TAU, THRESHOLD = 2.0, 1.0


def flexgen_model(n_in, hidden, layers, device, dtype, seed):
    """Linear -> Recurrent LIF, `layers` times (n_in 0: the recurrent layer alone, fed currents [B, hidden])."""
    torch.manual_seed(seed)
    mods = []
    for k in range(layers):
        if n_in:
            linear = torch.nn.Linear(n_in if k == 0 else hidden, hidden)
            with torch.no_grad():
                linear.weight.mul_(6.0 if k == 0 else 8.0)
            mods.append(linear)
        rec = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True, step_mode="s")
        with torch.no_grad():
            rec.weight.mul_(4.0)
        mods.append(rec)
    model = mods[0] if len(mods) == 1 else torch.nn.Sequential(*mods)
    return model.to(device=device, dtype=dtype).eval()


def parameters_of(model):
    """[(input weight or None, input bias or None, recurrent weight, recurrent bias)] per layer, detached."""
    mods = [model] if isinstance(model, flexgen.Recurrent) else list(model)
    layers, linear = [], None
    for m in mods:
        if isinstance(m, torch.nn.Linear):
            linear = m
            continue
        w_in = None if linear is None else linear.weight.detach()
        b_in = None if linear is None else linear.bias.detach()
        layers.append((w_in, b_in, m.weight.detach(), m.bias.detach()))
        linear = None
    return layers


def torch_step(x, states, layers):
    """One step of the whole network in torch ops: (output spikes, new states [(v, s) per layer])."""
    new = []
    for (w_in, b_in, w, b), (v, s) in zip(layers, states):
        current = x if w_in is None else torch.addmm(b_in, x, w_in.t())
        h = v + (torch.addmm(current + b, s, w.t()) - v) / TAU
        s = (h >= THRESHOLD).to(x.dtype)
        v = h * (1.0 - s)
        new.append((v, s))
        x = s
    return x, new


class TorchStream:
    def __init__(self, layers, batch, compile_mode=None):
        self.layers = layers
        self.graphs = compile_mode == "reduce-overhead"
        if compile_mode is None:
            self.step = torch_step
        else:
            torch._dynamo.reset()  # compiled per configuration, not recompiled from an earlier one's cache
            kwargs = {"mode": compile_mode} if compile_mode != "default" else {}
            self.step = torch.compile(torch_step, dynamic=False, **kwargs)
        w = layers[0][2]
        self.states = [(w.new_zeros(batch, l[2].shape[0]), w.new_zeros(batch, l[2].shape[0])) for l in layers]

    def __call__(self, x):
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        out, self.states = self.step(x, self.states, self.layers)
        if self.graphs:  # a replay's outputs are overwritten by the next replay: the carried states are copied out
            self.states = [(v.clone(), s.clone()) for v, s in self.states]
        return out


class SnnTorchStream:
    def __init__(self, layers, batch):
        import snntorch

        self.mods = []
        dev, dtype = layers[0][2].device, layers[0][2].dtype
        for w_in, b_in, w, b in layers:
            linear = None
            if w_in is not None:
                linear = torch.nn.Linear(w_in.shape[1], w_in.shape[0]).to(dev)
                with torch.no_grad():
                    linear.weight.copy_(w_in)
                    linear.bias.copy_(b_in)
            rleaky = snntorch.RLeaky(beta=1.0 - 1.0 / TAU, threshold=THRESHOLD, linear_features=w.shape[0],
                                     reset_mechanism="zero").to(dev)
            with torch.no_grad():
                rleaky.recurrent.weight.copy_(w)
                rleaky.recurrent.bias.copy_(b)
            spk, mem = rleaky.init_rleaky()
            self.mods.append([linear, rleaky, spk, mem])
        self.autocast, self.dtype = dtype in (torch.bfloat16, torch.float16), dtype

    def __call__(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=self.autocast):
            for m in self.mods:
                current = x if m[0] is None else m[0](x)
                m[2], m[3] = m[1](current, m[2], m[3])
                x = m[2]
        return x


class SpikingJellyStream:
    def __init__(self, layers, batch):
        from spikingjelly.activation_based import layer, neuron

        dev, dtype = layers[0][2].device, layers[0][2].dtype
        mods = []
        for w_in, b_in, w, b in layers:
            if w_in is not None:
                linear = torch.nn.Linear(w_in.shape[1], w_in.shape[0])
                with torch.no_grad():
                    linear.weight.copy_(w_in)
                    linear.bias.copy_(b_in)
                mods.append(linear)
            hidden = w.shape[0]
            node = neuron.LIFNode(tau=TAU, v_threshold=THRESHOLD, v_reset=0.0, decay_input=True, step_mode="s")
            rc = layer.LinearRecurrentContainer(node, in_features=hidden, out_features=hidden, bias=True,
                                                step_mode="s")
            with torch.no_grad():
                rc.rc.weight.copy_(torch.cat([torch.eye(hidden, device=w.device, dtype=w.dtype), w], dim=1))
                rc.rc.bias.copy_(b)
            mods.append(rc)
        self.net = torch.nn.Sequential(*mods).to(device=dev, dtype=dtype)

    def __call__(self, x):
        return self.net(x)


def candidates(kind, hidden, batch, dtype, device, spec):
    n_in, layers = (MODEL[0], MODEL[2]) if kind == "model" else (0, 1)
    seed = hidden + batch
    model = flexgen_model(n_in, hidden, layers, device, dtype, seed)
    params = parameters_of(model)
    example = torch.zeros(batch, n_in or hidden, device=device, dtype=dtype)
    makers = {"flexgen Stream": lambda: flexgen.Stream(model, example),
              "flexgen Stream, input in place": lambda: InPlace(
                  flexgen.Stream(flexgen_model(n_in, hidden, layers, device, dtype, seed), example)),
              "flexgen, no stream": lambda: flexgen_model(n_in, hidden, layers, device, dtype, seed),
              "torch eager": lambda: TorchStream(params, batch),
              "torch.compile": lambda: TorchStream(params, batch, "default")}
    if device.type == "cuda":
        makers["torch.compile reduce-overhead"] = lambda: TorchStream(params, batch, "reduce-overhead")
    makers["snnTorch"] = lambda: SnnTorchStream(params, batch)
    makers["SpikingJelly"] = lambda: SpikingJellyStream(params, batch)
    made, notes = {}, {}
    for name, make in makers.items():
        if spec.skip and name in spec.skip:
            continue
        try:
            made[name] = make()
        except ImportError as exc:
            notes[name] = f"not installed ({exc.name})"
    return made, notes


class InPlace:
    """A stream whose step's input is written into `stream.input` (`prepare`) before `stream()` runs on it."""

    def __init__(self, stream):
        self.stream = stream

    def prepare(self, x):
        self.stream.input.copy_(x)

    def __call__(self, x=None):
        if x is not None:
            self.prepare(x)
        return self.stream()


def inputs_for(kind, hidden, batch, dtype, device):
    g = torch.Generator().manual_seed(7)
    if kind == "model":
        xs = (torch.rand(64, batch, MODEL[0], generator=g) < 0.1).float()
    else:
        xs = torch.rand(64, batch, hidden, generator=g) * 1.5
    return [x.to(device=device, dtype=dtype) for x in xs]


def timed(call, xs, spec, sync):
    """(us per call back to back: the least of the passes, [us of each synchronized step])."""
    best = float("inf")
    for _ in range(spec.passes):
        sync()
        start = time.perf_counter()
        for i in range(spec.calls):
            call(xs[i % len(xs)])
        sync()
        best = min(best, (time.perf_counter() - start) / spec.calls * 1e6)
    single = []
    prepare = getattr(call, "prepare", None)
    for i in range(spec.samples):
        if prepare is not None:  # the input written in place before the timed step
            prepare(xs[i % len(xs)])
            sync()
            start = time.perf_counter()
            call()
            sync()
            single.append((time.perf_counter() - start) * 1e6)
            continue
        start = time.perf_counter()
        call(xs[i % len(xs)])
        sync()
        single.append((time.perf_counter() - start) * 1e6)
    return best, single


def step_peak(call, x, device):
    """(KiB allocated, KiB reserved): the rise of CUDA's peaks over one warm step, after `empty_cache`; None on
    the CPU (no allocator statistics)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    call(x)
    torch.cuda.synchronize()
    return [round((torch.cuda.max_memory_allocated() - allocated) / 1024, 1),
            round((torch.cuda.max_memory_reserved() - reserved) / 1024, 1)]


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def measure(spec, device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    shapes = [("model", MODEL[1] if not spec.tiny else 16, b) for b in spec.model_batches]
    shapes += [("recurrent", *map(int, s.split("x"))) for s in spec.recurrent]
    for name in spec.dtypes:
        dtype = DTYPES[name]
        for kind, hidden, batch in shapes:
            xs = inputs_for(kind, hidden, batch, dtype, device)
            made, notes = candidates(kind, hidden, batch, dtype, device, spec)
            row = {"kind": kind, "dtype": name, "hidden": hidden, "batch": batch, "us_per_call": {}, "p50_us": {},
                   "p99_us": {}, "step_peak_kib": {}, "spikes_differ": {}, "notes": notes}
            with torch.no_grad():
                reference = torch.stack([made["flexgen Stream"](x).clone() for x in xs]).float()
                for cand, call in made.items():
                    try:
                        if cand != "flexgen Stream":
                            got = torch.stack([call(x).clone() for x in xs]).float()
                            row["spikes_differ"][cand] = round((got != reference).float().mean().item(), 6)
                        for i in range(spec.warmup):
                            call(xs[i % len(xs)])  # warm-up, compilation
                        us, single = timed(call, xs, spec, sync)
                        peak = step_peak(call, xs[0], device)
                    except Exception as exc:  # a peer that cannot run this row: recorded, not fatal
                        row["notes"][cand] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                        continue
                    row["us_per_call"][cand] = round(us, 2)
                    if peak is not None:
                        row["step_peak_kib"][cand] = peak
                    row["p50_us"][cand] = round(percentile(single, 50), 2)
                    row["p99_us"][cand] = round(percentile(single, 99), 2)
            row["spike_rate"] = round(reference.mean().item(), 4)
            rows.append(row)
            print(row, flush=True)
    return rows


def _ratio(values, base):
    peers = [v for n, v in values.items() if not n.startswith("flexgen")]
    if not peers or base not in values:
        return "n/a"
    return f"{min(peers) / values[base]:.2f}"


def load_average():
    """The machine's load average (1, 5 and 15 minutes) as /proc/loadavg gives it; None where there is none."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None


def _load(meta):
    load = meta.get("load_average")
    if not load or not load.get("start"):
        return ""
    return f" Load average (1, 5, 15 min): {load['start']} at the start, {load['end']} at the end."


def table(meta, rows):
    names = list(dict.fromkeys(n for r in rows for n in r["us_per_call"]))
    lines = [f"# Streaming inference through whole models, one step a call ({meta['device']})",
             "",
             f"{meta['device']}, {meta['date']}, torch {meta['torch']}, Triton {meta['triton']}, "
             f"{meta['threads']} CPU thread(s). `{meta['command']}`.{_load(meta)}"
             + (" TF32 allowed in every candidate's fp32 products." if meta.get("tf32") else ""),
             f"Per cell: us per step back to back ({meta['calls']} calls then a synchronize, the least of "
             f"{meta['passes']} passes) / p50 / p99 us of single synchronized steps ({meta['samples']} of them). "
             "Speed-up: the fastest peer's time over flexgen Stream's (above 1: flexgen is faster), back to back "
             "and at p50 (and the input-in-place stream's at p50); \"flexgen, no stream\" is not a peer. "
             "Differ: the share of spikes over the first 64 "
             "steps unlike flexgen's (same weights and inputs; snnTorch's neuron is another one).",
             "",
             "| rows | dtype | H | B | spike rate | " + " | ".join(names)
             + " | speed-up (back to back) | speed-up (p50) | speed-up (p50, input in place) | differ |",
             "|---|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|"]
    for r in rows:
        cells = [f"{r['us_per_call'][n]:.1f} / {r['p50_us'][n]:.1f} / {r['p99_us'][n]:.1f}"
                 if n in r["us_per_call"] else "n/a" for n in names]
        differ = ", ".join(f"{n} {v:g}" for n, v in r["spikes_differ"].items())
        shape = "700 -> 3 x H" if r["kind"] == "model" else "one layer"
        lines.append(f"| {shape} | {r['dtype']} | {r['hidden']} | {r['batch']} | {r['spike_rate']:.3f} | "
                     + " | ".join(cells) + f" | {_ratio(r['us_per_call'], 'flexgen Stream')} | "
                     f"{_ratio(r['p50_us'], 'flexgen Stream')} | "
                     f"{_ratio(r['p50_us'], 'flexgen Stream, input in place')} | {differ} |")
    if any(r.get("step_peak_kib") for r in rows):
        lines += ["", "Memory: the rise of CUDA's peak over one warm step after `empty_cache`, KiB allocated / "
                  "reserved (what a step allocates; the buffers and graphs a candidate holds are not counted).", "",
                  "| rows | dtype | H | B | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
        for r in rows:
            peaks = r.get("step_peak_kib", {})
            cells = [f"{peaks[n][0]:g} / {peaks[n][1]:g}" if n in peaks else "n/a" for n in names]
            shape = "700 -> 3 x H" if r["kind"] == "model" else "one layer"
            lines.append(f"| {shape} | {r['dtype']} | {r['hidden']} | {r['batch']} | " + " | ".join(cells) + " |")
    notes = sorted({f"{n}: {why}" for r in rows for n, why in r["notes"].items()})
    if notes:
        lines += ["", "Not measured: " + "; ".join(notes) + "."]
    return "\n".join(lines) + "\n"


def write(meta, rows, out):
    os.makedirs(out, exist_ok=True)
    stem = meta.get("stem") or (f"bench_stream_model{'_cpu' if meta['device_type'] == 'cpu' else ''}"
                                f"{'_tf32' if meta.get('tf32') else ''}_{meta['date']}")
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    text = table(meta, rows)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text)
    print(text)
    return stem


class Spec:
    def __init__(self, args, tiny):
        self.dtypes, self.calls, self.passes, self.samples = args.dtypes, args.calls, args.passes, args.samples
        self.warmup, self.tiny, self.skip = args.warmup, tiny, set(args.skip or ())
        self.model_batches, self.recurrent = args.batches, args.recurrent


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="where the record goes (default docs/perf; a temp folder dry)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES))
    p.add_argument("--batches", nargs="+", type=int, default=list(MODEL_BATCHES), help="the model's batch sizes")
    p.add_argument("--recurrent", nargs="*", default=list(RECURRENT), help="one-layer rows, HxB")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--samples", type=int, default=2000, help="single synchronized steps for p50 and p99")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--skip", nargs="*", help="candidates to leave out, by name")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every candidate (CPU)")
    p.add_argument("--stem", default=None, help="the record's file name without extension (default "
                   "bench_stream_model[_cpu]_<date>)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--tf32", action="store_true", help="allow TF32 in every candidate's fp32 products "
                   "(torch.backends.cuda.matmul.allow_tf32; flexgen's kernels follow it); the record is *_tf32_*")
    p.add_argument("--replot", metavar="JSON", help="redraw the table of a recorded run")
    args = p.parse_args(argv)
    out = args.out or os.path.join(os.path.dirname(__file__), "..", "docs", "perf")
    if args.replot:
        with open(args.replot) as f:
            record = json.load(f)
        write(record["meta"], record["results"], out)
        return out
    device = torch.device("cpu" if args.dry_run else args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.dtypes is None:
        args.dtypes = ["fp32"] if device.type == "cpu" else list(DTYPES)
    if args.dry_run:
        args.batches, args.recurrent, args.calls, args.passes, args.samples, args.warmup = [2], ["16x2"], 3, 1, 5, 2
        args.skip = (args.skip or []) + ["torch.compile"]
        out = args.out or tempfile.mkdtemp(prefix="bench_stream_model_")
    if device.type == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"CPU ({os.cpu_count()} cores{', dry run' if args.dry_run else ''})"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    load_at_start = load_average()
    rows = measure(Spec(args, args.dry_run), device)
    given = sys.argv[1:] if argv is None else argv
    meta = {"device": name, "device_type": device.type, "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "triton": triton_version,
            "command": " ".join(["python benchmarks/bench_stream_model.py", *given]),
            "calls": args.calls, "passes": args.passes, "samples": args.samples, "threads": torch.get_num_threads(),
            "tf32": bool(args.tf32), "load_average": {"start": load_at_start, "end": load_average()}}
    if args.stem:
        meta["stem"] = args.stem
    write(meta, rows, out)
    return out


if __name__ == "__main__":
    main()
