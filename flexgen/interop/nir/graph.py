"""Checks on a NIR graph before anything is built from it: its edges, its one Input and one Output node, every node
on a path between them, the shapes along each edge, and no recurrent connection but a recurrent layer's loop (`fold_recurrence`); and the order the nodes of a
checked graph run in. Every walk here is a loop over the nodes and edges once (no recursion along paths), so graphs
of any depth are checked in time linear in their size."""
import collections

import numpy

from .packages import optional


def _graphs(graph, where):
    """The graph and every subgraph in it (nested ones too), each with the words that name it in messages: a graph
    comes before its subgraphs, and a subgraph's own subgraphs before its next sibling."""
    nir = optional("nir")

    todo = [(graph, where)]
    while todo:
        graph, where = todo.pop()
        yield graph, where
        inner = [(node, f"subgraph {name!r}") for name, node in graph.nodes.items() if isinstance(node, nir.NIRGraph)]
        todo.extend(reversed(inner))


def check_graph(graph, where="the graph"):
    """Refuse, before anything is built, a graph that cannot run as one model: edges to unknown nodes, other than one
    Input and one Output node, a node off every path from the Input to the Output node, or an edge between nodes
    whose declared shapes differ; the same for each subgraph."""
    for graph, where in _graphs(graph, where):
        _check_one_graph(graph, where)


def _check_one_graph(graph, where):
    nir = optional("nir")

    names = list(graph.nodes)
    following, preceding = {}, {}
    for source, target in graph.edges:
        for end in (source, target):
            if end not in graph.nodes:
                raise ValueError(f"flexgen.from_nir: {where} has an edge ({source!r}, {target!r}) to {end!r}, which is "
                                 f"not one of its nodes {names}")
        following.setdefault(source, []).append(target)
        preceding.setdefault(target, []).append(source)
    ends = {kind: [n for n, node in graph.nodes.items() if isinstance(node, getattr(nir, kind))]
            for kind in ("Input", "Output")}
    for kind, found in ends.items():
        if len(found) != 1:
            raise ValueError(
                f"flexgen.from_nir: {where} has {len(found)} {kind} nodes {found}; the model it becomes takes one "
                f"sequence and returns one, so it needs exactly one (nir.NIRGraph gives every node left without "
                f"edges an Input and an Output node of its own, named input_<node> and output_<node>)"
            )
    for kind, links, relation in (("Input", following, "reached from"), ("Output", preceding, "leading to")):
        reached = _reachable(ends[kind], links)
        off_path = [n for n in names if n not in reached]
        if off_path:
            raise ValueError(
                f"flexgen.from_nir: {where} has node(s) {off_path} on no path {relation} an {kind} node "
                f"{ends[kind]} ({len(graph.edges)} edge(s)); every node must lie on a path from an Input to an Output"
            )
    for source, target in graph.edges:
        _check_edge_shapes(graph, source, target, where)


def _reachable(starts, links):
    seen, todo = set(starts), list(starts)
    while todo:
        for following in links.get(todo.pop(), ()):
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


def declared_shape(types):
    """The one shape a node declares for its input or output, or None where it declares none (or several)."""
    if not types or len(types) != 1:
        return None
    shape = next(iter(types.values()))
    return None if shape is None else tuple(int(d) for d in numpy.asarray(shape).reshape(-1))


def _check_edge_shapes(graph, source, target, where):
    produced = declared_shape(getattr(graph.nodes[source], "output_type", None))
    expected = declared_shape(getattr(graph.nodes[target], "input_type", None))
    if produced is not None and expected is not None and produced != expected:
        raise ValueError(f"flexgen.from_nir: in {where}, {source!r} outputs shape {list(produced)} "
                         f"but {target!r} takes shape {list(expected)} (edge {source!r} -> {target!r})")


def check_feedforward(graph, where="the graph"):
    """Refuse a graph (or subgraph) with a cycle, naming the nodes along it: flexgen layers run all time steps at
    once, which a recurrent connection does not allow (but for a recurrent layer's loop, which `fold_recurrence`
    takes out first)."""
    for graph, where in _graphs(graph, where):
        check_acyclic(graph, where)


def check_acyclic(graph, where):
    """A depth-first walk from each node in turn, following edges in their order; the walk keeps its path (the nodes
    still open) and, for each, where it is in that node's edges. An edge back to an open node closes a cycle."""
    following = {}
    for source, target in graph.edges:
        following.setdefault(source, []).append(target)
    done = set()
    for root in graph.nodes:
        if root in done:
            continue
        path, position = [root], {root: 0}  # the open nodes, and each one's place in the path
        edges = [iter(following.get(root, ()))]
        while path:
            for target in edges[-1]:
                if target in position:
                    cycle = " -> ".join(path[position[target]:] + [target])
                    raise NotImplementedError(
                        f"flexgen.from_nir: {where} is recurrent ({cycle}); flexgen layers run all time steps at "
                        "once, which a recurrent connection does not allow, but for a recurrent layer's loop (a "
                        "neuron node whose output feeds only an Affine or Linear node back into it)"
                    )
                if target not in done:
                    position[target] = len(path)
                    path.append(target)
                    edges.append(iter(following.get(target, ())))
                    break
            else:  # every edge of the last open node followed
                finished = path.pop()
                del position[finished]
                done.add(finished)
                edges.pop()


def fold_recurrence(graph, neuron_kinds):
    """(graph without its recurrent loops, {neuron node: (its feedback node, the Delay node before it or None)}): a
    loop is a neuron node (of a class in `neuron_kinds`) whose output feeds an Affine or Linear node, through a
    Delay node or not, that feeds nothing but the neuron back (NIR's form of a recurrent layer: the neuron reads
    the product of its output one step, plus the delay, earlier); the loop's other nodes and edges leave the
    graph, which `reading` runs as one `flexgen.Recurrent`. Other cycles stay (and are refused)."""
    nir = optional("nir")

    following, preceding = collections.defaultdict(set), collections.defaultdict(set)
    for source, target in graph.edges:
        following[source].add(target)
        preceding[target].add(source)

    def only(links, name):
        return next(iter(links[name])) if len(links[name]) == 1 else None

    loops = {}
    for name, node in graph.nodes.items():
        if not isinstance(node, (nir.Affine, nir.Linear)):
            continue
        back, before = only(following, name), only(preceding, name)
        if back is None or before is None:
            continue
        delay = None
        if isinstance(graph.nodes[before], nir.Delay) and only(preceding, before) == back \
                and following[before] == {name}:
            delay, before = before, back
        if before == back and isinstance(graph.nodes[back], tuple(neuron_kinds)) and back not in loops:
            loops[back] = (name, delay)
    if not loops:
        return graph, {}
    dropped = {n for loop in loops.values() for n in loop if n is not None}
    nodes = {name: node for name, node in graph.nodes.items() if name not in dropped}
    edges = [tuple(edge) for edge in graph.edges if edge[0] not in dropped and edge[1] not in dropped]
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=dict(graph.metadata), type_check=False), loops


def running_order(graph):
    """[(node, the nodes it takes input from)] of a checked graph (one Input node, every node reached from it, no
    cycle), in an order where every node comes after those it takes input from: the Input node first, the Output node
    last. A node's inputs are in the order of its edges; an edge given twice counts once."""
    sources = {name: [] for name in graph.nodes}
    following = {name: [] for name in graph.nodes}
    for source, target in dict.fromkeys(tuple(edge) for edge in graph.edges):
        sources[target].append(source)
        following[source].append(target)
    waiting = {name: len(inputs) for name, inputs in sources.items()}
    ready = collections.deque(name for name, count in waiting.items() if count == 0)
    order = []
    while ready:
        name = ready.popleft()
        order.append((name, sources[name]))
        for target in following[name]:
            waiting[target] -= 1
            if waiting[target] == 0:
                ready.append(target)
    return order
