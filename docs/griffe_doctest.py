"""Griffe extension for the API reference: show docstring examples (`>>>` lines) as code.

flexgen's docstrings hold plain doctest examples (run by tests/test_docstrings.py).
Markdown would read `>>>` as nested quotes and `[...]` as links, so each run of
example lines and their expected output becomes a fenced `pycon` block.
"""
import griffe


def fence_doctests(text):
    out, block = [], None
    for line in text.splitlines():
        stripped = line.strip()
        if block is None and stripped.startswith(">>>"):
            indent = line[: len(line) - len(line.lstrip())]
            block = [f"{indent}```pycon"]
        if block is not None:
            if stripped:
                block.append(line)
                continue
            out.extend(block + [block[0].replace("```pycon", "```")])
            block = None
        out.append(line)
    if block is not None:
        out.extend(block + [block[0].replace("```pycon", "```")])
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None and ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
