"""mkdocs hooks: regenerate docs/generated/ and the pages' copies of it from the code before every build (see
gen_snippets.py), and
render the pages' maths to MathML at build time, so the site shows it with no script and no network; a link to a page
written on another branch (`LATER_PAGES`) stays text until that page is in the docs."""
import html
import importlib.util
import logging
import pathlib
import re

from latex2mathml.converter import convert as latex_to_mathml

log = logging.getLogger("mkdocs.hooks.flexgen")

# What pymdownx.arithmatex (generic mode) writes for \( \) and $$ $$: the TeX, HTML-escaped, in a span or div.
MATHS = re.compile(r'<(span|div) class="arithmatex">\\[(\[](.*?)\\[)\]]</\1>', re.DOTALL)


def on_pre_build(config):
    path = pathlib.Path(__file__).with_name("gen_snippets.py")
    spec = importlib.util.spec_from_file_location("flexgen_gen_snippets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    changed = module.generate()
    refreshed = module.refresh_pages()
    log.info("gen_snippets: %d generated file(s) updated, pages refreshed: %s", len(changed), refreshed or "none")


LATER_PAGES = ("streaming.md",)  # linked from deploying.md; written on another branch


def on_page_markdown(markdown, page, config, files):
    for name in LATER_PAGES:
        if files.get_file_from_path(name) is None:
            markdown = re.sub(r"\[([^\]]+)\]\(" + re.escape(name) + r"(#[^)]*)?\)", r"\1", markdown)
    return markdown


def on_page_content(content, page, config, files):
    return render_maths(content)


def render_maths(content):
    """Every arithmatex span (inline) or div (display) with its TeX replaced by MathML, which browsers draw."""

    def to_mathml(match):
        tag, tex = match.group(1), html.unescape(match.group(2)).strip()
        # latex2mathml lays out `split` as a table, not `aligned`; in display maths the two look the same.
        tex = tex.replace("{aligned}", "{split}")
        mathml = latex_to_mathml(tex, display="block" if tag == "div" else "inline")
        return f'<{tag} class="arithmatex">{mathml}</{tag}>'

    return MATHS.sub(to_mathml, content)
