"""Compiled libraries (the C target's shared objects), kept beside the entries.

A library is the file `c-<sha256 of its bytes>.so` in the root, found through the record
`c-library-<build key>.json` whose value is that sha256 (the build key covers the C source, the compiler and
the machine: see `flexgen.launch.c_path`). It is read like an entry's files (a regular file of ours that nobody
else may write, opened without following links) and accepted only if its bytes hash to its name. The caller gets
those bytes and loads a private copy of them, so the file in the root is never mapped after the check.
"""
import contextlib
import logging
import os
import tempfile

from .files import UntrustedEntry, _ROOT_FLAGS, _descriptor, _open_checked
from .keys import KEY_PATTERN, _sha256, library_name, record_name
from .locking import _BuildLock
from .maintenance import _sweep_stale
from .records import _read_record, _write_record
from .roots import usable_root

log = logging.getLogger("flexgen.cache")

RECORD_KIND = "c-library"


def load_or_build_library(build_key, build, root=None):
    """The bytes of the library built for `build_key`; `build()` -> bytes runs only on a miss, under the key's lock.

    A missing, damaged or untrusted library is rebuilt (with a warning for the last two); a root that cannot be
    written only costs the next process the same build.

    >>> import flexgen.cache, tempfile
    >>> root = tempfile.mkdtemp()
    >>> flexgen.cache.load_or_build_library("cd" * 32, lambda: b"built", root)
    b'built'
    >>> flexgen.cache.load_or_build_library("cd" * 32, lambda: b"not called", root)
    b'built'
    """
    if not isinstance(build_key, str) or not KEY_PATTERN.match(build_key):
        raise ValueError(f"library build keys are 64 lowercase hex digits, got {build_key!r}")
    root = usable_root(root)
    data = _cached(root, build_key, warn=False)  # the look under the lock says what is wrong, once
    if data is None:
        with _BuildLock(root, build_key):
            data = _cached(root, build_key)
            if data is None:
                data = build()
                _store(root, build_key, data)
                _sweep_stale(root)
    return data


def _cached(root, build_key, warn=True):
    """The bytes of the library the record for `build_key` names, if that library is there, trusted and whole
    (what is wrong otherwise logged as a warning where `warn` says so)."""
    digest = _read_record(root, record_name(RECORD_KIND, build_key), build_key, warn)
    if digest is None:
        return None
    if not KEY_PATTERN.match(digest):
        if warn:
            log.warning("flexgen cache record %s names no library; rebuilding it",
                        record_name(RECORD_KIND, build_key))
        return None
    return _read_library(root, digest, warn)


def _read_library(root, digest, warn=True):
    name = library_name(digest)
    path = os.path.join(root, name)
    try:
        root_fd = os.open(root, _ROOT_FLAGS)
    except OSError:
        return None
    with _descriptor(root_fd):
        try:
            data = _open_checked(name, root_fd, root)
        except FileNotFoundError:
            return None
        except (OSError, UntrustedEntry) as exc:
            if warn:
                log.warning("flexgen cache library %s cannot be used (%s); rebuilding it", path, exc)
            return None
        if _sha256(data) != digest:
            if warn:
                log.warning("flexgen cache library %s does not match its name's hash; rebuilding it", path)
            return None
        with contextlib.suppress(OSError, NotImplementedError):  # a load counts as a use for clear(older_than_days)
            os.utime(name, dir_fd=root_fd, follow_symlinks=False)
    return data


def _store(root, build_key, data):
    """Write the library whole (a temporary file renamed into place), then the record that names it."""
    digest = _sha256(data)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=root)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, library_name(digest)))
    except OSError as exc:
        log.debug("flexgen cache library %s not written: %s", library_name(digest), exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        return
    _write_record(root, record_name(RECORD_KIND, build_key), {"fingerprint": build_key, "value": digest})
