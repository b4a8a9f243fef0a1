"""The functions of the EventProp reference, as sympy: what `flexgen.render.eventprop` prints into torch code
(and `flexgen.render.eventprop_c` into the C kernels).

For a neuron that is linear between events (f = A x + b with A, b free of the states, the inputs at 0 between
events: event inputs are delta currents) the trajectory and the adjoint are propagated exactly, through
exp(A h) and exp(A^T h) derived by `flexgen.frontend.discretize` (method "exact"). For any other neuron the
trajectory is one step of the spec's method (`step`) and the adjoint's rate A(x)^T lambda is printed
(`adjoint_rate`); the reference and the C kernels take substeps of them. The jumps and parameter terms are those of
`flexgen.derive.adjoint`. Every function is elementwise over tensors (one value per neuron).

  flow(h, x, p)                    the states after a time h without spikes nor input events (linear)
  step(h, x, p)                    one step of the spec's method over h (nonlinear)
  adjoint_rate(x, lambda, p)       (df/dx)^T lambda (nonlinear)
  rate(x, p)                       f(x) between events
  threshold(x, p), gdot(x, p)      g and dg/dt = dg/dx . f
  reset(x, p)                      h(x)
  reset_vjp(x, lambda_post, p)     H^T lambda+ and lambda+^T dh/dp (a spike at an input event: its time is fixed)
  spike_adjoint(x, lambda_post, E, p)  lambda- and the spike's parameter terms (a spike where g crosses 0)
  adjoint_flow(h, lambda, p)       exp(A^T h) lambda: the adjoint a time h earlier (linear)
  integrand(x, lambda, p)          lambda^T df/dp
  jacobian(p)                      A = df/dx by rows: the quadrature's panels are short against its rates (linear)
  drive(p)                         b = df/du of the event input
  input_adjoint(x, lambda, w, p)   lambda^T b, w lambda^T db/dp, and the event-time error
"""
import dataclasses

import sympy

from ..errors import SpecError
from ..frontend import discretize
from ..frontend.names import NameAllocator, reserved_names
from ..frontend.ode_system import ContinuousSystem
from .adjoint import derive_adjoint


@dataclasses.dataclass(frozen=True)
class Function:
    """One printed function: its argument symbols, assignments ((symbol, expr), in order) and returned groups
    (each a tuple of expressions, returned as a tuple)."""

    name: str
    args: tuple
    assignments: tuple
    returns: tuple


@dataclasses.dataclass(frozen=True)
class EventPropProgram:
    """The functions of one neuron, with the names of its states, parameters and event input."""

    adjoint: object
    states: tuple
    parameters: tuple
    input: sympy.Symbol
    functions: tuple
    linear: bool
    singular: tuple = ()  # factors of parameters alone that the exact flows divide by (the layer checks them)


def _between_events(system):
    """The system with its event input at 0 (SpecError unless it has one input), and whether it is linear."""
    if len(system.inputs) != 1:
        raise SpecError(f"{system.where}: an EventProp layer drives a neuron with one input (the weighted spikes); "
                        f"{system.name} takes {len(system.inputs)}: {', '.join(map(str, system.inputs))}")
    u = system.inputs[0]
    quiet = dataclasses.replace(system, derivatives=tuple(f.xreplace({u: 0}) for f in system.derivatives))
    return quiet, discretize.linear_offence(quiet) is None


def _integrated(system, h, names, method="exact", singular=None):
    """(assignments, the states after a time h): the exact flow of a linear system, or one step of `method`;
    the parameter factors it divides by are added to the list `singular`."""
    integration = discretize.integrate(system, method, names)
    to_h = {discretize.DT: h}
    assignments = tuple((s, e.xreplace(to_h)) for s, e in integration.assignments)
    if singular is not None:
        singular += [f for f in integration.singular if f not in singular]
    return assignments, tuple(integration.steps)


def derive_program(system, method="rk4"):
    """The `EventPropProgram` of a `ContinuousSystem` (SpecError for a neuron the reference cannot take). A system
    that is not linear between events gets `step` (one step of `method`, the spec's) and `adjoint_rate` instead of
    the exact flows."""
    adj = derive_adjoint(system)
    quiet, linear = _between_events(system)
    u = system.inputs[0]
    states, params = system.states, system.parameters
    lam, lam_post = adj.lambdas, adj.lambdas_post
    taken = set(reserved_names()) | {str(s) for s in states + params + lam + lam_post + system.inputs}
    names = discretize.Names(NameAllocator(taken))
    h, E, w = names("h"), names("E"), names("w")
    at_rest = {u: 0}
    f = sympy.Matrix(quiet.derivatives)
    x = sympy.Matrix(states)

    A = f.jacobian(x)
    singular = []
    if linear:
        flow_assign, flow_steps = _integrated(quiet, h, names, singular=singular)
        back = ContinuousSystem(
            name=f"{system.name}_adjoint", where=system.where, inputs=(), states=tuple(lam), parameters=params,
            derivatives=tuple(A.T * sympy.Matrix(lam)), threshold=None, reset=(), refractory=None, hold=(),
            outputs=())
        back_assign, back_steps = _integrated(back, h, names, singular=singular)
        flows = (Function("flow", (h,) + states + params, flow_assign, (flow_steps,)),
                 Function("adjoint_flow", (h,) + lam + params, back_assign, (back_steps,)),
                 Function("jacobian", params, (), (tuple(A),)))
    else:
        step_assign, step_values = _integrated(quiet, h, names, method)
        flows = (Function("step", (h,) + states + params, step_assign, (step_values,)),
                 Function("adjoint_rate", states + lam + params, (), (tuple(A.T * sympy.Matrix(lam)),)))

    reset = sympy.Matrix(adj.post_states)
    H = reset.jacobian(x)
    reset_vjp = (tuple(H.T * sympy.Matrix(lam_post)),
                 tuple(sympy.expand((sympy.Matrix(lam_post).T * reset.diff(p))[0]) for p in params))
    c = names("c")
    to_quiet = {**at_rest, adj.time_error: E, adj.scale: c}
    (item,) = adj.inputs
    to_w = {item.weight: w, adj.loss_jump[0]: 0, adj.loss_jump[1]: 0}
    functions = flows + (
        Function("rate", states + params, (), (tuple(f),)),
        Function("threshold", states + params, (), ((system.threshold,),)),
        Function("gdot", states + params, (), ((adj.gdot.xreplace(at_rest),),)),
        Function("reset", states + params, (), (tuple(reset),)),
        Function("reset_vjp", states + lam_post + params, (), reset_vjp),
        Function("spike_adjoint", states + lam_post + (E,) + params,
                 ((c, adj.jump_scale().xreplace(to_quiet)),),
                 (tuple(j.xreplace(to_quiet) for j in adj.jump),
                  tuple(e.xreplace(to_quiet) for _, e in adj.spike_parameter_terms))),
        Function("integrand", states + lam + params, (),
                 (tuple(e.xreplace(at_rest) for _, e in adj.parameter_integrands),)),
        Function("drive", params, (), (item.drive,)),
        Function("input_adjoint", states + lam + (w,) + params, (),
                 ((item.weight_gradient,), tuple(e.xreplace(to_w) for _, e in item.parameter_terms),
                  (item.time_error.xreplace(to_w),))),
    )
    return EventPropProgram(adj, states, params, u, functions, linear, tuple(singular))
