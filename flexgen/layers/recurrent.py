"""Recurrent layers: any neuron whose output, times a dense weight, is added to its input at the next step.

    I_t = x_t + s_{t-1} W^T + b          (s_{-1} = 0)
    outputs_t, states_t = step(I_t, other inputs_t, states_{t-1})

`Recurrent` wraps any flexgen neuron: a spec (bundled or your own), a bundled layer class, or a configured layer.
Two ways to run it, the layer's `path`:

* "fused": two generated Triton kernels for the whole sequence, the forward and the backward through time, with
  the recurrent product inside their time loops (`flexgen.launch.recurrent.fused`). Needs Triton (CUDA tensors, or CPU
  tensors under TRITON_INTERPRET=1). On a GPU a layer wider than one program's tile (`RecurrentConfig.max_tile`:
  16 x 512 neurons in fp32, 16 x 1024 in 16-bit) is cut into slices of hidden neurons whose programs wait for
  each other every step; the slices of one row tile must fit the GPU at once (`RecurrentConfig.tiling`).
* "stepwise": per step, one matrix product and one call of the neuron's own kernels (or, with backend="torch", its
  generated torch path) for that step.

"auto" (the default) runs fused where it can and says once, with a warning, when a layer that could use Triton
falls back to stepwise. `backend="eager"` runs the plain torch loop of the step function that the tests compare
both paths against.

The layer, its options and what it keeps between calls live here; `recurrent_paths` chooses and runs a call's path,
`recurrent_known_calls` keeps known calls, `recurrent_feedback` adds what earlier outputs feed back.
"""
import contextlib
import math
import numbers

import torch

from ..launch.eager import recurrent_input, run_recurrent_eager
from ..launch.neuron.ops import triton_kernels_can_run
from ..launch.recurrent.stepped import run_stepwise
from ..launch.backends import check_name
from ..launch.recurrent.tiling import DEFAULT_RECURRENT
from .checks import recurrent_weight
from .tracing import refuse_jit_trace
from .delay import SynapseDelay, checked_feedback_delay
from .known_calls import handed_on_unchanged
from .neuron import NeuronModule
from .recurrent_feedback import (checked_history, in_dtype, last_sent, line_taps, line_values, scaled,
                                 with_previous_output, with_sent)
from .recurrent_known_calls import known_recurrent_forward, recurrent_call_key
from .recurrent_paths import run_checked, run_of
from .spec import NeuronSpec

PATHS = ("auto", "fused", "stepwise")

__all__ = ["Recurrent", "PATHS", "cell_module", "recurrent_input", "run_stepwise"]


class Recurrent(torch.nn.Module):
    """A recurrent layer of `hidden` neurons: `neuron`'s output `output_name` at step t - 1, times `weight`
    ([hidden, hidden], applied as `torch.nn.Linear` applies its weight), is added to its input `input_name` at step t.

    `neuron` is a `NeuronSpec` (`flexgen.neurons.alif`, your own `@flexgen.neuron`), a bundled layer class
    (`flexgen.LIF`: its spec, with parameters by the spec's names), or a configured layer (`flexgen.LIF(tau=3.0)`,
    `alif(tau=20.0)`: its options, hyper-parameters and learnable parameters; its step mode, backend and state
    handling are not used). Inputs are [T, B, hidden]. `input_name` defaults to the neuron's first input,
    `output_name` (a name, see `spec.equations()`, or a position) to its first output. `bias=True` adds a
    learnable bias [hidden] at every step (snnTorch's recurrent `nn.Linear` has one); `scale=True` a learnable
    per-neuron gain [hidden] on the recurrent current (the product uses `scale[:, None] * weight`);
    `per_neuron=True` (spec or class) gives every learnable parameter of the neuron one value per hidden neuron.
    Further keyword arguments are the hyper-parameters, learnable initial values and static options of a spec or
    class.

    `path` is "auto", "fused" or "stepwise" (see the module's docstring) and `layer.path` the one the last call
    took (`layer.last_run` also names the backend it ran on: "triton" for the fused kernels; the neuron's "c",
    "torch" or "triton" kernels step by step; "eager"); `backend` is "auto", "triton", "torch" or "c" (which run stepwise with the neuron's torch code or C
    kernels) or "eager" (the plain torch loop, the tests' oracle); `config` holds the fused kernels' launch settings
    (`flexgen.launch.recurrent.fused.RecurrentConfig`).

    The layer keeps its states between calls, as flexgen's other neuron layers do: after a call, the final states
    are in `layer.final_states` and the last step's fed-back output in `layer.final_output`, and the next call
    continues from them, so `layer(x1)` then `layer(x2)` computes what `layer(torch.cat([x1, x2]))` does (outputs
    and, left connected, gradients). `reset()` (or `flexgen.reset(model)`) forgets them: call it between
    independent sequences. `detach()` keeps their values but cuts the gradient there (truncated backpropagation
    through time). A call may also start from given `states=[...]` (tensors broadcastable to [B, hidden], which get
    gradients) and a given `previous_output=` ([B, hidden], whose product is added to the first step's input);
    passing either starts from what is passed, the other from its initial value (the declared initial states, a
    zero previous output). `step_mode="s"` takes one step per call (inputs [B, hidden]) for streaming inference.

    `delay=flexgen.Delay(hidden, max_delay, ...)` sends each neuron's output through its own delay line before the
    product: step t reads s_{t-1-d_h} of neuron h (fractional delays mix the two steps around it), and the delays
    (`layer.delay.delay`) learn with the rest. On the fused path the kernels read the delayed outputs in their time
    loop: two steps per neuron with linear taps, every step of the line with gaussian ones. The layer then keeps the
    outputs of its last max_delay + 1 steps between calls (`layer.sent`, oldest first), so calls on consecutive
    chunks equal one call on the whole sequence; such a layer's `previous_output=` may be that history too
    ([S, B, hidden], the last S outputs). `delay=flexgen.SynapseDelay(hidden, max_delay, ...)` gives each synapse
    a delay of its own instead: step t reads s_{t-1-d_ji} of neuron i into neuron j; the products then read the
    weight through max_delay + 1 tap matrices (`SynapseDelay.tap_matrices`) and the outputs of the last
    max_delay + 1 steps, on every path, with the same history between calls.

    >>> import torch, flexgen
    >>> layer = flexgen.Recurrent(flexgen.neurons.alif, hidden=8, bias=True, backend="torch")
    >>> layer(torch.rand(5, 2, 8)).shape
    torch.Size([5, 2, 8])
    >>> layer.path, sorted(layer.final_states)
    ('stepwise', ['a', 'v'])
    >>> layer.last_run
    Run(backend='torch', path='stepwise')
    >>> layer.reset()
    """

    def __init__(self, neuron, hidden, input_name=None, output_name=None, bias=False, scale=False, per_neuron=False,
                 path="auto", backend="auto", config=DEFAULT_RECURRENT, step_mode="m", delay=None, **params):
        super().__init__()
        if isinstance(hidden, bool) or not isinstance(hidden, numbers.Integral) or hidden < 1:
            raise ValueError(f"hidden must be a positive number of neurons, got {hidden!r}")
        hidden = int(hidden)
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        check_name(backend)
        if step_mode not in ("m", "s"):
            raise ValueError(f"step_mode must be 'm' (inputs [T, B, hidden]) or 's' (one step, [B, hidden]), "
                             f"got {step_mode!r}")
        if path == "fused" and backend in ("torch", "c", "eager"):
            raise ValueError(f"path='fused' runs Triton kernels; backend={backend!r} does not")
        self.cell = cell_module(neuron, "Recurrent", hidden, per_neuron, backend, params, recompute=False)
        self.hidden, self.requested_path, self.backend, self.config = hidden, path, backend, config
        self.step_mode = step_mode
        self.input_name, self.output_name = _feedback_names(self.cell, input_name, output_name)
        self.input_index = self.spec.signature.inputs.index(self.input_name)
        self.output_index = _output_names(self.cell).index(self.output_name)
        self._n_outputs = len(_output_names(self.cell))  # known here: looking it up inside torch.compile would break
        bound = 1.0 / math.sqrt(hidden)  # torch.nn.Linear's initialisation
        self.weight = torch.nn.Parameter(recurrent_weight(hidden).uniform_(-bound, bound))
        self.bias = torch.nn.Parameter(torch.empty(hidden).uniform_(-bound, bound)) if bias else None
        self.scale = torch.nn.Parameter(torch.ones(hidden)) if scale else None
        self.delay = checked_feedback_delay(delay, hidden)
        self._kernels = {}  # (delayed, tapped) -> the fused kernels, looked up once per layer as a neuron layer's are
        if path != "stepwise" and backend in ("auto", "triton") and triton_kernels_can_run():
            self.compiled()  # looked up now, as the cell's are: a first call inside torch.compile then finds them
        self.path = None
        self.last_run = None  # the `flexgen.launch.backends.Run` (backend and path) the last call took
        self.final_states, self.final_output = {}, None
        self.sent = None  # a delayed layer's fed-back outputs of its last max_delay + 1 steps, [<= max_delay + 1, B, H]
        self._continues = True  # False while a Dense layer runs this one from states it gives (see from_given)
        self._replay = None  # (bits of fed-back spikes, checks) a Dense layer's re-run of a segment replays (replaying)
        self._unfit = set()  # (device type, dtype) where the fused kernels did not fit the GPU
        self._known_calls = {}  # call key -> KnownRecurrentCall (see _call_key)
        self._warned = False

    @property
    def spec(self):
        return self.cell.spec

    def effective_weight(self):
        """The weight the product uses: `weight`, its rows scaled by `scale` if the layer has one."""
        return scaled(self.weight, self.scale)

    def _feedback_weight(self):
        """What the products read: the effective weight, or with a delay per synapse its tap matrices side by side
        ([H, (max_delay + 1) H])."""
        weight = self.effective_weight()
        return self.delay.tap_matrices(weight) if self._per_synapse() else weight

    def compiled(self):
        """The fused kernels of this layer's neuron, input and output (`flexgen.kinds.recurrent.CompiledRecurrent`) for its
        delay line's interpolation now."""
        line = self._line_kind()
        kernels = self._kernels.get(line)
        if kernels is None:
            options = {"input": self.input_name, "output": self.output_name, "delayed": line[0], "tapped": line[1],
                       "synaptic": line[2]}
            kernels = self.spec.compiled("recurrent", options, **self.cell.static)
            self._kernels[line] = kernels
        return kernels

    def _line_kind(self):
        """(delayed, tapped, synaptic): which fused kernels this layer's delays need now (per neuron through two
        taps or any; or per synapse, whatever the taps: with max_delay 0 the one tap matrix is the weight, and the
        undelayed kernels run it)."""
        if self._per_synapse():
            return False, False, self.delay.max_delay > 0
        delayed = self.delay is not None
        return delayed, delayed and self.delay.interpolation != "linear", False

    def _per_synapse(self):
        return isinstance(self.delay, SynapseDelay)

    def source(self, kind="forward"):
        """Generated source of the fused kernels: "forward", "inference", "backward", "replay" (layers without delays:
        every step's recurrent current from known outputs, see `replaying`) or "module"."""
        compiled = self.compiled()
        if kind == "module":
            return compiled.module_source()
        if kind not in compiled.meta["sources"]:
            raise ValueError(f"kind must be one of {sorted(compiled.meta['sources']) + ['module']}, got {kind!r}")
        return compiled.meta["sources"][kind]

    def extra_repr(self):
        items = [f"neuron={self.spec.__name__}", f"hidden={self.hidden}", f"input_name={self.input_name!r}",
                 f"output_name={self.output_name!r}", f"bias={self.bias is not None}"]
        if self.scale is not None:
            items.append("scale=True")
        items += [f"path={self.requested_path!r}", f"backend={self.backend!r}"]
        if self.step_mode != "m":
            items.append(f"step_mode={self.step_mode!r}")
        return ", ".join(items)

    def _keep(self, **values):
        """Set plain attributes (what a call keeps, its path) past nn.Module.__setattr__'s checks, which cost
        several microseconds each."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def reset(self):
        """Forget the kept states and output: the next call starts from the initial values."""
        self._keep(final_states={}, final_output=None, sent=None)

    def detach(self):
        """Keep the states' and output's values but cut them from the autograd graph of the calls that made them:
        the next backward stops at this call (truncated backpropagation through time)."""
        self.final_states = {k: v.detach() for k, v in self.final_states.items()}
        self.final_output = None if self.final_output is None else self.final_output.detach()
        self.sent = None if self.sent is None else self.sent.detach()

    @contextlib.contextmanager
    def from_given(self):
        """Within it, calls start from the states and previous output they pass (or the initial ones), never from
        the kept ones: a `Dense` layer around this one decides where its calls start."""
        self._continues = False
        try:
            yield self
        finally:
            self._continues = True

    @contextlib.contextmanager
    def replaying(self, sent, checks):
        """Within it, a training call on the fused path whose fed-back spikes an earlier call over the same steps,
        from the same states, gave (a `Dense` layer's long-sequence mode re-runs its segments so), packed as bits in
        `sent` (`flexgen.launch.bitpack.pack_spikes` of the [T, B, hidden] outputs), replays them: the recurrent currents
        of all steps at once (the generated replay kernel runs the forward's product in the forward's tiles on the
        unpacked spikes), then the neuron's steps in its plain kernels; the backward is the fused one. No step waits
        for the one before, so a replay takes a fraction of a fused forward's time. Layers without delays
        replay in float32 and float64 (in 16-bit dtypes the summed current would be stored rounded, where the fused
        kernel keeps it in fp32); other calls run as usual.

        A replay appends to `checks` whether its outputs are those spikes (a 0-d bool tensor: no device sync per
        call). Where one is False (kernels compiled apart that rounded otherwise, or `sent` not what this call gives),
        the caller must discard what the replay gave and run again without it. None: no replay."""
        self._keep(_replay=None if sent is None else (sent, checks))
        try:
            yield self
        finally:
            self._keep(_replay=None)

    def _apply(self, fn, recurse=True):
        """`.to()`, `.double()`, `.cuda()`... also convert the kept states and output (they are not buffers)."""
        result = super()._apply(fn, recurse)
        self.final_states = {k: fn(v) for k, v in self.final_states.items()}
        self.final_output = None if self.final_output is None else fn(self.final_output)
        self.sent = None if self.sent is None else fn(self.sent)
        return result

    def __getstate__(self):
        """Pickling and `copy.deepcopy` keep the kept states' values, detached from any autograd graph."""
        state = dict(super().__getstate__())
        state["final_states"] = {k: v.detach() for k, v in state.get("final_states", {}).items()}
        state["_kernels"] = {}  # loaded kernels stay in this process; looked up again on use
        state["_known_calls"] = {}
        for kept in ("final_output", "sent"):
            if state.get(kept) is not None:
                state[kept] = state[kept].detach()
        return state

    def __setstate__(self, state):
        """A copy (`copy.deepcopy`, unpickling) looks its fused kernels up again now, as a new layer does: a first
        call inside torch.compile then finds them instead of running step by step."""
        super().__setstate__(state)
        self.__dict__.setdefault("_known_calls", {})  # (pickled before layers kept them)
        if self.requested_path != "stepwise" and self.backend in ("auto", "triton") and triton_kernels_can_run():
            self.compiled()

    def forward(self, *inputs, states=None, previous_output=None):
        refuse_jit_trace("flexgen.Recurrent")
        if self.step_mode == "s":
            inputs = tuple(x.unsqueeze(0) if isinstance(x, torch.Tensor) else x for x in inputs)
        sent = None
        if states is None and previous_output is None and self._continues and self._has_kept():
            states, previous_output = self._kept(inputs[0] if inputs else None)
            sent = self.sent
        result = self._forward(inputs, states, previous_output, sent)
        if self.step_mode == "s":
            result = tuple(o[0] for o in result) if isinstance(result, tuple) else result[0]
        return result

    def _has_kept(self):
        return bool(self.final_states) or self.final_output is not None or self.sent is not None

    def _kept(self, first):
        """The kept states and output a call continues from, checked against its first input."""
        kept = next(iter(self.final_states.values()), self.final_output)
        if isinstance(first, torch.Tensor) and first.dim() == 3:
            if kept.dim() == 2 and first.shape[1] != kept.shape[0]:
                raise ValueError(
                    f"this Recurrent layer continues from its last call, whose batch had {kept.shape[0]} rows; this "
                    f"call has {first.shape[1]}. Call layer.reset() (or flexgen.reset(model)) between sequences")
            if first.device != kept.device:
                raise ValueError(
                    f"this Recurrent layer continues from its last call, whose states are on {kept.device}; this "
                    f"call's inputs are on {first.device}. Move the layer with them (.to() moves its states too) "
                    "or call layer.reset()")
        return list(self.final_states.values()), self.final_output

    def _forward(self, inputs, states, previous_output, sent=None):
        parameters = self._parameters_now()
        if self.spec.finite_learnable:  # a NaN refractory period would silently mean none (the cell's check)
            self.cell._check_finite(parameters[0])
        key = self._call_key(inputs, states, previous_output, *parameters)
        known = self._known_calls.get(key) if key is not None else None
        if known is not None:
            outputs, finals = known_recurrent_forward(self, known, inputs, states, previous_output, *parameters)
            path = "fused"
        else:
            outputs, finals, path, sent = self._checked_forward(inputs, states, previous_output, sent, key,
                                                                parameters[0])
        fed_back = outputs[self.output_index]
        # a copy: the last step as a view would keep the whole output sequence alive between calls
        self._keep(path=path, final_states=dict(zip(self.spec.signature.states, finals)),
                   final_output=fed_back[-1].clone() if fed_back.shape[0] else previous_output,
                   last_run=run_of(self, path, fed_back))
        if self.delay is not None:
            self._keep(sent=last_sent(sent, fed_back, self.delay.max_delay + 1))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _parameters_now(self):
        """(the neuron's learnable values, weight, bias, scale), each looked up once (nn.Module's lookup is slow)."""
        cell = self.cell
        return [getattr(cell, w) for w in cell._signature.learnable], self.weight, self.bias, self.scale

    def _call_key(self, inputs, states, previous_output, learnable, weight, bias, scale):
        """What a call depends on besides its tensors' values, or None for calls that take the checked path every
        time (`flexgen.layers.recurrent_known_calls.recurrent_call_key`)."""
        return recurrent_call_key(self, inputs, states, previous_output, learnable, weight, bias, scale)

    def _checked_forward(self, inputs, states, previous_output, sent, key, learnable):
        """(outputs, final states, path, the outputs sent before the call) of a call through the checks; `key`: its
        `_call_key`, under which a fused call whose checks handed its tensors on unchanged is kept; `learnable`: the
        neuron's learnable values (`_parameters_now`)."""
        neuron = self._neuron_call()
        checked = neuron.check(list(inputs), states, learnable)
        unchanged = handed_on_unchanged((inputs, states, learnable), checked)
        first = checked[0][0]
        self._check_shape(first)
        weight, bias = self._feedback_weight(), self.bias  # cast to the inputs' dtype by the paths that run them
        delayed = self.delay is not None
        if delayed:
            if sent is None and previous_output is not None:
                sent = checked_history(self, previous_output, first)
            if sent is not None:
                checked = with_sent(self, checked, sent, weight)
        if self.backend == "eager":
            if not delayed and previous_output is not None:
                checked = with_previous_output(self, checked, previous_output, weight.to(first.dtype))
            weight, bias = in_dtype(weight, bias, first.dtype)
            taps = line_taps(self, first) if delayed and not self._per_synapse() else None
            outputs, finals = self._run_eager(neuron, checked, weight, bias, taps)
            return outputs, finals, "eager", sent
        previous = None if delayed else previous_output
        return (*run_checked(self, neuron, checked, weight, bias, key if unchanged else None, states is None,
                             previous), sent)

    def _neuron_call(self):
        """The wrapped neuron's `NeuronCall` with this layer's backend (the step-wise path calls it per step)."""
        neuron = self.cell._neuron_call()._replace(backend=self.backend, store_state_seqs=False, recompute=False)
        if self.backend != "eager" and neuron.compiled is None:  # a wrapped layer built with backend="eager"
            neuron = neuron._replace(compiled=self.spec.compiled(**self.cell.static))
        return neuron

    def _run_eager(self, neuron, checked, weight, bias, taps=None):
        inputs, states, learnable = checked
        params = dict(zip(neuron.signature.learnable, learnable))
        states = [v.expand(inputs[0].shape[1:]) for v in states]
        return run_recurrent_eager(self.spec, neuron.static, inputs, states, params, neuron.hyper, weight, bias,
                                   self.input_index, self.output_index, taps)

    def _line_values(self, first):
        """What the fused kernels read the delay lines from (`flexgen.layers.recurrent_feedback.line_values`)."""
        return line_values(self, first)

    def _check_shape(self, first):
        if first.dim() != 3 or first.shape[2] != self.hidden:
            raise ValueError(
                f"a recurrent layer of {self.hidden} neurons takes inputs [T, B, {self.hidden}], "
                f"got {tuple(first.shape)}"
            )


_DELAYED_ELSEWHERE = {
    "Recurrent": "delay the fed-back outputs with Recurrent(..., delay=flexgen.Delay(hidden, max_delay)), or the "
                 "layer's input with a flexgen.Delay before it",
    "Dense": "delay the input with a flexgen.Delay before the layer, give every synapse a delay with "
             "flexgen.DelayedLinear followed by the neuron layer, or run torch.nn.Linear and the delayed layer",
}


def cell_module(neuron, owner, neurons, per_neuron, backend, params, recompute="auto"):
    """The `NeuronModule` a layer built around a neuron (`owner`: "Recurrent", "Dense") runs: `neuron` itself if it
    is a configured layer, else one made from a `NeuronSpec` or a bundled layer class with `params`
    (`per_neuron=True`: every learnable parameter gets one value per neuron of the `neurons`)."""
    if isinstance(neuron, NeuronModule):
        if params or per_neuron:
            raise TypeError(f"{owner}: a configured layer brings its own parameters; pass them when building it, "
                            f"not here (got {sorted(params) + (['per_neuron'] if per_neuron else [])})")
        if neuron.delay is not None:
            raise ValueError(f"{owner} runs its neuron's kernels itself, without the layer's delay= line; "
                             f"{_DELAYED_ELSEWHERE[owner]}")
        return neuron
    spec = neuron
    if isinstance(neuron, type) and issubclass(neuron, NeuronModule):
        spec = getattr(neuron, "spec", None)
    if not isinstance(spec, NeuronSpec):
        raise TypeError(f"{owner} needs a flexgen neuron (a NeuronSpec, a layer class such as flexgen.LIF, or a "
                        f"layer), got {neuron!r}")
    return NeuronModule(spec, backend=backend, per_channel=neurons if per_neuron else None, recompute=recompute,
                        **params)


def _output_names(cell):
    return tuple(str(o) for o in cell.spec.trace(**cell.static).outputs)


def _feedback_names(cell, input_name, output_name):
    """(input, output) names a recurrent layer feeds back through, checked."""
    spec = cell.spec
    inputs, outputs = spec.signature.inputs, _output_names(cell)
    input_name = inputs[0] if input_name is None else input_name
    if input_name not in inputs:
        raise ValueError(f"{spec.__name__} has no input {input_name!r}; its inputs are {inputs}")
    if output_name is None:
        output_name = outputs[0]
    elif isinstance(output_name, int) and not isinstance(output_name, bool):
        if not -len(outputs) <= output_name < len(outputs):
            raise ValueError(f"{spec.__name__} has {len(outputs)} output(s) {outputs}; "
                             f"output_name={output_name} is out of range")
        output_name = outputs[output_name]
    if output_name not in outputs:
        raise ValueError(f"{spec.__name__} has no output {output_name!r}; its outputs are {outputs} "
                         "(named after the step's variables, see spec.equations(); or give a position)")
    return input_name, output_name
