"""Stage 2, derive: per-step vector-Jacobian products by symbolic differentiation.

Takes a `Trace`; hands render a `Derivation`, from which `flexgen.derive.programs` cuts the programs each kernel
prints. The rewrites of those programs are in `flexgen.derive.optimise`, the cost of keeping a value for the backward
in `flexgen.derive.cost`.

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

import sympy

from ..errors import SpecError
from ..frontend.inlining import nodes, not_real, substitute
from ..frontend.names import FRAME_NAMES, NameAllocator, derived_forms
from ..frontend.symbolic import SpikeBase
from ..frontend.trace import Assign, Trace
from .cost import binary_values, read_cost
from .optimise import cse, inline_single_use
from .partition import choose_saved


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
    saved = tuple(choose_saved(forward, per_step, read_cost(trace, binary), needed))

    named = {}  # recomputed forward values and intermediate gradients that stay variables of the backward
    expanded = _expand(forward, {}, named, set(saved))
    expanded.update({s: s for s in saved})
    in_saved_terms = [Assign(a.target, _substituted(a.expr, a.target, expanded, named)) for a in adjoint]
    final = _expand(in_saved_terms, {}, named)
    gradients = [final[r] for r in results]
    variables = _live(named, gradients, [a.target for a in forward + adjoint])
    targets = [(s, named[s]) for s in variables] + [(r, final[r]) for r in results]
    _check_size(trace, sum(1 for n in nodes(*(e for _, e in targets)) if not n.is_Atom))
    backward = cse(targets, alloc, set(results))
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
