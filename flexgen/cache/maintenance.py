"""`info()` and `clear()` (what `flexgen cache info|clear` run), and the sweep of stale working files after a
build: they touch only what `inventory` proves flexgen wrote."""
import contextlib
import math
import os
import shutil
import stat
import time

from .entries import _tombstone
from .files import _open_root
from .inventory import WORKING_KINDS, _claim, _classify, _has_marker, _inventory
from .keys import TEMP_PATTERN, TRASH_PATTERN, cache_root


STALE_TEMP_SECONDS = 3600


class NotFlexgenCache(Exception):
    """`clear()` was asked to empty a directory flexgen has not marked as its cache."""


def _survey(root):
    """(marked, items, why it is not marked or None) for the directory `root`; (False, [], None) if there is none."""
    try:
        with _open_root(root) as root_fd:
            why_not = _claim(root_fd, root)
            return why_not is None, _inventory(root_fd, why_not is None), why_not
    except OSError:
        return False, [], None


def info(root=None):
    """What the cache holds, without importing anything.

    Returns a dict: `root` (str); `marked` (bool, the directory is marked as
    flexgen's cache, see the module's docstring); `count` (number of entries);
    `total_bytes` (int, all of flexgen's files there: entries, records,
    libraries, lock files, temporaries); `entries`, a list of dicts with `key` (str), `neuron`
    (str or None), `size` (bytes) and `mtime` (when it was last written or
    loaded, seconds since the epoch), sorted by key; `records`, the names of
    the records beside them (Triton's version key, which C library a build
    made), sorted; `libraries`, the names of the compiled C libraries
    (`c-<sha256>.so`), sorted; `working_files`, the names of build locks,
    temporaries and tombstones; and `not_flexgen`,
    a list of dicts with `name` and `reason` for everything else, which
    `clear()` leaves alone. Nothing is opened unless it is a regular file.
    An unmarked directory that holds nothing but flexgen's files is marked
    now (adopted), as at any first use.

    >>> import flexgen.cache, tempfile
    >>> flexgen.cache.info(tempfile.mkdtemp())["count"]
    0
    """
    root = root or cache_root()
    marked, items, _ = _survey(root)
    entries = [{"key": i.name, "neuron": i.neuron, "size": i.size, "mtime": i.used} for i in items if i.kind == "entry"]
    return {
        "root": root,
        "marked": marked,
        "count": len(entries),
        "total_bytes": sum(i.size for i in items if i.kind != "foreign"),
        "entries": entries,
        "records": [i.name for i in items if i.kind == "record"],
        "libraries": [i.name for i in items if i.kind == "library"],
        "working_files": [i.name for i in items if i.kind in WORKING_KINDS],
        "not_flexgen": [{"name": i.name, "reason": i.reason} for i in items if i.kind == "foreign"],
    }


def clear(root=None, force=False, older_than_days=None):
    """Delete flexgen's entries, records, compiled libraries, build locks and leftovers of crashed writers, and
    nothing else.

    Only what flexgen can prove it wrote is removed (see the module's
    docstring); the rest is returned under `not_flexgen`. A directory that is
    not marked as flexgen's cache raises NotFlexgenCache and is left as it is,
    unless `force=True`: then its entries, records and libraries are removed, still only
    those flexgen can prove it wrote. With `older_than_days`, only entries not
    written or loaded for that many days are removed (and records, libraries,
    temporaries and lock files as old); fresh temporaries are kept
    either way, as a build may be writing them.

    Returns a dict: `root`, `marked`, `removed` (entries removed), `kept`
    (entries kept because they were used more recently) and `not_flexgen`
    (dicts with `name` and `reason`). Safe while other processes use the
    cache: each entry is renamed to a tombstone before it is deleted, so a
    process loading it sees it whole or not at all (and then regenerates
    it). Modules already imported stay usable.

    >>> import flexgen.cache, tempfile
    >>> flexgen.cache.clear(tempfile.mkdtemp())["removed"]
    0
    """
    cutoff = _cutoff(older_than_days)
    root = root or cache_root()
    marked, items, why_not = _survey(root)
    foreign = [{"name": i.name, "reason": i.reason} for i in items if i.kind == "foreign"]
    if why_not and not force:
        raise NotFlexgenCache(
            f"{root} is not marked as flexgen's cache: it {why_not}. Nothing was removed. If it is flexgen's cache "
            "directory, `flexgen cache clear --force` (force=True) removes the entries and records in it that "
            "flexgen can prove it wrote and leaves everything else alone")
    entries = [i for i in items if i.kind == "entry"]
    kept = {i.name for i in entries if i.used > cutoff}
    for item in entries:
        if item.name not in kept:
            _tombstone(root, item.name)
    now = time.time()
    for item in items:
        if _is_garbage(item, cutoff, kept, now):
            _remove(root, item)
    return {"root": root, "marked": marked, "removed": len(entries) - len(kept), "kept": len(kept),
            "not_flexgen": foreign}


def _cutoff(older_than_days):
    """The time before which an item counts as old enough to remove (infinity without a limit)."""
    if older_than_days is None:
        return math.inf
    if isinstance(older_than_days, bool) or not isinstance(older_than_days, (int, float)) or not older_than_days >= 0:
        raise ValueError(f"older_than_days must be a number of days >= 0, got {older_than_days!r}")
    return time.time() - older_than_days * 86400.0


def _is_garbage(item, cutoff, kept_keys, now):
    """Whether `clear()` removes a record or working file (entries are handled before)."""
    if item.kind in ("record", "library"):
        return item.used <= cutoff
    if item.kind == "lock":  # left by a killed build (or an older flexgen); removing a held one costs a rebuild
        return item.name[len(".lock-"):] not in kept_keys and item.used <= cutoff
    if item.kind == "temp":  # a fresh temporary may be a build in progress
        return now - item.used > STALE_TEMP_SECONDS and item.used <= cutoff
    return item.kind == "trash"


def _sweep_stale(root):
    """After a build, remove what crashed or killed processes left: temporaries older than STALE_TEMP_SECONDS and
    tombstones. Only what `_classify` proves flexgen wrote, in a marked root; errors are ignored."""
    with contextlib.suppress(OSError):
        with _open_root(root) as root_fd:
            if not _has_marker(root_fd):
                return
            now = time.time()
            for name in os.listdir(root_fd):
                if not (TEMP_PATTERN.match(name) or TRASH_PATTERN.match(name)):
                    continue
                item = _classify(root_fd, name)
                if item is not None and item.kind in ("temp", "trash") and _is_garbage(item, math.inf, (), now):
                    _remove(root, item)


def _remove(root, item):
    path = os.path.join(root, item.name)
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)  # never follows links inside
        else:
            os.remove(path)
