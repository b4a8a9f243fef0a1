"""Modules imported at their first attribute lookup.

Layers loaded from the cache run on tensors and never trace, so `import flexgen` and a cached layer's calls
need neither sympy nor the symbolic modules built on it: the math namespace and the surrogates reach them
through these stand-ins, which import the module when an attribute is first looked up (tracing, printing).
"""
import importlib


class LazyModule:
    """Stands in for the module `name` until an attribute of it is needed."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self):
        return f"<module {self._name!r}, imported at its first use>"


sympy = LazyModule("sympy")
symbolic = LazyModule("flexgen.frontend.symbolic")
trace = LazyModule("flexgen.frontend.trace")
