"""Records: values slow to compute that depend only on files a fingerprint describes, kept beside the entries."""
import contextlib
import json
import logging
import os
import tempfile

from .files import UntrustedEntry, _open_checked, trust_problem
from .keys import cache_root, record_name
from .roots import usable_root

log = logging.getLogger("flexgen.cache")


def remembered(kind, fingerprint, compute, root=None, check=None):
    """`compute()`'s value (a string), kept beside the entries while `fingerprint` describes its inputs.

    For values that cost more to compute than to look up and depend only on
    files the fingerprint covers. A record that is missing, unreadable,
    untrusted or filed under another fingerprint is recomputed and rewritten;
    so is one whose value `check(value)` (if given) finds unusable, with the
    same warning as any damaged record. A record that cannot be written only
    costs the next process the same computation.

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
    if value is not None and check is not None and not check(value):
        log.warning("flexgen cache record %s is damaged; recomputing it", os.path.join(root, name))
        value = None
    if value is None:
        value = compute()
        _write_record(root, name, {"fingerprint": fingerprint, "value": value})
    return value


def recalled(kind, fingerprint):
    """The value a record of `kind` keeps for `fingerprint` in the configured root, or None (no record, no root,
    an untrusted root or record). Creates nothing: a lookup that finds nothing leaves no trace on disk."""
    root = cache_root()
    try:
        if trust_problem(os.stat(root)):
            return None
    except OSError:
        return None
    return _read_record(root, record_name(kind, fingerprint), fingerprint)


def remember(kind, fingerprint, value):
    """Keep `value` (a string) in a record of `kind` for `fingerprint` in the usable root (see `remembered`)."""
    root = usable_root()
    _write_record(root, record_name(kind, fingerprint), {"fingerprint": fingerprint, "value": value})


def _read_record(root, name, fingerprint, warn=True):
    """A record's value; None, with a warning where `warn` says so, if it is missing, unreadable, untrusted or
    damaged."""
    try:
        dir_fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None
    try:
        record = json.loads(_open_checked(name, dir_fd, root))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UntrustedEntry) as exc:
        if warn:
            log.warning("flexgen cache record %s cannot be used (%s); recomputing it", os.path.join(root, name),
                        exc)
        return None
    finally:
        os.close(dir_fd)
    if (not isinstance(record, dict) or record.get("fingerprint") != fingerprint
            or not isinstance(record.get("value"), str)):
        if warn:
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
