"""IF, LIF and PLIF: SpikingJelly's IFNode, LIFNode and ParametricLIFNode as flexgen specs.

Each neuron is a plain `@flexgen.neuron` step function (`if_step`,
`lif_step`, `plif_step`); the structural options are specialising
parameters, so every combination gets its own kernels:
`decay_input`, `soft_reset` (SpikingJelly's `v_reset=None`), `detach_reset`
and `surrogate`. The classes `IF`, `LIF`, `PLIF` are thin `NeuronModule`s
taking SpikingJelly's argument names and defaults: like IFNode, LIFNode and
ParametricLIFNode they run one step per call (`step_mode="s"`) unless built with
`step_mode="m"` (layers made from a `@flexgen.neuron` spec default to "m").

Equations (one step, x the input, v the membrane potential, V_r = v_reset,
taken as 0 in the charge under soft reset):
  IF              h = v + x
  LIF/PLIF, decay h = v + (x - (v - V_r)) / tau
  LIF/PLIF, plain h = v - (v - V_r) / tau + x
  (PLIF: 1/tau = sigmoid(w), w learnable, initialised to -log(init_tau - 1))
  fire            s = Θ(h - v_threshold)
  hard reset      v' = h (1 - s) + V_r s
  soft reset      v' = h - s v_threshold
With detach_reset the s in the reset carries no gradient.
Source: Fang et al., "SpikingJelly" (Science Advances 2023); PLIF from
Fang et al., "Incorporating Learnable Membrane Time Constant..." (ICCV 2021).
"""
import math

from ..frontend.functions import detach, sigmoid, spike
from ..frontend.hyper import hyper_value
from ..layers.neuron import NeuronModule
from ..layers.spec import neuron
from ..frontend.surrogate import Sigmoid, Surrogate


def _reset(h, s, v_threshold, v_reset, soft_reset, detach_reset):
    """The new membrane potential after firing `s` from `h` (hard or soft reset)."""
    s_reset = detach(s) if detach_reset else s
    if soft_reset:
        return h - s_reset * v_threshold
    return h * (1.0 - s_reset) + v_reset * s_reset


@neuron(states=("v",), init={"v": "v_reset"})
def if_step(x, v, v_threshold=1.0, v_reset=0.0, soft_reset=False, detach_reset=False, surrogate=Sigmoid()):
    """Integrate-and-fire: h = v + x, s = Θ(h - v_threshold), hard or soft reset. Fires where h >= v_threshold
    (as SpikingJelly's heaviside)."""
    h = v + x
    s = spike(h - v_threshold, surrogate)
    return s, _reset(h, s, v_threshold, v_reset, soft_reset, detach_reset)


@neuron(states=("v",), init={"v": "v_reset"})
def lif_step(x, v, tau=2.0, v_threshold=1.0, v_reset=0.0, decay_input=True, soft_reset=False,
             detach_reset=False, surrogate=Sigmoid()):
    """Leaky integrate-and-fire with time constant tau (SpikingJelly's LIFNode). Fires where h >= v_threshold."""
    v_rest = 0.0 if soft_reset else v_reset
    if decay_input:
        h = v + (x - (v - v_rest)) / tau
    else:
        h = v - (v - v_rest) / tau + x
    s = spike(h - v_threshold, surrogate)
    return s, _reset(h, s, v_threshold, v_reset, soft_reset, detach_reset)


@neuron(states=("v",), learnable=("w",), init={"v": "v_reset"})
def plif_step(x, v, w=0.0, v_threshold=1.0, v_reset=0.0, decay_input=True, soft_reset=False,
              detach_reset=False, surrogate=Sigmoid()):
    """Parametric LIF: 1/tau = sigmoid(w) with w learnable (SpikingJelly's ParametricLIFNode). Fires where
    h >= v_threshold."""
    v_rest = 0.0 if soft_reset else v_reset
    k = sigmoid(w)
    if decay_input:
        h = v + (x - (v - v_rest)) * k
    else:
        h = v - (v - v_rest) * k + x
    s = spike(h - v_threshold, surrogate)
    return s, _reset(h, s, v_threshold, v_reset, soft_reset, detach_reset)


class _IntegrateFireModule(NeuronModule):
    """Maps SpikingJelly's node arguments onto a `NeuronModule` of one of the specs above."""

    def __init__(self, spec, v_threshold, v_reset, surrogate, detach_reset, step_mode, backend, store_v_seq,
                 surrogate_function=None, **params):
        surrogate = surrogate_function if surrogate_function is not None else surrogate
        if not isinstance(surrogate, Surrogate):
            raise TypeError(f"surrogate must be a flexgen.surrogate.Surrogate, got {surrogate!r}")
        soft_reset = v_reset is None
        v_threshold = hyper_value("v_threshold", v_threshold, owner=type(self).__name__)
        v_reset = None if soft_reset else hyper_value("v_reset", v_reset, owner=type(self).__name__)
        super().__init__(
            spec, step_mode=step_mode, store_state_seqs=store_v_seq, backend=backend,
            v_threshold=v_threshold, v_reset=0.0 if soft_reset else v_reset, soft_reset=soft_reset,
            detach_reset=bool(detach_reset), surrogate=surrogate, **params,
        )
        self.v_threshold, self.v_reset = float(v_threshold), (None if soft_reset else float(v_reset))
        self.detach_reset, self.surrogate_function, self.store_v_seq = bool(detach_reset), surrogate, store_v_seq

    @property
    def v_seq(self):
        """The membrane potential after every step of the last call ([T, ...]); needs store_v_seq=True."""
        if not self.store_v_seq:
            raise RuntimeError(f"{type(self).__name__}.v_seq is only recorded when the layer is built "
                               "with store_v_seq=True")
        return self.state_seqs.get("v")


class IF(_IntegrateFireModule):
    """Integrate-and-fire layer with SpikingJelly's IFNode options.

    v_reset=None selects the soft reset (subtract v_threshold). The final
    membrane potential is `.v`, its sequence `.v_seq` (store_v_seq=True).
    `recompute=True`: the backward re-runs the forward steps instead of
    reading saved values; "auto" (the default) does where that moves fewer
    bytes (see `flexgen.NeuronModule`); LIF and PLIF take it too, and `delay=`
    (a `flexgen.Delay` on the input, with step_mode="m"; see `NeuronModule`).

    Single-step by default, as SpikingJelly's IFNode: one call is one step; `step_mode="m"` takes [T, ...].

    >>> import torch, flexgen
    >>> layer = flexgen.IF(v_threshold=1.0, backend="eager")
    >>> [layer(torch.tensor([0.6])).item() for _ in range(3)]
    [0.0, 1.0, 0.0]
    >>> flexgen.IF(step_mode="m", backend="eager")(torch.full((3, 1), 0.6)).flatten().tolist()
    [0.0, 1.0, 0.0]
    """

    def __init__(self, v_threshold=1.0, v_reset=0.0, surrogate=Sigmoid(alpha=4.0), detach_reset=False,
                 step_mode="s", backend="auto", store_v_seq=False, surrogate_function=None, recompute="auto",
                 delay=None):
        super().__init__(if_step, v_threshold, v_reset, surrogate, detach_reset, step_mode, backend, store_v_seq,
                         surrogate_function, recompute=recompute, delay=delay)


class LIF(_IntegrateFireModule):
    """Leaky integrate-and-fire layer with SpikingJelly's LIFNode options (tau, decay_input, ...).

    Single-step by default, as SpikingJelly's LIFNode; `step_mode="m"` takes [T, ...] inputs.

    >>> import torch, flexgen
    >>> layer = flexgen.LIF(tau=2.0, step_mode="m", backend="eager")
    >>> layer(torch.full((4, 1), 1.5)).flatten().tolist()
    [0.0, 1.0, 0.0, 1.0]
    """

    def __init__(self, tau=2.0, decay_input=True, v_threshold=1.0, v_reset=0.0, surrogate=Sigmoid(alpha=4.0),
                 detach_reset=False, step_mode="s", backend="auto", store_v_seq=False, surrogate_function=None,
                 recompute="auto", delay=None):
        super().__init__(lif_step, v_threshold, v_reset, surrogate, detach_reset, step_mode, backend, store_v_seq,
                         surrogate_function, tau=hyper_value("tau", tau, owner="LIF"), decay_input=bool(decay_input),
                         recompute=recompute, delay=delay)
        self.tau, self.decay_input = float(tau), bool(decay_input)


class PLIF(_IntegrateFireModule):
    """Parametric LIF layer (SpikingJelly's ParametricLIFNode): 1/tau = sigmoid(w), w an nn.Parameter.

    w starts at -log(init_tau - 1), so 1/tau starts at 1/init_tau. One w is
    shared by all neurons of the layer; with `per_channel=C` each channel (dim 2
    of [T, B, C, ...] inputs) has its own w, and the backward reduces its
    gradient per channel. `dtype` is w's dtype (default: torch's default dtype). Single-step by default,
    as SpikingJelly's ParametricLIFNode.

    >>> import torch, flexgen
    >>> layer = flexgen.PLIF(init_tau=2.0, backend="eager")
    >>> round(1 / torch.sigmoid(layer.w).item(), 6)
    2.0
    """

    def __init__(self, init_tau=2.0, decay_input=True, v_threshold=1.0, v_reset=0.0, surrogate=Sigmoid(alpha=4.0),
                 detach_reset=False, step_mode="s", backend="auto", store_v_seq=False, surrogate_function=None,
                 per_channel=None, recompute="auto", dtype=None, delay=None):
        init_tau = hyper_value("init_tau", init_tau, owner="PLIF")
        if init_tau <= 1.0:
            raise ValueError(f"PLIF: init_tau must be a finite number > 1 (1/tau = sigmoid(w) < 1), got {init_tau!r}")
        super().__init__(plif_step, v_threshold, v_reset, surrogate, detach_reset, step_mode, backend, store_v_seq,
                         surrogate_function, w=-math.log(init_tau - 1.0), decay_input=bool(decay_input),
                         per_channel=per_channel, recompute=recompute, dtype=dtype, delay=delay)
        self.init_tau, self.decay_input = init_tau, bool(decay_input)
