"""Checks on a NIR graph before anything is built from it: its edges, its one Input and one Output node, every node
on a path between them, the shapes along each edge, and no recurrent connection."""
import numpy

from .packages import optional


def check_graph(graph, where="the graph"):
    """Refuse, before anything is built, a graph nirtorch cannot run: edges to unknown nodes, other than one Input
    and one Output node, a node off every path from the Input to the Output node (nirtorch loops forever on such
    graphs), or an edge between nodes whose declared shapes differ."""
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
        off_path = [n for n in names if n not in _reachable(ends[kind], links)]
        if off_path:
            raise ValueError(
                f"flexgen.from_nir: {where} has node(s) {off_path} on no path {relation} an {kind} node "
                f"{ends[kind]} ({len(graph.edges)} edge(s)); every node must lie on a path from an Input to an Output"
            )
    for source, target in graph.edges:
        _check_edge_shapes(graph, source, target, where)
    for name, node in graph.nodes.items():
        if isinstance(node, nir.NIRGraph):
            check_graph(node, f"subgraph {name!r}")


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
    nir = optional("nir")

    edges = {}
    for source, target in graph.edges:
        edges.setdefault(source, []).append(target)
    state = {}

    def visit(name, path):
        state[name] = "open"
        for following in edges.get(name, ()):
            if state.get(following) == "open":
                cycle = " -> ".join(path[path.index(following):] + [following]) if following in path else following
                raise NotImplementedError(
                    f"flexgen.from_nir: {where} is recurrent ({cycle}); flexgen layers run all time steps at once, "
                    "which a recurrent connection does not allow"
                )
            if following not in state:
                visit(following, path + [following])
        state[name] = "done"

    for name in graph.nodes:
        if name not in state:
            visit(name, [name])
    for name, node in graph.nodes.items():
        if isinstance(node, nir.NIRGraph):
            check_feedforward(node, f"subgraph {name!r}")


def node_names(graph, prefix=""):
    """id(node) -> its name in the graph (dotted in subgraphs), for messages."""
    nir = optional("nir")

    names = {}
    for name, node in graph.nodes.items():
        names[id(node)] = prefix + name
        if isinstance(node, nir.NIRGraph):
            names.update(node_names(node, f"{prefix}{name}."))
    return names
