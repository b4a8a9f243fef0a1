"""Integration methods for `flexgen.ode`: one step of length dt of dx/dt = f(x, inputs, parameters).

The inputs are held constant over a step (zero-order hold). Every method
returns an `Integration`: named assignments in the step's order, ending in
each state's integrated value, as sympy expressions of the states before the
step, the inputs, the parameters and `dt`. `flexgen.ode` prints them into the
step function it writes.

  exact               f linear in the states, f = A x + b (A, b may hold inputs
                      and parameters): x(t + dt) = x_inf + exp(A dt) (x - x_inf),
                      x_inf = -A^-1 b; for singular A through the exponential of
                      the augmented matrix [[A, b], [0, 0]]
  exponential_euler   each f_i linear in its own state x_i (conditionally linear):
                      x_i is integrated exactly with the other states frozen
  euler               x + dt f(x)
  rk2                 the midpoint method: x + dt f(x + dt/2 f(x))
  rk4                 the classic fourth-order Runge-Kutta method
"""
import dataclasses

import sympy

from ..errors import SpecError

METHODS = ("exact", "exponential_euler", "euler", "rk2", "rk4")
DT = sympy.Symbol("dt", real=True)

# The stability function R(z) of each explicit method: a decaying mode exp(lambda t) is
# propagated as R(lambda dt) per step, which must stay within 1 in magnitude.
_STABILITY = {
    "euler": lambda z: 1 + z,
    "rk2": lambda z: 1 + z + z**2 / 2,
    "rk4": lambda z: 1 + z + z**2 / 2 + z**3 / 6 + z**4 / 24,
}


@dataclasses.dataclass(frozen=True)
class Integration:
    """One step of a method: `assignments` ((symbol, expr), in order), `steps` (each state's integrated
    value, a symbol assigned there), the method, why it was chosen, and `singular`: factors of
    parameters alone that the update divides by (the layer checks they are not zero)."""

    method: str
    reason: str
    assignments: tuple
    steps: tuple
    singular: tuple = ()


class Names:
    """Fresh local names for the written step, never one the equations or the frames use."""

    def __init__(self, allocator):
        self.allocator = allocator

    def __call__(self, stem):
        return sympy.Symbol(self.allocator.fresh(stem), real=True)


def expression_terms(expr):
    """The additive terms of `expr` with products over sums multiplied out (function arguments kept)."""
    return sympy.Add.make_args(sympy.expand(expr, deep=False, power_exp=False, power_base=False, log=False))


def _depends_on(expr, symbols):
    return bool(expr.free_symbols & set(symbols))


def nonlinear_term(expr, states):
    """The first term of `expr` that is not linear in `states` (jointly), or None if `expr` is linear."""
    for term in expression_terms(expr):
        if any(_depends_on(sympy.diff(term, s), states) for s in states):
            return term
    if any(_depends_on(sympy.diff(expr, s), states) for s in states):
        return expr
    return None


def linear_offence(system):
    """(state, term) of the first equation term that is not linear in the states, or None."""
    for state, f in zip(system.states, system.derivatives):
        term = nonlinear_term(f, system.states)
        if term is not None:
            return state, term
    return None


def conditional_offence(system):
    """(state, term) of the first equation term that is not linear in its own state, or None."""
    for state, f in zip(system.states, system.derivatives):
        term = nonlinear_term(f, [state])
        if term is not None:
            return state, term
    return None


def _offence_message(system, method, offence, requirement):
    state, term = offence
    return (
        f"{system.where}: method {method!r} needs {requirement}; in the equation "
        f"d{state}/dt = {sympy.sstr(system.rhs(state))} "
        f"the term {sympy.sstr(term)} is not. Use method='rk4' (or 'euler', 'rk2'), or method='auto'"
    )


def choose(system, method):
    """The method to use and why: `method` itself, or for "auto" exact, exponential Euler or RK4, the
    first that applies. SpecError where the requested method does not apply to the equations."""
    if method not in METHODS + ("auto",):
        raise SpecError(f"{system.where}: method must be 'auto' or one of {METHODS}, got {method!r}")
    linear = linear_offence(system)
    conditional = conditional_offence(system)
    if method == "auto":
        if linear is None:
            return "exact", "auto: the equations are linear in the states"
        if conditional is None:
            return "exponential_euler", (
                f"auto: the equations are not linear in the states (d{linear[0]}/dt has {sympy.sstr(linear[1])}), "
                "but each is linear in its own state"
            )
        return "rk4", (
            f"auto: d{conditional[0]}/dt is not linear in {conditional[0]} (the term {sympy.sstr(conditional[1])})"
        )
    if method == "exact" and linear is not None:
        raise SpecError(_offence_message(system, method, linear, "equations linear in the states"))
    if method == "exponential_euler" and conditional is not None:
        raise SpecError(_offence_message(system, method, conditional, "each equation linear in its own state"))
    return method, "requested"


class Oscillates(SpecError):
    """The exact solution of a linear system with complex eigenvalues, which needs sin/cos."""


def integrate(system, method, names):
    """The `Integration` of `system` (a `flexgen.frontend.ode_system.ContinuousSystem`) by `method` ("auto" allowed)."""
    chosen, reason = choose(system, method)
    try:
        assignments, steps, singular = _METHODS[chosen](system, names)
    except Oscillates:
        if method != "auto":
            raise
        chosen, reason = "rk4", "auto: the equations are linear, but their exact solution oscillates (sin/cos)"
        assignments, steps, singular = _METHODS[chosen](system, names)
    return Integration(chosen, reason, tuple(assignments), tuple(steps), tuple(singular))


def _simplified(expr):
    """A tidy form of a coefficient: cancelled as a rational function where that makes it shorter."""
    cancelled = sympy.cancel(sympy.together(expr))
    return cancelled if sympy.count_ops(cancelled) <= sympy.count_ops(expr) else expr


def parameter_factors(exprs, per_step):
    """The factors of the denominators of `exprs` that hold no per-step symbol (inputs, states):
    the values of the parameters for which the update would divide by zero."""
    factors = set()
    for expr in exprs:
        _, denominator = sympy.fraction(sympy.together(expr))
        for factor, _ in sympy.factor_list(denominator)[1]:
            never_zero = factor.is_positive or isinstance(factor, sympy.exp)
            if factor.free_symbols and not _depends_on(factor, per_step) and not never_zero:
                factors.add(factor)
    return sorted(factors, key=sympy.default_sort_key)


def _scalar_exact(state, a, b, names, assignments):
    """x' = x_inf + (x - x_inf) exp(a dt), x_inf = -b/a: dx/dt = a x + b solved over one step (a, b
    constant over it). For a = 0, x + dt b. Returns the integrated value's symbol and what it divides by."""
    step = names(f"{state}_step")
    if a == 0:
        assignments.append((step, state + DT * b))
        return step, []
    phi = names(f"phi_{state}")
    assignments.append((phi, sympy.exp(_simplified(a) * DT)))
    steady = _simplified(-b / a)
    if not steady.is_Atom:
        inf = names(f"{state}_inf")
        assignments.append((inf, steady))
        steady = inf
    assignments.append((step, steady + (state - steady) * phi))
    return step, [a]


def _linear_parts(system):
    states = sympy.Matrix(system.states)
    f = sympy.Matrix(system.derivatives)
    A = f.jacobian(states).applyfunc(_simplified)
    b = f.subs({s: 0 for s in system.states}).applyfunc(_simplified)
    return A, b


def _exact(system, names):
    A, b = _linear_parts(system)
    assignments, steps, divisors = [], [], []
    if A.is_diagonal():
        for k, state in enumerate(system.states):
            step, d = _scalar_exact(state, A[k, k], b[k], names, assignments)
            steps.append(step)
            divisors += d
        return assignments, steps, _divisors(system, divisors, assignments)
    return _coupled_exact(system, A, b, names)


def _divisors(system, divisors, assignments):
    """The parameter factors the update divides by: those of `divisors` (what it divides by) and of the
    denominators in its assignments."""
    return parameter_factors([1 / d for d in divisors] + [expr for _, expr in assignments], system.per_step())


def _check_real(system, exprs):
    for expr in exprs:
        if expr.has(sympy.I) or expr.atoms(sympy.sin, sympy.cos):
            raise Oscillates(
                f"{system.where}: the exact solution of these linear equations oscillates (their matrix has complex "
                "eigenvalues) and needs sin/cos, which flexgen steps do not have; use method='rk4'"
            )


def _coupled_exact(system, A, b, names):
    """exp(A dt) for a coupled linear system; the affine part through x_inf or the augmented matrix."""
    n = len(system.states)
    phi = (A * DT).exp().applyfunc(_simplified)
    _check_real(system, phi)
    assignments, coefficient, named = [], {}, {}
    diagonal_first = sorted(((i, j) for i in range(n) for j in range(n)), key=lambda ij: ij[0] != ij[1])
    for i, j in diagonal_first:
        entry = sympy.factor_terms(phi[i, j].xreplace(named))  # off-diagonal entries in terms of the diagonal
        if entry.is_Number:
            coefficient[i, j] = entry
            continue
        row, col = system.states[i], system.states[j]
        coefficient[i, j] = names(f"phi_{row}" if i == j else f"phi_{row}_{col}")
        assignments.append((coefficient[i, j], entry))
        named.setdefault(phi[i, j], coefficient[i, j])
    determinant = _simplified(A.det())
    steps = []
    if determinant != 0:
        steady = (-A.LUsolve(b)).applyfunc(_simplified)
        offsets = []
        for state, value in zip(system.states, steady):
            if not value.is_Atom:
                inf = names(f"{state}_inf")
                assignments.append((inf, value))
                value = inf
            offsets.append(value)
        for i, state in enumerate(system.states):
            step = names(f"{state}_step")
            assignments.append((step, offsets[i] + sum(coefficient[i, j] * (x - offsets[j])
                                                       for j, x in enumerate(system.states))))
            steps.append(step)
        divisors = [determinant]
    else:
        augmented = A.row_join(b).col_join(sympy.zeros(1, n + 1))
        forcing = (augmented * DT).exp()[:n, n].applyfunc(_simplified)
        _check_real(system, forcing)
        for i, state in enumerate(system.states):
            step = names(f"{state}_step")
            assignments.append((step, sum(coefficient[i, j] * x for j, x in enumerate(system.states)) + forcing[i]))
            steps.append(step)
        divisors = []
    return assignments, steps, _divisors(system, divisors, assignments)


def _exponential_euler(system, names):
    assignments, steps, divisors = [], [], []
    for state, f in zip(system.states, system.derivatives):
        a = _simplified(sympy.diff(f, state))
        b = _simplified(f.subs(state, 0))
        step, d = _scalar_exact(state, a, b, names, assignments)
        steps.append(step)
        divisors += d
    return assignments, steps, _divisors(system, divisors, assignments)


def _slopes(system, values, stage, names, assignments):
    """The right-hand sides at the state values `values` (symbols), assigned as d<state>_<stage>."""
    at = dict(zip(system.states, values))
    slopes = []
    for state, f in zip(system.states, system.derivatives):
        slope = names(f"d{state}_{stage}" if stage else f"d{state}")
        assignments.append((slope, f.xreplace(at)))
        slopes.append(slope)
    return slopes


def _stage_values(system, slopes, fraction, stage, names, assignments):
    values = []
    for state, slope in zip(system.states, slopes):
        value = names(f"{state}_{stage}")
        assignments.append((value, state + fraction * DT * slope))
        values.append(value)
    return values


def _finish(system, increments, names, assignments):
    steps = []
    for state, increment in zip(system.states, increments):
        step = names(f"{state}_step")
        assignments.append((step, state + DT * increment))
        steps.append(step)
    return assignments, steps, []


def _euler(system, names):
    assignments = []
    slopes = _slopes(system, system.states, None, names, assignments)
    return _finish(system, slopes, names, assignments)


def _rk2(system, names):
    assignments = []
    k1 = _slopes(system, system.states, 1, names, assignments)
    k2 = _slopes(system, _stage_values(system, k1, sympy.Rational(1, 2), 2, names, assignments), 2, names, assignments)
    return _finish(system, k2, names, assignments)


def _rk4(system, names):
    assignments = []
    k1 = _slopes(system, system.states, 1, names, assignments)
    k2 = _slopes(system, _stage_values(system, k1, sympy.Rational(1, 2), 2, names, assignments), 2, names, assignments)
    k3 = _slopes(system, _stage_values(system, k2, sympy.Rational(1, 2), 3, names, assignments), 3, names, assignments)
    k4 = _slopes(system, _stage_values(system, k3, 1, 4, names, assignments), 4, names, assignments)
    increments = [(a + 2 * b + 2 * c + d) / 6 for a, b, c, d in zip(k1, k2, k3, k4)]
    return _finish(system, increments, names, assignments)


_METHODS = {
    "exact": _exact,
    "exponential_euler": _exponential_euler,
    "euler": _euler,
    "rk2": _rk2,
    "rk4": _rk4,
}


def unstable_mode(method, jacobian, dt):
    """For an explicit method, (eigenvalue, |R(eigenvalue dt)|, eigenvector) of the first decaying mode of
    the linearised equations (`jacobian`, a numpy matrix) that the method amplifies at step `dt`, or None."""
    import numpy

    if method not in _STABILITY:
        return None
    eigenvalues, vectors = numpy.linalg.eig(jacobian)
    for k, lam in enumerate(eigenvalues):
        growth = abs(_STABILITY[method](lam * dt))
        if lam.real < 0 and growth > 1.0 + 1e-12:
            return lam, growth, vectors[:, k]
    return None


def stable_dt(method, eigenvalue):
    """The largest step at which `method` keeps the mode `eigenvalue` from growing (bisection on |R|)."""
    low, high = 0.0, 10.0 / abs(eigenvalue)
    for _ in range(60):
        middle = (low + high) / 2
        if abs(_STABILITY[method](eigenvalue * middle)) <= 1.0:
            low = middle
        else:
            high = middle
    return low
