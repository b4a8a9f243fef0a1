"""Recurrent spiking layers on SHD-shaped data: flexgen's fused kernels against a torch loop, torch.compile,
snnTorch's RLeaky and flexgen's own step-wise path.

The network of every candidate: an input projection (nn.Linear 700 -> H, one matrix product over all steps) and a
recurrent layer of H neurons, I_t = W_in x_t + W_rec s_{t-1} + b, on sparse binary input events [T, B, 700]. Each
time is a training step: forward and backward of both, the median of triton.testing.do_bench, fresh random inputs
for every configuration. The neuron is snnTorch's Leaky with reset by subtraction (RLeaky's; --neuron leaky, the
default) or flexgen's adaptive LIF (--neuron alif; no snnTorch peer).

Run on a GPU (writes bench_recurrent.json and bench_recurrent.md to --out, default docs/perf):

    python benchmarks/bench_recurrent.py               # B 256 and 32, T 100 and 1000, H 256..2048, fp32 and bf16
    python benchmarks/bench_recurrent.py --quick       # B 256, T 100 and 1000, H 128 and 512, bf16
    python benchmarks/bench_recurrent.py --hidden 2048 --split 16   # a fixed number of programs per row tile
    python benchmarks/bench_recurrent.py --batch 8 --no-peers     # the fused layer's columns only

Check the script on a CPU (tiny sizes, Triton's interpreter, timings meaningless; writes to a temporary folder):

    python benchmarks/bench_recurrent.py --dry-run

One record of several runs' records on one GPU (parts of the grid run apart, e.g. within a time limit):

    python benchmarks/bench_recurrent.py --merge A/bench_recurrent.json B/bench_recurrent.json [--out DIR]

Columns: ms per training step; peak memory of one step above what was allocated before it (MiB); for the fused
kernels, the recurrent layer alone (fwd + bwd) against the time cuBLAS takes for its recurrent products in the same
dtype (per step s_{t-1} W^T and grad_I_t W, and the weight's gradient over all steps, replayed from a CUDA graph),
the layer alone replayed from a CUDA graph too (its kernels without the host time of an eager call, which at T 100
is much of the eager layer's time), and how the kernels cut the layer: programs (row tiles x slices of the hidden
neurons; neurons per slice in brackets; the JSON has the whole tiling). The JSON also has
the share of the GPU's matmul rate the products reach (3 x 2 (T - 1) B H^2 FLOPs over the layer's time, over the
rate of one torch.matmul [T B, H] x [H, H]). torch.compile compiles the loop's step (the recurrent product, the
neuron and its surrogate; the whole loop unrolled over T = 1000 steps does not compile in reasonable time), once
per shape; the seconds of each candidate's first (untimed) call are recorded in the JSON.
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

INPUTS = 700  # SHD's input channels
EVENT_RATE = 0.02  # share of input channels with an event per step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few configurations only")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on the CPU (Triton's interpreter): checks the script")
    p.add_argument("--neuron", choices=("leaky", "alif"), default="leaky")
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 256 32)")
    p.add_argument("--steps", type=int, nargs="+", help="sequence lengths (default 100 1000)")
    p.add_argument("--hidden", type=int, nargs="+", help="hidden sizes (default 256 512 1024 2048)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), nargs="+", help="I/O dtypes (default fp32 bf16)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="time torch.compile's loop too (default: yes)")
    p.add_argument("--peers", action=argparse.BooleanOptionalAction, default=True,
                   help="run the step-wise path and the peers too (default: yes); --no-peers times the fused layer "
                        "alone, for its own columns")
    p.add_argument("--max-hidden", type=int, help="RecurrentConfig.max_hidden: the largest fused layer")
    p.add_argument("--split", type=int, help="RecurrentConfig.split: programs per row tile (default: chosen per call)")
    p.add_argument("--max-tile", type=int, help="RecurrentConfig.max_tile: neurons per program")
    p.add_argument("--block-k", type=int, help="RecurrentConfig.block_k")
    p.add_argument("--num-warps", type=int, help="RecurrentConfig.num_warps")
    p.add_argument("--num-stages", type=int, help="RecurrentConfig.num_stages")
    p.add_argument("--stationary", action=argparse.BooleanOptionalAction, default=None,
                   help="RecurrentConfig.stationary: programs keep their weight slice (default: chosen per call)")
    p.add_argument("--out", help="output folder (default docs/perf; a temporary folder with --dry-run)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="write one record of these records' rows (one GPU, "
                   "neuron, torch and Triton) instead of running")
    args = p.parse_args(argv)
    if args.dry_run:
        defaults = {"batch": [2], "steps": [1, 4], "hidden": [16, 40], "dtype": ["fp32"]}
    elif args.quick:
        defaults = {"batch": [256], "steps": [100, 1000], "hidden": [128, 512], "dtype": ["bf16"]}
    else:
        defaults = {"batch": [256, 32], "steps": [100, 1000], "hidden": [256, 512, 1024, 2048],
                    "dtype": ["fp32", "bf16"]}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any generated kernel is imported

import torch  # noqa: E402  (after TRITON_INTERPRET is set)
import triton  # noqa: E402

import flexgen  # noqa: E402
from flexgen.launch.recurrent.fused import RecurrentConfig, resident_programs  # noqa: E402
from bench_lif import SigmoidSpike  # noqa: E402  (flexgen's default surrogate, for the torch loop)
from bench_recurrent_host import graph_ms as replayed_ms  # noqa: E402  (a step replayed from a CUDA graph)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- the neurons, as flexgen specs and torch loops


@flexgen.neuron(states=("mem",))
def leaky(x, mem, beta=0.9, threshold=1.0, surrogate=flexgen.surrogate.ATan()):
    """snnTorch's Leaky with reset by subtraction, the neuron of its RLeaky: the reset comes from the previous
    membrane, and it fires on mem > threshold (1 - Θ(threshold - mem); flexgen's Θ fires on >= 0)."""
    reset = 1.0 - flexgen.detach(flexgen.spike(threshold - mem, surrogate))
    mem_new = beta * mem + x - reset * threshold
    s = 1.0 - flexgen.spike(threshold - mem_new, surrogate)
    return s, mem_new


SPECS = {"leaky": (leaky, {}), "alif": (flexgen.neurons.alif, {})}


class ATanSpike(torch.autograd.Function):
    """Θ(z > 0) forward; snnTorch's ATan surrogate (alpha 2) backward: 1 / (1 + (pi z)^2)."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return (z > 0).to(z.dtype)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return g / (1.0 + (math.pi * z) ** 2)


def leaky_cell(current_t, state, weight, bias):
    """One step of the recurrent leaky layer; `state` = (s, mem) after the previous step."""
    s, mem = state
    beta, threshold = 0.9, 1.0
    reset = (mem > threshold).to(mem.dtype)
    mem = beta * mem + (current_t + s @ weight.t() + bias) - reset * threshold
    s = ATanSpike.apply(mem - threshold)
    return s, (s, mem)


def alif_cell(current_t, state, weight, bias):
    """One step of the recurrent adaptive LIF (flexgen.neurons.alif's defaults); `state` = (s, v, a)."""
    s, v, a = state
    alpha, rho, beta, v_threshold = math.exp(-1.0 / 20.0), math.exp(-1.0 / 200.0), 1.8, 1.0
    x = current_t + s @ weight.t() + bias
    h = alpha * v + (1.0 - alpha) * x
    threshold = v_threshold + beta * a
    s = SigmoidSpike.apply(h - threshold)
    v = h - s * threshold
    a = rho * a + (1.0 - rho) * s
    return s, (s, v, a)


CELLS = {"leaky": (leaky_cell, 2), "alif": (alif_cell, 3)}


_COMPILED = {}


def compiled_cell(neuron):
    """The step compiled once per neuron (and recompiled by dynamo per shape and dtype: allow one per configuration)."""
    if neuron not in _COMPILED:
        for limit in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 256)
        _COMPILED[neuron] = torch.compile(CELLS[neuron][0], dynamic=False)
    return _COMPILED[neuron]


def torch_loop(neuron, compiled=False):
    """The recurrent layer as a Python loop over the steps of the projected input `current` [T, B, H], the step
    as written or compiled by torch.compile (once per shape: the loop itself is not unrolled into the graph)."""
    cell, n_states = CELLS[neuron]
    if compiled:
        cell = compiled_cell(neuron)

    def loop(current, weight, bias):
        state = tuple(torch.zeros_like(current[0]) for _ in range(n_states))
        out = []
        for t in range(current.shape[0]):
            s, state = cell(current[t], state, weight, bias)
            out.append(s)
        return torch.stack(out)

    return loop


# ---------------------------------------------------------------- the candidates


class Net(torch.nn.Module):
    """Input projection, then a recurrent layer `layer(current) -> spikes` whose recurrent weight and bias are
    `self.weight`, `self.bias` (a flexgen layer holds its own)."""

    def __init__(self, hidden, layer=None, loop=None):
        super().__init__()
        self.proj = torch.nn.Linear(INPUTS, hidden)
        self.layer, self.loop = layer, loop
        if loop is not None:
            self.weight = torch.nn.Parameter(torch.empty(hidden, hidden))
            self.bias = torch.nn.Parameter(torch.empty(hidden))

    def recurrent(self, current):
        if self.loop is not None:
            return self.loop(current, self.weight, self.bias)
        if isinstance(self.layer, flexgen.Recurrent):
            self.layer.reset()  # every call is a new sequence (the layer would continue from the last one)
        return self.layer(current)

    def forward(self, x):
        return self.recurrent(self.proj(x))


def recurrent_parameters(net):
    """(weight, bias) of a candidate's recurrent layer, whatever holds them."""
    if net.loop is not None:
        return net.weight, net.bias
    if isinstance(net.layer, flexgen.Recurrent):
        return net.layer.weight, net.layer.bias
    return net.layer.recurrent.weight, net.layer.recurrent.bias  # snnTorch RLeaky


def same_weights(nets, seed):
    """Every candidate gets the same projection and recurrent weights."""
    g = torch.Generator().manual_seed(seed)
    first = nets[0]
    hidden = first.proj.out_features
    with torch.no_grad():
        bound = 1.0 / math.sqrt(hidden)
        proj_w = torch.empty(hidden, INPUTS).uniform_(-1 / math.sqrt(INPUTS), 1 / math.sqrt(INPUTS), generator=g) * 8.0
        proj_b = torch.empty(hidden).uniform_(-bound, bound, generator=g)
        rec_w = torch.empty(hidden, hidden).uniform_(-bound, bound, generator=g) * 2.0
        rec_b = torch.empty(hidden).uniform_(-bound, bound, generator=g)
        for net in nets:
            net.proj.weight.copy_(proj_w)
            net.proj.bias.copy_(proj_b)
            w, b = recurrent_parameters(net)
            w.copy_(rec_w)
            b.copy_(rec_b)


def flexgen_net(neuron, hidden, path, config, backend):
    spec, params = SPECS[neuron]
    layer = flexgen.Recurrent(spec, hidden=hidden, bias=True, path=path, backend=backend, config=config, **params)
    return Net(hidden, layer=layer)


class SnnTorchRLeaky(torch.nn.Module):
    """snnTorch's RLeaky over a sequence, its own step loop; in 16-bit dtypes under autocast (its spikes are fp32)."""

    def __init__(self, hidden, dtype):
        super().__init__()
        import snntorch

        self.recurrent_layer = snntorch.RLeaky(beta=0.9, threshold=1.0, linear_features=hidden)
        self.recurrent = self.recurrent_layer.recurrent
        self.autocast = dtype in (torch.bfloat16, torch.float16)
        self.dtype = dtype

    def forward(self, current):
        device_type = current.device.type
        with torch.autocast(device_type, dtype=self.dtype, enabled=self.autocast):
            spk, mem = self.recurrent_layer.init_rleaky()
            out = []
            for t in range(current.shape[0]):
                spk, mem = self.recurrent_layer(current[t], spk, mem)
                out.append(spk)
            return torch.stack(out).to(current.dtype)


def candidates(args, batch, hidden, dtype, device):
    """name -> Net (or a note why it is not run), all with the same weights."""
    backend = "triton" if device.type == "cuda" or args.dry_run else "auto"
    config = fused_config(args)
    nets, notes = {}, {}
    tiling = config.tiling(batch, hidden, dtype, resident_programs(device))
    if isinstance(tiling, str):
        notes["flexgen fused"] = tiling
    else:
        nets["flexgen fused"] = flexgen_net(args.neuron, hidden, "fused", config, backend)
    if not args.peers:
        skipped = ("flexgen stepwise", *(p for p in PEERS if args.neuron == "leaky" or "snnTorch" not in p))
        notes.update({name: "not run (--no-peers)" for name in skipped})
    else:
        nets.update(others(args, hidden, dtype, config, backend, notes))
    on_device = {}
    for name, net in nets.items():
        keep_fp32 = name == "snnTorch RLeaky"  # runs under autocast
        on_device[name] = net.to(device) if keep_fp32 else net.to(device=device, dtype=dtype)
    if on_device:
        same_weights(list(on_device.values()), seed=hidden)
        if "snnTorch RLeaky" in on_device:
            on_device["snnTorch RLeaky"].proj.to(dtype)  # the projection in the I/O dtype like everyone else's
    return on_device, notes


def others(args, hidden, dtype, config, backend, notes):
    """The step-wise path and the peers (notes where one does not run)."""
    nets = {"flexgen stepwise": flexgen_net(args.neuron, hidden, "stepwise", config, backend),
            "torch loop": Net(hidden, loop=torch_loop(args.neuron))}
    if args.compile:
        nets["torch.compile"] = Net(hidden, loop=torch_loop(args.neuron, compiled=True))
    else:
        notes["torch.compile"] = "not run (--no-compile)"
    if args.neuron == "leaky":
        try:
            nets["snnTorch RLeaky"] = Net(hidden, layer=SnnTorchRLeaky(hidden, dtype))
        except ImportError:
            notes["snnTorch RLeaky"] = "snntorch not installed"
    return nets


def fused_config(args):
    overrides = {k: getattr(args, k) for k in ("max_hidden", "block_k", "num_warps", "num_stages", "split", "max_tile",
                                               "stationary") if getattr(args, k) is not None}
    return RecurrentConfig()._replace(**overrides)


# ---------------------------------------------------------------- timing


def timer(args):
    """ms of fn: do_bench's median on a GPU; a median of a few calls on the CPU (dry run)."""
    if args.dry_run:
        def cpu_median(fn, grad_to_none=()):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return statistics.median(times)
        return cpu_median

    def gpu_median(fn, grad_to_none=()):
        return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=list(grad_to_none), return_mode="median")
    return gpu_median


def time_candidate(net, x, grad, measure, device):
    """ms and peak MiB of a candidate's training step; its first step (which compiles or generates) untimed, but
    its seconds recorded."""
    step = training_step(net, x, grad)
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    result = {"ms": measure(step, grad_to_none=list(net.parameters())), "peak_mib": peak_mib(step, device),
              "first_call_s": first_s}
    if isinstance(net.layer, flexgen.Recurrent):
        result["path"] = net.layer.path
    return result


def training_step(net, x, grad):
    def step():
        net(x).backward(grad)
    return step


def peak_mib(fn, device):
    """Peak memory of one call above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def make_data(batch, steps, hidden, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.rand(steps, batch, INPUTS, generator=g, device=device) < EVENT_RATE).to(dtype)
    grad = torch.randn(steps, batch, hidden, generator=g, device=device).to(dtype)
    return x, grad


def matmul_rate(batch, steps, hidden, dtype, device, measure):
    """FLOP/s of one torch.matmul [T B, H] x [H, H]: the GPU's dense rate at the recurrent product's sizes."""
    a = torch.randn(steps * batch, hidden, device=device).to(dtype)
    w = torch.randn(hidden, hidden, device=device).to(dtype)
    ms = measure(lambda: torch.matmul(a, w))
    return 2 * steps * batch * hidden * hidden / (ms * 1e-3)


def recurrent_flops(batch, steps, hidden):
    """Forward product, backward product and the weight's gradient: 3 x 2 (T - 1) B H^2."""
    return 3 * 2 * max(steps - 1, 0) * batch * hidden * hidden


def check_agreement(nets, x, reference="flexgen fused"):
    """Share of spikes of each candidate that differ from the reference's (printed; rounding may flip a few)."""
    if not nets:
        return {}
    ref_name = reference if reference in nets else next(iter(nets))
    with torch.no_grad():
        ref = nets[ref_name](x)
        shares = {name: (net(x) != ref).float().mean().item() for name, net in nets.items() if name != ref_name}
    for name, share in shares.items():
        if share > 1e-3:
            print(f"# warning: {name} differs from {ref_name} on {share:.2%} of spikes")
    return shares


# ---------------------------------------------------------------- torch.compile in a child process


# ---------------------------------------------------------------- the run


def run(args, on_row=lambda rows: None):
    """The rows of the grid; `on_row(rows)` after each (the record so far is written: a run cut short keeps them)."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    measure = timer(args)
    rows = []
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        for batch in args.batch:
            for hidden in args.hidden:
                for steps in args.steps:
                    rows.append(run_configuration(args, batch, steps, hidden, dtype_name, dtype, device, measure))
                    print(summary_line(rows[-1]), flush=True)
                    on_row(rows)
    return rows


def run_configuration(args, batch, steps, hidden, dtype_name, dtype, device, measure):
    nets, notes = candidates(args, batch, hidden, dtype, device)
    x, grad = make_data(batch, steps, hidden, dtype, device, seed=steps * 7 + hidden)
    row = {"batch": batch, "steps": steps, "hidden": hidden, "dtype": dtype_name, "candidates": {}}
    for name, net in nets.items():
        try:
            row["candidates"][name] = time_candidate(net, x, grad, measure, device)
        except Exception as exc:  # noqa: BLE001 - e.g. kernels that do not fit the GPU: one candidate, not the run
            note = f"failed: {type(exc).__name__}: {exc}"[:300]
            print(f"# {name}: {note}")
            row["candidates"][name] = {"note": note}
    for name, note in notes.items():
        row["candidates"][name] = {"note": note}
    ran = {name: net for name, net in nets.items() if "ms" in row["candidates"][name]}
    row["agreement"] = check_agreement(ran, x)
    if "flexgen fused" in ran:
        share = matmul_share(nets["flexgen fused"], batch, steps, hidden, dtype, device, measure)
        row["matmul"] = dict(share, batch=batch)
    return row


def matmul_share(net, batch, steps, hidden, dtype, device, measure):
    """The fused recurrent layer alone, fwd + bwd, as users call it and captured in a CUDA graph (its kernels
    with no host time, as cuBLAS's floor is measured), and the share of the matmul rate its products reach."""
    g = torch.Generator(device=device).manual_seed(1)
    current = torch.randn(steps, batch, hidden, generator=g, device=device).to(dtype).requires_grad_()
    grad = torch.randn(steps, batch, hidden, generator=g, device=device).to(dtype)

    def layer_step():
        net.layer.reset()
        net.layer(current).backward(grad)

    fresh = [current, *net.layer.parameters()]

    def fresh_layer_step():  # as do_bench's grad_to_none: gradients set, not added to the last step's
        for tensor in fresh:
            tensor.grad = None
        layer_step()

    layer_step()
    layer_ms = measure(layer_step, grad_to_none=fresh)
    graph_ms = replayed_ms(fresh_layer_step, rep=200) if device.type == "cuda" else None
    rate = matmul_rate(batch, steps, hidden, dtype, device, measure)
    flops = recurrent_flops(batch, steps, hidden)
    floor_ms = matmul_floor(batch, steps, hidden, dtype, device, measure)
    tiling = net.layer.config.tiling(batch, hidden, dtype, resident_programs(device))
    return {"layer_ms": layer_ms, "matmul_tflops": rate / 1e12, "share": flops / (layer_ms * 1e-3) / rate,
            "floor_ms": floor_ms, "graph_ms": graph_ms, "tiling": tiling._asdict()}


def matmul_floor(batch, steps, hidden, dtype, device, measure):
    """ms that cuBLAS takes for the layer's recurrent products, in the same dtype: per step s_{t-1} W^T (forward)
    and grad_I_t W (backward), T - 1 of each, and the weight's gradient, one product over all steps. Replayed from
    a CUDA graph on a GPU, so that the launches' host time does not count."""
    g = torch.Generator(device=device).manual_seed(2)
    spikes = (torch.rand(steps, batch, hidden, generator=g, device=device) < 0.2).to(dtype)
    grads = torch.randn(steps, batch, hidden, generator=g, device=device).to(dtype)
    weight = torch.randn(hidden, hidden, generator=g, device=device).to(dtype)
    out = torch.empty(batch, hidden, device=device, dtype=dtype)

    def products():
        for t in range(1, steps):
            torch.matmul(spikes[t - 1], weight.t(), out=out)
            torch.matmul(grads[t], weight, out=out)
        grads[1:].reshape(-1, hidden).t() @ spikes[:-1].reshape(-1, hidden)

    if device.type != "cuda":
        return measure(products)
    return triton.testing.do_bench_cudagraph(products, rep=200, return_mode="median")


PEERS = ("torch loop", "torch.compile", "snnTorch RLeaky")


def speedups(row):
    """The fused kernels' speed-up over the fastest peer and over the step-wise path, where both ran."""
    times = {k: v["ms"] for k, v in row["candidates"].items() if "ms" in v}
    fused = times.get("flexgen fused")
    peers = [times[p] for p in PEERS if p in times]
    return {
        "vs_fastest_peer": fused and peers and min(peers) / fused or None,
        "vs_stepwise": fused and "flexgen stepwise" in times and times["flexgen stepwise"] / fused or None,
    }


def summary_line(row):
    parts = [f"B={row['batch']} T={row['steps']} H={row['hidden']} {row['dtype']}:"]
    for name, c in row["candidates"].items():
        parts.append(f"{name} {c['ms']:.3f} ms" if "ms" in c else f"{name} ({c.get('note')})")
    gains = speedups(row)
    if gains["vs_fastest_peer"]:
        parts.append(f"fused {gains['vs_fastest_peer']:.1f}x the fastest peer")
    return "  ".join(parts)


def markdown(rows, device_name, neuron, record=None):
    names = []
    for row in rows:
        names += [n for n in row["candidates"] if n not in names]
    lines = [f"# Recurrent layers, SHD-shaped ({neuron}; {device_name})", ""]
    if record is not None:  # where the figures come from
        commands = record.get("commands") or [record.get("command")]
        dates = ", ".join(sorted(set(record.get("dates") or [record.get("date") or "undated"])))
        lines += ["; ".join(f"`{c}`" for c in commands) + f" ({dates}; torch {record.get('torch')}, Triton "
                  f"{record.get('triton')})", ""]
    lines += ["Training step (forward + backward) of nn.Linear(700, H) + a recurrent layer of H neurons, ms "
              "(median of triton.testing.do_bench); peak MiB above the step's start in brackets.", "",
              "| B | T | H | dtype | " + " | ".join(names) + " | fused / fastest peer | fused / stepwise | "
              "layer alone, ms | its products in cuBLAS, ms | layer / cuBLAS | layer in a CUDA graph, ms | "
              "graph / cuBLAS | programs (slices of) |",
              "|" + "---|" * (len(names) + 12)]
    for row in rows:
        cells = []
        for name in names:
            c = row["candidates"].get(name, {})
            if "ms" in c:
                memory = f" ({c['peak_mib']:.0f})" if c.get("peak_mib") is not None else ""
                cells.append(f"{c['ms']:.2f}{memory}")
            else:
                cells.append(c.get("note", ""))
        gains = speedups(row)
        lines.append(f"| {row['batch']} | {row['steps']} | {row['hidden']} | {row['dtype']} | " + " | ".join(cells)
                     + f" | {_times(gains['vs_fastest_peer'])} | {_times(gains['vs_stepwise'])} | "
                     + _floor_cells(row.get("matmul")) + " |")
    return "\n".join(lines) + "\n"


def _floor_cells(matmul):
    """The fused layer alone against its products in cuBLAS, and its programs: row tiles x slices (neurons)."""
    if not matmul:
        return " |  |  |  |  | "
    tiling = matmul["tiling"]
    programs = -(-matmul["batch"] // tiling["block_b"]) * tiling["split"]
    floor, graph = matmul["floor_ms"], matmul.get("graph_ms")  # (older records have no graph)
    graph_cells = f"{graph:.2f} | {graph / floor:.2f}" if graph else " | "
    return (f"{matmul['layer_ms']:.2f} | {floor:.2f} | {matmul['layer_ms'] / floor:.2f} | {graph_cells} | "
            f"{programs} ({tiling['block']}{', stationary' if tiling.get('stationary') else ''})")


def _times(value):
    return f"{value:.1f}x" if value else ""


MERGED_FIELDS = ("device", "neuron", "torch", "triton")  # what merged records must share


def merged(records):
    """One record of several runs' records: their rows in order, with their commands, dates and launch settings;
    an error where they differ in GPU, neuron, torch or Triton (their figures would not compare)."""
    for field in MERGED_FIELDS:
        values = sorted({str(r.get(field)) for r in records})
        if len(values) > 1:
            raise ValueError(f"the records differ in {field} ({', '.join(values)}): merge runs of one setup only")
    return {**{field: records[0].get(field) for field in MERGED_FIELDS}, "flexgen": records[0].get("flexgen"),
            "commands": [c for r in records for c in r.get("commands", [r.get("command")])],
            "dates": [d for r in records for d in r.get("dates", [r.get("date")]) if d],
            "configs": [c for r in records for c in r.get("configs", [r.get("config")])],
            "rows": [row for r in records for row in r["rows"]]}


def write_record(out, record, neuron):
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_recurrent.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "bench_recurrent.md").write_text(markdown(record["rows"], record["device"], neuron, record))


def main(args):
    if args.merge:
        try:
            record = merged([json.loads(pathlib.Path(p).read_text()) for p in args.merge])
        except ValueError as exc:
            sys.exit(f"bench_recurrent.py --merge: {exc}")
        out = pathlib.Path(args.out or "docs/perf")
        write_record(out, record, record["neuron"])
        print(f"wrote {out / 'bench_recurrent.json'} and {out / 'bench_recurrent.md'}")
        return
    out = pathlib.Path(args.out or (tempfile.mkdtemp(prefix="bench-recurrent-") if args.dry_run else "docs/perf"))
    device_name = "CPU dry run (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name()
    record = {"command": "python benchmarks/bench_recurrent.py " + " ".join(sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "device": device_name, "neuron": args.neuron,
              "config": fused_config(args)._asdict(), "torch": torch.__version__, "triton": triton.__version__,
              "flexgen": flexgen.__version__, "rows": []}
    rows = run(args, on_row=lambda rows: write_record(out, dict(record, rows=rows), args.neuron))
    write_record(out, dict(record, rows=rows), args.neuron)
    print(f"wrote {out / 'bench_recurrent.json'} and {out / 'bench_recurrent.md'}")


if __name__ == "__main__":
    main(ARGS)
