"""The backends a layer's call runs on, one module each, registered here once: `triton` (the generated Triton
kernels: CUDA tensors, or CPU tensors in Triton's interpreter), `c` (the generated C kernels on CPU tensors),
`torch` (the generated torch code, anywhere) and `eager` (the step function itself on tensors, step by step: the
tests' oracle, and the one backend whose gradients can be differentiated again).

Each module holds a `Backend`: what it runs (layer kinds, devices, dtypes, gradient orders) and why it cannot run
a call. `choose` is the one place where a layer's requested backend ("auto" or a name) becomes the backend a call
runs on, with the one message a fallback gives. A layer records what its last call took as `layer.last_run` (a
`Run`: the backend's name and the layer's path).
"""
import functools
import warnings

from .base import Backend, Run, interpreter_on
from . import c, eager, torch_code, triton

__all__ = ["Backend", "Run", "REGISTRY", "NAMES", "check_name", "choose", "interpreter_on"]

REGISTRY = {backend.name: backend for backend in (triton.BACKEND, torch_code.BACKEND, c.BACKEND, eager.BACKEND)}
NAMES = ("auto", *REGISTRY)  # what a layer's `backend=` takes


def check_name(backend):
    """A clear error unless `backend` is one of `NAMES`."""
    if backend not in NAMES:
        raise ValueError(f"backend must be one of {NAMES}, got {backend!r}")
    return backend


def choose(requested, device, dtype=None, c_builds=None, owner="flexgen"):
    """The `Backend` a call with tensors on `device` (of I/O `dtype`) runs on, for a layer built with
    `backend=requested`.

    "auto" takes Triton on CUDA tensors and, on the CPU, the C kernels where they run the call, else the
    generated torch code; a named backend runs where it can, and where it cannot: an error for "c" on CUDA tensors
    and for "triton" on CPU tensors without the interpreter, the torch code (with a warning, once per reason) for
    "c" where the C kernels cannot run the call. `c_builds` () -> None, or the reason the C kernels cannot run
    (no compiler: `flexgen.launch.c_path.CompilerError`); without it the C target is not considered. `owner`
    names the layer in messages."""
    check_name(requested)
    if requested == "auto":
        if device.type == "cuda":
            return REGISTRY["triton"]
        if device.type == "cpu" and c_builds is not None:
            reason = c.BACKEND.unavailable(device, dtype) or c_builds()
            if reason is None:
                return REGISTRY["c"]
            if c.compiler_missing(reason):
                say_once(f"flexgen: the CPU layers run generated torch code, not the faster C kernels: {reason}. "
                         "Install a C compiler or set CC (or TMPDIR, where the libraries are built, if that "
                         "directory does not allow programs); backend='torch' chooses the torch code silently")
        return REGISTRY["torch"]
    backend = REGISTRY[requested]
    reason = backend.unavailable(device, dtype)
    if requested == "c" and reason is None and c_builds is not None:
        reason = c_builds()
    if reason is None:
        return backend
    if requested == "c" and device.type == "cpu":
        say_once(f"flexgen: {owner} with backend='c' runs the torch path: {reason}")
        return REGISTRY["torch"]
    raise RuntimeError(backend.refusal(device, reason))


@functools.lru_cache(maxsize=None)
def say_once(message):
    """A warning given once per process and text (a fallback is worth one line, not one per call)."""
    warnings.warn(message, stacklevel=5)
