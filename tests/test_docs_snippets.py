"""Every Python snippet of the docs (and the README) runs as written.

A page's snippets run in order in one namespace, as a reader would paste them into one interpreter; on the pages
in STANDALONE each snippet runs alone, in a namespace of its own, as a reader copying one block would run it. Copies of
generated files (between gen_snippets.py's markers) are left out: they come from the code itself (test_docs.py). A snippet that
cannot run here says so on its first line, visibly to readers: `# needs a CUDA GPU` (any first line starting
`# needs `; `# needs PACKAGE` for an optional package), and is skipped when that is not available.
"""
import contextlib
import importlib.util
import io
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if (DOCS / "generated") not in p.parents) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(?:python|py)\n(.*?)^```", re.S | re.M)
NEEDS = re.compile(r"^# needs (.+)")
# Pages whose every snippet carries its own imports and definitions: each runs in a fresh namespace.
STANDALONE = {"writing-a-neuron.md", "extending.md", "README.md"}


GENERATED_COPY = re.compile(r"<!-- generated from (\S+) by docs/gen_snippets.py -->\n.*?<!-- end of \1 -->\n", re.S)


def snippets(page):
    """(first line number, code) of each Python block of a page that is not a copy of a generated file."""
    text = page.read_text()
    copies = [m.span() for m in GENERATED_COPY.finditer(text)]
    found = []
    for match in FENCE.finditer(text):
        if any(start <= match.start() < end for start, end in copies):
            continue
        found.append((text.count("\n", 0, match.start(1)) + 1, match.group(1)))
    return found


def unmet_need(code):
    """Why a snippet cannot run here, or None."""
    marker = NEEDS.match(code)
    if marker is None:
        return None
    need = marker.group(1).strip()
    if "GPU" in need:
        return None if torch.cuda.is_available() else need
    return None if importlib.util.find_spec(need) is not None else need  # a package: "# needs spikingjelly"


def runnable_pages():
    return [page for page in PAGES if snippets(page)]


def test_the_pages_with_snippets_are_found():
    names = {page.name for page in runnable_pages()}
    assert {"getting-started.md", "writing-a-neuron.md", "neurons.md", "README.md"} <= names


@pytest.mark.parametrize("page", runnable_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_snippets_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    fresh = lambda: {"__name__": f"docs_{page.stem.replace('-', '_')}"}  # noqa: E731
    namespace = fresh()
    for line, code in snippets(page):
        need = unmet_need(code)
        if need is not None:
            continue
        if page.name in STANDALONE:
            namespace = fresh()
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(code, f"{page.name}, snippet at line {line}", "exec"), namespace)
            except Exception as exc:
                pytest.fail(f"{page.name}: the snippet at line {line} raised {type(exc).__name__}: {exc}")


def test_the_standalone_pages_are_found():
    assert STANDALONE <= {page.name for page in runnable_pages()}


def test_a_marked_snippet_is_skipped_without_what_it_needs():
    assert unmet_need("# needs a CUDA GPU\nimport torch\n") == (None if torch.cuda.is_available() else "a CUDA GPU")
    assert unmet_need("import torch\n# needs nothing\n") is None
    assert unmet_need("# needs torch\nimport torch\n") is None
    assert unmet_need("# needs no_such_package_here\n") == "no_such_package_here"
