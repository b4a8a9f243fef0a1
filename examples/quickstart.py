"""Quickstart: define a LIF neuron, look at what flexgen generates, check it against eager PyTorch.

    python examples/quickstart.py

On a GPU the fused Triton kernels run; on a CPU-only machine the generated C
kernels (where a C compiler is), else the generated torch code. The layer says
which in `layer.last_run`. Either way the result is compared with
backend="eager", the step function run step by step under torch autograd.
"""
import torch

import flexgen


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau          # charge: leaky integration towards the input
    s = flexgen.spike(h - v_th)    # fire: Heaviside forward, surrogate gradient backward
    return s, h * (1.0 - s)        # outputs first, then the new value of each state (hard reset)


def main():
    print("== derived equations ==")
    print(lif.equations())
    print("== generated backward kernel (Triton) ==")
    print(lif.source("backward"))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    x = (1.5 * torch.rand(16, 4, 64, device=device)).requires_grad_()   # [T, batch, neurons]

    layer = lif(tau=3.0)                       # backend="auto": Triton on CUDA; C (or torch) code on the CPU
    oracle = lif(tau=3.0, backend="eager")

    s = layer(x)
    (s * torch.linspace(0.5, 1.5, 64, device=device)).sum().backward()
    grad, x.grad = x.grad.clone(), None

    s_ref = oracle(x)
    (s_ref * torch.linspace(0.5, 1.5, 64, device=device)).sum().backward()

    assert torch.equal(s, s_ref), "spikes differ from the eager backend"
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.v, oracle.v, rtol=1e-5, atol=1e-6)
    run = layer.last_run                       # the backend and path the call took
    print(f"OK: backend {run.backend!r} ({run.path} kernels) on {device} matches backend='eager' "
          f"({int(s.sum())} spikes, max |grad x| = {grad.abs().max():.4f})")


if __name__ == "__main__":
    main()
