"""A stream's step as one kernel launch per recurrent layer (mode "graph" on CUDA, where the model fits): each
`flexgen.Recurrent` layer, with the `torch.nn.Linear` before it if there is one, runs as its `step` kernel
(`flexgen.launch.recurrent.step`): the Linear's product, the recurrent product and the neuron's step in one launch.

A model that is a `torch.nn.Sequential` (or one layer) of `flexgen.Recurrent` layers, each after at most one
`torch.nn.Linear` (no delays, no `scale`, on the Triton kernels, one-input one-output neurons whose parameters do
not adapt to the inputs), runs as such a list of launches over buffers made once. The launches of a step are
captured as a CUDA graph; a step's outputs go to one of two rows that alternate (step t writes row t % 2 and reads
the fed-back output from the other), so there are two graphs, one for each row. Weights and biases are read
through detached views of the parameters (in-place updates and `load_state_dict` show; a model moved with `.to()`
needs a new stream), the neurons' parameters as they were when the plan was made. Without `capture` (CPU tensors
on Triton's interpreter) the launches run as they are, for the tests.
"""
import torch

from ..launch.neuron.ops import triton_kernels_can_run
from ..launch.recurrent.step import StepLaunch
from ..layers.checks import check_learnable
from ..layers.neuron import NeuronModule, initial_states
from ..layers.recurrent import Recurrent


def why_not(model, example):
    """None where `model` runs as a fused plan for steps like `example`, else why not (a sentence)."""
    mods = list(model) if isinstance(model, torch.nn.Sequential) else [model]
    if example.dim() != 2:
        return "the fused plan takes [B, features] steps"
    before, width = None, example.shape[1]  # the features each module takes
    for k, m in enumerate(mods):
        if isinstance(m, torch.nn.Linear):
            if before is not None:
                return f"modules {k - 1} and {k} are two Linear layers in a row"
            if m.in_features != width:
                return f"module {k} (Linear) takes {m.in_features} features, its input has {width}"
            before, width = m, m.out_features
            continue
        if not isinstance(m, Recurrent):
            return f"module {k} ({type(m).__name__}) is neither a Linear nor a Recurrent layer"
        why = _why_not_recurrent(m, example)
        if why is not None:
            return f"module {k} {why}"
        if width != m.hidden:
            return f"module {k} (Recurrent) has {m.hidden} neurons, its input {width} features"
        before = None
    if before is not None:
        return "the model ends with a Linear layer"
    return None


def _why_not_recurrent(layer, example):
    cell = layer.cell
    if layer.delay is not None:
        return "has a delay"
    if layer.scale is not None:
        return "scales its recurrent current (scale=True)"
    if layer.backend not in ("auto", "triton") or layer.requested_path == "stepwise":
        return f"runs on backend {layer.backend!r} / path {layer.requested_path!r}, not the fused kernels"
    if not triton_kernels_can_run():
        return "cannot run Triton kernels here (no CUDA GPU, and TRITON_INTERPRET is not set)"
    if type(cell)._learnable_values is not NeuronModule._learnable_values:
        return f"({type(cell).__name__}) adapts its parameters to each call's inputs"
    if len(cell.spec.signature.inputs) != 1:
        return f"has a neuron of {len(cell.spec.signature.inputs)} inputs"
    if layer._n_outputs != 1:
        return f"has a neuron of {layer._n_outputs} outputs"
    if example.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return f"cannot take {example.dtype} steps"
    return None


def _detached(t):
    return None if t is None else t.detach()


class _Unit:
    """A Recurrent layer (and the Linear before it, or None) as two `StepLaunch`es, one for each output row."""

    def __init__(self, name, layer, linear, source, batch, like, tiling=None):
        self.name, self.layer = name, layer
        cell, hidden = layer.cell, layer.hidden
        dtype = like.dtype
        compiled = layer.compiled()
        sig = cell.spec.signature
        self.states = {s: like.new_zeros((batch, hidden)) for s in sig.states}
        self.rows = like.new_zeros((2, batch, hidden))  # step t's output: row t % 2
        sample = like.new_zeros((1, batch, hidden))
        self._learnable = [check_learnable(w, getattr(cell, w), sample) for w in cell._signature.learnable]
        weight, bias = _detached(layer.weight), _detached(layer.bias)
        in_weight = in_bias = None
        if linear is not None:
            in_weight, in_bias = _detached(linear.weight), _detached(linear.bias)
        for t in (weight, bias, in_weight, in_bias):
            if t is not None and (t.dtype != dtype or t.device != like.device):
                raise ValueError(f"{name or 'the model'}: its weights are {t.dtype} on {t.device}, the steps "
                                 f"{dtype} on {like.device}; move the model with .to() first")
        self.compiled, self.weight, self.bias = compiled, weight, bias
        self.in_weight, self.in_bias, self.n_in = in_weight, in_bias, None if linear is None else linear.in_features
        states = list(self.states.values())
        self.launches = [
            StepLaunch(compiled, states, [self.rows[t]], self.rows[1 - t], self._learnable, list(cell.hyper.values()),
                       weight, bias, inputs=None if linear is not None else [source(t)],
                       in_x=source(t) if linear is not None else None, in_weight=in_weight, in_bias=in_bias,
                       tiling=tiling)
            for t in (0, 1)]
        self._initial = initial_states(cell.spec, cell.hyper, cell.static, like)

    def output(self, t):
        return self.rows[t % 2]

    def reset(self):
        for state, value in zip(self.layer.spec.signature.states, self._initial):
            self.states[state].copy_(value.expand_as(self.states[state]))
        self.rows.zero_()

    def kept(self, done):
        """The layer's states and last output after `done` steps (buffers the next steps overwrite)."""
        return {**self.states, "output": self.rows[(done + 1) % 2]}


class FusedPlan:
    """The step of a model `why_not` accepts, over buffers made for steps like `example`; with `capture` (CUDA)
    each row's launches are a CUDA graph. `tiling`: every layer's `StepTiling` (default: `step_tiling`'s)."""

    def __init__(self, model, names, example, capture=True, warmup=2, tiling=None):
        mods = list(model) if isinstance(model, torch.nn.Sequential) else [model]
        self.x = example.detach().clone()
        batch, like = example.shape[0], example
        source, linear, self.units = (lambda t: self.x), None, []
        for m in mods:
            if isinstance(m, torch.nn.Linear):
                linear = m
                continue
            unit = _Unit(names.get(id(m), ""), m, linear, source, batch, like, tiling)
            self.units.append(unit)
            source, linear = unit.output, None
        self.done, self.graphs = 0, None
        if capture:
            self._capture(warmup)
        self.reset()

    def _launch(self, row):
        for unit in self.units:
            unit.launches[row]()

    def _capture(self, warmup):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):  # the kernels compiled and loaded before the capture
                self._launch(0)
                self._launch(1)
        torch.cuda.current_stream().wait_stream(side)
        self.graphs = []
        for row in (0, 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch(row)
            self.graphs.append(graph)

    def __call__(self, x=None):
        """One step on `x`, or (None) on what `self.x` holds."""
        if x is not None:
            self.x.copy_(x)
        row = self.done % 2
        if self.graphs is not None:
            self.graphs[row].replay()
        else:
            self._launch(row)
        self.done += 1
        return self.units[-1].output(row)

    def reset(self):
        with torch.no_grad():
            for unit in self.units:
                unit.reset()
        self.done = 0

    def states(self):
        return {unit.name: unit.kept(self.done) for unit in self.units}
