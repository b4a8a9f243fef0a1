"""What flexgen wrote in a root: the marker that claims a directory as flexgen's cache, and the classification of
every name in it (entries, records, locks, temporaries, tombstones, or not provably flexgen's)."""
import contextlib
import dataclasses
import json
import logging
import os
import stat

from .files import _open_dir, _owned, _read_regular, _CLOEXEC, _NOFOLLOW, fcntl, file_kind
from .keys import ENTRY_FILES, KEY_PATTERN, LIBRARY_PATTERN, LOCK_PATTERN, MARKER_FILE, MARKER_TEXT, META_FILE, RECORD_MAX_BYTES, RECORD_PATTERN, TEMP_PATTERN, TRASH_PATTERN, _MARKER_HEAD, _meta_digest, _sha256

log = logging.getLogger("flexgen.cache")


@dataclasses.dataclass
class _Item:
    """One name in the root, as `info()` and `clear()` see it."""

    name: str
    kind: str  # entry, record, library, lock, temp, trash, marker, or foreign (not provably flexgen's)
    size: int = 0  # bytes of its regular files
    used: float = 0.0  # its latest modification; for an entry also its latest load (see `_touch`)
    neuron: object = None
    reason: str = ""  # why a foreign item does not count as flexgen's


WORKING_KINDS = ("lock", "temp", "trash")


def _foreign(name, reason):
    return _Item(name, "foreign", reason=reason)


def _has_marker(root_fd):
    """Whether the root holds flexgen's marker: a regular file of ours that begins with `_MARKER_HEAD`."""
    try:
        data, st = _read_regular(MARKER_FILE, root_fd)
    except OSError:
        return False
    return _owned(st) and data.startswith(_MARKER_HEAD)


def _write_marker(root_fd):
    fd = os.open(MARKER_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=root_fd)
    with os.fdopen(fd, "wb") as f:
        f.write(MARKER_TEXT)


@contextlib.contextmanager
def _claim_lock(root_fd):
    """Serialise marking a root among processes: an advisory lock on the root directory itself."""
    locked = False
    if fcntl is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(root_fd, fcntl.LOCK_EX)
            locked = True
    try:
        yield
    finally:
        if locked:
            fcntl.flock(root_fd, fcntl.LOCK_UN)


def _claim(root_fd, root):
    """None if the root is flexgen's cache, else why it is not.

    It is if it holds flexgen's marker, or, adopted now, if it is ours and
    everything in it is provably flexgen's (an empty directory, or a cache
    written by a flexgen from before the marker): then the marker is written.
    """
    with _claim_lock(root_fd):
        if _has_marker(root_fd):
            return None
        if not _owned(os.fstat(root_fd)):
            return "is owned by another user"
        foreign = next((item for item in _items(root_fd) if item.kind == "foreign"), None)
        if foreign is not None:
            return f"holds {foreign.name!r} ({foreign.reason}), which flexgen did not write"
        try:
            _write_marker(root_fd)
        except OSError as exc:  # read-only: flexgen's all the same
            log.debug("flexgen cache marker not written in %s: %s", root, exc)
        else:
            log.info("marked %s as flexgen's cache (everything in it was flexgen's)", root)
        return None


def _inventory(root_fd, marked):
    """The items in the root; working-file names count as flexgen's only in a marked root."""
    items = []
    for item in _items(root_fd):
        if item.kind in WORKING_KINDS and not marked:
            item = _foreign(item.name, "named like flexgen's working files, in a directory not marked as its cache")
        items.append(item)
    return items


def _items(root_fd):
    for name in sorted(os.listdir(root_fd)):
        item = _classify(root_fd, name)
        if item is not None:
            yield item


def _classify(root_fd, name):
    """What `name` in the root is, counting as flexgen's only what it can prove it wrote; None if it vanished."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        if not _owned(st):
            return _foreign(name, f"owned by another user (uid {st.st_uid})")
        if name == MARKER_FILE:
            return _marker_item(root_fd, name, st)
        if KEY_PATTERN.match(name):
            return _entry_item(root_fd, name, st)
        if RECORD_PATTERN.match(name):
            return _record_item(root_fd, name, st)
        if LIBRARY_PATTERN.match(name):
            return _library_item(root_fd, name, st)
        if LOCK_PATTERN.match(name):
            if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                return _Item(name, "lock", 0, st.st_mtime)
            return _foreign(name, f"{file_kind(st.st_mode)}, not an empty lock file")
        if TEMP_PATTERN.match(name) or TRASH_PATTERN.match(name):
            return _working_item(root_fd, name, st)
        if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
            return _foreign(name, "not a name flexgen writes")
        return _foreign(name, f"{file_kind(st.st_mode)}, not a name flexgen writes")
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _foreign(name, f"unreadable: {exc.strerror}")


def _marker_item(root_fd, name, st):
    if _has_marker(root_fd):
        return _Item(name, "marker", st.st_size, st.st_mtime)
    if stat.S_ISREG(st.st_mode):
        return _foreign(name, "a cache directory tag flexgen did not write")
    return _foreign(name, f"{file_kind(st.st_mode)}, not flexgen's cache directory tag")


def _entry_files(dir_fd):
    """({name: lstat} of the entry-shaped directory `dir_fd`'s files, None) or (partial dict, why it is not one)."""
    files = {}
    for child in sorted(os.listdir(dir_fd)):
        if child not in ENTRY_FILES:
            return files, f"holds {child!r}, which flexgen does not write"
        st = os.stat(child, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            return files, f"its {child} is {file_kind(st.st_mode)}, not a regular file"
        if not _owned(st):
            return files, f"its {child} is owned by another user"
        files[child] = st
    return files, None


def _entry_item(root_fd, name, st):
    """An entry: a directory holding only regular `kernels.py` / `meta.json` and a meta.json sealed for `name`."""
    if not stat.S_ISDIR(st.st_mode):
        return _foreign(name, f"{file_kind(st.st_mode)}, not an entry directory")
    with _open_dir(name, root_fd) as dir_fd:
        files, problem = _entry_files(dir_fd)
        if problem:
            return _foreign(name, problem)
        if META_FILE not in files:
            return _foreign(name, "has no meta.json")
        raw, _ = _read_regular(META_FILE, dir_fd)
    meta = _sealed_meta_of(raw, name)
    if meta is None:
        return _foreign(name, "its meta.json is not a flexgen meta.json sealed for this key")
    used = max([st.st_mtime] + [f.st_mtime for f in files.values()])
    layout = meta.get("layout")
    neuron = meta.get("neuron") or (layout.get("neuron") if isinstance(layout, dict) else None)
    return _Item(name, "entry", sum(f.st_size for f in files.values()), used, neuron=neuron)


def _sealed_meta_of(raw, key):
    """The metadata in `raw` if it is a meta.json that flexgen sealed for `key` (its own hash matches), else None."""
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    if isinstance(meta, dict) and meta.get("key") == key and meta.get("meta_sha256") == _meta_digest(meta):
        return meta
    return None


def _record_item(root_fd, name, st):
    """A record: a regular file holding {"fingerprint": <the fingerprint in its name>, "value": <a string>}."""
    if not stat.S_ISREG(st.st_mode):
        return _foreign(name, f"{file_kind(st.st_mode)}, not a record file")
    if st.st_size > RECORD_MAX_BYTES:
        return _foreign(name, "too large for a record flexgen wrote")
    raw, st = _read_regular(name, root_fd)
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    fingerprint = name[-len(".json") - 64:-len(".json")]
    if isinstance(record, dict) and record.get("fingerprint") == fingerprint and isinstance(record.get("value"), str):
        return _Item(name, "record", st.st_size, st.st_mtime)
    return _foreign(name, "not a record flexgen wrote (its content does not match its name)")


def _library_item(root_fd, name, st):
    """A compiled library: a regular file whose bytes have the sha256 in its name (`c-<sha256>.so`)."""
    if not stat.S_ISREG(st.st_mode):
        return _foreign(name, f"{file_kind(st.st_mode)}, not a library file")
    raw, st = _read_regular(name, root_fd)
    if _sha256(raw) == LIBRARY_PATTERN.match(name).group(1):
        return _Item(name, "library", st.st_size, st.st_mtime)
    return _foreign(name, "not a library flexgen wrote (its content does not match its name)")


def _working_item(root_fd, name, st):
    """A `.tmp-*` (a half-written entry, or a record's file) or a `.trash-*` tombstone holding removed entries."""
    kind = "temp" if name.startswith(".tmp-") else "trash"
    if kind == "temp" and stat.S_ISREG(st.st_mode):
        return _Item(name, kind, st.st_size, st.st_mtime)
    if not stat.S_ISDIR(st.st_mode):
        return _foreign(name, f"{file_kind(st.st_mode)}, not a {'temporary' if kind == 'temp' else 'tombstone'}")
    with _open_dir(name, root_fd) as dir_fd:
        stats, problem = _tombstone_files(dir_fd) if kind == "trash" else _entry_files(dir_fd)
    if problem:
        return _foreign(name, problem)
    stats = list(stats.values())
    return _Item(name, kind, sum(f.st_size for f in stats), max([st.st_mtime] + [f.st_mtime for f in stats]))


def _tombstone_files(dir_fd):
    """Like `_entry_files`, for a tombstone: it holds only entry-shaped `<key>` directories."""
    files = {}
    for child in sorted(os.listdir(dir_fd)):
        st = os.stat(child, dir_fd=dir_fd, follow_symlinks=False)
        if not (KEY_PATTERN.match(child) and stat.S_ISDIR(st.st_mode) and _owned(st)):
            return files, f"holds {child!r}, which is not an entry flexgen removed"
        with _open_dir(child, dir_fd) as entry_fd:
            found, problem = _entry_files(entry_fd)
        if problem:
            return files, f"{child} {problem}"
        files.update((f"{child}/{n}", s) for n, s in found.items())
    return files, None
