"""LIF kernel timings by launch configuration: forward and backward kernels alone, and host overheads.

Run on a GPU: python benchmarks/kernel_variants.py [--quick] [--edits] [--regs] [--bounds]
For each (dtype, T, BLOCK, num_warps) prints the forward and backward kernel medians (do_bench) and
the fraction of copy bandwidth they reach on the bytes they must move; then the host-side cost of
one Triton launch and of a whole layer call. With --edits, instead: the kernels with edits of their
generated source that were tried and not adopted (cache hints, loading the next step's input early, the
time loop unrolled for a constexpr T),
beside a torch copy and a Triton copy of the inference kernel's bytes. With --regs: each kernel's
registers per thread and its time under a register cap (Triton's maxnreg), up to full occupancy.
With --bounds: what a launch costs under do_bench with no bytes to move, whether a persistent grid
(a few programs per SM looping over blocks) lowers it for a copy or the inference kernel, and for each (dtype, T) the
training step's three kernels (flexgen's forward, `y.sum()`, flexgen's backward) timed alone beside a
copy of each flexgen kernel's bytes: the share of copy bandwidth the step would reach if both of
flexgen's kernels ran as fast as a copy of their bytes.
"""
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl

from flexgen import launch
from flexgen.launch.allocate import n_checkpoints
from bench_lif import copy_bandwidth, lif, same_size_copy_ms

N, C = 64, 65536


def direct(kernel):
    """Launch a kernel as it is (what eager calls do; custom ops wrap it for the compiler)."""
    return kernel


def kernel_times(compiled, dtype, T, grad_kind, config=launch.DEFAULT):
    """Medians (ms) of the inference, training-forward and backward kernels alone."""
    layout, module = compiled.layout, compiled.module
    x = torch.rand(T, N * C, device="cuda", dtype=dtype) * 2
    v0 = torch.zeros((), device="cuda", dtype=dtype)
    hyper = [2.0, 1.0]  # tau, v_th of bench_lif.lif
    inf = lambda: launch.triton_forward(launch.Kernels(module, layout, direct), launch.ForwardCall([x], [v0], [], hyper, False, False), config)  # noqa: E731
    fwd = lambda: launch.triton_forward(launch.Kernels(module, layout, direct), launch.ForwardCall([x], [v0], [], hyper, False, True), config)  # noqa: E731
    _, _, buffer = fwd()
    if grad_kind == "sum":
        g = torch.ones((), device="cuda", dtype=dtype).expand(T, N * C)
    else:
        g = torch.randn(T, N * C, device="cuda", dtype=dtype)
    gv = torch.zeros((), device="cuda", dtype=dtype)
    bwd = lambda: launch.triton_backward(launch.Kernels(module, layout, direct), launch.BackwardCall([buffer], [g], [gv], [], hyper, False, False), config)  # noqa: E731
    bwd()
    return [triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median") for f in (inf, fwd, bwd)]


def host_costs(dtype):
    """Microseconds of host time per call on a small input (the GPU work is negligible)."""
    x = torch.rand(4, N, 1024, device="cuda", dtype=dtype, requires_grad=True)
    layer = lif()
    compiled = lif.compiled()
    layout, module = compiled.layout, compiled.module
    xs = x.detach().view(4, -1)
    n_elem = xs.shape[1]
    v0 = torch.zeros((), device="cuda", dtype=dtype)
    kernel = getattr(module, "lif_inference")
    out, final = torch.empty_like(xs), torch.empty_like(xs[0])
    raw_args = [xs, xs.stride(0), 1, False, v0, 0, final, out, 2.0, 1.0, 4, n_elem]

    def no_grad_call():
        with torch.no_grad():
            layer.reset()
            layer(x)

    cases = {
        "bare Triton launch, arguments ready (inference kernel)": lambda: kernel[(triton.cdiv(n_elem, 1024),)](
            *raw_args, STATE_SEQS=False, F64=False, HALF_IO=True, BLOCK=1024, num_warps=4),
        "one torch.empty": lambda: torch.empty_like(xs),
        "one triton_forward launch (inference kernel)": lambda: launch.triton_forward(launch.Kernels(module, layout, direct), launch.ForwardCall([xs], [v0], [], [2.0, 1.0], False, False)),
        "layer(x) under no_grad": no_grad_call,
        "layer(x) with grad": lambda: (layer.reset(), layer(x)),
        "layer(x).sum().backward()": lambda: (layer.reset(), layer(x).sum().backward()),
        "x.sum().backward() alone": lambda: (x * 1.0).sum().backward(),
    }
    results = {}
    for label, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        results[label] = (time.perf_counter() - t) / 300 * 1e6
    return results


LOAD_X = "x = tl.load(x_ptr + row * x_st + offs * x_sn, mask=mask)"
LOAD_H = "h = tl.load(h_buf_ptr + row * n_elem + offs, mask=mask)"
STORES = ("tl.store(s_ptr + row * n_elem + offs, s, mask=mask)", "tl.store(h_buf_ptr + row * n_elem + offs, h, mask=mask)",
          "tl.store(grad_x_ptr + row * n_elem + offs, grad_x, mask=mask)")
EVICT_FIRST = [(load, load[:-1] + ', eviction_policy="evict_first")') for load in (LOAD_X, LOAD_H)]
STREAMING = [(store, store[:-1] + ', cache_modifier=".cs")') for store in STORES]
# Loads step t+1's input before step t's stores (a dense input, as here: the stride-0 branch is dropped).
PREFETCH = [("""    for step in range(n_steps):
        row = tl.cast(step, tl.int64)
        if x_bcast:  # one value for all neurons (an expanded tensor): a scalar load
            x = tl.load(x_ptr + row * x_st).to(COMPUTE)
        else:
            x = tl.load(x_ptr + row * x_st + offs * x_sn, mask=mask).to(COMPUTE)
""", """    x_next = tl.load(x_ptr + offs * x_sn, mask=mask)
    for step in range(n_steps):
        row = tl.cast(step, tl.int64)
        x = x_next.to(COMPUTE)
        x_next = tl.load(x_ptr + (row + 1) * x_st + offs * x_sn, mask=mask & (step + 1 < n_steps))
""")]
# The time loop unrolled at compile time: T a constexpr (one compiled kernel per T), the loads of every
# step visible to the compiler at once, as in inductor's kernel of the unrolled torch loop.
STATIC_LOOP = [("    n_steps, n_elem,", "    n_steps: tl.constexpr, n_elem,"),
               ("for step in range(n_steps):", "for step in tl.static_range(n_steps):")]
SOURCE_EDITS = {
    "as generated": [],
    "loads evict_first": EVICT_FIRST,
    "stores streaming (.cs)": STREAMING,
    "both hints": EVICT_FIRST + STREAMING,
    "next input loaded early": PREFETCH,
    "time loop unrolled (T constexpr)": STATIC_LOOP,
}


def edited_module(source, edits, index):
    for old, new in edits:
        if old not in source:
            raise RuntimeError(f"the generated source no longer contains {old!r}")
        source = source.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), f"lif_variant{index}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"lif_variant{index}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def median_of_three(fn):
    return statistics.median(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") for _ in range(3))


def source_edits(bandwidth):
    """Each edit's kernel times (µs, % of copy bandwidth), checked bit-identical to the generated kernels."""
    compiled = lif.compiled()
    layout = compiled.layout
    source = compiled.module_source()
    modules = {name: edited_module(source, edits, i) for i, (name, edits) in enumerate(SOURCE_EDITS.items())}
    hyper = [2.0, 1.0]
    print("| dtype | T | kernel | " + " | ".join(modules) + " | torch copy | Triton copy |")
    print("|---|---|---|" + "---|" * (len(modules) + 2))
    for dtype in (torch.float16, torch.float32):
        esize = torch.finfo(dtype).bits // 8
        for T in (4, 8, 32):
            shape, n_elem = (T, N * C), N * C
            x = torch.rand(shape, device="cuda", dtype=dtype) * 2
            v0 = torch.zeros((), device="cuda", dtype=dtype)
            g = torch.ones((), device="cuda", dtype=dtype).expand(shape)
            n_bytes = {"inference": (2 * T + 1), "forward": (3 * T + 1), "backward": 2 * T}
            times, reference = {k: [] for k in n_bytes}, None
            for module in modules.values():
                def run(save, m=module):
                    return launch.triton_forward(launch.Kernels(m, layout, direct), launch.ForwardCall([x], [v0], [], hyper, False, save))
                buffers = run(True)
                backward = lambda m=module: launch.triton_backward(  # noqa: E731
                    launch.Kernels(m, layout, direct), launch.BackwardCall([buffers[2]], [g], [v0], [], hyper, False, False))
                results = (run(False)[0], buffers[0], backward()[0])
                reference = reference or results
                if not all(torch.equal(a, b) for a, b in zip(results, reference)):
                    raise RuntimeError("an edited kernel computes something else")
                for kind, fn in zip(n_bytes, (lambda: run(False), lambda: run(True), backward)):
                    times[kind].append(median_of_three(fn))
            src = torch.rand(n_bytes["inference"] * n_elem // 2, device="cuda").to(dtype)
            dst = torch.empty_like(src)
            copies = [median_of_three(lambda: dst.copy_(src)),
                      median_of_three(lambda: copy_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), BLOCK=1024))]
            for kind, row in times.items():
                floor_ms = n_bytes[kind] * n_elem * esize / bandwidth * 1e3
                cells = [f"{t * 1e3:.1f} ({floor_ms / t:.0%})" for t in row + (copies if kind == "inference" else [])]
                cells += [""] * (len(modules) + 2 - len(cells))
                print(f"| {str(dtype)[6:]} | {T} | {kind} | " + " | ".join(cells) + " |", flush=True)


class CappedLaunch:
    """`launch` for triton_forward/backward: launches with `maxnreg=cap` (None: Triton's choice) and
    keeps each compiled kernel, for its register count."""

    def __init__(self, cap):
        self.cap, self.compiled, self.kernel = cap, {}, None

    def __call__(self, kernel):  # launch(kernel)[grid](...) follows at once
        self.kernel = kernel
        return self

    def __getitem__(self, grid):
        kernel = self.kernel

        def run(*args, **kwargs):
            if self.cap:
                kwargs["maxnreg"] = self.cap
            self.compiled[kernel.fn.__name__] = kernel[grid](*args, **kwargs)
        return run


def register_caps(bandwidth):
    """Registers per thread and spills of each kernel, and its time under caps of 32, 40 and 48."""
    compiled = lif.compiled()
    module, layout = compiled.module, compiled.layout
    hyper = [2.0, 1.0]
    for dtype in (torch.float32, torch.float16):
        esize = torch.finfo(dtype).bits // 8
        for T in (8, 32):
            shape, n_elem = (T, N * C), N * C
            x = torch.rand(shape, device="cuda", dtype=dtype) * 2
            v0 = torch.zeros((), device="cuda", dtype=dtype)
            g = torch.ones((), device="cuda", dtype=dtype).expand(shape)
            n_bytes = {"inference": 2 * T + 1, "forward": 3 * T + 1, "backward": 2 * T}
            for cap in (None, 32, 40, 48):
                capped = CappedLaunch(cap)
                def run(save):
                    return launch.triton_forward(launch.Kernels(module, layout, capped), launch.ForwardCall([x], [v0], [], hyper, False, save))
                buffers = run(True)
                backward = lambda: launch.triton_backward(  # noqa: E731
                    launch.Kernels(module, layout, capped), launch.BackwardCall([buffers[2]], [g], [v0], [], hyper, False, False))
                times = [median_of_three(fn) for fn in (lambda: run(False), lambda: run(True), backward)]
                cells = []
                for (kind, rows), t in zip(n_bytes.items(), times):
                    k = capped.compiled[f"lif_{kind}"]
                    cells.append(f"{kind} {k.n_regs} regs, {k.n_spills} spills, {t * 1e3:.1f} µs "
                                 f"({rows * n_elem * esize / bandwidth / (t * 1e-3):.0%})")
                print(f"{str(dtype)[6:]} T={T} maxnreg={cap}: " + "; ".join(cells), flush=True)


@triton.jit
def empty_kernel(ptr):
    pass


@triton.jit
def copy_persistent(src, dst, n, BLOCK: tl.constexpr):
    """copy_kernel on a grid of a few programs per SM, each looping over blocks."""
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def lif_inference_persistent(x_ptr, v_ptr, s_ptr, inv_tau, v_th, n_steps, n_elem, BLOCK: tl.constexpr):
    """bench_lif.lif's inference from v = 0 (as generated, dense fp16 input), on a persistent grid."""
    for block in range(tl.program_id(0), tl.cdiv(n_elem, BLOCK), tl.num_programs(0)):
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_elem
        v = tl.zeros([BLOCK], tl.float32)
        for step in range(n_steps):
            row = tl.cast(step, tl.int64)
            x = tl.load(x_ptr + row * n_elem + offs, mask=mask).to(tl.float32)
            h = inv_tau * (-v + x) + v
            s = tl.where(h - v_th >= 0.0, 1.0, 0.0)
            v = h * (1.0 - s)
            tl.store(s_ptr + row * n_elem + offs, s, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


def launch_costs(bandwidth):
    """An empty kernel between do_bench's events, and fp16 inference at T = 4 and 8 on a block-per-program
    grid (as generated, and a copy of its bytes) against persistent grids of 1 to 16 programs per SM."""
    ptr = torch.empty(1, device="cuda")
    for programs in (1, triton.cdiv(N * C, 1024)):
        us = median_of_three(lambda: empty_kernel[(programs,)](ptr)) * 1e3
        print(f"an empty kernel of {programs} programs: {us:.1f} µs between do_bench's events")
    compiled, sms = lif.compiled(), torch.cuda.get_device_properties(0).multi_processor_count
    print("| fp16 inference | kernel µs (%) | copy of its bytes µs (%) |\n|---|---|---|")
    for T in (4, 8):
        n_elem, n_bytes = N * C, (2 * T + 1) * N * C * 2
        x = torch.rand(T, n_elem, device="cuda", dtype=torch.float16) * 2
        v0 = torch.zeros((), device="cuda", dtype=torch.float16)
        src = torch.rand(n_bytes // 4, device="cuda").to(torch.float16)
        dst = torch.empty_like(src)
        generated = lambda: launch.triton_forward(  # noqa: E731
            launch.Kernels(compiled.module, compiled.layout, direct), launch.ForwardCall([x], [v0], [], [2.0, 1.0], False, False))
        spikes, final = generated()
        cases = {"as generated": (generated, lambda: dst.copy_(src))}
        for per_sm in (1, 4, 16):
            grid = (sms * per_sm,)
            s, v = torch.full_like(spikes, 7), torch.full_like(final, 7)
            persistent = lambda g=grid, s=s, v=v: lif_inference_persistent[g](x, v, s, 0.5, 1.0, T, n_elem, BLOCK=1024)  # noqa: E731
            persistent()
            if not (torch.equal(s, spikes) and torch.equal(v, final)):
                raise RuntimeError("the persistent inference kernel computes something else")
            cases[f"persistent, {per_sm} per SM"] = (persistent, lambda g=grid: copy_persistent[g](src, dst, src.numel(), BLOCK=1024))
        for name, fns in cases.items():
            us = [median_of_three(fn) * 1e3 for fn in fns]
            print(f"| T={T}, {name} | " + " | ".join(f"{t:.1f} ({n_bytes / bandwidth / (t * 1e-6):.0%})" for t in us) + " |",
                  flush=True)


def kernel_bytes(T, dtype, recompute):
    """Bytes moved by the training forward and by the backward (given `sum()`'s stride-0 gradient) of the
    plain design (x read, s and h written, the final state; h read, grad_x written) or the recompute one
    (x read, s written, the final state, fp32 checkpoints; x read again, the checkpoints read, grad_x
    written)."""
    row = N * C * torch.finfo(dtype).bits // 8
    if not recompute:
        return (3 * T + 1) * row, 2 * T * row
    checkpoints = n_checkpoints(T, lif.compiled().ops_for(True).layout.variant.chunk) * N * C * 4
    return (2 * T + 1) * row + checkpoints, 2 * T * row + checkpoints


def step_bounds(bandwidth):
    """Each kernel of a default layer's training step timed alone, against copies of its bytes."""
    print("| dtype | T | design | forward µs (copy of its bytes) | y.sum() µs | backward µs (copy of its bytes) | "
          "step: the three | share | step with copies for flexgen's kernels | share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    layer = lif()
    for dtype in (torch.float16, torch.float32):
        recompute = lif.compiled().recompute_pays(dtype)
        for T in (4, 8, 16, 32):
            x = (torch.rand(T, N, C, device="cuda", dtype=dtype) * 2).requires_grad_(True)
            layer.reset()
            y = layer(x)
            g = torch.ones((), device="cuda", dtype=dtype).expand_as(y)  # what y.sum()'s backward passes
            def forward():
                layer.reset()
                return layer(x)
            times = [median_of_three(forward), median_of_three(lambda: y.sum()),
                     median_of_three(lambda: torch.autograd.grad(y, x, g, retain_graph=True))]
            fwd_bytes, bwd_bytes = kernel_bytes(T, dtype, recompute)
            copies = [same_size_copy_ms(fwd_bytes, dtype), same_size_copy_ms(bwd_bytes, dtype)]
            moved = fwd_bytes + bwd_bytes + T * N * C * torch.finfo(dtype).bits // 8  # with sum()'s read of s
            floor = moved / bandwidth * 1e3
            step, ideal = sum(times), copies[0] + times[1] + copies[1]
            print(f"| {str(dtype)[6:]} | {T} | {'recompute' if recompute else 'plain'} | "
                  f"{times[0] * 1e3:.1f} ({copies[0] * 1e3:.1f}) | {times[1] * 1e3:.1f} | {times[2] * 1e3:.1f} "
                  f"({copies[1] * 1e3:.1f}) | {step * 1e3:.1f} | {floor / step:.0%} | {ideal * 1e3:.1f} | "
                  f"{floor / ideal:.0%} |", flush=True)


def main():
    bandwidth = copy_bandwidth()
    if "--bounds" in sys.argv:
        print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
        launch_costs(bandwidth)
        step_bounds(bandwidth)
        return
    if "--regs" in sys.argv:
        print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
        register_caps(bandwidth)
        return
    if "--edits" in sys.argv:
        print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; µs (share of copy bandwidth)")
        source_edits(bandwidth)
        return
    compiled = lif.compiled()
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| dtype | T | grad | BLOCK | warps | inference ms | %bw | fwd ms | %bw | bwd ms | %bw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    quick = "--quick" in sys.argv
    for dtype in (torch.float16, torch.float32):
        esize = torch.finfo(dtype).bits // 8
        for T in (4, 8, 16, 32):
            for grad_kind in ("sum",) if T != 32 else ("sum", "dense"):
                configs = ((1024, 4),) if quick else (
                    (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 4), (4096, 8))
                for block, warps in configs:
                    config = launch.LaunchConfig(block=block, num_warps=warps)
                    t_i, t_f, t_b = kernel_times(compiled, dtype, T, grad_kind, config)
                    elems = T * N * C
                    passes = {"inference": 2, "fwd": 3, "bwd": 2 + (grad_kind == "dense")}
                    pct = [passes[k] * elems * esize / (t * 1e-3) / bandwidth for k, t in zip(passes, (t_i, t_f, t_b))]
                    print(f"| {str(dtype)[6:]} | {T} | {grad_kind} | {block} | {warps} | {t_i:.4f} | {pct[0]:.0%} | "
                          f"{t_f:.4f} | {pct[1]:.0%} | {t_b:.4f} | {pct[2]:.0%} |", flush=True)
    for label, us in host_costs(torch.float16).items():
        print(f"host: {label}: {us:.1f} us per call (small input, synchronized at the end)")


if __name__ == "__main__":
    main()
