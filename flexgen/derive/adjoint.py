"""The adjoint system of EventProp (Wunderlich & Pehle, "Event-based backpropagation can compute exact gradients for
spiking neural networks", Sci. Rep. 11:12829, 2021), derived from a neuron's `ContinuousSystem`.

Conventions. A neuron has states x, flow dx/dt = f(x, u, theta), threshold g(x, theta) (it fires where g crosses
0 from below) and reset x+ = h(x-, theta). The loss is L = l_p(spike times) + integral of l_V(x, t) dt. The adjoint
here is the sensitivity of the loss to the state: lambda(t) = dL/dx(t) (W&P's lambda is minus this, scaled per
state by the time constant they multiply each equation by; `tests/test_eventprop_derivation.py` checks the map).
With it, all signs follow from that one definition:

  between events      -dlambda/dt = (df/dx)^T lambda + dl_V/dx,  lambda(T) = 0 (integrated in reverse time)
  parameters          dL/dtheta = integral of lambda^T df/dtheta dt  (+ the spike and input-event terms below)
  at the neuron's own spike t_k, from g(x-(t_k), theta) = 0 and the implicit-function theorem,
    dt_k = -(dg/dx . dx- + dg/dtheta dtheta) / gdot-,   gdot- = dg/dx . f(x-)   (> 0 for an upward crossing);
    c = [lambda+^T (f(x+) - H f(x-)) - E] / gdot-,   H = dh/dx,
    lambda- = H^T lambda+ + (dg/dx) c,          dL/dtheta += lambda+^T dh/dtheta + (dg/dtheta) c,
  where E = dL/dt_k held directly: dl_p/dt_k, plus l_V(x-) - l_V(x+) when the loss has a density, plus the
  error the postsynaptic neurons send (the input-event time error below, summed over them).
  at an input event of weight w on input u (a delta current): f must be affine in u with a drive b = df/du that
  reads no state nor input, so the state jumps x+ = x- + w b; lambda is continuous there and
    dL/dw = lambda^T b,   dL/dtheta += w lambda^T db/dtheta,
    dL/dt_event = lambda^T (f(x-) - f(x+)) + l_V(x-) - l_V(x+)   (the error sent to the presynaptic neuron).

For the CuBa LIF of W&P (tau_mem dV/dt = -V + I, dI/dt = -I/tau_syn + u, reset V <- 0) the last line is
w (lambda_I/tau_syn - lambda_V/tau_mem), which is W&P's (W^T (lambda_V - lambda_I)) in their variables.

Everything is generic in the equations (no neuron is named here). Bad input is a SpecError naming what is missing.
"""
import dataclasses

import sympy

from ..errors import SpecError

NOT_DIFFERENTIABLE = (sympy.Heaviside, sympy.sign, sympy.Abs, sympy.Piecewise, sympy.Max, sympy.Min, sympy.floor,
                      sympy.ceiling, sympy.DiracDelta)


def _symbol(name):
    return sympy.Symbol(name, real=True)


class _Fresh:
    """Symbols for the adjoint's own names, none equal to a name of the equations (a parameter named c stays c)."""

    def __init__(self, system):
        self.taken = {str(s) for s in system.inputs + system.states + system.parameters}

    def __call__(self, stem):
        name, k = stem, 1
        while name in self.taken:
            name, k = f"{stem}_{k}", k + 1
        self.taken.add(name)
        return _symbol(name)


@dataclasses.dataclass(frozen=True)
class InputAdjoint:
    """What an event input contributes: the drive b = df/du, and at an event of weight `weight` (a symbol) the
    weight gradient lambda^T b, the parameter terms w lambda^T db/dtheta and the event-time error."""

    input: sympy.Symbol
    drive: tuple
    weight: sympy.Symbol
    weight_gradient: sympy.Expr
    parameter_terms: tuple
    time_error: sympy.Expr


@dataclasses.dataclass(frozen=True)
class AdjointSystem:
    """The adjoint of a `ContinuousSystem` (see the module docstring for the conventions).

    lambdas / lambdas_post: lambda per state (between events, and lambda+ just after a spike);
    loss_density: the symbols dl_V/dx per state (a hook: the loss fills them); time_error: E, the symbol of dL/dt_k
    held directly; flow: -dlambda/dt per state; parameter_integrands: (theta, lambda^T df/dtheta);
    post_states: h(x) per state (the state itself where not reset); gdot: dg/dx . f at x-; scale: the symbol c
    (its value: jump_numerator / gdot); jump: lambda- per state (reading c); spike_parameter_terms: (theta,
    lambda+^T dh/dtheta + dg/dtheta c);
    spike_time_sensitivity: dt_k/dx- per state; inputs: an `InputAdjoint` per input.
    """

    system: object
    lambdas: tuple
    lambdas_post: tuple
    loss_density: tuple
    time_error: sympy.Symbol
    flow: tuple
    parameter_integrands: tuple
    post_states: tuple
    gdot: sympy.Expr
    scale: sympy.Symbol
    jump_numerator: sympy.Expr
    jump: tuple
    spike_parameter_terms: tuple
    spike_time_sensitivity: tuple
    inputs: tuple
    loss_jump: tuple  # (l_V(x-), l_V(x+)) symbols of an input event's time error

    def jump_scale(self):
        """c as an expression of the states before the spike, lambda+ and E."""
        return self.jump_numerator / self.gdot

    def expanded(self, expr):
        """`expr` with c replaced by its value."""
        return expr.xreplace({self.scale: self.jump_scale()})

    def jacobian(self):
        """df/dx (inputs as they are)."""
        return sympy.Matrix(self.system.derivatives).jacobian(sympy.Matrix(self.system.states))

    def lines(self):
        """The adjoint system as text, one equation per line."""
        s = sympy.sstr
        system = self.system
        lines = ["# adjoint: lambda_<state> = dL/d<state>(t), integrated from lambda(T) = 0 in reverse time",
                 f"# (EventProp, Wunderlich & Pehle 2021); {self.loss_density[0].name[:4]}..: dl_V/d<state>, the loss "
                 f"density's hook; {self.time_error}: dL/dt_k held directly (dl_p/dt_k + l_V- - l_V+ + the "
                 "postsynaptic errors)"]
        lines += [f"-d{lam}/dt = {s(e)}" for lam, e in zip(self.lambdas, self.flow)]
        lines += [f"dL/d{theta} += integral of {s(e)} dt" for theta, e in self.parameter_integrands if e != 0]
        lines.append("at a spike (x = the states before it, x+ = h(x)): " +
                     ", ".join(f"{x}+ = {s(e)}" for x, e in zip(system.states, self.post_states)))
        lines.append(f"  gdot = {s(self.gdot)}")
        lines.append(f"  {self.scale} = ({s(self.jump_numerator)})/gdot")
        lines += [f"  {lam}- = {s(e)}" for lam, e in zip(self.lambdas, self.jump)]
        lines += [f"  dL/d{theta} += {s(e)}" for theta, e in self.spike_parameter_terms if e != 0]
        for item in self.inputs:
            drive = ", ".join(f"{x} += {s(item.weight * b)}" for x, b in zip(system.states, item.drive) if b != 0)
            lines.append(f"at an input event on {item.input} of weight {item.weight}: {drive}")
            lines.append(f"  dL/d{item.weight} += {s(item.weight_gradient)}")
            lines += [f"  dL/d{theta} += {s(e)}" for theta, e in item.parameter_terms if e != 0]
            lines.append(f"  dL/dt_event = {s(item.time_error)}")
        return lines


def _refuse(system):
    where = system.where
    if system.threshold is None:
        raise SpecError(f"{where}: EventProp needs a threshold (when the neuron fires); {system.name} has none")
    if not system.reset:
        raise SpecError(f"{where}: EventProp needs a reset (Dynamics(..., reset={{...}})); {system.name} has none, so "
                        "it would fire again at once after every spike")
    if system.refractory is not None:
        raise SpecError(f"{where}: a refractory period is not supported by EventProp yet (its adjoint holds the "
                        "states over the period; not derived); drop refractory= to use EventProp")
    found = [a for a in sympy.preorder_traversal(system.threshold) if isinstance(a, NOT_DIFFERENTIABLE)]
    if found:
        raise SpecError(f"{where}: the threshold {sympy.sstr(system.threshold)} is not differentiable in the states "
                        f"(it uses {type(found[0]).__name__}); EventProp needs the gradient of the threshold at the "
                        "crossing: write it with smooth functions")
    read = system.threshold.free_symbols & set(system.inputs)
    if read:
        raise SpecError(f"{where}: the threshold reads the input {sorted(map(str, read))[0]}; EventProp needs a "
                        "threshold of the states and parameters")
    if not system.threshold.free_symbols & set(system.states):
        raise SpecError(f"{where}: the threshold {sympy.sstr(system.threshold)} reads no state")


def _drive(system, u):
    """df/du per state; SpecError unless f is affine in u with a drive free of states and inputs."""
    drive = tuple(sympy.diff(f, u) for f in system.derivatives)
    for state, f, b in zip(system.states, system.derivatives, drive):
        if sympy.simplify(sympy.diff(b, u)) != 0:
            raise SpecError(f"{system.where}: d{state}/dt = {sympy.sstr(f)} is not affine in the input {u}; "
                            "EventProp takes an input event as a delta current, which needs f affine in it")
        read = b.free_symbols & (set(system.states) | set(system.inputs))
        if read:
            raise SpecError(f"{system.where}: in d{state}/dt = {sympy.sstr(f)} the input {u} is multiplied by "
                            f"{sympy.sstr(b)}, which reads {sorted(map(str, read))[0]}; EventProp takes an input "
                            "event as a jump of the states by w df/du, which needs df/du free of states and inputs")
    return drive


def derive_adjoint(system):
    """The `AdjointSystem` of a `ContinuousSystem` (SpecError for a system EventProp cannot take)."""
    _refuse(system)
    states, parameters = list(system.states), list(system.parameters)
    n = len(states)
    fresh = _Fresh(system)
    lam = sympy.Matrix([fresh(f"lambda_{x}") for x in states])
    lam_post = sympy.Matrix([fresh(f"lambda_{x}_post") for x in states])
    density = sympy.Matrix([fresh(f"dlV_d{x}") for x in states])
    error = fresh("dL_dt_k")
    f = sympy.Matrix(system.derivatives)
    x = sympy.Matrix(states)
    A = f.jacobian(x)
    flow = tuple(sympy.expand(e) for e in A.T * lam + density)
    integrands = tuple((p, sympy.expand((lam.T * f.diff(p))[0])) for p in parameters)

    reset = dict(system.reset)
    h = sympy.Matrix([reset.get(s, s) for s in states])
    H = h.jacobian(x)
    post = dict(zip(states, h))
    f_post = f.xreplace(post)
    grad_g = sympy.Matrix([sympy.diff(system.threshold, s) for s in states])
    gdot = sympy.expand((grad_g.T * f)[0])
    if gdot == 0:
        raise SpecError(f"{system.where}: the threshold's rate of change along the flow is 0 everywhere; no spike "
                        "time can be found from it")
    c = fresh("c")  # the jump and the spike's parameter terms read c, whose value is numerator / gdot
    numerator = sympy.factor_terms(sympy.expand((lam_post.T * (f_post - H * f))[0]) - error)
    jump = tuple(sympy.expand((H.T * lam_post)[k]) + grad_g[k] * c for k in range(n))
    spike_terms = tuple((p, sympy.expand((lam_post.T * h.diff(p))[0]) + sympy.diff(system.threshold, p) * c)
                        for p in parameters)
    sensitivity = tuple(sympy.cancel(-grad_g[k] / gdot) for k in range(n))

    l_minus, l_plus = fresh("l_V_minus"), fresh("l_V_plus")
    inputs = []
    for u in system.inputs:
        b = sympy.Matrix(_drive(system, u))
        w = fresh(f"w_{u}")
        f_before = f.xreplace({u: 0})  # the event's own input is a delta, 0 on either side of it
        f_after = f_before.xreplace({s: s + w * bk for s, bk in zip(states, b)})
        inputs.append(InputAdjoint(
            input=u, drive=tuple(b), weight=w, weight_gradient=sympy.expand((lam.T * b)[0]),
            parameter_terms=tuple((p, sympy.expand(w * (lam.T * b.diff(p))[0])) for p in parameters),
            time_error=sympy.factor_terms(sympy.expand((lam.T * (f_before - f_after))[0])) + l_minus - l_plus,
        ))
    return AdjointSystem(
        system=system, lambdas=tuple(lam), lambdas_post=tuple(lam_post), loss_density=tuple(density),
        time_error=error, flow=flow, parameter_integrands=integrands, post_states=tuple(h), gdot=gdot,
        scale=c, jump_numerator=numerator, jump=jump, spike_parameter_terms=spike_terms,
        spike_time_sensitivity=sensitivity, inputs=tuple(inputs), loss_jump=(l_minus, l_plus),
    )
