"""Neurons the tests run through every backend (the core issue's list, plus a learnable one)."""
import flexgen
from flexgen import spike


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = spike(h - v_th)
    return s, h * (1.0 - s)


@flexgen.neuron(states=("v", "a"))
def adaptive_mix(x, y, v, a, tau=2.0, v_th=1.0, beta=0.5, tau_a=4.0):
    """Two inputs, two outputs, two states: adaptive threshold, sigmoid(y) mixes hard and soft reset."""
    h = v + (x - v) / tau
    theta = v_th + beta * a
    s = spike(h - theta, surrogate=flexgen.surrogate.ATan())
    m = flexgen.sigmoid(y)
    v_next = m * h * (1.0 - s) + (1.0 - m) * (h - s * theta)
    a_next = a + (s - a) / tau_a
    return s, h, v_next, a_next


@flexgen.neuron(states=("v",))
def exp_quadratic(x, v, dt=0.5, v_th=1.0, delta=0.5):
    """Exponential and quadratic terms (EIF-like with a quadratic leak), detached reset."""
    dv = -v + 0.3 * v * v + delta * flexgen.exp((v - v_th) / delta) + x
    h = v + dt * dv
    s = spike(h - v_th)
    return s, h - flexgen.detach(s) * h


@flexgen.neuron(states=("v",), learnable=("w",))
def plif(x, v, w=-0.5, v_th=1.0):
    h = v + (x - v) * flexgen.sigmoid(w)
    s = spike(h - v_th)
    return s, h * (1.0 - s)


@flexgen.neuron()
def spiking_gate(x, k=0.5):
    """No state: a spiking activation, the input where it crosses k."""
    return spike(x - k) * x


ALL = {"lif": lif, "adaptive_mix": adaptive_mix, "exp_quadratic": exp_quadratic, "plif": plif,
       "spiking_gate": spiking_gate}


@flexgen.neuron(states=("v", "u"), learnable=("k",))
def smooth(x, y, v, u, k=0.7, a=0.3):
    """No spikes: every derivative is a true derivative, so gradcheck applies."""
    z = flexgen.tanh(v * k) + flexgen.sqrt(1.0 + x * x) - flexgen.log(1.0 + flexgen.sigmoid(y))
    r = flexgen.where(z > 10.0, z, flexgen.exp(-a * z * z)) * u + 0.5 * z ** 3
    return r, z, v + 0.1 * r, u - 0.2 * flexgen.abs(u - y) * flexgen.minimum(z, 5.0)


@flexgen.neuron(states=("v", "r"))
def refractory(x, v, r, tau=2.0, v_th=1.0):
    """A LIF held at rest for the step after each spike: its flag `r`, the last step's spike, is a state the backward
    reads (0 or 1 after the first step: kept in bytes)."""
    h = (v + (x - v) / tau) * (1.0 - flexgen.detach(r))
    s = spike(h - v_th)
    return s, h * (1.0 - s), s


@flexgen.neuron(states=("v",))
def gated_sum(x, v, v_th=1.0):
    """Its backward reads a detached spike of the input that no output is: kept in bytes, not re-read from x."""
    g = flexgen.detach(spike(x - v_th))
    return v * g, v + x
