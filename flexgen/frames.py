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


# The hand-written pieces the frames include verbatim ({% include "static/..." %}): Triton and torch functions,
# fixed fragments of the kernels and the C target's header. Plain source, no jinja2 in them.
STATIC_PATTERNS = ("static/*.py", "static/*.h")


def template_paths():
    """Every frame (`*.j2`) and every static piece they include."""
    root = template_dir()
    return sorted(root.glob("*.j2")) + sorted(p for pattern in STATIC_PATTERNS for p in root.glob(pattern))


def template_name(path):
    """A frame's name for the environment: its path below the template folder ("static/elementwise.py")."""
    return path.relative_to(template_dir()).as_posix()


def template_sources():
    """Text of every frame and static piece by name (`template_name`)."""
    return {template_name(p): p.read_text() for p in template_paths()}


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
