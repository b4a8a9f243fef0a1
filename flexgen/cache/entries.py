"""Entries: reading one whole and verified, writing one whole (a temporary directory renamed into place), moving
one out of the way, and importing a module from exactly the verified bytes."""
import errno
import importlib.machinery
import json
import linecache
import logging
import os
import shutil
import sys
import tempfile
import types

from .files import NotRegularFile, UntrustedEntry, _DIR_FLAGS, _open_checked, trust_problem
from .keys import META_FILE, SOURCE_FILE, _meta_digest, _sealed_meta, _sha256

log = logging.getLogger("flexgen.cache")


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


def read_entry(directory, warn=True):
    """(source bytes, meta) of a whole, trusted, untampered entry; None if absent or damaged.

    A damaged entry is logged as a warning, unless `warn` is False (a first look before the build lock, whose
    second look under the lock warns, so one damaged entry gives one warning).

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
        if warn:
            log.warning("flexgen cache entry %s: %s; regenerating it", directory, exc.strerror)
        return None
    except OSError:
        return None  # vanished (cleared) or half-removed: a miss
    finally:
        os.close(dir_fd)
    problem = _damage(directory, raw_meta, source)
    if problem:
        if warn:
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


def _write_file(dir_path, name, data):
    fd = os.open(os.path.join(dir_path, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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
