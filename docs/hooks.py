"""mkdocs hook: regenerate docs/generated/ from the code before every build (see gen_snippets.py)."""
import importlib.util
import logging
import pathlib

log = logging.getLogger("mkdocs.hooks.flexgen")


def on_pre_build(config):
    path = pathlib.Path(__file__).with_name("gen_snippets.py")
    spec = importlib.util.spec_from_file_location("flexgen_gen_snippets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    changed = module.generate()
    log.info("gen_snippets: %d generated file(s) updated", len(changed))
