"""The torch modules an imported NIR graph holds besides flexgen's layers: one-step modules run over whole
sequences, NIR's Scale, and the check that a neuron layer gets the number of neurons its node declares."""
import torch


class SequenceWise(torch.nn.Module):
    """A module for one step ([B, ...]) applied to every step of a [T, B, ...] sequence at once."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        steps, batch = x.shape[:2]
        y = self.module(x.flatten(0, 1))
        return y.unflatten(0, (steps, batch))


class Scale(torch.nn.Module):
    """NIR's Scale: the input times a fixed factor per neuron."""

    def __init__(self, scale):
        super().__init__()
        self.register_buffer("scale", torch.as_tensor(scale))

    def forward(self, x):
        return x * self.scale



class DeclaredShape:
    """A forward pre-hook: the neuron layer of a NIR node takes [T, B, *shape] of the shape its node declares
    (its parameters may be one value for all neurons, which would broadcast to any shape)."""

    def __init__(self, node_name, kind, shape):
        self.node_name, self.kind, self.shape = node_name, kind, tuple(shape)

    def __call__(self, layer, args):
        got = tuple(args[0].shape[2:])
        if got != self.shape:
            raise ValueError(f"NIR node {self.node_name!r} ({self.kind}) declares {list(self.shape)} neurons, "
                             f"got inputs {list(args[0].shape)}: [T, B, {', '.join(map(str, self.shape))}] expected")
