"""Constant 0-d tensors reused across eager calls: zero gradients and constant initial states."""
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_SCALARS = {}


def cached_scalar(value, dtype, device):
    """A 0-d tensor holding `value`, made once per value, dtype and device, for eager calls.

    Expanded, it serves as a zero gradient or a constant initial state without
    a fill launch per call. Nothing writes into it (kernels only read states and
    gradients). Made fresh, never cached, while anything traces or transforms
    (torch.compile, export, fake tensors, torch.func: the tensor would be theirs)
    or a CUDA graph is captured (a tensor made then is only written at replay).
    """
    if tracing_or_transforming():
        return torch.full((), value, dtype=dtype, device=device)
    key = (value, dtype, device)
    t = _SCALARS.get(key)
    if t is None:
        t = torch.full((), value, dtype=dtype, device=device)
        if type(t) is torch.Tensor and (device.type != "cuda" or not torch.cuda.is_current_stream_capturing()):
            _SCALARS[key] = t
    return t


def is_kept(t, value):
    """Whether `t` is the tensor `cached_scalar(value, ...)` keeps for later calls (not one made for this call only)."""
    return _SCALARS.get((value, t.dtype, t.device)) is t


def cached_zero(dtype, device):
    return cached_scalar(0.0, dtype, device)


def fresh_zero(dtype, device):
    return torch.zeros((), dtype=dtype, device=device)


def tracing_or_transforming():
    """Whether tensors made now may belong to a tracer or transform rather than to this process's eager calls."""
    return (
        torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or _get_current_dispatch_mode() is not None
    )
