"""Rewrites of a derived program that keep its values: single-use values folded into their consumer
(`inline_single_use`), loop-invariant work hoisted out of the time loop (`hoist_invariants`,
`hoist_reciprocals`) and one joint common-subexpression elimination (`cse`)."""
import collections
import heapq

import sympy

from ..frontend.inlining import substitute
from ..frontend.trace import Assign


def inline_single_use(program, keep):
    """Fold nodes used at most once (and not in `keep`) into their consumer, for readable code.

    Every occurrence counts as a use (`h ** h` uses h twice), so the program stays a graph: a value
    used twice is never copied into two places. A fold that `flexgen.frontend.inlining` refuses leaves the
    node a variable, assigned just before its consumer.
    """
    uses = collections.Counter()
    for a in program:
        uses.update(s for s in sympy.preorder_traversal(a.expr) if s.is_Symbol)
    uses.update(keep)
    order = {a.target: k for k, a in enumerate(program)}
    definitions, result = {}, []
    for a in program:
        expr, kept = substitute(a.expr, definitions, a.target)
        for s in sorted(kept, key=order.get):
            result.append(Assign(s, definitions.pop(s)))
        if _is_constant(expr):  # users read the value itself: a target never hands a bare float to a function
            definitions[a.target] = expr
            if a.target in keep:
                result.append(Assign(a.target, expr))
        elif (uses[a.target] <= 1 or expr.is_Atom) and a.target not in keep:
            definitions[a.target] = expr
        else:
            result.append(Assign(a.target, expr))
    return result


def hoist_reciprocals(program, invariant, alloc):
    """Divisions by loop-invariant values as multiplications by reciprocals computed once.

    `invariant`: symbols that do not change from step to step (parameters).
    Returns (prelude, program): the prelude computes each reciprocal, the
    program multiplies by it. A kernel runs the step T times; a float division
    costs several multiplications, and the compiler may not rewrite `x / tau`
    as `x * (1 / tau)` itself, since the rounding differs (by an ulp at most).
    """
    reciprocals, prelude, result = {}, [], []

    def reciprocal(base):
        if base not in reciprocals:
            stem = f"inv_{base}" if base.is_Symbol else "inv"
            reciprocals[base] = sympy.Symbol(alloc.fresh(stem), real=True)
            prelude.append(Assign(reciprocals[base], sympy.Pow(base, -1)))
        return reciprocals[base]

    for a in program:
        mapping = {}
        for power in sorted(a.expr.atoms(sympy.Pow), key=sympy.default_sort_key):
            base, exponent = power.args
            if exponent.is_Integer and exponent < 0 and base.free_symbols and base.free_symbols <= invariant:
                mapping[power] = reciprocal(base) ** -exponent
        result.append(Assign(a.target, a.expr.xreplace(mapping)) if mapping else a)
    return prelude, result


def invariant_names(program, invariant):
    """{expression: name} of the nodes of `program` computed from `invariant` symbols alone through a
    function call (`phi = exp(-dt/tau)`), as whole expressions: the names `hoist_invariants` gives them."""
    expanded, names = {}, {}
    for a in program:
        expr = a.expr.xreplace(expanded)
        # Only values of parameters alone are expanded: a node reading anything else stays a symbol, so its
        # users are not invariant either, and a program that reuses its values never grows into a tree.
        if expr.free_symbols and expr.free_symbols <= invariant:
            expanded[a.target] = expr
            if _calls(expr):
                names.setdefault(expr, str(a.target))
    return names


def _calls(expr):
    return bool(expr.atoms(sympy.Function)) or any(not p.exp.is_Integer for p in expr.atoms(sympy.Pow))


def hoist_invariants(program, invariant, alloc, names=None, fixed=()):
    """Loop-invariant work out of the time loop: every function of parameters alone (exp(-dt/tau),
    sigmoid(w)) and, in what remains, the reciprocals of parameters (`hoist_reciprocals`).

    Returns (prelude, program). A subexpression is hoisted whole: the largest one of parameters alone
    that calls a function, the parameters' factors of a product or terms of a sum taken together.
    `names` ({expression: name}, see `invariant_names`) names them after the step's own values where
    that name is free in `program`, the others are `k`, `k1`, ...; an assignment of such a value moves
    whole, renamed so unless its target is in `fixed` (names the frame reads).
    """
    used = {str(a.target) for a in program} | {str(s) for a in program for s in a.expr.free_symbols}
    names = {e: n for e, n in (names or {}).items() if n not in used}
    prelude, hoisted, moved = [], {}, set(invariant)

    def symbol_for(expr):
        if expr not in hoisted:
            stem = names.pop(expr, None)
            name = stem if stem is not None else alloc.fresh("k")  # a step value's name, unused in `program`
            hoisted[expr] = sympy.Symbol(name, real=True)
            prelude.append(Assign(hoisted[expr], expr))
        return hoisted[expr]

    def is_invariant(expr):
        return bool(expr.free_symbols) and expr.free_symbols <= moved

    def hoist(expr):
        if expr.is_Atom or not expr.free_symbols & moved:
            return expr
        if is_invariant(expr) and _calls(expr) and not _is_condition(expr):
            return symbol_for(expr)
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            fixed = [arg for arg in expr.args if is_invariant(arg)]
            if len(fixed) > 1 and _calls(expr.func(*fixed)):
                rest = [hoist(arg) for arg in expr.args if not is_invariant(arg)]
                return expr.func(symbol_for(expr.func(*fixed)), *rest)
        return expr.func(*[hoist(arg) for arg in expr.args])

    result, renamed = [], {}
    for a in program:
        expr = a.expr.xreplace(renamed)
        if is_invariant(expr) and _calls(expr):  # a whole value of parameters alone: named after the step's
            target = a.target
            if expr in names and target not in fixed:
                target = renamed[a.target] = sympy.Symbol(names.pop(expr), real=True)
            prelude.append(Assign(target, expr))
            moved.add(target)
        else:
            result.append(Assign(a.target, hoist(expr)))
    reciprocal_prelude, result = hoist_reciprocals(result, moved, alloc)
    return prelude + reciprocal_prelude, result


def _is_condition(expr):
    return isinstance(expr, (sympy.core.relational.Relational, sympy.logic.boolalg.Boolean))


def _is_constant(expr):
    return expr.is_Number or expr is sympy.true or expr is sympy.false




def cse(targets, alloc, results):
    """One joint `sympy.cse` over `targets` ((symbol, expression), in order; those not in `results` are
    variables the others read), as a program in which every assignment follows those it reads."""
    names = (sympy.Symbol(alloc.fresh("c"), real=True) for _ in iter(int, 1))
    replacements, reduced = sympy.cse([expr for _, expr in targets], symbols=names, order="none")
    # A common subexpression can fold to a constant once earlier ones are known (a condition to False,
    # say); its users get the value, so no variable prints as a bare bool or float. A variable that is
    # another one (two recomputed values the CSE found equal) is read under the other's name.
    constants, program = {}, []
    assignments = list(replacements) + [(t, e) for (t, _), e in zip(targets, reduced)]
    for symbol, expr in _in_dependency_order(assignments):
        expr, _ = substitute(expr, constants, symbol)
        if (_is_constant(expr) or expr.is_Symbol) and symbol not in results:
            constants[symbol] = expr
        else:
            program.append(Assign(symbol, expr))
    return program


def _in_dependency_order(assignments):
    """(symbol, expression) pairs reordered so that each follows the ones it reads, otherwise in the given order."""
    index = {symbol: k for k, (symbol, _) in enumerate(assignments)}
    unmet, readers = [], collections.defaultdict(list)
    for k, (_, expr) in enumerate(assignments):
        reads = {index[s] for s in expr.free_symbols if s in index}
        unmet.append(len(reads))
        for d in reads:
            readers[d].append(k)
    ready = [k for k, n in enumerate(unmet) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        k = heapq.heappop(ready)
        order.append(assignments[k])
        for reader in readers[k]:
            unmet[reader] -= 1
            if unmet[reader] == 0:
                heapq.heappush(ready, reader)
    return order
