"""LIF kernel timings by launch configuration: forward and backward kernels alone, and host overheads.

Run on a GPU: python benchmarks/kernel_variants.py
For each (dtype, T, BLOCK, num_warps) prints the forward and backward kernel medians (do_bench) and
the fraction of copy bandwidth they reach on the bytes they must move; then the host-side cost of
one Triton launch and of a whole layer call.
"""
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexgen  # noqa: E402
from flexgen import launch  # noqa: E402
from bench_lif import copy_bandwidth, lif  # noqa: E402

N, C = 64, 65536


def kernel_times(compiled, dtype, T, grad_kind):
    """Medians (ms) of the inference, training-forward and backward kernels alone."""
    lay, module = compiled.layout, compiled.module
    x = torch.rand(T, N * C, device="cuda", dtype=dtype) * 2
    v0 = torch.zeros((), device="cuda", dtype=dtype)
    shape = (T, N * C)
    hyper = [2.0, 1.0]  # tau, v_th of bench_lif.lif
    inf = lambda: launch.triton_forward(module, lay, [x], [v0], [], hyper, False, False, launch._direct, shape, N * C)  # noqa: E731
    fwd = lambda: launch.triton_forward(module, lay, [x], [v0], [], hyper, False, True, launch._direct, shape, N * C)  # noqa: E731
    _, _, buffer = fwd()
    if grad_kind == "sum":
        g = torch.ones((), device="cuda", dtype=dtype).expand(T, N * C)
    else:
        g = torch.randn(T, N * C, device="cuda", dtype=dtype)
    gv = torch.zeros((), device="cuda", dtype=dtype)
    bwd = lambda: launch.triton_backward(module, lay, [buffer], [g], [gv], [], hyper, False, False, launch._direct, shape, N * C)  # noqa: E731
    bwd()
    return [triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median") for f in (inf, fwd, bwd)]


def host_costs(dtype):
    """Microseconds of host time per call on a small input (the GPU work is negligible)."""
    x = torch.rand(4, N, 1024, device="cuda", dtype=dtype, requires_grad=True)
    layer = lif()
    compiled = lif.compiled()
    lay, module = compiled.layout, compiled.module
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
            *raw_args, STATE_SEQS=False, F64=False, BLOCK=1024, num_warps=4),
        "one torch.empty": lambda: torch.empty_like(xs),
        "one triton_forward launch (inference kernel)": lambda: launch.triton_forward(
            module, lay, [xs], [v0], [], [2.0, 1.0], False, False, launch._direct, tuple(xs.shape), n_elem),
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


def main():
    bandwidth = copy_bandwidth()
    compiled = lif.compiled()
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| dtype | T | grad | BLOCK | warps | inference ms | %bw | fwd ms | %bw | bwd ms | %bw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    quick = "--quick" in sys.argv
    for dtype in (torch.float16, torch.float32):
        esize = torch.finfo(dtype).bits // 8
        for T in (4, 8, 16, 32):
            for grad_kind in ("sum",) if T != 32 else ("sum", "dense"):
                configs = ((1024, 4),) if quick else ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8))
                for block, warps in configs:
                    launch.BLOCK, launch.NUM_WARPS = block, warps
                    t_i, t_f, t_b = kernel_times(compiled, dtype, T, grad_kind)
                    elems = T * N * C
                    passes = {"inference": 2, "fwd": 3, "bwd": 2 + (grad_kind == "dense")}
                    pct = [passes[k] * elems * esize / (t * 1e-3) / bandwidth for k, t in zip(passes, (t_i, t_f, t_b))]
                    print(f"| {str(dtype)[6:]} | {T} | {grad_kind} | {block} | {warps} | {t_i:.4f} | {pct[0]:.0%} | "
                          f"{t_f:.4f} | {pct[1]:.0%} | {t_b:.4f} | {pct[2]:.0%} |", flush=True)
    launch.BLOCK, launch.NUM_WARPS = 1024, 4
    for label, us in host_costs(torch.float16).items():
        print(f"host: {label}: {us:.1f} us per call (small input, synchronized at the end)")


if __name__ == "__main__":
    main()
