"""The cache's entry point: the module for a key, loaded from its entry or built under the key's lock."""
import contextlib
import os

from .entries import BrokenModule, _tombstone, import_source, read_entry, store
from .files import UntrustedEntry
from .keys import KEY_PATTERN, SOURCE_FILE, _sealed_meta
from .locking import _BuildLock
from .maintenance import _sweep_stale
from .roots import _private_root, usable_root


def load_or_build(key, build):
    """The module and metadata for `key`; `build()` -> (source, meta) runs only on a miss.

    Never raises because of the cache's state: damaged entries are rebuilt,
    untrusted ones or unusable roots are replaced by a private temporary root.
    A module that fails to import raises `BrokenModule`, and its entry is removed.

    >>> import flexgen.cache, os, tempfile
    >>> os.environ["FLEXGEN_CACHE_DIR"] = tempfile.mkdtemp()
    >>> module, meta = flexgen.cache.load_or_build("ab" * 32, lambda: ("ANSWER = 42", {"neuron": "demo"}))
    >>> module.ANSWER, meta["neuron"], flexgen.cache.info()["count"]
    (42, 'demo', 1)
    """
    source, meta, root = entry_or_build(key, build)
    return import_entry(source, root, key), meta


def entry_or_build(key, build):
    """(source bytes, meta, root) of the entry for `key`, built on a miss as `load_or_build` does, without
    importing it: `import_entry(source, root, key)` imports it when it is needed (the C target needs only
    the metadata)."""
    if not isinstance(key, str) or not KEY_PATTERN.match(key):
        raise ValueError(f"cache keys are 64 lowercase hex digits, got {key!r}")
    root = usable_root()
    try:
        source, meta = _lookup_or_build(root, key, build)
    except UntrustedEntry as exc:
        root = _private_root(f"flexgen cache entry {exc}, so it is not imported")
        try:
            source, meta = _lookup_or_build(root, key, build)
        except UntrustedEntry:  # even the private root looks foreign: keep the result in memory only
            source, meta = build()
            source = source.encode()
            meta = _sealed_meta(key, source, meta)
    return source, meta, root


def import_entry(source, root, key):
    """The imported module of an entry's verified `source`; a module that fails to import leaves the cache
    (BrokenModule), never to be found again."""
    path = os.path.join(root, key, SOURCE_FILE)
    try:
        return import_source(source, path, key)
    except Exception as exc:
        _tombstone(root, key)
        lineno = _failing_line(exc, path)
        lines = source.decode().splitlines()
        line = lines[lineno - 1].strip() if lineno and lineno <= len(lines) else None
        raise BrokenModule(key, exc, lineno, line) from exc


def _failing_line(exc, path):
    """The line of the module at `path` where `exc` was raised, or None."""
    if isinstance(exc, SyntaxError) and exc.filename == path:
        return exc.lineno
    lineno, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return lineno


def _lookup_or_build(root, key, build):
    """(source bytes, meta) from `<root>/<key>`, building it under the key's lock on a miss."""
    directory = os.path.join(root, key)
    entry = read_entry(directory, warn=False)  # the look under the lock says what is wrong, once
    if entry is None:
        with _BuildLock(root, key):
            entry = read_entry(directory)
            if entry is None:
                entry = _build_into(root, key, build)
                _sweep_stale(root)
    else:
        _touch(directory)
    return entry


def _touch(directory):
    """Note a load in the entry directory's modification time, which `clear(older_than_days=...)` goes by."""
    with contextlib.suppress(OSError, NotImplementedError):
        os.utime(directory, follow_symlinks=False)


def _build_into(root, key, build):
    """Build, install and return (source bytes, meta); replaces a damaged entry."""
    if os.path.lexists(os.path.join(root, key)):
        _tombstone(root, key)
    source, meta = build()
    meta = store(root, key, source, meta)
    try:
        installed = read_entry(os.path.join(root, key))
    except UntrustedEntry:
        installed = None
    if installed is not None and installed[1]["sha256"] == meta["sha256"]:
        return installed
    return source.encode(), meta  # someone else's entry won (or it vanished): use our own bytes
