"""The jinja2 kernel frames in `templates/`: where they are, their text, the environment that fills them.

A leaf module: `names` reads the frames' own identifiers from here, `render` fills them.
"""
import functools
import pathlib


def template_dir():
    """The frames: `flexgen/templates` in an installed package, `templates/` at the top of a checkout."""
    package = pathlib.Path(__file__).resolve().parent
    installed = package / "templates"
    return installed if installed.is_dir() else package.parent / "templates"


def template_paths():
    return sorted(template_dir().glob("*.j2"))


def template_sources():
    """Text of every frame by file name."""
    return {p.name: p.read_text() for p in template_paths()}


@functools.lru_cache(maxsize=None)
def environment():
    import jinja2  # only a cache miss renders: a process that loads cached kernels never imports it

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=False,
        autoescape=False,
    )


def frame(name):
    """The frame `name` (e.g. "forward.py.j2"), ready to render."""
    return environment().get_template(name)
