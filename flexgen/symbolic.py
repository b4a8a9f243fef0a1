"""sympy function classes for the operations sympy has no node for.

They print as single calls (see `flexgen.printing`) and carry their own
derivatives, which is all `flexgen.derive` needs from them.
"""
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
    with different surrogates are different sympy functions.
    """

    surrogate = None

    @classmethod
    def eval(cls, z):
        if z.is_Number:
            return sympy.S.One if z >= 0 else sympy.S.Zero

    def fdiff(self, argindex=1):
        return self.surrogate.derivative(self.args[0])


_spike_classes = {}


def spike_class(surrogate):
    """The sympy function class of a spike with this surrogate (one per surrogate key)."""
    key = surrogate.key()
    if key not in _spike_classes:
        name = "spike_" + surrogate.name
        _spike_classes[key] = type(name, (SpikeBase,), {"surrogate": surrogate})
    return _spike_classes[key]
