"""Stage 6, launch: call the generated kernels, as PyTorch custom ops with autograd.

Takes a loaded module and its `Layout`s from the compile stage; hands `NeuronOps` (per variant) to module.py.

Each variant gets two `torch.library.triton_op`s, `flexgen::<neuron>_<key>_forward` and `..._backward`, so
`torch.compile` and `torch.export` see and trace into the Triton launches; the forward op's autograd formula
calls the backward op. Eager calls run the same implementations through plain autograd.Functions
(`autograd`), with the host work of each call signature done once (`plans`). Both run the Triton kernels
(`triton_path`: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1) or the generated torch loops
(`torch_path`). The kernels' argument values follow `flexgen.render.layout`'s lists (`abi`); what depends on the
Triton release is in `compat`. `DelayedLinear`'s hand-written kernels (`delayed_linear`; `delay_taps` with
`tap_matrices`) run the same two ways, through `delay_ops`.
"""
from .abi import broadcasts_per_neuron
from .neuron.calls import BackwardCall, ForwardCall, Kernels
from .config import DEFAULT, HALF_DTYPES, MAX_PLANS, LaunchConfig, compute_dtype
from .neuron.ops import NeuronOps
from .scalars import cached_scalar, cached_zero, tracing_or_transforming
from .triton_path import triton_backward, triton_forward
from .torch_path import torch_backward, torch_forward

__all__ = [
    "NeuronOps", "broadcasts_per_neuron", "Kernels", "ForwardCall", "BackwardCall", "LaunchConfig", "DEFAULT",
    "MAX_PLANS", "HALF_DTYPES",
    "compute_dtype", "cached_scalar", "cached_zero", "tracing_or_transforming",
    "triton_forward", "triton_backward", "torch_forward", "torch_backward",
]
