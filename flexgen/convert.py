"""Drop-in conversion: replace SpikingJelly and snnTorch neurons in a model by flexgen layers.

`convert(model)` walks the model and swaps, in place,

* `spikingjelly.activation_based.neuron.IFNode` -> `flexgen.IF`,
* `...LIFNode` -> `flexgen.LIF`,
* `...ParametricLIFNode` -> `flexgen.PLIF` (its learnable `w` copied),
* `snntorch.Leaky` (with `init_hidden=True`) -> a single-step flexgen layer of
  `snntorch_leaky`, which follows snnTorch's own update (reset from the
  previous membrane potential, `beta` clamped to [0, 1], firing on mem > threshold),

keeping hyper-parameters, surrogate gradients, step modes and learnable
values. Neither library is imported unless the model holds one of its modules.
"""
import sys

import torch

from . import surrogate as flexgen_surrogate
from .functions import detach, spike, where
from .spec import neuron

_SJ_NEURON = "spikingjelly.activation_based.neuron"


@neuron(states=("mem",), learnable=("beta", "threshold"))
def snntorch_leaky(x, mem, beta=0.9, threshold=1.0, reset_mechanism="subtract", spike_grad=flexgen_surrogate.ATan()):
    """snnTorch's `Leaky` step (`reset_delay=True`): the reset comes from the previous `mem`.

    snnTorch fires on `mem - threshold > 0`; `1 - spike(threshold - mem)` is that
    step (flexgen's `spike` fires on `>= 0`) with the same symmetric surrogate.
    """
    reset = 1.0 - detach(spike(threshold - mem, surrogate=spike_grad))
    b = where(beta > 1.0, 1.0, where(beta < 0.0, 0.0, beta))  # clamp to [0, 1]
    if reset_mechanism == "subtract":
        new = b * mem + x - reset * threshold
    elif reset_mechanism == "zero":
        new = b * (1.0 - reset) * mem + x
    else:
        new = b * mem + x
    s = 1.0 - spike(threshold - new, surrogate=spike_grad)
    return s, new


def convert(model, backend="auto"):
    """Replace SpikingJelly / snnTorch neuron modules in `model` by flexgen layers, in place.

    Returns the model (or the replacement, when `model` itself is a neuron).
    Raises `ValueError` for options flexgen has no equivalent for.

    >>> import torch, flexgen
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> flexgen.convert(net) is net
    True
    """
    replacement = _replacement(model, backend)
    if replacement is not None:
        return replacement
    for name, child in list(model.named_children()):
        new = convert(child, backend)
        if new is not child:
            setattr(model, name, new)
    return model


def _replacement(module, backend):
    kind = _kind(module)
    if kind is None:
        return None
    if kind == "snntorch_leaky":
        new = _from_snntorch_leaky(module, backend)
    else:
        new = _from_spikingjelly(kind, module, backend)
    new.train(module.training)
    return _to_like(new, module)


def _kind(module):
    """Which supported neuron class `module` is (by exact class, from already-imported libraries)."""
    sj = sys.modules.get(_SJ_NEURON)
    if sj is not None:
        for cls_name, kind in (("IFNode", "if"), ("LIFNode", "lif"), ("ParametricLIFNode", "plif")):
            cls = getattr(sj, cls_name, None)
            if cls is not None and type(module) is cls:
                return kind
    snn = sys.modules.get("snntorch")
    if snn is not None and type(module) is getattr(snn, "Leaky", None):
        return "snntorch_leaky"
    return None


def _to_like(new, old):
    tensors = list(old.parameters()) + list(old.buffers())
    return new.to(tensors[0].device) if tensors else new


# ---- SpikingJelly -------------------------------------------------------------


def _sj_surrogate(sg):
    """The flexgen surrogate of the same name and alpha as a SpikingJelly surrogate function."""
    name = type(sg).__name__
    cls = getattr(flexgen_surrogate, name, None)
    if cls is None or not isinstance(cls, type) or not issubclass(cls, flexgen_surrogate.Surrogate):
        raise ValueError(f"convert: SpikingJelly surrogate {name} has no flexgen equivalent")
    if not getattr(sg, "spiking", True):
        raise ValueError(f"convert: SpikingJelly surrogate {sg!r} has spiking=False, which flexgen does not support")
    if not hasattr(sg, "alpha"):
        raise ValueError(f"convert: SpikingJelly surrogate {sg!r} has no alpha to carry over")
    return cls(alpha=float(sg.alpha))


def _from_spikingjelly(kind, node, backend):
    import flexgen

    if getattr(node, "backend", "torch") not in ("torch", "cupy", "triton"):
        raise ValueError(f"convert: unknown SpikingJelly backend {node.backend!r}")
    kwargs = dict(
        v_threshold=float(node.v_threshold),
        v_reset=None if node.v_reset is None else float(node.v_reset),
        surrogate=_sj_surrogate(node.surrogate_function),
        detach_reset=bool(node.detach_reset),
        step_mode=node.step_mode,
        store_v_seq=bool(node.store_v_seq),
        backend=backend,
    )
    if kind == "if":
        return flexgen.IF(**kwargs)
    if kind == "lif":
        return flexgen.LIF(tau=float(node.tau), decay_input=bool(node.decay_input), **kwargs)
    new = flexgen.PLIF(decay_input=bool(node.decay_input), **kwargs)
    _copy_learnable(node.w, new, "w")
    return new


def _copy_learnable(value, module, name):
    params = dict(module.named_parameters())
    target = params.get(name)
    if target is None and len(params) == 1:
        target = next(iter(params.values()))
    if target is None:
        raise ValueError(f"convert: {type(module).__name__} has no learnable parameter {name!r} to copy into")
    with torch.no_grad():
        target.copy_(value.detach().reshape(target.shape))
    target.requires_grad_(value.requires_grad)


# ---- snnTorch ---------------------------------------------------------------


def _snntorch_surrogate(fn):
    """flexgen's surrogate for snnTorch's `surrogate.atan(alpha)` / `surrogate.sigmoid(slope)` (and the default)."""
    owner = getattr(fn, "__qualname__", "")
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
    numbers = [c for c in cells if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if owner.startswith("atan.") and len(numbers) == 1:
        return flexgen_surrogate.ATan(alpha=numbers[0])
    if owner.startswith("sigmoid.") and len(numbers) == 1:
        return flexgen_surrogate.Sigmoid(alpha=numbers[0])
    if getattr(fn, "__self__", None) is not None and getattr(fn.__self__, "__name__", "") == "ATan":
        return flexgen_surrogate.ATan(alpha=2.0)  # snnTorch's default `ATan.apply`
    raise ValueError(
        f"convert: snnTorch spike_grad {fn!r} has no flexgen equivalent; "
        "use snntorch.surrogate.atan(alpha) or snntorch.surrogate.sigmoid(slope)"
    )


def _check_leaky_options(leaky):
    unsupported = {
        "init_hidden": (getattr(leaky, "init_hidden", True), True),
        "output": (bool(getattr(leaky, "output", False)), False),
        "inhibition": (bool(getattr(leaky, "inhibition", False)), False),
        "state_quant": (bool(getattr(leaky, "state_quant", False)), False),
        "reset_delay": (bool(getattr(leaky, "reset_delay", True)), True),
    }
    for name, (value, needed) in unsupported.items():
        if value != needed:
            raise ValueError(f"convert: snnTorch Leaky with {name}={value} is not supported (needs {name}={needed})")
    factor = getattr(leaky, "graded_spikes_factor", 1.0)
    if float(torch.as_tensor(factor)) != 1.0 or isinstance(factor, torch.nn.Parameter):
        raise ValueError("convert: snnTorch Leaky with graded spikes (graded_spikes_factor != 1) is not supported")
    if leaky.reset_mechanism not in ("subtract", "zero", "none"):
        raise ValueError(f"convert: unknown snnTorch reset_mechanism {leaky.reset_mechanism!r}")


def _from_snntorch_leaky(leaky, backend):
    _check_leaky_options(leaky)
    beta, threshold = torch.as_tensor(leaky.beta), torch.as_tensor(leaky.threshold)
    for name, value in (("beta", beta), ("threshold", threshold)):
        if value.numel() != 1:
            raise ValueError(f"convert: snnTorch Leaky with a per-neuron {name} (shape {tuple(value.shape)}) is not supported")
    new = snntorch_leaky(
        step_mode="s", backend=backend,
        reset_mechanism=leaky.reset_mechanism, spike_grad=_snntorch_surrogate(leaky.spike_grad),
    )
    with torch.no_grad():
        new.beta.copy_(beta.detach().reshape(()))
        new.threshold.copy_(threshold.detach().reshape(()))
    new.beta.requires_grad_(isinstance(leaky.beta, torch.nn.Parameter))
    new.threshold.requires_grad_(isinstance(leaky.threshold, torch.nn.Parameter))
    return new
