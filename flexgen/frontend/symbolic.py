"""sympy function classes for the operations sympy has no node for.

They print as single calls (see `flexgen.printing`) and carry their own
derivatives, which is all `flexgen.derive.derivation` needs from them.
"""
import hashlib

import sympy


class sigmoid(sympy.Function):
    """Logistic function 1 / (1 + exp(-z)), kept whole so it prints as one call."""

    @classmethod
    def eval(cls, z):
        if z.is_Number:
            return 1 / (1 + sympy.exp(-z))

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0]) * (1 - sigmoid(self.args[0]))


class detach(sympy.Function):
    """Identity in the forward pass, zero derivative."""

    @classmethod
    def eval(cls, z):
        if z.is_Number:
            return z

    def fdiff(self, argindex=1):
        return sympy.S.Zero


class SpikeBase(sympy.Function):
    """Heaviside step Θ(z) (1 where z >= 0) whose derivative is a surrogate.

    Each surrogate gets its own subclass (see `spike_class`), so two spikes
    with different surrogates are different sympy functions. A surrogate with
    a learnable alpha makes it a function of two arguments, `spike(z, alpha)`:
    the value ignores alpha; the derivatives are the surrogate's dg/dz and
    dg/dalpha of its primitive g.
    """

    surrogate = None

    @classmethod
    def eval(cls, z, alpha=None):
        if z.is_Number:
            return sympy.S.One if z >= 0 else sympy.S.Zero

    def _surrogate(self):
        return self.surrogate.with_alpha(self.args[1]) if len(self.args) == 2 else self.surrogate

    def fdiff(self, argindex=1):
        if argindex == 2:
            return self._surrogate().alpha_derivative(self.args[0])
        return self._surrogate().derivative(self.args[0])


_spike_classes = {}


def _is_default(surrogate):
    try:
        return type(surrogate)() == surrogate
    except TypeError:  # a surrogate without defaults (Custom)
        return False


def spike_class_name(surrogate):
    """`spike_<name>` for a surrogate with default parameters, else `spike_<name>_<hash of its key>`.

    The name is printed into the traced program (and so the cache key), so it
    depends on the surrogate's key alone, never on the order classes were made.

    >>> from flexgen.surrogate import ATan
    >>> spike_class_name(ATan()), spike_class_name(ATan(alpha=3.0)) != "spike_atan"
    ('spike_atan', True)
    """
    name = "spike_" + surrogate.name
    if _is_default(surrogate):
        return name
    return f"{name}_{hashlib.sha256(surrogate.key().encode()).hexdigest()[:8]}"


def spike_class(surrogate):
    """The sympy function class of a spike with this surrogate (one per surrogate key)."""
    key = surrogate.key()
    if key not in _spike_classes:
        _spike_classes[key] = type(spike_class_name(surrogate), (SpikeBase,), {"surrogate": surrogate})
    return _spike_classes[key]
