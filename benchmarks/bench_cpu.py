"""Neurons on the CPU, forward + backward: flexgen's C target and torch path against SpikingJelly, snnTorch, Norse
and torch.compile.

    python benchmarks/bench_cpu.py [--out DIR] [--steps 8 32 128 256] [--threads 1 2] [--no-compile]

Input [T, 32, 4096] (fresh uniform values in [0, 2), three inputs in turn), loss the output's sum; every layer
is reset before each call. Candidates: LIF (flexgen backend="c" with its default design choice and with the plain
design (`recompute=False`), and "torch"; SpikingJelly's LIFNode, snnTorch's Leaky and Norse's LIFBoxCell in Python
loops, and a torch LIF loop compiled by torch.compile, once per configuration), PLIF (flexgen,
SpikingJelly's ParametricLIFNode), ALIF (a two-state neuron: flexgen only) and a recurrent LIF layer of 512
neurons on [T, 32, 512] (flexgen's `Recurrent`, step by step on the CPU, and snnTorch's RLeaky), in float32 and
float64, with one thread and with more (`torch.set_num_threads`; the C kernels take the same count). Time is the median of
`--repeats` calls after one warm-up (of 3 for a candidate whose call takes over a second). Outputs are checked against flexgen's torch path first. Writes bench_cpu.json
and bench_cpu.md to DIR (default docs/perf).
"""
import argparse
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flexgen  # noqa: E402
from bench_lif import SigmoidSpike  # noqa: E402 (the torch.compile peer's spike, as bench_lif times it)

BATCH, NEURONS = 32, 4096
HIDDEN = 512  # the recurrent layer's neurons: inputs [T, BATCH, HIDDEN]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_lif_loop(x):
    """LIF as SpikingJelly's LIFNode computes it (tau 2, hard reset to 0, threshold 1, sigmoid surrogate)."""
    v = torch.zeros_like(x[0])
    out = []
    for t in range(x.shape[0]):
        h = v + (x[t] - v) / 2.0
        s = SigmoidSpike.apply(h - 1.0)
        out.append(s)
        v = h * (1.0 - s)
    return torch.stack(out)


COMPILED_LOOP = torch.compile(torch_lif_loop, dynamic=False)  # one wrapper: compiled once per shape and dtype


def recurrent_candidates(dtype):
    """A recurrent LIF layer of HIDDEN neurons: flexgen (step by step on the CPU) and snnTorch's RLeaky."""
    made = {}
    torch.manual_seed(0)
    for backend in ("c", "torch"):
        layer = flexgen.Recurrent(flexgen.LIF, hidden=HIDDEN, backend=backend).to(dtype)
        made[f"flexgen backend={backend}"] = layer
    try:
        import snntorch
    except ImportError:
        return made
    if dtype != torch.float32:  # snnTorch 1.0's RLeaky makes its spike and membrane buffers in float32
        return made
    rleaky = snntorch.RLeaky(beta=0.5, linear_features=HIDDEN, reset_mechanism="zero").to(dtype)

    def snntorch_loop(x):
        spk, mem = torch.zeros_like(x[0]), torch.zeros_like(x[0])  # (init_rleaky's are in the default dtype)
        out = []
        for t in range(x.shape[0]):
            spk, mem = rleaky(x[t], spk, mem)
            out.append(spk)
        return torch.stack(out)

    made["snnTorch RLeaky loop"] = snntorch_loop
    return made


def candidates(neuron, dtype, compile_peer):
    """name -> a function of x running forward only (the caller adds the backward), layers reset per call."""
    if neuron == "Recurrent":
        return recurrent_candidates(dtype)
    made = {}
    for name, options in (("flexgen backend=c", {"backend": "c"}),
                          ("flexgen backend=c recompute=False", {"backend": "c", "recompute": False}),
                          ("flexgen backend=torch", {"backend": "torch"})):
        layer = {"LIF": lambda o: flexgen.LIF(step_mode="m", **o),
                 "PLIF": lambda o: flexgen.PLIF(step_mode="m", dtype=dtype, **o),
                 "ALIF": lambda o: flexgen.neurons.spec("ALIF")(tau=2.0, tau_a=20.0, **o)}[neuron](options)
        made[name] = _resetting(layer)
    try:
        from spikingjelly.activation_based import neuron as sj
    except ImportError:
        sj = None
    if sj is not None and neuron in ("LIF", "PLIF"):
        layer = sj.LIFNode(step_mode="m") if neuron == "LIF" else sj.ParametricLIFNode(step_mode="m")
        made[f"SpikingJelly {type(layer).__name__}"] = _resetting(layer.to(dtype))
    if neuron == "LIF":
        try:
            import snntorch
        except ImportError:
            snntorch = None
        if snntorch is not None:
            made["snnTorch Leaky loop"] = _snntorch(snntorch.Leaky(beta=0.5, reset_mechanism="zero"))
        norse = _norse_lif(dtype)
        if norse is not None:
            made["Norse LIFBoxCell loop"] = norse
        if compile_peer:
            made["torch.compile LIF loop"] = COMPILED_LOOP
    return made


def _resetting(layer):
    def run(x):
        layer.reset()
        return layer(x)

    return run


def _snntorch(leaky):
    def run(x):
        mem = leaky.init_leaky()
        out = []
        for t in range(x.shape[0]):
            spk, mem = leaky(x[t], mem)
            out.append(spk)
        return torch.stack(out)

    return run


def _norse_lif(dtype):
    """Norse's LIF without a synaptic current (LIFBoxCell), stepped in a loop: dt * tau_mem_inv = 0.5 is tau 2,
    threshold 1, reset to 0 (its SuperSpike surrogate); None without Norse."""
    try:
        import norse.torch as norse
    except ImportError:
        return None
    value = functools.partial(torch.tensor, dtype=dtype)
    cell = norse.LIFBoxCell(norse.LIFBoxParameters(tau_mem_inv=value(500.0), v_leak=value(0.0), v_th=value(1.0),
                                                   v_reset=value(0.0)), dt=0.001)

    def run(x):
        state, out = None, []
        for t in range(x.shape[0]):
            spikes, state = cell(x[t], state)
            out.append(spikes)
        return torch.stack(out)

    return run


def fwd_bwd(fn, x):
    fn(x).sum().backward()
    x.grad = None


SLOW_SECONDS, SLOW_REPEATS = 1.0, 3  # a candidate whose call takes longer is timed over fewer calls


def median_ms(fn, inputs, repeats):
    start = time.perf_counter()
    fwd_bwd(fn, inputs[0])  # warm: compiled, caches filled
    if time.perf_counter() - start > SLOW_SECONDS:
        start = time.perf_counter()
        fwd_bwd(fn, inputs[0])  # (the first call may have been compiling)
        if time.perf_counter() - start > SLOW_SECONDS:
            repeats = min(repeats, SLOW_REPEATS)
    times = []
    for i in range(repeats):
        x = inputs[i % len(inputs)]
        start = time.perf_counter()
        fwd_bwd(fn, x)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(neuron, dtype_name, steps, threads, repeats, compile_peer):
    dtype = DTYPES[dtype_name]
    g = torch.Generator().manual_seed(steps)
    width = HIDDEN if neuron == "Recurrent" else NEURONS
    inputs = [(2.0 * torch.rand(steps, BATCH, width, generator=g, dtype=dtype)).requires_grad_() for _ in range(3)]
    made = candidates(neuron, dtype, compile_peer)
    reference = made["flexgen backend=torch"](inputs[0]).detach()
    rows = []
    for name, fn in made.items():
        torch.set_num_threads(threads)
        if name.startswith("flexgen") and neuron != "Recurrent":  # (the recurrent products sum in another order)
            assert torch.equal(fn(inputs[0]).detach(), reference), f"{name}: spikes differ from the torch path's"
        ms = median_ms(fn, inputs, repeats)
        rows.append({"neuron": neuron, "dtype": dtype_name, "steps": steps, "threads": threads, "candidate": name,
                     "ms": round(ms, 3)})
        print(rows[-1], flush=True)
    return rows


def table(results):
    lines = ["| neuron | dtype | T | threads | candidate | fwd+bwd ms | flexgen C is faster by |", "|---|---|---|---|---|---|---|"]
    for r in results:
        c = next(x["ms"] for x in results if x["candidate"] == "flexgen backend=c" and
                 all(x[k] == r[k] for k in ("neuron", "dtype", "steps", "threads")))
        ratio = "" if r["candidate"] == "flexgen backend=c" else f"{r['ms'] / c:.2f}x"
        lines.append(f"| {r['neuron']} | {r['dtype']} | {r['steps']} | {r['threads']} | {r['candidate']} | "
                     f"{r['ms']:.2f} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    parser.add_argument("--neurons", nargs="+", default=["LIF", "PLIF", "ALIF", "Recurrent"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    args = parser.parse_args(argv)
    if not flexgen.launch.c_path.available():
        print("bench_cpu needs a C compiler for flexgen's C target", file=sys.stderr)
        return 2
    results = [row for neuron in args.neurons for dtype in args.dtypes for steps in args.steps
               for threads in args.threads
               for row in measure(neuron, dtype, steps, threads, args.repeats, not args.no_compile)]
    meta = {"cpu": cpu_name(), "cores": os.cpu_count(), "date": datetime.date.today().isoformat(),
            "torch": torch.__version__, "spikingjelly": _version("spikingjelly"), "snntorch": _version("snntorch"),
            "norse": _version("norse"),
            "command": "python benchmarks/bench_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "shape": [None, BATCH, NEURONS]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_cpu.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(args.out, "bench_cpu.md"), "w") as f:
        f.write(f"# Neurons on the CPU, forward + backward\n\n{meta['cpu']} ({meta['cores']} cores), {meta['date']}, torch "
                f"{meta['torch']}, SpikingJelly {meta['spikingjelly']}, snnTorch {meta['snntorch']}, Norse {meta['norse']}. "
                f"`{meta['command']}`.\nInput [T, {BATCH}, {NEURONS}] ([T, {BATCH}, {HIDDEN}] for the recurrent layer); the "
                f"median of {args.repeats} calls.\n\n"
                + table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
