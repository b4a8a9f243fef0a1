"""Which root a process uses: the configured one if it is trusted and writable (marked as flexgen's at its first
use), else a private temporary root that the process removes when it exits."""
import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading

from .files import _open_root, trust_problem
from .inventory import _claim, _write_marker
from .keys import cache_root

log = logging.getLogger("flexgen.cache")


_FALLBACK_ROOTS = {}
_FALLBACK_LOCK = threading.Lock()
_PRIVATE_ROOTS = []  # (pid, path) of private temporary roots, removed at exit by the process that made them
_CLAIMED_ROOTS = set()  # roots this process has marked or found foreign (usable_root checks each once)
_CLAIMED_LOCK = threading.Lock()


def _private_root(reason):
    """A per-process private temporary root, used when the configured one cannot be used."""
    with _FALLBACK_LOCK:
        fresh = reason not in _FALLBACK_ROOTS
        if fresh:
            _FALLBACK_ROOTS[reason] = _make_private_root()
        root = _FALLBACK_ROOTS[reason]
    if fresh:
        log.warning("%s; using the private temporary cache %s for this process", reason, root)
    return root


def _make_private_root():
    """A marked `flexgen-cache-*` temporary directory that this process removes when it exits."""
    root = tempfile.mkdtemp(prefix="flexgen-cache-")
    with contextlib.suppress(OSError), _open_root(root) as root_fd:
        _write_marker(root_fd)
    if not _PRIVATE_ROOTS:
        atexit.register(_remove_private_roots)
    _PRIVATE_ROOTS.append((os.getpid(), root))
    return root


def _remove_private_roots():
    """At exit: delete the private roots this process made (not those of a parent it was forked from)."""
    for pid, root in _PRIVATE_ROOTS:
        if pid == os.getpid():
            shutil.rmtree(root, ignore_errors=True)


def usable_root(root=None):
    """The root to read and write: `root` (default `cache_root()`), created 0700, if trusted and writable.

    Otherwise a private temporary directory, with a warning saying why. The
    first use in a process marks the root as flexgen's cache (see `_claim`).
    """
    root = root or cache_root()
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.stat(root)
    except OSError as exc:
        return _private_root(f"flexgen cache dir {root} cannot be created ({exc.strerror})")
    problem = trust_problem(st)
    if problem:
        return _private_root(f"flexgen cache dir {root} is {problem}; it is not used")
    if not os.access(root, os.W_OK | os.X_OK):
        return _private_root(f"flexgen cache dir {root} is read-only")
    _claim_once(root)
    return root


def _claim_once(root):
    """Mark `root` as flexgen's cache at its first use in this process, or warn once that it is not."""
    with _CLAIMED_LOCK:
        if root in _CLAIMED_ROOTS:
            return
        _CLAIMED_ROOTS.add(root)
    try:
        with _open_root(root) as root_fd:
            why_not = _claim(root_fd, root)
    except OSError:
        return
    if why_not:
        log.warning(
            "flexgen cache dir %s %s; flexgen stores its entries there but does not mark it as its cache, "
            "so `flexgen cache clear` refuses it unless given --force", root, why_not)
