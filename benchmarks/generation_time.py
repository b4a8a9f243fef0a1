"""Generation time against the depth of three step families whose expressions grow exponentially as trees.

    python benchmarks/generation_time.py [--depths 1 2 4 8 16 32 64 128] [--timeout 120] [--json FILE]

Each family nests one operation `depth` times; every level uses the previous value several times, so
substituting values into their users turns the step's graph into a tree twice (or three times) as
large per level:

* `where`: `h = where(h > 0, h * 0.5, h + 1)`, a chain of conditions (h three times per level);
* `exp_tanh`: `h = exp(-h * h) + tanh(h)`;
* `power`: `h = h ** h`, a tower of powers.

For each point it records, in a fresh process (cold caches; a point that runs past `--timeout` is
recorded as such): the traced step's operations, the seconds spent tracing, deriving (`derive.derive`)
and rendering (the plain kind's `generate`), the derived backward's operations (as printed: repeats counted) and the
generated module's size. A spec that flexgen refuses (`SpecError`, e.g. the size guard) is recorded with
its message. Run it with another checkout on PYTHONPATH to compare versions. Prints a Markdown table.
"""
import argparse
import json
import os
import subprocess
import sys
import time

FAMILIES = ("where", "exp_tanh", "power")


def step_family(family, depth):
    """A NeuronSpec: one state, one spike output, the family's operation nested `depth` times."""
    import flexgen
    from flexgen import exp, spike, tanh, where

    def where_level(h):
        return where(h > 0.0, h * 0.5, h + 1.0)

    def exp_tanh_level(h):
        return exp(-h * h) + tanh(h)

    def power_level(h):
        return h ** h

    level = {"where": where_level, "exp_tanh": exp_tanh_level, "power": power_level}[family]

    def step(x, v):
        h = v + x
        for _ in range(depth):
            h = level(h)
        s = spike(h - 1.0)
        return s, h * (1.0 - s)

    step.__name__ = f"{family}_{depth}"
    return flexgen.neuron(states=("v",))(step)


def operations(program):
    """Operations of a program as printed: the nodes of every expression that are not atoms, with repeats
    (computed here, not by flexgen, so that other versions are measured the same way)."""
    counts = {}

    def count(expr):
        if expr not in counts:
            counts[expr] = 0 if expr.is_Atom else 1 + sum(count(a) for a in expr.args)
        return counts[expr]

    return sum(count(a.expr) for a in program)


def measure(family, depth):
    """One point, in this process: a dict of the quantities in the module docstring."""
    from flexgen import SpecError
    from flexgen.derive.derivation import derive
    from flexgen.kinds import PLAIN

    spec = step_family(family, depth)
    point = {"family": family, "depth": depth}
    start = time.perf_counter()
    try:
        trace = spec.trace()
        point.update(traced_operations=operations(trace.program), trace_s=time.perf_counter() - start)
        start = time.perf_counter()
        derivation = derive(trace)
        point.update(derive_s=time.perf_counter() - start, backward_operations=operations(derivation.backward))
        start = time.perf_counter()
        module, _ = PLAIN.generate(derivation, ())
        point.update(render_s=time.perf_counter() - start, module_kib=len(module.encode()) / 1024)
    except SpecError as exc:
        point["refused"] = str(exc).splitlines()[0]
    return point


def measure_in_subprocess(family, depth, timeout):
    command = [sys.executable, os.path.abspath(__file__), "--point", family, str(depth)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return {"family": family, "depth": depth, "timeout_s": timeout}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cell(point, key, fmt):
    return fmt.format(point[key]) if key in point else ""


def markdown(points):
    rows = ["| family | depth | traced ops | trace s | derive s | render s | backward ops | module KiB | note |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in points:
        note = f"over {p['timeout_s']} s" if "timeout_s" in p else p.get("refused", "")
        cells = [p["family"], str(p["depth"]), _cell(p, "traced_operations", "{}"), _cell(p, "trace_s", "{:.2f}"),
                 _cell(p, "derive_s", "{:.2f}"), _cell(p, "render_s", "{:.2f}"), _cell(p, "backward_operations", "{}"),
                 _cell(p, "module_kib", "{:.0f}"), note]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per point")
    parser.add_argument("--json", help="also write the points to this file")
    parser.add_argument("--point", nargs=2, metavar=("FAMILY", "DEPTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(measure(args.point[0], int(args.point[1]))))
        return
    points = []
    for family in args.families:
        for depth in args.depths:
            points.append(measure_in_subprocess(family, depth, args.timeout))
            print(json.dumps(points[-1]), file=sys.stderr, flush=True)
            if "timeout_s" in points[-1]:
                break  # deeper points of this family only take longer
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f, indent=1)
    print(markdown(points))


if __name__ == "__main__":
    main()
