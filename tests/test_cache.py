"""The on-disk cache: concurrency, damage, trust, info/clear, and no re-derivation."""
import builtins
import json
import linecache
import logging
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest
import torch

import flexgen
from conftest import HAS_CUDA, TRITON_DEVICE
from flexgen import cache
from flexgen.launch import compat

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

# A child process: optionally counts (or forbids) derivations, waits for a start signal, compiles `specs.lif`.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    import flexgen.compile
    mode, counter, go = sys.argv[1], sys.argv[2], sys.argv[3]
    real = flexgen.compile.derive
    def derive(*args, **kwargs):
        if mode == "forbid":
            raise AssertionError("derive ran although the cache was warm")
        with open(counter, "a") as f:
            f.write("derived\\n")
        return real(*args, **kwargs)
    flexgen.compile.derive = derive  # the compile stage's reference to derive
    import specs
    open(go + f".ready-{os.getpid()}", "w").close()
    deadline = time.time() + 300
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.02)
    compiled = specs.lif.compiled()
    if mode == "triton":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.linspace(-1, 3, 12, dtype=torch.float64, device=device).reshape(4, 3)
        got = specs.lif.apply(x, backend="triton")[0][0]
        ref = specs.lif.apply(x, backend="eager")[0][0]
        assert torch.equal(got, ref), (got, ref)
    print("KEY", compiled.key)
    """
)


def start_child(cache_dir, mode, counter, go):
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(cache_dir), PYTHONPATH=os.pathsep.join([ROOT, TESTS]))
    if not HAS_CUDA:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(counter), str(go)], env=env, cwd=TESTS,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return [line.split()[1] for line in out.splitlines() if line.startswith("KEY ")][0]


def run_children(cache_dir, mode, n, tmp_path):
    """Start n children, let them all reach the compile together, return their keys."""
    counter, go = tmp_path / f"derived-{mode}", tmp_path / f"go-{mode}"
    procs = [start_child(cache_dir, mode, counter, go) for _ in range(n)]
    deadline = time.time() + 300
    while len(list(tmp_path.glob(f"go-{mode}.ready-*"))) < n and time.time() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    go.write_text("go")
    keys = [finish(p) for p in procs]
    derived = counter.read_text().count("derived") if counter.exists() else 0
    return keys, derived


def generated_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs if not f.startswith(".lock-"))


def test_concurrent_cold_start_then_warm_processes_do_not_rederive(tmp_path):
    cache_dir = tmp_path / "cache"
    keys, derived = run_children(cache_dir, "count", 8, tmp_path)
    assert len(set(keys)) == 1
    key = keys[0]
    assert derived == 1, "the build lock should let exactly one process derive"
    assert generated_files(cache_dir) == [f"{key}/kernels.py", f"{key}/meta.json"]  # no temporaries left
    assert stat.S_IMODE(os.stat(cache_dir).st_mode) == 0o700
    assert cache.read_entry(str(cache_dir / key)) is not None

    keys, _ = run_children(cache_dir, "forbid", 1, tmp_path)  # derive raises in this process
    assert keys == [key]

    with open(cache_dir / key / "kernels.py", "a") as f:  # damage it: the next process regenerates and runs Triton
        f.write("\nraise SystemExit('tampered')\n")
    keys, derived = run_children(cache_dir, "triton", 1, tmp_path)
    assert keys == [key] and derived == 1
    assert cache.read_entry(str(cache_dir / key)) is not None


# ---------------------------------------------------------------- load_or_build directly

KEY = "0123456789abcdef" * 4


@pytest.fixture
def root(tmp_path, monkeypatch):
    path = tmp_path / "root"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(path))
    return path


def unique_key(tag):
    return cache.make_key("test_cache", tag, str(time.time_ns()))


class Builder:
    """build() for load_or_build that counts its calls."""

    def __init__(self, value=1):
        self.calls, self.value = 0, value

    def __call__(self):
        self.calls += 1
        return f"VALUE = {self.value}\n", {"neuron": "demo", "layout": {"neuron": "demo"}}


def forget(key):
    sys.modules.pop(f"flexgen_generated_{key[:16]}", None)


def load(key, build):
    forget(key)
    return cache.load_or_build(key, build)


DAMAGE = {
    "truncated source": lambda d: (d / "kernels.py").write_bytes((d / "kernels.py").read_bytes()[:3]),
    "edited source": lambda d: (d / "kernels.py").write_text("import builtins\nbuiltins.FLEXGEN_PWNED = True\nVALUE = 666\n"),
    "edited meta": lambda d: (d / "meta.json").write_text((d / "meta.json").read_text().replace('"demo"', '"evil"')),
    "garbage meta": lambda d: (d / "meta.json").write_bytes(b"\x00{not json"),
    "missing meta": lambda d: (d / "meta.json").unlink(),
    "missing source": lambda d: (d / "kernels.py").unlink(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_regenerated_never_imported(root, damage, caplog):
    key, build = unique_key(damage), Builder()
    module, _ = load(key, build)
    assert module.VALUE == 1 and build.calls == 1
    DAMAGE[damage](root / key)
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        module, meta = load(key, build)
    assert module.VALUE == 1 and meta["neuron"] == "demo"
    assert build.calls == 2
    assert not hasattr(builtins, "FLEXGEN_PWNED")
    if "missing" not in damage:
        assert any("regenerating" in r.getMessage() for r in caplog.records)
    assert cache.read_entry(str(root / key)) is not None  # repaired on disk
    module, _ = load(key, build)
    assert build.calls == 2  # and used again


def test_entry_filed_under_another_key_is_rejected(root):
    first, second = unique_key("a"), unique_key("b")
    load(first, Builder(1))
    os.rename(root / first, root / second)
    build = Builder(2)
    module, _ = load(second, build)
    assert build.calls == 1 and module.VALUE == 2


def test_module_comes_from_the_verified_bytes_not_a_second_read(root, monkeypatch):
    """Swap the file between the check and the import: the checked text is what runs."""
    key = unique_key("toctou")
    load(key, Builder(7))
    verified_read = cache.read_entry

    def read_then_swap(directory):
        entry = verified_read(directory)
        if entry is not None:
            with open(os.path.join(directory, "kernels.py"), "w") as f:
                f.write("import builtins\nbuiltins.FLEXGEN_PWNED = True\nVALUE = 666\n")
        return entry

    monkeypatch.setattr(cache, "read_entry", read_then_swap)
    module, _ = load(key, Builder(8))
    assert module.VALUE == 7
    assert not hasattr(builtins, "FLEXGEN_PWNED")
    assert "".join(linecache.getlines(module.__file__)) == "VALUE = 7\n"


def test_triton_runs_from_the_verified_source_even_after_the_file_changes(root):
    """Triton reads the kernel source through inspect/linecache: it must see the verified text."""

    @flexgen.neuron(states=("v",))
    def verified_lif(x, v, tau=2.0):
        h = v + (x - v) / tau
        s = flexgen.spike(h - 0.625)
        return s, h * (1.0 - s)

    x = torch.linspace(-1.0, 3.0, 12, dtype=torch.float64, device=TRITON_DEVICE).reshape(4, 3).requires_grad_()
    out = verified_lif.apply(x, backend="triton")[0][0]
    path = verified_lif.compiled().module.__file__
    assert path.startswith(str(root))
    with open(path, "w") as f:
        f.write("this is not python\n")
    out32 = verified_lif.apply(x.detach().float(), backend="triton")[0][0]  # new specialisation, compiled now
    ref = verified_lif.apply(x, backend="eager")[0][0]
    assert torch.equal(out, ref) and torch.equal(out32, ref.float())
    assert verified_lif.source("module") == "".join(linecache.getlines(path))
    assert "this is not python" not in verified_lif.source("module")


# ---------------------------------------------------------------- trust


def test_root_is_created_private(root):
    load(unique_key("private"), Builder())
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    entry = next(p for p in root.iterdir() if cache.KEY_PATTERN.match(p.name))
    assert stat.S_IMODE(os.stat(entry).st_mode) & 0o077 == 0
    assert stat.S_IMODE(os.stat(entry / "kernels.py").st_mode) & 0o077 == 0


@pytest.mark.parametrize("target", ["directory", "kernels.py", "meta.json"])
def test_group_writable_entry_is_not_imported(root, target, caplog):
    key = unique_key("writable" + target)
    load(key, Builder(1))
    (root / key / "kernels.py").chmod(0o600)
    (root / key / "kernels.py").write_text("import builtins\nbuiltins.FLEXGEN_PWNED = True\nVALUE = 666\n")
    path = root / key if target == "directory" else root / key / target
    path.chmod(0o777 if target == "directory" else 0o666)
    build = Builder(2)
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        module, _ = load(key, build)
    assert module.VALUE == 2 and build.calls == 1
    assert not module.__file__.startswith(str(root))
    assert not hasattr(builtins, "FLEXGEN_PWNED")
    assert any("writable by group or others" in r.getMessage() for r in caplog.records)


def test_world_writable_root_is_not_used(root, caplog):
    root.mkdir(mode=0o700)
    root.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        module, _ = load(unique_key("world"), Builder(3))
    assert module.VALUE == 3 and not module.__file__.startswith(str(root))
    assert list(root.iterdir()) == []
    assert any("writable by group or others" in r.getMessage() for r in caplog.records)


def test_read_only_root_falls_back_to_a_private_dir(root, monkeypatch, caplog):
    root.mkdir(mode=0o700)
    root.chmod(0o500)
    if os.access(root, os.W_OK):  # running as root: permissions do not bind, so simulate what they would say
        monkeypatch.setattr(cache.os, "access", lambda path, mode: False)
    try:
        with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
            module, _ = load(unique_key("readonly"), Builder(4))
    finally:
        root.chmod(0o700)
    assert module.VALUE == 4 and not module.__file__.startswith(str(root))
    fallback = os.path.dirname(os.path.dirname(module.__file__))
    assert stat.S_IMODE(os.stat(fallback).st_mode) == 0o700
    assert any("read-only" in r.getMessage() for r in caplog.records)


def test_uncreatable_root_falls_back_to_a_private_dir(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        module, _ = load(unique_key("uncreatable"), Builder(5))
    assert module.VALUE == 5
    assert any("cannot be created" in r.getMessage() for r in caplog.records)


def fake_stat(uid, mode):
    return types.SimpleNamespace(st_uid=uid, st_mode=mode)


def test_trust_decision():
    me = os.getuid()
    assert cache.trust_problem(fake_stat(me, stat.S_IFDIR | 0o700)) is None
    assert cache.trust_problem(fake_stat(me, stat.S_IFREG | 0o644)) is None
    assert "another user" in cache.trust_problem(fake_stat(me + 1, stat.S_IFDIR | 0o700))
    assert "another user" in cache.trust_problem(fake_stat(0, stat.S_IFREG | 0o600), uid=1000)
    assert "group or others" in cache.trust_problem(fake_stat(me, stat.S_IFDIR | 0o770))
    assert "group or others" in cache.trust_problem(fake_stat(me, stat.S_IFREG | 0o602))


def test_entry_owned_by_another_user_is_not_imported(root, monkeypatch, caplog):
    key = unique_key("owner")
    load(key, Builder(1))
    real = cache.trust_problem

    def foreign_entries(st, uid=None):  # the root stays ours; everything inside "belongs to uid 4242"
        if stat.S_ISDIR(st.st_mode) and st.st_ino == os.stat(root).st_ino:
            return real(st, uid)
        return real(fake_stat(4242, st.st_mode), os.getuid())

    monkeypatch.setattr(cache, "trust_problem", foreign_entries)
    build = Builder(9)
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        module, _ = load(key, build)
    assert module.VALUE == 9 and build.calls == 1
    assert any("owned by another user" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- info / clear


def test_info_and_clear(root):
    keys = [unique_key(f"info{k}") for k in range(3)]
    for k in keys:
        load(k, Builder())
    (root / ".tmp-leftover").mkdir()
    (root / ".tmp-leftover" / "kernels.py").write_text("VALUE = 0\n")
    (root / ("f" * 64 + ".txt")).write_text("not an entry")
    summary = cache.info()
    assert summary["root"] == str(root)
    assert summary["count"] == 3
    assert sorted(e["key"] for e in summary["entries"]) == sorted(keys)
    sizes = {k: sum(f.stat().st_size for f in (root / k).iterdir()) for k in keys}
    for e in summary["entries"]:
        assert e["neuron"] == "demo" and e["size"] == sizes[e["key"]] and e["mtime"] <= time.time()
    assert summary["total_bytes"] == sum(sizes.values())
    json.dumps(summary)  # plain data, ready for a CLI

    if cache.fcntl is not None:
        assert any(p.name.startswith(".lock-") for p in root.iterdir())  # builds leave their locks
    assert cache.clear() == 3
    assert cache.info()["count"] == 0
    assert not any(p.name.startswith((".trash-", ".lock-")) for p in root.iterdir())
    assert (root / ".tmp-leftover").exists()  # a fresh temporary may be a build in progress
    build = Builder(6)
    module, _ = load(keys[0], build)
    assert module.VALUE == 6 and build.calls == 1


def test_info_of_missing_root(tmp_path):
    assert cache.info(str(tmp_path / "nothing")) == {
        "root": str(tmp_path / "nothing"), "count": 0, "total_bytes": 0, "entries": [], "records": []
    }


def test_readers_see_whole_entries_while_another_thread_clears(root):
    key = unique_key("race")
    load(key, Builder())
    directory = str(root / key)
    stop, seen, errors = threading.Event(), [], []

    def reader():
        try:
            while not stop.is_set():
                entry = cache.read_entry(directory)
                if entry is not None:
                    seen.append(entry[0])
        except Exception as exc:  # any exception is a failure
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(40):
            cache.clear()
            cache.store(str(root), key, "VALUE = 1\n", {"neuron": "demo"})
            time.sleep(0.001)  # let the reader find whole entries, too
    finally:
        stop.set()
        thread.join()
    assert not errors
    assert all(s == b"VALUE = 1\n" for s in seen)
    assert cache.read_entry(directory)[0] == b"VALUE = 1\n"


def test_bad_keys_are_refused(root):
    with pytest.raises(ValueError, match="64 lowercase hex"):
        cache.load_or_build("../../etc/passwd", Builder())


# ---------------------------------------------------------------- records and Triton's version key

FINGERPRINT = "a" * 64


class Counter:
    """compute() for `remembered` that counts its calls."""

    def __init__(self, value="value"):
        self.calls, self.value = 0, value

    def __call__(self):
        self.calls += 1
        return self.value


def test_record_is_computed_once_and_reused(root):
    first, second = Counter("kept"), Counter("other")
    assert cache.remembered("demo", FINGERPRINT, first) == "kept"
    assert cache.remembered("demo", FINGERPRINT, second) == "kept"
    assert (first.calls, second.calls) == (1, 0)
    record = root / cache.record_name("demo", FINGERPRINT)
    assert stat.S_IMODE(record.stat().st_mode) & 0o077 == 0
    assert cache.info()["count"] == 0  # a record is not an entry
    assert cache.info()["records"] == [record.name]


def test_record_under_another_fingerprint_is_recomputed(root):
    cache.remembered("demo", FINGERPRINT, Counter("old"))
    fresh = Counter("new")
    assert cache.remembered("demo", "b" * 64, fresh) == "new" and fresh.calls == 1
    assert cache.remembered("demo", FINGERPRINT, Counter("unused")) == "old"


RECORD_DAMAGE = {
    "garbage": b"\x00{not json",
    "not a dict": b"[1, 2]",
    "other fingerprint inside": json.dumps({"fingerprint": "c" * 64, "value": "forged"}).encode(),
    "value not a string": json.dumps({"fingerprint": FINGERPRINT, "value": 3}).encode(),
}


@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_damaged_record_is_recomputed_and_rewritten(root, damage, caplog):
    cache.remembered("demo", FINGERPRINT, Counter("good"))
    record = root / cache.record_name("demo", FINGERPRINT)
    record.write_bytes(RECORD_DAMAGE[damage])
    fresh = Counter("good")
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        assert cache.remembered("demo", FINGERPRINT, fresh) == "good"
    assert fresh.calls == 1 and str(record) in caplog.text
    assert json.loads(record.read_text()) == {"fingerprint": FINGERPRINT, "value": "good"}


def test_group_writable_record_is_not_trusted(root, caplog):
    cache.remembered("demo", FINGERPRINT, Counter("good"))
    record = root / cache.record_name("demo", FINGERPRINT)
    record.write_text(json.dumps({"fingerprint": FINGERPRINT, "value": "planted"}))
    record.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        assert cache.remembered("demo", FINGERPRINT, Counter("good")) == "good"
    assert "writable by group or others" in caplog.text
    assert stat.S_IMODE(record.stat().st_mode) & 0o077 == 0  # replaced by a private one


def denied(*args, **kwargs):
    raise PermissionError(13, "denied")


@pytest.mark.parametrize("failing", ["os.replace", "tempfile.mkstemp"])
def test_unwritable_record_only_costs_a_recomputation(root, monkeypatch, failing):
    cache.usable_root()
    module, function = failing.split(".")
    monkeypatch.setattr(getattr(cache, module), function, denied)
    first, second = Counter("v"), Counter("v")
    assert cache.remembered("demo", FINGERPRINT, first) == "v"
    assert cache.remembered("demo", FINGERPRINT, second) == "v"
    assert (first.calls, second.calls) == (1, 1)
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


def test_clear_removes_records(root):
    cache.remembered("demo", FINGERPRINT, Counter())
    (root / ".tmp-stale-record").write_text("{}")
    old = time.time() - 2 * cache.STALE_TEMP_SECONDS
    os.utime(root / ".tmp-stale-record", (old, old))
    assert cache.clear() == 0
    assert sorted(p.name for p in root.iterdir()) == []


@pytest.fixture
def fake_triton(tmp_path, monkeypatch):
    """A stand-in Triton package: a directory of files and modules binding a counting `triton_key`."""
    package = tmp_path / "triton"
    (package / "_C").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_C" / "libtriton.so").write_bytes(b"\x7fELF" * 100)
    (package / "__pycache__").mkdir()
    compute = Counter("triton-key-of-the-fake")
    top = types.ModuleType("triton")
    top.__file__, top.__version__ = str(package / "__init__.py"), "3.99.0"
    runtime_cache, autotuner, compiler = (types.ModuleType(n) for n in compat.TRITON_KEY_HOLDERS)
    runtime_cache.triton_key = autotuner.triton_key = compute
    compiler.triton_key = Counter("an unrelated function of the same name")
    monkeypatch.setitem(sys.modules, "triton", top)
    for module in (runtime_cache, compiler, autotuner):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.delenv("FLEXGEN_TRITON_KEY", raising=False)
    return types.SimpleNamespace(package=package, compute=compute, runtime_cache=runtime_cache, autotuner=autotuner, compiler=compiler)


def test_fingerprint_follows_every_file_of_the_package(fake_triton):
    before = compat.triton_fingerprint()
    assert compat.triton_fingerprint() == before
    (fake_triton.package / "__pycache__" / "x.pyc").write_bytes(b"bytecode")
    assert compat.triton_fingerprint() == before  # bytecode is not what Triton hashes
    library = fake_triton.package / "_C" / "libtriton.so"
    st = library.stat()
    os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    touched = compat.triton_fingerprint()
    assert touched != before
    (fake_triton.package / "language.py").write_text("")
    assert compat.triton_fingerprint() not in (before, touched)
    sys.modules["triton"].__version__ = "3.99.1"
    assert len({before, touched, compat.triton_fingerprint()}) == 3


def test_triton_key_is_computed_once_across_processes(root, fake_triton):
    compat.remember_triton_key()
    kept = fake_triton.runtime_cache.triton_key
    assert kept.flexgen_kept and kept is fake_triton.autotuner.triton_key
    assert isinstance(fake_triton.compiler.triton_key, Counter)  # another function: left alone
    compat.remember_triton_key()
    assert fake_triton.runtime_cache.triton_key is kept  # installed once
    assert kept() == kept() == "triton-key-of-the-fake" and fake_triton.compute.calls == 1

    next_process = compat._kept_triton_key(fake_triton.compute)
    assert next_process() == "triton-key-of-the-fake" and fake_triton.compute.calls == 1
    (fake_triton.package / "_C" / "libtriton.so").write_bytes(b"\x7fELF" * 101)  # Triton upgraded
    after_upgrade = compat._kept_triton_key(fake_triton.compute)
    assert after_upgrade() == "triton-key-of-the-fake" and fake_triton.compute.calls == 2


def test_triton_key_left_alone_when_switched_off(root, fake_triton, monkeypatch):
    monkeypatch.setenv("FLEXGEN_TRITON_KEY", "0")
    compat.remember_triton_key()
    assert fake_triton.runtime_cache.triton_key is fake_triton.compute


def test_real_triton_gets_the_key_it_computes(root):
    """With the real Triton: a loaded neuron installs the kept key, which equals Triton's own value."""
    flexgen.LIF()
    import triton.runtime.cache as triton_cache

    kept = triton_cache.triton_key
    assert getattr(kept, "flexgen_kept", False)
    assert kept() == kept.computed_by()
