"""LIF forward+backward and inference benchmark: flexgen vs a torch loop, torch.compile, SpikingJelly.

Run on a GPU:  python benchmarks/bench_lif.py [--out DIR] [--quick]
Writes bench_lif.json and bench_lif.md (and bench_lif.png with matplotlib) to DIR (default docs/perf).
Times are medians of three triton.testing.do_bench medians (ms), the candidates timed in turn; training steps are
also timed as CUDA-graph replays (no host time). The floor is the bytes flexgen's design must move
divided by the measured device-to-device copy bandwidth; "copy, same bytes" times a copy that moves
as many bytes, which is what a perfect streaming kernel of that size reaches.
"""
import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time

import torch
import triton

import flexgen
from flexgen import spike

N, C = 64, 65536


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = spike(h - v_th)
    return s, h * (1.0 - s)


@flexgen.neuron(states=("v", "a"))
def custom(x, y, v, a, tau=2.0, v_th=1.0, beta=0.5, tau_a=4.0):
    h = v + (x - v) / tau
    theta = v_th + beta * a
    s = spike(h - theta)
    m = flexgen.sigmoid(y)
    v_next = m * h * (1.0 - s) + (1.0 - m) * (h - s * theta)
    return s, h, v_next, a + (s - a) / tau_a


class SigmoidSpike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return (z >= 0).to(z.dtype)

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        sg = torch.sigmoid(4.0 * z)
        return g * 4.0 * sg * (1 - sg)


def torch_lif_loop(x, tau=2.0, v_th=1.0):
    """The spike sequence and the final v."""
    v = torch.zeros_like(x[0])
    out = []
    for t in range(x.shape[0]):
        h = v + (x[t] - v) / tau
        s = SigmoidSpike.apply(h - v_th)
        v = h * (1.0 - s)
        out.append(s)
    return torch.stack(out), v


def keeping_state(loop):
    """`loop` as a layer: returns the spikes and keeps the final state, as every other candidate does."""
    held = {}

    def layer(x):
        s, held["v"] = loop(x)
        return s

    return layer


def torch_custom_loop(x, y, tau=2.0, v_th=1.0, beta=0.5, tau_a=4.0):
    v = torch.zeros_like(x[0])
    a = torch.zeros_like(x[0])
    ss, hs = [], []
    for t in range(x.shape[0]):
        h = v + (x[t] - v) / tau
        theta = v_th + beta * a
        s = SigmoidSpike.apply(h - theta)
        m = torch.sigmoid(y[t])
        v = m * h * (1.0 - s) + (1.0 - m) * (h - s * theta)
        a = a + (s - a) / tau_a
        ss.append(s)
        hs.append(h)
    return torch.stack(ss), torch.stack(hs)


def copy_bandwidth():
    """Bytes read + written per second by a large device-to-device copy."""
    a = torch.rand(512 * 2**20 // 4, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    return 2 * a.numel() * 4 / (ms * 1e-3)


def bench(fn, x_list):
    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=x_list, return_mode="median")


def lif_candidates(dtype):
    """name -> callable(x) returning the spike sequence (fresh state per call)."""
    layer, plain, recomputing = lif(), lif(recompute=False), lif(recompute=True)
    cands = {
        "flexgen": lambda x: (layer.reset(), layer(x))[1],
        "flexgen recompute=False": lambda x: (plain.reset(), plain(x))[1],
        "flexgen recompute=True": lambda x: (recomputing.reset(), recomputing(x))[1],
        "torch loop": keeping_state(torch_lif_loop),
        "torch.compile": keeping_state(torch.compile(torch_lif_loop, dynamic=False)),
    }
    try:
        from spikingjelly.activation_based import neuron, surrogate

        # SpikingJelly 2.0 picks its CUDA (Triton) multi-step kernel itself; older versions took backend="triton".
        sj_kwargs = dict(tau=2.0, v_threshold=1.0, v_reset=0.0, surrogate_function=surrogate.Sigmoid(alpha=4.0), step_mode="m")
        try:
            sj = neuron.LIFNode(**sj_kwargs, backend="triton").cuda()
        except TypeError:
            sj = neuron.LIFNode(**sj_kwargs).cuda()

        def sj_lif(x):
            sj.reset()
            return sj(x)

        cands["SpikingJelly LIFNode"] = sj_lif

        def core(x, v):
            h = v + (x - v) / 2.0
            s = surrogate.Sigmoid(alpha=4.0)(h - 1.0)
            return s, h * (1.0 - s)

        flex = neuron.FlexSN(core, num_states=1, step_mode="m").cuda()

        def sj_flex(x):
            flex.reset()
            return flex(x)

        cands["FlexSN"] = sj_flex
    except Exception as exc:  # noqa: BLE001 - any import/setup failure just drops the column
        print(f"# SpikingJelly not available: {type(exc).__name__}: {exc}")
    return cands


def lif_bytes(T, dtype, training):
    """Bytes flexgen's design moves: x read, s written, the final state written (the layer keeps it);
    training adds h written and read, and grad_x written. The initial state is a constant: no pass."""
    step = N * C * torch.finfo(dtype).bits // 8
    return step * (T * (5 if training else 2) + 1)


def lif_recompute_bytes(T, dtype):
    """Bytes of recompute=True's training: x read twice, s and grad_x written, the final state written, and
    the fp32 checkpoints (the states before every chunk but the first) written and read."""
    from flexgen.launch.allocate import n_checkpoints

    chunk = lif.compiled().ops_for(True).layout.variant.chunk
    step = N * C * torch.finfo(dtype).bits // 8
    return step * (T * 4 + 1) + 2 * n_checkpoints(T, chunk) * N * C * 4


TRAIN_ONLY = {"flexgen recompute=False", "flexgen recompute=True"}  # their inference is flexgen's (the same kernel)


def default_design(dtype):
    """The design a default layer (recompute="auto") trains with on CUDA for this dtype."""
    return "recompute" if lif.compiled().recompute_pays(dtype) else "plain"


def same_size_copy_ms(n_bytes, dtype):
    """A device-to-device copy that reads and writes `n_bytes` in all: what a perfect streaming kernel of
    this size could reach (small copies fall short of the large-copy bandwidth the floor uses)."""
    src = torch.rand(n_bytes // 2 // (torch.finfo(dtype).bits // 8), device="cuda").to(dtype)
    dst = torch.empty_like(src)
    return triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")


def check_agreement(cands, x):
    ref = torch_lif_loop(x.float())[0].to(x.dtype)
    for name, fn in cands.items():
        with torch.no_grad():
            y = fn(x)
        mism = (y != ref).float().mean().item()
        if mism > 1e-3:
            print(f"# warning: {name} spikes differ from the torch loop on {mism:.2%} of elements")


ROUNDS = 3  # each time is the median of this many do_bench medians, the candidates taken in turn


def run_lif(results, bandwidth, Ts, dtypes):
    for dtype in dtypes:
        cands = lif_candidates(dtype)
        inputs = {T: torch.rand(T, N, C, device="cuda", dtype=dtype) * 2.0 for T in Ts}
        for x in inputs.values():  # compiles every shape first: no compile workers busy while a later T is timed
            check_agreement(cands, x)
        for T, x in inputs.items():
            x.requires_grad_(True)
            times = {name: {"train_ms": [], "infer_ms": []} for name in cands}
            for _ in range(ROUNDS):  # in turn, so a slow spell of the host does not land on one candidate
                for name, fn in cands.items():
                    if times[name] is None:
                        continue
                    try:
                        times[name]["train_ms"].append(bench(lambda: fn(x).sum().backward(), [x]))
                        if name not in TRAIN_ONLY:
                            with torch.no_grad():
                                times[name]["infer_ms"].append(bench(lambda: fn(x), []))
                    except Exception as exc:  # noqa: BLE001
                        print(f"# {name} T={T} {dtype} failed: {type(exc).__name__}: {exc}")
                        times[name] = None
            for name, t in times.items():
                if t is not None:
                    row = {"bench": "lif", "impl": name, "T": T, "dtype": str(dtype).split(".")[-1]}
                    row.update({mode: statistics.median(ms) for mode, ms in t.items() if ms})
                    if name == "flexgen":
                        row["design"] = default_design(dtype)
                    results.append(row)
            for mode, training in (("train_ms", True), ("infer_ms", False)):
                n_bytes = lif_bytes(T, dtype, training)
                dt = str(dtype).split(".")[-1]
                design_bytes = lif_recompute_bytes(T, dtype) if training and default_design(dtype) == "recompute" else n_bytes
                results.append({"bench": "lif", "impl": "copy, same bytes", "T": T, "dtype": dt, mode: same_size_copy_ms(design_bytes, dtype)})
                results.append({"bench": "lif", "impl": "floor", "T": T, "dtype": dt, mode: n_bytes / bandwidth * 1e3})
            results.append({"bench": "lif", "impl": "floor, recompute", "T": T, "dtype": str(dtype).split(".")[-1],
                            "train_ms": lif_recompute_bytes(T, dtype) / bandwidth * 1e3})


def graphed_training_step(fn, x):
    """One training step of `fn` on `x` captured in a CUDA graph (warmed up on a side stream first), and
    `x.grad` after one replay next to an eager step's: replays run the kernels with no host work."""
    def step():
        fn(x).sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    replayed = x.grad.clone()
    x.grad = None
    step()
    agree = torch.equal(replayed, x.grad)
    x.grad = None
    return graph, agree


def run_graphed(results, bandwidth, Ts, dtypes):
    """Training steps replayed from CUDA graphs: the GPU's time for each candidate, host time removed."""
    for dtype in dtypes:
        cands = {name: fn for name, fn in lif_candidates(dtype).items() if name in GRAPHED}
        for T in Ts:
            x = (torch.rand(T, N, C, device="cuda", dtype=dtype) * 2.0).requires_grad_()
            graphs, times = {}, {}
            for name, fn in cands.items():
                # A leaf of its own: a candidate keeps its last step's graph (its state), and with it the
                # leaf's gradient accumulator, made on another stream than the next capture's.
                leaf = x.detach().clone().requires_grad_()
                try:
                    graphs[name], agree = graphed_training_step(fn, leaf)
                except Exception as exc:  # noqa: BLE001
                    print(f"# {name} T={T} {dtype} could not be captured: {type(exc).__name__}: {exc}")
                    continue
                if not agree:
                    print(f"# warning: {name} T={T} {dtype}: the replayed gradient differs from an eager step's")
                times[name] = []
            for _ in range(ROUNDS):
                for name, graph in graphs.items():
                    times[name].append(triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median"))
            dt = str(dtype).split(".")[-1]
            for name, t in times.items():
                results.append({"bench": "lif graphed", "impl": name, "T": T, "dtype": dt, "train_ms": statistics.median(t)})
            n_bytes = lif_recompute_bytes(T, dtype) if default_design(dtype) == "recompute" else lif_bytes(T, dtype, True)
            results.append({"bench": "lif graphed", "impl": "floor", "T": T, "dtype": dt, "train_ms": n_bytes / bandwidth * 1e3})
            del graphs
            torch.cuda.empty_cache()


GRAPHED = ("flexgen", "torch.compile")  # the candidates timed from CUDA graphs too


def run_custom(results):
    T, dtype = 16, torch.float32
    x = torch.rand(T, N, C, device="cuda", dtype=dtype).requires_grad_()
    y = torch.randn(T, N, C, device="cuda", dtype=dtype).requires_grad_()
    layer = custom()

    def fg():
        layer.reset()
        s, h = layer(x, y)
        (s.sum() + h.sum()).backward()

    impls = {"flexgen": fg, "torch loop": lambda: sum(o.sum() for o in torch_custom_loop(x, y)).backward()}
    try:
        from spikingjelly.activation_based import neuron, surrogate

        def core(x, y, v, a):
            h = v + (x - v) / 2.0
            theta = 1.0 + 0.5 * a
            s = surrogate.Sigmoid(alpha=4.0)(h - theta)
            m = torch.sigmoid(y)
            v_next = m * h * (1.0 - s) + (1.0 - m) * (h - s * theta)
            return s, h, v_next, a + (s - a) / 4.0

        flex = neuron.FlexSN(core, num_states=2, step_mode="m").cuda()

        def sj():
            flex.reset()
            s, h = flex(x, y)
            (s.sum() + h.sum()).backward()

        impls["FlexSN"] = sj
    except Exception as exc:  # noqa: BLE001
        print(f"# FlexSN custom neuron unavailable: {exc}")
    for name, fn in impls.items():
        try:
            ms = bench(fn, [x, y])
        except Exception as exc:  # noqa: BLE001
            print(f"# custom {name} failed: {type(exc).__name__}: {exc}")
            continue
        results.append({"bench": "custom", "impl": name, "T": T, "dtype": "float32", "train_ms": ms})


STARTUP = textwrap.dedent(
    """
    import time, torch
    torch.zeros(1, device="cuda")  # CUDA context first: its start-up is not flexgen's
    t0 = time.perf_counter()
    import flexgen
    t1 = time.perf_counter()
    @flexgen.neuron(states=("v",))
    def lif(x, v, tau=2.0, v_th=1.0):
        h = v + (x - v) / tau
        s = flexgen.spike(h - v_th)
        return s, h * (1.0 - s)
    x = torch.rand(8, 64, 4096, device="cuda", requires_grad=True)
    lif()(x).sum().backward()
    torch.cuda.synchronize()
    print(t1 - t0, time.perf_counter() - t1, time.time())
    """
)


@flexgen.neuron(states=("v", "i_syn", "a", "trace"))
def four_state(x, v, i_syn, a, trace, tau_v=2.0, tau_syn=4.0, tau_a=20.0, tau_tr=10.0, v_th=1.0, beta=0.2):
    """Synaptic current, adaptation and a spike trace around a LIF: four states to derive."""
    i_next = i_syn + (x - i_syn) / tau_syn
    h = v + (i_next - v) / tau_v - a
    s = spike(h - v_th)
    a_next = a + (beta * s - a) / tau_a
    trace_next = trace + (s - trace) / tau_tr
    return s, trace_next, h * (1.0 - s), i_next, a_next, trace_next


DERIVE = textwrap.dedent(
    """
    import time
    from bench_lif import four_state
    t0 = time.perf_counter()
    four_state.compiled()
    print(time.perf_counter() - t0)
    """
)


def run_derive(results, tmp):
    """Seconds to trace, derive, render, write and load a four-state neuron, in a fresh process, empty cache."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, FLEXGEN_CACHE_DIR=os.path.join(tmp, "fg-derive"))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")  # the installed flexgen, or PYTHONPATH's
    out = subprocess.run([sys.executable, "-c", DERIVE], env=env, capture_output=True, text=True, check=True)
    results.append({"bench": "derive", "impl": "flexgen", "seconds": float(out.stdout.split()[-1])})


def run_startup(results, tmp, repeats=3):
    """Seconds to import flexgen and to run a first LIF fwd+bwd after it, in fresh processes: cold (empty
    flexgen and Triton caches) then warm (the same caches), `repeats` times with new caches; medians."""
    env = dict(os.environ, PYTHONPYCACHEPREFIX=os.path.join(tmp, "pyc"))  # flexgen as installed (or on PYTHONPATH)
    # Bytecode as an installed package has it (pip writes it at install time). Some images set
    # PYTHONDONTWRITEBYTECODE, which would leave every process compiling sympy's, Triton's and flexgen's
    # sources (about 1.2 s on the H200 machine): a first run with throwaway caches writes the bytecode.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    runs = {"cold": [], "warm": []}
    for i in range(repeats + 1):
        caches = dict(env, FLEXGEN_CACHE_DIR=os.path.join(tmp, f"fg{i}"), TRITON_CACHE_DIR=os.path.join(tmp, f"tr{i}"))
        for label in ("cold", "warm") if i else ("bytecode",):  # run 0 only writes the bytecode
            started = time.time()
            out = subprocess.run([sys.executable, "-c", STARTUP], env=caches, capture_output=True, text=True, check=True)
            import_s, first_s, done = (float(v) for v in out.stdout.split()[-3:])
            if i:
                runs[label].append((import_s, first_s, done - started))
    for label, times in runs.items():
        import_s, first_s, process_s = (statistics.median(t[k] for t in times) for k in range(3))
        results.append({"bench": "startup", "impl": "flexgen", "cache": label, "import_s": import_s, "first_call_s": first_s,
                        "process_s": process_s, "runs": times})


def markdown(results, bandwidth, device):
    lines = [f"GPU: {device}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; input [T, {N}, {C}]; the median of three do_bench medians per cell, ms.", ""]
    for mode, title in (("train_ms", "LIF forward + backward (y.sum().backward())"), ("infer_ms", "LIF inference forward")):
        impls = []
        for r in results:
            if r["bench"] == "lif" and mode in r and r["impl"] not in impls:
                impls.append(r["impl"])
        if not impls:
            continue
        # flexgen's columns first, the references (copy, floors) last
        impls.sort(key=lambda i: (not i.startswith("flexgen"), i.startswith(("copy", "floor"))))
        note = {"train_ms": "The floors count each design's bytes, the copy those of the default layer's design; every "
                            "measured time also holds `y.sum()`, which reads `s` once more and launches its own kernel.",
                "infer_ms": "The floor and the copy count `x` read, `s` written and the final state written."}[mode]
        shares = ["flexgen, % of copy bandwidth"]
        if mode == "train_ms":
            note += (" \"flexgen\" is the default layer (`recompute=\"auto\"`), which trains with the design that moves "
                     "fewer bytes: `recompute=True` in fp32 (its floor: `x` read twice, `s` and `grad_x` written, fp32 "
                     "checkpoints of `v` every few steps written and read), `recompute=False` in fp16 (the plain floor); "
                     "its shares are on its design's bytes. The columns counting `y.sum()`'s read also count that read "
                     "of `s`, which the measured time holds: the share of copy bandwidth on all the bytes the measured "
                     "work moves.")
            shares += ["flexgen, counting `y.sum()`'s read"]
        lines += [f"### {title}", "", note, "", "| dtype | T | " + " | ".join(impls + shares) + " |",
                  "|---" * (len(impls) + len(shares) + 2) + "|"]
        keys = sorted({(r["dtype"], r["T"]) for r in results if r["bench"] == "lif"}, key=lambda k: (k[0], k[1]))
        for dt, T in keys:
            cell_rows = [r for r in results if r["bench"] == "lif" and r["dtype"] == dt and r["T"] == T]
            row = {r["impl"]: r[mode] for r in cell_rows if mode in r}
            design = next((r.get("design", "plain") for r in cell_rows if r["impl"] == "flexgen"), "plain")
            cells = [f"{row[i]:.3f}" if i in row else "—" for i in impls]
            sum_read_ms = T * N * C * torch.finfo(getattr(torch, dt)).bits // 8 / bandwidth * 1e3
            floor = "floor, recompute" if design == "recompute" and mode == "train_ms" else "floor"
            if floor in row and "flexgen" in row:
                cells.append(f"{row[floor] / row['flexgen']:.0%}")
                if mode == "train_ms":
                    cells.append(f"{(row[floor] + sum_read_ms) / row['flexgen']:.0%}")
            cells += ["—"] * (len(impls) + len(shares) - len(cells))
            lines.append(f"| {dt} | {T} | " + " | ".join(cells) + " |")
        lines.append("")
    graphed = [r for r in results if r["bench"] == "lif graphed"]
    if graphed:
        impls = list(dict.fromkeys(r["impl"] for r in graphed))
        lines += ["### LIF forward + backward without host time: one training step captured in a CUDA graph, replayed", "",
                  "The same step as the first table (`y.sum().backward()` included), timed as graph replays: the GPU's "
                  "time with Python, autograd and the launches taken out. The floor is that of the design the default "
                  "layer trains with; the share counts `y.sum()`'s read of `s`.", "",
                  "| dtype | T | " + " | ".join(impls) + " | flexgen, counting `y.sum()`'s read |", "|---" * (len(impls) + 3) + "|"]
        for dt, T in sorted({(r["dtype"], r["T"]) for r in graphed}):
            row = {r["impl"]: r["train_ms"] for r in graphed if r["dtype"] == dt and r["T"] == T}
            sum_read_ms = T * N * C * torch.finfo(getattr(torch, dt)).bits // 8 / bandwidth * 1e3
            share = f"{(row['floor'] + sum_read_ms) / row['flexgen']:.0%}" if "floor" in row and "flexgen" in row else "—"
            lines.append(f"| {dt} | {T} | " + " | ".join(f"{row[i]:.3f}" if i in row else "—" for i in impls) + f" | {share} |")
        lines.append("")
    custom = [r for r in results if r["bench"] == "custom"]
    if custom:
        lines += ["### Custom two-input/two-output/two-state neuron, fp32, T=16, forward + backward", "",
                  "| impl | ms |", "|---|---|"] + [f"| {r['impl']} | {r['train_ms']:.3f} |" for r in custom] + [""]
    start = [r for r in results if r["bench"] == "startup"]
    if start:
        lines += ["### Start-up: `import flexgen`, then defining a LIF and its first forward + backward (s, medians of fresh processes)", "",
                  "| flexgen and Triton caches | import flexgen | after import, to the first fwd+bwd done | from process start |",
                  "|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['import_s']:.2f} | {r['first_call_s']:.2f} | {r['process_s']:.2f} |" if "process_s" in r else
                  f"| {r['cache']} | {r['import_s']:.2f} | {r['first_call_s']:.2f} | — |" for r in start]
        lines += ["", "From process start: the interpreter, `import torch` and the CUDA context included.", ""]
    derive = [r for r in results if r["bench"] == "derive"]
    if derive:
        lines += ["### Generating a four-state neuron: trace, derive, render, write and load, empty cache (s)", "",
                  f"{derive[0]['seconds']:.2f}", ""]
    return "\n".join(lines)


def write_outputs(meta, out):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_lif.json"), "w") as f:
        json.dump(meta, f, indent=1)
    table = markdown(meta["results"], meta["copy_bandwidth_Bps"], meta["gpu"])
    table += f"\nCommand: `{meta['command']}` (torch {meta['torch']}, Triton {meta['triton']}).\n"
    with open(os.path.join(out, "bench_lif.md"), "w") as f:
        f.write(table)
    plot(meta, os.path.join(out, "bench_lif.png"))
    return table


def plot(meta, path):
    """fwd+bwd and inference time against T, one panel per (mode, dtype), log scale (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return
    lif = [r for r in meta["results"] if r["bench"] == "lif"]
    dtypes = sorted({r["dtype"] for r in lif})
    if not dtypes:
        return  # a start-up run: nothing to plot
    modes = (("train_ms", "forward + backward"), ("infer_ms", "inference"))
    fig, axes = plt.subplots(len(modes), len(dtypes), figsize=(5 * len(dtypes), 7), squeeze=False)
    for row, (mode, title) in enumerate(modes):
        for col, dtype in enumerate(dtypes):
            ax = axes[row][col]
            for impl in dict.fromkeys(r["impl"] for r in lif):
                points = sorted((r["T"], r[mode]) for r in lif if r["impl"] == impl and r["dtype"] == dtype and mode in r)
                if points:
                    style = {"floor": "k--", "floor, recompute": "k-.", "copy, same bytes": "k:", "flexgen": "o-",
                             "flexgen recompute=False": "v:", "flexgen recompute=True": "s:"}.get(impl, ".-")
                    ax.plot(*zip(*points), style, label=impl, linewidth=2.5 if impl.startswith("flexgen") else 1)
            ax.set(xscale="log", yscale="log", xlabel="T", ylabel="ms", title=f"LIF {title}, {dtype}")
            ax.set_xticks([4, 8, 16, 32], labels=["4", "8", "16", "32"])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{meta['gpu']}, input [T, {N}, {C}]")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge(paths, out):
    """One table from several runs on the same GPU (e.g. one run per dtype)."""
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    if len({r["gpu"] for r in runs}) != 1:
        raise SystemExit("refusing to merge runs from different GPUs")
    meta = dict(runs[0], results=[x for r in runs for x in r["results"]],
                copy_bandwidth_Bps=min(r["copy_bandwidth_Bps"] for r in runs),
                command=" ; ".join(r["command"] for r in runs))
    print(write_outputs(meta, out))
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "perf"))
    parser.add_argument("--quick", action="store_true", help="T=8 fp16 only")
    parser.add_argument("--dtype", choices=["float16", "float32"], help="one dtype only (and no custom/start-up runs for float32)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="combine result files of earlier runs into --out, no GPU needed")
    parser.add_argument("--startup", action="store_true", help="only the derive and start-up measurements")
    args = parser.parse_args()
    if args.merge:
        return merge(args.merge, args.out)
    if not torch.cuda.is_available():
        print("bench_lif needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name()
    # Every (T, dtype, grad mode) is its own graph for torch.compile; allow them all.
    dynamo_config = importlib.import_module("torch._dynamo").config
    dynamo_config.cache_size_limit = 256
    if hasattr(dynamo_config, "recompile_limit"):
        dynamo_config.recompile_limit = 256
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    results = []
    Ts, dtypes = ([8], [torch.float16]) if args.quick else ([4, 8, 16, 32], [torch.float16, torch.float32])
    if args.dtype:
        dtypes = [getattr(torch, args.dtype)]
    if not args.startup:
        run_lif(results, bandwidth, Ts, dtypes)
        run_graphed(results, bandwidth, Ts, dtypes)
    if not args.quick and args.dtype != "float32":
        if not args.startup:
            run_custom(results)
        import tempfile

        tmp = tempfile.mkdtemp()
        run_derive(results, tmp)
        run_startup(results, tmp)
    meta = {"gpu": device, "copy_bandwidth_Bps": bandwidth, "torch": torch.__version__, "triton": triton.__version__,
            "command": "python benchmarks/bench_lif.py " + " ".join(sys.argv[1:]), "results": results}
    print(write_outputs(meta, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
