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


# Learnable alpha: the spike is treated as the primitive g(z; a) in the backward, so it gets dg/dz and dg/da.
def sigmoid_grads(z, a):  # g = sigmoid(a z)
    s = torch.sigmoid(a * z)
    return a * s * (1.0 - s), z * s * (1.0 - s)


def atan_grads(z, a):  # g = atan(pi/2 a z) / pi + 1/2
    d = 1.0 + (math.pi / 2 * a * z) ** 2
    return (a / 2) / d, (z / 2) / d


class RefSpikeAlpha(torch.autograd.Function):
    """Heaviside forward; backward (dg/dz, dg/da) from `grads_fn(z, a)`, da summed to a's shape."""

    @staticmethod
    def forward(ctx, z, a, grads_fn):
        ctx.save_for_backward(z, a)
        ctx.grads_fn = grads_fn
        return (z >= 0).to(z.dtype)

    @staticmethod
    def backward(ctx, grad):
        z, a = ctx.saved_tensors
        dz, da = ctx.grads_fn(z, a)
        da = (grad * da).sum() if a.dim() == 0 else (grad * da).sum_to_size(a.shape)
        return grad * dz, da, None
