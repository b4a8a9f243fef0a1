"""The compile stage: a spec, its static options and a layer kind through trace, derive, render and cache, loaded.

`compile_kernels` runs every kind (`flexgen.kinds`) alike: the kind says what keys its entry, how its kernels are
generated from the derivation and how the generated module is loaded; hands the loaded kernels (the kind's
`Compiled*`, with its custom ops) to the layers.
"""
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import sys
import threading

from . import cache
from .errors import SpecError
from .frames import template_name, template_paths
from .launch.compat import remember_triton_key
from .version import __version__

_COMPILED = {}  # cache key -> the loaded kernels: custom ops can be registered once per process
_KIND_OF = {}  # cache key -> the name of the layer kind its kernels were loaded as
_LOCK = threading.RLock()


def compile_kernels(spec, static, kind, options=()):
    """The loaded kernels of `spec`'s layer `kind` (a `flexgen.kinds.Kind`) with the kind's `options` and the
    static options `static` (complete: see `NeuronSpec.static_values`): generated on the first call, then loaded
    from the cache. A record kept under the step's lasting fingerprint gives the entry's key without tracing."""
    fingerprint = lasting_fingerprint(spec, static, kind, options)
    kept = _kept_key(fingerprint)
    key = kept or cache_key(spec, static, kind=kind, options=options)
    with _LOCK:
        if key not in _COMPILED:
            built = []
            source, meta, root = cache.entry_or_build(
                key, lambda: built.append(1) or generate(spec.trace(**static), kind, options))
            if built:  # checked once, where it is generated; the cache's hashes guard it afterwards
                _check_compiles(spec, source, root, key)
            if fingerprint is not None and kept is None:
                cache.remember("trace-key", fingerprint, key)
            _COMPILED[key] = kind.load(_lazy_module(spec, source, root, key), meta, key)
            _KIND_OF[key] = kind.name
        return _COMPILED[key]


def loaded_kernels():
    """cache key -> (layer kind's name, the loaded kernels) of every entry loaded in this process."""
    with _LOCK:
        return {key: (_KIND_OF[key], compiled) for key, compiled in _COMPILED.items()}


def load_entry(key, carried=None):
    """The loaded kernels (and so the registered custom ops) of the cache entry `key`, without the spec that made
    it, loaded as the layer kind its metadata names: from this machine's cache or, where it lacks the entry and
    `carried` is given, (module source, metadata) written into the cache first. Raises LookupError where
    neither has it."""
    from . import kinds

    def build():
        if carried is None:
            raise LookupError(f"no flexgen cache entry {key} here")
        return carried

    with _LOCK:
        if key not in _COMPILED:
            source, meta, root = cache.entry_or_build(key, build)
            if "kind" not in meta:
                raise LookupError(f"the flexgen cache entry {key} names no layer kind (written by an older flexgen)")
            kind = kinds.get(meta["kind"])
            _COMPILED[key] = kind.load(_lazy_module(None, source, root, key), meta, key)
            _KIND_OF[key] = kind.name
        return _COMPILED[key]


def lasting_fingerprint(spec, static, kind=None, options=()):
    """A hash of what `spec`'s trace for `static` depends on, where it means the same in any process
    (`NeuronSpec.lasting_key`: the step's code, defaults and outside values, its signature and options), with
    the generator's files, the Python and sympy versions and the layer kind's key (none: the plain kind); None for
    a step that reads an object by identity."""
    lasting = spec.lasting_key(static)
    if lasting is None:
        return None
    parts = () if kind is None else kind.key(options)
    return cache.make_key(lasting, generator_fingerprint(), __version__, sys.version, _sympy_version(), *parts)


def cache_key(spec, static, fingerprint=None, kind=None, options=()):
    """The cache key of `spec`'s kernels of `kind` (none: the plain kind) for `static`: a hash of the traced
    program's text, what the kernels are generated from. Where `fingerprint` (`lasting_fingerprint`) is given, a
    record kept under it by an earlier process gives the key without tracing, or importing sympy;
    `compile_kernels` writes it once the entry exists."""
    parts = () if kind is None else kind.key(options)
    return _kept_key(fingerprint) or cache.make_key(spec.trace(**static).text(), spec.static_key(static), *parts,
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
        if spec is None:  # an entry loaded by its key alone (`load_entry`)
            raise
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


def generate(trace, kind, options=()):
    """(module source, metadata) of a layer kind's kernels for a traced step: derive, then the kind renders."""
    from .derive.derivation import derive  # (a cache miss: sympy and jinja2 only here)

    return kind.generate(derive(trace), options)


@functools.lru_cache(maxsize=None)
def generator_fingerprint():
    """sha256 of every source file of the package and every kernel frame, for the cache key: a change
    anywhere in the generator must not reuse kernels generated before it, and a new module cannot fall
    outside the key."""
    h = hashlib.sha256()
    package = pathlib.Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for path in template_paths():
        h.update(template_name(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
