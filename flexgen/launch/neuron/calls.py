"""The arguments of one forward or backward call, and the kernels it runs, as small named objects."""
from typing import Any, Callable, List, NamedTuple

from ..config import numel


class Kernels(NamedTuple):
    """One variant's generated functions: the loaded `module`, its `layout`, and `launch`, which wraps a Triton
    kernel before it is launched (itself for eager calls, `wrap_triton` inside a custom op)."""

    module: Any
    layout: Any
    launch: Callable

    def triton(self, kind):
        return self.launch(getattr(self.module, self.layout.kernel_name(kind)))


class ForwardCall(NamedTuple):
    """A forward over [T, ...] inputs; `save`: keep what the backward needs (training)."""

    inputs: List
    states: List
    learnable: List
    hyper: List[float]
    state_seqs: bool
    save: bool

    @property
    def shape(self):
        return tuple(self.inputs[0].shape)

    @property
    def n_elem(self):
        return numel(self.shape[1:])


class BackwardCall(NamedTuple):
    """A backward through time; `grad_init`: compute the initial states' gradients too."""

    saved: List
    grad_outputs: List
    grad_states: List
    learnable: List
    hyper: List[float]
    state_seqs: bool
    grad_init: bool

    @property
    def shape(self):
        return tuple(self.grad_outputs[0].shape)

    @property
    def n_elem(self):
        return numel(self.shape[1:])
