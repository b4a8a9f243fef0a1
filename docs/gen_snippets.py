"""Write the documentation's code and equation snippets from the real code, into docs/generated/.

    python docs/gen_snippets.py [OUT_DIR]

The pages hold a copy of each file between two markers,

    <!-- generated from docs/generated/NAME by docs/gen_snippets.py -->
    ... (the file, in a fenced block where the page had one)
    <!-- end of docs/generated/NAME -->

so they read complete on GitHub too, and this script refreshes the copies: what
the pages show is what this checkout generates (LIF's traced step, derived
equations and kernels, the bundled neurons' equations, the actual SpecError
messages and `flexgen --help`). tests/test_docs.py fails when a copy is stale.
`mkdocs build` runs this first (docs/hooks.py); files and pages are rewritten
only when their content changes.
"""
import atexit
import contextlib
import functools
import importlib.util
import io
import os
import pathlib
import re
import shutil
import sys
import tempfile

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sympy  # noqa: E402
from sympy.printing.latex import LatexPrinter  # noqa: E402

import flexgen  # noqa: E402

LIF_SOURCE = '''\
import flexgen


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s)
'''


CUBA_SOURCE = '''\
import flexgen


@flexgen.ode(states=("i", "v"), dt=0.5)
def cuba_lif(x, i, v, tau_syn=2.0, tau_mem=8.0, r=1.0, v_th=1.0, v_reset=0.0):
    return flexgen.Dynamics(
        {"i": (x - i) / tau_syn,               # di/dt: a synaptic current fed by the input
         "v": (r * i - v) / tau_mem},          # dv/dt: the membrane, fed by the current
        threshold=v >= v_th,                   # fires where this holds after the step
        reset={"v": v_reset},
    )
'''


class StepLatex(LatexPrinter):
    """LaTeX for traced steps: Θ for spikes, σ for the logistic function, sg(·) for detach."""

    def _print_SpikeBase(self, expr):
        return r"\Theta\left(%s\right)" % self._print(expr.args[0])

    def _print_sigmoid(self, expr):
        return r"\sigma\left(%s\right)" % self._print(expr.args[0])

    def _print_detach(self, expr):
        return r"\operatorname{sg}\left(%s\right)" % self._print(expr.args[0])


def _symbol_latex(name):
    stem, _, sub = name.partition("_")
    head = sympy.latex(sympy.Symbol(stem))
    return f"{head}_{{\\mathrm{{{sub.replace('_', ' ')}}}}}" if sub else head


def step_latex(trace):
    """The traced step as aligned equations: user-named values kept, tmpN inlined, new states primed."""
    results = {s: f"{st}'" for st, s in zip(trace.states, map(str, trace.next_states))}
    results.update({str(o): str(o) for o in trace.outputs})
    names = {sym: _symbol_latex(str(sym)) for a in trace.program for sym in a.expr.free_symbols}
    subs, lines = {}, []
    for a in trace.program:
        expr = a.expr.xreplace(subs)
        target = str(a.target)
        if target.startswith("tmp") and target not in results:
            subs[a.target] = expr
            continue
        subs_name = results.get(target, target)
        lhs = _symbol_latex(subs_name[:-1]) + "'" if subs_name.endswith("'") else _symbol_latex(subs_name)
        names[a.target] = _symbol_latex(target)
        printer = StepLatex({"symbol_names": names, "mul_symbol": None})
        lines.append(f"{lhs} &= {printer.doprint(expr)}")
    body = " \\\\\n".join(lines)
    return "$$\n\\begin{aligned}\n" + body + "\n\\end{aligned}\n$$\n"


@functools.lru_cache(maxsize=None)
def _scratch_dir():
    """One temporary folder per process for the snippets' source files, removed when the process exits."""
    path = tempfile.mkdtemp(prefix="flexgen-docs-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _load(source, name="my_neuron"):
    """Import `source` from a real file (so SpecErrors can quote its lines); returns (module, path)."""
    directory = tempfile.mkdtemp(prefix=f"{name}-", dir=_scratch_dir())
    path = os.path.join(directory, f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"_flexgen_docs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    return module, spec, path


def lif_snippets():
    module, spec, _ = _load(LIF_SOURCE, "lif_doc")
    spec.loader.exec_module(module)
    lif = module.lif
    derivation = lif.derivation()
    out = {
        "lif_source.py": LIF_SOURCE,
        "lif_trace.txt": "\n".join(str(a) for a in lif.trace().program) + "\n",
        "lif_equations.txt": lif.equations().rstrip("\n") + "\n",
        "lif_saved.txt": ", ".join(str(s) for s in derivation.saved) + "\n",
        "lif_step.md": step_latex(lif.trace()),
    }
    for kind in ("forward", "inference", "backward", "backward_recompute", "torch_forward", "torch_backward"):
        out[f"lif_{kind}.py"] = lif.source(kind).rstrip("\n") + "\n"
    c_source = lif.source("c")
    start = c_source.index("void lif_forward_f32(")
    out["lif_c_forward.c"] = c_source[:c_source.index("\n\n#define scalar_t")] + "\n\n#define scalar_t float\n\n" + \
        c_source[start:c_source.index("\n}\n", start) + 3]
    recurrent = flexgen.Recurrent(lif, hidden=4)
    for kind in ("forward", "backward"):
        out[f"recurrent_lif_{kind}.py"] = recurrent.source(kind).rstrip("\n") + "\n"
    return out


def ode_snippets():
    """The equations front end on a current-based LIF: its source, the step flexgen wrote, equations()."""
    import inspect

    module, spec, path = _load(CUBA_SOURCE, "cuba_doc")
    spec.loader.exec_module(module)
    cuba = module.cuba_lif
    return {
        "ode_source.py": CUBA_SOURCE,
        "ode_step.py": inspect.getsource(cuba.fn).replace(os.path.dirname(path) + os.sep, ""),
        "ode_equations.txt": cuba.equations().rstrip("\n") + "\n",
        "ode_forward.py": cuba.source("forward").rstrip("\n") + "\n",
    }


def eventprop_snippets():
    """EventProp: the adjoint system of the bundled LIF as `flexgen show OdeLIF --adjoint` prints it, and the torch
    functions the reference runs for the current-based LIF of the page."""
    from flexgen import cli
    from flexgen.layers import eventprop

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli.main(["show", "OdeLIF", "--adjoint"])
    module, spec, _ = _load(CUBA_SOURCE, "cuba_doc")
    spec.loader.exec_module(module)
    return {"eventprop_lif_adjoint.txt": buf.getvalue(),
            "eventprop_cuba_functions.py": eventprop._functions(module.cuba_lif)[1].rstrip("\n") + "\n"}


def surrogates_table():
    """Every surrogate in flexgen.surrogate.available(): default parameters, derivative, alpha derivative."""
    z, alpha = sympy.Symbol("z", real=True), sympy.Symbol("alpha", positive=True)

    def latex(expr):
        return "$" + StepLatex().doprint(expr).replace("|", r"\vert ") + "$"  # a bare | would split the table cell

    rows = ["| surrogate | default | replaces dΘ/dz by | with `learnable_alpha`, alpha's gradient dg/dα |", "|---|---|---|---|"]
    for name, cls in flexgen.surrogate.available().items():
        sur = cls()
        by_alpha = latex(sur.with_alpha(alpha).alpha_derivative(z)) if "alpha" in sur.params() else "(no alpha)"
        rows.append(f"| `flexgen.surrogate.{name}` | `{sur!r}` | {latex(sur.derivative(z))} | {by_alpha} |")
    return "\n".join(rows) + "\n"


def _param_table(spec):
    sig = spec.signature
    rows = []
    for name in sig.parameters:
        if name in sig.inputs:
            role, default = "input", ""
        elif name in sig.states:
            init = sig.init[name]
            role, default = "state", f"initial value `{init}`"
        elif name in sig.learnable:
            role, default = "learnable", f"`{sig.defaults[name]!r}`"
        elif name in sig.hyper:
            role, default = "hyper-parameter", f"`{sig.defaults[name]!r}`"
        else:
            role, default = "specialisation", f"`{sig.defaults[name]!r}`"
        rows.append(f"| `{name}` | {role} | {default} |")
    return "| parameter | role | default |\n|---|---|---|\n" + "\n".join(rows) + "\n"


def neurons_page():
    neurons = getattr(flexgen, "neurons", None)
    if neurons is None or not callable(getattr(neurons, "available", None)):
        raise SystemExit("gen_snippets.py: flexgen.neurons.available() does not exist in this checkout")
    parts = []
    for name in neurons.available():
        obj = neurons.get(name)
        spec = getattr(obj, "spec", obj)
        summary = (obj.__doc__ or "").strip().split("\n\n")[0]
        summary = " ".join(line.strip() for line in summary.splitlines())
        trace = spec.trace()
        kind = "layer class" if obj is not spec else "neuron spec"
        parts.append(f"## {name}\n")
        parts.append(f"`flexgen.neurons.get({name!r})` — {kind}. {summary}\n")
        parts.append(_param_table(spec))
        system = getattr(spec, "system", None)
        if system is not None:  # a flexgen.ode model: its equations, then the step flexgen derived
            equations = "\n".join(system.lines())
            parts.append(f"Equations (`flexgen.ode`, method `{spec.method}`):\n\n```text\n{equations}\n```\n")
        parts.append("Traced step (default options; Θ is the spike, σ the logistic function, sg(·) a detached value, "
                     "primes are the new states):\n")
        parts.append(step_latex(trace))
        saved = ", ".join(f"`{s}`" for s in spec.derivation().saved) or "nothing"
        parts.append(f"Saved for the backward per step: {saved}. "
                     f"See the kernels with `flexgen show {name} --kernel backward`.\n")
    return "\n".join(parts)


# Each case: (title, explanation, source that fails when imported).
ERROR_CASES = [
    ("Python `if` on a traced value",
     "The step runs once, on symbols, to generate code for all neurons; branch with `flexgen.where`.",
     '''import flexgen

@flexgen.neuron(states=("v",))
def bad(x, v, v_th=1.0):
    h = v + x
    if h > v_th:
        return 1.0, 0.0
    return 0.0, h

bad()
'''),
    ("A comparison where a number is expected",
     "`spike` takes the difference that crosses zero when the neuron fires (its surrogate gradient is a function "
     "of it), and arithmetic needs numbers: write `spike(h - v_th)`, or `flexgen.where(h >= v_th, 1.0, 0.0)` for "
     "a 0/1 value.",
     '''import flexgen

@flexgen.neuron(states=("v",))
def bad(x, v, v_th=1.0):
    h = v + x
    s = flexgen.spike(h > v_th)
    return s, h * (1.0 - s)

bad()
'''),
    ("A `math` (or `float()`) call on a traced value",
     "Use the functions in the `flexgen` namespace: `flexgen.exp`, `flexgen.log`, `flexgen.sigmoid`, ...",
     '''import math
import flexgen

@flexgen.neuron(states=("v",))
def bad(x, v, tau=2.0):
    h = v * math.exp(-1.0 / tau) + x
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)

bad()
'''),
    ("A torch function in the step",
     "Tensors never enter the step function while it is traced; use the `flexgen` math functions.",
     '''import torch
import flexgen

@flexgen.neuron(states=("v",))
def bad(x, v):
    h = torch.sigmoid(v) + x
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)

bad()
'''),
    ("`torch.tensor` of a hyper-parameter",
     "A hyper-parameter is already a number in the step: use it as it is, with the `flexgen` math functions.",
     '''import torch
import flexgen

@flexgen.neuron(states=("v",))
def bad(x, v, tau=2.0):
    h = v + (x - v) / torch.tensor(tau)
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)

bad()
'''),
    ("Too few return values",
     "Return the outputs first, then one new value per state, in the order of `states=`.",
     '''import flexgen

@flexgen.neuron(states=("v", "a"))
def bad(x, v, a):
    h = v + x
    return h, a

bad()
'''),
    ("An operation with no finite real value",
     "sympy evaluates operations on constants while tracing; one that is infinite, undefined or complex for "
     "every neuron (a division by zero, the log of zero, the root of a negative number) is refused.",
     '''import flexgen

@flexgen.neuron(states=("v",))
def bad(x, v, tau=2.0):
    h = v + (x - v) / (tau - tau)
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)

bad()
'''),
    ("A parameter named like something the kernels make from another name",
     "The kernels name a learnable parameter's channel count `<name>_size`, a state's checkpoints `<name>_ckpt`, "
     "...; rename one of the two.",
     '''import flexgen

@flexgen.neuron(states=("v",), learnable=("w",))
def bad(x, v, w=0.5, w_size=2.0):
    h = v + (x - v) * w * w_size
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)

bad()
'''),
    ("A hyper-parameter given a tensor that requires grad",
     "Hyper-parameters are plain numbers (one per layer); a value to train is a learnable parameter.",
     '''import torch
import flexgen

@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)

layer = lif(tau=torch.tensor(2.0, requires_grad=True))
'''),
    ("A learnable parameter without a default",
     "A learnable parameter's default is its initial value.",
     '''import flexgen

@flexgen.neuron(states=("v",), learnable=("w",))
def bad(x, v, w):
    h = v + w * x
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)
'''),
    ("A default that is neither a number nor an option",
     "Numbers are runtime hyper-parameters; bool, None, str and surrogate defaults are static options.",
     '''import flexgen

@flexgen.neuron(states=("v",))
def bad(x, v, taus=[2.0, 4.0]):
    h = v + x
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)
'''),
    ("`init` naming something that is not a hyper-parameter",
     "A state's initial value is a number or the name of a hyper-parameter of the step.",
     '''import flexgen

@flexgen.neuron(states=("v",), init={"v": "v_rest"})
def bad(x, v, v_reset=0.0):
    h = v + x
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)
'''),
    ("No per-step input",
     "Parameters without a default are the per-step inputs; a neuron needs at least one.",
     '''import flexgen

@flexgen.neuron(states=("v",))
def bad(v, drive=1.0):
    h = v + drive
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)
'''),
    ("`states` naming a missing parameter",
     "Every state is also a parameter of the step function (its value before the step).",
     '''import flexgen

@flexgen.neuron(states=("u",))
def bad(x, v):
    s = flexgen.spike(v + x - 1.0)
    return s, v + x
'''),
    ("`flexgen.ode`: `method=\"exact\"` for equations that are not linear",
     "The exact solution needs equations linear in the states; the message names the term that is not. "
     "Use `method=\"auto\"`, an explicit method, or `exponential_euler` where each equation is linear in its own state.",
     '''import flexgen

@flexgen.ode(states=("v",), method="exact")
def bad(x, v, tau=2.0, v_c=0.5):
    return flexgen.Dynamics({"v": (v * (v - v_c) + x) / tau}, threshold=v >= 1.0, reset={"v": 0.0})
'''),
    ("`flexgen.ode`: `dt` in the equations",
     "Equations state rates of change; flexgen adds the step size `dt` (a hyper-parameter) when it integrates them.",
     '''import flexgen

@flexgen.ode(states=("v",))
def bad(x, v, tau=2.0, dt=0.1):
    return flexgen.Dynamics({"v": v + dt * (x - v) / tau}, threshold=v >= 1.0, reset={"v": 0.0})
'''),
    ("The decorator without parentheses",
     "`flexgen.neuron` takes options; write `@flexgen.neuron(states=(...))`.",
     '''import flexgen

@flexgen.neuron
def bad(x, v):
    return x, v
'''),
]


def _capture_error(source):
    module, spec, path = _load(source, "my_neuron")
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the point is to record the message
        kind = type(exc).__qualname__ if type(exc).__module__ == "builtins" else f"{type(exc).__module__}.{type(exc).__qualname__}"
        message = f"{kind}: {exc}"
        return message.replace(os.path.dirname(path) + os.sep, "")
    raise AssertionError(f"this example was expected to fail:\n{source}")


def errors_page():
    parts = []
    for title, why, source in ERROR_CASES:
        message = _capture_error(source).replace("flexgen.errors.SpecError", "flexgen.SpecError")
        parts.append(f"### {title}\n\n{why}\n\n```python\n# my_neuron.py\n{source.rstrip()}\n```\n\n"
                     f"```text\n{message}\n```\n")
    triton_case = '''import torch, flexgen

@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - 1.0)
    return s, h * (1.0 - s)

lif(backend="triton")(torch.rand(4, 8))
'''
    from flexgen.launch import c_path

    saved, available = os.environ.pop("TRITON_INTERPRET", None), c_path.available
    c_path.available = lambda: True  # the page shows a machine with a C compiler, wherever it is generated
    try:
        message = _capture_error(triton_case)
    finally:
        c_path.available = available
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    parts.append("### `backend=\"triton\"` on CPU tensors\n\nThe Triton kernels need CUDA tensors, or Triton's "
                 "interpreter (`TRITON_INTERPRET=1`, set before flexgen is imported). `backend=\"auto\"` (the "
                 "default) runs the generated C kernels on the CPU where a C compiler is available, else the "
                 "generated torch code; without a compiler the message suggests `backend='torch'`.\n\n"
                 f"```python\n# my_neuron.py\n{triton_case.rstrip()}\n```\n\n```text\n{message}\n```\n")
    return "\n".join(parts)


def cli_help():
    from flexgen import cli

    out = {}
    os.environ["COLUMNS"] = "88"  # argparse wraps help to the terminal width
    for name, argv in (("cli_help.txt", ["--help"]), ("cli_show_help.txt", ["show", "--help"]),
                       ("cli_bench_help.txt", ["bench", "--help"]),
                       ("cli_cache_clear_help.txt", ["cache", "clear", "--help"])):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                cli.build_parser().parse_args(argv)
            except SystemExit:
                pass
        out[name] = re.sub(r"^usage: \S+", "usage: flexgen", buf.getvalue(), flags=re.M)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        cli.main(["list"])
    out["cli_list.txt"] = buf.getvalue()
    return out


def perf_notes():
    """The engineering notes on performance (docs/perf/NOTES.md), shown on the performance page."""
    notes = DOCS / "perf" / "NOTES.md"
    return notes.read_text() if notes.is_file() else "No benchmark notes are recorded in this checkout.\n"


def perf_results():
    """The lead's recorded benchmark results (benchmarks/bench_lif.py writes docs/perf/), if any."""
    table = DOCS / "perf" / "bench_lif.md"
    if not table.is_file():
        return ("No benchmark results are recorded in this checkout yet: `docs/perf/bench_lif.md` does not exist. "
                "Run `python benchmarks/bench_lif.py` on a GPU machine to produce it; the next docs build shows it here.\n")
    text = table.read_text()
    # Links in the table are relative to docs/perf/; the page including it lives in docs/.
    return re.sub(r"\]\((?!https?:|/|#)([^)]+)\)", r"](perf/\1)", text)


def generate(out_dir=DOCS / "generated"):
    """Write every snippet; returns the names of files whose content changed."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {**lif_snippets(), **ode_snippets(), **eventprop_snippets(), **cli_help(), "neurons.md": neurons_page(), "errors.md": errors_page(),
             "perf_results.md": perf_results(), "perf_notes.md": perf_notes(), "surrogates.md": surrogates_table()}
    changed = []
    for name, text in files.items():
        path = out_dir / name
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    return changed


GENERATED_COPY = re.compile(
    r"<!-- generated from (docs/generated/[\w.-]+) by docs/gen_snippets.py -->\n(.*?)<!-- end of \1 -->\n", re.S)


def pages():
    """The documentation's pages and the README."""
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


def with_copies(text, generated_dir):
    """A page's text with every marked copy replaced by the generated file it names (kept in its fence)."""

    def copy(match):
        name, old = match.group(1), match.group(2).strip("\n")
        body = (pathlib.Path(generated_dir) / pathlib.Path(name).name).read_text().rstrip("\n")
        if old.startswith("```"):
            body = f"{old.splitlines()[0]}\n{body}\n```"
        return f"<!-- generated from {name} by docs/gen_snippets.py -->\n\n{body}\n\n<!-- end of {name} -->\n"

    return GENERATED_COPY.sub(copy, text)


def stale_pages(generated_dir=DOCS / "generated"):
    """{page: refreshed text} for each page whose copies differ from the generated files."""
    stale = {}
    for page in pages():
        text = page.read_text()
        refreshed = with_copies(text, generated_dir)
        if refreshed != text:
            stale[page] = refreshed
    return stale


def refresh_pages(generated_dir=DOCS / "generated"):
    """Rewrite the pages whose copies are stale; returns their names."""
    stale = stale_pages(generated_dir)
    for page, text in stale.items():
        page.write_text(text)
    return [page.name for page in stale]


def main(argv):
    if "FLEXGEN_CACHE_DIR" not in os.environ:
        os.environ["FLEXGEN_CACHE_DIR"] = os.path.join(_scratch_dir(), "cache")
    out_dir = argv[1] if len(argv) > 1 else DOCS / "generated"
    changed = generate(out_dir)
    print(f"gen_snippets: {len(changed)} file(s) updated in {out_dir}")
    refreshed = refresh_pages(out_dir)
    print(f"gen_snippets: {len(refreshed)} page(s) refreshed {refreshed}")


if __name__ == "__main__":
    main(sys.argv)
