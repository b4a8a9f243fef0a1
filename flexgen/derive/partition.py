"""Stage 2, derive (part): which forward values the backward kernel reads, a minimum vertex cut.

Takes the forward program from derive; hands it back the saved set.

The backward needs some forward values at every step. It can read them only
from memory: inputs cost one read, outputs (already written) one read, and
anything else, states before the step included, a write in the forward plus a
read in the backward. Every path from the per-step leaves (inputs, states) to a
needed value must pass through something read from memory, the rest is
recomputed. The cheapest such set is a minimum cut of the step's expression
graph, the idea behind PyTorch's AOTAutograd partitioner.
"""
import collections

INFINITE = float("inf")


def _max_flow_source_side(capacity, source, sink):
    """Edmonds–Karp; returns the vertices reachable from `source` in the final residual graph."""
    residual = collections.defaultdict(dict)
    for u, edges in capacity.items():
        for v, c in edges.items():
            residual[u][v] = residual[u].get(v, 0) + c
            residual[v].setdefault(u, 0)
    while True:
        parent = {source: None}
        queue = collections.deque([source])
        while queue and sink not in parent:
            u = queue.popleft()
            for v, c in residual[u].items():
                if c > 0 and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return set(parent)
        path, v = [], sink
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        push = min(residual[u][v] for u, v in path)
        for u, v in path:
            residual[u][v] -= push
            residual[v][u] += push


def choose_saved(program, per_step_leaves, read_cost, needed):
    """The cheapest set of symbols from which every symbol in `needed` can be recomputed.

    program: forward assignments; per_step_leaves: leaves that change every step
    (inputs, states); read_cost(symbol): memory passes to make it available in
    the backward; needed: symbols the backward uses. Leaves not in
    per_step_leaves (parameters) are always available.
    """
    source, sink = ("source",), ("sink",)
    capacity = collections.defaultdict(dict)
    varying = set(per_step_leaves)
    for leaf in per_step_leaves:
        capacity[source][("in", leaf)] = INFINITE
        capacity[("in", leaf)][("out", leaf)] = read_cost(leaf)
    for a in program:
        deps = [s for s in a.expr.free_symbols if s in varying]
        if not deps:
            continue  # depends on parameters only: always recomputable
        varying.add(a.target)
        capacity[("in", a.target)][("out", a.target)] = read_cost(a.target)
        for d in deps:
            capacity[("out", d)][("in", a.target)] = INFINITE
    for s in needed:
        if s in varying:
            capacity[("out", s)][sink] = INFINITE
    reachable = _max_flow_source_side(capacity, source, sink)
    order = list(per_step_leaves) + [a.target for a in program]
    return [s for s in order if ("in", s) in reachable and ("out", s) not in reachable]
