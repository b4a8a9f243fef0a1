"""A neuron whose backward reads a spike kept as a state (a refractory flag, `r`: the last step's spike) saves that
state in bytes: forward + backward of `refractory` on [T, 64, 65536], fp32 and fp16, the plain design
(`recompute=False`) and the default ("auto"), peak memory above the input (in units of its size) and time (the
median of `triton.testing.do_bench`, three fresh random inputs in turn). To compare with a flexgen from before
bytes, run it again with that checkout first on PYTHONPATH. Needs a CUDA GPU; standard output only.

    python benchmarks/probe_binary_saved.py
"""
import sys

import torch
import triton

import flexgen
from flexgen import detach, neuron, spike


@neuron(states=("v", "r"))
def refractory(x, v, r, tau=2.0, v_th=1.0):
    h = (v + (x - v) / tau) * (1.0 - detach(r))
    s = spike(h - v_th)
    return s, h * (1.0 - s), s


def fwd_bwd(x, recompute):
    (s,), _ = refractory.apply(x, backend="triton", recompute=recompute)
    s.sum().backward()
    x.grad = None


def peak_above_input(x, recompute):
    fwd_bwd(x, recompute)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(x, recompute)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / (x.numel() * x.element_size())


def main():
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}; flexgen from {flexgen.__file__}")
    for dtype in (torch.float32, torch.float16):
        for n_steps in (8, 64):
            xs = [(torch.rand(n_steps, 64, 65536, device="cuda") * 2).to(dtype).requires_grad_() for _ in range(3)]
            for recompute in (False, "auto"):
                peak = peak_above_input(xs[0], recompute)
                calls = iter(range(1 << 30))
                ms = triton.testing.do_bench(lambda: fwd_bwd(xs[next(calls) % 3], recompute), return_mode="median")
                print(f"{str(dtype)[6:]:8s} T {n_steps:3d} recompute={str(recompute):5s} peak above the input "
                      f"{peak:.3f} x input, fwd+bwd {ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
