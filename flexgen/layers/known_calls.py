"""Known calls: what a layer keeps of a call so that later calls with the same key skip the checks.

A call's key holds what its checks and plan depend on (`tensor_keys` of its tensors, its options); a call whose
checks handed its tensors on unchanged (`handed_on_unchanged`) and that nothing traces or captures
(`capturing_on`) is kept under it (`keep_known_call`), a neuron layer's as a `KnownCall` of its plan.
"""
import torch

from ..launch import config as launch_config


def _same(tensors, checked):
    return len(tensors) == len(checked) and all(a is b for a, b in zip(tensors, checked))


def handed_on_unchanged(given, checked):
    """Whether a call's checks handed its (inputs, states, learnable) on as they were (states None: the initial
    ones, made by the checks)."""
    (inputs, states, learnable), (c_inputs, c_states, c_learnable) = given, checked
    return _same(inputs, c_inputs) and _same(learnable, c_learnable) and (states is None or _same(states, c_states))


def tensor_keys(tensors):
    """What a known call's key holds of each tensor (None stays None): its type, shape, strides, dtype, device and
    whether it requires grad. Raises AttributeError for an argument not a tensor."""
    return [None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors]


def capturing_on(device):
    """Whether a CUDA graph is being captured on `device`'s current stream (made for it, not kept: no known calls)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def keep_known_call(known_calls, key, call):
    """Keep `call` under `key`; calls whose keys keep changing start the dict over rather than grow it."""
    if len(known_calls) >= launch_config.MAX_PLANS:
        known_calls.clear()
    known_calls[key] = call


class KnownCall:
    """A call signature a layer has run through an `EagerPlan`, with the initial states the plan reads
    (None when the call passes its own states) and the `Run` it takes (the layer's `last_run`)."""

    def __init__(self, plan, initial_states, run=None):
        self.plan, self.initial_states, self.n_outputs, self.run = plan, initial_states, plan.n_outputs, run

    def __call__(self, inputs, states, learnable):
        result = self.plan(inputs, self.initial_states if states is None else states, learnable)
        return result[:self.n_outputs], result[self.n_outputs:]

