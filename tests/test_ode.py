"""flexgen.ode: each method's step against scipy's solve_ivp or the method's own formula (written here
independently of flexgen), every method on both backends against the eager oracle in float64 with
gradients, exact LIF against flexgen.LIF, refractoriness, and the errors and warnings for bad equations."""
import functools
import inspect
import math
import pickle
import warnings

import numpy
import pytest
import torch

import flexgen
from conftest import device_backends, plain_device_backends
from flexgen import Dynamics
from flexgen.neurons import continuous
from flexgen import StiffnessWarning

solve_ivp = pytest.importorskip("scipy.integrate").solve_ivp


def fp32_params(spec, **overrides):
    """Every hyper-parameter at its default (or override) rounded to float32: the Triton kernels take
    hyper-parameters as fp32 scalars, the eager oracle and the references as Python floats."""
    values = {h: spec.signature.defaults[h] for h in spec.signature.hyper}
    values.update(overrides)
    return {h: float(numpy.float32(v)) for h, v in values.items()}


def solve_steps(rhs, y0, inputs, dt):
    """The states after each step, by solve_ivp (DOP853, tolerances 1e-13) with the step's input held.

    rhs(y, x): dy/dt for y of shape [states, N] and x of shape [N]; y0: [states, N]; inputs: [T, N]."""
    shape, y, result = y0.shape, y0.reshape(-1), []
    for x in inputs:
        sol = solve_ivp(lambda t, flat: rhs(flat.reshape(shape), x).reshape(-1), (0.0, dt), y,
                        method="DOP853", rtol=1e-13, atol=1e-13)
        y = sol.y[:, -1]
        result.append(y.reshape(shape))
    return numpy.stack(result, axis=1)  # [states, T, N]


def run_states(spec, inputs, states, backend, **params):
    """The state sequences ([states, T, N] numpy) of a layer run."""
    _, seqs = spec.apply(*inputs, states=states, backend=backend, store_state_seqs=True, **params)
    return numpy.stack([s.detach().cpu().numpy() for s in seqs])


# --- exact: against solve_ivp between events -------------------------------------------------------

def lif_rhs(p):
    return lambda y, x: numpy.stack([(p["v_rest"] - y[0] + p["r"] * x) / p["tau"]])


def cuba_rhs(p):
    return lambda y, x: numpy.stack([(p["w_in"] * x - y[0]) / p["tau_syn"], (p["v_leak"] - y[1] + p["r"] * y[0]) / p["tau_mem"]])


def alif_rhs(p):
    return lambda y, x: numpy.stack([(x - y[0]) / p["tau"], -y[1] / p["tau_a"]])


EXACT = {
    "OdeLIF": (continuous.lif, lif_rhs, {"tau": 3.0, "r": 1.5, "v_rest": -0.25, "dt": 0.75}),
    "OdeCubaLIF": (continuous.cuba_lif, cuba_rhs, {"tau_syn": 2.5, "tau_mem": 6.0, "w_in": 1.25, "r": 0.75, "v_leak": 0.5, "dt": 1.5}),
    "OdeALIF": (continuous.alif, alif_rhs, {"tau": 5.0, "tau_a": 12.0, "dt": 2.0}),
}


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_step_is_the_solution_between_events(name, device, backend):
    spec, rhs, overrides = EXACT[name]
    assert spec.method == "exact"
    threshold = "v_th"
    params = fp32_params(spec, **overrides, **{threshold: 1e9})  # no spikes: the step is the integration alone
    g = torch.Generator().manual_seed(1)
    n_states = len(spec.signature.states)
    x = torch.randn(5, 6, generator=g, dtype=torch.float64) * 2
    y0 = torch.randn(n_states, 6, generator=g, dtype=torch.float64)
    got = run_states(spec, [x.to(device)], [s.to(device) for s in y0], backend, **params)
    want = solve_steps(rhs(params), y0.numpy(), x.numpy(), params["dt"])
    numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-11)


# --- exponential Euler, Euler, RK2, RK4: against the method's own formula and its order ------------

@functools.lru_cache(maxsize=None)
def fitzhugh_nagumo(method):
    """FitzHugh-Nagumo: smooth, bounded, not linear in v (v^3)."""

    def fitzhugh_nagumo(x, v, w, eps=0.125, a=0.75, b=0.75):
        return Dynamics({"v": v - v * v * v / 3.0 - w + x, "w": eps * (v + a - b * w)}, outputs=(v,))

    return flexgen.ode(states=("v", "w"), method=method)(fitzhugh_nagumo)


def fhn_rhs(p):
    return lambda y, x: numpy.stack([y[0] - y[0] ** 3 / 3 - y[1] + x, p["eps"] * (y[0] + p["a"] - p["b"] * y[1])])


@functools.lru_cache(maxsize=None)
def conductance(method, threshold=1e9):
    """A conductance-based membrane: v's equation is linear in v with a coefficient holding ge."""

    def conductance(x, v, ge, tau=8.0, tau_g=4.0, e_syn=4.0, v_th=threshold, v_reset=0.0):
        return Dynamics({"v": (-v + ge * (e_syn - v)) / tau, "ge": -ge / tau_g + x},
                        threshold=v >= v_th, reset={"v": v_reset})

    return flexgen.ode(states=("v", "ge"), method=method)(conductance)


def conductance_rhs(p):
    return lambda y, x: numpy.stack([(-y[0] + y[1] * (p["e_syn"] - y[0])) / p["tau"], -y[1] / p["tau_g"] + x])


def explicit_step(method, f, y, dt):
    """One step of the method's Butcher tableau."""
    if method == "euler":
        return y + dt * f(y)
    if method == "rk2":
        return y + dt * f(y + dt / 2 * f(y))
    k1 = f(y)
    k2 = f(y + dt / 2 * k1)
    k3 = f(y + dt / 2 * k2)
    k4 = f(y + dt * k3)
    return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def exponential_euler_step(p, y, x, dt):
    """Each state exactly with the other frozen: v with ge, ge (already linear) exactly."""
    v, ge = y
    rate = (1 + ge) / p["tau"]
    v_inf = p["e_syn"] * ge / (1 + ge)
    g_inf = p["tau_g"] * x
    return numpy.stack([v_inf + (v - v_inf) * numpy.exp(-rate * dt), g_inf + (ge - g_inf) * numpy.exp(-dt / p["tau_g"])])


def reference_steps(step, y0, inputs):
    y, result = y0, []
    for x in inputs:
        y = step(y, x)
        result.append(y)
    return numpy.stack(result, axis=1)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("method", ["exponential_euler", "euler", "rk2", "rk4"])
def test_each_method_is_its_formula(method, device, backend):
    g = torch.Generator().manual_seed(2)
    x = torch.rand(4, 6, generator=g, dtype=torch.float64)
    y0 = torch.rand(2, 6, generator=g, dtype=torch.float64)
    if method == "exponential_euler":
        spec = conductance(method)
        params = fp32_params(spec, dt=0.75)
        step = functools.partial(exponential_euler_step, params, dt=params["dt"])
        want = reference_steps(lambda y, u: step(y, u), y0.numpy(), x.numpy())
    else:
        spec = fitzhugh_nagumo(method)
        params = fp32_params(spec, dt=0.375)
        f = fhn_rhs(params)
        want = reference_steps(lambda y, u: explicit_step(method, lambda z: f(z, u), y, params["dt"]), y0.numpy(), x.numpy())
    assert spec.method == method
    got = run_states(spec, [x.to(device)], [s.to(device) for s in y0], backend, **params)
    numpy.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("method,order", [("exponential_euler", 1), ("euler", 1), ("rk2", 2), ("rk4", 4)])
def test_each_method_converges_at_its_order(method, order):
    """The error at a fixed time against solve_ivp falls as dt**order: halving dt divides it by 2**order."""
    spec = conductance(method) if method == "exponential_euler" else fitzhugh_nagumo(method)
    rhs = conductance_rhs if method == "exponential_euler" else fhn_rhs
    y0 = numpy.array([[0.5, -0.25], [0.2, 0.1]])
    errors = []
    for dt in (0.1, 0.05, 0.025):
        params = {**{h: spec.signature.defaults[h] for h in spec.signature.hyper}, "dt": dt}
        n = round(2.0 / dt)
        inputs = numpy.full((n, 2), 0.5)
        got = run_states(spec, [torch.tensor(inputs)], [torch.tensor(s) for s in y0], "torch", **params)[:, -1]
        want = solve_steps(rhs(params), y0, inputs[:1], 2.0)[:, -1]
        errors.append(numpy.abs(got - want).max())
    ratio = errors[-2] / errors[-1]
    assert 2**order * 0.8 < ratio < 2**order * 1.25, f"{method}: errors {errors}"


# --- every method on both backends, with events, against the eager oracle ---------------------------

@flexgen.ode(states=("v",), method="exact")
def refractory_lif(x, v, tau=4.0, v_th=1.0, v_reset=0.0, t_ref=2.0):
    """LIF with a refractory period: silent, v held at the reset, for round(t_ref / dt) steps."""
    return Dynamics({"v": (x - v) / tau}, threshold=v >= v_th, reset={"v": v_reset}, refractory=t_ref)


@functools.lru_cache(maxsize=None)
def spiking_fitzhugh_nagumo(method):
    def spiking_fitzhugh_nagumo(x, v, w, eps=0.125, a=0.75, b=0.75, t_ref=1.0):
        return Dynamics({"v": v - v * v * v / 3.0 - w + x, "w": eps * (v + a - b * w)},
                        threshold=v >= 1.25, reset={"v": -1.0, "w": w + 0.25}, refractory=t_ref, hold=("v",))

    return flexgen.ode(states=("v", "w"), method=method, dt=0.5)(spiking_fitzhugh_nagumo)


EVENTS = {  # method -> (spec, input range, initial-state ranges)
    "exact": (continuous.cuba_lif, (0.0, 8.0), [(0.0, 6.0), (0.0, 0.9)]),
    "exact+refractory": (refractory_lif, (0.0, 3.0), [(0.0, 0.9), (0.0, 2.0)]),
    "exponential_euler": (conductance("exponential_euler", threshold=0.75), (0.0, 1.5), [(0.0, 0.7), (0.0, 1.0)]),
    "euler": (continuous.izhikevich, (0.0, 20.0), [(-70.0, 25.0), (-15.0, -5.0)]),
    "rk2": (spiking_fitzhugh_nagumo("rk2"), (0.0, 2.0), [(-1.0, 1.2), (-0.5, 0.5), (0.0, 1.0)]),
    "rk4": (spiking_fitzhugh_nagumo("rk4"), (0.0, 2.0), [(-1.0, 1.2), (-0.5, 0.5), (0.0, 1.0)]),
}


def uniform(shape, low, high, g):
    return torch.rand(*shape, generator=g, dtype=torch.float64) * (high - low) + low


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("case", sorted(EVENTS))
def test_every_method_matches_the_eager_oracle_with_gradients(case, device, backend):
    spec, (lo, hi), state_ranges = EVENTS[case]
    params = fp32_params(spec)
    g = torch.Generator().manual_seed(sorted(EVENTS).index(case))
    x = uniform((6, 8), lo, hi, g).to(device).requires_grad_()
    states = [uniform((8,), a, b, g).to(device).requires_grad_() for a, b in state_ranges]
    results = []
    for b in (backend, "eager"):
        outputs, finals = spec.apply(x, states=states, backend=b, **params)
        weights = torch.linspace(-1.0, 1.0, 6 * 8, dtype=torch.float64, device=device).view(6, 8)
        loss = sum((o * weights).sum() for o in outputs) + sum((f * f).sum() for f in finals)
        results.append([*outputs, *finals, *torch.autograd.grad(loss, [x, *states], allow_unused=True)])
    spikes = results[0][0]
    assert 0 < spikes.sum() < spikes.numel(), "the case should both fire and not fire"
    for got, want in zip(*results):
        if want is None:
            assert got is None or not got.any()
            continue
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(continuous.BUNDLED))
def test_bundled_models_run_on_every_backend(name):
    spec = continuous.BUNDLED[name]
    params = fp32_params(spec)
    x = torch.linspace(0.0, 3.0, 24, dtype=torch.float64).view(3, 8).requires_grad_()
    reference = None
    for device, backend in [("cpu", "eager")] + plain_device_backends():
        outputs, finals = spec.apply(x.to(device), backend=backend, **params)
        grad = torch.autograd.grad(outputs[0].sum() + sum(f.sum() for f in finals), x)[0]
        result = [o.cpu() for o in outputs + finals] + [grad]
        if reference is None:
            reference = result
        for got, want in zip(result, reference):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# --- exact LIF is SpikingJelly's LIF -----------------------------------------------------------------

@pytest.mark.parametrize("device,backend", device_backends())
def test_exact_lif_is_flexgen_lif_with_mapped_tau(device, backend):
    """tau dv/dt = -(v - v_reset) + x over dt is SpikingJelly's charge h = v + (x - (v - v_reset)) / tau_sj
    with 1 / tau_sj = 1 - exp(-dt / tau)."""
    tau, dt = 8.0, 2.0
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(8, 3, 16, generator=g, dtype=torch.float64) * 3).to(device).requires_grad_()
    exact = continuous.lif(tau=tau, dt=dt, v_reset=-0.25, v_rest=-0.25, backend=backend)
    handwritten = flexgen.LIF(tau=1.0 / (1.0 - math.exp(-dt / tau)), v_reset=-0.25, backend="torch", step_mode="m")
    s_exact, s_hand = exact(x), handwritten(x)
    assert torch.equal(s_exact, s_hand) and 0 < s_exact.sum() < s_exact.numel()
    torch.testing.assert_close(exact.v, handwritten.v, rtol=1e-12, atol=1e-13)
    weights = torch.randn(s_exact.shape, generator=g, dtype=torch.float64).to(device)
    grads = [torch.autograd.grad((s * weights).sum() + layer.v.sum(), x)[0] for s, layer in ((s_exact, exact), (s_hand, handwritten))]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


# --- refractoriness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("t_ref,pattern,left", [
    (2.0, [1, 0, 0, 1, 0, 0, 1, 0], [2.0, 1.0, 0.0, 2.0, 1.0, 0.0, 2.0, 1.0]),
    (1.5, [1, 0, 1, 0, 1, 0, 1, 0], [1.5, 0.5, 1.5, 0.5, 1.5, 0.5, 1.5, 0.5]),  # round(1.5 / dt) = 1 silent step
    (0.0, [1] * 8, [0.0] * 8),
])
def test_refractory_period_silences_and_holds_for_whole_steps(t_ref, pattern, left, device, backend):
    layer = refractory_lif(t_ref=t_ref, v_reset=-0.5, backend=backend, store_state_seqs=True)
    s = layer(torch.full((8, 2), 100.0, dtype=torch.float64, device=device))
    assert s[:, 0].tolist() == pattern
    assert torch.all(layer.state_seqs["v"] == -0.5)  # reset, then held at the reset while refractory
    assert layer.state_seqs["refractory_left"][:, 0].tolist() == left


# --- everything a NeuronSpec does --------------------------------------------------------------------

@flexgen.ode(states=("v",), learnable=("tau",), method="exact")
def learnable_lif(x, v, tau=4.0, v_th=1.0):
    return Dynamics({"v": (x - v) / tau}, threshold=v - v_th, reset={"v": 0.0})


@pytest.mark.parametrize("device,backend", device_backends())
def test_learnable_per_channel_time_constant_gets_the_eager_gradient(device, backend):
    g = torch.Generator().manual_seed(4)
    x = (torch.rand(6, 2, 3, 4, generator=g, dtype=torch.float64) * 3).to(device)
    grads = []
    for b in (backend, "eager"):
        layer = learnable_lif(backend=b, per_channel=3, tau=2.5).to(device).double()
        s = layer(x)
        (s * torch.linspace(-1, 1, s.numel(), dtype=s.dtype, device=device).view_as(s)).sum().backward()
        grads.append(layer.tau.grad)
    assert grads[0].shape == (3,) and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


def test_options_surrogate_detach_reset_and_recompute():
    from flexgen.surrogate import ATan, Sigmoid

    x = (torch.rand(6, 10, dtype=torch.float64) * 3).requires_grad_()
    for options in ({"surrogate": ATan()}, {"detach_reset": True}, {"surrogate": Sigmoid(learnable_alpha=True)}):
        got, want = (continuous.cuba_lif(backend=b, **options).double() for b in ("torch", "eager"))
        grads = [torch.autograd.grad(layer(x).sum() + layer.v.sum(), x)[0] for layer in (got, want)]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
    assert continuous.cuba_lif(surrogate=Sigmoid(learnable_alpha=True)).surrogate_alpha.item() == 4.0
    for device, backend in plain_device_backends():
        plain, recomputed = (continuous.cuba_lif(backend=backend, recompute=r) for r in (False, True))
        grads = [torch.autograd.grad(layer(x.to(device)).sum(), x)[0] for layer in (plain, recomputed)]
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def test_equations_show_the_continuous_system_the_discrete_update_and_the_backward():
    text = continuous.cuba_lif.equations()
    assert text.index("di/dt = ") < text.index("# discretised: method exact") < text.index("# backward step")
    assert "phi_v_i = " in text and "(tau_mem - tau_syn)" in text
    assert "fires where v - v_th >= 0" in text and "v <- v_reset" in text
    source = inspect.getsource(continuous.cuba_lif.fn)
    assert source.startswith("def cuba_lif(x, i, v, tau_syn=5.0,") and "# Written by flexgen.ode" in source
    assert "dt=1.0, surrogate=Sigmoid(alpha=4.0), detach_reset=False" in source
    assert continuous.cuba_lif.source("forward").count("@triton.jit") == 1


def test_auto_picks_the_first_method_that_applies_and_says_why():
    @flexgen.ode(states=("v", "u"))
    def oscillator(x, v, u, omega=2.0):
        return Dynamics({"v": -omega * u + x, "u": omega * v}, threshold=v - 1.0)

    linear = flexgen.ode(states=("v",))(_decay)
    picks = {"exact": linear, "exponential_euler": conductance("auto"), "rk4": fitzhugh_nagumo("auto")}
    for method, spec in picks.items():
        assert spec.method == method
    assert linear.integration.reason == "auto: the equations are linear in the states"
    assert continuous.cuba_lif.integration.reason == "requested"
    assert "v**3" in fitzhugh_nagumo("auto").integration.reason
    assert oscillator.method == "rk4" and "oscillates" in oscillator.integration.reason
    assert "method rk4 (auto: " in oscillator.describe()


def test_layers_pickle_and_compile():
    layer = refractory_lif(backend="torch")
    x = torch.full((5, 3), 3.0)
    copy = pickle.loads(pickle.dumps(layer))
    assert torch.equal(copy(x), layer(x))

    from torch import _dynamo

    net = torch.nn.Sequential(torch.nn.Linear(4, 6), continuous.cuba_lif(backend="torch"))
    inputs = torch.randn(5, 2, 4)
    _dynamo.reset()
    assert _dynamo.explain(net)(inputs).graph_break_count == 0
    net[1].reset()
    want = net(inputs)
    net[1].reset()
    assert torch.equal(torch.compile(net, fullgraph=True, backend="aot_eager")(inputs), want)


def test_cli_shows_the_continuous_equations(tmp_path):
    from test_cli import run_cli

    proc = run_cli("show", "OdeCubaLIF", "--equations", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert "continuous-time equations" in proc.stdout and "# backward step" in proc.stdout


# --- the exact LIF's kernels are the hand-written LIF's ---------------------------------------------

def test_exact_lif_kernels_move_what_the_handwritten_lif_kernels_move():
    """Same loads and stores in every kernel (the saved set is one value per step, the pre-spike
    potential), and exp(-dt/tau) computed once before the time loop: the discretisation costs nothing."""
    exact, hand = continuous.lif, flexgen.LIF.spec
    for kind in ("forward", "inference", "backward", "forward_recompute", "backward_recompute"):
        a, b = exact.source(kind), hand.source(kind)
        before, loop = a.split("    for ", 1)  # the time loop, or the recompute backward's loop over chunks
        hand_loop = b.split("    for ", 1)[1]
        # per step: the same loads (hyper-parameters, of which the exact LIF has more, are read once, before it)
        assert loop.count("tl.load(") == hand_loop.count("tl.load("), kind
        assert a.count("tl.store(") == b.count("tl.store("), kind
        assert "tl.exp(" in before and "tl.exp(" not in loop, kind
    assert [s.name for s in exact.compiled().layout.saved] == ["v_step"]
    assert [s.name for s in hand.compiled().layout.saved] == ["h"]


# --- bad equations -----------------------------------------------------------------------------------

def _izhikevich_exact(x, v, u):
    return Dynamics({"v": 0.04 * v * v + 5.0 * v + 140.0 - u + x, "u": 0.02 * (0.2 * v - u)}, threshold=v - 30.0)


def _quadratic(x, v, tau=2.0):
    return Dynamics({"v": (v * v + x) / tau}, threshold=v - 1.0)


def _undefined(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau_m}, threshold=v - 1.0)  # noqa: F821 (the undefined symbol under test)


def _uses_dt(x, v, tau=2.0, dt=0.1):
    return Dynamics({"v": (x - v) * dt / tau}, threshold=v - 1.0)


def _missing(x, v, w, tau=2.0):
    return Dynamics({"v": (x - v) / tau}, threshold=v - 1.0)


def _not_a_state(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau, "u": -v}, threshold=v - 1.0)


def _spike_inside(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau - flexgen.spike(v - 1.0)}, threshold=v - 1.0)


def _two_conditions(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau}, threshold=(v > 1.0) & (x > 0.0))


def _option(x, v, tau=2.0, soft=False):
    return Dynamics({"v": (x - v) / tau}, threshold=v - 1.0)


def _reset_without_threshold(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau}, reset={"v": 0.0}, outputs=(v,))


def _state_refractory(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau}, threshold=v - 1.0, refractory=v)


def _tuple(x, v, tau=2.0):
    return (x - v) / tau, v - 1.0


def _oscillates(x, v, u):
    return Dynamics({"v": -u + x, "u": v}, threshold=v - 1.0)


def _takes_surrogate_name(x, v, surrogate=1.0):
    return Dynamics({"v": x - v}, threshold=v - 1.0)


def _no_output(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau})


BAD = [
    (_izhikevich_exact, ("v", "u"), "exact", ["method 'exact' needs equations linear in the states", "dv/dt = ", "0.04*v**2"]),
    (_quadratic, ("v",), "exponential_euler", ["each equation linear in its own state", "v**2/tau"]),
    (_undefined, ("v",), "auto", ["NameError", "tau_m", "at line"]),
    (_uses_dt, ("v",), "auto", ["parameter named 'dt'", "must not use it"]),
    (_missing, ("v", "w"), "auto", ["no derivative for the state 'w'"]),
    (_not_a_state, ("v",), "auto", ["names 'u', which is not a state"]),
    (_spike_inside, ("v",), "auto", ["dv/dt uses flexgen.spike"]),
    (_two_conditions, ("v",), "auto", ["one comparison"]),
    (_option, ("v",), "auto", ["'soft' is a specialisation option"]),
    (_reset_without_threshold, ("v",), "auto", ["reset and refractory need a threshold"]),
    (_state_refractory, ("v",), "auto", ["refractory must be", "reads v"]),
    (_tuple, ("v",), "auto", ["must return flexgen.Dynamics"]),
    (_oscillates, ("v", "u"), "exact", ["oscillates", "sin/cos"]),
    (_takes_surrogate_name, ("v",), "auto", ["'surrogate' is one flexgen.ode adds"]),
    (_no_output, ("v",), "auto", ["without threshold", "outputs=(v,)"]),
    (_quadratic, ("v",), "midpoint", ["method must be 'auto' or one of"]),
]


@pytest.mark.parametrize("fn,states,method,fragments", BAD, ids=[b[0].__name__.strip("_") for b in BAD])
def test_bad_equations_are_spec_errors_naming_the_problem(fn, states, method, fragments):
    with pytest.raises(flexgen.SpecError) as info:
        flexgen.ode(states=states, method=method)(fn)
    message = str(info.value)
    assert fn.__name__ in message
    for fragment in fragments:
        assert fragment in message


def test_bad_decorator_arguments():
    with pytest.raises(flexgen.SpecError, match="dt must be a positive number"):
        flexgen.ode(states=("v",), dt=-0.1)
    with pytest.raises(flexgen.SpecError, match="surrogate must be a flexgen.surrogate.Surrogate"):
        flexgen.ode(states=("v",), surrogate="atan")
    with pytest.raises(flexgen.SpecError, match="with parentheses"):
        flexgen.ode(_decay)


def _decay(x, v, tau=2.0):
    return Dynamics({"v": (x - v) / tau}, threshold=v - 1.0)


def test_stiff_step_warns_naming_the_equation_and_the_stable_step():
    euler, rk4 = (flexgen.ode(states=("v",), method=m)(_decay) for m in ("euler", "rk4"))
    with pytest.warns(StiffnessWarning, match=r"method 'euler' with dt=5.*dv/dt = \(-v \+ x\)/tau.*use dt < 4"):
        euler(dt=5.0)
    with pytest.warns(StiffnessWarning, match="by 1.38 per step.*use dt < 5.57"):  # |R(-3)| for RK4; 2.785 tau
        rk4.apply(torch.zeros(2, 1), dt=6.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        euler(dt=3.5)
        rk4(dt=5.5)
        continuous.lif(dt=50.0)  # exact: any step


def test_runtime_parameters_the_update_cannot_take():
    with pytest.raises(ValueError, match="dt must be a positive number"):
        continuous.lif(dt=0.0)
    with pytest.raises(ValueError, match=r"divides by tau_mem - tau_syn, which is 0 for tau_mem=4.0, tau_syn=4.0"):
        continuous.cuba_lif(tau_mem=4.0, tau_syn=4.0)
    with pytest.raises(ValueError, match="divides by tau_mem - tau_syn"):
        continuous.cuba_lif.apply(torch.zeros(2, 1), tau_mem=3.0, tau_syn=3.0)
    with pytest.raises(ValueError, match=r"the exponential_euler update divides by k, which is 0 for k=0.0"):
        flexgen.ode(states=("v",), method="exponential_euler")(_rate)(k=0.0)  # the steady state x / k
    with pytest.warns(UserWarning, match=r"refractory period t_ref = 0.25 is shorter than half a step \(dt=1\)"):
        refractory_lif(t_ref=0.25)


def _rate(x, v, k=1.0):
    return Dynamics({"v": x - k * v}, threshold=v - 1.0)


# --- equations not defined at the initial state ---------------------------------------------------------

@flexgen.ode(states=("v",), dt=0.5)
def divides_by_v(x, v):
    return flexgen.Dynamics({"v": x / v}, outputs=(v,))


@flexgen.ode(states=("v",), dt=0.5)
def log_of_v(x, v):
    return flexgen.Dynamics({"v": x + flexgen.log(v)}, outputs=(v,))


@pytest.mark.parametrize("spec,what", [(divides_by_v, r"dv/dt = x/v is undefined \(NaN\)"),
                                       (log_of_v, r"dv/dt = x \+ log\(v\) is infinite")])
@pytest.mark.parametrize("backend", ["eager", "torch", "triton"])
def test_equations_singular_at_the_initial_state_are_a_clear_error(spec, what, backend):
    with pytest.raises(ValueError, match=what + r" at the initial state \(v=0\) with x=0.*init="):
        spec(backend=backend)
    with pytest.raises(ValueError, match=what):
        spec.apply(torch.rand(3, 2), backend=backend)


def test_the_same_equations_from_a_state_where_they_are_defined_run():
    @flexgen.ode(states=("v",), dt=0.01, init={"v": 1.0})
    def grows(x, v):
        return flexgen.Dynamics({"v": x / v + flexgen.log(v)}, outputs=(v,))

    out = grows(backend="torch")(torch.rand(4, 2, dtype=torch.float64))
    assert torch.isfinite(out).all() and (out >= 1.0).all()


def test_a_derivative_finite_at_the_initial_state_without_a_linearisation_there_builds():
    @flexgen.ode(states=("v",), dt=0.1, method="euler")
    def square_root(x, v):
        return flexgen.Dynamics({"v": x - flexgen.sqrt(v)}, outputs=(v,))

    out = square_root(backend="torch")(torch.full((3, 1), 1.0, dtype=torch.float64))
    torch.testing.assert_close(out[:2, 0], torch.tensor([0.1, 0.2 - 0.1 * 0.1 ** 0.5], dtype=torch.float64),
                               rtol=1e-12, atol=0)


@flexgen.ode(states=("v",), method="exact", learnable=("t_ref",))
def learnable_refractory_lif(x, v, tau=4.0, v_th=1.0, t_ref=2.0):
    """LIF with a learnable refractory period."""
    return Dynamics({"v": (x - v) / tau}, threshold=v >= v_th, reset={"v": 0.0}, refractory=2.0 * t_ref)


@pytest.mark.parametrize("device,backend", [*device_backends(), ("cpu", "eager")])
@pytest.mark.parametrize("value,what", [(float("nan"), "NaN"), (float("inf"), "infinite")])
def test_a_learnable_refractory_period_that_is_not_finite_is_refused(device, backend, value, what):
    layer = learnable_refractory_lif(backend=backend).to(device)
    x = torch.full((4, 3), 2.0, device=device)
    layer(x)
    layer.reset()
    with torch.no_grad():
        layer.t_ref.fill_(value)  # set after construction (an optimizer step, a loaded state dict)
    message = f"the learnable parameter 't_ref' is {what}; it must be a finite number \\(the refractory period"
    with pytest.raises(ValueError, match=message):
        layer(x)
    with pytest.raises(ValueError, match=f"the parameter 't_ref' is {what}"):
        learnable_refractory_lif(t_ref=value)
    with pytest.raises(ValueError, match=f"the parameter 't_ref' is {what}"):
        learnable_refractory_lif.apply(x, backend=backend, t_ref=torch.tensor(value, device=device))


@pytest.mark.parametrize("owner", ["Recurrent", "Dense", "Dense of a Recurrent"])
def test_layers_that_run_the_neuron_themselves_refuse_a_refractory_period_that_is_not_finite(owner):
    if owner == "Recurrent":
        layer = flexgen.Recurrent(learnable_refractory_lif, hidden=3, backend="torch")
        cell = layer.cell
    elif owner == "Dense":
        layer = flexgen.Dense(3, 3, learnable_refractory_lif, backend="torch")
        cell = layer.cell
    else:
        layer = flexgen.Dense(3, 3, flexgen.Recurrent(learnable_refractory_lif, hidden=3, backend="torch"))
        cell = layer.cell.cell
    x = (torch.rand(4, 2, 3) < 0.5).float()
    layer(x)
    with torch.no_grad():
        cell.t_ref.fill_(float("nan"))
    flexgen.reset(layer)
    with pytest.raises(ValueError, match="the learnable parameter 't_ref' is NaN"):
        layer(x)
