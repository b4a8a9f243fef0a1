"""The installed package carries its templates (CI runs the tests against a non-editable install)."""
import pathlib

import flexgen
from flexgen import frames


def test_templates_ship_with_the_package():
    names = {p.name for p in frames.template_dir().glob("*.j2")}
    assert {"forward.py.j2", "backward.py.j2", "module.py.j2", "torch_forward.py.j2", "torch_backward.py.j2"} <= names
    package = pathlib.Path(flexgen.__file__).resolve().parent
    if "site-packages" in package.parts:  # a non-editable install: the templates must be inside it
        assert frames.template_dir() == package / "templates"
