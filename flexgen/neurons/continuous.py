"""Published neuron models as differential equations (`flexgen.ode`): flexgen derives each step.

Each is an equations function returning `flexgen.Dynamics`; `dt` is a
hyper-parameter like the others (`lif(dt=0.1)`), the method is fixed per model
(exact where the equations are linear; the exponential and quadratic models by
the explicit method of their papers or of the zoo: `equations()` shows the
derivation). Registered as `OdeLIF`, `OdeCubaLIF`, `OdeALIF`, `OdeAdEx`,
`OdeIzhikevich`, `OdeQIF`, `OdeEIF` in `flexgen.neurons` (the zoo's
hand-discretised `LIF`, `ALIF`, `AdEx`, ... stay as they are).
"""
from ..frontend.functions import exp
from ..layers.ode_spec import Dynamics, ode


@ode(states=("v",), method="exact", init={"v": "v_reset"})
def lif(x, v, tau=2.0, r=1.0, v_rest=0.0, v_th=1.0, v_reset=0.0):
    """Leaky integrate-and-fire, integrated exactly over each step (input held constant):

        tau dv/dt = -(v - v_rest) + r x,   fires where v >= v_th, then v <- v_reset

    With v_rest = v_reset and r = 1 it is SpikingJelly's LIF (`flexgen.LIF`) with
    tau_sj = 1 / (1 - exp(-dt / tau)).

    Fires where `v >= v_th` (the comparison is inclusive), then resets.

    >>> import torch
    >>> lif(tau=2.0, backend="eager")(torch.full((4, 1), 1.5)).flatten().tolist()
    [0.0, 0.0, 1.0, 0.0]
    """
    return Dynamics({"v": (v_rest - v + r * x) / tau}, threshold=v >= v_th, reset={"v": v_reset})


@ode(states=("i", "v"), method="exact", init={"v": "v_reset"})
def cuba_lif(x, i, v, tau_syn=5.0, tau_mem=10.0, w_in=1.0, r=1.0, v_leak=0.0, v_th=1.0, v_reset=0.0):
    """Current-based LIF (NIR's CubaLIF), a synaptic current i feeding the membrane, solved exactly
    (the coupled linear system through its matrix exponential; needs tau_syn != tau_mem):

        tau_syn di/dt = -i + w_in x
        tau_mem dv/dt = (v_leak - v) + r i,   fires where v >= v_th, then v <- v_reset

    Fires where `v >= v_th` (the comparison is inclusive), then resets.

    >>> import torch
    >>> int(cuba_lif(backend="eager")(torch.full((30, 1), 2.0)).sum().item()) > 0
    True
    """
    return Dynamics(
        {"i": (w_in * x - i) / tau_syn, "v": (v_leak - v + r * i) / tau_mem},
        threshold=v >= v_th, reset={"v": v_reset},
    )


@ode(states=("v", "a"), method="exact")
def alif(x, v, a, tau=20.0, tau_a=200.0, v_th=1.0, beta=1.8):
    """Adaptive-threshold LIF (Bellec et al., NeurIPS 2018) in continuous time: every spike raises the
    adaptation a by 1/tau_a, which decays with tau_a (the zoo's ALIF raises it by 1 - exp(-dt/tau_a)):

        tau dv/dt = -v + x,   tau_a da/dt = -a
        fires where v >= v_th + beta a, then v <- v - (v_th + beta a), a <- a + 1/tau_a

    Fires where `v >= threshold` (the comparison is inclusive), then resets.

    >>> import torch
    >>> alif(tau=2.0, tau_a=5.0, backend="eager")(torch.full((3, 1), 3.0)).flatten().tolist()
    [1.0, 0.0, 1.0]
    """
    threshold = v_th + beta * a
    return Dynamics(
        {"v": (x - v) / tau, "a": -a / tau_a},
        threshold=v >= threshold, reset={"v": v - threshold, "a": a + 1.0 / tau_a},
    )


@ode(states=("v", "w"), method="euler", dt=0.1, init={"v": "e_l"})
def adex(x, v, w, c_m=0.281, g_l=0.030, e_l=-70.6, v_t=-50.4, delta_t=2.0, tau_w=144.0, a=0.004, b=0.0805,
         v_reset=-70.6, v_peak=20.0):
    """Adaptive exponential integrate-and-fire (Brette & Gerstner, J. Neurophysiol. 2005, their Fig. 2
    parameters: mV, ms, nF, µS, nA; x is the input current in nA), by explicit Euler at dt = 0.1 ms:

        c_m dv/dt = -g_l (v - e_l) + g_l delta_t exp((v - v_t) / delta_t) - w + x
        tau_w dw/dt = a (v - e_l) - w
        fires where v >= v_peak, then v <- v_reset, w <- w + b

    Fires where `v >= v_peak` (the comparison is inclusive), then resets.

    >>> import torch
    >>> int(adex(backend="eager")(torch.full((400, 1), 1.0)).sum().item()) > 0
    True
    """
    return Dynamics(
        {"v": (-g_l * (v - e_l) + g_l * delta_t * exp((v - v_t) / delta_t) - w + x) / c_m,
         "w": (a * (v - e_l) - w) / tau_w},
        threshold=v >= v_peak, reset={"v": v_reset, "w": w + b})


@ode(states=("v", "u"), method="euler", dt=0.5, init={"v": "c", "u": -13.0})
def izhikevich(x, v, u, a=0.02, b=0.2, c=-65.0, d=8.0, v_peak=30.0):
    """Izhikevich, "Simple model of spiking neurons" (IEEE TNN 2003), v in mV, time in ms, by explicit
    Euler as in the paper:

        dv/dt = 0.04 v^2 + 5 v + 140 - u + x,   du/dt = a (b v - u)
        fires where v >= v_peak, then v <- c, u <- u + d

    Fires where `v >= v_peak` (the comparison is inclusive), then resets.

    >>> import torch
    >>> int(izhikevich(backend="eager")(torch.full((100, 1), 10.0)).sum().item()) > 0
    True
    """
    return Dynamics(
        {"v": 0.04 * v * v + 5.0 * v + 140.0 - u + x, "u": a * (b * v - u)},
        threshold=v >= v_peak, reset={"v": c, "u": u + d},
    )


@ode(states=("v",), method="rk4", init={"v": "v_reset"})
def qif(x, v, tau=2.0, v_c=0.8, a0=1.0, v_rest=0.0, v_th=1.0, v_reset=-0.1):
    """Quadratic integrate-and-fire (Latham et al. 2000; SpikingJelly's QIFNode parameters), by RK4:

        tau dv/dt = a0 (v - v_rest)(v - v_c) + x,   fires where v >= v_th, then v <- v_reset

    Fires where `v >= v_th` (the comparison is inclusive), then resets.

    >>> import torch
    >>> qif(backend="eager")(torch.full((3, 1), 1.5)).flatten().tolist()
    [0.0, 1.0, 0.0]
    """
    return Dynamics({"v": (a0 * (v - v_rest) * (v - v_c) + x) / tau}, threshold=v >= v_th, reset={"v": v_reset})


@ode(states=("v",), method="euler", init={"v": "v_reset"})
def eif(x, v, tau=2.0, delta_t=1.0, theta_rh=0.8, v_rest=0.0, v_th=1.0, v_reset=-0.1):
    """Exponential integrate-and-fire (Fourcaud-Trocmé et al. 2003; SpikingJelly's EIFNode parameters),
    by explicit Euler:

        tau dv/dt = v_rest - v + delta_t exp((v - theta_rh) / delta_t) + x
        fires where v >= v_th, then v <- v_reset

    Fires where `v >= v_th` (the comparison is inclusive), then resets.

    >>> import torch
    >>> eif(backend="eager")(torch.full((3, 1), 1.5)).flatten().tolist()
    [0.0, 1.0, 0.0]
    """
    return Dynamics({"v": (v_rest - v + delta_t * exp((v - theta_rh) / delta_t) + x) / tau}, threshold=v >= v_th,
                    reset={"v": v_reset})


BUNDLED = {
    "OdeLIF": lif,
    "OdeCubaLIF": cuba_lif,
    "OdeALIF": alif,
    "OdeAdEx": adex,
    "OdeIzhikevich": izhikevich,
    "OdeQIF": qif,
    "OdeEIF": eif,
}
