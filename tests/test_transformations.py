"""The program transformations between tracing and printing, tested on their own.

`choose_saved` picks what the forward writes for the backward (a minimum cut),
`hoist_reciprocals` moves divisions by parameters out of the time loop and
`inline_single_use` folds temporaries into their one consumer. Each is run on
small hand-built programs, where the right answer is known, and on the traces
of the test and bundled neurons, where the answer is checked by evaluating the
programs on numbers.
"""
import itertools
import random

import pytest
import sympy

import flexgen
import specs
from flexgen.derive.optimise import hoist_reciprocals, inline_single_use
from flexgen.frontend.names import NameAllocator
from flexgen.derive.partition import choose_saved
from flexgen.frontend.trace import Assign

x, y, v, w, tau, beta = sympy.symbols("x y v w tau beta", real=True)
t0, t1, t2, h, a, b, c, m = sympy.symbols("t0 t1 t2 h a b c m", real=True)

ALL_SPECS = {
    **{f"tests.{name}": spec for name, spec in specs.ALL.items()},
    "tests.smooth": specs.smooth,
    **{name: flexgen.neurons.spec(name) for name in flexgen.neurons.available()},
}


def program_of(*pairs):
    return [Assign(target, expr) for target, expr in pairs]


def evaluate(program, values):
    """Every symbol's value after running `program` on the numbers in `values`."""
    env = dict(values)
    for line in program:
        value = line.expr.xreplace(env)
        assert value.is_Number or value in (sympy.true, sympy.false), f"{line} did not evaluate: {value}"
        env[line.target] = value
    return env


def computable_from(program, available):
    """The symbols known after running `program` knowing only `available`."""
    known = set(available)
    for line in program:
        if line.expr.free_symbols <= known:
            known.add(line.target)
    return known


def leaf_values(trace, seed=0):
    """Values for a trace's leaves away from the edges of the bundled neurons' domains."""
    rng = random.Random(seed)
    return {symbol: sympy.Float(rng.uniform(0.2, 0.8)) for symbol in trace.leaves.values()}


def assert_close(actual, expected):
    """Two programs' values of one symbol, sympy Floats of float64's 53 bits: a rewrite (hoisting, inlining,
    recomputing from the saved values) changes only the order of operations, so 1e-12 relative (measured: at most
    5.5e-16); `abs` for a value that cancels to about 0 from terms of order 1 (the leaves are in [0.2, 0.8]), which
    keeps their rounding of a few 1e-16."""
    assert float(actual) == pytest.approx(float(expected), rel=1e-12, abs=1e-14)


# ---------------------------------------------------------------------------------------------
# choose_saved


def costs(table, default=2):
    return lambda symbol: table.get(symbol, default)


# h = v + (x - v) / tau: the pre-spike potential of LIF, x an input (one read), v a state (a write and a read).
LIF_H = program_of((t0, x - v), (t1, t0 / tau), (h, t1 + v))
LIF_COST = costs({x: 1})


def test_choose_saved_keeps_one_value_rather_than_the_two_leaves_it_comes_from():
    assert choose_saved(LIF_H, [x, v], LIF_COST, {h}) == [h]


@pytest.mark.parametrize("cost_of_h, expected", [(1, [h]), (2, [h]), (4, [x, v])])
def test_choose_saved_follows_the_read_costs(cost_of_h, expected):
    """Saving h costs `cost_of_h` (1: an output, already written); saving x and v costs 1 + 2."""
    assert choose_saved(LIF_H, [x, v], costs({x: 1, h: cost_of_h}), {h}) == expected


def test_choose_saved_keeps_an_input_rather_than_several_values_computed_from_it():
    program = program_of((a, sympy.exp(x)), (b, sympy.sin(x)), (c, x * x))
    assert choose_saved(program, [x], costs({x: 1}), {a, b, c}) == [x]


def test_choose_saved_cuts_at_a_shared_intermediate():
    """Two states (2 each) feed m, which feeds three needed values: m alone (2) is the cheapest cut."""
    program = program_of((m, v * w), (a, sympy.sin(m)), (b, sympy.cos(m)), (c, sympy.exp(m)))
    assert choose_saved(program, [v, w], costs({}), {a, b, c}) == [m]


def test_choose_saved_chooses_jointly_for_a_leaf_and_a_value_both_needed():
    """v itself and h are needed: {x, v} (3) covers both, {v, h} would cost 4."""
    assert choose_saved(LIF_H, [x, v], LIF_COST, {v, h}) == [x, v]


def test_choose_saved_never_saves_what_parameters_alone_determine():
    program = program_of((t0, 1 / tau), (a, t0 * x))
    assert choose_saved(program, [x], costs({x: 1}), {t0}) == []
    assert choose_saved(program, [x], costs({x: 1}), {t0, a}) == [x]
    assert choose_saved(program, [x], costs({x: 1}), {tau}) == []


def test_choose_saved_ignores_needed_symbols_the_forward_does_not_compute():
    grad_s = sympy.Symbol("grad_s", real=True)
    assert choose_saved(LIF_H, [x, v], LIF_COST, {grad_s}) == []
    assert choose_saved(LIF_H, [x, v], LIF_COST, {grad_s, h}) == [h]


def test_choose_saved_on_empty_inputs():
    assert choose_saved([], [], LIF_COST, set()) == []
    assert choose_saved([], [x, v], LIF_COST, set()) == []
    assert choose_saved(LIF_H, [x, v], LIF_COST, set()) == []
    assert choose_saved([], [x, v], LIF_COST, {v}) == [v]


def test_choose_saved_lists_leaves_in_the_given_order_then_program_order():
    assert choose_saved([], [x, v], LIF_COST, {x, v}) == [x, v]
    assert choose_saved([], [v, x], LIF_COST, {x, v}) == [v, x]
    program = program_of((a, sympy.exp(v)), (b, sympy.sin(v)))
    assert choose_saved(program, [v], costs({v: 9}), {b, a}) == [a, b]
    program = program_of((a, sympy.exp(v)), (b, sympy.sin(x)), (c, sympy.cos(x)))
    assert choose_saved(program, [x, v], costs({x: 1, v: 9}), {c, b, a}) == [x, a]


def random_program(rng, leaves, size):
    """A straight-line program of `size` nodes, each one or two earlier symbols combined."""
    symbols, program = list(leaves), []
    for k in range(size):
        target = sympy.Symbol(f"n{k}", real=True)
        p, q = rng.choice(symbols), rng.choice(symbols)
        expr = rng.choice([lambda: p + 2 * q, lambda: p * q + 1, lambda: sympy.sin(p), lambda: sympy.exp(p) * q])()
        program.append(Assign(target, expr))
        symbols.append(target)
    return program


def cheapest_cut(program, per_step, read_cost, needed, parameters):
    """Brute force: the least total read cost of a set from which (with the parameters) `needed` is computable."""
    candidates = list(per_step) + [line.target for line in program]
    return min(
        sum(map(read_cost, subset))
        for r in range(len(candidates) + 1)
        for subset in itertools.combinations(candidates, r)
        if needed <= computable_from(program, set(subset) | parameters)
    )


@pytest.mark.parametrize("seed", range(40))
def test_choose_saved_is_sufficient_and_as_cheap_as_brute_force(seed):
    rng = random.Random(seed)
    program = random_program(rng, [x, v, tau], size=7)
    table = {s: rng.choice([1, 2, 3]) for s in [x, v] + [line.target for line in program]}
    needed = set(rng.sample([line.target for line in program] + [x, v], rng.randint(1, 4)))
    saved = choose_saved(program, [x, v], table.get, needed)
    assert needed <= computable_from(program, set(saved) | {tau})
    assert sum(map(table.get, saved)) == cheapest_cut(program, [x, v], table.get, needed, {tau})


def read_cost_of(trace):
    """The costs derive uses: inputs and outputs are read once, everything else written and read."""
    once = {trace.leaves[n] for n in trace.inputs} | set(trace.outputs)
    return lambda symbol: 1 if symbol in once else 2


def needed_by_backward(derivation):
    forward = {line.target for line in derivation.forward} | set(derivation.trace.leaves.values())
    return set().union(*(line.expr.free_symbols for line in derivation.adjoint)) & forward


@pytest.mark.parametrize("name", ["tests.lif", "tests.plif", "IF", "LIF", "PLIF"])
def test_choose_saved_on_small_neurons_is_as_cheap_as_brute_force(name):
    d = ALL_SPECS[name].derivation()
    tr = d.trace
    per_step = [tr.leaves[n] for n in tr.inputs + tr.states]
    parameters = {tr.leaves[n] for n in tr.hyper + tr.learnable}
    needed = needed_by_backward(d)
    saved = choose_saved(list(d.forward), per_step, read_cost_of(tr), needed)
    assert saved == list(d.saved)
    assert needed <= computable_from(d.forward, set(saved) | parameters)
    best = cheapest_cut(list(d.forward), per_step, read_cost_of(tr), needed, parameters)
    assert sum(map(read_cost_of(tr), saved)) == best


def test_choose_saved_on_lif_saves_the_pre_spike_potential():
    d = specs.lif.derivation()
    assert [str(s) for s in d.saved] == ["h"]


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_backward_is_computed_from_the_saved_values_alone(name):
    """The backward program reads only saved values, parameters and incoming gradients, and gives
    the gradients the full adjoint gives with every forward value at hand."""
    d = ALL_SPECS[name].derivation()
    tr = d.trace
    parameters = {tr.leaves[n] for n in tr.hyper + tr.learnable}
    incoming = set(d.grad_outputs) | set(d.grad_states)
    results = d.grad_inputs + d.grad_prev_states + d.grad_learnable
    assert set(results) <= computable_from(d.backward, set(d.saved) | parameters | incoming)

    rng = random.Random(name)
    grads = {g: sympy.Float(rng.uniform(-1.0, 1.0)) for g in incoming}
    forward = evaluate(d.forward, leaf_values(tr))
    reference = evaluate(d.adjoint, {**forward, **grads})
    from_saved = evaluate(d.backward, {**{s: forward[s] for s in set(d.saved) | parameters}, **grads})
    for r in results:
        assert_close(from_saved[r], reference[r])


# ---------------------------------------------------------------------------------------------
# hoist_reciprocals


def allocator_for(*programs, extra=()):
    taken = set(extra)
    for program in programs:
        for line in program:
            taken |= {str(line.target)} | {str(s) for s in line.expr.free_symbols}
    return NameAllocator(taken)


def test_hoist_turns_a_division_by_a_parameter_into_a_multiplication():
    program = program_of((t0, (x - v) / tau))
    prelude, step = hoist_reciprocals(program, {tau}, allocator_for(program))
    inv_tau = sympy.Symbol("inv_tau", real=True)
    assert prelude == [Assign(inv_tau, 1 / tau)]
    assert step == [Assign(t0, (x - v) * inv_tau)]


def test_hoist_computes_each_reciprocal_once_and_keeps_integer_powers():
    program = program_of((t0, x / tau), (t1, v / tau + x / tau**2))
    prelude, step = hoist_reciprocals(program, {tau}, allocator_for(program))
    (line,) = prelude
    assert step == [Assign(t0, x * line.target), Assign(t1, v * line.target + x * line.target**2)]


def test_hoist_leaves_divisions_by_per_step_values_alone():
    program = program_of((t0, x / v), (t1, x / (v + tau)), (t2, x / (v * tau)))
    prelude, step = hoist_reciprocals(program, {tau}, allocator_for(program))
    (line,) = prelude
    assert line.expr == 1 / tau
    assert step[:2] == program[:2]
    assert step[2] == Assign(t2, x * line.target / v)


def test_hoist_leaves_constant_non_integer_and_positive_powers_alone():
    program = program_of((t0, x / sympy.sqrt(tau)), (t1, x * tau**2), (t2, x / 2), (a, x / sympy.pi))
    assert hoist_reciprocals(program, {tau}, allocator_for(program)) == ([], program)


def test_hoist_reaches_divisions_inside_function_calls():
    program = program_of((t0, sympy.exp((v - x) / tau)))
    prelude, step = hoist_reciprocals(program, {tau}, allocator_for(program))
    (line,) = prelude
    assert step == [Assign(t0, sympy.exp((v - x) * line.target))]


def test_hoist_names_a_composite_base_inv_and_distinct_bases_apart():
    program = program_of((t0, x / (tau + beta)), (t1, x / (tau * beta + 1)), (t2, v / (tau + beta)))
    prelude, step = hoist_reciprocals(program, {tau, beta}, allocator_for(program))
    assert [str(line.target) for line in prelude] == ["inv", "inv1"]
    assert [line.expr for line in prelude] == [1 / (tau + beta), 1 / (tau * beta + 1)]
    assert step[2] == Assign(t2, v * prelude[0].target)


def test_hoist_names_never_collide_with_taken_names():
    """A step whose own input is called inv_tau: the reciprocal gets another name, and the allocator
    keeps it so later names (the renderer's) avoid it too."""
    user_inv_tau = sympy.Symbol("inv_tau", real=True)
    program = program_of((t0, user_inv_tau * x / tau), (t1, t0 / (tau + beta)))
    alloc = allocator_for(program, extra={"inv"})
    taken_before = set(alloc.taken)
    prelude, step = hoist_reciprocals(program, {tau, beta}, alloc)
    names = [str(line.target) for line in prelude]
    assert names == ["inv_tau1", "inv1"]
    assert not set(names) & taken_before
    assert set(names) <= alloc.taken and alloc.fresh("inv_tau") == "inv_tau2"
    values = {x: sympy.Float(0.3), v: sympy.Float(0.7), tau: sympy.Float(2.5), beta: sympy.Float(0.4),
              user_inv_tau: sympy.Float(1.9)}
    hoisted = evaluate(prelude + step, values)
    original = evaluate(program, values)
    for target in (t0, t1):
        assert_close(hoisted[target], original[target])


def test_hoist_on_an_empty_program():
    assert hoist_reciprocals([], {tau}, NameAllocator()) == ([], [])


def negative_powers(program, over):
    """Negative integer powers in `program` whose base's symbols satisfy `over`."""
    return [p for line in program for p in line.expr.atoms(sympy.Pow)
            if p.exp.is_Integer and p.exp < 0 and p.base.free_symbols and over(p.base.free_symbols)]


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
@pytest.mark.parametrize("part", ["forward", "backward"])
def test_hoist_on_neuron_programs(name, part):
    d = ALL_SPECS[name].derivation()
    tr = d.trace
    invariant = {tr.leaves[n] for n in tr.hyper + tr.learnable}
    program = list(getattr(d, part))
    prelude, step = hoist_reciprocals(program, invariant, allocator_for(d.forward, d.backward, d.adjoint))

    def varies(symbols):
        return not symbols <= invariant

    assert not negative_powers(step, lambda symbols: not varies(symbols))
    assert sorted(map(str, negative_powers(step, varies))) == sorted(map(str, negative_powers(program, varies)))
    assert all(line.expr.free_symbols <= invariant for line in prelude)
    assert [line.target for line in step] == [line.target for line in program]

    rng = random.Random(name)
    values = leaf_values(tr)
    if part == "backward":
        forward = evaluate(d.forward, values)
        values = {**{s: forward[s] for s in d.saved}, **{s: values[s] for s in invariant},
                  **{g: sympy.Float(rng.uniform(-1.0, 1.0)) for g in d.grad_outputs + d.grad_states}}
    hoisted, original = evaluate(prelude + step, values), evaluate(program, values)
    for line in program:
        if original[line.target].is_Number:
            assert_close(hoisted[line.target], original[line.target])
        else:
            assert hoisted[line.target] == original[line.target]


def test_hoist_on_lif_moves_the_division_by_tau_out():
    d = specs.lif.derivation()
    tau_ = d.trace.leaves["tau"]
    prelude, _ = hoist_reciprocals(list(d.forward), {tau_, d.trace.leaves["v_th"]}, allocator_for(d.forward))
    assert [(str(line.target), line.expr) for line in prelude] == [("inv_tau", 1 / tau_)]


# ---------------------------------------------------------------------------------------------
# inline_single_use


def test_inline_folds_a_chain_of_temporaries_into_the_kept_value():
    assert inline_single_use(LIF_H, {h}) == [Assign(h, v + (x - v) / tau)]


def test_inline_keeps_a_value_used_twice():
    program = program_of((t0, x - v), (a, 2 * t0), (b, t0 + 1))
    assert inline_single_use(program, {a, b}) == program


def test_inline_keeps_kept_values_even_when_used_once():
    program = program_of((t0, x - v), (t1, t0 / tau), (h, t1 + v))
    assert inline_single_use(program, {t0, h}) == [Assign(t0, x - v), Assign(h, t0 / tau + v)]


def test_inline_with_everything_kept_changes_nothing():
    assert inline_single_use(LIF_H, {t0, t1, h}) == LIF_H


def test_inline_drops_unused_temporaries():
    program = program_of((t0, x * v), (h, x + v))
    assert inline_single_use(program, {h}) == [Assign(h, x + v)]


def test_inline_folds_aliases_however_often_they_are_used():
    program = program_of((t0, v), (a, t0 * x), (b, t0 + x))
    assert inline_single_use(program, {a, b}) == [Assign(a, v * x), Assign(b, v + x)]


def test_inline_hands_constants_to_their_users():
    """Users read a constant's value, never its name, also when the constant itself is kept."""
    program = program_of((c, sympy.Float(0.5)), (a, c * x), (b, c + v))
    assert inline_single_use(program, {a, b}) == [Assign(a, 0.5 * x), Assign(b, v + 0.5)]
    assert inline_single_use(program, {c, a, b}) == [Assign(c, sympy.Float(0.5)), Assign(a, 0.5 * x),
                                                       Assign(b, v + 0.5)]


def test_inline_folds_values_that_become_constant():
    zero = sympy.Integer(0)
    program = program_of((t0, zero), (t1, t0 * x), (h, t1 + v), (a, t1 * 2 + x))
    assert inline_single_use(program, {h, a}) == [Assign(h, v), Assign(a, x)]
    cond = sympy.Symbol("cond")
    program = program_of((cond, sympy.true), (t0, sympy.Piecewise((x, cond), (v, True))), (h, t0 + 1))
    assert inline_single_use(program, {h}) == [Assign(h, x + 1)]


def test_inline_on_an_empty_program():
    assert inline_single_use([], set()) == []
    assert inline_single_use([], {h}) == []


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_inline_on_neuron_forwards_keeps_values_and_order(name):
    """As the renderer calls it: the outputs, next states and saved values kept."""
    d = ALL_SPECS[name].derivation()
    tr = d.trace
    keep = set(tr.outputs) | set(tr.next_states) | set(d.saved)
    result = inline_single_use(list(d.forward), keep)

    targets = [line.target for line in result]
    order = [line.target for line in d.forward]
    assert targets == sorted(targets, key=order.index)
    # Every occurrence counts as a use (h ** h uses h twice); a fold flexgen.frontend.inlining refuses (a `where` into a
    # condition, say) leaves the value a variable, assigned just before its one consumer.
    uses = {line.target: sum(1 for other in d.forward for s in sympy.preorder_traversal(other.expr) if s == line.target)
            for line in d.forward}
    assert set(targets) >= keep & set(order)
    for k, t in enumerate(targets):
        refused_fold = k + 1 < len(result) and t in result[k + 1].expr.free_symbols
        assert t in keep or uses[t] >= 2 or refused_fold, t

    values = leaf_values(tr)
    inlined, original = evaluate(result, values), evaluate(d.forward, values)
    for target in keep:
        assert_close(inlined[target], original[target])
