"""Stage 4: splice printed step code into the jinja2 kernel frames.

The templates in `templates/` hold only the frame — one program per block of
neurons, the time loop, loads, stores, masks — and take the step itself as
printed code. This module decides names and argument order (the `layout`,
which `flexgen.launch` follows when it calls the kernels) and fills the frames.
"""
import functools
import hashlib
import pathlib

import jinja2
import sympy

from . import __version__
from .derive import hoist_reciprocals, inline_single_use, recompute_program
from .names import NameAllocator, derived_forms, reserved_names
from .printing import TorchPrinter, TritonPrinter


def template_dir():
    """The templates: `flexgen/templates` in an installed package, `templates/` at the top of a checkout."""
    package = pathlib.Path(__file__).resolve().parent
    installed = package / "templates"
    return installed if installed.is_dir() else package.parent / "templates"


@functools.lru_cache(maxsize=None)
def environment():
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=False,
        autoescape=False,
    )


def template_sources():
    """Text of every template by file name."""
    return {p.name: p.read_text() for p in sorted(template_dir().glob("*.j2"))}


@functools.lru_cache(maxsize=None)
def generator_fingerprint():
    """sha256 of the templates and of the generator's own source, for the cache key.

    A change to a printer or to the derivation must not reuse kernels generated before it.
    """

    h = hashlib.sha256()
    package = pathlib.Path(__file__).resolve().parent
    generator = ["trace.py", "derive.py", "inlining.py", "partition.py", "render.py", "symbolic.py", "surrogate.py", "names.py"]
    sources = sorted(template_dir().glob("*.j2")) + [package / g for g in generator] + sorted(package.glob("printing/*.py"))
    for path in sources:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def layout(derivation):
    """Names and order of everything the kernels read and write (JSON-serialisable)."""
    tr = derivation.trace
    inputs, outputs = list(tr.inputs), [str(o) for o in tr.outputs]
    saved = []
    for s in derivation.saved:
        name = str(s)
        if name in inputs:
            saved.append({"name": name, "kind": "input", "index": inputs.index(name)})
        elif name in outputs:
            saved.append({"name": name, "kind": "output", "index": outputs.index(name)})
        else:
            saved.append({"name": name, "kind": "buffer", "state": name in tr.states})
    name = tr.name
    return {
        "neuron": name,
        "inputs": inputs,
        "states": list(tr.states),
        "hyper": list(tr.hyper),
        "learnable": list(tr.learnable),
        "outputs": outputs,
        "next_states": [str(s) for s in tr.next_states],
        "saved": saved,
        "buffers": [s["name"] for s in saved if s["kind"] == "buffer"],
        "grad_outputs": [str(g) for g in derivation.grad_outputs],
        "carried": [str(g) for g in derivation.grad_states],
        "grad_inputs": [str(g) for g in derivation.grad_inputs],
        "grad_prev_states": [str(g) for g in derivation.grad_prev_states],
        "grad_learnable": [str(g) for g in derivation.grad_learnable],
        "chunk": 0,
        "kernels": {"forward": f"{name}_forward", "inference": f"{name}_inference", "backward": f"{name}_backward"},
    }


# Values per neuron the recompute backward keeps in registers for one chunk of steps: the chunk is as
# long as that allows (4 steps when the backward reads one value per step). Longer chunks write fewer
# checkpoints but hold more registers: on an H200, LIF's recompute backward reached 30-88 % of copy
# bandwidth with 8-step chunks and 47-97 % with 4 (docs/perf/NOTES.md).
RECOMPUTE_VALUES = 4


def recompute_layout(lay):
    """The layout of the recompute kernels, derived from the plain one.

    The training forward saves nothing per step: it checkpoints the states
    (in the compute dtype, so the re-run is exact) before every `chunk`-th
    step. The backward reads the inputs, the initial states and those
    checkpoints, re-runs each chunk's forward steps and walks them backwards.
    """
    states, name = lay["states"], lay["neuron"]
    saved = [{"name": x, "kind": "input", "index": i} for i, x in enumerate(lay["inputs"])]
    saved += [{"name": v, "kind": "state", "index": i} for i, v in enumerate(states)]
    saved += [{"name": f"{v}_ckpt", "kind": "checkpoint", "index": i} for i, v in enumerate(states)]
    return {
        **lay,
        "saved": saved,
        "buffers": [f"{v}_ckpt" for v in states],
        "step_saved": lay["saved"],
        "chunk": max(1, RECOMPUTE_VALUES // max(1, len(lay["saved"]))),
        "kernels": {"forward": f"{name}_forward_recompute", "inference": f"{name}_inference", "backward": f"{name}_backward_recompute"},
    }


def forward_args(lay, buffer_ptrs=()):
    """The forward kernels' arguments; `buffer_ptrs`: what the training forward writes besides the outputs."""
    args = []
    for x in lay["inputs"]:
        args += [f"{x}_ptr", f"{x}_st", f"{x}_sn", f"{x}_bcast: tl.constexpr"]
    for v in lay["states"]:
        args += [f"{v}_ptr", f"{v}_sn", f"{v}_seq_ptr"]
    args += [f"{o}_ptr" for o in lay["outputs"]]
    args += list(buffer_ptrs)
    for w in lay["learnable"]:
        args += [f"{w}_ptr", f"{w}_inner", f"{w}_size", f"{w}_chan: tl.constexpr"]
    return args + list(lay["hyper"])


def backward_args(lay):
    args = []
    for s in lay["saved"]:
        name, kind = s["name"], s["kind"]
        args += [f"{name}_ptr", f"{name}_st", f"{name}_sn", f"{name}_bcast: tl.constexpr"] if kind == "input" else []
        args += [f"{name}_ptr"] if kind in ("output", "checkpoint") else []
        args += [f"{name}_buf_ptr"] if kind == "buffer" else []
        args += [f"{name}_ptr", f"{name}_sn"] if kind == "state" else []
    for g in lay["grad_outputs"]:
        args += [f"{g}_ptr", f"{g}_st", f"{g}_sn", f"{g}_bcast: tl.constexpr"]
    for g in lay["carried"]:
        args += [f"{g}_ptr", f"{g}_st", f"{g}_sn"]
    args += [f"{g}_ptr" for g in lay["grad_inputs"]]
    args += [f"{g}_prev_ptr" for g in lay["carried"]]
    for w in lay["learnable"]:
        args += [f"{w}_ptr", f"{w}_inner", f"{w}_size", f"{w}_chan: tl.constexpr"]
    args += [f"partial_{w}_ptr" for w in lay["learnable"]]
    return args + list(lay["hyper"])


def print_program(program, printer):
    return "\n".join(f"{a.target} = {printer.doprint(a.expr)}" for a in program)


def forward_code(derivation):
    tr = derivation.trace
    keep = set(tr.outputs) | set(tr.next_states) | set(derivation.saved)
    return inline_single_use(derivation.forward, keep)


def _free_names(derivation):
    """An allocator of names that neither the spec, the derivation nor the frames use: for the renderer's own."""
    taken = set(derivation.trace.leaves)
    for a in derivation.forward + derivation.backward + derivation.adjoint:
        taken |= {str(a.target)} | {str(s) for s in a.expr.free_symbols}
    return NameAllocator(set(reserved_names()) | taken | derived_forms(taken))


def _split_invariant(derivation, program, alloc):
    """(prelude, step): the reciprocals of parameters, computed once before the time loop, and the step."""
    tr = derivation.trace
    invariant = {tr.leaves[n] for n in tr.hyper + tr.learnable}
    return hoist_reciprocals(program, invariant, alloc)


def _forward_context(derivation, lay, training, printer, chunk=0):
    """The forward frame's names; with `chunk` the states are checkpointed every `chunk` steps instead of
    the saved values being written (the recompute variant)."""
    buffers = lay["buffers"] if training and not chunk else []
    states = lay["states"]
    return {
        "checkpoints": states if chunk else [],
        "chunk": chunk,
        "inputs": lay["inputs"],
        "states": states,
        "learnable": lay["learnable"],
        "hyper": lay["hyper"],
        "outputs": lay["outputs"],
        "buffers": buffers,
        "stores": [(o, f"{o}_ptr") for o in lay["outputs"]],
        "updates": list(zip(states, lay["next_states"])),
        **_kept_decisions(derivation, lay, buffers, printer),
        **_code(derivation, forward_code(derivation), printer),
    }


def _kept_decisions(derivation, lay, written, printer):
    """What the forward needs to keep the backward's comparisons when it rounds saved values to a 16-bit
    I/O dtype (see `derive.decisions_on`): `rounded`, the written values the comparisons read (each
    rounded first, as `<name>_io`, and read back as `<name>_seen`); `seen_outputs`, the saved outputs
    they read; `nudged`, (value, printed test that the comparisons it answers for agree on the values
    as stored with the forward's outcomes) in order; `reread`, values whose comparisons a later test reads."""
    outputs = {s["name"] for s in lay["saved"] if s["kind"] == "output"}
    nudged, read_by = [], {}
    for value, comparisons in derivation.decisions if written else ():
        read = sorted(set().union(*(c.free_symbols for c in comparisons)), key=str)
        seen = {s: sympy.Symbol(f"{s}_seen", real=True) for s in read if str(s) in written or str(s) in outputs}
        for s in seen:
            read_by.setdefault(str(s), []).append(str(value))
        agree = sympy.And(*(sympy.Equivalent(c.xreplace(seen), c) for c in comparisons))
        nudged.append((str(value), printer.doprint(agree)))
    order = [v for v, _ in nudged]
    rounded = [b for b in written if b in read_by]
    seen_outputs = [o for o in read_by if o in outputs]
    reread = [v for v in order if any(order.index(user) > order.index(v) for user in read_by.get(v, ()))]
    return {"rounded": rounded, "seen_outputs": seen_outputs, "nudged": nudged, "reread": reread}


def _code(derivation, program, printer):
    prelude, step = _split_invariant(derivation, program, _free_names(derivation))
    return {"prelude": print_program(prelude, printer), "code": print_program(step, printer)}


def _backward_context(derivation, lay, printer):
    loads = []
    for s in lay["saved"]:
        stem = s["name"] + ("_buf" if s["kind"] == "buffer" else "")
        loads.append((s["name"], stem, s["kind"] == "input"))
    loads += [(g, g, True) for g in lay["grad_outputs"]]
    return {
        "learnable": lay["learnable"],
        "hyper": lay["hyper"],
        "carried": lay["carried"],
        "loads": loads,
        "grad_inputs": lay["grad_inputs"],
        "grad_learnable": list(zip(lay["learnable"], lay["grad_learnable"])),
        "updates": list(zip(lay["carried"], lay["grad_prev_states"])),
        **_code(derivation, derivation.backward, printer),
    }


def _recompute_backward_context(derivation, lay, rlay, printer):
    """The recompute backward frame: the forward step (as the forward kernel prints it), then the backward."""
    forward, backward = forward_code(derivation), list(derivation.backward)
    alloc = _free_names(derivation)
    prelude, step = _split_invariant(derivation, forward + backward, alloc)
    kept_values = [s["name"] for s in lay["saved"]]
    return {
        "hyper": lay["hyper"],
        "learnable": lay["learnable"],
        "inputs": lay["inputs"],
        "states": lay["states"],
        "carried": lay["carried"],
        "chunk": rlay["chunk"],
        "prelude": print_program(prelude, printer),
        "code": print_program(step[:len(forward)], printer),
        "kept": [[(v, alloc.fresh(f"{v}_at{k}")) for v in kept_values] for k in range(rlay["chunk"])],
        "updates": list(zip(lay["states"], lay["next_states"])),
        "grad_outputs": lay["grad_outputs"],
        "backward_code": print_program(step[len(forward):], printer),
        "grad_inputs": lay["grad_inputs"],
        "grad_learnable": list(zip(lay["learnable"], lay["grad_learnable"])),
        "carried_updates": list(zip(lay["carried"], lay["grad_prev_states"])),
    }


def _torch_backward_loads(lay):
    loads = []
    for k, s in enumerate(lay["saved"]):
        loads.append((s["name"], f"saved[{k}]"))
    loads += [(g, f"grad_outputs[{k}]") for k, g in enumerate(lay["grad_outputs"])]
    return loads


def render(derivation):
    """Generate the kernel module; returns (source text, layout, kernel sources by kind)."""
    lay = layout(derivation)
    env = environment()
    triton_printer, torch_printer = TritonPrinter(), TorchPrinter()
    forward_tpl, backward_tpl = env.get_template("forward.py.j2"), env.get_template("backward.py.j2")
    name, kernels = lay["neuron"], lay["kernels"]
    sources = {
        "forward": forward_tpl.render(
            kernel=kernels["forward"], args=forward_args(lay, [f"{b}_buf_ptr" for b in lay["buffers"]]),
            **_forward_context(derivation, lay, True, triton_printer),
        ),
        "inference": forward_tpl.render(
            kernel=kernels["inference"], args=forward_args(lay), **_forward_context(derivation, lay, False, triton_printer)
        ),
        "backward": backward_tpl.render(
            kernel=kernels["backward"], args=backward_args(lay), **_backward_context(derivation, lay, triton_printer)
        ),
    }
    rlay = recompute_layout(lay)
    sources["forward_recompute"] = forward_tpl.render(
        kernel=rlay["kernels"]["forward"], args=forward_args(rlay, [f"{b}_ptr" for b in rlay["buffers"]]),
        **_forward_context(derivation, lay, True, triton_printer, chunk=rlay["chunk"]),
    )
    sources["backward_recompute"] = env.get_template("backward_recompute.py.j2").render(
        kernel=rlay["kernels"]["backward"], args=backward_args(rlay),
        **_recompute_backward_context(derivation, lay, rlay, triton_printer),
    )
    torch_context = _forward_context(derivation, lay, True, torch_printer)
    sources["torch_forward"] = env.get_template("torch_forward.py.j2").render(**torch_context)
    backward_context = _backward_context(derivation, lay, torch_printer)
    backward_context["loads"] = _torch_backward_loads(lay)
    sources["torch_backward"] = env.get_template("torch_backward.py.j2").render(**backward_context)
    module = env.get_template("module.py.j2").render(
        version=__version__,
        neuron=name,
        keeps_decisions=bool(derivation.decisions),
        uses_libdevice="libdevice." in sources["forward"] + sources["backward"] + sources["backward_recompute"],
        **sources,
    )
    return module + "\n", lay, sources


def equations(derivation):
    """The derived step, readable: forward, what is saved, recomputation, backward."""
    tr = derivation.trace
    recompute = recompute_program(derivation)
    keep = set(tr.outputs) | set(tr.next_states) | set(derivation.saved) | {a.target for a in recompute}
    lines = [f"# {tr.name}: forward step (inputs {', '.join(tr.inputs)}; states {', '.join(tr.states)} before the step)"]
    lines += [str(a) for a in inline_single_use(derivation.forward, keep)]
    lines.append(f"outputs: {', '.join(map(str, tr.outputs))}")
    lines.append("new states: " + ", ".join(f"{s} <- {n}" for s, n in zip(tr.states, tr.next_states)))
    saved = ", ".join(map(str, derivation.saved)) or "nothing"
    lines.append(f"\n# saved for the backward, per step: {saved}")
    for value, comparisons in derivation.decisions:
        tests = ", ".join(map(str, comparisons))
        lines.append(f"# the backward tests {tests}: stored in fp16/bf16, {value} keeps the forward's outcome")
    if recompute:
        lines.append("# recomputed in the backward from the saved values:")
        lines += [str(a) for a in inline_single_use(recompute, keep)]
    incoming = ", ".join(map(str, derivation.grad_outputs))
    carried = ", ".join(f"{g} (dL/d{s} after the step)" for g, s in zip(derivation.grad_states, tr.states))
    lines.append(f"\n# backward step: incoming {incoming}; carried {carried}")
    lines += [str(a) for a in derivation.adjoint]
    return "\n".join(lines) + "\n"


__all__ = ["render", "layout", "recompute_layout", "equations", "template_dir", "generator_fingerprint"]
