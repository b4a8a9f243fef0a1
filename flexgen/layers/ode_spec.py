"""Continuous-time neurons: write the differential equations, flexgen derives the step.

    >>> import torch, flexgen
    >>> @flexgen.ode(states=("v",), dt=0.5)
    ... def leaky(x, v, tau=10.0, v_th=1.0, v_reset=0.0):
    ...     return flexgen.Dynamics({"v": (x - v) / tau}, threshold=v >= v_th, reset={"v": v_reset})
    >>> leaky.method
    'exact'
    >>> leaky(backend="eager")(torch.full((40, 1), 2.0)).sum().item()
    2.0

The equations function is traced once on symbols (the language of a step
function: arithmetic and the flexgen math functions), giving the continuous
system. `flexgen.frontend.discretize` integrates it over one step of length `dt` (a
runtime hyper-parameter) by the chosen method, and `flexgen.frontend.ode_step` writes
that as an ordinary step function, with the threshold, reset and refractory
period as the step's events. The result is a `NeuronSpec` (an `OdeSpec`):
layers, backends, learnable parameters, surrogates, recompute, the cache and
the CLI are the ones of every neuron. `OdeSpec.equations()` starts with the
continuous system and its discretisation. (This module is `flexgen.layers.ode_spec`:
the name `flexgen.ode` is the decorator.)
"""
import dataclasses
import functools
import math
import numbers
import warnings

import sympy

from ..frontend import discretize, trace as tracing
from ..errors import SpecError
from ..frontend.names import NameAllocator, reserved_names
from ..frontend.ode_step import COUNTER, write_step
from .spec import NeuronSpec, _check_captured, _location, parse_signature
from ..frontend.surrogate import Sigmoid, Surrogate
from ..frontend.symbolic import SpikeBase, detach

ADDED = ("dt", "surrogate", "detach_reset", COUNTER)  # names the written step adds to the equations' parameters


class StiffnessWarning(UserWarning):
    """An explicit method at a step size that amplifies a decaying mode of the equations."""


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


class _WholeExpressions(tracing._Recorder):
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


def _check_names(signature, where):
    if "dt" in signature.parameters:
        raise SpecError(
            f"{where}: the equations take a parameter named 'dt'. flexgen.ode adds the step size dt itself (a "
            "hyper-parameter, default flexgen.ode(dt=...)), and the equations must not use it: they state the rate "
            "of change (dv/dt), not the change over one step"
        )
    taken = [n for n in ADDED if n in signature.parameters]
    if taken:
        raise SpecError(f"{where}: the parameter name {taken[0]!r} is one flexgen.ode adds to the step; rename it")
    if signature.static:
        name = signature.static[0]
        raise SpecError(
            f"{where}: parameter {name!r} is a specialisation option (default {signature.defaults[name]!r}); the "
            "equations take numbers only. The step flexgen writes has the options `surrogate` and `detach_reset`"
        )


def ode(states, method="auto", dt=1.0, learnable=(), init=None, surrogate=Sigmoid()):
    """Decorator: a neuron from its differential equations (see the module docstring).

    The function takes the per-step inputs (no default), the states (named in
    `states`) and numeric parameters, and returns `flexgen.Dynamics`. `method`:
    "exact", "exponential_euler", "euler", "rk2", "rk4" or "auto" (exact
    where the equations are linear in the states, exponential Euler where each
    is linear in its own state, else RK4; `spec.method` and `equations()` say
    which). `dt` is the default step size, a hyper-parameter of the layer like
    the function's own. `surrogate` is the default of the step's `surrogate`
    option; `detach_reset=True` (a layer option) stops the reset's gradient.
    `learnable` and `init` are those of `flexgen.neuron`.
    """
    if callable(states) and not isinstance(states, (tuple, list, str)):
        raise SpecError("use @flexgen.ode(states=(...)) with parentheses")
    if isinstance(states, str):
        states = (states,)
    if isinstance(learnable, str):
        learnable = (learnable,)
    if not isinstance(dt, numbers.Real) or isinstance(dt, bool) or not math.isfinite(dt) or dt <= 0:
        raise SpecError(f"flexgen.ode: dt must be a positive number (the default step size), got {dt!r}")
    if not isinstance(surrogate, Surrogate):
        raise SpecError(f"flexgen.ode: surrogate must be a flexgen.surrogate.Surrogate, got {surrogate!r}")

    def decorate(fn):
        signature = parse_signature(fn, states, learnable, init)
        where = f"flexgen.ode {_location(fn)}"
        _check_captured(fn, where)
        _check_names(signature, where)
        system = trace_equations(fn, signature, where)
        names = discretize.Names(NameAllocator(set(reserved_names()) | set(signature.parameters) | set(ADDED)))
        integration = discretize.integrate(system, method, names)
        step = write_step(fn, signature, system, integration, names, float(dt), surrogate)
        step_states = signature.states + ((COUNTER,) if system.refractory is not None else ())
        return OdeSpec(step.function, system, integration, step.body, states=step_states,
                       learnable=signature.learnable, init=signature.init)

    return decorate


class OdeSpec(NeuronSpec):
    """The `NeuronSpec` of `flexgen.ode`: its step function is the one flexgen wrote from the equations
    (`spec.fn`, whose source `inspect.getsource` shows). Adds the continuous system and its
    discretisation to `equations()`, and checks the parameters when a layer is made: dt > 0, no
    division by zero in the update (exact solutions divide by differences of rates), and a
    `StiffnessWarning` where an explicit method's step is too long for the equations."""

    rebuild = None  # (factory, args) of a spec made by a factory (flexgen.interop.nir): pickled as that call

    def __init__(self, fn, system, integration, discrete, states=(), learnable=(), init=None):
        super().__init__(fn, states=states, learnable=learnable, init=init)
        self.system, self.integration, self.discrete = system, integration, discrete

    def __reduce__(self):
        return self.rebuild if self.rebuild is not None else super().__reduce__()

    @property
    def method(self):
        """The integration method in use ("auto" resolved)."""
        return self.integration.method

    def describe(self):
        """The continuous system and the derived discrete update, as text (the start of `equations()`)."""
        lines = [f"# {self.name}: continuous-time equations (flexgen.ode)"]
        lines += self.system.lines()
        lines.append(f"\n# discretised: method {self.method} ({self.integration.reason}); the inputs are held "
                     "constant over a step of length dt")
        lines += self.discrete
        return "\n".join(lines) + "\n"

    def equations(self, **static):
        """The continuous system, its discrete update, then the derived forward, saved set and backward."""
        return self.describe() + "\n" + super().equations(**static)

    def __call__(self, step_mode="m", store_state_seqs=False, backend="auto", recompute="auto", **params):
        self.check_parameters(params)
        return super().__call__(step_mode=step_mode, store_state_seqs=store_state_seqs, backend=backend,
                                recompute=recompute, **params)

    def apply(self, *inputs, states=None, backend="auto", store_state_seqs=False, recompute="auto", **params):
        self.check_parameters(params)
        return super().apply(*inputs, states=states, backend=backend, store_state_seqs=store_state_seqs,
                             recompute=recompute, **params)

    def parameter_values(self, params):
        """name -> numpy array of every hyper- and learnable parameter's value for these overrides."""
        import numpy

        values = {}
        for name in self.signature.hyper + self.signature.learnable:
            value = params.get(name, self.signature.defaults[name])
            if hasattr(value, "detach"):
                value = value.detach().cpu().double().numpy()
            values[name] = numpy.asarray(value, dtype=float)
        return values

    def check_parameters(self, params):
        """ValueError for a step size or parameters the update cannot take; StiffnessWarning (see the class)."""
        values = self.parameter_values(params)
        dt = values["dt"]
        if dt.ndim or not math.isfinite(float(dt)) or float(dt) <= 0:
            raise ValueError(f"{self.name}: dt must be a positive number (the step size), got {params.get('dt')!r}")
        self._check_divisors(values)
        self._check_refractory(values)
        self._check_initial_state(values)
        self._check_stability(values)

    @functools.cached_property
    def _divisor_checks(self):
        """(factor, parameter names, its value, the sum of its terms' magnitudes) as numpy functions."""
        checks = []
        for factor in self.integration.singular:
            names = sorted(map(str, factor.free_symbols))
            symbols = [sympy.Symbol(n, real=True) for n in names]
            magnitude = sympy.Add(*map(sympy.Abs, sympy.Add.make_args(factor)))
            checks.append((factor, names, sympy.lambdify(symbols, factor, "numpy"),
                           sympy.lambdify(symbols, magnitude, "numpy")))
        return checks

    def _check_divisors(self, values):
        import numpy

        for factor, names, value, magnitude in self._divisor_checks:
            args = [values[n] for n in names]
            if numpy.any(numpy.abs(value(*args)) <= 1e-9 * numpy.abs(magnitude(*args))):  # 0 up to rounding
                given = ", ".join(f"{n}={values[n].tolist()}" for n in names)
                raise ValueError(
                    f"{self.name}: the {self.method} update divides by {factor}, which is 0 for {given}; make the "
                    f"values differ, or use another method (flexgen.ode(..., method='rk4'))"
                )

    @functools.cached_property
    def finite_learnable(self):
        """Learnable parameters the refractory period reads -> why they must be finite: a NaN or infinite period
        leaves the refractory counter NaN, which never counts, so the neuron would silently have none."""
        if self.system.refractory is None:
            return {}
        reads = {str(s) for s in self.system.refractory.free_symbols}
        period = sympy.sstr(self.system.refractory)
        return {name: f"the refractory period {period} reads it, and a period that is not a finite number would "
                      "mean no refractory period on every backend"
                for name in self.signature.learnable if name in reads}

    def _check_refractory(self, values):
        """A ValueError for a refractory period's parameter that is NaN or infinite; a warning for a period too
        short to silence a single step."""
        import numpy

        if self.system.refractory is None:
            return
        names = sorted(map(str, self.system.refractory.free_symbols))
        for name in names:
            if not numpy.all(numpy.isfinite(values[name])):
                what = "NaN" if numpy.any(numpy.isnan(values[name])) else "infinite"
                raise ValueError(f"{self.name}: the parameter {name!r} is {what}; it must be a finite number "
                                 f"({self.finite_learnable.get(name) or 'the refractory period reads it'})")
        period = sympy.lambdify([sympy.Symbol(n, real=True) for n in names], self.system.refractory, "numpy")
        period = numpy.asarray(period(*[values[n] for n in names]), dtype=float)
        dt = float(values["dt"])
        if numpy.any((period > 0) & (period < dt / 2)):
            warnings.warn(
                f"{self.name}: the refractory period {sympy.sstr(self.system.refractory)} = {period.tolist()} "
                f"is shorter than half a step (dt={dt:g}), so no step is refractory; "
                "it lasts round(period / dt) steps",
                UserWarning, stacklevel=4,
            )

    def _initial_point(self, values, input_value=0.0):
        """symbol -> value: the states at their initial values, the inputs at `input_value`, every parameter with
        one value (those with one per channel stay symbols)."""
        system = self.system
        point = {s: self._initial(s, values) for s in system.states}
        point.update({x: input_value for x in system.inputs})
        point.update({s: float(values[str(s)]) for s in system.parameters if values[str(s)].ndim == 0})
        return point

    def _check_initial_state(self, values):
        """ValueError where a derivative is not a finite real number at the initial state (inputs 0 or 1): the
        first step would make the states NaN or infinite on every backend."""
        system = self.system
        for input_value in (0.0, 1.0):
            point = self._initial_point(values, input_value)
            for state in system.states:
                value = system.rhs(state).xreplace(point)
                if value.free_symbols:  # a parameter with one value per channel: not checked
                    continue
                if value.has(sympy.nan, sympy.zoo, sympy.oo, -sympy.oo) or value.is_extended_real is False:
                    start = ", ".join(f"{s}={point[s]:g}" for s in system.states)
                    inputs = ", ".join(f"{x}={input_value:g}" for x in system.inputs)
                    raise ValueError(
                        f"{self.name}: d{state}/dt = {sympy.sstr(system.rhs(state))} is {_not_finite(value)} "
                        f"at the initial state ({start}) with {inputs}, so the first step would make the states NaN "
                        "or infinite; start the states where the equations are defined (flexgen.ode(..., init={...})) "
                        "or change the equations"
                    )

    def _check_stability(self, values):
        import numpy

        system = self.system
        if self.method not in ("euler", "rk2", "rk4"):
            return
        point = self._initial_point(values)
        jacobian = sympy.Matrix(system.derivatives).jacobian(sympy.Matrix(system.states)).xreplace(point)
        if jacobian.free_symbols:  # a parameter with one value per channel: not checked
            return
        try:
            numeric = numpy.array(jacobian.evalf(), dtype=float)
        except TypeError:  # not a real number at the initial state
            return
        if not numpy.all(numpy.isfinite(numeric)):  # e.g. sqrt(v) from v = 0: finite, but no linearisation there
            return
        dt = float(values["dt"])
        mode = discretize.unstable_mode(self.method, numeric, dt)
        if mode is None:
            return
        eigenvalue, growth, vector = mode
        state = system.states[int(numpy.argmax(numpy.abs(vector)))]
        warnings.warn(
            f"{self.name}: method {self.method!r} with dt={dt:g} amplifies a decaying mode of the equations "
            f"(linearised at the initial state: eigenvalue {eigenvalue:.4g}, mostly d{state}/dt = "
            f"{sympy.sstr(system.rhs(state))}) by {growth:.3g} per step, so the solution oscillates or diverges; "
            f"use dt < {discretize.stable_dt(self.method, eigenvalue):.3g}, or method='exact'/'exponential_euler' "
            "where they apply",
            StiffnessWarning, stacklevel=4,
        )

    def _initial(self, state, values):
        value = self.signature.init[str(state)]
        if isinstance(value, str):
            return float(values[value])
        return float(value)


def _not_finite(value):
    if value.has(sympy.nan):
        return "undefined (NaN)"
    if value.has(sympy.zoo, sympy.oo, -sympy.oo):
        return "infinite"
    return f"not a real number ({value})"


__all__ = ["ode", "Dynamics", "OdeSpec", "ContinuousSystem", "StiffnessWarning"]
