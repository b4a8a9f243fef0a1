"""The per-key build lock, so that processes missing the same entry at once derive it once."""
import contextlib
import errno
import logging
import os
import stat

from .files import NotRegularFile, _CLOEXEC, _NOFOLLOW, _NONBLOCK, fcntl, file_kind

log = logging.getLogger("flexgen.cache")


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
