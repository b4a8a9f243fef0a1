"""What depends on the installed Triton release: the direct-launch convention, launch hooks, and Triton's
version key kept across processes. Triton is imported on first use: CPU layers never need it."""
import functools
import hashlib
import os
import sys
import threading

import torch

from .. import cache


def triton_version():
    import triton

    parts = []
    for piece in triton.__version__.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.lru_cache(maxsize=None)
def dependent_launch(index):
    """Whether kernels on CUDA device `index` can start while the launch before them finishes (a programmatic
    dependent launch): Hopper or later, and a Triton with `launch_pdl` and `tl.extra.cuda.gdc_wait` (3.4 on)."""
    if getattr(torch.version, "hip", None) is not None or torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(cuda_extra, "gdc_wait") and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def direct_launch():
    """Whether kernels are launched through their compiled launcher. Since Triton 3.3 that launcher takes every
    argument of the kernel's signature, the constexprs included (3.2 took only the others); 3.3 to 3.9 keep that
    convention."""
    return (triton_version() >= (3, 3) and getattr(torch.version, "hip", None) is None
            and os.environ.get("FLEXGEN_DIRECT_LAUNCH", "1") != "0")


@functools.lru_cache(maxsize=None)
def _launch_hook_holder():
    import triton

    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; before, the hooks were CompiledKernel's
    return knobs.runtime if knobs is not None else triton.compiler.CompiledKernel


def launch_hooks_set():
    """Whether a profiler (Proton, for one) hooks Triton launches: those go through Triton's own path."""
    hooks = _launch_hook_holder()
    return _hook_set(getattr(hooks, "launch_enter_hook", None)) or _hook_set(getattr(hooks, "launch_exit_hook", None))


def _hook_set(hook):
    """A launch hook: None, a function, or (Triton 3.5+) a chain of functions, empty when none is added."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


# Where Triton binds `triton_key`: older releases define it in compiler.compiler, newer ones in
# runtime.cache, which the autotuner imports it from by name.
TRITON_KEY_HOLDERS = ("triton.runtime.cache", "triton.compiler.compiler", "triton.runtime.autotuner")
_TRITON_KEY_LOCK = threading.Lock()


def remember_triton_key():
    """Let Triton take its version key from flexgen's cache instead of recomputing it in every process.

    Triton files its compiled kernels under a key that starts with
    `triton_key()`, a hash of its own package, a 500 MB library included.
    Each process computes it before its first kernel is compiled or loaded:
    about 0.25 s of a warm start on an H200 host, more than everything else
    the first call does. The value changes only when those files do, so it is
    kept in a cache record under `triton_fingerprint()` and Triton's function is
    replaced, in the modules that bind it, by one returning the kept value;
    the first process after any file changes computes it again with Triton's
    own function. `FLEXGEN_TRITON_KEY=0` leaves Triton as it is.
    """
    if os.environ.get("FLEXGEN_TRITON_KEY", "1") == "0":
        return
    with _TRITON_KEY_LOCK:
        holders = [m for m in (sys.modules.get(name) for name in TRITON_KEY_HOLDERS) if hasattr(m, "triton_key")]
        if not holders or getattr(holders[0].triton_key, "flexgen_kept", False):
            return
        original = holders[0].triton_key
        kept = _kept_triton_key(original)
        for module in holders:
            if module.triton_key is original:
                module.triton_key = kept


def _kept_triton_key(compute):
    @functools.lru_cache(maxsize=None)
    def triton_key():
        return cache.remembered("triton-key", triton_fingerprint(), compute)

    triton_key.flexgen_kept = True
    triton_key.computed_by = compute
    return triton_key


def triton_fingerprint():
    """sha256 over Triton's version and the path, size, modification time and inode of every file in its package."""
    installed = sys.modules["triton"]
    package = os.path.dirname(os.path.abspath(installed.__file__))
    h = hashlib.sha256(f"{installed.__version__}\0{package}\n".encode())
    for directory, subdirs, files in os.walk(package):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(files):
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
                described = f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
            except OSError as exc:
                described = f"unreadable {exc.errno}"
            h.update(f"{os.path.relpath(path, package)}\0{described}\n".encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def fp64_dot_error(device_index):
    """Why this Triton cannot run `tl.dot` on float64 operands on CUDA device `device_index` (support came with
    Triton's FP64 MMA and FMA lowering, in 2025), or None where it can: one tiny kernel, compiled and run once per
    process and device."""
    import triton
    import triton.language as tl

    @triton.jit
    def fp64_dot(a_ptr, out_ptr, N: tl.constexpr):  # as the recurrent kernels call it: an fp64 accumulator
        rows = tl.arange(0, N)
        a = tl.load(a_ptr + rows[:, None] * N + rows[None, :])
        product = tl.dot(a, a, tl.zeros([N, N], dtype=tl.float64), input_precision="ieee", out_dtype=tl.float64)
        tl.store(out_ptr + rows[:, None] * N + rows[None, :], product)

    try:
        with torch.cuda.device(device_index):
            a = torch.arange(256, dtype=torch.float64, device="cuda").reshape(16, 16) / 16
            out = torch.empty_like(a)
            fp64_dot[(1,)](a, out, N=16)
            if not torch.equal(out, a @ a):  # products of multiples of 1/16: exact in any order of the sums
                return "its float64 tl.dot gave wrong products"
    except Exception as exc:  # noqa: BLE001 - a compile or launch failure of the probe is the answer
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None
