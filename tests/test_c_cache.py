"""The C target's compiled libraries in flexgen's disk cache: compiled once per source, compiler and machine,
then loaded by every later process from bytes the cache verified, under the same trust rules as the entries."""
import ctypes
import json
import logging
import os
import stat
import subprocess
import sys
import uuid

import pytest

from flexgen import cache, cli
from flexgen.launch import c_path

from conftest import HAS_C_COMPILER

pytestmark = pytest.mark.skipif(not HAS_C_COMPILER, reason="needs a C compiler")


@pytest.fixture
def root(private_cache):
    c_path.load.cache_clear()
    c_path._usable_options.cache_clear()
    yield private_cache
    c_path.load.cache_clear()
    c_path._usable_options.cache_clear()
    c_path._machine.cache_clear()


def unique_source(factor):
    """(name, a C source of its own that no other test loads): `name(x)` returns `factor` times x."""
    name = f"scale_{uuid.uuid4().hex[:12]}"
    return name, f"double {name}(double x) {{ return {factor} * x; }}\n"


def call(library, name, value):
    fn = getattr(library, name)
    fn.argtypes, fn.restype = [ctypes.c_double], ctypes.c_double
    return fn(value)


def forget_loaded():
    """What a new process knows: nothing loaded, nothing probed."""
    c_path.load.cache_clear()
    c_path._usable_options.cache_clear()


def library_files(root):
    return sorted(p for p in root.iterdir() if cache.LIBRARY_PATTERN.match(p.name))


def test_a_library_is_compiled_once_then_loaded_from_a_private_copy_of_the_cached_bytes(root, monkeypatch):
    name, source = unique_source(3)
    assert call(c_path.load(source), name, 1.5) == 4.5
    [stored] = library_files(root)
    assert stat.S_IMODE(stored.stat().st_mode) & 0o022 == 0

    forget_loaded()
    monkeypatch.setattr(c_path, "_run", lambda *a: pytest.fail("compiled again"))
    library = c_path.load(source)
    assert call(library, name, 2.0) == 6.0
    assert not library._name.startswith(str(root))  # the file in the cache is never the one mapped
    with open(library._name, "rb") as copy:
        assert copy.read() == stored.read_bytes()
    summary = cache.info()
    assert summary["libraries"] == [stored.name] and summary["not_flexgen"] == []
    assert any(r.startswith("c-library-") for r in summary["records"])
    assert any(r.startswith("c-options-") for r in summary["records"])  # the probe is kept too


def test_a_second_process_loads_the_neuron_without_compiling(tmp_path):
    real = c_path.compiler()
    log = tmp_path / "compiler-calls"
    wrapper = tmp_path / "cc"
    wrapper.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\nexec {real} \"$@\"\n")
    wrapper.chmod(0o700)
    env = dict(os.environ, CC=str(wrapper), FLEXGEN_CACHE_DIR=str(tmp_path / "cache"))
    program = "import torch, flexgen\nflexgen.LIF(backend='c', step_mode='m')(torch.rand(5, 2, 3))\n"
    run = [sys.executable, "-W", "error::UserWarning", "-c", program]  # (falling back to torch code would warn)
    subprocess.run(run, env=env, check=True, timeout=300)
    first = log.read_text().splitlines()
    assert any("kernels_" in line for line in first)  # the first process compiled the library
    subprocess.run(run, env=env, check=True, timeout=300)
    assert log.read_text().splitlines() == first  # the second one compiled nothing, probe included


@pytest.mark.parametrize("damage", ["bytes", "group-writable", "fifo", "missing"])
def test_a_damaged_or_untrusted_library_is_rebuilt_never_loaded(root, damage, caplog):
    name, source = unique_source(5)
    c_path.load(source)
    [stored] = library_files(root)
    if damage == "bytes":
        data = stored.read_bytes()
        stored.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "group-writable":
        stored.chmod(0o664)
    elif damage == "fifo":
        stored.unlink()
        os.mkfifo(stored)
    else:
        stored.unlink()
    forget_loaded()
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        assert call(c_path.load(source), name, 1.0) == 5.0
    expected = {"bytes": "does not match its name's hash", "group-writable": "writable by group or others",
                "fifo": "a FIFO, not a regular file", "missing": None}[damage]
    if expected:
        assert expected in caplog.text
    [rebuilt] = library_files(root)
    assert stat.S_ISREG(rebuilt.lstat().st_mode) and stat.S_IMODE(rebuilt.stat().st_mode) & 0o022 == 0
    forget_loaded()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        assert call(c_path.load(source), name, 2.0) == 10.0
    assert caplog.text == ""  # whole again


@pytest.mark.parametrize("damage", ["library", "record"])
def test_a_damaged_library_or_its_record_gives_one_warning(root, damage, caplog):
    name, source = unique_source(9)
    c_path.load(source)
    if damage == "library":
        [stored] = library_files(root)
        data = stored.read_bytes()
        stored.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        [record] = root.glob("c-library-*.json")
        record.write_text("{not json")
    forget_loaded()
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        assert call(c_path.load(source), name, 1.0) == 9.0
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert "rebuilding" in caplog.text or "recomputing" in caplog.text


def damage_options(root, edit):
    """Change the value of the cached record of the compiler's usable options with `edit(value) -> value`."""
    [path] = root.glob("c-options-*.json")
    record = json.loads(path.read_text())
    record["value"] = edit(record["value"])
    path.write_text(json.dumps(record))
    return path


@pytest.mark.parametrize("edit", [
    lambda value: value.replace("[[", "[{", 1),  # one byte: not JSON any more
    lambda value: value.replace("-O3", "-O#", 1),  # one byte: a flag of no one's
], ids=["not json", "unknown flag"])
def test_a_damaged_options_record_is_probed_again_with_one_warning(root, edit, caplog):
    name, source = unique_source(11)
    c_path.load(source)
    path = damage_options(root, edit)
    forget_loaded()
    with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
        assert call(c_path.load(source), name, 1.0) == 11.0
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    assert f"flexgen cache record {path} is damaged; recomputing it" == caplog.records[0].getMessage()
    flags, libraries = json.loads(json.loads(path.read_text())["value"])  # rewritten whole
    assert tuple(flags[:len(c_path.FLAGS)]) == c_path.FLAGS


def test_a_cached_flag_the_compiler_rejects_names_the_record(root, tmp_path, monkeypatch):
    real = c_path.compiler()
    wrapper = tmp_path / "cc"  # a compiler that takes everything but -march=native
    wrapper.write_text(f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -march=native ] && "
                       f"{{ echo 'unknown option -march=native' >&2; exit 1; }}; done\nexec {real} \"$@\"\n")
    wrapper.chmod(0o700)
    cache.remember("c-options", c_path._options_key(str(wrapper)),
                   json.dumps([[*c_path.FLAGS, "-march=native"], []]))  # kept from before, say
    [record] = root.glob("c-options-*.json")
    monkeypatch.setenv("CC", str(wrapper))
    c_path.compiler.cache_clear()
    try:
        _, source = unique_source(13)
        with pytest.raises(c_path.CompilerError) as error:
            c_path.load(source)
    finally:
        c_path.compiler.cache_clear()
    assert "unknown option -march=native" in str(error.value)
    assert f"came from the cached record {record}" in str(error.value)


def test_another_cpu_or_compiler_gets_its_own_build(root, monkeypatch):
    name, source = unique_source(7)
    c_path.load(source)
    forget_loaded()
    c_path._machine.cache_clear()
    monkeypatch.setattr(c_path, "_cpu_identity", lambda: "another CPU")
    runs = []
    real_run = c_path._run
    monkeypatch.setattr(c_path, "_run", lambda *a: runs.append(a[3]) or real_run(*a))
    assert call(c_path.load(source), name, 1.0) == 7.0
    assert any(path.endswith(".c") and "probe" not in path for path in runs)  # compiled for that machine
    assert len(library_files(root)) == 1  # the same bytes: one file, two records
    assert sum(r.startswith("c-library-") for r in cache.info()["records"]) == 2


def test_a_compiler_error_leaves_nothing_in_the_cache(root):
    with pytest.raises(c_path.CompilerError, match="failed on the generated C source"):
        c_path.load("this is not C either;\n")
    assert library_files(root) == []
    assert not any(r.startswith("c-library-") for r in cache.info()["records"])


def test_a_read_only_cache_still_runs_the_c_kernels(root, monkeypatch, caplog):
    root.mkdir(mode=0o700)
    root.chmod(0o500)
    if os.access(root, os.W_OK):  # running as root: permissions do not bind, so simulate what they would say
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    name, source = unique_source(11)
    try:
        with caplog.at_level(logging.WARNING, logger="flexgen.cache"):
            assert call(c_path.load(source), name, 1.0) == 11.0
    finally:
        root.chmod(0o700)
    assert "read-only" in caplog.text
    assert library_files(root) == []


def test_info_and_clear_count_only_libraries_whose_bytes_match_their_name(root, capsys):
    name, source = unique_source(13)
    c_path.load(source)
    [stored] = library_files(root)
    assert cli.main(["cache", "info"]) == 0
    assert "compiled C libraries: 1" in capsys.readouterr().out
    impostor = root / f"c-{'0' * 64}.so"
    impostor.write_bytes(b"not what the name says")
    summary = cache.info()
    assert summary["libraries"] == [stored.name]
    assert {i["name"]: i["reason"] for i in summary["not_flexgen"]} == {
        impostor.name: "not a library flexgen wrote (its content does not match its name)"}
    cache.clear()
    assert library_files(root) == [impostor]  # left alone
    assert not any(r.startswith("c-library-") for r in cache.info()["records"])
    forget_loaded()
    assert call(c_path.load(source), name, 1.0) == 13.0  # rebuilt after the clear


def test_clear_older_than_keeps_libraries_in_use(root):
    _, source = unique_source(17)
    c_path.load(source)
    [stored] = library_files(root)
    old = stored.stat().st_mtime - 10 * 86400
    os.utime(stored, (old, old))
    forget_loaded()
    c_path.load(source)  # a load counts as a use
    cache.clear(older_than_days=5)
    assert library_files(root) == [stored]
    os.utime(stored, (old, old))
    cache.clear(older_than_days=5)
    assert library_files(root) == []
