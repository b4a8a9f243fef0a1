"""flexgen models outside eager PyTorch: `export_model` (torch.export with the number of steps a symbol where the
layers allow), `save_exported` and `load_exported` (a saved program's flexgen ops registered before torch loads
it).

An exported program calls flexgen's custom ops by name (`torch.ops.flexgen.<neuron>_<key>..._forward`: the key is
the first 12 hex digits of the generated module's cache key). A process that loads the program needs those ops
registered first, which building the layers does; `load_exported` registers them from the names alone: it loads
each named entry from this machine's kernel cache or, with `trust_kernels=True`, from the generated modules that
`save_exported` wrote into the file.
"""
import json
import os
import re
import warnings
import zipfile

import torch

from .. import compile as compile_stage
from ..cache.keys import KEY_PATTERN
from ..cache.roots import usable_root
from .conversion import reset

__all__ = ["export_model", "save_exported", "load_exported", "flexgen_ops", "export_onnx"]

ENTRIES_FILE = "flexgen_kernels.json"  # the extra file save_exported writes: cache key -> kind (and module)
_OP = re.compile(r"^flexgen::(?:(delayed_linear_\w+)|\w*?_([0-9a-f]{12})\w*)$")


def export_model(model, args, kwargs=None, dynamic_steps=True, strict=False):
    """`torch.export.export(model, args, kwargs)` for a model with flexgen layers; returns the `ExportedProgram`.

    Every flexgen layer is reset first and after (`flexgen.reset`): the program starts each call from the
    layers' initial states, as the model does after a reset, and states an earlier call left are not frozen into
    it as constants. With `dynamic_steps`, the first dimension of every tensor argument (T of [T, B, ...]
    sequences) is `torch.export.Dim.AUTO`: symbolic where every layer allows it (neuron layers, `Dense`, `Chain`,
    `Delay`, `DelayedLinear`), else fixed at the example's value, and the program refuses other lengths with
    torch's error naming the expected size (a `Recurrent` layer on the CPU runs its steps one by one, so the
    program holds T of them). The model exports as it is: in eval mode, under torch.no_grad() or
    inference_mode, or training (a checkpointed `Dense` or `Chain` exports its default path: the same outputs).

    >>> import torch, flexgen
    >>> layer = flexgen.LIF(step_mode="m", backend="torch")
    >>> program = flexgen.export_model(layer, (torch.rand(4, 2, 3),))
    >>> program.module()(torch.rand(7, 2, 3)).shape
    torch.Size([7, 2, 3])
    """
    args = tuple(args)
    shapes = _leading_dims_auto(model, args, kwargs) if dynamic_steps else None
    reset(model)
    try:
        with warnings.catch_warnings():  # the layers keep their states as plain attributes, reset around it
            warnings.filterwarnings("ignore", message=".*assigned during export")
            return torch.export.export(model, args, kwargs, dynamic_shapes=shapes, strict=strict)
    finally:
        reset(model)


def export_onnx(model, args, path, **options):
    """Write the ONNX file of a model with flexgen layers to `path`, with each flexgen op decomposed into its
    generated torch path (plain torch operations: ONNX has no flexgen op), and return torch.onnx's
    `ONNXProgram`. The torch path loops over the steps, so T is the example's. Needs the `onnx` and `onnxscript`
    packages (`pip install "flexgen[onnx]"`, which brings `onnxruntime` to run the file); `options` go to
    `torch.onnx.export`. Layers whose kernels have no torch path (a neuron with a delay line in its kernels on
    the C target) raise a RuntimeError naming the op; `backend="torch"` exports them."""
    from ..launch.neuron.ops import TORCH_PATHS

    program = export_model(model, args, dynamic_steps=False)
    table = {}
    for name in flexgen_ops(program):
        if name not in TORCH_PATHS:
            raise RuntimeError(f"flexgen.export_onnx: the op {name} has no torch path to write as ONNX operations")
        namespace, _, op = name.partition("::")
        table[getattr(getattr(torch.ops, namespace), op).default] = _checked_torch_path(name, TORCH_PATHS[name]())
    decomposed = program.run_decompositions(table)
    return torch.onnx.export(decomposed, tuple(args), path, dynamo=True, **options)


def _checked_torch_path(name, forward):
    def decomposed(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except AttributeError as exc:  # a generated module without torch loops (the delayed kind's)
            raise RuntimeError(f"flexgen.export_onnx: the op {name} has no torch path to write as ONNX operations; "
                               "build the layer with backend='torch'") from exc

    return decomposed


def _leading_dims_auto(model, args, kwargs):
    auto = getattr(torch.export.Dim, "AUTO", None)
    if auto is None:  # a torch without Dim.AUTO: the example's shapes
        return None
    shapes = torch.export.ShapesCollection()
    for t in torch.utils._pytree.tree_leaves((args, kwargs or {})):
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            shapes[t] = {0: auto}
    return shapes.dynamic_shapes(model, args, kwargs)


def flexgen_ops(program):
    """The names of the flexgen custom ops an `ExportedProgram` calls, sorted ("flexgen::<name>")."""
    names = set()
    for module in program.graph_module.modules():
        for node in getattr(module, "graph", torch.fx.Graph()).nodes:
            name = getattr(getattr(node.target, "_schema", None), "name", "")
            if name.startswith("flexgen::"):
                names.add(name)
    return sorted(names)


def save_exported(program, path, carry_kernels=True):
    """`torch.export.save(program, path)`, with a list of the kernels its flexgen ops come from (their cache keys)
    for `load_exported`; with `carry_kernels`, their generated modules too (the text of
    each cache entry), so that a machine without the entries can load the program (`trust_kernels=True`)."""
    loaded = compile_stage.loaded_kernels()
    entries = {}
    for name in flexgen_ops(program):
        match = _OP.match(name)
        if match is None or match.group(1):
            continue
        keys = [key for key in loaded if key.startswith(match.group(2))]
        if len(keys) != 1:
            raise RuntimeError(f"flexgen: the op {name} comes from no kernels loaded in this process; save the "
                               "program in the process that exported it")
        compiled = loaded[keys[0]][1]
        entries[keys[0]] = {"source": compiled.module_source(), "meta": compiled.meta} if carry_kernels else {}
    torch.export.save(program, path, extra_files={ENTRIES_FILE: json.dumps(entries, sort_keys=True)})


def load_exported(path, trust_kernels=False):
    """`torch.export.load(path)` after registering the flexgen ops the program calls, so a fresh process needs no
    layer built first. Each op's kernels load from this machine's kernel cache (where the model was built or
    exported) or, with `trust_kernels=True`, from the generated modules `save_exported` put in the file: Python
    code that this imports, so pass it only for files you trust. A program saved by `torch.export.save` alone
    loads from the cache only. Raises LookupError naming the ops whose kernels are in neither."""
    names = _op_names_in(path)
    carried = _entries_in(path)
    missing = []
    for name in names:
        match = _OP.match(name)
        if match is None:
            missing.append(name)
        elif match.group(1):
            _register_delayed_linear()
        elif not _load(match.group(2), name, carried, trust_kernels):
            missing.append(name)
    if missing:
        hint = ("build the layers in this process, or run the model once on this machine (its kernel cache), or "
                "save the program with flexgen.save_exported and load it with trust_kernels=True")
        raise LookupError(f"flexgen: no kernels here for the op(s) {', '.join(missing)}: {hint}")
    return torch.export.load(path)


def _load(prefix, name, carried, trust_kernels):
    """Load the kernels of an op whose cache key starts with `prefix`; False where neither the cache nor a trusted
    file has them."""
    keys = {key for key in carried if key.startswith(prefix)}
    root = usable_root()
    keys |= {key for key in os.listdir(root) if key.startswith(prefix) and KEY_PATTERN.match(key)}
    for key in sorted(keys):
        entry = carried.get(key, {})
        given = (entry["source"], entry["meta"]) if trust_kernels and "source" in entry else None
        try:
            compiled = compile_stage.load_entry(key, given)
        except LookupError:
            continue
        if name.endswith(("_c_forward", "_c_backward")):  # the C target's ops: registered at their first use
            for recompute in (False, True):
                compiled.c_ops_for(recompute)
        return True
    return False


def _register_delayed_linear():
    from ..launch.delay import fused, taps  # noqa: F401 (registering their ops on import)


def _op_names_in(path):
    """The flexgen op names in a saved program's serialized graph (read from the archive, before torch resolves
    them)."""
    names = set()
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if member.endswith(".json") and ("/models/" in member or "serialized_exported_program" in member):
                text = archive.read(member).decode("utf-8", "replace")
                names.update("flexgen::" + m for m in re.findall(r"torch\.ops\.flexgen\.(\w+)\.default", text))
    return sorted(names)


def _entries_in(path):
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if member.endswith("/" + ENTRIES_FILE) or member == ENTRIES_FILE:
                return json.loads(archive.read(member))
    return {}
