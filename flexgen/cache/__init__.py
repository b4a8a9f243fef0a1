"""Stage 5, cache: generated modules on disk, keyed by what they were generated from.

Takes a key and a build function from the compile stage; hands back the loaded module and its metadata.

An entry is a directory `<root>/<key>/` (the key is 64 hex digits) holding
`kernels.py` (the generated module; Triton reads its source) and `meta.json`
(layout, equations, kernel sources, the sha256 of `kernels.py` and of the
metadata itself). Beside the entries, records (`<kind>-<fingerprint>.json`)
keep values that are slow to compute and depend only on files their
fingerprint describes (Triton's version key, see `flexgen.launch.compat`), and
compiled C libraries (`c-<sha256 of the file>.so`, found through a record of
their build; see `libraries`).

Protocol, safe with many processes sharing one root:

* writing: the entry is built in a private `.tmp-*` directory and renamed into
  place whole, so a reader sees a whole entry or none. Names starting with a
  dot (temporaries, `.trash-*` tombstones, `.lock-*` files) are never entries.
* building: a miss takes an advisory lock `.lock-<key>` (where `fcntl` exists)
  and looks again before building, so concurrent cold starts derive once; the
  builder removes the lock file when done and sweeps stale temporaries and
  tombstones that crashed processes left.
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

One module per concern: `keys` (names and seals), `files` (safe reading and
the trust check), `inventory` (the marker and what flexgen wrote), `roots`
(which root a process uses), `entries` (reading, writing, importing an
entry), `locking` (the build lock), `records`, `maintenance` (`info`,
`clear`, the sweep), `lookup` (`load_or_build`, the entry point) and
`libraries` (`load_or_build_library`, the C target's compiled libraries).

>>> import flexgen.cache
>>> sorted(flexgen.cache.info())
['count', 'entries', 'libraries', 'marked', 'not_flexgen', 'records', 'root', 'total_bytes', 'working_files']
"""
from .entries import BrokenModule, import_source, read_entry, store
from .files import NotRegularFile, UntrustedEntry, fcntl, file_kind, trust_problem
from .keys import KEY_PATTERN, LIBRARY_PATTERN, MARKER_FILE, MARKER_TEXT, META_FILE, SOURCE_FILE, cache_root, library_name, make_key, record_name
from .libraries import load_or_build_library
from .lookup import entry_or_build, import_entry, load_or_build
from .maintenance import STALE_TEMP_SECONDS, NotFlexgenCache, clear, info
from .records import recalled, remember, remembered
from .roots import usable_root

__all__ = [
    "load_or_build", "entry_or_build", "import_entry", "load_or_build_library", "remembered", "recalled", "remember",
    "info", "clear", "cache_root", "usable_root", "make_key",
    "record_name", "library_name", "LIBRARY_PATTERN",
    "read_entry", "store", "import_source", "trust_problem", "file_kind", "BrokenModule", "UntrustedEntry",
    "NotRegularFile", "NotFlexgenCache", "KEY_PATTERN", "MARKER_FILE", "MARKER_TEXT", "SOURCE_FILE", "META_FILE",
    "STALE_TEMP_SECONDS", "fcntl",
]
