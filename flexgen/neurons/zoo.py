"""A zoo of published neuron models, each a plain `@flexgen.neuron` step function.

All are discretised with one explicit Euler step per time step and fire with
`flexgen.spike` (Θ(z) = 1 for z >= 0) using the `surrogate` option, which,
like every bool/None/surrogate default, is a specialisation: each choice gets
its own kernels. Each docstring says where its neuron fires: on reaching the
threshold (>=), except `synaptic`, which fires above it (>) as snnTorch does.
Call a spec to get a layer, e.g. `izhikevich(dt=0.25)`.
"""
from ..frontend.functions import clamp, detach, exp, sigmoid, spike
from ..layers.spec import neuron
from ..frontend.surrogate import ATan, Sigmoid


@neuron(states=("v", "a"))
def alif(x, v, a, tau=20.0, tau_a=200.0, v_threshold=1.0, beta=1.8, dt=1.0, surrogate=Sigmoid()):
    """Adaptive-threshold LIF (Bellec et al., "Long short-term memory and learning-to-learn in networks
    of spiking neurons", NeurIPS 2018), with alpha = exp(-dt/tau), rho = exp(-dt/tau_a):

        h  = alpha v + (1 - alpha) x
        A  = v_threshold + beta a                 (threshold grows with the adaptation a)
        s  = Θ(h - A)
        v' = h - s A                              (reset by subtracting the threshold)
        a' = rho a + (1 - rho) s

    Fires where h >= A.

    >>> import torch
    >>> layer = alif(tau=2.0, tau_a=5.0, backend="eager")
    >>> layer(torch.full((3, 1), 3.0)).flatten().tolist()
    [1.0, 0.0, 1.0]
    """
    alpha = exp(-dt / tau)
    rho = exp(-dt / tau_a)
    h = alpha * v + (1.0 - alpha) * x
    threshold = v_threshold + beta * a
    s = spike(h - threshold, surrogate)
    return s, h - s * threshold, rho * a + (1.0 - rho) * s


@neuron(states=("syn", "mem"))
def synaptic(x, syn, mem, alpha=0.9, beta=0.8, threshold=1.0, surrogate=ATan()):
    """Current-based synaptic LIF (snnTorch's `Synaptic`, reset by subtraction, atan surrogate, alpha and beta
    clamped to [0, 1] as snnTorch does):

        r    = 1 - Θ(threshold - mem), detached   (the reset uses the previous step's spike)
        syn' = alpha syn + x
        mem' = beta mem + syn' - r threshold
        s    = 1 - Θ(threshold - mem')

    Fires where mem' > threshold (strictly, as snnTorch: on the threshold 1 - Θ(0) = 0).

    >>> import torch
    >>> layer = synaptic(backend="eager")
    >>> layer(torch.full((3, 1), 0.6)).flatten().tolist()
    [0.0, 1.0, 1.0]
    """
    reset = detach(_fires_above(mem, threshold, surrogate))
    syn_new = clamp(alpha, 0.0, 1.0) * syn + x
    mem_new = clamp(beta, 0.0, 1.0) * mem + syn_new - reset * threshold
    return _fires_above(mem_new, threshold, surrogate), syn_new, mem_new


def _fires_above(mem, threshold, surrogate):
    """[mem > threshold]: the complement of spike(threshold - mem), with the same gradient (symmetric surrogate)."""
    return 1.0 - spike(threshold - mem, surrogate)


@neuron(states=("v", "u"), init={"v": "c", "u": -13.0})
def izhikevich(x, v, u, a=0.02, b=0.2, c=-65.0, d=8.0, v_peak=30.0, dt=0.5, surrogate=Sigmoid()):
    """Izhikevich, "Simple model of spiking neurons" (IEEE TNN 2003); v in mV, dt in ms:

        h  = v + dt (0.04 v² + 5 v + 140 - u + x)
        g  = u + dt a (b v - u)
        s  = Θ(h - v_peak)
        v' = h (1 - s) + c s,   u' = g + d s

    Fires where h >= v_peak. The initial state is v = c, u = -13 (= b·c for the default b and c).

    >>> import torch
    >>> layer = izhikevich(backend="eager")
    >>> int(layer(torch.full((100, 1), 10.0)).sum().item()) > 0
    True
    """
    h = v + dt * (0.04 * v * v + 5.0 * v + 140.0 - u + x)
    g = u + dt * a * (b * v - u)
    s = spike(h - v_peak, surrogate)
    return s, h * (1.0 - s) + c * s, g + d * s


@neuron(states=("v",), init={"v": "v_reset"})
def qif(x, v, tau=2.0, v_c=0.8, a0=1.0, v_threshold=1.0, v_rest=0.0, v_reset=-0.1, surrogate=Sigmoid()):
    """Quadratic integrate-and-fire (Latham et al. 2000; SpikingJelly's QIFNode defaults):

        h  = v + (x + a0 (v - v_rest)(v - v_c)) / tau
        s  = Θ(h - v_threshold)
        v' = h (1 - s) + v_reset s

    Fires where h >= v_threshold.

    >>> import torch
    >>> qif(backend="eager")(torch.full((3, 1), 1.5)).flatten().tolist()
    [0.0, 1.0, 0.0]
    """
    h = v + (x + a0 * (v - v_rest) * (v - v_c)) / tau
    s = spike(h - v_threshold, surrogate)
    return s, h * (1.0 - s) + v_reset * s


@neuron(states=("v",), init={"v": "v_reset"})
def eif(x, v, tau=2.0, delta_t=1.0, theta_rh=0.8, v_threshold=1.0, v_rest=0.0, v_reset=-0.1, surrogate=Sigmoid()):
    """Exponential integrate-and-fire (Fourcaud-Trocmé et al. 2003; SpikingJelly's EIFNode defaults):

        h  = v + (x + v_rest - v + delta_t exp((v - theta_rh) / delta_t)) / tau
        s  = Θ(h - v_threshold)
        v' = h (1 - s) + v_reset s

    Fires where h >= v_threshold.

    >>> import torch
    >>> eif(backend="eager")(torch.full((3, 1), 1.5)).flatten().tolist()
    [0.0, 1.0, 0.0]
    """
    h = v + (x + v_rest - v + delta_t * exp((v - theta_rh) / delta_t)) / tau
    s = spike(h - v_threshold, surrogate)
    return s, h * (1.0 - s) + v_reset * s


@neuron(states=("v", "w"), init={"v": "e_l"})
def adex(x, v, w, c_m=0.281, g_l=0.030, e_l=-70.6, v_t=-50.4, delta_t=2.0, tau_w=144.0, a=0.004, b=0.0805,
         v_reset=-70.6, v_peak=20.0, dt=0.1, surrogate=Sigmoid()):
    """Adaptive exponential integrate-and-fire (Brette & Gerstner, J. Neurophysiol. 2005; their
    parameters in mV, ms, nF, µS, nA; x is the input current in nA):

        h  = v + dt (-g_l (v - e_l) + g_l delta_t exp((v - v_t) / delta_t) - w + x) / c_m
        g  = w + dt (a (v - e_l) - w) / tau_w
        s  = Θ(h - v_peak)
        v' = h (1 - s) + v_reset s,   w' = g + b s

    Fires where h >= v_peak.

    >>> import torch
    >>> layer = adex(backend="eager")
    >>> int(layer(torch.full((400, 1), 1.0)).sum().item()) > 0
    True
    """
    h = v + dt * (-g_l * (v - e_l) + g_l * delta_t * exp((v - v_t) / delta_t) - w + x) / c_m
    g = w + dt * (a * (v - e_l) - w) / tau_w
    s = spike(h - v_peak, surrogate)
    return s, h * (1.0 - s) + v_reset * s, g + b * s


@neuron(states=("u", "v"))
def resonate_and_fire(x, u, v, b=-0.1, omega=6.283185307179586, dt=0.1, v_threshold=1.0, surrogate=Sigmoid()):
    """Resonate-and-fire (Izhikevich, "Resonate-and-fire neurons", Neural Networks 2001): the
    complex state z = u + i v follows z' = (b + i omega) z + x; it fires when v crosses the
    threshold and then resets z to 0:

        p  = u + dt (b u - omega v + x)
        q  = v + dt (omega u + b v)
        s  = Θ(q - v_threshold)
        u' = p (1 - s),   v' = q (1 - s)

    Fires where q >= v_threshold.

    >>> import torch
    >>> layer = resonate_and_fire(backend="eager")
    >>> int(layer(torch.full((20, 1), 3.0)).sum().item()) > 0
    True
    """
    p = u + dt * (b * u - omega * v + x)
    q = v + dt * (omega * u + b * v)
    s = spike(q - v_threshold, surrogate)
    return s, p * (1.0 - s), q * (1.0 - s)


@neuron(states=("v", "a"))
def adaptive_mix(x, y, v, a, tau=2.0, v_th=1.0, beta=0.5, tau_a=4.0, surrogate=ATan()):
    """The FlexSN tutorial neuron: two inputs, two outputs, two states. An adaptive threshold
    theta, and the second input y mixes a hard and a soft reset through m = sigmoid(y):

        h  = v + (x - v) / tau
        theta = v_th + beta a
        s  = Θ(h - theta)
        v' = m h (1 - s) + (1 - m)(h - s theta)
        a' = a + (s - a) / tau_a
        outputs: s and h

    Fires where h >= theta.

    >>> import torch
    >>> s, h = adaptive_mix(backend="eager")(torch.full((2, 1), 3.0), torch.zeros(2, 1))
    >>> s.flatten().tolist(), h.flatten().tolist()
    ([1.0, 1.0], [1.5, 1.625])
    """
    h = v + (x - v) / tau
    theta = v_th + beta * a
    s = spike(h - theta, surrogate)
    m = sigmoid(y)
    v_next = m * h * (1.0 - s) + (1.0 - m) * (h - s * theta)
    a_next = a + (s - a) / tau_a
    return s, h, v_next, a_next
