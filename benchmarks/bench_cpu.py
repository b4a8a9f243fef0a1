"""Neurons on the CPU, forward + backward: flexgen's C target and torch path against SpikingJelly, snnTorch, Norse
and torch.compile.

    python benchmarks/bench_cpu.py [--out DIR] [--steps 8 32 128 256] [--threads 1 2] [--neurons ...] [--no-compile]

Input [T, 32, 4096] (fresh uniform values in [0, 2), three inputs in turn), loss the output's sum; every layer is
reset before each call. Every neuron row has flexgen backend="c" (its default design choice), backend="c" with the
plain design (`recompute=False`; not for the recurrent layer) and backend="torch", and the peers that exist:

- LIF (tau 2, threshold 1, hard reset to 0, sigmoid surrogate): SpikingJelly's LIFNode, snnTorch's Leaky (beta 0.5,
  reset "zero") and Norse's LIFBoxCell in Python loops, and the same LIF step as a torch loop compiled by
  torch.compile (inductor), once per shape and dtype.
- PLIF: SpikingJelly's ParametricLIFNode.
- ALIF (flexgen's adaptive-threshold neuron): flexgen only.
- Synaptic, a two-state (current and membrane) neuron: flexgen's bundled `synaptic` (alpha 0.9, beta 0.8,
  threshold 10, reset by subtracting the threshold, its sigmoid surrogate); snnTorch's Synaptic with the same
  alpha, beta, threshold and reset ("subtract"; its default atan surrogate) in a Python loop; the same step as a
  torch.compile'd loop (bench_lif's sigmoid surrogate); Norse's LIFCell (current-based LIF, states v and i) in a
  Python loop. Norse's Euler step differs from flexgen's: the input enters the current and v decays towards it, v
  resets to 0 at once on this step's spike (flexgen, as snnTorch, subtracts the threshold at the next step). With
  dt * tau_syn_inv = 1 - alpha, dt * tau_mem_inv = 1 - beta and v_th = (1 - beta) threshold it computes the same
  current and, until a neuron first fires, 1 - beta times the same membrane potential: the same work per step
  (two states, one threshold, one reset), not the same spikes.
- Recurrent: a layer of 512 neurons on [T, 32, 512], the LIF above with its spikes at t - 1 times a [512, 512]
  weight (no bias, flexgen's default) added to its input at t: flexgen's `Recurrent(flexgen.LIF, hidden=512)` (step
  by step on the CPU); the same step with the product as a torch.compile'd loop; SpikingJelly's
  ElementWiseRecurrentContainer around a single-step LIFNode, its "element-wise" function adding the product;
  Norse's LIFBoxCell in a Python loop that adds the product; snnTorch's RLeaky (beta 0.5, reset "zero", its
  recurrent nn.Linear with a bias; float32 only, as its buffers are). All but RLeaky share one weight. Left out,
  as their work per step is not comparable: SpikingJelly's LinearRecurrentContainer (one nn.Linear on the
  concatenated [x, s], a [32, 1024] x [1024, 512] product per step, twice the recurrent product's) and Norse's
  LIFRecurrentCell (it always applies an input weight too, another [512, 512] product per step, and its neuron is
  the current-based one).

Where a peer computes flexgen's recurrence (`SAME_SPIKES`), its spikes are checked against flexgen's torch path
before timing, as are flexgen's own rows. In float32 and float64, with one thread and with more
(`torch.set_num_threads`; the C kernels take the same count). Time is the median of `--repeats` calls after one
warm-up (of 3 for a candidate whose call takes over a second). Writes bench_cpu.json and bench_cpu.md to DIR
(default docs/perf).
"""
import argparse
import datetime
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
NEURON_ROWS = ("LIF", "PLIF", "ALIF", "Synaptic", "Recurrent")
# The current settles near 10 (inputs average 1, alpha 0.9): about half the neurons fire at a step, where at
# threshold 1 nearly all fire at every step and the spike checks would check little.
SYNAPTIC = {"alpha": 0.9, "beta": 0.8, "threshold": 10.0}
# Peers computing flexgen's recurrence: the largest fraction of their spikes that may differ from flexgen's torch
# path's. Norse fires where v > threshold (flexgen where v >= threshold) and orders the sums otherwise, a recurrent
# layer's product may sum in another order than flexgen's, and a spike that rounding flips there feeds back into the
# next steps' inputs: these allow a few. (On one thread, at T 32 and 256: 2e-6 of Norse's LIF spikes differed in
# float32, none of the recurrent peers'.)
SAME_SPIKES = {
    ("LIF", "SpikingJelly LIFNode"): 0.0,
    ("LIF", "Norse LIFBoxCell loop"): 1e-3,
    ("LIF", "torch.compile LIF loop"): 0.0,
    ("PLIF", "SpikingJelly ParametricLIFNode"): 0.0,
    ("Synaptic", "snnTorch Synaptic loop"): 0.0,
    ("Synaptic", "torch.compile Synaptic loop"): 0.0,
    ("Recurrent", "flexgen backend=c"): 1e-2,
    ("Recurrent", "torch.compile recurrent LIF loop"): 1e-2,
    ("Recurrent", "SpikingJelly ElementWiseRecurrentContainer(LIFNode)"): 1e-2,
    ("Recurrent", "Norse LIFBoxCell + recurrent product loop"): 1e-2,
}


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _optional(module):
    """The module, or None where its package is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
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


def lif_step(v, current):
    """One step of the LIF that SpikingJelly's LIFNode and flexgen.LIF compute (tau 2, hard reset to 0, threshold 1,
    sigmoid surrogate): (spikes, v)."""
    h = v + (current - v) / 2.0
    s = SigmoidSpike.apply(h - 1.0)
    return s, h * (1.0 - s)


def torch_lif_loop(x):
    v, out = torch.zeros_like(x[0]), []
    for t in range(x.shape[0]):
        s, v = lif_step(v, x[t])
        out.append(s)
    return torch.stack(out)


def torch_synaptic_loop(x):
    """flexgen's `synaptic` with SYNAPTIC's values: the reset subtracts the threshold where the previous step fired,
    which fired where mem > threshold (written as 1 - Θ(threshold - mem), flexgen's and snnTorch's way)."""
    alpha, beta, threshold = SYNAPTIC["alpha"], SYNAPTIC["beta"], SYNAPTIC["threshold"]
    syn, mem, s, out = torch.zeros_like(x[0]), torch.zeros_like(x[0]), torch.zeros_like(x[0]), []
    for t in range(x.shape[0]):
        syn = alpha * syn + x[t]
        mem = beta * mem + syn - s.detach() * threshold
        s = 1.0 - SigmoidSpike.apply(threshold - mem)
        out.append(s)
    return torch.stack(out)


def torch_recurrent_lif_loop(x, weight):
    """flexgen's Recurrent(flexgen.LIF): the LIF step on the input plus the previous step's spikes times weight."""
    v, s, out = torch.zeros_like(x[0]), torch.zeros_like(x[0]), []
    for t in range(x.shape[0]):
        s, v = lif_step(v, x[t] + torch.nn.functional.linear(s, weight))
        out.append(s)
    return torch.stack(out)


# One wrapper each: compiled once per shape and dtype. Dynamo keeps 8 compilations of a function by default and
# runs it uncompiled past them, silently; the grid compiles each loop once per T and dtype (up to 5 x 2).
torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
COMPILED_LOOP = torch.compile(torch_lif_loop, dynamic=False)
COMPILED_SYNAPTIC_LOOP = torch.compile(torch_synaptic_loop, dynamic=False)
COMPILED_RECURRENT_LOOP = torch.compile(torch_recurrent_lif_loop, dynamic=False)


def candidates(neuron, dtype, compile_peer):
    """name -> a function of x running forward only (the caller adds the backward), layers reset per call."""
    if neuron == "Recurrent":
        return recurrent_candidates(dtype, compile_peer)
    peers = {"LIF": lif_peers, "PLIF": plif_peers, "ALIF": no_peers, "Synaptic": synaptic_peers}[neuron]
    return {**flexgen_candidates(neuron, dtype), **peers(dtype, compile_peer)}


def flexgen_candidates(neuron, dtype):
    made = {}
    for name, options in (("flexgen backend=c", {"backend": "c"}),
                          ("flexgen backend=c recompute=False", {"backend": "c", "recompute": False}),
                          ("flexgen backend=torch", {"backend": "torch"})):
        layer = {"LIF": lambda o: flexgen.LIF(step_mode="m", **o),
                 "PLIF": lambda o: flexgen.PLIF(step_mode="m", dtype=dtype, **o),
                 "ALIF": lambda o: flexgen.neurons.spec("ALIF")(tau=2.0, tau_a=20.0, **o),
                 "Synaptic": lambda o: flexgen.neurons.spec("Synaptic")(
                     **SYNAPTIC, surrogate=flexgen.surrogate.Sigmoid(alpha=4.0), **o)}[neuron](options)
        made[name] = _resetting(layer, flexgen.reset)
    return made


def lif_peers(dtype, compile_peer):
    made = {}
    sj = _optional("spikingjelly.activation_based.neuron")
    if sj is not None:
        made["SpikingJelly LIFNode"] = _resetting(sj.LIFNode(step_mode="m").to(dtype))
    snntorch = _optional("snntorch")
    if snntorch is not None:
        made["snnTorch Leaky loop"] = _snntorch_leaky(snntorch.Leaky(beta=0.5, reset_mechanism="zero"))
    norse = _optional("norse.torch")
    if norse is not None:
        made["Norse LIFBoxCell loop"] = _stepped(_norse_lif_box(norse, dtype))
    if compile_peer:
        made["torch.compile LIF loop"] = COMPILED_LOOP
    return made


def no_peers(dtype, compile_peer):
    """ALIF: no peer library has it."""
    return {}


def plif_peers(dtype, compile_peer):
    sj = _optional("spikingjelly.activation_based.neuron")
    if sj is None:
        return {}
    return {"SpikingJelly ParametricLIFNode": _resetting(sj.ParametricLIFNode(step_mode="m").to(dtype))}


def synaptic_peers(dtype, compile_peer):
    made = {}
    snntorch = _optional("snntorch")
    if snntorch is not None:
        # (values as tensors of dtype: a float becomes a float32 buffer, and float64 would compute with 0.9 rounded)
        values = {name: torch.tensor(value, dtype=dtype) for name, value in SYNAPTIC.items()}
        made["snnTorch Synaptic loop"] = _snntorch_synaptic(snntorch.Synaptic(**values, reset_mechanism="subtract"))
    norse = _optional("norse.torch")
    if norse is not None:
        made["Norse LIFCell loop"] = _stepped(_norse_lif_cell(norse, dtype))
    if compile_peer:
        made["torch.compile Synaptic loop"] = COMPILED_SYNAPTIC_LOOP
    return made


def recurrent_candidates(dtype, compile_peer):
    """A recurrent LIF layer of HIDDEN neurons, every candidate with the same recurrent weight (snnTorch's RLeaky,
    which does not compute the same recurrence, has its own)."""
    torch.manual_seed(0)
    weight = torch.empty(HIDDEN, HIDDEN, dtype=dtype).uniform_(-HIDDEN ** -0.5, HIDDEN ** -0.5)
    made = {}
    for backend in ("c", "torch"):
        layer = flexgen.Recurrent(flexgen.LIF, hidden=HIDDEN, backend=backend).to(dtype)
        with torch.no_grad():
            layer.weight.copy_(weight)
        made[f"flexgen backend={backend}"] = _resetting(layer, flexgen.reset)
    if compile_peer:
        compiled_weight = torch.nn.Parameter(weight.clone())
        made["torch.compile recurrent LIF loop"] = lambda x: COMPILED_RECURRENT_LOOP(x, compiled_weight)
    if _optional("spikingjelly.activation_based.layer") is not None:
        made["SpikingJelly ElementWiseRecurrentContainer(LIFNode)"] = _spikingjelly_recurrent(weight)
    norse = _optional("norse.torch")
    if norse is not None:
        made["Norse LIFBoxCell + recurrent product loop"] = _norse_recurrent(_norse_lif_box(norse, dtype), weight)
    snntorch = _optional("snntorch")
    if snntorch is not None and dtype == torch.float32:  # snnTorch 1.0's RLeaky makes its buffers in float32
        made["snnTorch RLeaky loop"] = _snntorch_rleaky(
            snntorch.RLeaky(beta=0.5, linear_features=HIDDEN, reset_mechanism="zero").to(dtype))
    return made


def _resetting(layer, reset=lambda layer: layer.reset()):
    def run(x):
        reset(layer)
        return layer(x)

    return run


def _stepped(step):
    """A Python loop over time of step(x_t, state) -> (spikes, state), starting from state None."""
    def run(x):
        state, out = None, []
        for t in range(x.shape[0]):
            spikes, state = step(x[t], state)
            out.append(spikes)
        return torch.stack(out)

    return run


def _snntorch_leaky(leaky):
    def run(x):
        mem = leaky.init_leaky()
        out = []
        for t in range(x.shape[0]):
            spk, mem = leaky(x[t], mem)
            out.append(spk)
        return torch.stack(out)

    return run


def _snntorch_synaptic(synaptic):
    def run(x):
        syn, mem = torch.zeros_like(x[0]), torch.zeros_like(x[0])  # (init_synaptic's are in the default dtype)
        out = []
        for t in range(x.shape[0]):
            spk, syn, mem = synaptic(x[t], syn, mem)
            out.append(spk)
        return torch.stack(out)

    return run


def _snntorch_rleaky(rleaky):
    def run(x):
        spk, mem = torch.zeros_like(x[0]), torch.zeros_like(x[0])  # (init_rleaky's are in the default dtype)
        out = []
        for t in range(x.shape[0]):
            spk, mem = rleaky(x[t], spk, mem)
            out.append(spk)
        return torch.stack(out)

    return run


def _norse_values(dtype, **values):
    return {name: torch.tensor(value, dtype=dtype) for name, value in values.items()}


def _norse_lif_box(norse, dtype):
    """Norse's LIF without a synaptic current (LIFBoxCell): dt * tau_mem_inv = 0.5 is tau 2, threshold 1, reset to
    0 (its SuperSpike surrogate)."""
    return norse.LIFBoxCell(norse.LIFBoxParameters(**_norse_values(dtype, tau_mem_inv=500.0, v_leak=0.0, v_th=1.0,
                                                                   v_reset=0.0)), dt=0.001)


def _norse_lif_cell(norse, dtype):
    """Norse's current-based LIF (LIFCell) closest to SYNAPTIC (see the module's docstring): dt * tau_syn_inv =
    1 - alpha, dt * tau_mem_inv = 1 - beta, v_th = (1 - beta) threshold, reset to 0 (its SuperSpike surrogate)."""
    dt, leak = 0.001, 1.0 - SYNAPTIC["beta"]
    parameters = norse.LIFParameters(**_norse_values(dtype, tau_syn_inv=(1.0 - SYNAPTIC["alpha"]) / dt,
                                                     tau_mem_inv=leak / dt, v_leak=0.0,
                                                     v_th=leak * SYNAPTIC["threshold"], v_reset=0.0))
    return norse.LIFCell(parameters, dt=dt)


def _norse_recurrent(cell, weight):
    weight = torch.nn.Parameter(weight.clone())

    def run(x):
        state, spikes, out = None, torch.zeros_like(x[0]), []
        for t in range(x.shape[0]):
            spikes, state = cell(x[t] + torch.nn.functional.linear(spikes, weight), state)
            out.append(spikes)
        return torch.stack(out)

    return run


def _spikingjelly_recurrent(weight):
    """SpikingJelly's container feeding a module's output at t - 1 back through a function of it and the input
    at t; the function here adds the recurrent product (the container does not require it to be element-wise)."""
    from spikingjelly.activation_based import functional, layer, neuron

    weight = torch.nn.Parameter(weight.clone())
    container = layer.ElementWiseRecurrentContainer(
        neuron.LIFNode(step_mode="s").to(weight.dtype),
        element_wise_function=lambda y, x: x + torch.nn.functional.linear(y, weight), step_mode="m")
    return _resetting(container, functional.reset_net)


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


def check_spikes(neuron, name, spikes, reference):
    """Flexgen's rows and the peers in SAME_SPIKES against flexgen's torch path; other peers are not checked."""
    if name.startswith("flexgen") and neuron != "Recurrent":
        assert torch.equal(spikes, reference), f"{neuron}, {name}: spikes differ from the torch path's"
    elif (neuron, name) in SAME_SPIKES:
        differ = (spikes.to(reference.dtype) != reference).double().mean().item()
        assert differ <= SAME_SPIKES[neuron, name], f"{neuron}, {name}: {differ:.2%} of the spikes differ"


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
        check_spikes(neuron, name, fn(inputs[0]).detach(), reference)
        ms = median_ms(fn, inputs, repeats)
        rows.append({"neuron": neuron, "dtype": dtype_name, "steps": steps, "threads": threads, "candidate": name,
                     "ms": round(ms, 3)})
        print(rows[-1], flush=True)
    return rows


def table(results):
    lines = ["| neuron | dtype | T | threads | candidate | fwd+bwd ms | flexgen C is faster by |",
             "|---|---|---|---|---|---|---|"]
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
    parser.add_argument("--neurons", nargs="+", choices=NEURON_ROWS, default=list(NEURON_ROWS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 32, 128, 256])
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
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
        f.write(f"# Neurons on the CPU, forward + backward\n\n{meta['cpu']} ({meta['cores']} cores), {meta['date']}, "
                f"torch {meta['torch']}, SpikingJelly {meta['spikingjelly']}, snnTorch {meta['snntorch']}, Norse "
                f"{meta['norse']}. `{meta['command']}`.\nInput [T, {BATCH}, {NEURONS}] ([T, {BATCH}, {HIDDEN}] for the "
                f"recurrent layer); the median of {args.repeats} calls.\n\n"
                + table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
