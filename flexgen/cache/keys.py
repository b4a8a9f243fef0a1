"""Names in the cache root and what seals them: the root's location, keys, digests, file and record names."""
import hashlib
import json
import os
import re


KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")
SOURCE_FILE, META_FILE = "kernels.py", "meta.json"
ENTRY_FILES = frozenset((SOURCE_FILE, META_FILE))
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
RECORD_PATTERN = re.compile(r"^[a-z][a-z0-9-]*-[0-9a-f]{64}\.json$")
RECORD_MAX_BYTES = 1 << 20  # records hold one short string; a larger file of that name is not flexgen's
LIBRARY_PATTERN = re.compile(r"^c-([0-9a-f]{64})\.so$")  # a compiled library, named by the sha256 of its bytes


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


def _sealed_meta(key, source_bytes, meta):
    meta = dict(meta, key=key, sha256=_sha256(source_bytes))
    meta["meta_sha256"] = _meta_digest(meta)
    return meta


def library_name(digest):
    """The file name of a compiled library whose bytes have the sha256 `digest`: `c-<digest>.so`."""
    return f"c-{digest}.so"


def record_name(kind, fingerprint):
    """The file name of a record: `<kind>-<fingerprint>.json` (fingerprint: 64 hex digits)."""
    return f"{kind}-{fingerprint}.json"
