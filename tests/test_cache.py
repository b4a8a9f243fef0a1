"""The on-disk cache: concurrency, damage, trust, info/clear, and no re-derivation."""
import builtins
import contextlib
import json
import linecache
import logging
import os
import shutil
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
    import flexgen.derive.derivation
    mode, counter, go = sys.argv[1], sys.argv[2], sys.argv[3]
    real = flexgen.derive.derivation.derive
    def derive(*args, **kwargs):
        if mode == "forbid":
            raise AssertionError("derive ran although the cache was warm")
        with open(counter, "a") as f:
            f.write("derived\\n")
        return real(*args, **kwargs)
    flexgen.derive.derivation.derive = derive  # what the compile stage calls on a miss
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
    # no temporaries left; the processes that raced to mark the new root left one whole marker; the key is kept
    records = [f for f in generated_files(cache_dir) if f.startswith("trace-key-")]
    assert len(records) == 1
    assert generated_files(cache_dir) == sorted([cache.MARKER_FILE, f"{key}/kernels.py", f"{key}/meta.json", *records])
    assert (cache_dir / cache.MARKER_FILE).read_bytes() == cache.MARKER_TEXT
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


@pytest.mark.parametrize("damage", ["edited source", "garbage meta"])
def test_a_damaged_entry_gives_one_warning(root, damage, caplog):
    key, build = unique_key(f"once {damage}"), Builder()
    load(key, build)
    DAMAGE[damage](root / key)
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        load(key, build)
    assert build.calls == 2
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert "regenerating" in caplog.records[0].getMessage()


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

    def read_then_swap(directory, **options):
        entry = verified_read(directory, **options)
        if entry is not None:
            with open(os.path.join(directory, "kernels.py"), "w") as f:
                f.write("import builtins\nbuiltins.FLEXGEN_PWNED = True\nVALUE = 666\n")
        return entry

    monkeypatch.setattr(cache.lookup, "read_entry", read_then_swap)
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
    assert (root / cache.MARKER_FILE).read_bytes() == cache.MARKER_TEXT  # flexgen created it: marked as its own
    assert stat.S_IMODE(os.stat(root / cache.MARKER_FILE).st_mode) == 0o600
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
        monkeypatch.setattr(os, "access", lambda path, mode: False)
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

    for where in (cache.files, cache.entries, cache.roots):  # each module that checks trust
        monkeypatch.setattr(where, "trust_problem", foreign_entries)
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
    assert summary["root"] == str(root) and summary["marked"]
    assert summary["count"] == 3
    assert sorted(e["key"] for e in summary["entries"]) == sorted(keys)
    sizes = {k: sum(f.stat().st_size for f in (root / k).iterdir()) for k in keys}
    for e in summary["entries"]:
        assert e["neuron"] == "demo" and e["size"] == sizes[e["key"]] and e["mtime"] <= time.time()
    flexgens = sum(sizes.values()) + (root / ".tmp-leftover" / "kernels.py").stat().st_size
    assert summary["total_bytes"] == flexgens + (root / cache.MARKER_FILE).stat().st_size
    assert summary["not_flexgen"] == [{"name": "f" * 64 + ".txt", "reason": "not a name flexgen writes"}]
    assert ".tmp-leftover" in summary["working_files"]
    json.dumps(summary)  # plain data, ready for a CLI

    assert not any(p.name.startswith(".lock-") for p in root.iterdir())  # a build removes its lock when done
    result = cache.clear()
    assert (result["removed"], result["kept"], result["not_flexgen"]) == (3, 0, summary["not_flexgen"])
    assert cache.info()["count"] == 0
    assert not any(p.name.startswith((".trash-", ".lock-")) for p in root.iterdir())
    assert (root / ".tmp-leftover").exists()  # a fresh temporary may be a build in progress
    assert (root / ("f" * 64 + ".txt")).read_text() == "not an entry"
    build = Builder(6)
    module, _ = load(keys[0], build)
    assert module.VALUE == 6 and build.calls == 1


def test_info_of_missing_root(tmp_path):
    assert cache.info(str(tmp_path / "nothing")) == {
        "root": str(tmp_path / "nothing"), "marked": False, "count": 0, "total_bytes": 0, "entries": [],
        "records": [], "libraries": [], "working_files": [], "not_flexgen": [],
    }
    assert cache.clear(str(tmp_path / "nothing"))["removed"] == 0
    assert not (tmp_path / "nothing").exists()


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
    assert seen, "the reader never found a whole entry: the check below would hold vacuously"
    assert all(s == b"VALUE = 1\n" for s in seen)
    assert cache.read_entry(directory)[0] == b"VALUE = 1\n"


def age(path, days):
    """Set the modification time of `path` and everything in it to `days` ago."""
    when = time.time() - days * 86400
    for directory, _, files in os.walk(path):
        for name in files:
            os.utime(os.path.join(directory, name), (when, when))
    os.utime(path, (when, when))


def test_clear_older_than_removes_only_entries_not_used_for_that_long(root):
    stale, used, fresh = (unique_key(f"age{k}") for k in range(3))
    for key in (stale, used, fresh):
        load(key, Builder())
    cache.remembered("old", FINGERPRINT, Counter())
    cache.remembered("new", FINGERPRINT, Counter())
    for key in (stale, used):  # lock files as builds before flexgen removed its locks left them
        (root / f".lock-{key}").write_bytes(b"")
    for path in (root / stale, root / used, root / f".lock-{stale}", root / f".lock-{used}",
                 root / cache.record_name("old", FINGERPRINT)):
        age(path, 40)
    load(used, Builder())  # loading an old entry counts as using it
    result = cache.clear(older_than_days=30)
    assert (result["removed"], result["kept"]) == (1, 2)
    left = {p.name for p in root.iterdir()}
    assert stale not in left and f".lock-{stale}" not in left
    assert {used, fresh, f".lock-{used}", cache.record_name("new", FINGERPRINT)} <= left
    assert cache.record_name("old", FINGERPRINT) not in left
    assert cache.clear(older_than_days=0.5)["removed"] == 0
    assert cache.clear(older_than_days=0)["removed"] == 2


@pytest.mark.parametrize("days", [-1, float("nan"), "7", True])
def test_clear_older_than_refuses_a_bad_number_of_days(root, days):
    load(unique_key("days"), Builder())
    with pytest.raises(ValueError, match="older_than_days"):
        cache.clear(older_than_days=days)
    assert cache.info()["count"] == 1


def test_private_temporary_root_is_removed_when_the_process_exits(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    script = textwrap.dedent("""
        import os, sys
        from flexgen import cache
        module, _ = cache.load_or_build("cd" * 32, lambda: ("VALUE = 1", {"neuron": "demo"}))
        root = os.path.dirname(os.path.dirname(module.__file__))
        print(root, flush=True)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a forked child exiting normally runs the atexit hooks: it must leave the parent's root
        os.waitpid(pid, 0)
        assert os.path.isfile(os.path.join(root, "cd" * 32, "kernels.py")), "removed by the forked child"
    """)
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(blocker / "cache"), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot be created" in proc.stderr  # it did fall back to a private root
    root = proc.stdout.split()[0]
    assert os.path.basename(root).startswith("flexgen-cache-")
    assert not os.path.exists(root)


# ---------------------------------------------------------------- only what flexgen wrote

OUTSIDE_FILES = {"precious.txt": "the user's data"}


def plant_foreign_items(root, tmp_path):
    """Things flexgen never wrote, named as flexgen names its files; returns {name: expected reason fragment}."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("the user's data")
    (outside / "meta.json").write_text("{}")
    real = unique_key("real")
    load(real, Builder())
    planted = {}

    def plant(name, reason, make):
        make(root / name)
        planted[name] = reason

    plant("e" * 64, "holds 'precious.txt'", lambda p: (p.mkdir(), (p / "precious.txt").write_text("data")))
    plant("d" * 64, "not a flexgen meta.json", lambda p: (
        p.mkdir(), (p / "meta.json").write_text(json.dumps({"key": "d" * 64, "meta_sha256": "0" * 64}))))
    plant(real[::-1], "not a flexgen meta.json", lambda p: shutil.copytree(root / real, p))  # filed under another key
    plant(unique_key("extra"), "holds 'notes.txt'", lambda p: (
        shutil.copytree(root / real, p, copy_function=shutil.copy),
        (p / "meta.json").write_text(json.dumps(cache.keys._sealed_meta(p.name, b"VALUE = 1\n", {}))),
        (p / "notes.txt").write_text("mine")))
    plant("c" * 64, "a symbolic link", lambda p: p.symlink_to(outside, target_is_directory=True))
    plant(".lock-" + "b" * 64, "not an empty lock file", lambda p: p.write_text("a user's file"))
    plant(cache.record_name("demo", "a" * 64), "a symbolic link", lambda p: p.symlink_to(outside / "meta.json"))
    plant(cache.record_name("other", "a" * 64), "content does not match", lambda p: p.write_text('{"value": "x"}'))
    plant(".tmp-abcdefgh", "holds 'precious.txt'", lambda p: (p.mkdir(), (p / "precious.txt").write_text("data")))
    plant(".trash-abcdefgh", "not an entry flexgen removed", lambda p: (p.mkdir(), (p / "notes").write_text("x")))
    plant("notes.txt", "not a name flexgen writes", lambda p: p.write_text("mine"))
    plant("notes.lnk", "a symbolic link, not a name", lambda p: p.symlink_to(outside / "precious.txt"))
    if hasattr(os, "mkfifo"):
        plant("pipe", "a FIFO, not a name flexgen writes", os.mkfifo)
    for name in planted:
        if (root / name).is_dir() and not (root / name).is_symlink():
            age(root / name, 2)  # old enough for a stale-temporary rule to apply
    return real, planted, outside


def snapshot(path):
    """Every file under `path` (not following links) with its content or link target."""
    found = {}
    for directory, subdirs, files in os.walk(path):
        for name in subdirs + files:
            full = os.path.join(directory, name)
            rel = os.path.relpath(full, path)
            if os.path.islink(full):
                found[rel] = "-> " + os.readlink(full)
            elif os.path.isfile(full):
                found[rel] = open(full, "rb").read()
    return found


def test_info_and_clear_touch_only_what_flexgen_wrote(root, tmp_path):
    real, planted, outside = plant_foreign_items(root, tmp_path)
    before = {k: v for k, v in snapshot(root).items() if k.split(os.sep)[0] in planted}
    outside_before = snapshot(outside)
    summary = cache.info()
    assert [e["key"] for e in summary["entries"]] == [real]
    reasons = {item["name"]: item["reason"] for item in summary["not_flexgen"]}
    assert sorted(reasons) == sorted(planted)
    for name, fragment in planted.items():
        assert fragment in reasons[name], (name, reasons[name])

    result = cache.clear()
    assert result["removed"] == 1 and result["not_flexgen"] == summary["not_flexgen"]
    assert not (root / real).exists()
    assert {k: v for k, v in snapshot(root).items() if k.split(os.sep)[0] in planted} == before
    assert snapshot(outside) == outside_before  # links were not followed


def test_entry_owned_by_another_user_is_not_flexgens(root, monkeypatch):
    key = unique_key("theirs")
    load(key, Builder())
    entry_inode = os.stat(root / key).st_ino
    real_owned = cache.inventory._owned
    monkeypatch.setattr(cache.inventory, "_owned", lambda st: st.st_ino != entry_inode and real_owned(st))
    assert cache.info()["not_flexgen"] == [{"name": key, "reason": f"owned by another user (uid {os.getuid()})"}]
    assert cache.clear()["removed"] == 0 and (root / key / "meta.json").exists()


def flexgen_files_without_marker(root):
    """A cache as a flexgen from before the marker left it: entries, a record, locks, a stale temporary, a tombstone."""
    root.mkdir(mode=0o700)
    keys = [unique_key(f"old{k}") for k in range(2)]
    for key in keys:
        cache.store(str(root), key, "VALUE = 1\n", {"neuron": "demo"})
        (root / f".lock-{key}").write_bytes(b"")
    cache.records._write_record(str(root), cache.record_name("demo", FINGERPRINT), {"fingerprint": FINGERPRINT, "value": "v"})
    shutil.copytree(root / keys[0], root / ".tmp-k2j4h5g6")
    (root / ".trash-a1b2c3d4").mkdir()
    shutil.copytree(root / keys[1], root / ".trash-a1b2c3d4" / keys[1])
    for name in (".tmp-k2j4h5g6", ".trash-a1b2c3d4"):
        age(root / name, 1)
    return keys


def test_a_cache_from_before_the_marker_is_adopted(tmp_path):
    root = tmp_path / "old-cache"
    keys = flexgen_files_without_marker(root)
    summary = cache.info(str(root))
    assert summary["marked"] and summary["not_flexgen"] == [] and summary["count"] == 2
    assert (root / cache.MARKER_FILE).read_bytes() == cache.MARKER_TEXT
    assert cache.clear(str(root))["removed"] == 2
    assert sorted(p.name for p in root.iterdir()) == [cache.MARKER_FILE]
    assert not any(k in os.listdir(root) for k in keys)


def test_an_empty_directory_is_adopted_at_first_use(root):
    root.mkdir(mode=0o700)
    cache.usable_root()
    assert (root / cache.MARKER_FILE).read_bytes() == cache.MARKER_TEXT


MARKER_FAKES = {
    "another tool's tag": lambda p: p.write_bytes(b"Signature: 8a477f597d28d172789f06886806bc55\n# some other cache\n"),
    "a link to a real marker": lambda p: ((p.parent.parent / "elsewhere").write_bytes(cache.MARKER_TEXT),
                                          p.symlink_to(p.parent.parent / "elsewhere")),
    "a user's file": lambda p: p.write_text("notes"),
}


MARKER_REASONS = {"another tool's tag": "tag flexgen did not write", "a link to a real marker": "a symbolic link",
                  "a user's file": "tag flexgen did not write"}


@pytest.mark.parametrize("fake", sorted(MARKER_FAKES))
def test_only_flexgens_own_marker_marks_a_directory(tmp_path, fake, caplog):
    root = tmp_path / "cache"
    keys = flexgen_files_without_marker(root)
    MARKER_FAKES[fake](root / cache.MARKER_FILE)
    summary = cache.info(str(root))
    assert not summary["marked"] and summary["count"] == 2
    reasons = {item["name"]: item["reason"] for item in summary["not_flexgen"]}
    assert MARKER_REASONS[fake] in reasons[cache.MARKER_FILE]
    assert f".lock-{keys[0]}" in reasons  # working-file names count as flexgen's only in a marked directory
    with pytest.raises(cache.NotFlexgenCache):
        cache.clear(str(root))
    assert all((root / k).exists() for k in keys)


def test_clear_refuses_a_directory_that_is_not_flexgens_cache_unless_forced(tmp_path, monkeypatch, caplog):
    root = tmp_path / "shared"
    keys = flexgen_files_without_marker(root)
    (root / "notes.txt").write_text("the user's")
    (root / "layer").mkdir()
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(root))
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        module, _ = load(keys[0], Builder())  # still usable as a cache ...
    assert module.VALUE == 1 and module.__file__.startswith(str(root))
    assert "does not mark it as its cache" in caplog.text and "'layer'" in caplog.text  # ... with a warning
    assert not (root / cache.MARKER_FILE).exists()
    summary = cache.info()
    assert not summary["marked"] and summary["count"] == 2 and summary["records"]
    assert {"layer", "notes.txt", f".lock-{keys[0]}", ".tmp-k2j4h5g6"} <= {i["name"] for i in summary["not_flexgen"]}
    before = snapshot(root)
    with pytest.raises(cache.NotFlexgenCache, match="not marked as flexgen's cache.*'layer'.*--force"):
        cache.clear()
    assert snapshot(root) == before

    result = cache.clear(force=True)
    assert result["removed"] == 2 and not result["marked"]
    left = sorted(p.name for p in root.iterdir())
    # entries and the record (proven by their content) are gone; names alone prove nothing here
    assert left == sorted([".lock-" + keys[0], ".lock-" + keys[1], ".tmp-k2j4h5g6", ".trash-a1b2c3d4", "layer",
                           "notes.txt"])


# ---------------------------------------------------------------- FIFOs and other special files

def within_time_limit(operation, fifos, seconds=30):
    """operation()'s result; fails (instead of hanging) if it blocks, releasing a reader stuck on one of `fifos`."""
    box = {}

    def run():
        try:
            box["value"] = operation()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:  # a writer's open and close lets a blocked reader through (it reads end of file)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"{operation} blocked on a FIFO in the cache")
    if "error" in box:
        raise box["error"]
    return box["value"]


FIFO_PLACES = {  # where the FIFO goes, relative to the root, given the entry's key
    "meta.json": lambda key: f"{key}/meta.json",
    "kernels.py": lambda key: f"{key}/kernels.py",
    "entry": lambda key: key,
    "lock": lambda key: f".lock-{key}",
    "record": lambda key: cache.record_name("demo", FINGERPRINT),
    "temporary": lambda key: ".tmp-f1f0f1f0/meta.json",
    "marker": lambda key: cache.MARKER_FILE,
}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.parametrize("place", sorted(FIFO_PLACES))
def test_a_fifo_in_the_cache_is_reported_never_waited_on(root, place, caplog):
    key = unique_key("fifo" + place)
    load(key, Builder())
    cache.remembered("demo", FINGERPRINT, Counter())
    (root / ".tmp-f1f0f1f0").mkdir()
    fifo = root / FIFO_PLACES[place](key)
    if fifo.is_dir():
        shutil.rmtree(fifo)
    elif fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    top = FIFO_PLACES[place](key).split("/")[0]
    fifos = [fifo]

    summary = within_time_limit(cache.info, fifos)
    assert "a FIFO" in {i["name"]: i["reason"] for i in summary["not_flexgen"]}[top]
    if place == "marker":  # not marked any more: clearing needs force
        with pytest.raises(cache.NotFlexgenCache):
            within_time_limit(cache.clear, fifos)
    within_time_limit(lambda: cache.clear(force=True), fifos)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # left alone

    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        assert within_time_limit(lambda: cache.remembered("demo", FINGERPRINT, Counter("v")), fifos) == "v"
        build = Builder(2)
        module, _ = within_time_limit(lambda: load(key, build), fifos)
    assert module.VALUE == 2 and build.calls == 1
    if place in ("meta.json", "kernels.py", "lock", "record"):
        assert "a FIFO, not a regular file" in caplog.text
    assert cache.read_entry(str(root / key)) is not None  # the entry at its own key is rebuilt whole


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
    monkeypatch.setattr(getattr(cache.records, module), function, denied)
    first, second = Counter("v"), Counter("v")
    assert cache.remembered("demo", FINGERPRINT, first) == "v"
    assert cache.remembered("demo", FINGERPRINT, second) == "v"
    assert (first.calls, second.calls) == (1, 1)
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


def test_clear_removes_records(root):
    cache.remembered("demo", FINGERPRINT, Counter())
    (root / ".tmp-x7k2_q9a").write_text("{}")  # a record's temporary, left by a crashed writer
    old = time.time() - 2 * cache.STALE_TEMP_SECONDS
    os.utime(root / ".tmp-x7k2_q9a", (old, old))
    assert cache.clear()["removed"] == 0
    assert sorted(p.name for p in root.iterdir()) == [cache.MARKER_FILE]


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
    """With the real Triton: a neuron's generated module, imported at its first Triton call, installs the kept
    key, which equals Triton's own value."""
    layer = flexgen.LIF(step_mode="m", backend="triton")
    layer(torch.rand(2, 3, device=TRITON_DEVICE))
    import triton.runtime.cache as triton_cache

    kept = triton_cache.triton_key
    assert getattr(kept, "flexgen_kept", False)
    assert kept() == kept.computed_by()


@pytest.mark.skipif(cache.fcntl is None, reason="build locks need fcntl")
def test_a_waiting_builder_takes_the_lock_again_when_the_holder_removes_the_file(tmp_path):
    root, key = str(tmp_path), "c" * 64
    holder = cache.locking._BuildLock(root, key).__enter__()
    assert holder.fd is not None
    got = {}

    def wait_for_it():
        with cache.locking._BuildLock(root, key) as waiter:
            got["fd"], got["holds"] = waiter.fd, waiter._holds_the_path()

    thread = threading.Thread(target=wait_for_it)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # blocked on the holder's lock
    holder.__exit__(None, None, None)
    thread.join(10)
    assert not thread.is_alive() and got["fd"] is not None and got["holds"]
    assert not os.path.exists(holder.path)  # the waiter removed the file it locked afterwards, too


def test_a_build_sweeps_stale_temporaries_and_tombstones_but_keeps_fresh_ones(root):
    cache.load_or_build(cache.make_key("sweep-warmup"), lambda: ("VALUE = 1", {"neuron": "demo"}))
    stale, fresh, trash = root / ".tmp-stale", root / ".tmp-fresh", root / ".trash-old"
    for directory in (stale, fresh, trash):
        directory.mkdir()
    (stale / "kernels.py").write_text("half written")
    (fresh / "kernels.py").write_text("being written")
    old = time.time() - cache.STALE_TEMP_SECONDS - 60
    os.utime(stale / "kernels.py", (old, old))
    os.utime(stale, (old, old))
    cache.load_or_build(cache.make_key("sweep-build"), lambda: ("VALUE = 2", {"neuron": "demo"}))
    names = {p.name for p in root.iterdir()}
    assert ".tmp-stale" not in names and ".trash-old" not in names and ".tmp-fresh" in names
    assert not any(name.startswith(".lock-") for name in names)
