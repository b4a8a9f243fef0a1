"""snnTorch's Leaky, Synaptic, Alpha, Lapicque, RLeaky and RSynaptic as flexgen specs, and the layers that stand in
for them (the recurrent two add their recurrent current with torch, then run the neuron's step).

Each spec is snnTorch's own update written as a step function: the reset comes
from the previous membrane potential (detached), decay rates are clamped to
[0, 1], and a neuron fires where `mem > threshold` (strictly: flexgen's `spike`
fires on `>= 0`, so snnTorch's spike is written as its complement,
`1 - spike(threshold - mem)`, whose gradient is the same for the symmetric
surrogates snnTorch offers). Every tensor the snnTorch module holds (beta,
threshold, graded_spikes_factor, alpha, R, C, time_step) is a learnable value of
the spec, so `SnnTorchLayer` keeps the module's own tensors, learnt or not,
under their own names: same dtype, same shape (one value, per channel or per
neuron), same `state_dict()`.
"""
import sys

import torch

from ...frontend import surrogate as flexgen_surrogate
from ...frontend.functions import clamp, detach, log, minimum, spike
from ...layers.neuron import NeuronModule
from ...layers.spec import neuron
from . import Unsupported, adopt, class_path, defined_in, derives_from, finish


def _fires(mem, threshold, surrogate):
    """snnTorch's spike: 1 where mem > threshold."""
    return 1.0 - spike(threshold - mem, surrogate)


def _unit(rate):
    """A decay rate as snnTorch uses it: clamped to [0, 1]."""
    return clamp(rate, 0.0, 1.0)


def _reset_now(mem, fired, reset, threshold, reset_mechanism):
    """`reset_delay=False`: the reset of this step's spike applied at once (the previous one was applied already)."""
    if reset_mechanism == "subtract":
        return mem - (fired - reset) * threshold
    if reset_mechanism == "zero":
        return mem - (fired - reset) * mem
    return mem


def _reset_after_input(new, reset, threshold, reset_mechanism):
    """The previous step's reset applied to a potential that already holds this step's input."""
    if reset_mechanism == "subtract":
        return new - reset * threshold
    if reset_mechanism == "zero":
        return new - new * reset
    return new


def _fire(new, reset, threshold, graded_spikes_factor, spike_grad, reset_mechanism, reset_delay):
    """(spikes, potential kept): this step's spikes and, with `reset_delay=False`, their reset applied at once."""
    fired = _fires(new, threshold, spike_grad)
    if not reset_delay:
        new = _reset_now(new, fired, reset, threshold, reset_mechanism)
    return fired * graded_spikes_factor, new


@neuron(states=("mem",), learnable=("beta", "threshold", "graded_spikes_factor"))
def snntorch_leaky(x, mem, beta=0.9, threshold=1.0, graded_spikes_factor=1.0, reset_mechanism="subtract",
                   reset_delay=True, spike_grad=flexgen_surrogate.ATan()):
    """snnTorch's `Leaky`; fires where mem > threshold:

        r    = Θ(mem - threshold), detached           (the previous step's spike)
        mem' = β mem + x - r threshold                (subtract; zero: β (1 - r) mem + x; none: β mem + x)
        s    = Θ(mem' - threshold) graded_spikes_factor,   β = clamp(beta, 0, 1)
    """
    reset = detach(_fires(mem, threshold, spike_grad))
    b = _unit(beta)
    if reset_mechanism == "subtract":
        new = b * mem + x - reset * threshold
    elif reset_mechanism == "zero":
        new = b * ((1.0 - reset) * mem) + x
    else:
        new = b * mem + x
    return _fire(new, reset, threshold, graded_spikes_factor, spike_grad, reset_mechanism, reset_delay)


@neuron(states=("syn", "mem"), learnable=("alpha", "beta", "threshold", "graded_spikes_factor"))
def snntorch_synaptic(x, syn, mem, alpha=0.9, beta=0.8, threshold=1.0, graded_spikes_factor=1.0,
                      reset_mechanism="subtract", reset_delay=True, spike_grad=flexgen_surrogate.ATan()):
    """snnTorch's `Synaptic` (current-based LIF); fires where mem > threshold:

        r    = Θ(mem - threshold), detached
        syn' = α syn + x
        mem' = β mem + syn' - r threshold             (subtract; zero: (β mem + syn')(1 - r); none: β mem + syn')
        s    = Θ(mem' - threshold) graded_spikes_factor,   α, β clamped to [0, 1]
    """
    reset = detach(_fires(mem, threshold, spike_grad))
    syn_new = _unit(alpha) * syn + x
    new = _reset_after_input(_unit(beta) * mem + syn_new, reset, threshold, reset_mechanism)
    spikes, new = _fire(new, reset, threshold, graded_spikes_factor, spike_grad, reset_mechanism, reset_delay)
    return spikes, syn_new, new


@neuron(states=("mem",), learnable=("beta", "threshold", "graded_spikes_factor"))
def snntorch_rleaky(x, mem, beta=0.9, threshold=1.0, graded_spikes_factor=1.0, reset_mechanism="subtract",
                    reset_delay=True, spike_grad=flexgen_surrogate.ATan()):
    """snnTorch's `RLeaky` neuron, `x` being its whole input (the input plus the recurrent current); fires where
    mem > threshold. `snntorch_leaky` but for the zero reset, which RLeaky applies after adding the input:

        r    = Θ(mem - threshold), detached
        mem' = β mem + x - r threshold                (subtract; zero: (β mem + x)(1 - r); none: β mem + x)
        s    = Θ(mem' - threshold) graded_spikes_factor,   β = clamp(beta, 0, 1)
    """
    reset = detach(_fires(mem, threshold, spike_grad))
    new = _reset_after_input(_unit(beta) * mem + x, reset, threshold, reset_mechanism)
    return _fire(new, reset, threshold, graded_spikes_factor, spike_grad, reset_mechanism, reset_delay)


@neuron(states=("syn_exc", "syn_inh", "mem"), learnable=("alpha", "beta", "threshold", "graded_spikes_factor"))
def snntorch_alpha(x, syn_exc, syn_inh, mem, alpha=0.9, beta=0.8, threshold=1.0, graded_spikes_factor=1.0,
                   reset_mechanism="zero", spike_grad=flexgen_surrogate.ATan()):
    """snnTorch's `Alpha` (excitatory and inhibitory synaptic currents); fires where mem > threshold:

        r     = Θ(mem - threshold), detached
        e'    = α e + x,   i' = β i - x,   τ = log α / (log β - log α) + 1
        mem'  = τ (e' + i')
        zero reset:      e', i', mem' each times (1 - r)
        subtract reset:  e' - r threshold,  i' (1 - r),  mem' + r i
        s     = Θ(mem' - threshold) graded_spikes_factor,   α, β clamped to [0, 1]
    """
    reset = detach(_fires(mem, threshold, spike_grad))
    a, b = _unit(alpha), _unit(beta)
    exc = a * syn_exc + x
    inh = b * syn_inh - x
    # The logs take the rates clamped above only: below 0 snnTorch's log(0) is -inf, a degenerate neuron either way.
    log_a, log_b = log(minimum(alpha, 1.0)), log(minimum(beta, 1.0))
    new = (log_a / (log_b - log_a) + 1.0) * (exc + inh)
    if reset_mechanism == "subtract":
        exc, inh, new = exc - threshold * reset, inh - inh * reset, new + syn_inh * reset
    elif reset_mechanism == "zero":
        exc, inh, new = exc - exc * reset, inh - inh * reset, new - new * reset
    return _fires(new, threshold, spike_grad) * graded_spikes_factor, exc, inh, new


@neuron(states=("mem",), learnable=("R", "C", "time_step", "threshold", "graded_spikes_factor"))
def snntorch_lapicque(x, mem, R=1.0, C=1.0, time_step=1.0, threshold=1.0, graded_spikes_factor=1.0,
                      reset_mechanism="subtract", spike_grad=flexgen_surrogate.ATan()):
    """snnTorch's `Lapicque` (an RC circuit, one Euler step of `time_step`); fires where mem > threshold:

        r    = Θ(mem - threshold), detached
        mem' = x R time_step / (R C) + (1 - time_step / (R C)) mem - r threshold    (zero: times (1 - r))
        s    = Θ(mem' - threshold) graded_spikes_factor
    """
    reset = detach(_fires(mem, threshold, spike_grad))
    new = x * R * (1.0 / (R * C)) * time_step + (1.0 - time_step / (R * C)) * mem
    if reset_mechanism == "subtract":
        new = new - reset * threshold
    elif reset_mechanism == "zero":
        new = new - reset * new
    return _fires(new, threshold, spike_grad) * graded_spikes_factor, new


RESET_MECHANISMS = ("subtract", "zero", "none")  # snnTorch's reset_mechanism_val indexes this


def owns(module):
    return defined_in(module, "snntorch")


def is_neuron(module):
    return derives_from(module, "snntorch._neurons")


def _layer_class(module):
    """The `SnnTorchLayer` subclass standing in for `module`'s class (exactly: a subclass may change the update)."""
    package = sys.modules.get("snntorch")
    for cls in LAYERS:
        if package is not None and type(module) is getattr(package, cls.peer, None):
            return cls
    return None


def replacement(module, backend):
    layer_class = _layer_class(module)
    if layer_class is None:
        raise Unsupported(
            f"{class_path(module)} has no flexgen equivalent (supported: {', '.join(c.peer for c in LAYERS)}); "
            "write its step as a @flexgen.neuron"
        )
    _check_options(module)
    layer_class.check(module)
    static = {"reset_mechanism": module.reset_mechanism, "reset_delay": bool(getattr(module, "reset_delay", True))}
    static = {k: v for k, v in static.items() if k in layer_class.spec.signature.static}
    spike_grad = _surrogate(module.spike_grad, getattr(module, "surrogate_disable", False))
    return finish(layer_class(module, backend=backend, spike_grad=spike_grad, **static), module)


def _check_options(module):
    for option in ("inhibition", "state_quant"):
        if getattr(module, option, False):
            raise Unsupported(f"snnTorch's {option} option is not supported")
    if module.reset_mechanism not in RESET_MECHANISMS:
        raise Unsupported(f"unknown snnTorch reset_mechanism {module.reset_mechanism!r}")


def _surrogate(fn, disabled):
    """flexgen's surrogate for snnTorch's `surrogate.atan(alpha)`, `sigmoid(slope)` and `fast_sigmoid(slope)`."""
    if disabled:
        raise Unsupported("surrogate_disable=True (spikes without a gradient) is not supported")
    makers = {
        "atan": lambda a: flexgen_surrogate.ATan(alpha=a),
        "sigmoid": lambda slope: flexgen_surrogate.Sigmoid(alpha=slope),
        "fast_sigmoid": lambda slope: flexgen_surrogate.FastSigmoid(slope=slope),
    }
    maker = makers.get(getattr(fn, "__qualname__", "").split(".<locals>.")[0])
    cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
    numbers = [c for c in cells if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if maker is not None and getattr(fn, "__module__", "") == "snntorch.surrogate" and len(numbers) == 1:
        return maker(numbers[0])
    raise Unsupported(
        f"snnTorch spike_grad {fn!r} has no flexgen equivalent; use snntorch.surrogate.atan(alpha), "
        "sigmoid(slope) or fast_sigmoid(slope)"
    )


class SnnTorchLayer(NeuronModule):
    """A flexgen layer standing in for an snnTorch neuron (made by `flexgen.convert`).

    Called like the module it replaces: with `init_hidden=False` (snnTorch's
    default) `spk, mem = layer(x, mem)` (`spk, syn, mem` for Synaptic, `spk,
    syn_exc, syn_inh, mem` for Alpha), states optional and made by `init_leaky()`
    etc.; with `init_hidden=True` `spk = layer(x)`, or `spk, mem` with
    `output=True`. As in snnTorch, a state whose shape is not the input's starts
    at zero. It holds the snnTorch module's own parameters and buffers, so
    checkpoints load both ways with `strict=True`; `reset_hidden()` and
    `detach_hidden()` act on this layer (snnTorch's `utils.reset` does not see
    it: use `layer.reset_hidden()` or `flexgen.reset(model)`).
    """

    peer = spec = None  # set by each subclass: the snnTorch class's name and its spec
    kept = ()  # tensors of the snnTorch module its update does not read, kept for its state_dict

    def __init__(self, module, backend="auto", **static):
        super().__init__(self.spec, step_mode="s", backend=backend, **static)
        self._state_names = self.spec.signature.states
        self.init_hidden, self.output = bool(module.init_hidden), bool(module.output)
        for name in (*self.spec.signature.learnable, *self.kept):
            adopt(self, name, getattr(module, name))
        adopt(self, "reset_mechanism_val", module.reset_mechanism_val)
        self.register_load_state_dict_pre_hook(_check_reset_mechanism)

    @property
    def reset_mechanism(self):
        return self.static["reset_mechanism"]

    def extra_repr(self):
        return f"snntorch.{self.peer}, init_hidden={self.init_hidden}, output={self.output}, " + super().extra_repr()

    @classmethod
    def check(cls, module):
        """Raise `Unsupported` for an option of `module` this layer cannot follow (a subclass adds its own)."""

    def forward(self, input_, *states, **named_states):
        given = self._bind(states, named_states)
        if self.init_hidden and any(s is not None for s in given):
            raise TypeError(
                f"states ({', '.join(self._state_names)}) are not passed while init_hidden=True: the layer keeps them"
            )
        spk = self._step(input_, given)
        if self.init_hidden and not self.output:
            return spk
        return (spk, *(self._states[n] for n in self.spec.signature.states))

    def _step(self, input_, given):
        """One step of the neuron from the given states (None: the layer's own), its spike returned."""
        names = self.spec.signature.states
        current = [g if g is not None else self._states.get(n) for g, n in zip(given, names)]
        if all(s is None or s.shape != input_.shape for s in current):
            self.reset()
        else:
            fresh = [s if s is not None and s.shape == input_.shape else torch.zeros_like(input_) for s in current]
            object.__setattr__(self, "_states", dict(zip(names, fresh)))
        return NeuronModule.forward(self, input_)

    def _bind(self, states, named):
        names = self._state_names
        if len(states) > len(names):
            raise TypeError(f"snnTorch {self.peer} takes the input and at most {len(names)} state(s) {names}")
        given = dict(zip(names, states))
        for name, value in named.items():
            if name not in names or name in given:
                raise TypeError(f"snnTorch {self.peer} got an unexpected or repeated state argument {name!r}")
            given[name] = value
        return [given.get(n) for n in names]

    def _learnable_values(self, inputs):
        """The snnTorch tensors as the kernels take them: floating (Lapicque's R and time_step may be integer
        buffers) and, for a 1-d tensor, broadcast against the step's last dim, as torch (and snnTorch) would."""
        step_dims = inputs[0].dim() - 1
        values = []
        for value in super()._learnable_values(inputs):
            if not value.is_floating_point():
                value = value.to(inputs[0].dtype)
            if value.dim() == 1 and value.numel() > 1 and step_dims > 2:
                value = value.reshape([1] * (step_dims - 1) + [-1])
            values.append(value)
        return values

    def reset_mem(self):
        """snnTorch's `init_leaky()` / `init_synaptic()` / ... / `reset_mem()`: states set to zero (the shape of
        the last step, or empty before the first call, which the next call replaces by zeros of its input's
        shape); returns them."""
        like = next(iter(self.parameters()), None)
        if like is None:
            like = next(iter(self.buffers()))
        zeros = {n: torch.zeros_like(self._states[n]) if n in self._states else like.new_zeros(0)
                 for n in self._state_names}
        object.__setattr__(self, "_states", zeros)
        values = tuple(zeros[n] for n in self._state_names)
        return values[0] if len(values) == 1 else values

    def reset_hidden(self):
        """snnTorch's `reset_hidden()` for this layer: the next call starts from zero states."""
        self.reset()

    def detach_hidden(self):
        """snnTorch's `detach_hidden()` for this layer: the states stay, cut from the autograd graph."""
        object.__setattr__(self, "_states", {k: v.detach() for k, v in self._states.items()})


class SnnTorchLeaky(SnnTorchLayer):
    """snnTorch's `Leaky` (see `SnnTorchLayer`)."""

    peer, spec = "Leaky", snntorch_leaky
    init_leaky = SnnTorchLayer.reset_mem


class SnnTorchSynaptic(SnnTorchLayer):
    """snnTorch's `Synaptic` (see `SnnTorchLayer`)."""

    peer, spec = "Synaptic", snntorch_synaptic
    init_synaptic = SnnTorchLayer.reset_mem


class SnnTorchAlpha(SnnTorchLayer):
    """snnTorch's `Alpha` (see `SnnTorchLayer`)."""

    peer, spec = "Alpha", snntorch_alpha
    init_alpha = SnnTorchLayer.reset_mem


class SnnTorchLapicque(SnnTorchLayer):
    """snnTorch's `Lapicque` (see `SnnTorchLayer`); its beta (not read by the update) is kept for the state_dict."""

    peer, spec, kept = "Lapicque", snntorch_lapicque, ("beta",)
    init_lapicque = SnnTorchLayer.reset_mem


class SnnTorchRecurrentLayer(SnnTorchLayer):
    """A flexgen layer standing in for snnTorch's `RLeaky` or `RSynaptic` (made by `flexgen.convert`).

    Called like the module it replaces: `spk, mem = layer(x, spk, mem)` (`spk, syn, mem` for RSynaptic), states
    made by `init_rleaky()` / `init_rsynaptic()` / `reset_mem()`, or `init_hidden=True` as `SnnTorchLayer`. Each
    step adds the recurrent current, snnTorch's `recurrent` module applied to the previous spikes
    (`all_to_all=True`: its `nn.Linear` or `nn.Conv2d`) or `V * spk` (`all_to_all=False`), to the input, then
    runs the neuron's flexgen kernels for that step. snnTorch steps one call at a time, so nothing is fused
    across steps; `flexgen.Recurrent` runs a whole sequence in fused kernels (docs/recurrent.md).
    The previous spikes are a state (`layer.spk`) like the neuron's own; `recurrent` is the snnTorch module's
    own submodule, so its weights, `V` and the `state_dict()` keys are the same.
    """

    def __init__(self, module, backend="auto", **static):
        super().__init__(module, backend=backend, **static)
        self._state_names = ("spk", *self.spec.signature.states)
        self.all_to_all = bool(module.all_to_all)
        self.recurrent = module.recurrent
        if not self.all_to_all:
            adopt(self, "V", module.V)

    @property
    def spk(self):
        """The spikes of the last step (0.0 before the first, as the neuron's states)."""
        return self._states.get("spk", 0.0)

    def extra_repr(self):
        return f"all_to_all={self.all_to_all}, " + super().extra_repr()

    def recurrent_current(self, spk):
        """What the previous step's spikes add to this step's input."""
        if self.all_to_all:
            return self.recurrent(spk)
        return spk * self.V  # not snnTorch's `recurrent` module: its V may be a tensor .to() did not move

    def _step(self, input_, given):
        previous = given[0] if given[0] is not None else self._states.get("spk")
        if previous is None or previous.shape != input_.shape:
            previous = torch.zeros_like(input_)
        spk = super()._step(input_ + self.recurrent_current(previous), given[1:])
        object.__setattr__(self, "_states", {"spk": spk, **self._states})
        return spk


class SnnTorchRLeaky(SnnTorchRecurrentLayer):
    """snnTorch's `RLeaky` (see `SnnTorchRecurrentLayer`)."""

    peer, spec = "RLeaky", snntorch_rleaky
    init_rleaky = SnnTorchLayer.reset_mem


class SnnTorchRSynaptic(SnnTorchRecurrentLayer):
    """snnTorch's `RSynaptic` (see `SnnTorchRecurrentLayer`): snnTorch's `Synaptic` neuron with the recurrent
    current added to its input."""

    peer, spec = "RSynaptic", snntorch_synaptic
    init_rsynaptic = SnnTorchLayer.reset_mem

    @classmethod
    def check(cls, module):
        if not getattr(module, "reset_delay", True):
            raise Unsupported(
                "snnTorch's RSynaptic with reset_delay=False is not converted: its forward computes the early "
                "reset into a local variable and drops it (or fails on the states' shapes), so there is no "
                "behaviour to follow; use reset_delay=True"
            )


LAYERS = (SnnTorchLeaky, SnnTorchSynaptic, SnnTorchAlpha, SnnTorchLapicque, SnnTorchRLeaky, SnnTorchRSynaptic)


def _check_reset_mechanism(layer, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                           error_msgs):
    """A checkpoint's reset_mechanism_val must be the layer's: the reset is built into its kernels."""
    value = state_dict.get(prefix + "reset_mechanism_val")
    if value is None or int(value) == RESET_MECHANISMS.index(layer.reset_mechanism):
        return
    got = RESET_MECHANISMS[int(value)] if 0 <= int(value) < len(RESET_MECHANISMS) else int(value)
    error_msgs.append(
        f"{prefix}reset_mechanism_val: the checkpoint's snnTorch reset_mechanism is {got!r}, this converted layer's "
        f"is {layer.reset_mechanism!r} (fixed when it was converted: convert a module built with {got!r})"
    )
