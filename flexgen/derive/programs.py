"""The programs each kernel prints, from a `Derivation`: the forward step, the backward step and the recompute
backward's pair, each split into what runs once before the time loop and what runs every step."""
import dataclasses

import sympy

from ..frontend.names import NameAllocator, derived_forms, reserved_names
from ..frontend.trace import Assign
from .optimise import hoist_invariants, inline_single_use, invariant_names


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
