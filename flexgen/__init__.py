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
__version__ = "0.1.0"

from . import surrogate  # noqa: E402
from .errors import SpecError  # noqa: E402
from .functions import (  # noqa: E402
    abs, atan, clamp, detach, eq, exp, ge, gt, le, log, lt, maximum, minimum, ne, sigmoid, spike, sqrt, tanh, where,
)
from .module import NeuronModule  # noqa: E402
from .spec import NeuronSpec, neuron  # noqa: E402
from .ode_spec import Dynamics, StiffnessWarning, ode  # noqa: E402
from . import neurons  # noqa: E402
from .neurons import IF, LIF, PLIF  # noqa: E402
from .convert import convert  # noqa: E402
from .nir_bridge import from_nir, to_nir  # noqa: E402

__all__ = [
    "neuron", "NeuronSpec", "ode", "Dynamics", "StiffnessWarning", "from_nir", "to_nir", "NeuronModule", "SpecError", "surrogate", "spike", "detach", "where",
    "exp", "log", "sqrt", "tanh", "atan", "sigmoid", "abs", "minimum", "maximum", "clamp",
    "lt", "le", "gt", "ge", "eq", "ne",
]
