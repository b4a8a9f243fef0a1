"""The package's shape: imports between flexgen's modules run one way (no circle, deferred imports included),
no module grows into several concerns again, and the kernel frames stay thin: short, and saying nothing twice."""
import ast
import pathlib
import re

import flexgen
from flexgen import frames

PACKAGE = pathlib.Path(flexgen.__file__).resolve().parent


def module_names():
    """dotted name -> file, for every module of the package (not the frames' static pieces, which an installed
    package keeps in flexgen/templates/static/: plain source the frames include, never imported)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] == "templates":
            continue
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


# The package's rooms (a folder of flexgen/, or a module at its top) in pipeline order: a room imports only rooms
# before it (or itself). The leaves first; then the stages (printing is a toolkit the front end prints steps
# with); the layer kinds and the compile stage that drives them; what users hold; what talks to other tools; the
# data sets the examples train on; the package's faces (its lazy loader names the public modules at run time) and
# the command line last.
ROOMS = ("version", "errors", "lazy", "frames", "printing", "frontend", "derive", "render", "cache", "launch",
         "kinds", "compile", "layers", "streaming", "neurons", "interop", "datasets", "surrogate", "__init__", "cli",
         "__main__")


def room_of(module):
    """The room of a dotted module name: its folder below flexgen/, or the top-level module itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def imports_running_back_up(graph):
    """(importer, imported) pairs whose imported room comes after the importer's in `ROOMS`."""
    order = {room: k for k, room in enumerate(ROOMS)}
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if order[room_of(b)] > order[room_of(a)])


def test_every_room_is_placed_in_the_pipeline():
    assert {room_of(name) for name in module_names()} <= set(ROOMS)


def test_no_import_runs_back_up_the_pipeline():
    """Deferred imports (inside functions) count: a stage that reaches into a later one, even lazily, is one
    program spread over two rooms."""
    modules = module_names()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph["flexgen.layers.neuron"] & {m for m in modules if m.startswith("flexgen.launch")}  # real edges
    assert imports_running_back_up(graph) == []


def test_the_order_check_finds_an_import_running_back_up():
    graph = {"flexgen.launch.abi": {"flexgen.layers.delay"}, "flexgen.layers.delay": {"flexgen.launch.abi"}}
    assert imports_running_back_up(graph) == [("flexgen.launch.abi", "flexgen.layers.delay")]


# A module of one concern fits in about 450 lines. OVER lists any that are a little over it and may not grow
# (none now).
MAX_LINES = 450
OVER = {}


def test_no_module_grows_past_450_lines():
    """cache.py reached 993 lines holding five concerns before it became a package, and four layer modules later
    sat at 700 with three to five each: a module this long is a sign that it should be split by concern."""
    lengths = {name: len(path.read_text().splitlines()) for name, path in module_names().items()}
    long = {name: n for name, n in lengths.items() if n > OVER.get(name, MAX_LINES)}
    assert long == {}
    assert all(lengths[name] > MAX_LINES for name in OVER), "a module is back under the cap: drop it from OVER"


# ---------------------------------------------------------------- the kernel frames


def frame_texts():
    """Every jinja2 frame (templates/**/*.j2) by its path below the template folder."""
    root = frames.template_dir()
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*.j2"))}


def test_no_frame_grows_past_250_lines():
    """A frame is a loop, loads and stores around the printed code; what frames share is a macro, and fixed code a
    static piece (templates/static/)."""
    texts = frame_texts()
    assert {"forward.py.j2", "c_forward.c.j2", "macros.j2"} <= set(texts)
    long = {name: n for name, text in texts.items() if (n := len(text.splitlines())) > 250}
    assert long == {}


_JINJA_COMMENT = re.compile(r"\{#.*?#\}", re.S)


def repeated_runs(texts, length=8):
    """(first place, later place) of every run of `length` consecutive non-blank lines (white space folded, jinja
    comments left out) that stands twice in `texts` (name -> text), across texts or within one."""
    first, found = {}, []
    for name, text in sorted(texts.items()):
        text = _JINJA_COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text)  # the lines keep their numbers
        lines = [(n, " ".join(line.split())) for n, line in enumerate(text.split("\n"), 1)]
        lines = [(n, line) for n, line in lines if line]
        for i in range(len(lines) - length + 1):
            run = tuple(line for _, line in lines[i:i + length])
            place = f"{name}:{lines[i][0]}"
            if run in first:
                found.append((first[run], place))
            else:
                first[run] = place
    return found


def test_no_run_of_eight_lines_repeats_in_the_frames():
    """What two frames (or two places of one) do alike is one macro in macros.j2, delay_macros.j2,
    recurrent_macros.j2 or c_macros.j2."""
    assert repeated_runs(frame_texts()) == []


def test_the_repeat_check_finds_a_planted_repeat():
    run = [f"{{{{ x{i} }}}} = tl.load(x{i}_ptr + row * n_elem + offs, mask=mask)" for i in range(8)]
    planted = {
        "a.j2": "{#- a comment\n   over two lines -#}\n" + "\n".join("    " + line for line in run) + "\n",
        "b.j2": "@triton.jit\n\n" + "\n\n".join("  " + line.replace(" = ", "  =  ") for line in run) + "\n",
        "c.j2": "\n".join(run[:7]) + "\n{# between #}\n\n",  # seven lines only
    }
    assert repeated_runs(planted) == [("a.j2:3", "b.j2:3")]
    within = {"d.j2": "\n".join(run + ["pass"] + run)}
    assert repeated_runs(within) == [("d.j2:1", "d.j2:10")]
    assert repeated_runs({**frame_texts(), **planted}) == [("a.j2:3", "b.j2:3")]
