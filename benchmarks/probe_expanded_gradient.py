"""The C target's backward of a gradient that is the same at every step (`layer(x).sum()`'s): read as one row at
every step (what flexgen does) against copied to T contiguous rows first (what it did before 2026-11-26, patched
in for the comparison). flexgen.LIF(backend="c"), [T, 32, 4096] float32, one thread; the backward alone, calls of
the two alternated in one process, the median and minimum of 41 each. Standard output only.

    python benchmarks/probe_expanded_gradient.py [T ...]      # default: 8 32 128
"""
import statistics
import sys
import time

import torch

import flexgen
import flexgen.launch.c_path as c_path
from flexgen.launch.torch_path import rows


def copied_rows(grad, n_steps, n_elem, dtype):
    return rows(grad, n_steps, n_elem).to(dtype).contiguous(), n_elem


def main(argv):
    if not c_path.available():
        print("no C compiler: the C target cannot run here", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    ways = {"one row": c_path._gradient_rows, "T rows": copied_rows}
    try:
        for n_steps in [int(t) for t in argv] or (8, 32, 128):
            x = torch.rand(n_steps, 32, 4096).requires_grad_()
            layer = flexgen.LIF(step_mode="m", backend="c")
            times = {name: [] for name in ways}
            for k in range(2 * 41 + 4):  # the first two of each warm up
                name = list(ways)[k % 2]
                c_path._gradient_rows = ways[name]
                layer.reset()
                x.grad = None
                loss = layer(x).sum()
                start = time.perf_counter()
                loss.backward()
                if k >= 4:
                    times[name].append(time.perf_counter() - start)
            cells = [f"{name}: median {statistics.median(t) * 1e3:.2f} ms, min {min(t) * 1e3:.2f}"
                     for name, t in times.items()]
            print(f"T {n_steps:4d}: " + ", ".join(cells))
    finally:
        c_path._gradient_rows = ways["one row"]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
