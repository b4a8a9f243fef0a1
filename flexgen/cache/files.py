"""Reading the root's files safely: regular files only (never a FIFO, device or link), opened through directory
handles, and the trust check (owner and permissions) every file and directory passes before it is used."""
import contextlib
import errno
import os
import stat

try:
    import fcntl
except ImportError:  # not POSIX: no build lock; the atomic rename still keeps entries whole
    fcntl = None

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ROOT_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NONBLOCK | _CLOEXEC  # the root may be a link the user set
_DIR_FLAGS = _ROOT_FLAGS | _NOFOLLOW
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC


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


class UntrustedEntry(Exception):
    """An entry that exists but must not be imported (owner or permissions)."""


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
