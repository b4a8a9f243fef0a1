"""NIR's neuron nodes as flexgen equations: one `Dynamics` function per node class (its fields are the function's
parameters), the table of them both directions use, and the `OdeSpec` of each, made once per combination."""
import functools

from ...layers.ode_spec import Dynamics, ode

DEFAULT_DT = 1e-4


# --- NIR's neuron equations --------------------------------------------------------------------------

def nir_lif(x, v, tau=1.0, r=1.0, v_leak=0.0, v_threshold=1.0, v_reset=0.0):
    return Dynamics({"v": (v_leak - v + r * x) / tau}, threshold=v >= v_threshold, reset={"v": v_reset})


def nir_cuba_lif(x, i, v, tau_syn=1.0, tau_mem=2.0, r=1.0, v_leak=0.0, v_threshold=1.0, v_reset=0.0, w_in=1.0):
    return Dynamics({"i": (w_in * x - i) / tau_syn, "v": (v_leak - v + r * i) / tau_mem},
                    threshold=v >= v_threshold, reset={"v": v_reset})


def nir_if(x, v, r=1.0, v_threshold=1.0, v_reset=0.0):
    return Dynamics({"v": r * x}, threshold=v >= v_threshold, reset={"v": v_reset})


def nir_li(x, v, tau=1.0, r=1.0, v_leak=0.0):
    return Dynamics({"v": (v_leak - v + r * x) / tau}, outputs=(v,))


def nir_integrator(x, v, r=1.0):
    return Dynamics({"v": r * x}, outputs=(v,))


def nir_cuba_li(x, i, v, tau_syn=1.0, tau_mem=2.0, r=1.0, v_leak=0.0, w_in=1.0):
    return Dynamics({"i": (w_in * x - i) / tau_syn, "v": (v_leak - v + r * i) / tau_mem}, outputs=(v,))


# NIR node class name -> (equations, states); the equations' parameters are the node's fields.
NEURONS = {
    "LIF": (nir_lif, ("v",)),
    "CubaLIF": (nir_cuba_lif, ("i", "v")),
    "IF": (nir_if, ("v",)),
    "LI": (nir_li, ("v",)),
    "I": (nir_integrator, ("v",)),
    "CubaLI": (nir_cuba_li, ("i", "v")),
}


def parameter_names(kind):
    fn, states = NEURONS[kind]
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return [n for n in names if n != "x" and n not in states]


@functools.lru_cache(maxsize=None)
def node_spec(kind, learnable=(), method="euler"):
    """The `OdeSpec` of NIR's `kind` neuron with these parameters learnable (those that differ between
    channels), integrated by `method`. Made once per combination; pickled as this call."""
    fn, states = NEURONS[kind]
    spec = ode(states=states, method=method, learnable=learnable, dt=DEFAULT_DT)(fn)
    spec.rebuild = (node_spec, (kind, learnable, method))
    spec.nir_kind = kind
    return spec
