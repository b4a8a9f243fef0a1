"""The documentation: its generated snippets come from the real code, and `mkdocs build --strict` passes."""
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

import flexgen

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def load_gen_snippets():
    spec = importlib.util.spec_from_file_location("flexgen_gen_snippets", DOCS / "gen_snippets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_snippets_come_from_the_code(tmp_path):
    gen = load_gen_snippets()
    changed = gen.generate(tmp_path)
    assert "lif_backward.py" in changed
    text = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert text["lif_saved.txt"].strip() == "h"  # the min-cut saves only the pre-spike potential
    assert "grad_v_prev = " in text["lif_equations.txt"]
    assert text["lif_backward.py"].startswith("@triton.jit\ndef lif_backward(")
    assert text["recurrent_lif_forward.py"].startswith("@triton.jit(do_not_specialize=[\"n_steps\", \"rec_previous_given\"])")
    assert "\ndef lif_recurrent_forward(" in text["recurrent_lif_forward.py"]
    assert "s &= \\Theta\\left(h - v_{\\mathrm{th}}\\right)" in text["lif_step.md"]
    for name in flexgen.neurons.available():
        assert f"\n## {name}\n" in "\n" + text["neurons.md"]
    assert text["errors.md"].count("flexgen.SpecError: ") == len(gen.ERROR_CASES)
    assert "needs CUDA tensors" in text["errors.md"]
    for name in flexgen.surrogate.available():
        assert f"`flexgen.surrogate.{name}`" in text["surrogates.md"]
    assert text["cli_help.txt"].startswith("usage: flexgen")
    assert gen.generate(tmp_path) == []  # unchanged files are not rewritten (no rebuild loop in `mkdocs serve`)


def test_pages_show_the_generated_files_as_they_are_generated_now(tmp_path):
    """Every page holds its generated code itself (readable on GitHub, copyable), and each copy is what
    gen_snippets.py generates from this checkout: `python docs/gen_snippets.py` refreshes them."""
    gen = load_gen_snippets()
    gen.generate(tmp_path)
    copies = [m.group(1) for page in gen.pages() for m in gen.GENERATED_COPY.finditer(page.read_text())]
    assert len(copies) >= 20 and all((tmp_path / name[len("docs/generated/"):]).is_file() for name in copies)
    assert {"docs/generated/ode_source.py", "docs/generated/surrogates.md",
            "docs/generated/recurrent_lif_forward.py"} <= set(copies)
    assert not [page.name for page in gen.pages() if "--8<--" in page.read_text()]
    stale = [page.name for page in gen.stale_pages(tmp_path)]
    assert stale == [], f"stale generated copies in {stale}: run `python docs/gen_snippets.py`"


def test_a_stale_copy_is_refreshed_inside_its_fence(tmp_path):
    gen = load_gen_snippets()
    (tmp_path / "example.py").write_text("print('new')\n")
    page = ("text\n<!-- generated from docs/generated/example.py by docs/gen_snippets.py -->\n\n```python\n"
            "print('old')\n```\n\n<!-- end of docs/generated/example.py -->\nmore\n")
    refreshed = gen.with_copies(page, tmp_path)
    assert refreshed == page.replace("print('old')", "print('new')")
    assert gen.with_copies(refreshed, tmp_path) == refreshed


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings_handlers", "latex2mathml")),
    reason="needs mkdocs, mkdocs-material, mkdocstrings[python] and latex2mathml (pip install '.[docs]')",
)
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(tmp_path / "cache"), NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    api = (site / "api" / "index.html").read_text()
    assert 'id="flexgen.layers.spec.neuron"' in api  # the defining module's path: flexgen's names load lazily
    assert '<span class="gp">&gt;&gt;&gt; </span>' in api  # docstring examples rendered as highlighted code
    how = (site / "how-it-works" / "index.html").read_text()
    assert "lif_backward" in how and "arithmatex" in how and "--8&lt;--" not in how
    # The maths is MathML made at build time: no TeX left for a script to typeset, no script from the network.
    assert '<div class="arithmatex"><math' in how and "<mtable" in how and "\\begin{" not in how
    for page in site.rglob("*.html"):
        scripts = re.findall(r'<script[^>]*src="([^"]*)"', page.read_text())
        assert not [src for src in scripts if "//" in src], (page, scripts)


def test_coming_from_page_snippets_run(capsys):
    """The "Coming from ..." page's code runs as written (a block that imports a peer runs where it is installed),
    and the report it shows is the one convert prints."""
    page = (DOCS / "coming-from.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    assert len(blocks) == 4
    ran = 0
    for block in blocks:
        peers = [m for m in ("snntorch", "spikingjelly") if f"import {m}" in block or f"from {m}" in block]
        if any(importlib.util.find_spec(m) is None for m in peers):
            continue
        exec(compile(block, "coming-from.md", "exec"), {"__name__": "coming_from"})
        ran += 1
    assert ran >= 1
    if importlib.util.find_spec("snntorch") is not None:
        shown = re.search(r"prints\n\n```text\n(.*?)```", page, re.DOTALL).group(1)
        assert shown in capsys.readouterr().out
