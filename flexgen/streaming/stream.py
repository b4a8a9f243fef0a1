"""`flexgen.Stream`: a model of flexgen layers run one step a call, its states kept in buffers of its own.

On the CPU a model of Linear, Recurrent and neuron layers runs as a plan over buffers made once
(`flexgen.streaming.cpu_plan`, mode "plan").

On CUDA (mode "graph") the step is captured once as a `torch.cuda.CUDAGraph` after warm-up steps on a side
stream: the graph reads the step's input from a static buffer, runs every layer's kernels and the torch modules
between them, and writes what each layer keeps (states, last output, delay lines) back into the stream's buffers
with one multi-tensor copy. A call copies its input in and replays the graph: no Python runs per layer. A model
of Linear/Recurrent pairs is fused instead (`flexgen.streaming.fused_plan`): one kernel launch per recurrent layer
a step, states written in place, two graphs for the two rows its outputs alternate between. Elsewhere
(mode "eager") a call runs the model, then the same copy. `flexgen.streaming.held` says what each layer keeps.
"""
import contextlib

import torch

from ..launch.backends import interpreter_on
from . import cpu_plan, fused_plan, persistent
from .held import StreamError, adapter, copy_into, find_layers

MODES = ("auto", "graph", "persistent", "plan", "eager", "compile")


def _describe(spec):
    shape, dtype, device = spec
    return f"[{', '.join(map(str, shape))}] {str(dtype).replace('torch.', '')} on {device}"


def _spec_of(x):
    return tuple(x.shape), x.dtype, x.device


class Stream:
    """Runs `model` one step a call: `stream(x)` takes one step's input (shaped, typed and placed as `example`,
    e.g. [B, features]) and returns the model's output for that step.

    `model` holds flexgen layers (neuron layers, `Recurrent`, `Dense`; a neuron layer's `delay=` and a recurrent
    layer's `delay=` too) with any torch modules between them, and is in eval mode. The stream switches its
    flexgen layers to one step a call (`step_mode="s"`) until `close()`. `example` is one step's input (a tensor,
    or a tuple of them for a model that takes several), which fixes the batch size, dtype and device: a call with
    another shape, dtype or device is a `StreamError` (make a new stream for it).

    `mode`: "graph" captures the step as a CUDA graph (CUDA inputs), fused where the model is a Sequential of
    `Recurrent` layers each after at most one `Linear` (one launch per layer a step; `fuse=False` captures the
    model's own calls instead; `stream.fused` says which); "plan" (CPU, fp32 and fp64) runs a
    `torch.nn.Sequential` of `torch.nn.Linear`, `Recurrent` and neuron layers (no delays, on the C kernels) over
    buffers made once, nothing allocated per step (`flexgen.streaming.cpu_plan`); "eager" runs the model each call
    (any model a stream takes); "compile" runs that step through `torch.compile(**compile_options)` (default
    `mode="reduce-overhead"` on CUDA); "persistent" (CUDA, models the fused plan takes) keeps one kernel running on
    the GPU that takes each step when the host asks (`flexgen.streaming.persistent`): steps come from the host and
    go back to it (CPU inputs, pinned host buffers `stream.input` and the returned output), no launch or CUDA event
    per step; after `idle_timeout` seconds (default 1) without a step the kernel leaves, and the next step starts
    it again. "auto" chooses "graph" on CUDA, else "plan" where the model fits it, else "eager". In "graph",
    "persistent", "plan" and (on CUDA) "compile" modes the returned output is a buffer that later calls overwrite:
    clone it to keep it.
    Every call runs under `torch.no_grad()`: a stream is for inference. `stream()` with no argument steps on what
    `stream.input` (`stream.inputs` for several) holds: a producer that writes each step's input there in place
    saves the copy (on CUDA, a launch) that `stream(x)` makes.

    The layers' states live in the stream's buffers, updated in place each step: `stream.states()` returns them
    by layer name; `stream.reset()` puts the declared initial values back (zeros in delay lines and last
    outputs), so the next call starts a new sequence. `close()` (or leaving a `with` block) gives the model back:
    step modes and hooks restored, the layers reset.

    >>> import torch, flexgen
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), flexgen.LIF(tau=2.0, backend="torch")).eval()
    >>> stream = flexgen.Stream(model, torch.zeros(2, 4))
    >>> stream(torch.ones(2, 4)).shape, sorted(stream.states()["1"])
    (torch.Size([2, 8]), ['v'])
    >>> stream.reset(); stream.close()
    """

    def __init__(self, model, example, mode="auto", warmup=3, compile_options=None, fuse=True, idle_timeout=None):
        examples = example if isinstance(example, (tuple, list)) else (example,)
        self._check_example(examples)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"Stream takes a torch.nn.Module, got {type(model).__name__}")
        if model.training:
            raise StreamError(f"{type(model).__name__} is in training mode: a stream runs inference (no gradients, "
                              "dropout off); call model.eval() first")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        device = examples[0].device
        if mode == "graph" and device.type != "cuda":
            raise StreamError(f"mode='graph' captures a CUDA graph; the example input is on {device} (use "
                              "mode='eager', or move the model and input to a GPU)")
        if idle_timeout is not None and mode != "persistent":
            raise ValueError(f"idle_timeout is for mode='persistent'; this stream's mode is {mode!r}")
        if mode == "persistent":
            self._check_persistent(model, examples, device)
        found = find_layers(model)
        if mode in ("auto", "plan") and device.type != "cuda":
            why = "it takes one input" if len(examples) != 1 else cpu_plan.why_not(model, examples[0])
            if mode == "plan" and why is not None:
                raise StreamError(f"mode='plan' cannot run this model: {why}; use mode='eager'")
            mode = "plan" if why is None else "eager"
        elif mode in ("auto", "plan"):
            if mode == "plan":
                raise StreamError("mode='plan' runs on the CPU; on CUDA use mode='graph'")
            mode = "graph"
        self.model, self.mode = model, mode
        self.fused = mode == "persistent" or (mode == "graph" and bool(fuse) and len(examples) == 1
                                              and fused_plan.why_not(model, examples[0]) is None)
        self._idle_timeout = 1.0 if idle_timeout is None else idle_timeout
        self._specs = [_spec_of(x) for x in examples]
        if mode == "persistent":  # steps come from the host
            self._specs = [(shape, dtype, torch.device("cpu")) for shape, dtype, _ in self._specs]
        self._static = [x.detach().clone() for x in examples]
        self._held = [adapter(name, layer) for name, layer in found]
        self._graph, self._out, self._closed, self._compiled, self._plan = None, None, False, None, None
        if mode == "compile":
            options = {"mode": "reduce-overhead"} if device.type == "cuda" else {}
            self._compiled = torch.compile(self._step, **(options if compile_options is None else compile_options))
        elif compile_options is not None:
            raise ValueError(f"compile_options are for mode='compile'; this stream's mode is {mode!r}")
        for held in self._held:
            held.prepare()
        try:
            with torch.no_grad():
                self._start(max(int(warmup), 1))
        except BaseException:
            self._give_back()
            raise

    @staticmethod
    def _check_persistent(model, examples, device):
        if device.type != "cuda" and not interpreter_on():
            raise StreamError(f"mode='persistent' keeps a kernel running on a GPU; the example input is on {device} "
                              "(use mode='plan' or 'eager' on the CPU)")
        why = "it takes several inputs" if len(examples) != 1 else fused_plan.why_not(model, examples[0])
        if why is not None:
            raise StreamError(f"mode='persistent' runs models of Linear/Recurrent pairs, not this one: {why}; use "
                              "mode='graph'")

    @staticmethod
    def _check_example(examples):
        if not examples or not all(isinstance(x, torch.Tensor) for x in examples):
            raise TypeError("Stream takes one step's example input: a tensor (e.g. [B, features]) or a tuple of "
                            "tensors")
        for x in examples:
            if x.requires_grad:
                raise StreamError("the example input requires grad: a stream runs inference without gradients; "
                                  "pass x.detach()")
            if not x.is_floating_point():
                raise StreamError(f"the example input is {x.dtype}; flexgen layers take floating-point inputs "
                                  "(convert spikes with x.float())")

    def _start(self, warmup):
        """Find each layer's kept tensors from a first step, make the buffers, and (mode "graph") capture; or make
        the CPU plan (mode "plan")."""
        if self.mode == "plan" or self.fused:
            names = {id(held.layer): held.name for held in self._held}
            if self.mode == "persistent":
                self._plan = persistent.PersistentPlan(self.model, names, self._static[0], self._idle_timeout,
                                                       one_step=self._static[0].device.type != "cuda")
                return
            plan = cpu_plan.Plan if self.mode == "plan" else fused_plan.FusedPlan
            self._plan = plan(self.model, names, self._static[0])
            return
        for held in self._held:
            reset = getattr(held.layer, "reset", None)
            if reset is not None:
                reset()
        cuda = self.mode == "graph"
        side = torch.cuda.Stream() if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            self.model(*self._static)  # from the layers' own initial states: what they keep, and its shapes
            self._buffers = [held.buffers_like(held.read()) for held in self._held]
            if self._compiled is not None and self._static[0].device.type == "cuda":
                for buffers in self._buffers:  # written in place by each step: Inductor's graphs keep their address
                    for t in buffers.values():
                        torch._dynamo.mark_static_address(t)
            self.reset()
            if self._compiled is not None:  # compiled (and, on CUDA, its graphs recorded) before the first call
                for _ in range(warmup):
                    self._compiled_step(self._static)
                self.reset()
            if cuda:  # kernels compiled, tuned and known before the capture
                for _ in range(warmup):
                    self._step(self._static)
                self.reset()
        if cuda:
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._out = self._step(self._static)
            self._graph = graph
            self._bind()

    def _bind(self):
        for held, buffers in zip(self._held, self._buffers):
            held.bind(buffers)

    def _step(self, inputs):
        """One step of the model, then what each layer kept into its buffers (and the layers bound to them)."""
        out = self.model(*inputs)
        for held, buffers in zip(self._held, self._buffers):
            copy_into(buffers, held.read())
            held.bind(buffers)
        return out

    def _compiled_step(self, inputs):
        if inputs[0].device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten now
        return self._compiled(inputs)

    def __call__(self, *inputs):
        if self._closed:
            raise StreamError("this stream is closed; make a new one")
        if not inputs:
            return self._step_in_place()
        if len(inputs) != len(self._specs):
            raise TypeError(f"this stream takes {len(self._specs)} input(s) per step (or none: the step reads "
                            f"stream.inputs), got {len(inputs)}")
        for x, spec in zip(inputs, self._specs):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"a stream's step takes tensors, got {type(x).__name__}")
            if self.mode == "persistent" and x.device != spec[2]:
                raise StreamError(f"a persistent stream takes its steps from the host (CPU tensors, or what "
                                  f"stream.input holds); this one is on {x.device}. For steps already on the GPU "
                                  "use mode='graph'")
            if x.shape != spec[0] or x.dtype != spec[1] or x.device != spec[2]:
                raise StreamError(f"this stream was made for steps {_describe(spec)}, this one is "
                                  f"{_describe(_spec_of(x))}: the batch size, dtype and device are fixed when "
                                  "it is made (its buffers and captured graph have them); make a new Stream "
                                  "for these inputs")
            if x.requires_grad:
                raise StreamError("the step's input requires grad: a stream runs inference; pass x.detach()")
        if self._plan is not None:
            return self._plan(inputs[0])
        if self._graph is not None:
            for static, x in zip(self._static, inputs):
                static.copy_(x)
            self._graph.replay()
            return self._out
        with torch.no_grad():
            if self._compiled is not None:
                return self._compiled_step(inputs)
            return self._step(inputs)

    def _step_in_place(self):
        """A step on what `inputs` hold now (no copy)."""
        if self._plan is not None:
            return self._plan()
        if self._graph is not None:
            self._graph.replay()
            return self._out
        with torch.no_grad():
            if self._compiled is not None:
                return self._compiled_step(self._static)
            return self._step(self._static)

    @property
    def inputs(self):
        """The buffers the next step reads, one per input: `stream()` with no argument steps on what they hold,
        without the copy `stream(x)` makes (write a step's input into them in place, e.g. a producer's kernel
        writing its output there, or `stream.input.copy_(x)`). They keep the example's shape, dtype and device."""
        if self._closed:
            raise StreamError("this stream is closed; make a new one")
        if self.mode == "persistent":
            return [self._plan.input]
        return [self._plan.x] if self._plan is not None else list(self._static)

    @property
    def input(self):
        """The one buffer the next step reads (a model of one input); see `inputs`."""
        buffers = self.inputs
        if len(buffers) != 1:
            raise StreamError(f"this stream takes {len(buffers)} inputs per step: use stream.inputs")
        return buffers[0]

    step = __call__

    def reset(self):
        """Put every layer's declared initial states back (zeros in delay lines and last outputs), in place: the
        next call starts a new sequence."""
        if self._plan is not None:
            self._plan.reset()
            return
        for held, buffers in zip(self._held, self._buffers):
            with torch.no_grad():
                held.fill_initial(buffers)
            held.bind(buffers)

    def states(self):
        """{layer name: {kept name: tensor}}: each flexgen layer's states as the stream holds them (its buffers,
        updated in place by every call: clone what you keep). Layer names are the model's (`named_modules`; ""
        for a model that is itself a layer). Besides a neuron's states: "output" (a recurrent layer's last
        output), "line" (a neuron layer's delay line, [max_delay, B, ...], oldest first), "sent" (a delayed
        recurrent layer's last max_delay + 1 outputs)."""
        if self._plan is not None:
            return self._plan.states()
        return {held.name: dict(buffers) for held, buffers in zip(self._held, self._buffers)}

    def source(self):
        """The generated source of the stream's own kernel (mode "persistent"). The other modes run the layers'
        kernels: `layer.source("step")` shows a fused layer's."""
        if self.mode != "persistent":
            raise StreamError(f"a stream in mode {self.mode!r} has no kernel of its own; layer.source(...) shows a "
                              "layer's kernels")
        if self._closed:
            raise StreamError("this stream is closed; make a new one")
        return self._plan.source

    def close(self):
        """Give the model back: its layers' step modes restored, the stream's hooks removed, the layers reset (their
        states no longer the stream's buffers). Calls after it are errors."""
        if not self._closed:
            self._give_back()

    def _give_back(self):
        if isinstance(self._plan, persistent.PersistentPlan):
            self._plan.stop()
        self._closed, self._graph, self._out, self._compiled, self._plan = True, None, None, None, None
        for held in self._held:
            held.restore()
            reset = getattr(held.layer, "reset", None)
            if reset is not None:
                reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        layers = ", ".join(f"{h.name or 'model'}: {type(h.layer).__name__}" for h in self._held)
        fused = ", fused" if self.fused else ""
        return (f"Stream(mode={self.mode!r}{fused}, step={', '.join(map(_describe, self._specs))}, "
                f"layers=[{layers}])")

