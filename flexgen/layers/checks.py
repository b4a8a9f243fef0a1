"""The checks a neuron layer's call and options go through: clear errors, not kernel crashes.

A call's inputs, states and learnable values (`check_inputs`, `check_states`, `check_learnable`), its dtype under
`torch.autocast` (`autocast_inputs`), and a layer's options (the backend's name: `flexgen.launch.backends.check_name`;
`check_recompute`, `check_delay`, `check_dtype`, `check_attribute_names`; a recurrent weight too large for the
machine, `recurrent_weight`).
"""
import math
import os

import torch


def check_inputs(spec, inputs, multi_step=True):
    """Clear errors (not kernel crashes) for per-step inputs the kernels cannot take."""
    sig = spec.signature
    if len(inputs) != len(sig.inputs):
        raise TypeError(f"{spec.fn.__name__} takes {len(sig.inputs)} input(s) {sig.inputs}, got {len(inputs)}")
    first = inputs[0]
    for name, x in zip(sig.inputs, inputs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(
                f"input {name!r} has dtype {x.dtype}; neurons take floating-point tensors "
                "(convert with x.float(), or x.to(dtype))"
            )
        if x is not first and (x.shape != first.shape or x.dtype != first.dtype or x.device != first.device):
            raise ValueError(
                f"all inputs must share shape, dtype and device: {sig.inputs[0]!r} is "
                f"{tuple(first.shape)} {first.dtype} {first.device}, {name!r} is {tuple(x.shape)} {x.dtype} {x.device}"
            )
    if multi_step and first.dim() < 1:
        raise ValueError(
            f"multi-step input {sig.inputs[0]!r} needs a leading time dimension [T, ...], got a scalar; "
            "use step_mode='s' for one step at a time, or x.unsqueeze(0) for T = 1"
        )


def any_autocast_enabled():
    """One cheap check before the per-device ones (torch < 2.4 lacks it: assume enabled)."""
    check = getattr(torch._C, "_is_any_autocast_enabled", None)
    return True if check is None else check()


def autocast_inputs(inputs):
    """Under `torch.autocast` for the inputs' device, floating inputs in the autocast dtype.

    Kernels compute in fp32 whatever their I/O dtype, so a layer under autocast
    reads and writes the low-precision dtype like the layers around it.
    fp64 inputs are left alone (autocast does not lower them either).

    >>> import torch
    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_inputs([torch.zeros(2)])[0].dtype
    torch.bfloat16
    """
    if not any_autocast_enabled():
        return list(inputs)
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor) or not first.is_floating_point() or first.dtype == torch.float64:
        return list(inputs)
    device_type = first.device.type
    if device_type not in ("cpu", "cuda", "xpu", "mps", "hpu") or not torch.is_autocast_enabled(device_type):
        return list(inputs)
    dtype = torch.get_autocast_dtype(device_type)
    return [x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 else x
            for x in inputs]


def check_recompute(recompute):
    if not (isinstance(recompute, bool) or (isinstance(recompute, str) and recompute == "auto")):
        raise TypeError(f"recompute must be True, False or 'auto', got {recompute!r}")


def check_learnable(name, value, like):
    """A learnable parameter as a floating tensor on the inputs' device: one value, one per channel, or any
    shape that broadcasts against one step of the inputs.

    The channel is dim 2 of the [T, B, C, ...] inputs (dim 1 of a step).
    """
    if not isinstance(value, torch.Tensor):
        return torch.full((), float(value), dtype=like.dtype, device=like.device)  # no host copy: capturable
    if value.device != like.device:
        raise ValueError(
            f"learnable parameter {name!r} is on {value.device}, the inputs on {like.device}; "
            "move the layer with .to(device) (or pass the parameter on the inputs' device)"
        )
    if not value.is_floating_point():
        raise TypeError(f"learnable parameter {name!r} has dtype {value.dtype}; it must be floating-point")
    channels = like.shape[2] if like.dim() > 2 else None
    per_channel = value.dim() == 1 and value.numel() == channels
    if value.numel() != 1 and not per_channel and not _broadcasts_to(value.shape, like.shape[1:]):
        raise ValueError(
            f"learnable parameter {name!r} has shape {tuple(value.shape)}; it must hold one value, one per channel "
            f"(dim 2 of the [T, B, C, ...] inputs, here {channels if channels is not None else 'absent'}) or a shape "
            f"that broadcasts against one step of the inputs (here {tuple(like.shape[1:])})"
        )
    return value


def _broadcasts_to(shape, target):
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def check_states(spec, states, like):
    states = list(states)
    if len(states) != len(spec.signature.states):
        raise TypeError(f"{spec.fn.__name__} has {len(spec.signature.states)} state(s), got {len(states)}")
    step_shape = like.shape[1:]
    result = []
    for name, v in zip(spec.signature.states, states):
        v = torch.as_tensor(v, dtype=like.dtype, device=like.device) if not isinstance(v, torch.Tensor) else v
        if v.device != like.device:
            raise ValueError(f"state {name!r} is on {v.device}, the inputs on {like.device}")
        if not v.is_floating_point():
            raise TypeError(f"state {name!r} has dtype {v.dtype}; states must be floating-point")
        if v.shape != step_shape:
            try:
                v = v.expand(step_shape)
            except RuntimeError:
                raise ValueError(
                    f"state {name!r} has shape {tuple(v.shape)}, one step of the inputs is {tuple(step_shape)} "
                    f"(inputs {tuple(like.shape)} are [T, ...]); is the leading time dimension missing, "
                    "or did the batch shape change without reset()?"
                ) from None
        result.append(v if v.dtype == like.dtype else v.to(like.dtype))
    return result


# What a layer keeps as attributes of its own besides the class's and nn.Module's: a learnable parameter or a
# state of the same name would be hidden by them (or overwrite them).
LAYER_ATTRIBUTES = frozenset({"spec", "step_mode", "store_state_seqs", "backend", "recompute", "static", "hyper",
                              "delay", "line", "state_seqs"})


def check_attribute_names(layer, spec):
    """An error for a learnable parameter or state whose name the layer uses for something else."""
    taken = LAYER_ATTRIBUTES | set(dir(type(layer))) | set(vars(torch.nn.Module()))
    for role, names in (("learnable parameter", spec.signature.learnable), ("state", spec.signature.states)):
        for name in names:
            if name in taken:
                raise TypeError(f"{spec.fn.__name__}: the {role} {name!r} would be hidden by the layer's own "
                                f"attribute {name!r} (layer.{name}); rename it")


def check_delay(delay, spec):
    """`delay` as a layer option: None or a `flexgen.Delay` on the first input."""
    if delay is None:
        return None
    from .delay import Delay

    if "delay" in spec.signature.parameters:
        raise TypeError(f"{spec.fn.__name__} has a parameter named 'delay', which the layer option delay= (a "
                        "flexgen.Delay on the input) would hide; rename the parameter")
    if not isinstance(delay, Delay):
        raise TypeError(f"delay must be a flexgen.Delay (per-channel delays of the first input), got "
                        f"{type(delay).__name__}; e.g. delay=flexgen.Delay(channels, max_delay=25)")
    return delay


def check_dtype(dtype):
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (the learnable parameters' dtype), got {dtype!r}")


def recurrent_weight(hidden):
    """An uninitialised [hidden, hidden] float32 weight; a MemoryError that says how large it would be where it is
    larger than this machine's memory (an overcommitting allocator would hand it out and the process be killed
    when it is filled) or cannot be allocated."""
    size = hidden * hidden * 4
    too_large = MemoryError(f"Recurrent(hidden={hidden}) needs a [{hidden}, {hidden}] recurrent weight, "
                            f"{size / 2**30:,.1f} GiB in float32, more than this machine has")
    if size > physical_memory():
        raise too_large
    try:
        return torch.empty(hidden, hidden)
    except (RuntimeError, MemoryError) as exc:
        raise too_large from exc


def physical_memory():
    """Bytes of memory this machine has (infinite where the operating system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return math.inf
