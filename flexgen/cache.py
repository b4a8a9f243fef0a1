"""Stage 5: generated modules on disk, keyed by what they were generated from.

An entry is a directory `<root>/<key>/` with `kernels.py` (the generated
module; Triton needs a real source file) and `meta.json` (layout, equations,
kernel sources and the sha256 of `kernels.py`). Files are written to a temporary
name and renamed into place, and `meta.json` goes last, so a reader sees a
whole entry or none. An entry whose recorded hash does not match is rebuilt.
"""
import hashlib
import importlib.util
import json
import logging
import os
import sys
import tempfile

log = logging.getLogger("flexgen.cache")


def cache_root():
    """FLEXGEN_CACHE_DIR, else $XDG_CACHE_HOME/flexgen, else ~/.cache/flexgen."""
    if os.environ.get("FLEXGEN_CACHE_DIR"):
        return os.path.abspath(os.environ["FLEXGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flexgen")


def make_key(*parts):
    """sha256 over the given strings (spec text, specialization, templates, version)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path, data):
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _read_entry(directory):
    """(source bytes, meta) of a whole, untampered entry, else None."""
    try:
        with open(os.path.join(directory, "meta.json"), "rb") as f:
            meta = json.loads(f.read())
        with open(os.path.join(directory, "kernels.py"), "rb") as f:
            source = f.read()
    except (OSError, ValueError):
        return None
    if meta.get("sha256") != _sha256(source):
        log.warning("flexgen cache entry %s does not match its recorded hash; regenerating it", directory)
        return None
    return source, meta


def store(directory, source, meta):
    """Write an entry (kernels.py, then meta.json with its hash)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    data = source.encode()
    _write_atomic(os.path.join(directory, "kernels.py"), data)
    meta = dict(meta, sha256=_sha256(data))
    _write_atomic(os.path.join(directory, "meta.json"), json.dumps(meta, indent=1, sort_keys=True).encode())
    return meta


def load_or_build(key, build):
    """The module and metadata for `key`; `build()` -> (source, meta) runs only on a miss."""
    root = cache_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    directory = os.path.join(root, key)
    entry = _read_entry(directory)
    if entry is None:
        source, meta = build()
        meta = store(directory, source, meta)
    else:
        meta = entry[1]
    return import_module(os.path.join(directory, "kernels.py"), key), meta


def import_module(path, key):
    name = f"flexgen_generated_{key[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
