"""Which path a recurrent layer's checked call takes, and running it there.

"fused" where the fused kernels can run the call (`choose_path`, `fused_unavailable`), else "stepwise", with a
warning once per layer when a layer that could use Triton falls back (`fall_back`); kernels that need more than
the GPU has fall back too, and the layer remembers that for the dtype. A training call inside `Recurrent.replaying`
(a `Dense` layer's long-sequence mode re-running a segment) replays the spikes it was given (`replayed`).
"""
import warnings

import torch

from ..launch import tracing_or_transforming
from ..launch.backends import Run, choose
from ..launch.bitpack import packed_bytes
from ..launch.compat import fp64_dot_error
from ..launch.recurrent.fused import run_fused
from ..launch.recurrent.replay import REPLAYED_DTYPES, run_replayed
from ..launch.recurrent.stepped import run_stepwise
from ..launch.recurrent.tiling import cached_tiling, resident_programs
from ..launch.triton_path import cuda_index
from .recurrent_feedback import in_dtype, line_taps, line_values, previous_for_kernels, with_previous_output
from .recurrent_known_calls import remember_recurrent_call


def out_of_resources():
    """What Triton raises when a kernel needs more shared memory or registers than the GPU has (imported when a
    fused call runs: the CPU never needs Triton)."""
    try:
        from triton.runtime.errors import OutOfResources
    except ImportError:  # pragma: no cover (every supported Triton release has it)
        return ()
    return OutOfResources


def run_checked(layer, neuron, checked, weight, bias, key=None, initial=True, previous_output=None):
    """(outputs, final states, path) of the fused kernels where they can run, else step by step. `weight` and
    `bias` in the parameters' dtype: the fused kernels' autograd function casts them itself. A fused call
    with a `key` (one whose checks handed its tensors on unchanged) is kept under it, with its states if they are
    the `initial` ones. `previous_output`: an undelayed layer's output before the call (`with_previous_output`
    or `previous_for_kernels`)."""
    inputs, states, learnable = checked
    first = inputs[0]
    if choose_path(layer, first) == "fused":
        delay = line_values(layer, first)
        save = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (
            *inputs, *states, *learnable, weight, bias, delay, previous_output))
        previous = previous_for_kernels(layer, previous_output, first, save)
        if previous_output is not None and previous is None:  # added to the first step's input here
            checked = with_previous_output(layer, checked, previous_output, weight.to(first.dtype))
            inputs, previous_output = checked[0], None
        replay = replayed(layer, neuron, checked, weight, bias) if save else None
        if replay is not None:
            return (*replay, "fused")
        try:
            outputs, finals = run_fused(layer.compiled(), inputs, states, learnable, list(neuron.hyper.values()),
                                        weight, bias, save, layer.config, delay,
                                        None if delay is None else layer.delay.max_delay, key, previous)
            if key is not None:
                remember_recurrent_call(layer, key, checked, list(neuron.hyper.values()), save, initial,
                                        previous is not None)
            return outputs, finals, "fused"
        except out_of_resources() as exc:
            if layer.requested_path == "fused":
                raise
            layer._unfit.add((first.device.type, first.dtype))
            layer._known_calls.clear()
            fall_back(layer, f"the fused kernels need more than the GPU has ({exc})")
    if previous_output is not None:
        checked = with_previous_output(layer, checked, previous_output, weight.to(first.dtype))
    weight, bias = in_dtype(weight, bias, first.dtype)
    taps = line = None
    if layer.delay is not None and not layer._per_synapse():
        taps = line_taps(layer, first)
        if layer.delay.interpolation == "linear":
            line = (layer.delay.line_delays(), layer.delay.max_delay)
    outputs, finals = run_stepwise(neuron, checked, weight, bias, layer.input_index, layer.output_index,
                                   layer._n_outputs, taps, line)
    return outputs, finals, "stepwise"


def replayed(layer, neuron, checked, weight, bias):
    """(outputs, final states) of a training call that replays the fed-back outputs given to `replaying`, or
    None where the call does not (none given, or one it cannot replay)."""
    replay = getattr(layer, "_replay", None)
    inputs, states, learnable = checked
    first = inputs[0]
    if replay is None or layer.delay is not None or first.dtype not in REPLAYED_DTYPES or tracing_or_transforming():
        return None
    sent, checks = replay
    shape = (first.shape[0], packed_bytes(first[0].numel()))
    if sent.dtype != torch.uint8 or tuple(sent.shape) != shape:
        raise ValueError(f"replaying takes the spikes as bits, [T, ceil(B * H / 8)] = "
                         f"{list(shape)} uint8 (flexgen.launch.bitpack.pack_spikes); "
                         f"got {sent.dtype} {list(sent.shape)}")
    return run_replayed(layer.compiled(), neuron.compiled.ops, inputs, states, learnable,
                        list(neuron.hyper.values()), weight, bias, sent, checks, layer.config)


def choose_path(layer, first):
    """"fused" or "stepwise" for a call whose first input is `first`."""
    if layer.requested_path == "stepwise":
        return "stepwise"
    triton = choose(layer.backend, first.device).name == "triton"
    reason = fused_unavailable(layer, triton, first)
    if reason is None:
        return "fused"
    if layer.requested_path == "fused":
        raise ValueError(f"path='fused' cannot run this call: {reason}; use path='auto' or 'stepwise'")
    if triton and first.numel() and not torch.compiler.is_compiling():  # a warning would break the graph
        fall_back(layer, reason)
    return "stepwise"


def fused_unavailable(layer, triton, first):
    """Why the fused kernels cannot run a call, or None if they can."""
    if not triton:
        return f"the fused kernels are Triton kernels, and this call runs the torch path ({first.device} tensors)"
    if torch.compiler.is_compiling() and first.device.type != "cuda":
        return "torch.compile traces the fused kernels' custom ops on CUDA (the interpreter runs kernels eagerly)"
    if torch.compiler.is_compiling() and layer._line_kind() not in layer._kernels:
        # Looking them up inside the trace would break the graph: the layer's interpolation changed since the
        # layer was made (e.g. to linear taps after DCLS's rounding). An eager call, or layer.compiled(), first.
        return "the fused kernels of this delay line's interpolation were not looked up before torch.compile"
    if first.numel() == 0:
        return "the inputs are empty"
    tiling = cached_tiling(layer.config, first.shape[1], layer.hidden, first.dtype, resident_programs(first.device),
                           plain=not any(layer._line_kind()))
    if isinstance(tiling, str):
        return tiling
    if first.dtype == torch.float64 and first.device.type == "cuda":
        if torch.compiler.is_compiling():
            return "float64 fused kernels are not traced by torch.compile"
        problem = fp64_dot_error(cuda_index(first.device))
        if problem is not None:
            return f"this Triton cannot compile float64 products (tl.dot) for this GPU ({problem})"
    if (first.device.type, first.dtype) in layer._unfit:
        return f"the fused kernels did not fit this GPU for {first.dtype}"
    return None


def fall_back(layer, reason):
    """Say once per layer, with a warning, why a call it would have run fused runs step by step."""
    if not layer._warned:
        warnings.warn(f"flexgen.Recurrent ({layer.spec.__name__}, hidden={layer.hidden}) runs step by step: {reason}",
                      stacklevel=2)
        layer._warned = True


def run_of(layer, path, first):
    """The `Run` of a call that took `path`: the fused kernels are Triton kernels; a stepwise call runs the
    neuron's kernels on the backend the neuron's call chooses (`NeuronCall.backend_for`; while torch.compile
    traces, the C target is not considered, as the neuron's call does not run it there)."""
    if path in ("fused", "eager"):
        return Run("triton" if path == "fused" else "eager", path)
    if torch.compiler.is_compiling():
        return Run(choose(layer.backend, first.device, first.dtype).name, path)
    return Run(layer._neuron_call().backend_for(first).name, path)
