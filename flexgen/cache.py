"""Stage 5, cache: generated modules on disk, keyed by what they were generated from.

Takes a key and a build function from the compile stage; hands back the loaded module and its metadata.

An entry is a directory `<root>/<key>/` (the key is 64 hex digits) holding
`kernels.py` (the generated module; Triton reads its source) and `meta.json`
(layout, equations, kernel sources, the sha256 of `kernels.py` and of the
metadata itself). Beside the entries, records (`<kind>-<fingerprint>.json`)
keep values that are slow to compute and depend only on files their
fingerprint describes (Triton's version key, see `flexgen.launch.compat`).

Protocol, safe with many processes sharing one root:

* writing: the entry is built in a private `.tmp-*` directory and renamed into
  place whole, so a reader sees a whole entry or none. Names starting with a
  dot (temporaries, `.trash-*` tombstones, `.lock-*` files) are never entries.
* building: a miss takes an advisory lock `.lock-<key>` (where `fcntl` exists)
  and looks again before building, so concurrent cold starts derive once.
* reading: both files are read through one directory handle, checked
  (owner, permissions, hashes) and the module is compiled from exactly the
  verified bytes, which are also registered in `linecache` for Triton's
  `inspect.getsource`; the file is never re-read after the check.
* a damaged entry is logged as a warning and regenerated; an entry or root
  that another user owns or that group/others may write is never imported
  (a private temporary root is used instead, with a warning); so is a root
  that cannot be written.
* `clear()` renames each entry to a tombstone before deleting it, and removes the lock files.

>>> import flexgen.cache
>>> sorted(flexgen.cache.info())
['count', 'entries', 'records', 'root', 'total_bytes']
"""
import contextlib
import errno
import hashlib
import importlib.machinery
import json
import linecache
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
import types

try:
    import fcntl
except ImportError:  # not POSIX: no build lock; the atomic rename still keeps entries whole
    fcntl = None

log = logging.getLogger("flexgen.cache")

KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")
SOURCE_FILE, META_FILE = "kernels.py", "meta.json"
STALE_TEMP_SECONDS = 3600
_FALLBACK_ROOTS = {}
_FALLBACK_LOCK = threading.Lock()


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


def _meta_digest(meta):
    body = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return _sha256(json.dumps(body, sort_keys=True).encode())


# ---------------------------------------------------------------- trust


def trust_problem(st, uid=None):
    """Why a file or directory with `os.stat` result `st` must not be trusted, or None.

    Trusted means: owned by `uid` (default: this process's user) and not
    writable by group or others.

    >>> class Fake: st_uid, st_mode = 0, 0o40777
    >>> trust_problem(Fake(), uid=0)
    'writable by group or others (mode 777)'
    """
    uid = os.getuid() if uid is None and hasattr(os, "getuid") else uid
    if uid is not None and st.st_uid != uid:
        return f"owned by another user (uid {st.st_uid}, not {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _private_root(reason):
    """A per-process private temporary root, used when the configured one cannot be used."""
    with _FALLBACK_LOCK:
        fresh = reason not in _FALLBACK_ROOTS
        if fresh:
            _FALLBACK_ROOTS[reason] = tempfile.mkdtemp(prefix="flexgen-cache-")
        root = _FALLBACK_ROOTS[reason]
    if fresh:
        log.warning("%s; using the private temporary cache %s for this process", reason, root)
    return root


def usable_root(root=None):
    """The root to read and write: `root` (default `cache_root()`), created 0700, if trusted and writable.

    Otherwise a private temporary directory, with a warning saying why.
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
    return root


# ---------------------------------------------------------------- reading


class UntrustedEntry(Exception):
    """An entry that exists but must not be imported (owner or permissions)."""


class BrokenModule(Exception):
    """A generated module that does not compile or fails while it is imported; its entry has been removed.

    `lineno` and `line`: where in the generated source it failed (None if unknown); `reason`: the error's
    message without the file's path; the cause is chained.
    """

    def __init__(self, key, error, lineno, line):
        self.key, self.error, self.lineno, self.line = key, error, lineno, line
        self.reason = f"{type(error).__name__}: {error.msg if isinstance(error, SyntaxError) else error}"
        where = f" at line {lineno} (`{line}`)" if lineno else ""
        super().__init__(f"the generated module {key} failed{where}: {self.reason}")


def _open_checked(name, dir_fd, directory):
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{name} is not a regular file")
        problem = trust_problem(st)
        if problem:
            raise UntrustedEntry(f"{os.path.join(directory, name)} is {problem}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def read_entry(directory):
    """(source bytes, meta) of a whole, trusted, untampered entry; None if absent or damaged.

    Raises UntrustedEntry for an entry another user owns or others may write.
    Both files are read through one handle on the directory, so an entry
    renamed or replaced meanwhile is read whole or not at all.
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        dir_fd = os.open(directory, flags)
    except OSError:
        return None
    try:
        problem = trust_problem(os.fstat(dir_fd))
        if problem:
            raise UntrustedEntry(f"{directory} is {problem}")
        raw_meta = _open_checked(META_FILE, dir_fd, directory)
        source = _open_checked(SOURCE_FILE, dir_fd, directory)
    except OSError:
        return None  # vanished (cleared) or half-removed: a miss
    finally:
        os.close(dir_fd)
    problem = _damage(directory, raw_meta, source)
    if problem:
        log.warning("flexgen cache entry %s %s; regenerating it", directory, problem)
        return None
    return source, json.loads(raw_meta)


def _damage(directory, raw_meta, source):
    """What is wrong with an entry's bytes, or None."""
    try:
        meta = json.loads(raw_meta)
    except ValueError:
        return "has unreadable metadata"
    if not isinstance(meta, dict):
        return "has unreadable metadata"
    if meta.get("key") != os.path.basename(directory):
        return "is filed under the wrong key"
    if meta.get("meta_sha256") != _meta_digest(meta):
        return "has metadata that does not match its recorded hash"
    if meta.get("sha256") != _sha256(source):
        return "has a kernels.py that does not match its recorded hash"
    return None


# ---------------------------------------------------------------- writing


def _write_file(dir_path, name, data):
    fd = os.open(os.path.join(dir_path, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sealed_meta(key, source_bytes, meta):
    meta = dict(meta, key=key, sha256=_sha256(source_bytes))
    meta["meta_sha256"] = _meta_digest(meta)
    return meta


def store(root, key, source, meta):
    """Write the entry `<root>/<key>` whole (temporary directory, then rename); returns the sealed meta.

    If another process installed the same key first, its entry is kept.
    """
    data = source.encode()
    meta = _sealed_meta(key, data, meta)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        _write_file(tmp, SOURCE_FILE, data)
        _write_file(tmp, META_FILE, json.dumps(meta, indent=1, sort_keys=True).encode())
        try:
            os.rename(tmp, os.path.join(root, key))
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def _tombstone(root, key):
    """Move `<root>/<key>` out of the way (to a dot-name no reader takes for an entry), then delete it."""
    grave = tempfile.mkdtemp(prefix=".trash-", dir=root)
    try:
        os.rename(os.path.join(root, key), os.path.join(grave, key))
    except OSError:
        pass  # already gone (another process cleared or replaced it)
    shutil.rmtree(grave, ignore_errors=True)


class _BuildLock:
    """Advisory per-key lock in the root, so concurrent misses derive once (no-op without fcntl)."""

    def __init__(self, root, key):
        self.path = os.path.join(root, f".lock-{key}")
        self.fd = None

    def __enter__(self):
        if fcntl is not None:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            except OSError as exc:  # a lock we cannot take only costs a redundant build
                log.debug("flexgen cache lock %s unavailable: %s", self.path, exc)
                self._close()
        return self

    def __exit__(self, *exc):
        self._close()

    def _close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ---------------------------------------------------------------- importing


class _VerifiedSource:
    """Loader serving the verified text, so `linecache` can restore it even if the file goes away."""

    def __init__(self, text):
        self.text = text

    def get_source(self, name):
        return self.text


def import_source(source_bytes, path, key):
    """Import the generated module from `source_bytes` (already verified), naming it `path`.

    The bytes are compiled directly and put in `linecache` under `path`, so
    Triton's `inspect.getsource` sees exactly the text that was checked.
    One module per key and process.
    """
    name = f"flexgen_generated_{key[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    text = source_bytes.decode()
    loader = _VerifiedSource(text)
    module = types.ModuleType(name)
    module.__file__ = path
    module.__loader__ = loader
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader, origin=path)
    module.__flexgen_source__ = text
    linecache.cache[path] = (len(text), None, text.splitlines(keepends=True), path)
    code = compile(text, path, "exec", dont_inherit=True)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ---------------------------------------------------------------- records


RECORD_PATTERN = re.compile(r"^[a-z][a-z0-9-]*-[0-9a-f]{64}\.json$")


def record_name(kind, fingerprint):
    """The file name of a record: `<kind>-<fingerprint>.json` (fingerprint: 64 hex digits)."""
    return f"{kind}-{fingerprint}.json"


def remembered(kind, fingerprint, compute, root=None):
    """`compute()`'s value (a string), kept beside the entries while `fingerprint` describes its inputs.

    For values that cost more to compute than to look up and depend only on
    files the fingerprint covers. A record that is missing, unreadable,
    untrusted or filed under another fingerprint is recomputed and rewritten;
    a record that cannot be written only costs the next process the same
    computation.

    >>> import flexgen.cache, tempfile
    >>> root = tempfile.mkdtemp()
    >>> flexgen.cache.remembered("demo", "0" * 64, lambda: "computed", root)
    'computed'
    >>> flexgen.cache.remembered("demo", "0" * 64, lambda: "not called", root)
    'computed'
    """
    root = usable_root(root)
    name = record_name(kind, fingerprint)
    value = _read_record(root, name, fingerprint)
    if value is None:
        value = compute()
        _write_record(root, name, {"fingerprint": fingerprint, "value": value})
    return value


def _read_record(root, name, fingerprint):
    try:
        dir_fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None
    try:
        record = json.loads(_open_checked(name, dir_fd, root))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UntrustedEntry) as exc:
        log.warning("flexgen cache record %s cannot be used (%s); recomputing it", os.path.join(root, name), exc)
        return None
    finally:
        os.close(dir_fd)
    if not isinstance(record, dict) or record.get("fingerprint") != fingerprint or not isinstance(record.get("value"), str):
        log.warning("flexgen cache record %s is damaged; recomputing it", os.path.join(root, name))
        return None
    return record["value"]


def _write_record(root, name, record):
    """Write a record whole (a temporary file renamed over it)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=root)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(record).encode())
        os.replace(tmp, os.path.join(root, name))
    except OSError as exc:
        log.debug("flexgen cache record %s not written: %s", name, exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


# ---------------------------------------------------------------- entry points


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
    return _import_or_discard(source, root, key), meta


def _import_or_discard(source, root, key):
    """The imported module; a module that fails to import leaves the cache (BrokenModule), never to be found again."""
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
    entry = read_entry(directory)
    if entry is None:
        with _BuildLock(root, key):
            entry = read_entry(directory) or _build_into(root, key, build)
    return entry


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


def _entry_dirs(root):
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(n for n in names if KEY_PATTERN.match(n) and os.path.isdir(os.path.join(root, n)))


def _entry_summary(root, key):
    directory = os.path.join(root, key)
    size, mtime = 0, 0.0
    for name in (SOURCE_FILE, META_FILE):
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        size, mtime = size + st.st_size, max(mtime, st.st_mtime)
    neuron = None
    try:
        with open(os.path.join(directory, META_FILE), "rb") as f:
            meta = json.loads(f.read())
        neuron = meta.get("neuron") or meta.get("layout", {}).get("neuron")
    except (OSError, ValueError, AttributeError):
        pass
    return {"key": key, "neuron": neuron, "size": size, "mtime": mtime}


def info(root=None):
    """What the cache holds, without importing anything.

    Returns a dict: `root` (str), `count` (number of entries), `total_bytes`
    (int, the entries'), `entries`, a list of dicts with `key` (str), `neuron`
    (str, or None if the metadata is unreadable), `size` (bytes) and `mtime`
    (seconds since the epoch), sorted by key, and `records`, the names of the
    records beside them (Triton's version key), sorted.

    >>> import flexgen.cache, tempfile
    >>> flexgen.cache.info(tempfile.mkdtemp())["count"]
    0
    """
    root = root or cache_root()
    entries = [_entry_summary(root, key) for key in _entry_dirs(root)]
    return {"root": root, "count": len(entries), "total_bytes": sum(e["size"] for e in entries), "entries": entries,
            "records": _record_names(root)}


def _record_names(root):
    try:
        return sorted(n for n in os.listdir(root) if RECORD_PATTERN.match(n))
    except OSError:
        return []


def clear(root=None):
    """Delete every entry, the records, the build locks and leftovers of crashed writers; returns how many entries were removed.

    Safe while other processes use the cache: each entry is renamed to a
    tombstone before it is deleted, so a process loading it sees it whole or
    not at all (and then regenerates it). Modules already imported stay usable.

    >>> import flexgen.cache, tempfile
    >>> flexgen.cache.clear(tempfile.mkdtemp())
    0
    """
    root = root or cache_root()
    removed = 0
    for key in _entry_dirs(root):
        _tombstone(root, key)
        removed += 1
    now = time.time()
    try:
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        path = os.path.join(root, name)
        try:
            age = now - os.lstat(path).st_mtime
        except OSError:
            continue
        if name.startswith(".trash-") or (name.startswith(".tmp-") and age > STALE_TEMP_SECONDS):
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)
        elif RECORD_PATTERN.match(name):
            with contextlib.suppress(OSError):
                os.remove(path)
        elif name.startswith(".lock-"):
            # Builds leave their empty lock files behind. Removing one a build still holds costs at
            # most a redundant build of that key elsewhere; entries stay whole either way.
            with contextlib.suppress(OSError):
                os.remove(path)
    return removed
