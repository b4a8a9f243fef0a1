"""The equations of `flexgen.ode`, traced: an equations function returns `Dynamics`, which `trace_equations` reads
on symbols into a `ContinuousSystem` (sympy expressions of the inputs, states and parameters), the system that
`flexgen.frontend.discretize` integrates over one step."""
import dataclasses

import sympy

from . import trace as tracing
from ..errors import SpecError
from .ode_step import COUNTER
from .symbolic import SpikeBase, detach


@dataclasses.dataclass(frozen=True)
class Dynamics:
    """What an equations function of `flexgen.ode` returns.

    derivatives: {state: dstate/dt}, one entry per state, in the function's
        variables (continuous in time: no dt, no spikes).
    threshold: the neuron fires where this expression is >= 0, or where this
        comparison holds (`v >= v_th`), tested on the states after the step's
        integration. None: a neuron without spikes (give `outputs`).
    reset: {state: value} assigned where it fired, all from the states after
        the integration (`{"v": v_reset, "w": w + b}`).
    refractory: a refractory period (an expression of parameters, in the
        time unit of dt): after a spike the neuron cannot fire for
        round(refractory / dt) steps, and the states in `hold` keep their value.
    hold: the states frozen while refractory (default: those in `reset`).
    outputs: more outputs after the spike (or the outputs of a neuron without
        threshold), expressions of the states after the integration.
    """

    derivatives: dict
    threshold: object = None
    reset: dict = dataclasses.field(default_factory=dict)
    refractory: object = None
    hold: tuple = None
    outputs: tuple = ()


@dataclasses.dataclass(frozen=True)
class ContinuousSystem:
    """The traced equations: sympy expressions of the input, state and parameter symbols."""

    name: str
    where: str
    inputs: tuple
    states: tuple
    parameters: tuple
    derivatives: tuple
    threshold: object
    reset: tuple
    refractory: object
    hold: tuple
    outputs: tuple

    def rhs(self, state):
        return self.derivatives[self.states.index(state)]

    def per_step(self):
        """The symbols that change from step to step: inputs and states."""
        return self.inputs + self.states

    def lines(self):
        """The system as text, one equation or event per line."""
        lines = [f"d{s}/dt = {sympy.sstr(f)}" for s, f in zip(self.states, self.derivatives)]
        if self.threshold is not None:
            event = f"fires where {sympy.sstr(self.threshold)} >= 0 (tested after the step's integration)"
            if self.reset:
                event += "; then " + ", ".join(f"{s} <- {sympy.sstr(e)}" for s, e in self.reset)
            lines.append(event)
        if self.refractory is not None:
            held = ", ".join(map(str, self.hold)) or "no state"
            lines.append(f"refractory for {sympy.sstr(self.refractory)} after a spike "
                         f"(counted by the state {COUNTER}): no spike, {held} held")
        if self.outputs:
            lines.append("outputs: " + ", ".join(sympy.sstr(o) for o in self.outputs))
        return lines


class _WholeExpressions(tracing.Recorder):
    """Tracing without nodes: every operation gives the whole sympy expression (the equations are
    analysed as formulas; the step flexgen writes from them is traced as usual)."""

    def emit(self, expr):
        return tracing.Var(self, expr)


def _call_on_symbols(fn, signature, where):
    """Call the equations function on symbols; returns its Dynamics and the symbol of every parameter."""
    recorder = _WholeExpressions(fn)
    symbols = {name: sympy.Symbol(name, real=True) for name in signature.parameters}
    try:
        result = fn(**{name: tracing.Var(recorder, s) for name, s in symbols.items()})
    except SpecError:
        raise
    except Exception as exc:  # a failure inside the user's equations is a spec problem
        line = _failing_line(exc, fn)
        raise SpecError(f"{where}: evaluating the equations failed{line}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(result, Dynamics):
        raise SpecError(f"{where}: an equations function must return flexgen.Dynamics(...), "
                        f"got {type(result).__name__}")
    return result, symbols, recorder


def _failing_line(exc, fn):
    tb, line = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code is fn.__code__:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" at line {line}" if line else ""


def _expression(value, what, recorder, where, continuous=False):
    try:
        expr = tracing.to_sympy(value, recorder)
    except SpecError as exc:
        raise SpecError(f"{where}: {what}: {exc}") from None
    if tracing.is_condition(expr):
        raise SpecError(f"{where}: {what} is a condition; it must be a number (use flexgen.where(cond, a, b))")
    if expr.atoms(SpikeBase):
        raise SpecError(f"{where}: {what} uses flexgen.spike; spikes come from `threshold=` (flexgen fires and resets)")
    if continuous and expr.atoms(detach):
        raise SpecError(f"{where}: {what} uses flexgen.detach; a derivative has no gradient to stop (the step is "
                        "differentiated as a whole)")
    return expr


def _threshold(value, recorder, where):
    """The threshold as an expression z that fires where z >= 0."""
    if value is None:
        return None
    expr = tracing.to_sympy(value, recorder) if isinstance(value, (tracing.Var, bool)) else value
    if isinstance(expr, sympy.logic.boolalg.BooleanAtom):  # `True`, or a comparison of two constants
        raise SpecError(f"{where}: threshold is always {expr} "
                        f"(the neuron would fire {'at every step' if expr else 'never'});"
                        " it must depend on the states, e.g. `v >= v_th`")
    if isinstance(expr, (sympy.GreaterThan, sympy.StrictGreaterThan)):
        expr = expr.lhs - expr.rhs
    elif isinstance(expr, (sympy.LessThan, sympy.StrictLessThan)):
        expr = expr.rhs - expr.lhs
    elif tracing.is_condition(expr):
        raise SpecError(f"{where}: threshold must be an expression (fires where >= 0) or one comparison such as "
                        f"`v >= v_th`, got {expr}")
    return _expression(expr, "threshold", recorder, where)


def _state_map(mapping, what, states, where):
    if not isinstance(mapping, dict):
        raise SpecError(f"{where}: {what} must be a dict {{state name: expression}}, got {type(mapping).__name__}")
    unknown = [k for k in mapping if k not in states]
    if unknown:
        raise SpecError(f"{where}: {what} names {unknown[0]!r}, which is not a state (states: {', '.join(states)})")
    return mapping


def trace_equations(fn, signature, where):
    """The `ContinuousSystem` of an equations function (SpecError for anything flexgen cannot integrate)."""
    dynamics, symbols, recorder = _call_on_symbols(fn, signature, where)
    states = signature.states
    derivatives = _state_map(dynamics.derivatives, "the derivatives", states, where)
    missing = [s for s in states if s not in derivatives]
    if missing:
        raise SpecError(f"{where}: no derivative for the state {missing[0]!r}; give d{missing[0]}/dt in "
                        "Dynamics({...}) (0.0 for a state that changes only at spikes)")
    reset = _state_map(dynamics.reset or {}, "reset", states, where)
    if dynamics.threshold is None and (reset or dynamics.refractory is not None):
        raise SpecError(f"{where}: reset and refractory need a threshold (when does the neuron fire?)")
    threshold = _threshold(dynamics.threshold, recorder, where)
    outputs = tuple(_expression(o, f"output #{k}", recorder, where) for k, o in enumerate(_as_tuple(dynamics.outputs)))
    if threshold is None and not outputs:
        raise SpecError(f"{where}: a neuron without threshold has no spikes to output; name its outputs with "
                        "Dynamics(..., outputs=(v,))")
    parameters = tuple(symbols[n] for n in signature.hyper + signature.learnable)
    refractory = _refractory(dynamics.refractory, recorder, parameters, where)
    hold = tuple(dynamics.hold) if dynamics.hold is not None else tuple(reset)
    _state_map(dict.fromkeys(hold), "hold", states, where)
    return ContinuousSystem(
        name=fn.__name__,
        where=where,
        inputs=tuple(symbols[n] for n in signature.inputs),
        states=tuple(symbols[n] for n in states),
        parameters=parameters,
        derivatives=tuple(_expression(derivatives[s], f"d{s}/dt", recorder, where, continuous=True) for s in states),
        threshold=threshold,
        reset=tuple((symbols[s], _expression(e, f"the reset of {s}", recorder, where)) for s, e in reset.items()),
        refractory=refractory,
        hold=tuple(symbols[s] for s in hold) if refractory is not None else (),
        outputs=outputs,
    )


def _as_tuple(outputs):
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def _refractory(value, recorder, parameters, where):
    if value is None:
        return None
    expr = _expression(value, "refractory", recorder, where)
    if not expr.free_symbols <= set(parameters):
        extra = ", ".join(sorted(map(str, expr.free_symbols - set(parameters))))
        raise SpecError(f"{where}: refractory must be a number or an expression of parameters; it reads {extra}")
    return expr
