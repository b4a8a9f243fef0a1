"""A stream's step on the CPU with nothing allocated per step (mode "plan"): the model's modules as a list of
steps over buffers made once.

A model that is a `torch.nn.Sequential` (or one layer) of `torch.nn.Linear`, `flexgen.Recurrent` and neuron layers
(no delays, one input, on the C kernels: fp32 or fp64, a C compiler, the plain design) runs as:
- a Linear: `out = x W^T + b` over events (`flexgen.launch.event_product`): a C function adds the rows of a
  transposed copy of the weight at the nonzero entries of x (spikes: mostly zeros), or runs `torch.addmm` where
  the step's x is dense;
- a neuron layer: its C forward kernel for one step (`flexgen.launch.c_path.StepCall`, a ctypes call whose
  pointers are the rows of the buffers);
- a Recurrent layer: `current = x + s_{t-1} W^T + b`, the same product over the fed-back spikes, then its cell's
  C kernel.
Weights and biases are read through detached views of the parameters (in-place updates, `load_state_dict`, show:
the transposed copies are refreshed when a parameter's version counter moves; a model moved with `.to()` needs a
new stream), the neurons' parameters as they were when the plan was made.
States, outputs and fed-back spikes live in two rows each, [2, B x N]: step t reads row t % 2 and writes the
other (a neuron's output: row t % 2, which the next step's product reads). `flexgen.streaming.held` keeps the
other modes' states; here `states()` gives views of the rows the next step reads.
"""
import torch

from ..launch import c_path
from ..launch.event_product import EventProduct
from ..layers.checks import check_learnable
from ..layers.neuron import NeuronModule, initial_states
from ..layers.recurrent import Recurrent
from ..render.layout import Forward

SMALL = 1 << 14  # neurons a step: fewer than this run on one thread (waking others costs more than the step)


def why_not(model, example):
    """None where `model` runs as a plan for steps like `example`, else why not (a sentence)."""
    mods = list(model) if isinstance(model, torch.nn.Sequential) else [model]
    if example.device.type != "cpu" or example.dtype not in (torch.float32, torch.float64):
        return "the plan runs fp32 and fp64 steps on the CPU"
    if example.dim() != 2:
        return "the plan takes [B, features] steps"
    for k, m in enumerate(mods):
        if isinstance(m, torch.nn.Linear):
            continue
        if not isinstance(m, (Recurrent, NeuronModule)):
            return f"module {k} ({type(m).__name__}) is neither a Linear, a Recurrent nor a neuron layer"
        cell = m.cell if isinstance(m, Recurrent) else m
        if m.delay is not None:
            return f"module {k} has a delay"
        if isinstance(m, Recurrent) and m.scale is not None:
            return f"module {k} scales its recurrent current (scale=True)"
        if type(cell)._learnable_values is not NeuronModule._learnable_values:
            return f"module {k} ({type(cell).__name__}) adapts its parameters to each call's inputs"
        if len(cell.spec.signature.inputs) != 1:
            return f"module {k}'s neuron takes {len(cell.spec.signature.inputs)} inputs"
        if cell.backend not in ("auto", "c") or cell._compiled is None:
            return f"module {k} runs on backend {cell.backend!r}, not the C kernels"
        if cell._neuron_call().backend_for(example).name != "c":
            return f"module {k}'s C kernels do not run here (no C compiler?)"
        layout = cell._compiled.c_ops_for(False).layout
        if not c_path.steps_one_at_a_time(layout, example.dtype):
            return f"module {k}'s kernels are not of the plain design"
        if len(layout.outputs) != 1:
            return f"module {k}'s neuron has {len(layout.outputs)} outputs"
    return None


class _Linear:
    def __init__(self, module, source, batch, like):
        self.out = like.new_empty((batch, module.out_features))
        self.product = EventProduct(module.weight, module.bias, [source(0), source(1)], self.out,
                                    threads=torch.get_num_threads())

    def __call__(self, t):
        self.product(t)

    def output(self, t):
        return self.out


def _cycled(call):
    """A `StepCall`'s arguments at even and odd steps, made once: every row the plan passes is one of two used in
    turn, or the same at every step, so the pointers repeat every two steps (a call then builds no list)."""
    assert all(r.period == 2 or (r.period == 0 and r.sign == 0) for _, r in call.moving)
    cycle = []
    for t in (0, 1):
        values = list(call.fixed)
        for at, rows_of in call.moving:
            values[at] = rows_of.pointer(t)
        cycle.append((*call.flags, *values))
    return cycle


class _Neuron:
    """A neuron layer (or a Recurrent layer's cell, `recurrent` its layer) on its C kernel, one step a call."""

    def __init__(self, name, layer, source, batch, like):
        self.name, self.layer, self.source = name, layer, source
        self.recurrent = layer if isinstance(layer, Recurrent) else None
        cell = layer.cell if self.recurrent else layer
        self.cell = cell
        width = source(0).shape[1] if self.recurrent is None else layer.hidden
        self.shape, n = (batch, width), batch * width
        ops = cell._compiled.c_ops_for(False)
        layout, dtype = ops.layout, like.dtype
        sig = cell.spec.signature
        self.state_rows = {s: like.new_zeros((2, n)) for s in sig.states}
        self.out_rows = [like.new_zeros((2, n)) for _ in layout.outputs]
        if self.recurrent is not None:
            self.current = like.new_empty((1, n))
            drive = c_path.Rows(self.current, 0, 0, 0)
        else:
            drive = self._input_rows(source, n)
        learnable = [check_learnable(w, getattr(cell, w), like[None]) for w in cell._signature.learnable]
        self._learnable = learnable  # (kept alive: the kernel reads their data)
        ws, strides = c_path.learnable_data(learnable, self.shape, dtype)
        self._ws = ws
        groups = {Forward.INPUTS: [drive], Forward.STATES: [c_path.Rows(v, 0, 2) for v in self.state_rows.values()],
                  Forward.LEARNABLE: ws, Forward.OUTPUTS: [c_path.Rows(o, 0, 2) for o in self.out_rows],
                  Forward.FINALS: [c_path.Rows(v, 1, 2) for v in self.state_rows.values()],
                  Forward.BUFFERS: [None] * len(layout.buffers)}
        threads = 1 if n < SMALL else torch.get_num_threads()
        kernel = c_path.StepCall(ops.c_library, layout, "forward", dtype, groups, strides,
                                 list(cell.hyper.values()), (1, n, threads, 0, 0))
        self.kernel, self.arguments = kernel.fn, _cycled(kernel)
        self.views = [[rows[k].view(self.shape) for k in (0, 1)] for rows in self.out_rows]
        self.state_views = {s: [rows[k].view(self.shape) for k in (0, 1)] for s, rows in self.state_rows.items()}
        if self.recurrent is not None:  # I_t = x_t + s_{t-1} W^T + b: step t reads the spikes of row (t + 1) % 2
            self.product = EventProduct(layer.weight, layer.bias, [self.views[0][1], self.views[0][0]],
                                        self.current.view(self.shape), [source(0), source(1)],
                                        threads=torch.get_num_threads())
        self._initial = initial_states(cell.spec, cell.hyper, cell.static, like)

    def _input_rows(self, source, n):
        """The kernel's input argument: the source's buffer, or its two rows (a neuron layer before this one)."""
        before = getattr(source, "__self__", None)
        if isinstance(before, _Neuron):
            return c_path.Rows(before.out_rows[0], 0, 2)
        return c_path.Rows(source(0).reshape(1, n), 0, 0, 0)

    def __call__(self, t):
        if self.recurrent is not None:
            self.product(t)
        self.kernel(*self.arguments[t % 2])

    def output(self, t):
        return self.views[0][t % 2]

    def reset(self):
        for state, value in zip(self.cell.spec.signature.states, self._initial):
            self.state_rows[state][0].copy_(value.expand(self.shape).reshape(-1))
        for rows in self.out_rows:
            rows.zero_()

    def states(self, done):
        """The kept tensors after `done` steps: views of the rows the next step reads."""
        kept = {s: views[done % 2] for s, views in self.state_views.items()}
        if self.recurrent is not None:
            kept["output"] = self.views[0][(done + 1) % 2]
        return kept


class Plan:
    """The step of a model `why_not` accepts, over buffers made for steps like `example`."""

    def __init__(self, model, names, example):
        mods = list(model) if isinstance(model, torch.nn.Sequential) else [model]
        names = names or {}
        self.x = example.detach().clone()
        batch, source = example.shape[0], (lambda t: self.x)
        self.steps, self.layers = [], []
        for m in mods:
            if isinstance(m, torch.nn.Linear):
                step = _Linear(m, source, batch, example)
            else:
                step = _Neuron(names.get(id(m), ""), m, source, batch, example)
                self.layers.append(step)
            self.steps.append(step)
            source = step.output
        self.done = 0
        self.reset()

    def __call__(self, x=None):
        """One step on `x`, or (None) on what `self.x` holds (no autograd: every operand is a buffer or a detached
        view)."""
        if x is not None:
            self.x.copy_(x)
        t = self.done
        for step in self.steps:
            step(t)
        self.done = t + 1
        return self.steps[-1].output(t)

    def reset(self):
        for layer in self.layers:
            layer.reset()
        self.done = 0

    def states(self):
        return {layer.name: layer.states(self.done) for layer in self.layers}
