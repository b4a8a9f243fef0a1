"""The EventProp adjoint system derived from flexgen.ode equations equals the one derived by hand (lambda = dL/dx,
see flexgen/derive/adjoint.py), maps onto Wunderlich & Pehle's CuBa LIF equations, and bad input is refused."""
import pytest
import sympy

import flexgen
from flexgen import cli
from flexgen.derive.adjoint import derive_adjoint


def S(name):
    return sympy.Symbol(name, real=True)


def same(a, b):
    return sympy.simplify(sympy.expand(a - b)) == 0


@flexgen.ode(states=("v",), method="exact")
def lif(u, v, tau=2.0, v_th=1.0):
    return flexgen.Dynamics({"v": (-v + u) / tau}, threshold=v >= v_th, reset={"v": 0.0})


@flexgen.ode(states=("v", "i"), method="exact")
def cuba(u, v, i, tau_m=10.0, tau_s=5.0, v_th=1.0):
    return flexgen.Dynamics({"v": (-v + i) / tau_m, "i": -i / tau_s + u}, threshold=v >= v_th, reset={"v": 0.0})


@flexgen.ode(states=("v", "a"), method="exact")
def adaptive(u, v, a, tau=2.0, tau_a=20.0, v_th=1.0, beta=0.5):
    return flexgen.Dynamics({"v": (-v + u) / tau, "a": -a / tau_a}, threshold=v >= v_th + beta * a,
                            reset={"v": 0.0, "a": a + 1.0})


u, v, i, a, tau, tau_m, tau_s, tau_a, v_th, beta, E, w = map(
    S, "u v i a tau tau_m tau_s tau_a v_th beta dL_dt_k w_u".split())


def check(adj, flow, integrands, gdot, numerator, jump, spike_terms, drive, time_error, input_terms):
    assert len(adj.flow) == len(flow) and all(same(x, y) for x, y in zip(adj.flow, flow))
    got = dict(adj.parameter_integrands)
    assert set(map(str, got)) == set(integrands) | {str(p) for p in got if got[p] == 0}
    for name, expected in integrands.items():
        assert same(got[S(name)], expected), name
    assert same(adj.gdot, gdot)
    assert same(adj.jump_numerator, numerator)
    c = numerator / gdot
    for got_jump, expected in zip(adj.jump, jump):
        assert same(adj.expanded(got_jump), expected.xreplace({S("c"): c}))
    terms = dict(adj.spike_parameter_terms)
    for p, e in terms.items():
        assert same(adj.expanded(e), spike_terms.get(str(p), sympy.Integer(0)).xreplace({S("c"): c})), p
    (item,) = adj.inputs
    assert all(same(x, y) for x, y in zip(item.drive, drive))
    assert same(item.time_error - S("l_V_minus") + S("l_V_plus"), time_error)
    assert same(item.weight_gradient, sum(S(f"lambda_{x}") * b for x, b in zip(adj.system.states, drive)))
    for p, e in item.parameter_terms:
        assert same(e, input_terms.get(str(p), sympy.Integer(0))), p


def test_lif_adjoint_equals_the_hand_derived_one():
    lam, lam_p = S("lambda_v"), S("lambda_v_post")
    c = S("c")
    check(lif.adjoint(),
          flow=[-lam / tau + S("dlV_dv")],
          integrands={"tau": lam * (v - u) / tau**2},
          gdot=(u - v) / tau,
          numerator=lam_p * u / tau - E,  # f(x+) - H f(x-) with H = 0, x+ = 0
          jump=[c],
          spike_terms={"v_th": -c},
          drive=[1 / tau],
          time_error=lam * w / tau**2,  # lambda (f(v) - f(v + w/tau)), f = -v/tau between events
          input_terms={"tau": -lam * w / tau**2})


def test_cuba_lif_adjoint_equals_the_hand_derived_one():
    lv, li, lvp, lip = S("lambda_v"), S("lambda_i"), S("lambda_v_post"), S("lambda_i_post")
    c = S("c")
    check(cuba.adjoint(),
          flow=[-lv / tau_m + S("dlV_dv"), lv / tau_m - li / tau_s + S("dlV_di")],
          integrands={"tau_m": lv * (v - i) / tau_m**2, "tau_s": li * i / tau_s**2},
          gdot=(i - v) / tau_m,
          numerator=lvp * i / tau_m - E,
          jump=[c, lip],
          spike_terms={"v_th": -c},
          drive=[0, 1],
          time_error=-w * lv / tau_m + w * li / tau_s,
          input_terms={})


def test_adaptive_lif_adjoint_equals_the_hand_derived_one():
    lv, la, lvp, lap = S("lambda_v"), S("lambda_a"), S("lambda_v_post"), S("lambda_a_post")
    c = S("c")
    check(adaptive.adjoint(),
          flow=[-lv / tau + S("dlV_dv"), -la / tau_a + S("dlV_da")],
          integrands={"tau": lv * (v - u) / tau**2, "tau_a": la * a / tau_a**2},
          gdot=(u - v) / tau + beta * a / tau_a,  # d/dt (v - v_th - beta a)
          numerator=lvp * u / tau - lap / tau_a - E,  # f(x+) - H f(x-) = (u/tau, -1/tau_a)
          jump=[c, lap - beta * c],
          spike_terms={"v_th": -c, "beta": -a * c},
          drive=[1 / tau, 0],
          time_error=lv * w / tau**2,
          input_terms={"tau": -lv * w / tau**2})


def test_cuba_lif_maps_onto_wunderlich_and_pehle():
    """W&P (Sci. Rep. 2021, Table 2), reverse time ' = -d/dt, with their lambda_V = -lambda_v / tau_m and
    lambda_I = -lambda_i / tau_s: tau_m lambda_V' = -lambda_V - dl_V/dV, tau_s lambda_I' = -lambda_I + lambda_V,
    lambda_V- = lambda_V+ + [v_th lambda_V+ + W^T(lambda_V - lambda_I) + dl_p/dt] / (tau_m Vdot-), and
    dL/dw = -tau_s lambda_I at the presynaptic spikes."""
    adj = cuba.adjoint()
    lv, li, lvp = S("lambda_v"), S("lambda_i"), S("lambda_v_post")
    wp_v, wp_i = -lv / tau_m, -li / tau_s
    flow_v, flow_i = [e.subs({S("dlV_di"): 0}) for e in adj.flow]  # -dlambda/dt; W&P's l_V reads V only
    # the reverse-time derivative of wp_v is -d(wp_v)/dt = flow_v / tau_m... with the sign of wp_v: -(-flow)/tau
    assert same(tau_m * (-flow_v / tau_m), -wp_v - S("dlV_dv"))
    assert same(tau_s * (-flow_i / tau_s), -wp_i + wp_v)
    (item,) = adj.inputs
    assert same(item.weight_gradient, -tau_s * wp_i)
    assert same(item.time_error - S("l_V_minus") + S("l_V_plus"), w * (wp_v - wp_i))
    wp_v_post = -lvp / tau_m
    vdot = (i - v) / tau_m
    expected = wp_v_post + (v_th * wp_v_post + E) / (tau_m * vdot)
    assert same((-adj.expanded(adj.jump[0]) / tau_m).subs(v, v_th), expected.subs(v, v_th))  # at the crossing


def test_show_prints_the_adjoint(capsys):
    assert cli.main(["show", "OdeCubaLIF", "--adjoint"]) == 0
    out = capsys.readouterr().out
    assert "-dlambda_v/dt = dlV_dv - lambda_v/tau_mem" in out
    assert "lambda_v- = c" in out and "dL/dw_x += lambda_i*w_in/tau_syn" in out
    assert cli.main(["show", "LIF", "--adjoint"]) == 1
    assert "EventProp needs the neuron's differential equations" in capsys.readouterr().err


def refused(fn, match, **kw):
    with pytest.raises(flexgen.SpecError, match=match):
        flexgen.ode(**kw)(fn).adjoint()


def test_bad_neurons_are_refused():
    def no_threshold(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u - v) / tau}, outputs=(v,))

    def no_reset(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u - v) / tau}, threshold=v >= 1.0)

    def kinked(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u - v) / tau}, threshold=flexgen.abs(v) >= 1.0, reset={"v": 0.0})

    def clamped(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u - v) / tau}, threshold=flexgen.maximum(v, 0.5) >= 1.0, reset={"v": 0.0})

    def squared(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u * u - v) / tau}, threshold=v >= 1.0, reset={"v": 0.0})

    def conductance(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u * (1.0 - v) - v) / tau}, threshold=v >= 1.0, reset={"v": 0.0})

    def refractory(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u - v) / tau}, threshold=v >= 1.0, reset={"v": 0.0}, refractory=2.0)

    def reads_input(u, v, tau=2.0):
        return flexgen.Dynamics({"v": (u - v) / tau}, threshold=v + u >= 1.0, reset={"v": 0.0})

    refused(no_threshold, "EventProp needs a threshold", states=("v",))
    refused(no_reset, "EventProp needs a reset", states=("v",))
    refused(kinked, "not differentiable.*Abs", states=("v",))
    refused(clamped, "not differentiable", states=("v",))
    refused(squared, "not affine in the input u", states=("v",), method="rk4")
    refused(conductance, "input u is multiplied by .*reads v", states=("v",), method="rk4")
    refused(refractory, "refractory period is not supported by EventProp yet", states=("v",))
    refused(reads_input, "threshold reads the input u", states=("v",))
    with pytest.raises(flexgen.SpecError, match="step function.*@flexgen.ode"):
        flexgen.LIF.spec.adjoint()


def test_the_derivation_is_generic():
    """No neuron is named in the derivation: a system with renamed symbols gives the renamed adjoint."""
    @flexgen.ode(states=("m",), method="exact")
    def renamed(q, m, k=2.0, th=1.0):
        return flexgen.Dynamics({"m": (-m + q) / k}, threshold=m >= th, reset={"m": 0.0})

    ref, got = lif.adjoint(), renamed.adjoint()
    names = {S("lambda_v"): S("lambda_m"), S("dlV_dv"): S("dlV_dm"), tau: S("k")}
    assert same(ref.flow[0].xreplace(names), got.flow[0])
    assert derive_adjoint(renamed.system).gdot == got.gdot


def test_names_of_the_equations_are_never_taken_by_the_adjoint():
    """A parameter named c (the jump's scale) or lambda_v, a state named w (the printed functions' weight), a
    parameter h (their time step): each keeps its meaning; the adjoint's own names step aside."""
    @flexgen.ode(states=("v", "w"), method="exact")
    def clash(u, v, w, c=4.0, h=6.0, lambda_v=0.5, v_th=1.0):
        return flexgen.Dynamics({"v": (-v + w) / c + u, "w": -w / h}, threshold=v >= v_th,
                                reset={"v": 0.0, "w": w + lambda_v})

    adj = clash.adjoint()
    c, h, lam_param, w_state = S("c"), S("h"), S("lambda_v"), S("w")
    assert str(adj.scale) == "c_1" and str(adj.lambdas[0]) == "lambda_v_1"
    lv, lwp, lvp = adj.lambdas[0], S("lambda_w_post"), S("lambda_v_post")
    gdot = (-v + w_state) / c + u
    numerator = lvp * ((w_state + lam_param) / c + u) - lwp * lam_param / h - E  # f(x+) - H f(x-)
    assert same(adj.gdot, gdot)
    assert same(adj.jump_numerator, numerator.subs(E, adj.time_error))
    assert same(adj.expanded(adj.jump[0]), (numerator / gdot).subs(E, adj.time_error))
    assert dict(adj.spike_parameter_terms)[lam_param] == lwp
    assert same(adj.flow[0], -lv / c + S("dlV_dv"))
    layer = flexgen.EventPropDense(1, 1, clash, dt=1.0, steps=5)  # the printed functions compile
    assert "def flow(h1, v, w, c, h, lambda_v, v_th)" in layer.source("torch")
