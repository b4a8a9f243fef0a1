"""EventProp against BPTT on an SHD-shaped task (CPU): 700 inputs -> a recurrent layer of H current-based LIF
neurons -> 20 leaky readout neurons, trained once with exact EventProp gradients (`flexgen.EventPropDense`,
recurrent hidden layer and readout, fp64 C kernels) and once with BPTT (`flexgen.Dense` into `flexgen.Recurrent`
of the same neuron on the dt grid, its surrogate gradient, and the same readout), on the same data, from the same
initial weights, for the same number of epochs. Reports the time per training step, the peak memory of one step
and the test accuracy.

    python benchmarks/train_shd_eventprop.py [--out DIR] [--hidden 128] [--train 480] [--test 240] [--epochs 15]
    python benchmarks/train_shd_eventprop.py --epochs 1 --train 32 --test 16 --hidden 16   # seconds

The data (synthetic, as SHD is not on this machine; seeded): 20 classes, each a fixed random spatio-temporal
pattern of input spike times: each of the 700 inputs takes part in a class's pattern with probability
`--pattern-p` (0.4), at a time uniform in [0, 0.9 window). A sample of class c is its pattern with each spike
dropped with probability `--drop` (0.2), the others moved by a normal jitter of sd `--jitter` ms (2; kept inside
the window), plus `--noise` (0.5) spikes per input on average at uniform random times (Poisson count per input).
So a sample holds about 570 spikes in 100 ms (SHD's hold about 8,000 over up to 1.4 s on 700 inputs): the classes
differ in which inputs fire and when, and are balanced (the labels cycle through the classes). The sizes (T 100,
H 128, a few hundred samples; SHD has 8,156 training samples and its networks 256-1024 hidden neurons) are chosen so
that both runs finish in about 10 minutes on one CPU thread. The train and test
samples share the classes' patterns and differ in their draws. EventProp reads the spike times; BPTT the same
spikes binned into the 1 ms grid ([T, B, 700], counts).

The neuron: tau_m 20 ms, tau_s 5 ms, v_th 1, v reset to 0; an input spike of weight w makes i jump by w (EventProp);
BPTT's discrete step (`method="exact"`) holds each bin's input over the step, and its recurrent spikes arrive one
step later (EventProp's at the spike's time). The readout is the same neuron with v_th 1e9 (it never fires: a
leaky integrator). Loss: cross-entropy of each readout neuron's largest v on the grid (`max_voltage_cross_entropy`);
the class is the argmax of that. Adam, `--lr` (5e-3), batches of `--batch` (16). Initial weights (seeded, equal for
both): input normal(`--w-in` 0.04, 0.04), recurrent uniform(+-1/sqrt(H)) with a zero diagonal, readout
normal(0, 1/sqrt(H)) times 4.

Time: each training step (forward, backward, optimiser step) on `--threads` torch threads (1). Peak memory: as
`bench_eventprop.py` measures it, the rise of the peak resident set (VmHWM) over one training step of a batch, in a
fresh process per model, after a step on a tiny input. With --out DIR, writes DIR/train_shd_eventprop_cpu_<date>.md
and .json (machine, date, command, settings, per-epoch accuracies; `--tag WORD` puts a word before _cpu). Exits 1
if a final test accuracy is below --min-accuracy.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import flexgen
from flexgen.layers import eventprop_losses as losses
from bench_cpu import cpu_name  # (benchmarks/ is on sys.path when a script in it runs)
from bench_eventprop import _status_kib

INPUTS, CLASSES = 700, 20
F64 = torch.float64


@flexgen.ode(states=("v", "i"), method="exact")
def cuba(x, v, i, tau_m=20.0, tau_s=5.0, v_th=1.0):
    return flexgen.Dynamics({"v": (i - v) / tau_m, "i": -i / tau_s + x}, threshold=v >= v_th, reset={"v": 0.0})


READOUT_V_TH = 1e9  # the readout never fires: a leaky integrator of the hidden spikes


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, kind, default, text in [
            ("hidden", int, 128, "recurrent hidden neurons"), ("train", int, 480, "training samples"),
            ("test", int, 240, "test samples"), ("epochs", int, 15, "epochs (the same for both)"),
            ("batch", int, 16, ""), ("steps", int, 100, "grid steps of --dt ms (the window)"),
            ("dt", float, 1.0, "ms"), ("lr", float, 5e-3, "Adam's learning rate"),
            ("w_in", float, 0.04, "the mean input weight"), ("pattern_p", float, 0.4, ""),
            ("drop", float, 0.2, ""), ("jitter", float, 2.0, "ms"), ("noise", float, 0.5, "spikes per input"),
            ("seed", int, 0, "data, weights and batches"), ("threads", int, 1, "torch threads"),
            ("min_accuracy", float, 0.0, "")]:
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text or None)
    parser.add_argument("--models", nargs="+", default=["eventprop", "bptt"], choices=["eventprop", "bptt"])
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    parser.add_argument("--out", help="write the record into this folder")
    parser.add_argument("--tag", default="", help="a word in the record's name: train_shd_eventprop_<tag>_cpu_<date>")
    args = parser.parse_args(argv)
    for name in ("hidden", "train", "test", "epochs", "batch", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 0 <= args.drop < 1 or not 0 < args.pattern_p <= 1 or args.noise < 0 or args.jitter < 0 or args.dt <= 0:
        parser.error("--drop in [0, 1), --pattern-p in (0, 1], --noise, --jitter >= 0 and --dt > 0")
    return args


def synthetic_shd(n_train, n_test, window, pattern_p, drop, jitter, noise, seed):
    """((train times [n, 700, K], labels [n]), (test times, labels)): see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    member = torch.rand(CLASSES, INPUTS, generator=g) < pattern_p  # which inputs take part in each class's pattern
    at = torch.rand(CLASSES, INPUTS, generator=g, dtype=F64) * 0.9 * window

    def draw(n):
        labels = torch.arange(n) % CLASSES
        keep = member[labels] & (torch.rand(n, INPUTS, generator=g) >= drop)
        moved = (at[labels] + jitter * torch.randn(n, INPUTS, generator=g, dtype=F64)).clamp(0.0, window * (1 - 1e-9))
        pattern = torch.where(keep, moved, torch.full_like(moved, float("inf")))[..., None]
        extra = torch.poisson(torch.full((n, INPUTS), float(noise)), generator=g).long()
        width = max(1, int(extra.max()))
        slots = torch.rand(n, INPUTS, width, generator=g, dtype=F64) * window
        added = torch.where(torch.arange(width) < extra[..., None], slots, torch.full_like(slots, float("inf")))
        times = torch.cat([pattern, added], -1).sort(-1).values
        width = max(1, int(torch.isfinite(times).sum(-1).max()))
        return times[..., :width].contiguous(), labels

    return draw(n_train), draw(n_test)


def raster(times, steps, dt):
    """The spikes binned on the grid: [T, B, 700] counts (float32)."""
    B = times.shape[0]
    finite = torch.isfinite(times)
    b, i, _ = finite.nonzero(as_tuple=True)
    n = (times[finite] / dt).floor().long().clamp_max(steps - 1)
    out = torch.zeros(steps, B, INPUTS)
    out.index_put_((n, b, i), torch.ones(len(n)), accumulate=True)
    return out


def initial_weights(args):
    g = torch.Generator().manual_seed(args.seed)
    H = args.hidden
    w_in = args.w_in + 0.04 * torch.randn(H, INPUTS, generator=g, dtype=F64)
    w_rec = (torch.rand(H, H, generator=g, dtype=F64) * 2 - 1) / H ** 0.5
    w_rec.fill_diagonal_(0.0)
    w_out = 4.0 * torch.randn(CLASSES, H, generator=g, dtype=F64) / H ** 0.5
    return w_in, w_rec, w_out


class EventPropNet(torch.nn.Module):
    """Spike times [B, 700, K] -> recurrent EventPropDense -> EventPropDense readout; returns its v [T, B, 20]."""

    def __init__(self, args, weights):
        super().__init__()
        self.hidden = flexgen.EventPropDense(INPUTS, args.hidden, cuba, dt=args.dt, steps=args.steps, recurrent=True)
        self.readout = flexgen.EventPropDense(args.hidden, CLASSES, cuba, dt=args.dt, steps=args.steps,
                                              v_th=READOUT_V_TH)
        with torch.no_grad():
            for p, w in zip((self.hidden.weight, self.hidden.weight_rec, self.readout.weight), weights):
                p.copy_(w)

    def forward(self, times):
        self.spikes = self.hidden(times)
        return self.readout(self.spikes).state("v")

    def after_step(self):
        self.hidden.weight_rec.data.fill_diagonal_(0.0)

    def spike_rate(self):
        return float(self.spikes.counts.double().mean())


class BPTTNet(torch.nn.Module):
    """Binned spikes [T, B, 700] -> flexgen.Dense into flexgen.Recurrent (surrogate gradient) -> the readout neuron
    layer on the grid; returns its v [T, B, 20]."""

    def __init__(self, args, weights):
        super().__init__()
        self.hidden = flexgen.Dense(INPUTS, args.hidden, flexgen.Recurrent(cuba, hidden=args.hidden), bias=False)
        self.readout_weight = torch.nn.Parameter(torch.empty(CLASSES, args.hidden))
        self.readout = cuba(v_th=READOUT_V_TH, store_state_seqs=True)
        with torch.no_grad():
            for p, w in zip((self.hidden.weight, self.hidden.cell.weight, self.readout_weight), weights):
                p.copy_(w.float())

    def forward(self, x):
        self.spikes = self.hidden(x)
        self.readout.reset()  # each sequence from v = i = 0
        self.readout(F.linear(self.spikes, self.readout_weight))
        return self.readout.state_seqs["v"]

    def after_step(self):
        self.hidden.cell.weight.data.fill_diagonal_(0.0)

    def spike_rate(self):
        return float(self.spikes.detach().sum(0).mean())


def model_and_inputs(kind, args, weights, times):
    if kind == "eventprop":
        return EventPropNet(args, weights), times
    return BPTTNet(args, weights), raster(times, args.steps, args.dt)


def batch_of(inputs, kind, index):
    return inputs[index] if kind == "eventprop" else inputs[:, index]


def accuracy(model, inputs, labels, kind, batch):
    correct = 0
    with torch.no_grad():
        for index in torch.arange(len(labels)).split(batch):
            v = model(batch_of(inputs, kind, index))
            correct += int((v.max(0).values.argmax(1) == labels[index]).sum())
    return correct / len(labels)


def train(kind, args, weights, data):
    (train_times, train_labels), (test_times, test_labels) = data
    torch.manual_seed(args.seed)
    model, inputs = model_and_inputs(kind, args, weights, train_times)
    test_inputs = model_and_inputs(kind, args, weights, test_times)[1]
    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr)
    order = torch.Generator().manual_seed(args.seed)
    steps, epochs, start = [], [], time.perf_counter()
    for epoch in range(args.epochs):
        total, rates = 0.0, []
        for index in torch.randperm(len(train_labels), generator=order).split(args.batch):
            t0 = time.perf_counter()
            optimiser.zero_grad(set_to_none=True)
            loss = losses.max_voltage_cross_entropy(model(batch_of(inputs, kind, index)), train_labels[index])
            loss.backward()
            optimiser.step()
            model.after_step()
            steps.append(time.perf_counter() - t0)
            total += loss.item() * len(index)
            rates.append(model.spike_rate())
        test = accuracy(model, test_inputs, test_labels, kind, args.batch)
        epochs.append({"epoch": epoch + 1, "loss": total / len(train_labels), "test_accuracy": test,
                       "hidden_spikes_per_neuron": statistics.mean(rates)})
        print(f"{kind:9s} epoch {epoch + 1:3d}: loss {epochs[-1]['loss']:.4f}, test accuracy {test:.3f}, "
              f"hidden spikes / neuron {epochs[-1]['hidden_spikes_per_neuron']:.1f}", flush=True)
    return {"step_s_median": statistics.median(steps), "step_s_mean": statistics.mean(steps),
            "train_s": time.perf_counter() - start, "train_accuracy": accuracy(model, inputs, train_labels, kind,
                                                                               args.batch),
            "test_accuracy": epochs[-1]["test_accuracy"], "epochs": epochs,
            "backend": getattr(model.hidden.last_run, "backend", None)}


def child(kind, argv):
    """Print the rise of the peak resident set (KiB) over one training step of a batch of `kind`."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = synthetic_shd(args.batch, 1, args.steps * args.dt, args.pattern_p, args.drop, args.jitter, args.noise,
                         args.seed)
    times, labels = data[0]

    def step(model, inputs, labels):
        model.zero_grad(set_to_none=True)
        losses.max_voltage_cross_entropy(model(inputs), labels).backward()

    tiny = parse_args(argv + ["--hidden", "2"])
    model, inputs = model_and_inputs(kind, tiny, initial_weights(tiny), times[:1])
    step(model, inputs, labels[:1])  # every code path loaded, on a tiny input
    model, inputs = model_and_inputs(kind, args, initial_weights(args), times)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark from here
    before = _status_kib("VmRSS")
    step(model, inputs, labels)
    print(_status_kib("VmHWM") - before)


def peak_rise(kind, argv):
    """MiB; see `child` (glibc maps every block of 64 KiB or more on its own, so a freed block leaves the
    resident set)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, *argv], capture_output=True,
                         text=True, check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1]) / 2 ** 10


def without_out(argv):
    """argv less --out and its folder (the child writes no record)."""
    kept, skip = [], False
    for a in argv:
        if not skip and a != "--out" and not a.startswith("--out="):
            kept.append(a)
        skip = a == "--out"
    return kept


def table(results):
    lines = ["| model | time per step: median / mean (s) | training time (s) | peak rise of one step (MiB) | "
             "hidden spikes / neuron (last epoch) | train accuracy | test accuracy |", "|---|---|---|---|---|---|---|"]
    names = {"eventprop": "EventProp (C kernels, fp64)", "bptt": "BPTT (flexgen.Recurrent, fp32)"}
    for kind, r in results.items():
        peak = "n/a" if r.get("peak_rss_mib") is None else f"{r['peak_rss_mib']:.1f}"
        lines.append(f"| {names[kind]} | {r['step_s_median']:.3g} / {r['step_s_mean']:.3g} | {r['train_s']:.0f} | "
                     f"{peak} | {r['epochs'][-1]['hidden_spikes_per_neuron']:.1f} | {r['train_accuracy']:.3f} | "
                     f"{r['test_accuracy']:.3f} |")
    return "\n".join(lines)


def write_record(folder, meta, results):
    os.makedirs(folder, exist_ok=True)
    tag = f"_{meta['settings']['tag']}" if meta["settings"]["tag"] else ""
    stem = os.path.join(folder, f"train_shd_eventprop{tag}_cpu_{meta['date']}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    s = meta["settings"]
    epochs = range(len(next(iter(results.values()))["epochs"]))
    curves = "\n".join(f"| {n + 1} | " + " | ".join(f"{r['epochs'][n]['test_accuracy']:.3f}" for r in results.values())
                       + " |" for n in epochs)
    with open(stem + ".md", "w") as f:
        f.write(f"# EventProp against BPTT on a synthetic SHD-shaped task (CPU), {meta['date']}\n\n"
                f"{meta['cpu']}, {meta['cores']} cores ({meta['threads']} torch thread(s)), torch {meta['torch']}; "
                f"`{meta['command']}`. 700 inputs -> {s['hidden']} recurrent current-based LIF -> 20 leaky readout "
                f"neurons; {s['train']} training and {s['test']} test samples of the synthetic task "
                f"(`benchmarks/train_shd_eventprop.py`'s docstring: about {meta['events_per_sample']:.0f} input "
                f"spikes per sample), {s['steps']} steps of {s['dt']:g} ms, batch {s['batch']}, {s['epochs']} "
                f"epochs, Adam lr {s['lr']:g}, the same data and initial weights for both. Peak: the rise of the peak "
                "resident set over one training step of a batch (a fresh process each).\n\n" + table(results) +
                "\n\nTest accuracy per epoch:\n\n| epoch | " + " | ".join(results) + " |\n|---|" +
                "---|" * len(results) + "\n" + curves + "\n")
    return stem


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2:])
        return 0
    args = parse_args(argv)
    if "eventprop" in args.models and not flexgen.launch.c_path.available():
        print("train_shd_eventprop needs a C compiler for the EventProp C kernels", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    data = synthetic_shd(args.train, args.test, args.steps * args.dt, args.pattern_p, args.drop, args.jitter,
                         args.noise, args.seed)
    events = float(torch.isfinite(data[0][0]).sum((1, 2)).double().mean())
    print(f"synthetic SHD-shaped data: {args.train} training, {args.test} test samples, {events:.0f} input spikes "
          "per sample", flush=True)
    weights = initial_weights(args)
    results = {}
    for kind in args.models:
        results[kind] = train(kind, args, weights, data)
        results[kind]["peak_rss_mib"] = None if args.no_memory else peak_rise(kind, without_out(argv))
    print(table(results))
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "events_per_sample": events,
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "models")},
            "command": "python benchmarks/train_shd_eventprop.py " + " ".join(argv)}
    if args.out:
        print("record:", write_record(args.out, meta, results) + ".md")
    low = [k for k, r in results.items() if r["test_accuracy"] < args.min_accuracy]
    if low:
        print(f"test accuracy below --min-accuracy {args.min_accuracy}: {', '.join(low)}", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
