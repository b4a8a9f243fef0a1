"""The package's shape: imports between flexgen's modules run one way (no circle, deferred imports included),
and no module grows into several concerns again."""
import ast
import pathlib

import flexgen

PACKAGE = pathlib.Path(flexgen.__file__).resolve().parent


def module_names():
    """dotted name -> file, for every module of the package."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("flexgen",) + path.relative_to(PACKAGE).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name, path, modules):
    """The flexgen modules `name` imports anywhere in its file (at the top or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_the_modules():
    modules = module_names()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph["flexgen.layers.ode_spec"] >= {"flexgen.frontend.ode_step"}  # the check sees real edges
    assert circles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_grows_past_700_lines():
    """cache.py reached 993 lines holding five concerns before it became a package: a module this long is a sign
    that it should be split by concern."""
    long = {name: n for name, path in module_names().items() if (n := len(path.read_text().splitlines())) > 700}
    assert long == {}
