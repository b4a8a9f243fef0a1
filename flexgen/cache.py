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
  (a private temporary root is used instead, with a warning, and removed when
  the process exits); so is a root that cannot be written.
* files are opened only when they are regular files (looked at with lstat,
  opened with O_NOFOLLOW | O_NONBLOCK, checked with fstat): a FIFO, device or
  symbolic link where a cache file belongs is skipped and reported, never
  read or waited on.
* the root carries a marker, `CACHEDIR.TAG` (the cache directory tag that
  backup tools skip, with a line naming flexgen), written when flexgen creates
  the root or first uses one that holds nothing but flexgen's files.
  `info()` and `clear()` count as flexgen's only what it can prove it wrote:
  entries holding nothing but `kernels.py` and a sealed `meta.json` filed
  under their key, records whose content matches their name, and, only in a
  marked root, its lock files, temporaries and tombstones. Everything else is
  reported as not flexgen's and left alone; `clear()` refuses an unmarked
  root unless forced. Nothing is followed through a symbolic link.
* `clear()` renames each entry to a tombstone before deleting it, and removes
  the lock files; a load touches its entry, so `clear(older_than_days=...)`
  removes only entries not used for that long.

>>> import flexgen.cache
>>> sorted(flexgen.cache.info())
['count', 'entries', 'marked', 'not_flexgen', 'records', 'root', 'total_bytes', 'working_files']
"""
import atexit
import contextlib
import dataclasses
import errno
import hashlib
import importlib.machinery
import json
import linecache
import logging
import math
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
ENTRY_FILES = frozenset((SOURCE_FILE, META_FILE))
STALE_TEMP_SECONDS = 3600
MARKER_FILE = "CACHEDIR.TAG"
# The first line is the signature of the Cache Directory Tagging Specification (backup tools skip
# tagged directories); the second is what tells flexgen the directory is its own.
_MARKER_HEAD = b"Signature: 8a477f597d28d172789f06886806bc55\n# flexgen kernel cache\n"
MARKER_TEXT = _MARKER_HEAD + (
    b"# flexgen wrote this file when it created this directory or took it over as its cache.\n"
    b"# `flexgen cache info` lists what flexgen keeps here; `flexgen cache clear` removes it.\n"
)
LOCK_PATTERN = re.compile(r"^\.lock-[0-9a-f]{64}$")
TEMP_PATTERN = re.compile(r"^\.tmp-[A-Za-z0-9_]+$")
TRASH_PATTERN = re.compile(r"^\.trash-[A-Za-z0-9_]+$")
RECORD_MAX_BYTES = 1 << 20  # records hold one short string; a larger file of that name is not flexgen's
_FALLBACK_ROOTS = {}
_FALLBACK_LOCK = threading.Lock()
_PRIVATE_ROOTS = []  # (pid, path) of private temporary roots, removed at exit by the process that made them
_CLAIMED_ROOTS = set()  # roots this process has marked or found foreign (usable_root checks each once)
_CLAIMED_LOCK = threading.Lock()

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NONBLOCK | _CLOEXEC  # the root may be a link the user set
_DIR_FLAGS = _ROOT_FLAGS | _NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC


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


def _owned(st):
    """Whether this process's user owns the file with `os.stat` result `st`."""
    return not hasattr(os, "getuid") or st.st_uid == os.getuid()


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


class NotRegularFile(OSError):
    """A FIFO, device, socket, directory or symbolic link where a cache file belongs."""


_FILE_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
               (stat.S_ISREG, "a regular file"))


def file_kind(mode):
    """What a file with `st_mode` `mode` is, in words.

    >>> import stat
    >>> file_kind(stat.S_IFIFO | 0o600)
    'a FIFO'
    """
    return next((name for test, name in _FILE_KINDS if test(mode)), "a special file")


def _open_root(root):
    """A context manager holding a descriptor of the directory `root` (which may be a link the user set)."""
    return _descriptor(os.open(root, _ROOT_FLAGS))


def _open_dir(name, dir_fd):
    """A context manager holding a descriptor of the directory `name` in `dir_fd`; never follows a link."""
    return _descriptor(os.open(name, _DIR_FLAGS, dir_fd=dir_fd))


@contextlib.contextmanager
def _descriptor(fd):
    try:
        yield fd
    finally:
        os.close(fd)


def _read_regular(name, dir_fd):
    """(bytes, os.stat_result) of `name` in the directory `dir_fd`, if it is a regular file.

    It is looked at (lstat) before it is opened, so a FIFO or device is never
    opened, and opened with O_NOFOLLOW | O_NONBLOCK and checked with fstat, so
    one swapped in meanwhile is neither waited on nor read. Anything else
    raises NotRegularFile.
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, f"{name} is {file_kind(st.st_mode)}, not a regular file")
    with _descriptor(os.open(name, _FILE_FLAGS, dir_fd=dir_fd)) as fd:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"{name} is {file_kind(st.st_mode)}, not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(), st


def _open_checked(name, dir_fd, directory):
    data, st = _read_regular(name, dir_fd)
    problem = trust_problem(st)
    if problem:
        raise UntrustedEntry(f"{os.path.join(directory, name)} is {problem}")
    return data


def read_entry(directory):
    """(source bytes, meta) of a whole, trusted, untampered entry; None if absent or damaged.

    Raises UntrustedEntry for an entry another user owns or others may write.
    Both files are read through one handle on the directory, so an entry
    renamed or replaced meanwhile is read whole or not at all. A special file
    (a FIFO, say) in the entry is reported and never opened.
    """
    try:
        dir_fd = os.open(directory, _DIR_FLAGS)
    except OSError:
        return None
    try:
        problem = trust_problem(os.fstat(dir_fd))
        if problem:
            raise UntrustedEntry(f"{directory} is {problem}")
        raw_meta = _open_checked(META_FILE, dir_fd, directory)
        source = _open_checked(SOURCE_FILE, dir_fd, directory)
    except NotRegularFile as exc:
        log.warning("flexgen cache entry %s: %s; regenerating it", directory, exc.strerror)
        return None
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
    """Advisory per-key lock in the root, so concurrent misses derive once (no-op without fcntl).

    The holder removes the lock file when it is done, so builds leave nothing behind. A process that was
    waiting on the removed file finds, once it holds it, that the path no longer names that file, and takes
    the lock again on the current one.
    """

    ATTEMPTS = 8  # each retry means another process finished a build meanwhile; beyond this, build unlocked

    def __init__(self, root, key):
        self.path = os.path.join(root, f".lock-{key}")
        self.fd = None

    def __enter__(self):
        if fcntl is None:
            return self
        for _ in range(self.ATTEMPTS):
            try:
                self._check_regular(os.lstat(self.path).st_mode)
            except NotRegularFile as exc:  # a FIFO or device is never opened: build without the lock
                log.warning("flexgen cache lock %s %s; building without it", self.path, exc.strerror)
                return self
            except OSError:
                pass  # absent: created below
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o600)
                self._check_regular(os.fstat(self.fd).st_mode)
                fcntl.flock(self.fd, fcntl.LOCK_EX)
            except OSError as exc:  # a lock we cannot take only costs a redundant build
                log.debug("flexgen cache lock %s unavailable: %s", self.path, exc)
                self._close()
                return self
            if self._holds_the_path():
                return self
            self._close()  # its holder removed it while we waited: lock the file now at the path
        return self

    def _holds_the_path(self):
        try:
            at_path = os.lstat(self.path)
        except OSError:
            return False
        held = os.fstat(self.fd)
        return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)

    @staticmethod
    def _check_regular(mode):
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"is {file_kind(mode)}, not a regular file")

    def __exit__(self, *exc):
        if self.fd is not None and self._holds_the_path():
            with contextlib.suppress(OSError):
                os.unlink(self.path)
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


# ---------------------------------------------------------------- what flexgen wrote


@dataclasses.dataclass
class _Item:
    """One name in the root, as `info()` and `clear()` see it."""

    name: str
    kind: str  # entry, record, lock, temp, trash, marker, or foreign (not provably flexgen's)
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


# ---------------------------------------------------------------- info and clear


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
    `total_bytes` (int, all of flexgen's files there: entries, records, lock
    files, temporaries); `entries`, a list of dicts with `key` (str), `neuron`
    (str or None), `size` (bytes) and `mtime` (when it was last written or
    loaded, seconds since the epoch), sorted by key; `records`, the names of
    the records beside them (Triton's version key), sorted; `working_files`,
    the names of build locks, temporaries and tombstones; and `not_flexgen`,
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
        "working_files": [i.name for i in items if i.kind in WORKING_KINDS],
        "not_flexgen": [{"name": i.name, "reason": i.reason} for i in items if i.kind == "foreign"],
    }


def clear(root=None, force=False, older_than_days=None):
    """Delete flexgen's entries, records, build locks and leftovers of crashed writers, and nothing else.

    Only what flexgen can prove it wrote is removed (see the module's
    docstring); the rest is returned under `not_flexgen`. A directory that is
    not marked as flexgen's cache raises NotFlexgenCache and is left as it is,
    unless `force=True`: then its entries and records are removed, still only
    those flexgen can prove it wrote. With `older_than_days`, only entries not
    written or loaded for that many days are removed (and records, temporaries
    and lock files of removed entries as old); fresh temporaries are kept
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
    if item.kind == "record":
        return item.used <= cutoff
    if item.kind == "lock":  # builds leave their empty lock files; removing a held one costs at most a rebuild
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
