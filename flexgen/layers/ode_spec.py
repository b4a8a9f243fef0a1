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
system (`flexgen.frontend.ode_system`). `flexgen.frontend.discretize` integrates it over one step of length `dt` (a
runtime hyper-parameter) by the chosen method, and `flexgen.frontend.ode_step` writes
that as an ordinary step function, with the threshold, reset and refractory
period as the step's events. The result is a `NeuronSpec` (an `OdeSpec`):
layers, backends, learnable parameters, surrogates, recompute, the cache and
the CLI are the ones of every neuron. `OdeSpec.equations()` starts with the
continuous system and its discretisation. (This module is `flexgen.layers.ode_spec`:
the name `flexgen.ode` is the decorator.)
"""
import functools
import math
import numbers
import warnings

import sympy

from ..errors import SpecError
from ..frontend import discretize
from ..frontend.names import NameAllocator, reserved_names
from ..frontend.ode_step import COUNTER, write_step
from ..frontend.ode_system import ContinuousSystem, Dynamics, trace_equations
from ..frontend.surrogate import Sigmoid, Surrogate
from .spec import NeuronSpec, _check_captured, _location, parse_signature

ADDED = ("dt", "surrogate", "detach_reset", COUNTER)  # names the written step adds to the equations' parameters


class StiffnessWarning(UserWarning):
    """An explicit method at a step size that amplifies a decaying mode of the equations."""


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


def divisor_checks(factors):
    """(factor, parameter names, its value, the sum of its terms' magnitudes) as numpy functions, for each
    factor of parameters alone that an update divides by."""
    checks = []
    for factor in factors:
        names = sorted(map(str, factor.free_symbols))
        symbols = [sympy.Symbol(n, real=True) for n in names]
        magnitude = sympy.Add(*map(sympy.Abs, sympy.Add.make_args(factor)))
        checks.append((factor, names, sympy.lambdify(symbols, factor, "numpy"),
                       sympy.lambdify(symbols, magnitude, "numpy")))
    return checks


def check_divisors(owner, what, checks, values,
                   advice="make the values differ, or use another method (flexgen.ode(..., method='rk4'))"):
    """A ValueError where a factor of `checks` (`divisor_checks`) is 0 up to rounding for the parameter `values`
    (name -> number or array): `what` ("the exact update", ...) would divide by zero, giving NaN."""
    import numpy

    for factor, names, value, magnitude in checks:
        args = [numpy.asarray(values[n], dtype=float) for n in names]
        if numpy.any(numpy.abs(value(*args)) <= 1e-9 * numpy.abs(magnitude(*args))):  # 0 up to rounding
            given = ", ".join(f"{n}={numpy.asarray(values[n]).tolist()}" for n in names)
            raise ValueError(
                f"{owner}: {what} divides by {factor}, which is 0 for {given}; {advice}"
            )


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

    def adjoint(self):
        """The EventProp adjoint system of the equations (`flexgen.derive.adjoint.AdjointSystem`)."""
        from ..derive.adjoint import derive_adjoint

        return derive_adjoint(self.system)

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
        return divisor_checks(self.integration.singular)

    def _check_divisors(self, values):
        check_divisors(self.name, f"the {self.method} update", self._divisor_checks, values)

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
