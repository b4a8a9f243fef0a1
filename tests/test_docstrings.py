"""Run the docstring examples of every public flexgen module (doctest.testmod on each)."""
import doctest
import importlib
import os
import pkgutil
import tempfile

import pytest

import flexgen


def public_modules():
    names = ["flexgen"]
    for info in pkgutil.walk_packages(flexgen.__path__, prefix="flexgen."):
        parts = info.name.split(".")
        if any(p.startswith("_") for p in parts[1:]):  # private modules and __main__
            continue
        names.append(info.name)
    return sorted(names)


MODULES = public_modules()


def test_modules_found():
    for name in ("flexgen", "flexgen.layers.spec", "flexgen.cli", "flexgen.surrogate", "flexgen.frontend.functions", "flexgen.cache"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name, tmp_path, monkeypatch):
    # The examples make temporary folders and point FLEXGEN_CACHE_DIR at one: keep both inside this test.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", os.environ["FLEXGEN_CACHE_DIR"])
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest example(s) failed in {name} (output above)"


def test_examples_exist():
    """The docstrings do carry examples: at least the user-facing modules have some."""
    finder = doctest.DocTestFinder()
    counts = {}
    for name in ("flexgen", "flexgen.layers.spec", "flexgen.frontend.functions", "flexgen.frontend.surrogate"):
        module = importlib.import_module(name)
        counts[name] = sum(len(t.examples) for t in finder.find(module))
    assert all(n > 0 for n in counts.values()), counts
