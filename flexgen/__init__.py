"""flexgen: fused Triton kernels for spiking neurons, generated from a Python step function.

>>> import torch, flexgen
>>> @flexgen.neuron(states=("v",))
... def lif(x, v, tau=2.0, v_th=1.0):
...     h = v + (x - v) / tau
...     s = flexgen.spike(h - v_th)
...     return s, h * (1.0 - s)
>>> layer = lif(tau=3.0)
>>> layer(torch.full((4, 2), 1.5)).sum(dim=1).tolist()
[0.0, 0.0, 2.0, 0.0]

The package loads on first use of one of its names (PEP 562), module by module: `import flexgen` alone,
`flexgen --help` and `flexgen cache info|clear` do not load torch, sympy or Triton, and a layer whose kernels
are in the cache runs without sympy (nor Triton on the CPU).
"""
import importlib
import importlib.util

from .version import __version__

# module -> the public names it defines, loaded together on the first use of any of them
_PUBLIC = {
    ".errors": ("SpecError",),
    ".frontend.functions": ("spike", "detach", "where", "exp", "log", "sqrt", "tanh", "atan", "sigmoid", "abs",
                            "minimum", "maximum", "clamp", "lt", "le", "gt", "ge", "eq", "ne"),
    ".layers.spec": ("neuron", "NeuronSpec"),
    ".layers.ode_spec": ("ode", "Dynamics", "StiffnessWarning"),
    ".layers.neuron": ("NeuronModule",),
    ".layers.recurrent": ("Recurrent",),
    ".layers.dense": ("Dense", "Chain"),
    ".layers.budget": ("MemoryBudgetError",),
    ".layers.delay": ("Delay", "DelayedLinear", "SynapseDelay"),
    ".streaming.stream": ("Stream",),
    ".streaming.held": ("StreamError",),
    ".layers.eventprop": ("EventPropDense",),
    ".neurons": ("IF", "LIF", "PLIF"),
    ".interop.conversion": ("convert", "reset", "ConversionError", "ConversionReport"),
    ".interop.nir": ("from_nir", "to_nir"),
    ".interop.export": ("export_model", "save_exported", "load_exported"),
}
__all__ = ["__version__", "neurons", "surrogate", *(name for names in _PUBLIC.values() for name in names)]
_HOME = {name: module for module, names in _PUBLIC.items() for name in names}  # public name -> its module


def _load(module):
    """Import `module` and bind the public names it defines."""
    loaded = importlib.import_module(module, __name__)
    globals().update((name, getattr(loaded, name)) for name in _PUBLIC[module])


def __getattr__(name):
    if name in _HOME:
        _load(_HOME[name])
        return globals()[name]
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # a submodule: that module alone
    raise AttributeError(f"module 'flexgen' has no attribute {name!r}")


def __dir__():
    """The public names: what `__all__` lists (the package's own imports and helpers stay out of sight)."""
    return sorted(__all__)
