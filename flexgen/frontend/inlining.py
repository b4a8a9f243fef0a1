"""Which substitutions keep what a step computes: the rule behind every place flexgen inlines a value.

Stages 2 to 4 substitute one assignment's expression into another's: derive writes the backward in
terms of the saved values, the printers inline values used once. sympy simplifies while it
substitutes, and some of its simplifications change the kernels' results or their size. A
substitution is refused, and the value stays a variable computed as the step wrote it, when the
result would

* hold more than `MAX_SIZE` nodes or nest deeper than `MAX_DEPTH`: substituting values that are used
  several times into each other turns the step's graph into a tree, exponentially larger than the
  graph for chains of `where`, `h ** h` and the like (a DAG must stay a DAG), and deep nesting is
  more than Python's parser takes;
* contain a value that is not a finite real number: `1 / p` with `p = maximum(a, 0)` becomes
  `Piecewise((1/a, a >= 0), (zoo, True))`, while the step as written divides by +0.0 (inf);
* contain a constant that fp32 (the narrowest arithmetic the kernels run in) cannot hold as a normal
  number and that the operands did not contain, such as 0.5**128 from squaring `0.5 * x` seven times;
* raise a scaled value to an integer power, which sympy distributes: `(c*x)**k` becomes
  `c**k * x**k`, and `x**k` overflows where `(c*x)**k` does not;
* put a `where` (a Piecewise) into a condition: sympy then solves the inequality to simplify the
  Piecewise, which takes seconds per level of a chain of `where`s.

Constants are always substituted (a target never holds a bare number: `torch.tanh(1.0)` is an
error), so a substitution whose constants alone make a value that is not a finite real number is a
step that computes inf or nan for every neuron: a SpecError.
"""
import sympy

from ..errors import SpecError

MAX_SIZE = 1000  # nodes of one expression (operations and their operands)
MAX_DEPTH = 40  # nesting levels of one expression; each may print as a few parentheses (Python allows 200)
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, 3.4028234663852886e38


def nodes(*exprs):
    """Every distinct subexpression of `exprs`, each visited once (linear in the graph, not the tree)."""
    seen, stack = set(), list(exprs)
    while stack:
        expr = stack.pop()
        if expr not in seen:
            seen.add(expr)
            stack.extend(expr.args)
    return seen


def not_real(expr):
    """The atoms of `expr` that are not finite real numbers (sympy's zoo, oo, -oo, nan, I), sorted."""
    return sorted((a for a in nodes(expr) if a.is_Atom and _is_not_real(a)), key=sympy.default_sort_key)


def _is_not_real(atom):
    if atom.is_Symbol or isinstance(atom, sympy.logic.boolalg.BooleanAtom) or not atom.is_number:
        return False
    return not (atom.is_real and atom.is_finite)


def _outside_float32(number):
    """True for a nonzero constant that fp32 cannot hold as a normal number."""
    if number.is_zero:
        return False
    try:
        magnitude = abs(float(number))
    except (OverflowError, TypeError):
        return True
    return not FLOAT32_TINY <= magnitude <= FLOAT32_MAX


class Measure:
    """An expression's size as a tree (its nodes counted with repeats, as printed; at most `max_size` + 1)
    and depth, whether it holds a value that is not a finite real number, and its constants outside
    fp32's normal range (integer exponents aside: `x**3` takes no constant 3 into the arithmetic).
    Each distinct subexpression is visited once."""

    def __init__(self, expr, max_size=MAX_SIZE):
        self._limit, self._memo = max_size + 1, {}
        self.size, self.depth = self._measure(expr)
        self.fits = self.size <= max_size and self.depth <= MAX_DEPTH
        atoms = [e for e in self._memo if e.is_Atom]
        self.special = any(_is_not_real(a) for a in atoms)
        self.outside = {a for a in atoms if a.is_Number and _outside_float32(a)}

    def _measure(self, expr):
        found = self._memo.get(expr)
        if found is None:
            args = expr.args[:1] if expr.is_Pow and expr.args[1].is_Integer else expr.args
            parts = [self._measure(a) for a in args]
            size = min(self._limit, 1 + sum(size for size, _ in parts))
            found = self._memo[expr] = (size, 1 + max((depth for _, depth in parts), default=0))
        return found


def _constants(expr):
    return {n for n in nodes(expr) if n.is_Number}


def _powers_scaled_value(subexpressions, mapping):
    """True if an integer power (other than 1) among `subexpressions` has a base that `mapping` replaces by
    a product with a numeric factor: sympy would distribute the power over the product."""
    for power in subexpressions:
        if power.is_Pow and power.args[1].is_Integer and power.args[1] != 1 and power.args[0] in mapping:
            value = mapping[power.args[0]]
            if value.is_Mul and any(f.is_Number and abs(f) != 1 for f in value.args):
                return True
    return False


def _conditions_on_piecewise(subexpressions, mapping):
    """True if a condition among `subexpressions` reads a symbol that `mapping` replaces by an expression
    with a Piecewise."""
    read = set()
    for condition in subexpressions:
        if isinstance(condition, sympy.core.relational.Relational):
            read |= condition.free_symbols & set(mapping)
    return any(isinstance(n, sympy.Piecewise) for s in read for n in nodes(mapping[s]))


def _size_with(expr, mapping, limit):
    """The size `expr` would have with `mapping` substituted, counted without building it (up to `limit` + 1)."""
    sizes = {symbol: Measure(value, limit).size for symbol, value in mapping.items()}
    total, stack = 0, [expr]
    while stack and total <= limit:
        node = stack.pop()
        if node in sizes:
            total += sizes[node]
        else:
            total += 1
            stack.extend(node.args)
    return total


def may_substitute(expr, mapping):
    """Whether substituting `mapping` into `expr` is worth trying (cheap checks, before building it)."""
    subexpressions = nodes(expr)
    return not (
        _powers_scaled_value(subexpressions, mapping)
        or _conditions_on_piecewise(subexpressions, mapping)
        or _size_with(expr, mapping, MAX_SIZE) > MAX_SIZE
    )


def keeps_meaning(expr, mapping, result):
    """Whether `result` (`expr` with `mapping` substituted) computes what `expr` computes, within the
    limits of the module docstring."""
    measured = Measure(result)
    if not measured.fits or measured.special:
        return False
    if measured.outside:
        given = _constants(expr).union(*(_constants(v) for v in mapping.values()))
        return measured.outside <= given
    return True


def _is_constant(expr):
    return expr.is_Number or expr is sympy.true or expr is sympy.false


def substitute(expr, definitions, where=None):
    """(result, kept): `expr` with every symbol that has a definition replaced by it, except `kept`, the
    symbols (sorted) whose substitution `keeps_meaning` refuses; those must stay variables. `where`
    names the assignment in an error."""
    mapping = {s: definitions[s] for s in expr.free_symbols if s in definitions and definitions[s] is not s}
    if not mapping:
        return expr, ()
    if may_substitute(expr, mapping):
        result = expr.xreplace(mapping)
        if keeps_meaning(expr, mapping, result):
            return result, ()
    kept = tuple(sorted((s for s, value in mapping.items() if not _is_constant(value)), key=str))
    result = expr.xreplace({s: value for s, value in mapping.items() if s not in kept})
    bad = not_real(result)
    if bad:
        constants = ", ".join(f"{s} = {mapping[s]}" for s in sorted(mapping, key=str) if s not in kept)
        target = f"`{where} = {expr}`" if where is not None else f"`{expr}`"
        raise SpecError(
            f"the step computes {target} where {constants} for every neuron, which is "
            f"{', '.join(map(str, bad))} in sympy's terms: not a finite real number (eager torch gives inf or nan "
            "here for every input). Check the step for a division by a value that is always zero, or a log or "
            "square root of one that is never positive"
        )
    return result, kept
