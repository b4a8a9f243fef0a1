"""A recurrent layer's known calls: fused calls kept under their key, which later calls with that key run without
the checks (`flexgen.launch.recurrent.known.KnownRecurrentCall`).

The key (`recurrent_call_key`) holds what the checks, the path and the launches' arguments depend on; a fused call
whose checks handed its tensors on unchanged is kept under it (`remember_recurrent_call`) and later run by
`known_recurrent_forward`.
"""
import torch

from ..launch import tracing_or_transforming
from ..launch.recurrent.known import known_call
from ..launch.recurrent.tiling import resident_programs
from .checks import any_autocast_enabled
from .known_calls import capturing_on, keep_known_call, tensor_keys
from .recurrent_feedback import scaled, with_previous_output


def recurrent_call_key(layer, inputs, states, previous_output, learnable, weight, bias, scale):
    """What a call depends on besides its tensors' values: the checks, the path and the launches' arguments (see
    `KnownRecurrentCall`). None for calls that take the checked path every time: the eager backend, delays,
    replays, tracing, torch.func, autocast, an argument not a tensor."""
    if (layer.backend == "eager" or layer.delay is not None or getattr(layer, "_replay", None) is not None
            or tracing_or_transforming() or any_autocast_enabled()):
        return None
    try:
        tensors = tensor_keys((*inputs, *(states or ()), previous_output, *learnable, weight, bias, scale))
        programs = resident_programs(inputs[0].device)
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return None
    options = (torch.is_grad_enabled(), states is None, layer.requested_path, layer.config,
               torch.backends.cuda.matmul.allow_tf32, programs,
               previous_output is not None and previous_output is layer.final_output)
    return (*options, *layer.cell.hyper.values(), *tensors)


def known_recurrent_forward(layer, known, inputs, states, previous_output, learnable, weight, bias, scale):
    """(outputs, final states) of a call with a known key: what `Recurrent._checked_forward` and
    `flexgen.layers.recurrent_paths.run_checked` do after the checks."""
    weight, inputs, dtype = scaled(weight, scale), list(inputs), inputs[0].dtype
    weight = weight if known.save else weight.to(dtype)  # cast once, for the product below and the kernels
    if previous_output is not None and not known.reads_previous:
        inputs = with_previous_output(layer, (inputs, states, learnable), previous_output, weight.to(dtype))[0]
    return known(inputs, states, learnable, weight, bias, previous_output if known.reads_previous else None)


def remember_recurrent_call(layer, key, checked, hyper, save, initial, reads_previous):
    """Keep a fused call under its key, with its states if they are the `initial` ones; not while a CUDA graph is
    captured (the 0-d tensors it reads would be made for the graph, not kept)."""
    inputs, states, learnable = checked
    if capturing_on(inputs[0].device):
        return
    kept = states if initial else None
    call = known_call(layer.compiled(), key, inputs, kept, learnable, hyper, save, layer.config, reads_previous)
    keep_known_call(layer._known_calls, key, call)
