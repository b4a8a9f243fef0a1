"""The C target: the generated C source compiled with the system's C compiler and called on contiguous [T, N]
arrays, with what the torch path does around its loops.

A library is compiled once per source, compiler and machine, and kept in flexgen's disk cache (see
`flexgen.cache.libraries`), so later processes load it without compiling. Each process loads a private copy
(in a temporary directory nobody else can write) of the bytes the cache verified. `available()` says whether
this machine can: a C compiler (`$CC`, else `cc` or `gcc`) that builds a shared library. OpenMP, the machine's
vector instructions and glibc's vector math are used where the compiler and C library have them. A compiler call
that runs longer than `FLEXGEN_CC_TIMEOUT` seconds (default `CC_TIMEOUT`) is stopped and counts as a failure; a
compiler that timed out is not called again in that process.
"""
import atexit
import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings
from typing import NamedTuple

import torch

from .. import cache
from ..render.c_abi import c_backward_parameters, c_forward_parameters
from ..render.layout import Backward, Forward, Kind
from .abi import learnable_gradients, per_neuron
from .allocate import BINARY, buffer_shapes_dtypes, line_rows
from .config import HALF_DTYPES, compute_dtype, numel
from .torch_path import _saved_rows, flat, rows

DTYPES = {torch.float32: ("f32", ctypes.c_float), torch.float64: ("f64", ctypes.c_double)}
# No fused multiply-adds (the torch path rounds every product); math that never sets errno or traps (the same values;
# else loops with a math call or a comparison, a threshold, stay scalar: a LIF step 4 ns a neuron, not 0.8).
FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math")
# (compiler flags, libraries) each added where the compiler and C library take them: threads, the machine's vector
# instructions, and vector exp and log from glibc's libmvec (at most a few ulps from the scalar ones)
OPTIONS = ((("-fopenmp",), ()), (("-march=native",), ()), (("-DFLEXGEN_VECTOR_MATH",), ("-lmvec",)))
PROBE = """#include <math.h>
#ifdef FLEXGEN_VECTOR_MATH
#pragma omp declare simd notinbranch
float expf(float);
#endif
void flexgen_probe(float *restrict y, const float *restrict x, long n) {
#pragma omp parallel for simd
    for (long i = 0; i < n; ++i) y[i] = expf(x[i]);
}
"""
# flags and libraries a cached record of the usable options may name: those above, nothing else
KNOWN_FLAGS = frozenset(FLAGS).union(*(extra for extra, _ in OPTIONS))
KNOWN_LIBRARIES = frozenset().union(*(libs for _, libs in OPTIONS))
CC_TIMEOUT = 300.0  # seconds a compiler call may take (FLEXGEN_CC_TIMEOUT overrides it)
_LOCK = threading.Lock()
_FAILED = {}  # source -> the CompilerError it gave
_TIMED_OUT = {}  # compiler -> the CompilerError of its call that timed out


class CompilerError(RuntimeError):
    """No C compiler here, or it failed on a generated source."""


@functools.lru_cache(maxsize=None)
def compiler():
    """The C compiler's path: $CC, else cc, else gcc; None if there is none. A $CC that names no program is said
    once (a warning naming what is used instead)."""
    wanted = os.environ.get("CC")
    if wanted and shutil.which(wanted):
        return shutil.which(wanted)
    path = next(filter(None, map(shutil.which, ("cc", "gcc"))), None)
    if wanted:
        instead = f"using {path} instead" if path else "no cc or gcc either, so the C target is not used"
        warnings.warn(f"flexgen: CC={wanted!r} names no program found here; {instead}", stacklevel=2)
    return path


def timeout():
    """Seconds a compiler call may take: FLEXGEN_CC_TIMEOUT (a positive number), else CC_TIMEOUT."""
    value = os.environ.get("FLEXGEN_CC_TIMEOUT")
    if not value:
        return CC_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        warnings.warn(f"flexgen: FLEXGEN_CC_TIMEOUT={value!r} is not a positive number of seconds; using "
                      f"{CC_TIMEOUT:g}", stacklevel=2)
        return CC_TIMEOUT
    return seconds


@functools.lru_cache(maxsize=None)
def _build_dir():
    path = tempfile.mkdtemp(prefix="flexgen-c-")  # mode 0700: only this user can put a library here
    atexit.register(shutil.rmtree, path, True)  # (a loaded library stays mapped once its file is gone)
    return path


def _run(cc, flags, libraries, source_path, library_path):
    """The finished compiler call (a CompletedProcess); CompilerError if it runs past `timeout()`, after stopping
    it and every process it started (its own session), and never calling `cc` again in this process."""
    if cc in _TIMED_OUT:
        raise _TIMED_OUT[cc]
    command = [cc, *flags, source_path, "-o", library_path, *libraries, "-lm"]
    limit = timeout()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop(process)
            _TIMED_OUT[cc] = CompilerError(
                f"{cc} did not finish within {limit:g} s on {source_path} and was stopped (FLEXGEN_CC_TIMEOUT sets "
                "the limit in seconds)")
            raise _TIMED_OUT[cc] from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _stop(process):
    """Kill a compiler call's process group (a driver's children hold its pipes open), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (AttributeError, OSError):  # no process groups here, or already gone
        process.kill()
    process.communicate()


def _cpu_identity():
    """What `-march=native` compiles for: the CPU's model and feature flags (Linux), else the platform's words.
    A cache shared between machines (a home directory on NFS) must not hand one CPU another's instructions."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)
def _machine(cc):
    """sha256 of what a library's build depends on besides its source: the compiler (its resolved path, size and
    modification time), the C library and the CPU."""
    real = os.path.realpath(cc)
    st = os.stat(real)
    parts = (real, str(st.st_size), str(st.st_mtime_ns), platform.machine(), " ".join(platform.libc_ver()),
             _cpu_identity())
    return cache.make_key(*parts)


@functools.lru_cache(maxsize=None)
def _usable_options(cc):
    """(flags, libraries, the path of the cache record they were read from, None where probed now): FLAGS plus each
    of OPTIONS with which a probe compiles and loads; probed once per compiler and machine, then read from the
    cache. A record whose value is not such options is damaged: recomputed, with a warning."""
    root = cache.usable_root()
    probed = []

    def probe():
        probed.append(True)
        return json.dumps(_probe(cc))

    value = cache.remembered("c-options", _options_key(cc), probe, root, check=_options_check)
    flags, libraries = json.loads(value)
    record = None if probed else os.path.join(root, cache.record_name("c-options", _options_key(cc)))
    return tuple(flags), tuple(libraries), record


def _options_key(cc):  # the record of `cc`'s usable options: per machine and FLAGS
    return cache.make_key(_machine(cc), " ".join(FLAGS))


def _options_check(value):
    """Whether a cached value is usable options: JSON [flags, libraries], FLAGS first, each one of ours."""
    try:
        flags, libraries = json.loads(value)
    except (ValueError, TypeError):
        return False
    return (isinstance(flags, list) and isinstance(libraries, list) and tuple(flags[:len(FLAGS)]) == FLAGS
            and all(isinstance(f, str) and f in KNOWN_FLAGS for f in flags)
            and all(isinstance(lib, str) and lib in KNOWN_LIBRARIES for lib in libraries))


def _probe(cc):
    flags, libraries = list(FLAGS), []
    probe = os.path.join(_build_dir(), "probe.c")
    with open(probe, "w") as f:
        f.write(PROBE)
    for n, (extra, libs) in enumerate(OPTIONS):
        library = os.path.join(_build_dir(), f"probe{n}.so")
        if _run(cc, flags + list(extra), libraries + list(libs), probe, library).returncode == 0:
            try:
                ctypes.CDLL(library)
            except OSError:
                continue
            flags += extra
            libraries += libs
    return flags, libraries


@functools.lru_cache(maxsize=None)
def load(source):
    """The compiled library of a generated C source: from the disk cache, else compiled (and kept there). A
    failure is remembered in this process too, so a source that does not compile is tried once."""
    cc = compiler()
    if cc is None:
        raise CompilerError("no C compiler found ($CC, cc or gcc)")
    if source in _FAILED:
        raise _FAILED[source]
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    try:
        flags, libraries, record = _usable_options(cc)
    except CompilerError as exc:  # the probe timed out
        _FAILED[source] = exc
        raise
    build_key = cache.make_key(source, _machine(cc), json.dumps([flags, libraries]))
    try:
        data = cache.load_or_build_library(build_key, lambda: _compile(cc, flags, libraries, source, digest, record))
    except CompilerError as exc:
        _FAILED[source] = exc
        raise
    library_path = _private_copy(data)
    try:
        return ctypes.CDLL(library_path)
    except OSError as exc:
        _FAILED[source] = CompilerError(f"the library {cc} built from the generated C source does not load: {exc}")
        raise _FAILED[source] from exc


def _compile(cc, flags, libraries, source, digest, record=None):
    """The bytes of the library `cc` builds from `source` (in this process's private directory); `record`: the
    cache record the flags and libraries were read from (a failure names it), None where they were probed now."""
    with _LOCK:
        source_path = os.path.join(_build_dir(), f"kernels_{digest}.c")
        library_path = os.path.join(_build_dir(), f"kernels_{digest}.so")
        with open(source_path, "w") as f:
            f.write(source)
        result = _run(cc, flags, libraries, source_path, library_path)
    if result.returncode != 0:
        cached = (f"\nThe options {' '.join(flags + libraries)} came from the cached record {record}; delete it (or "
                  "run `flexgen cache clear`) to probe the compiler again" if record else "")
        raise CompilerError(f"{cc} failed on the generated C source ({source_path}):\n{result.stderr[-2000:]}"
                            f"{cached}")
    with open(library_path, "rb") as f:
        return f.read()


def _private_copy(data):
    """The path of a file in this process's private directory holding exactly `data` (what the cache verified)."""
    path = os.path.join(_build_dir(), f"c-{hashlib.sha256(data).hexdigest()}.so")
    with _LOCK:
        if not os.path.exists(path):
            fd, tmp = tempfile.mkstemp(dir=_build_dir())
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
    return path


@functools.lru_cache(maxsize=None)
def available():
    """Whether this machine compiles and loads the C target (a compiler that builds a shared library)."""
    try:
        load("int flexgen_available(void) { return 1; }\n")
    except (CompilerError, OSError):
        return False
    return True


# kind -> (its parameter list, how many counts and flags lead them: n_steps, n_elem, THREADS, [SAVE,] STATE_SEQS)
_KINDS = {"forward": (c_forward_parameters, 5), "backward": (c_backward_parameters, 4)}


@functools.lru_cache(maxsize=None)
def _kernel(library, layout, kind, dtype):
    """(the library's `kind` function for `dtype`, with its ctypes argument types; its parameter list), made once."""
    suffix, scalar = DTYPES[dtype]
    parameter_list, n_leading = _KINDS[kind]
    parameters = parameter_list(layout)
    fn = getattr(library, f"{layout.neuron}_{kind}{layout.variant.suffix}_{suffix}")
    types = {"data": ctypes.c_void_p, "stride": ctypes.c_int64, "step": ctypes.c_int64, "value": scalar}
    fn.argtypes = ([ctypes.c_int64, ctypes.c_int64] + [ctypes.c_int] * (n_leading - 2)
                   + [types[p.part] for p in parameters])
    fn.restype = None
    return fn, parameters


def _pointer(t):
    return None if t is None else t.data_ptr()


def _values(parameters, groups, strides, hyper, steps=()):
    """Each parameter's value: a tensor's data pointer, a learnable parameter's neuron stride, a gradient's step
    stride (`steps`, by gradient output), a hyper-parameter."""
    values = []
    for p in parameters:
        if p.part == "stride":
            values.append(strides[p.index])
        elif p.part == "step":
            values.append(steps[p.index])
        elif p.part == "value":
            values.append(hyper[p.index])
        else:
            values.append(_pointer(groups[p.group][p.index]))
    return values


def learnable_data(call_learnable, step_shape, dtype, layout=None):
    """Learnable parameters as contiguous data with neuron strides: one value (stride 0) or one per neuron; after
    them a tapped line's taps ([channels, K]) as tap-major rows of one tap per neuron, [K, N], and a held line as
    its [max_delay, N] rows."""
    n_summed = len(call_learnable) if layout is None else len(layout.learnable)
    data = [per_neuron(w.detach(), step_shape).to(dtype).contiguous() for w in call_learnable[:n_summed]]
    strides = [0 if w.dim() == 0 else 1 for w in data]
    if layout is not None and layout.tapped:
        taps = call_learnable[n_summed].detach().to(dtype)
        n = numel(step_shape)  # (one channel: per_neuron gives one value)
        data.append(torch.stack([per_neuron(column, step_shape).reshape(-1).expand(n) for column in taps.unbind(1)]))
    if layout is not None and layout.held:  # [max_delay, N] rows
        data.append(call_learnable[-1].detach().to(dtype).reshape(layout.max_delay, -1).contiguous())
    return data, strides


def takes(dtype):
    """Whether the C kernels run calls of this I/O dtype: fp32 and fp64 as they are, fp16 and bf16 through the fp32
    kernels (converted on the way in and out; the values saved for the backward stay in fp32)."""
    return dtype in DTYPES or dtype in HALF_DTYPES


def c_forward(library, kernels, call):
    """The C forward on [T, N] arrays; results in the inputs' shape, as `torch_path.torch_forward` returns them. A
    16-bit call runs the fp32 kernels: outputs and final states come back in its dtype, saved values in fp32."""
    layout, shape, n_elem = kernels.layout, call.shape, call.n_elem
    n_steps, step_shape = shape[0], shape[1:]
    io = call.inputs[0].dtype
    dtype = compute_dtype(io)
    xs = [rows(x.detach(), n_steps, n_elem).to(dtype).contiguous() for x in call.inputs]
    vs = [flat(v.detach(), n_elem).to(dtype).contiguous() for v in call.states]
    ws, strides = learnable_data(call.learnable, step_shape, dtype, layout)
    new = functools.partial(torch.empty, dtype=dtype, device=xs[0].device)
    final_shape = shape if call.state_seqs else step_shape
    # Made in the inputs' shape and written through [T, N] views: a result is its own tensor, not a view (FSDP2
    # warns of a module that returns a view), at no copy.
    outputs = [new(shape) for _ in layout.outputs]
    finals = [new(final_shape) for _ in layout.states]
    made = buffer_shapes_dtypes(layout, (n_steps, n_elem), dtype)  # per step, or checkpoints (recompute)
    buffers = [torch.empty(s, dtype=dt, device=xs[0].device) for s, dt in made] if call.save else [None] * len(made)
    groups = {Forward.INPUTS: xs, Forward.STATES: vs, Forward.LEARNABLE: ws, Forward.OUTPUTS: outputs,
              Forward.FINALS: finals, Forward.BUFFERS: buffers}
    fn, parameters = _kernel(library, layout, "forward", dtype)
    fn(n_steps, n_elem, torch.get_num_threads(), int(call.save), int(call.state_seqs),
       *_values(parameters, groups, strides, call.hyper))
    saved = [b.view(s[0], *step_shape) for b, (s, _) in zip(buffers, made)] if call.save else []
    return [o.to(io) for o in outputs] + [f.to(io) for f in finals] + saved


def c_backward(library, kernels, call):
    """The C backward through time; results as `torch_path.torch_backward` returns them (a 16-bit call's
    gradients of the inputs and initial states in its dtype, computed by the fp32 kernels)."""
    layout, shape, n_elem = kernels.layout, call.shape, call.n_elem
    n_steps, step_shape = shape[0], shape[1:]
    like = call.grad_outputs[0]
    io = like.dtype
    dtype = compute_dtype(io)
    saved = [_saved_rows(s, t.detach(), n_steps, n_elem).to(BINARY if s.binary else dtype).contiguous()
             for s, t in zip(layout.saved, call.saved)]
    grad_outputs, steps = zip(*(_gradient_rows(g, n_steps, n_elem, dtype) for g in call.grad_outputs))
    grad_states = [(rows(g, n_steps, n_elem) if call.state_seqs else flat(g, n_elem)).to(dtype).contiguous()
                   for g in call.grad_states]
    ws, strides = learnable_data(call.learnable, step_shape, dtype, layout)
    new = functools.partial(torch.empty, dtype=dtype, device=like.device)
    grad_inputs = [new(n_steps, n_elem) for _ in layout.grad_inputs]
    grad_prev = [new(n_elem) for _ in layout.carried]
    partials = [new(n_elem) for _ in layout.learnable] + line_rows(layout, n_steps, n_elem, dtype, like.device)
    groups = {Backward.SAVED: saved, Backward.GRAD_OUTPUTS: grad_outputs, Backward.GRAD_STATES: grad_states,
              Backward.LEARNABLE: ws, Backward.GRAD_INPUTS: grad_inputs, Backward.GRAD_PREV: grad_prev,
              Backward.PARTIALS: partials}
    fn, parameters = _kernel(library, layout, "backward", dtype)
    fn(n_steps, n_elem, torch.get_num_threads(), int(call.state_seqs),
       *_values(parameters, groups, strides, call.hyper, steps))
    return ([g.view(shape).to(io) for g in grad_inputs] + [g.view(step_shape).to(io) for g in grad_prev]
            + learnable_gradients(layout, partials, call.learnable, step_shape))


def _gradient_rows(grad, n_steps, n_elem, dtype):
    """(data, step stride) of an output's gradient as the C backward reads it: contiguous [T, N] rows, N apart; or,
    for a gradient that is the same at every step (expanded over time, as `sum()`'s is), its one row with stride 0,
    instead of T copies of it."""
    if grad.dim() == 0 or (grad.shape[0] and grad.stride(0) == 0):
        return flat(grad if grad.dim() == 0 else grad[0], n_elem).to(dtype).contiguous(), 0
    return rows(grad, n_steps, n_elem).to(dtype).contiguous(), n_elem


class Rows(NamedTuple):
    """A kernel argument that is one row of a [rows, N] array, chosen per step t: row (sign * t + offset), taken
    modulo `period` where one is given (two rows used in turn); sign 0 keeps one row for every step."""

    tensor: torch.Tensor
    offset: int = 0
    period: int = 0
    sign: int = 1

    def pointer(self, t):
        at = self.sign * t + self.offset
        if self.period:
            at %= self.period
        return self.tensor.data_ptr() + at * self.tensor.stride(0) * self.tensor.element_size()


class StepCall:
    """One of a library's kernels called one step at a time (n_steps = 1, STATE_SEQS = 0) on rows of arrays that
    stay allocated for the whole sequence: per step only the rows' pointers change, so a call costs a ctypes call
    and no tensors. `groups` maps each parameter group to its arguments: `Rows`, a tensor (passed as is) or
    None."""

    def __init__(self, library, layout, kind, dtype, groups, strides, hyper, flags):
        self.fn, parameters = _kernel(library, layout, kind, dtype)
        self.flags = flags  # the leading counts and flags, n_steps = 1 first
        self.fixed, self.moving = [], []  # values; (position, Rows) of the arguments that move per step
        for p in parameters:
            if p.part == "stride":
                self.fixed.append(strides[p.index])
            elif p.part == "step":  # one step a call: its rows' pointers are the arguments
                self.fixed.append(0)
            elif p.part == "value":
                self.fixed.append(hyper[p.index])
            else:
                arg = groups[p.group][p.index]
                if isinstance(arg, Rows):
                    self.moving.append((len(self.fixed), arg))
                    self.fixed.append(None)
                else:
                    self.fixed.append(_pointer(arg))

    def __call__(self, t):
        values = list(self.fixed)
        for at, rows_of in self.moving:
            values[at] = rows_of.pointer(t)
        self.fn(*self.flags, *values)


def steps_one_at_a_time(layout, dtype):
    """Whether `StepCall` runs this layout's kernels for calls of this dtype: fp32 or fp64, and the plain design,
    whose backward reads per-step values only (inputs, outputs, buffers)."""
    per_step = (Kind.INPUT, Kind.OUTPUT, Kind.BUFFER)
    return dtype in DTYPES and not layout.variant.recompute and all(v.kind in per_step for v in layout.saved)
