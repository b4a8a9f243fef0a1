"""The `flexgen` command line: list bundled neurons, show generated code, manage the cache, benchmark.

    flexgen list
    flexgen show NEURON [--kernel KIND] [--equations] [--adjoint] [--color auto|always|never]
    flexgen cache info
    flexgen cache clear [--older-than DAYS] [--force]
    flexgen bench NEURON [--steps T] [--neurons N] [--dtype float32|float16|bfloat16]

NEURON is the name of a bundled neuron (see `flexgen list`) or a neuron of your
own, written `path/to/file.py:name` or `package.module:name`. A file is imported
as a module named `_flexgen_cli_<file>`: its top-level code runs, code under
`if __name__ == "__main__":` does not.
`python -m flexgen ...` runs the same commands. Exit status: 0 on success,
1 for an error (unknown neuron, a spec flexgen cannot compile), 2 for a usage
error or, for `bench`, a machine without a CUDA GPU.
"""
import argparse
import datetime
import importlib
import importlib.util
import os
import re
import sys

from .errors import SpecError

KINDS = ("forward", "inference", "backward", "forward_recompute", "backward_recompute", "torch_forward",
         "torch_backward", "c", "module")


class CLIError(Exception):
    """A problem to report in one line, with an exit status."""

    def __init__(self, message, status=1):
        super().__init__(message)
        self.status = status


def _zoo():
    """flexgen.neurons, checked for the `available()` / `get(name)` API."""
    import flexgen.neurons as neurons

    missing = [f for f in ("available", "get") if not callable(getattr(neurons, f, None))]
    if missing:
        raise CLIError(
            f"this flexgen build has no bundled neuron zoo (flexgen.neurons lacks {', '.join(missing)}()); "
            "name a neuron of your own as FILE.py:NAME or MODULE:NAME"
        )
    return neurons


def _as_spec(obj, name):
    """The NeuronSpec behind a zoo entry or user object (a spec, a layer, or a class with `.spec`)."""
    from .layers.spec import NeuronSpec

    if isinstance(obj, NeuronSpec):
        return obj
    spec = getattr(obj, "spec", None)
    if isinstance(spec, NeuronSpec):
        return spec
    raise CLIError(f"{name!r} is a {type(obj).__name__}, not a flexgen neuron (a @flexgen.neuron spec)")


def _is_path(where):
    return where.endswith(".py") or os.sep in where or "/" in where


def _load_user_module(where):
    """The module `where` names: a file (`path/to/file.py`) or an importable module (`package.module`)."""
    if _is_path(where):
        if not os.path.isfile(where):
            raise CLIError(f"no such file: {where}")
        module_name = "_flexgen_cli_" + os.path.splitext(os.path.basename(where))[0]
        spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise CLIError(f"cannot import {where!r}: {exc}") from exc


def _load_user_object(target):
    """`file.py:name` or `package.module:name` -> the object."""
    where, _, attr = target.rpartition(":")
    if not attr:
        _missing_name(where)
    module = _load_user_module(where)
    if not hasattr(module, attr):
        raise CLIError(f"{where} has no attribute {attr!r}")
    return getattr(module, attr)


def _missing_name(where):
    """CLIError for a file or module named without the neuron in it: the FILE.py:NAME syntax and its neurons."""
    from .layers.spec import NeuronSpec

    module = _load_user_module(where)
    found = sorted(k for k, v in vars(module).items()
                   if isinstance(v, NeuronSpec) or isinstance(getattr(v, "spec", None), NeuronSpec))
    example = f"{where}:{found[0] if found else 'NAME'}"
    listed = f"; neurons in it: {', '.join(found)}" if found else "; it defines no @flexgen.neuron"
    raise CLIError(f"{where} names a file or module, not a neuron: write FILE.py:NAME or MODULE:NAME, e.g. "
                   f"{example}{listed}")


def resolve(name):
    """The NeuronSpec a command line NEURON argument names."""
    if ":" in name:
        return _as_spec(_load_user_object(name), name)
    if _is_path(name):
        _missing_name(name)
    neurons = _zoo()
    try:
        found = neurons.get(name)
    except KeyError:
        names = list(neurons.available())
        raise CLIError(f"unknown neuron {name!r}; bundled neurons: {', '.join(names) or '(none)'}; a neuron of your "
                       "own is written FILE.py:NAME or MODULE:NAME") from None
    return _as_spec(found, name)


def _highlighter(color, language="python"):
    """A function str -> str that colours Python (or C) source for the terminal, or None."""
    if color == "never" or (color == "auto" and not sys.stdout.isatty()):
        return None
    try:
        from pygments import highlight
        from pygments.formatters import TerminalFormatter
        from pygments.lexers import CLexer, PythonLexer
    except ImportError:
        return None
    lexer, formatter = (CLexer() if language == "c" else PythonLexer()), TerminalFormatter()
    return lambda text: highlight(text, lexer, formatter).rstrip("\n")


def _summary(obj, limit=72):
    """The first sentence of a docstring, at most `limit` characters."""
    paragraph = " ".join((getattr(obj, "__doc__", None) or "").strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=[a-z]{3})\.\s", paragraph)[0].rstrip(".:")  # not at "et al. ", "J. "
    return sentence if len(sentence) <= limit else sentence[: limit - 3].rstrip() + "..."


def _python_name(obj):
    """How Python spells a bundled neuron: flexgen.LIF, flexgen.neurons.alif, flexgen.neurons.continuous.lif."""
    import importlib

    import flexgen

    for module_name in ("flexgen", "flexgen.neurons", "flexgen.neurons.continuous"):
        module = flexgen if module_name == "flexgen" else importlib.import_module(module_name)
        for attr in getattr(module, "__all__", None) or sorted(vars(module)):
            if not attr.startswith("_") and getattr(module, attr, None) is obj:
                return f"{module_name}.{attr}"
    return "-"


def cmd_list(args):
    neurons = _zoo()
    names = list(neurons.available())
    if not names:
        print("no bundled neurons")
        return 0
    rows = []
    for name in names:
        obj = neurons.get(name)
        try:
            sig = _as_spec(obj, name).signature
            detail = f"inputs {', '.join(sig.inputs)}; states {', '.join(sig.states) or '-'}"
        except CLIError as exc:
            detail = str(exc)
        rows.append((name, _python_name(obj), detail, _summary(obj)))
    w_name, w_python, w_detail = (max(len(r[i]) for r in rows) for i in (0, 1, 2))
    for name, python, detail, summary in rows:
        print(f"{name:<{w_name}}  {python:<{w_python}}  {detail:<{w_detail}}  {summary}".rstrip())
    return 0


def cmd_show(args):
    if args.target == "cpu" and args.kernel not in ("forward", "backward", "c"):
        raise CLIError("with --target cpu, --kernel is forward or backward (or c for the whole C source)", status=2)
    spec = resolve(args.neuron)
    paint = _highlighter(args.color) or (lambda text: text)
    if args.adjoint:
        if args.kernel or args.equations:
            raise CLIError("--adjoint prints the EventProp adjoint system alone (no --kernel, no --equations)",
                           status=2)
        try:
            print("\n".join(spec.adjoint().lines()))
        except SpecError as exc:
            raise CLIError(str(exc)) from None
        return 0
    kinds = [args.kernel] if args.kernel else []
    if args.equations or not kinds:
        print(paint(spec.equations().rstrip("\n")))
    for kind in kinds:
        if args.equations:
            print()
        if args.target == "cpu" or kind == "c":
            source = spec.source("c") if kind == "c" else _c_functions(spec.source("c"), kind)
            print((_highlighter(args.color, "c") or (lambda text: text))(source.rstrip("\n")))
        else:
            print(paint(spec.source(kind).rstrip("\n")))
    return 0


def _c_functions(source, kind):
    """The C target's preamble and its `kind` ("forward" or "backward") functions, for float and for double."""
    preamble = source[:source.index("\n#define scalar_t")]
    parts = [preamble]
    for scalar, suffix in (("float", "f32"), ("double", "f64")):
        start = source.index(f"_{kind}_{suffix}(")
        start = source.rindex("\nvoid ", 0, start) + 1
        end = source.index("\n}\n", start) + 3
        parts.append(f"#define scalar_t {scalar}\n\n" + source[start:end] + "#undef scalar_t")
    return "\n\n".join(parts) + "\n"


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _cache_module():
    from . import cache

    missing = [f for f in ("info", "clear") if not callable(getattr(cache, f, None))]
    if missing:
        raise CLIError(f"this flexgen build has no flexgen.cache.{'()/'.join(missing)}()")
    return cache


def _when(timestamp):
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S") if timestamp else "-"


def _print_not_flexgen(items):
    if items:
        print(f"not flexgen's, left alone: {len(items)}")
        width = max(len(item["name"]) for item in items)
        for item in items:
            print(f"  {item['name']:<{width}}  {item['reason']}")


def cmd_cache_info(args):
    info = _cache_module().info()
    entries = info["entries"]
    print(f"cache: {info['root']}")
    if not info["marked"] and os.path.isdir(info["root"]):
        print("not marked as flexgen's cache: `flexgen cache clear` refuses it without --force")
    print(f"entries: {len(entries)}, {_size(sum(e['size'] for e in entries))}")
    if entries:
        width = max(len(str(e["neuron"])) for e in entries)
        for e in entries:
            print(f"  {e['key'][:16]}  {str(e['neuron']):<{width}}  {_size(e['size']):>10}  {_when(e['mtime'])}")
    if info["records"]:
        print(f"records: {len(info['records'])}")
        for name in info["records"]:
            print(f"  {name}")
    if info["libraries"]:
        print(f"compiled C libraries: {len(info['libraries'])}")
    if info["working_files"]:
        print(f"build locks and temporaries: {len(info['working_files'])}")
    print(f"total: {_size(info['total_bytes'])}")
    _print_not_flexgen(info["not_flexgen"])
    return 0


def cmd_cache_clear(args):
    cache = _cache_module()
    try:
        result = cache.clear(force=args.force, older_than_days=args.older_than)
    except cache.NotFlexgenCache as exc:
        raise CLIError(str(exc)) from None
    removed, kept = result["removed"], result["kept"]
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {result['root']}")
    if args.older_than is not None:
        print(f"kept {kept} entr{'y' if kept == 1 else 'ies'} used in the last {args.older_than:g} days")
    _print_not_flexgen(result["not_flexgen"])
    return 0


def _days(text):
    """argparse type for --older-than: a number of days >= 0."""
    try:
        days = float(text)
    except ValueError:
        days = None
    if days is None or not 0 <= days < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return days


def _dtype(name):
    import torch

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
    return dtypes[name]


def cmd_bench(args):
    import torch

    if not torch.cuda.is_available():
        raise CLIError("flexgen bench needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured",
                       status=2)
    from triton.testing import do_bench

    spec = resolve(args.neuron)
    dtype = _dtype(args.dtype)
    shape = (args.steps, args.neurons)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [1.5 * torch.rand(shape, device="cuda", dtype=dtype, generator=gen) for _ in spec.signature.inputs]
    layers = {"flexgen (triton)": spec(backend="triton"), "torch loop (eager)": spec(backend="eager")}
    for layer in layers.values():
        layer.to("cuda")

    def forward(layer, xs):
        layer.reset()
        out = layer(*xs)
        return out if isinstance(out, tuple) else (out,)

    def run_forward(layer):
        with torch.no_grad():
            forward(layer, inputs)

    leaves = [x.clone().requires_grad_() for x in inputs]

    def run_training(layer):
        outs = forward(layer, leaves)
        sum(o.float().sum() for o in outs).backward()
        for x in leaves:
            x.grad = None

    rows = []
    for label, layer in layers.items():
        times = [do_bench(lambda: run_forward(layer), warmup=args.warmup, rep=args.rep),
                 do_bench(lambda: run_training(layer), warmup=args.warmup, rep=args.rep)]
        rows.append((label, *times))
    base = rows[-1]
    print(f"{spec.fn.__name__}: T={args.steps}, N={args.neurons}, {args.dtype}, {torch.cuda.get_device_name()}")
    print(f"{'':<20} {'forward ms':>11} {'fwd+bwd ms':>11} {'forward speed-up':>17} {'fwd+bwd speed-up':>17}")
    for label, fwd, train in rows:
        print(f"{label:<20} {fwd:>11.3f} {train:>11.3f} {base[1] / fwd:>16.1f}x {base[2] / train:>16.1f}x")
    return 0


def build_parser():
    parser = argparse.ArgumentParser(
        prog="flexgen",
        description="Fused kernels for spiking neurons, generated from a Python step function: Triton on the GPU, C "
                    "and torch on the CPU.",
        epilog="NEURON: a bundled neuron's name (flexgen list) or FILE.py:NAME / MODULE:NAME for your own.",
    )
    from .version import __version__

    parser.add_argument("--version", action="version", version=f"flexgen {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("list", help="list the bundled neurons: the name `show` takes, the same neuron in Python, "
                                    "its inputs and states")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser(
        "show", help="print a neuron's derived equations or generated code",
        epilog="FILE.py:NAME imports FILE.py as a module: its top-level code runs, what is under "
               "`if __name__ == \"__main__\":` does not (keep a script's training there, or the neuron in a module "
               "of its own).")
    p.add_argument("neuron", metavar="NEURON")
    p.add_argument("--kernel", choices=KINDS, help="print this generated kernel: Triton (GPU), torch path or C target (c, CPU)")
    p.add_argument("--target", choices=("gpu", "cpu"), default="gpu",
                   help="cpu: --kernel forward or backward prints that function of the C target, in float and double")
    p.add_argument("--equations", action="store_true",
                   help="print the derived equations (the default without --kernel)")
    p.add_argument("--adjoint", action="store_true",
                   help="print the EventProp adjoint system derived from the neuron's equations (flexgen.ode)")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="syntax highlighting (auto: when stdout is a terminal and pygments is installed)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("cache", help="inspect or empty the on-disk kernel cache")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    a = actions.add_parser("info", help="list the entries, records and total size; name what is not flexgen's")
    a.set_defaults(func=cmd_cache_info)
    a = actions.add_parser("clear", help="remove what flexgen wrote in the cache and leave everything else alone")
    a.add_argument("--older-than", type=_days, metavar="DAYS",
                   help="remove only entries not loaded or written for DAYS days (fractions allowed)")
    a.add_argument("--force", action="store_true",
                   help="clear a directory flexgen has not marked as its cache (its entries and records only)")
    a.set_defaults(func=cmd_cache_clear)

    p = sub.add_parser("bench", help="time the generated kernels against a plain torch loop (needs a GPU)")
    p.add_argument("neuron", metavar="NEURON")
    p.add_argument("--steps", type=int, default=64, help="time steps T (default 64)")
    p.add_argument("--neurons", type=int, default=1 << 20, help="neurons N per step (default 2**20)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16", "float64"), default="float32")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time, ms")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv=None):
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as exc:
        print(f"flexgen {args.command}: {exc}", file=sys.stderr)
        return exc.status
    except SpecError as exc:
        print(f"flexgen {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `flexgen show ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
