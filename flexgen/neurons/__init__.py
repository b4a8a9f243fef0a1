"""Bundled neurons: IF, LIF, PLIF (SpikingJelly-compatible layers), a zoo of published models, and
the same models as differential equations (`flexgen.neurons.continuous`, names starting with `Ode`).

Every bundled neuron is an ordinary `@flexgen.neuron` step function (the
continuous ones a step `flexgen.ode` wrote); nothing here takes a special code
path. `available()` lists them, `get(name)` returns one: a layer class for
IF/LIF/PLIF (its step function is `cls.spec`), a `NeuronSpec` for the others
(call it to get a layer). The continuous models are imported on first use
(deriving their exact solutions takes sympy a moment).

>>> import flexgen
>>> "Izhikevich" in flexgen.neurons.available()
True
>>> flexgen.neurons.get("lif") is flexgen.LIF
True
>>> flexgen.neurons.spec("LIF").signature.states
('v',)
"""
from .integrate_fire import IF, LIF, PLIF, if_step, lif_step, plif_step
from .zoo import adaptive_mix, adex, alif, eif, izhikevich, qif, resonate_and_fire, synaptic

IF.spec, LIF.spec, PLIF.spec = if_step, lif_step, plif_step

_BUNDLED = {
    "IF": IF,
    "LIF": LIF,
    "PLIF": PLIF,
    "ALIF": alif,
    "Synaptic": synaptic,
    "Izhikevich": izhikevich,
    "QIF": qif,
    "EIF": eif,
    "AdEx": adex,
    "ResonateAndFire": resonate_and_fire,
    "AdaptiveMix": adaptive_mix,
}

__all__ = ["IF", "LIF", "PLIF", "available", "get", "spec"] + [
    "if_step", "lif_step", "plif_step", "alif", "synaptic", "izhikevich", "qif", "eif", "adex",
    "resonate_and_fire", "adaptive_mix",
]


def available():
    """All bundled neurons, name -> layer class (IF, LIF, PLIF) or `NeuronSpec` (the others).

    >>> sorted(available())[:4]
    ['ALIF', 'AdEx', 'AdaptiveMix', 'EIF']
    """
    from .continuous import BUNDLED as continuous

    return {**_BUNDLED, **continuous}


def get(name):
    """The bundled neuron called `name` (case-insensitive): a layer class or a `NeuronSpec`.

    >>> get("izhikevich").signature.states
    ('v', 'u')
    """
    if not isinstance(name, str):
        raise TypeError(f"neuron name must be a string, got {name!r}")
    bundled = available()
    by_lower = {k.lower(): v for k, v in bundled.items()}
    if name.lower() not in by_lower:
        raise KeyError(f"no bundled neuron named {name!r}; available: {', '.join(bundled)}")
    return by_lower[name.lower()]


def spec(name):
    """The `NeuronSpec` (step function) of the bundled neuron `name`, also for IF/LIF/PLIF.

    >>> spec("PLIF").signature.learnable
    ('w',)
    """
    found = get(name)
    return getattr(found, "spec", found)
