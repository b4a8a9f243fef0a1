"""Stage 2, derive: per-step vector-Jacobian products by symbolic differentiation.

Takes a `Trace`; hands render a `Derivation` and the programs each kernel prints (`KernelCode`, `RecomputeCode`).

Reverse-mode differentiation of the traced program: each node's adjoint
`grad_<node>` is the sum, over its consumers, of the consumer's adjoint times
the local partial derivative (sympy `diff` of one small expression). The
result is
  * `adjoint`: that program, readable, for `equations()`;
  * `saved`: what the forward must keep (see `flexgen.derive.partition`);
  * `backward`: the per-step backward as one joint `sympy.cse` over the final
    gradient expressions, written in terms of the saved values, the incoming
    gradients and the parameters — what the backward kernels print. Values are
    substituted into their users only where `flexgen.frontend.inlining` allows it; the
    others stay variables of the backward (a recomputed forward value, an
    intermediate gradient), so the backward is a graph of bounded expressions,
    not one tree per gradient;
  * `decisions`: the comparisons the backward makes on each saved forward
    value (a spike's `z >= 0`, a `where` condition), which the forward keeps
    when it rounds that value to a narrower I/O dtype;
  * `binary`: the saved values that are 0 or 1 at every step (a state: at every
    step after the first), which the kernels keep in bytes, not in floats.
"""
import collections
import dataclasses
import heapq

import sympy

from ..errors import SpecError
from ..frontend.inlining import nodes, not_real, substitute
from ..frontend.names import FRAME_NAMES, NameAllocator, derived_forms, reserved_names
from .partition import choose_saved
from ..frontend.symbolic import SpikeBase, detach
from ..frontend.trace import Assign, Trace


@dataclasses.dataclass(frozen=True)
class Derivation:
    """Everything the printers need for one neuron (see module docstring)."""

    trace: Trace
    forward: tuple
    grad_outputs: tuple
    grad_states: tuple
    adjoint: tuple
    grad_inputs: tuple
    grad_prev_states: tuple
    grad_learnable: tuple
    saved: tuple
    backward: tuple
    decisions: tuple = ()
    binary: frozenset = frozenset()


def live_program(program, roots):
    """The assignments `roots` depend on, in order."""
    definitions = {a.target: a for a in program}
    live, stack = set(), list(roots)
    while stack:
        s = stack.pop()
        if s in definitions and s not in live:
            live.add(s)
            stack.extend(definitions[s].expr.free_symbols)
    return [a for a in program if a.target in live]


# The derived backward's size, in distinct operations, beyond which flexgen stops: such a kernel takes
# minutes to compile, and the step is usually a long unrolled loop. (The bundled neurons' backwards have
# 20 to 60.) Counted before the joint CSE, over the graph of the expressions (each distinct subexpression
# once): about what the CSE leaves, and what its time grows with.
MAX_BACKWARD_OPERATIONS = 5000


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


def _partial(assignment, operand):
    """d(assignment's expression)/d(operand); SpecError where it is not a finite real expression."""
    partial = assignment.expr.diff(operand)
    bad = not_real(partial)
    if bad:
        raise SpecError(
            f"the derivative of `{assignment}` with respect to {operand} is {partial}, which holds "
            f"{', '.join(map(str, bad))}: not a finite real number for any input; rewrite that operation"
        )
    return partial


def _adjoint_program(trace, forward, alloc, seeds):
    """Reverse-mode sweep over `forward`; returns (program, adjoint symbol of each leaf)."""
    contributions = collections.defaultdict(list)
    for node, grad in seeds:
        contributions[node].append(grad)
    differentiable = set(trace.differentiable_leaves())
    for a in forward:  # nodes of hyper-parameters alone (exp(-dt/tau)) carry no gradient
        if a.expr.free_symbols & differentiable:
            differentiable.add(a.target)
    program = []
    for a in reversed(forward):
        if not contributions[a.target]:
            continue
        grad = sympy.Symbol(alloc.fresh(f"grad_{a.target}"), real=True)
        program.append(Assign(grad, sympy.Add(*contributions[a.target])))
        for operand in sorted(a.expr.free_symbols & differentiable, key=str):
            partial = _partial(a, operand)
            if partial != 0:
                contributions[operand].append(grad * partial)
    return program, contributions


def _expand(program, expanded, named, keep_symbolic=frozenset()):
    """Give each target of `program` its expression with the earlier targets in `expanded` substituted
    (`keep_symbolic` stay symbols). A target whose substitution `flexgen.frontend.inlining` refuses becomes a
    variable: its expression goes into `named` (target -> expression) and later users read it by name."""
    for a in program:
        if a.target in keep_symbolic:
            expanded[a.target] = a.target
            continue
        expanded[a.target] = _substituted(a.expr, a.target, expanded, named)
    return expanded


def _substituted(expr, target, expanded, named):
    expr, kept = substitute(expr, expanded, target)
    for s in kept:
        named[s] = expanded[s]
        expanded[s] = s
    return expr


def _live(named, roots, order):
    """The keys of `named` (target -> expression) that `roots` read, directly or through each other, in `order`."""
    live, stack = set(), [s for e in roots for s in e.free_symbols]
    while stack:
        s = stack.pop()
        if s in named and s not in live:
            live.add(s)
            stack.extend(named[s].free_symbols)
    return [s for s in order if s in live]


def _is_binary(expr, binary):
    """Whether `expr` is 0 or 1 for every value of its operands, given the symbols in `binary` are: a spike, a
    product, `1 - b`, a power, a `where`, a minimum or a maximum of such values, detached or not."""
    if expr.is_Number:
        return expr.is_zero or _is_one(expr)
    if expr.is_Symbol:
        return expr in binary
    if isinstance(expr, SpikeBase):
        return True
    if isinstance(expr, (detach, sympy.Max, sympy.Min)) or expr.is_Mul:
        return all(_is_binary(a, binary) for a in expr.args)
    if expr.is_Pow:
        return expr.exp.is_Integer and expr.exp > 0 and _is_binary(expr.base, binary)
    if isinstance(expr, sympy.Piecewise):
        return all(_is_binary(value, binary) for value, _ in expr.args)
    if expr.is_Add and len(expr.args) == 2 and any(_is_one(a) for a in expr.args):  # 1 - b
        coeff, rest = [a for a in expr.args if not _is_one(a)][0].as_coeff_Mul()
        return (coeff + 1).is_zero and _is_binary(rest, binary)
    return False


def _is_one(expr):
    """Whether `expr` is the number 1, as an Integer or a Float (sympy 1.13 on: Float(1.0) != 1)."""
    return expr.is_Number and (expr - 1).is_zero


def binary_values(trace, forward):
    """The values of the step that are 0 or 1 whatever its inputs, and the states that are after the first step
    (their new value is one of those values; their first is the caller's initial state)."""
    binary = set()
    for a in forward:
        if _is_binary(a.expr, binary):
            binary.add(a.target)
    states = {trace.leaves[n] for n, new in zip(trace.states, trace.next_states) if _is_binary(new, binary)}
    return binary | states


# What keeping a value for the backward costs, in bytes per fp32 value: an input or output is read again; another
# value is written and read back, in floats, or in bytes where it is 0 or 1. (One saved set serves every dtype, cut
# with fp32's sizes: in 16-bit I/O a byte is half a float, not a quarter, so there a byte written and read costs
# what re-reading an input does.)
READ_AGAIN, WRITTEN_AND_READ, IN_BYTES = 4, 8, 2


def _read_cost(trace, binary):
    inputs = {trace.leaves[n] for n in trace.inputs}
    outputs = set(trace.outputs)

    def cost(s):
        if s in inputs or s in outputs:
            return READ_AGAIN
        return IN_BYTES if s in binary else WRITTEN_AND_READ

    return cost


def derive(trace):
    """Differentiate one traced step; see the module docstring for what comes back."""
    taken = set(trace.leaves) | {str(a.target) for a in trace.program}
    alloc = NameAllocator(FRAME_NAMES | taken | derived_forms(taken))
    forward = live_program(trace.program, trace.outputs + trace.next_states)
    grad_outputs = tuple(sympy.Symbol(alloc.fresh(f"grad_{o}"), real=True) for o in trace.outputs)
    grad_states = tuple(sympy.Symbol(alloc.fresh(f"grad_{s}"), real=True) for s in trace.states)
    seeds = list(zip(trace.outputs, grad_outputs)) + list(zip(trace.next_states, grad_states))
    adjoint, contributions = _adjoint_program(trace, forward, alloc, seeds)

    def leaf_grads(names, stem):
        result = []
        for n in names:
            symbol = sympy.Symbol(alloc.fresh(stem.format(n)), real=True)
            adjoint.append(Assign(symbol, sympy.Add(*contributions[trace.leaves[n]])))
            result.append(symbol)
        return tuple(result)

    grad_inputs = leaf_grads(trace.inputs, "grad_{}")
    grad_prev_states = leaf_grads(trace.states, "grad_{}_prev")
    grad_learnable = leaf_grads(trace.learnable, "grad_{}")
    results = grad_inputs + grad_prev_states + grad_learnable

    forward_symbols = {a.target for a in forward} | {trace.leaves[n] for n in trace.inputs + trace.states}
    # Only what the gradients read: a detached value's adjoint is computed, then reaches nothing.
    needed = set().union(*(a.expr.free_symbols for a in live_program(adjoint, results))) & forward_symbols
    per_step = [trace.leaves[n] for n in trace.inputs + trace.states]
    binary = binary_values(trace, forward)
    saved = tuple(choose_saved(forward, per_step, _read_cost(trace, binary), needed))

    named = {}  # recomputed forward values and intermediate gradients that stay variables of the backward
    expanded = _expand(forward, {}, named, set(saved))
    expanded.update({s: s for s in saved})
    in_saved_terms = [Assign(a.target, _substituted(a.expr, a.target, expanded, named)) for a in adjoint]
    final = _expand(in_saved_terms, {}, named)
    gradients = [final[r] for r in results]
    variables = _live(named, gradients, [a.target for a in forward + adjoint])
    targets = [(s, named[s]) for s in variables] + [(r, final[r]) for r in results]
    _check_size(trace, sum(1 for n in nodes(*(e for _, e in targets)) if not n.is_Atom))
    backward = _cse(targets, alloc, set(results))
    states, outputs = {trace.leaves[n] for n in trace.states}, set(trace.outputs)
    # Values kept in bytes are exact: rounding to a 16-bit I/O dtype cannot move them across a comparison.
    written = [s for s in saved if s in states and s not in binary]
    written += [s for s in saved if s not in per_step and s not in outputs and s not in binary]
    return Derivation(
        trace=trace,
        forward=tuple(forward),
        grad_outputs=grad_outputs,
        grad_states=grad_states,
        adjoint=tuple(inline_single_use(adjoint, set(results))),
        grad_inputs=grad_inputs,
        grad_prev_states=grad_prev_states,
        grad_learnable=grad_learnable,
        saved=saved,
        backward=tuple(backward),
        decisions=decisions_on(written, [named[s] for s in variables] + gradients, set(variables)),
        binary=frozenset(str(s) for s in saved if s in binary),
    )


def _check_size(trace, count):
    """SpecError for a backward of `count` operations, if that is over MAX_BACKWARD_OPERATIONS."""
    if count > MAX_BACKWARD_OPERATIONS:
        raise SpecError(
            f"the derived backward of {trace.name!r} has {count} operations (from {len(trace.program)} in the "
            f"traced step); flexgen generates kernels of up to {MAX_BACKWARD_OPERATIONS}, since larger ones take "
            "minutes to compile. Shorten the step: fewer unrolled loop iterations or nested where/exp/power "
            "chains, or split the neuron into several layers"
        )


def _comparisons(expr):
    """The comparisons whose outcome `expr`'s value depends on: conditions, and a spike's or a sign's
    test of its argument (as the printers write them)."""
    found = set()
    for node in nodes(expr):
        if isinstance(node, sympy.core.relational.Relational):
            found.add(node)
        elif isinstance(node, SpikeBase):
            found.add(sympy.Ge(node.args[0], 0, evaluate=False))
        elif isinstance(node, sympy.sign):
            found |= {sympy.Gt(node.args[0], 0, evaluate=False), sympy.Lt(node.args[0], 0, evaluate=False)}
    return found


def decisions_on(written, exprs, recomputed=frozenset()):
    """((value, comparisons), ...): the comparisons in `exprs` (the backward in saved terms) that read
    values the forward writes for it (`written`: saved states, then the step's values), each under the
    first of those values it reads. (They may also read saved outputs, which the backward reads as
    stored too, but which the forward does not change.)

    The backward evaluates these comparisons on the stored values; where rounding to a narrower I/O
    dtype moved a value across a comparison's boundary, it would take a branch the forward did not.
    The forward rounds every value first, then moves each comparison's chosen value to its other
    neighbour where the outcome differs. A membrane potential, the usual operand of a threshold, is
    among the first states; moving a value of small weight in the comparison (an adaptation current)
    by one step of its dtype may not restore the outcome. A comparison that also reads a `recomputed`
    value (a variable of the backward, not a stored one) is left out: the forward cannot evaluate it on the
    stored values."""
    found = set().union(*(_comparisons(e) for e in exprs)) if exprs else set()
    found = {c for c in found if not c.free_symbols & recomputed}
    owned = {value: [] for value in written}
    for comparison in found:
        read = [value for value in written if value in comparison.free_symbols]
        if read:
            owned[read[0]].append(comparison)
    return tuple((value, tuple(sorted(owned[value], key=sympy.default_sort_key))) for value in written if owned[value])


def _cse(targets, alloc, results):
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


def recompute_program(derivation):
    """Forward nodes the backward step recomputes from the saved values (kept for equations())."""
    needed = set().union(*(a.expr.free_symbols for a in derivation.adjoint))
    definitions = {a.target: a for a in derivation.forward}
    saved = set(derivation.saved)
    stack, seen = [s for s in needed if s in definitions and s not in saved], set()
    while stack:
        s = stack.pop()
        if s in seen:
            continue
        seen.add(s)
        stack.extend(d for d in definitions[s].expr.free_symbols if d in definitions and d not in saved)
    return [a for a in derivation.forward if a.target in seen]


# ---------------------------------------------------------------- the programs the kernels print


@dataclasses.dataclass(frozen=True)
class KernelCode:
    """A kernel's step split for printing: `prelude` runs once before the time loop (the reciprocals of
    parameters), `step` every step."""

    prelude: list
    step: list


@dataclasses.dataclass(frozen=True)
class RecomputeCode:
    """The recompute backward's programs: the forward step it re-runs, then the backward step; `kept[k]`
    pairs each value the backward reads with the name it is kept under at step k of a chunk."""

    prelude: list
    forward_step: list
    backward_step: list
    kept: list


def forward_program(derivation):
    """The forward step with single-use temporaries folded into their consumer."""
    tr = derivation.trace
    keep = set(tr.outputs) | set(tr.next_states) | set(derivation.saved)
    return inline_single_use(derivation.forward, keep)


def free_names(derivation):
    """An allocator of names that neither the spec, the derivation nor the frames use."""
    taken = set(derivation.trace.leaves)
    for a in derivation.forward + derivation.backward + derivation.adjoint:
        taken |= {str(a.target)} | {str(s) for s in a.expr.free_symbols}
    return NameAllocator(set(reserved_names()) | taken | derived_forms(taken))


def _split_invariant(derivation, program, alloc):
    """Functions and reciprocals of parameters, computed once before the time loop (the prelude), and the step."""
    tr = derivation.trace
    invariant = {tr.leaves[n] for n in tr.hyper + tr.learnable}
    read_by_frame = set(tr.outputs) | set(tr.next_states) | set(derivation.saved) | set(derivation.grad_inputs) | set(
        derivation.grad_prev_states) | set(derivation.grad_learnable)
    return KernelCode(*hoist_invariants(program, invariant, alloc, invariant_names(tr.program, invariant),
                                        read_by_frame))


def forward_code(derivation):
    return _split_invariant(derivation, forward_program(derivation), free_names(derivation))


def backward_code(derivation):
    return _split_invariant(derivation, list(derivation.backward), free_names(derivation))


def recompute_code(derivation, chunk):
    """The recompute backward's programs for chunks of `chunk` steps."""
    forward = forward_program(derivation)
    alloc = free_names(derivation)
    # Both parts are hoisted together (one prelude), which may move whole assignments out of either; an
    # assignment of a fresh symbol to itself marks where the backward starts (the backward may assign names the
    # forward assigns too: values it recomputes).
    boundary = sympy.Symbol(alloc.fresh("boundary"), real=True)
    program = forward + [Assign(boundary, boundary)] + list(derivation.backward)
    split = _split_invariant(derivation, program, alloc)
    kept = [[(str(v), alloc.fresh(f"{v}_at{k}")) for v in derivation.saved] for k in range(chunk)]
    at = next(i for i, a in enumerate(split.step) if a.target == boundary)
    return RecomputeCode(_without_repeats(split.prelude), split.step[:at], split.step[at + 1:], kept)


def _without_repeats(program):
    """`program` less the assignments that repeat an earlier one (the same name, the same expression): hoisted from
    both the forward and the backward, a value both compute lands in the prelude twice. (C refuses a second
    definition of a name in one scope.)"""
    latest, kept = {}, []
    for a in program:
        if latest.get(a.target) != a.expr:
            kept.append(a)
            latest[a.target] = a.expr
    return kept


def equations(derivation):
    """The derived step, readable: forward, what is saved, recomputation, backward."""
    tr = derivation.trace
    recompute = recompute_program(derivation)
    keep = set(tr.outputs) | set(tr.next_states) | set(derivation.saved) | {a.target for a in recompute}
    lines = [f"# {tr.name}: forward step (inputs {', '.join(tr.inputs)}; "
             f"states {', '.join(tr.states)} before the step)"]
    lines += [str(a) for a in inline_single_use(derivation.forward, keep)]
    lines.append(f"outputs: {', '.join(map(str, tr.outputs))}")
    lines.append("new states: " + ", ".join(f"{s} <- {n}" for s, n in zip(tr.states, tr.next_states)))
    saved = ", ".join(f"{s} (0 or 1{' after the first step' if str(s) in tr.states else ''}: kept in bytes)"
                      if str(s) in derivation.binary else str(s) for s in derivation.saved) or "nothing"
    lines.append(f"\n# saved for the backward, per step: {saved}")
    for value, comparisons in derivation.decisions:
        tests = ", ".join(map(str, comparisons))
        lines.append(f"# the backward tests {tests}: stored in fp16/bf16, {value} keeps the forward's outcome")
    if recompute:
        lines.append("# recomputed in the backward from the saved values:")
        lines += [str(a) for a in inline_single_use(recompute, keep)]
    incoming = ", ".join(map(str, derivation.grad_outputs))
    carried = ", ".join(f"{g} (dL/d{s} after the step)" for g, s in zip(derivation.grad_states, tr.states))
    lines.append(f"\n# backward step: incoming {incoming}; carried {carried}")
    lines += [str(a) for a in derivation.adjoint]
    return "\n".join(lines) + "\n"
