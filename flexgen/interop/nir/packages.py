"""The optional packages behind NIR import and export, `nir` and `nirtorch`, imported where first used."""
import importlib


def optional(package):
    """nir or nirtorch, imported on first use: they are optional (`pip install "flexgen-snn[nir]"`)."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(f"flexgen's NIR import and export need the {package!r} package: "
                          'pip install nir nirtorch (or pip install "flexgen-snn[nir]")') from exc
