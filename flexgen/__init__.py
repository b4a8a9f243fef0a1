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
"""
from .version import __version__
from . import surrogate
from .errors import SpecError
from .functions import (
    abs, atan, clamp, detach, eq, exp, ge, gt, le, log, lt, maximum, minimum, ne, sigmoid, spike, sqrt, tanh, where,
)
from .module import NeuronModule
from .spec import NeuronSpec, neuron
from .ode_spec import Dynamics, StiffnessWarning, ode
from . import neurons
from .neurons import IF, LIF, PLIF
from .convert import ConversionError, ConversionReport, convert, reset
from .nir_bridge import from_nir, to_nir
from .recurrent import Recurrent

__all__ = [
    "__version__", "neurons", "IF", "LIF", "PLIF", "convert", "reset", "ConversionError", "ConversionReport",
    "neuron", "NeuronSpec", "ode", "Dynamics", "StiffnessWarning", "from_nir", "to_nir", "Recurrent", "NeuronModule",
    "SpecError", "surrogate", "spike", "detach", "where",
    "exp", "log", "sqrt", "tanh", "atan", "sigmoid", "abs", "minimum", "maximum", "clamp",
    "lt", "le", "gt", "ge", "eq", "ne",
]
