"""Hand-written surrogate gradients and spike for the tests' eager references (independent of flexgen)."""
import math

import torch


def sigmoid_grad(z):  # SpikingJelly Sigmoid, alpha = 4
    s = torch.sigmoid(4.0 * z)
    return 4.0 * s * (1.0 - s)


def atan_grad(z):  # SpikingJelly ATan, alpha = 2
    return 1.0 / (1.0 + (math.pi * z) ** 2)


class RefSpike(torch.autograd.Function):
    """Heaviside forward, `grad_fn(z)` backward."""

    @staticmethod
    def forward(ctx, z, grad_fn):
        ctx.save_for_backward(z)
        ctx.grad_fn = grad_fn
        return (z >= 0).to(z.dtype)

    @staticmethod
    def backward(ctx, grad):
        (z,) = ctx.saved_tensors
        return grad * ctx.grad_fn(z), None
