"""Accuracy of LIF training in half precision: what saving `h` in the I/O dtype costs.

Run on a GPU:  python benchmarks/accuracy.py [--steps T] [--neurons N] [--out DIR]
or on the CPU through Triton's interpreter:  TRITON_INTERPRET=1 python benchmarks/accuracy.py --neurons 20000

It prints a table; with --out DIR it also writes accuracy.json (every figure, the device, the date, the torch and
Triton versions, the command) and accuracy.md (the table with that header) to DIR. Nothing is written without
--out, so a trial run does not replace a recorded one.

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
import datetime
import json
import os
import sys

import torch
import triton

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


def markdown(rows, meta):
    """The table, under a header naming the device, date, versions and command."""
    columns = list(rows[0][2])
    steps, neurons = meta["shape"]
    lines = [f"# LIF training in fp16 and bf16 against a float64 torch loop ({meta['device']})", "",
             f"{meta['device']}, {meta['date']}, torch {meta['torch']}, Triton {meta['triton']}. "
             f"`{meta['command']}`.",
             f"LIF of bench_lif, input [{steps}, {neurons}], seed {meta['seed']}; errors relative to the torch loop "
             "in float64 on the same inputs and incoming gradient.", "",
             "| dtype | candidate | " + " | ".join(columns) + " |",
             "|---" * (len(columns) + 2) + "|"]
    for dtype, name, result in rows:
        lines.append(f"| {dtype} | {name} | " + " | ".join(f"{result[c]:.1e}" for c in columns) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--neurons", type=int, default=64 * 65536)
    parser.add_argument("--out", metavar="DIR", help="also write accuracy.json and accuracy.md to DIR")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("accuracy.py runs the Triton kernels: on a machine without a CUDA GPU set TRITON_INTERPRET=1")
    seed = 0
    rows = measure(args.steps, args.neurons, device, seed)
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton interpreter",
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "command": "python benchmarks/accuracy.py " + " ".join(sys.argv[1:]),
            "shape": [args.steps, args.neurons], "seed": seed}
    text = markdown(rows, meta)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        results = [{"dtype": dtype, "candidate": name, **result} for dtype, name, result in rows]
        with open(os.path.join(args.out, "accuracy.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        with open(os.path.join(args.out, "accuracy.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
