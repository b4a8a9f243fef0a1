"""The installed package carries its templates (CI runs the tests against a non-editable install)."""
import pathlib

import pytest

import flexgen
from flexgen import frames


def test_templates_ship_with_the_package():
    names = {p.name for p in frames.template_dir().glob("*.j2")}
    assert {"forward.py.j2", "backward.py.j2", "kernels.py.j2", "torch_forward.py.j2", "torch_backward.py.j2"} <= names
    package = pathlib.Path(flexgen.__file__).resolve().parent
    if "site-packages" in package.parts:  # a non-editable install: the templates must be inside it
        assert frames.template_dir() == package / "templates"


def test_every_subpackage_is_listed_for_installation():
    """A subpackage missing from pyproject's list would be left out of a non-editable install."""
    root = pathlib.Path(__file__).resolve().parent.parent
    pyproject = (root / "pyproject.toml").read_text()
    subpackages = {".".join(p.parent.relative_to(root).parts) for p in (root / "flexgen").rglob("*/__init__.py")}
    assert "flexgen.launch.recurrent" in subpackages  # nested ones too
    listed = pyproject.split("packages = [", 1)[1].split("]", 1)[0]
    assert subpackages and all(f'"{name}"' in listed for name in subpackages), (subpackages, listed)


def _extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer

    root = pathlib.Path(__file__).resolve().parent.parent
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_each_peer_has_an_extra_that_leaves_torch_alone_and_the_test_extra_has_no_docs_stack():
    extras = _extras()
    assert {"snntorch", "spikingjelly", "norse", "nir", "test", "docs"} <= set(extras)
    for name, requirements in extras.items():
        assert not any(r.split("[")[0].split(">")[0].split("=")[0].strip() in ("torch", "torchvision", "torchaudio")
                       for r in requirements), name
    assert not any(r.startswith(("mkdocs", "latex2mathml")) for r in extras["test"])


def test_a_required_peer_that_is_missing_is_named_with_its_install_line(monkeypatch):
    import sys

    from conftest import missing_peers

    monkeypatch.setitem(sys.modules, "snntorch", None)  # None: importing it fails
    assert 'snntorch (pip install ".[test]")' in missing_peers()


def test_a_missing_c_compiler_is_named(monkeypatch):
    import conftest

    monkeypatch.setattr(conftest, "HAS_C_COMPILER", False)
    assert conftest.C_COMPILER_MISSING in conftest.missing_peers()
    monkeypatch.setattr(conftest, "HAS_C_COMPILER", True)
    assert conftest.C_COMPILER_MISSING not in conftest.missing_peers()


def test_the_static_pieces_the_frames_include_ship_with_the_package():
    """Every `{% include "static/..." %}` of a frame names a file that is there, and pyproject's package data
    takes every static piece along (a non-editable install would lack one it leaves out)."""
    import fnmatch
    import re

    sources = frames.template_sources()
    included = {name for text in sources.values() for name in re.findall(r'\{% include "(static/[^"]+)" %\}', text)}
    static = {name for name in sources if name.startswith("static/")}
    assert included and included <= static, included - static
    assert static <= included, f"static pieces no frame includes: {sorted(static - included)}"
    root = pathlib.Path(__file__).resolve().parent.parent
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["flexgen.templates"]
    assert all(any(fnmatch.fnmatch(name, p) for p in shipped) for name in static), (sorted(static), shipped)
    assert set(frames.STATIC_PATTERNS) <= set(shipped)
