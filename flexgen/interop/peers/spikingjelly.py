"""SpikingJelly's IFNode, LIFNode and ParametricLIFNode as flexgen.IF, LIF and PLIF.

The flexgen classes take SpikingJelly's arguments and follow its update (fire on
h >= v_threshold, hard or soft reset, detach_reset); the conversion carries the
options, the surrogate (same name and alpha), the step mode and PLIF's `w` (the
Parameter itself, so its dtype, device and values are kept and the state_dict
keys stay SpikingJelly's).
"""
import sys

from ...frontend import surrogate as flexgen_surrogate
from ...neurons.integrate_fire import IF, LIF, PLIF
from . import Unsupported, adopt, class_path, defined_in, derives_from, finish

NEURON_PACKAGES = ("spikingjelly.activation_based.neuron", "spikingjelly.clock_driven.neuron")
SUPPORTED = {
    "spikingjelly.activation_based.neuron.IFNode": "IF",
    "spikingjelly.activation_based.neuron.LIFNode": "LIF",
    "spikingjelly.activation_based.neuron.ParametricLIFNode": "PLIF",
}


def owns(module):
    return defined_in(module, "spikingjelly")


def is_neuron(module):
    return derives_from(module, *NEURON_PACKAGES)


def _supported_kind(module):
    """'IF', 'LIF' or 'PLIF' when `module` is exactly one of the supported classes (a subclass may change
    the update, so it is not), else None."""
    package = sys.modules.get("spikingjelly.activation_based.neuron")
    for qualified, kind in SUPPORTED.items():
        cls = getattr(package, qualified.rsplit(".", 1)[1], None) if package is not None else None
        if cls is not None and type(module) is cls:
            return kind
    return None


def replacement(node, backend):
    kind = _supported_kind(node)
    if kind is None:
        raise Unsupported(
            f"{class_path(node)} has no flexgen equivalent (supported: IFNode, LIFNode, ParametricLIFNode); "
            "write its step as a @flexgen.neuron"
        )
    _check_options(node)
    options = dict(
        v_threshold=float(node.v_threshold),
        v_reset=None if node.v_reset is None else float(node.v_reset),
        surrogate=_surrogate(node.surrogate_function),
        detach_reset=bool(node.detach_reset),
        step_mode=node.step_mode,
        store_v_seq=bool(node.store_v_seq),
        backend=backend,
    )
    if kind == "IF":
        new = IF(**options)
    elif kind == "LIF":
        new = LIF(tau=float(node.tau), decay_input=bool(node.decay_input), **options)
    else:
        new = PLIF(decay_input=bool(node.decay_input), **options)
        adopt(new, "w", node.w)
    return finish(new, node)


def _check_options(node):
    if getattr(node, "backend", "torch") not in ("torch", "cupy", "triton"):
        raise Unsupported(f"unknown SpikingJelly backend {node.backend!r}")
    if getattr(node, "_neuron_precision", None) is not None:
        raise Unsupported("a SpikingJelly neuron precision setting (its states in another dtype) is not supported")


def _surrogate(sg):
    """The flexgen surrogate of the same name and alpha as a SpikingJelly surrogate function."""
    name = type(sg).__name__
    cls = getattr(flexgen_surrogate, name, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, flexgen_surrogate.Surrogate):
        raise Unsupported(f"SpikingJelly surrogate {name} has no flexgen equivalent")
    if not getattr(sg, "spiking", True):
        raise Unsupported(f"SpikingJelly surrogate {sg!r} has spiking=False, which flexgen does not support")
    if not hasattr(sg, "alpha"):
        raise Unsupported(f"SpikingJelly surrogate {sg!r} has no alpha to carry over")
    return cls(alpha=float(sg.alpha))
