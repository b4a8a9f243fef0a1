"""Accuracy of LIF training in half precision: what saving `h` in the I/O dtype costs.

Run on a GPU:  python benchmarks/accuracy.py [--steps T] [--neurons N]
or on the CPU through Triton's interpreter:  TRITON_INTERPRET=1 python benchmarks/accuracy.py --neurons 20000

For fp16 and bf16 inputs, bench_lif's LIF is trained with the plain kernels (they save the pre-spike
potential `h` in the I/O dtype) and with the recompute kernels (they keep `h` in fp32 registers), and
the torch loop of bench_lif runs in that dtype, as a plain PyTorch model would. Each is compared with
the torch loop in float64 on the same inputs and the same incoming gradient (a random weighting of the
spikes, rounded to the I/O dtype): the share of spikes that differ, the relative error of `grad_x`
(‖g − ref‖ / ‖ref‖), the share of elements whose gradient is off by more than 1 % of the largest, and
the relative error without those elements. The plain backward decides each step's spike again from the
rounded `h` (for the reset's derivative); where rounding moved `h` across the threshold it takes the
other branch, and those are the elements off by more than 1 %.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lif import lif, torch_lif_loop  # noqa: E402


def flexgen_run(recompute):
    def run(x):
        (s,), _ = lif.apply(x, backend="triton", recompute=recompute)
        return s
    return run


def torch_run(x):
    return torch_lif_loop(x)[0]


def spikes_and_grad(run, x, weight):
    x = x.detach().clone().requires_grad_()
    s = run(x)
    (grad,) = torch.autograd.grad((s.to(weight.dtype) * weight).sum(), [x])
    return s.detach(), grad


def compare(s, grad, s_ref, grad_ref):
    diff = grad.double() - grad_ref
    off = diff.abs() > 1e-2 * grad_ref.abs().max()
    return {"spikes differing": (s.double() != s_ref).double().mean().item(),
            "grad_x relative error": (diff.norm() / grad_ref.norm()).item(),
            "elements off by > 1 %": off.double().mean().item(),
            "relative error without them": (torch.where(off, 0.0, diff).norm() / grad_ref.norm()).item()}


def measure(steps, neurons, device, seed=0):
    """Rows of (dtype, candidate, comparison) for fp16 and bf16 inputs."""
    g = torch.Generator(device=device).manual_seed(seed)
    x32 = torch.randn(steps, neurons, generator=g, device=device) * 1.5 + 0.8
    weight32 = torch.randn(steps, neurons, generator=g, device=device)
    candidates = {"flexgen, plain (h saved in the I/O dtype)": flexgen_run(False),
                  "flexgen, recompute (h kept in fp32)": flexgen_run(True),
                  "torch loop in the I/O dtype": torch_run}
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        x, weight = x32.to(dtype), weight32.to(dtype)
        s_ref, grad_ref = spikes_and_grad(torch_run, x.double(), weight.double())
        for name, run in candidates.items():
            s, grad = spikes_and_grad(run, x, weight.float())
            rows.append((str(dtype).split(".")[-1], name, compare(s, grad, s_ref, grad_ref)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--neurons", type=int, default=64 * 65536)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("accuracy.py runs the Triton kernels: on a machine without a CUDA GPU set TRITON_INTERPRET=1")
    rows = measure(args.steps, args.neurons, device)
    columns = list(rows[0][2])
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton interpreter"
    print(f"LIF (bench_lif), input [{args.steps}, {args.neurons}], against the torch loop in float64; {where}\n")
    print("| dtype | candidate | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for dtype, name, result in rows:
        print(f"| {dtype} | {name} | " + " | ".join(f"{result[c]:.1e}" for c in columns) + " |")


if __name__ == "__main__":
    main()
