"""The compile stage: a spec and its static options through trace, derive, render and cache, loaded.

Hands a `CompiledNeuron` (the generated module, its layouts, the custom ops of both variants) to module.py.
"""
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import sys
import threading

import torch

from . import cache
from .errors import SpecError
from .frames import template_paths
from .launch import NeuronOps
from .launch import c_path
from .launch.compat import remember_triton_key
from .launch.config import compute_dtype
from .launch.recurrent.ops import RecurrentOps
from .launch.triton_path import SpecialisedLaunches
from .render.layout import Layout, recompute_layout
from .render.recurrent_abi import RecurrentLayout, recurrent_backward_arguments, recurrent_forward_arguments
from .version import __version__

_COMPILED = {}  # cache key -> CompiledNeuron: custom ops can be registered once per process
_LOCK = threading.RLock()


def compile_spec(spec, static):
    """The `CompiledNeuron` of `spec` with the static options `static` (complete: see
    `NeuronSpec.static_values`): generated on the first call, then loaded from the cache."""
    fingerprint = lasting_fingerprint(spec, static)
    kept = _kept_key(fingerprint)
    key = kept or cache_key(spec, static)
    with _LOCK:
        if key not in _COMPILED:
            built = []
            source, meta, root = cache.entry_or_build(key, lambda: built.append(1) or generate(spec.trace(**static)))
            if built:  # checked once, where it is generated; the cache's hashes guard it afterwards
                _check_compiles(spec, source, root, key)
            if fingerprint is not None and kept is None:
                cache.remember("trace-key", fingerprint, key)
            _COMPILED[key] = CompiledNeuron(_lazy_module(spec, source, root, key), meta, key)
        return _COMPILED[key]


def lasting_fingerprint(spec, static):
    """A hash of what `spec`'s trace for `static` depends on, where it means the same in any process
    (`NeuronSpec.lasting_key`: the step's code, defaults and outside values, its signature and options), with
    the generator's files and the Python and sympy versions; None for a step that reads an object by identity."""
    lasting = spec.lasting_key(static)
    if lasting is None:
        return None
    return cache.make_key(lasting, generator_fingerprint(), __version__, sys.version, _sympy_version())


def cache_key(spec, static, fingerprint=None):
    """The cache key of `spec`'s kernels for `static`: a hash of the traced program's text, what the kernels are
    generated from. Where `fingerprint` (`lasting_fingerprint`) is given, a record kept under it by an earlier
    process gives the key without tracing, or importing sympy; `compile_spec` writes it once the entry exists."""
    return _kept_key(fingerprint) or cache.make_key(spec.trace(**static).text(), spec.static_key(static),
                                                    generator_fingerprint(), __version__)


def _kept_key(fingerprint):
    """The cache key a record keeps for `fingerprint`, or None."""
    kept = None if fingerprint is None else cache.recalled("trace-key", fingerprint)
    return kept if kept is not None and cache.KEY_PATTERN.match(kept) else None


def _check_compiles(spec, source, root, key):
    """A SpecError now, not at the first call, for a generated module that is not valid Python."""
    try:
        compile(source, key, "exec", dont_inherit=True)
    except SyntaxError:
        _import(spec, source, root, key)  # raises the SpecError naming the line, and removes the entry


@functools.lru_cache(maxsize=None)
def _sympy_version():
    """The installed sympy's version, read without importing it (tracing depends on it)."""
    return importlib.metadata.version("sympy")


def _lazy_module(spec, source, root, key):
    path = os.path.join(root, key, cache.SOURCE_FILE)
    return DeferredImport(functools.partial(_import, spec, source, root, key), source, path)


def _import(spec, source, root, key):
    """The generated module of an entry, imported at its first use."""
    try:
        module = cache.import_entry(source, root, key)
    except cache.BrokenModule as exc:
        raise _invalid_code_error(spec, exc) from exc
    remember_triton_key()  # before Triton compiles or loads any of these kernels
    return module


class DeferredImport:
    """A generated module imported at its first attribute lookup. Its Triton kernels and torch functions are
    looked up when a call runs them; a layer on the C target needs only the entry's metadata, so it never
    imports the module, nor Triton."""

    def __init__(self, load, source, path):
        self._load, self._module, self._lock = load, None, threading.Lock()
        self.__flexgen_source__ = source.decode()  # the verified text and its path, as the imported module has them
        self.__file__ = path

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        with self._lock:
            if self._module is None:
                self._module = self._load()
        return getattr(self._module, name)


def _invalid_code_error(spec, broken):
    """The SpecError for a spec whose generated module does not import: it names the spec and the failing line."""
    code = spec.fn.__code__
    where = f" at generated line {broken.lineno}: `{broken.line}`" if broken.lineno else ""
    return SpecError(
        f"flexgen generated invalid code for the neuron {spec.fn.__name__!r} ({code.co_filename}:{code.co_firstlineno})"
        f"{where} ({broken.reason}). Nothing was cached. This is a flexgen bug: please "
        "report it with the step function; backend='eager' runs the step without generated code meanwhile"
    )


def generate(trace):
    """(module source, metadata) for a traced step: derive, then render."""
    from .derive.derivation import derive, equations  # (a cache miss: sympy and jinja2 only here)
    from .render.contexts import render

    derivation = derive(trace)
    source, layout, sources = render(derivation)
    meta = {"layout": layout.to_json(), "sources": sources, "equations": equations(derivation), "version": __version__}
    return source, meta


@functools.lru_cache(maxsize=None)
def generator_fingerprint():
    """sha256 of every source file of the package and every kernel frame, for the cache key: a change
    anywhere in the generator must not reuse kernels generated before it, and a new module cannot fall
    outside the key."""
    h = hashlib.sha256()
    package = pathlib.Path(__file__).resolve().parent
    sources = sorted(package.rglob("*.py")) + template_paths()
    for path in sources:
        name = path.relative_to(package).as_posix() if path.is_relative_to(package) else path.name
        h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class CompiledNeuron:
    """A generated module loaded from the cache, with the custom ops of its plain and recompute variants."""

    def __init__(self, module, meta, key):
        self.module, self.meta, self.key = module, meta, key
        self.layout = Layout.from_json(meta["layout"])
        # Both variants' ops are registered now, never inside a compiled graph's trace.
        self.ops = NeuronOps(module, self.layout, key)
        self.recompute_ops = NeuronOps(module, recompute_layout(self.layout), key)

    def ops_for(self, recompute):
        """The custom ops of the plain kernels, or of the recompute variant."""
        return self.recompute_ops if recompute else self.ops

    def ops_for_call(self, recompute, use_triton, like):
        """The ops a call runs through. `recompute`: True, False or "auto", which recomputes where the recompute
        kernels move fewer bytes than the plain ones: for Triton kernels on CUDA, where they are bound by memory
        (the interpreter and the torch path keep the plain design; the C target: `c_ops_for`)."""
        if recompute == "auto":
            recompute = use_triton and like.device.type == "cuda" and self.recompute_pays(like.dtype)
        return self.ops_for(recompute)

    @functools.cached_property
    def c_library(self):
        """The C target's library (compiled at the first use on this machine and kept in the disk cache;
        `flexgen.launch.c_path.CompilerError` if it cannot be)."""
        return c_path.load(self.meta["sources"]["c"])

    def c_ops_for(self, recompute):
        """The custom ops of the plain or the recompute design on the C target; "auto" runs the plain one (on the
        development CPU the recompute pair was faster only from T 128-256 on, and up to 1.9x slower at T 8:
        docs/perf/bench_cpu.md, bench_cpu_lif_small_t.md)."""
        return self._c_recompute_ops if recompute is True else self._c_plain_ops

    @functools.cached_property
    def _c_plain_ops(self):
        return self._c_ops(self.layout)

    @functools.cached_property
    def _c_recompute_ops(self):
        return self._c_ops(recompute_layout(self.layout))

    def _c_ops(self, layout):
        library = self.c_library
        cpu = (functools.partial(c_path.c_forward, library), functools.partial(c_path.c_backward, library))
        return NeuronOps(self.module, layout, self.key, cpu=cpu, target="_c", c_library=library)

    def recompute_pays(self, dtype):
        """Whether the recompute kernels move fewer bytes per step than the plain ones for this I/O dtype."""
        sizes = torch.finfo(dtype).bits // 8, torch.finfo(compute_dtype(dtype)).bits // 8
        return self.recompute_ops.layout.saved_bytes_per_step(*sizes) < self.ops.layout.saved_bytes_per_step(*sizes)

    def module_source(self):
        """The text the module was compiled from (verified by the cache; not re-read from disk)."""
        return self.module.__flexgen_source__


# ---------------------------------------------------------------- delayed inputs


def compile_delayed(spec, static, input, max_delay, tapped=False, held=False):
    """The `CompiledDelayed` of `spec` with its input `input` read through a delay line of at most `max_delay`
    steps (every step of it weighed by taps if `tapped`; continuing a line held from earlier calls if `held`), for
    the static options `static` (complete)."""
    trace = spec.trace(**static)
    key = cache.make_key(trace.text(), spec.static_key(static), "delayed", input, str(max_delay),
                         *(["tapped"] if tapped else []), *(["held"] if held else []), generator_fingerprint(),
                         __version__)
    with _LOCK:
        if key not in _COMPILED:
            source, meta, root = cache.entry_or_build(
                key, lambda: generate_delayed(trace, input, max_delay, tapped, held))
            _COMPILED[key] = CompiledDelayed(_lazy_module(spec, source, root, key), meta, key)
        return _COMPILED[key]


def generate_delayed(trace, input, max_delay, tapped=False, held=False):
    """(module source, metadata) of the neuron's kernels with a delayed input."""
    from .derive.derivation import derive
    from .render.contexts import render_delayed

    source, layout, sources = render_delayed(derive(trace), input, max_delay, tapped, held)
    meta = {"layout": layout.to_json(), "sources": sources, "version": __version__}
    return source, meta


class CompiledDelayed:
    """A neuron's kernels with a delayed input, loaded from the cache: the custom ops of the plain design (a
    delayed input is read again by the backward, so recomputing would save nothing for it), on Triton and on the
    C target."""

    def __init__(self, module, meta, key):
        self.module, self.meta, self.key = module, meta, key
        self.layout = Layout.from_json(meta["layout"])
        self.ops = NeuronOps(module, self.layout, key)

    def ops_for_call(self, recompute, use_triton, like):
        return self.ops

    @functools.cached_property
    def c_library(self):
        """The C target's library (`CompiledNeuron.c_library`)."""
        return c_path.load(self.meta["sources"]["c"])

    def c_ops_for(self, recompute):
        return self._c_ops

    @functools.cached_property
    def _c_ops(self):
        library = self.c_library
        cpu = (functools.partial(c_path.c_forward, library), functools.partial(c_path.c_backward, library))
        return NeuronOps(self.module, self.layout, self.key, cpu=cpu, target="_c")

    def module_source(self):
        return self.module.__flexgen_source__


# ---------------------------------------------------------------- recurrent layers


def compile_recurrent(spec, static, input, output, delayed=False, tapped=False, synaptic=False):
    """The `CompiledRecurrent` of `spec`'s recurrent layer with `output` fed back into `input` (names of the
    spec's input and output; through per-neuron delays if `delayed`, of any taps if `tapped`; a delay per synapse if
    `synaptic`), for the static options `static` (complete)."""
    trace = spec.trace(**static)
    line = ["delayed-taps"] if tapped else ["delayed"] if delayed else ["synaptic"] if synaptic else []
    key = cache.make_key(trace.text(), spec.static_key(static), "recurrent", input, output, *line,
                         generator_fingerprint(), __version__)
    with _LOCK:
        if key not in _COMPILED:
            source, meta, root = cache.entry_or_build(
                key, lambda: generate_recurrent(trace, input, output, delayed, tapped, synaptic))
            _COMPILED[key] = CompiledRecurrent(_lazy_module(spec, source, root, key), meta, key)
        return _COMPILED[key]


def generate_recurrent(trace, input, output, delayed=False, tapped=False, synaptic=False):
    """(module source, metadata) of a recurrent layer's kernels."""
    from .derive.derivation import derive
    from .render.contexts import render_recurrent

    source, layout, sources = render_recurrent(derive(trace), input, output, delayed, tapped, synaptic)
    meta = {"neuron": trace.name, "layout": layout.to_json(), "sources": sources, "version": __version__}
    return source, meta


class CompiledRecurrent:
    """A recurrent layer's generated module loaded from the cache, with its `RecurrentLayout`."""

    def __init__(self, module, meta, key):
        self.module, self.meta, self.key = module, meta, key
        self.layout = RecurrentLayout.from_json(meta["layout"])
        self.ops = RecurrentOps(self)  # registered now, never inside a compiled graph's trace
        self._launches = {}
        self.argument_plans = {}  # eager calls' kernel arguments by call signature (`launch.recurrent`)

    def kernel(self, kind):
        """The Triton kernel of `kind`: "forward", "inference" or "backward"."""
        return getattr(self.module, self.layout.kernel_name(kind))

    def launches(self, kind):
        """The eager launches of the kernel of `kind` (`flexgen.launch.triton_path.SpecialisedLaunches`)."""
        if kind not in self._launches:
            self._launches[kind] = SpecialisedLaunches(self.kernel(kind))
        return self._launches[kind]

    @functools.cached_property
    def arguments(self):
        """The kernels' argument lists by kind (`flexgen.render.layout`), made once: every call walks them."""
        return {"forward": recurrent_forward_arguments(self.layout, training=True),
                "inference": recurrent_forward_arguments(self.layout, training=False),
                "backward": recurrent_backward_arguments(self.layout)}

    def module_source(self):
        return self.module.__flexgen_source__
