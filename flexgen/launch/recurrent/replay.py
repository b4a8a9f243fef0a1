"""The long-sequence mode's replays of a fused recurrent layer's forward: where the fed-back spikes of a segment
are known (kept as bits by the first run), every step's recurrent current is computed at once by the generated
replay kernel and the neuron's steps run in its plain kernels; the backward is the fused one."""
from typing import NamedTuple

import torch

from ..bitpack import all_spikes, pack_spikes, unpack_spikes
from ...render.layout import Kind, pick_saved
from .fused import FusedRecurrentFunction, FusedRun, read_parameters
from ..scalars import cached_zero
from .tiling import DEFAULT_RECURRENT, call_tiling, dot_precision


# 16-bit replays would store the summed current rounded to the I/O dtype, which the fused forward keeps in fp32 for
# the neuron's step: its spikes could come out otherwise
REPLAYED_DTYPES = (torch.float32, torch.float64)


class ReplayedRun(NamedTuple):
    """A replayed training forward's non-tensor arguments: the fused run's, the neuron's plain ops (its elementwise
    kernels), `sent`, the fed-back spikes an earlier run over the same steps gave as bits (`flexgen.launch.bitpack`,
    [T, ceil(B * H / 8)] bytes), and `checks`, a list the forward appends to whether it reproduced them (a 0-d bool
    tensor: read without a device sync per call)."""

    run: FusedRun
    neuron_ops: object
    sent: torch.Tensor
    checks: list


class ReplayedRecurrentFunction(FusedRecurrentFunction):
    """A fused layer's training forward over steps whose fed-back outputs are known: every step's recurrent
    current at once (`replayed_current`), then the neuron's steps in its plain kernels, which save what the fused
    backward reads (the input the product is added to, summed, is that backward's saved input). The backward is
    `FusedRecurrentFunction`'s."""

    @staticmethod
    def forward(ctx, replay, *tensors):
        run = replay.run
        inputs, states, learnable, weight, bias, _ = run.split(tensors)
        weight, bias = read_parameters(ctx, weight, bias, inputs[0].dtype)
        layout = run.compiled.layout
        given = list(inputs)
        given[layout.input_index] = replayed_current(run.compiled, inputs[layout.input_index], replay.sent, weight,
                                                     bias, run.config)
        outputs, finals, saved = _plain_training_forward(replay.neuron_ops, given, states, learnable, run.hyper)
        fed_back = outputs[layout.output_index]
        replay.checks.append(_reproduces(fed_back, replay.sent))
        ctx.save_for_backward(*saved, fed_back, *learnable, weight)
        ctx.run, ctx.state_dtypes, ctx.line = run, [v.dtype for v in states], None
        ctx.set_materialize_grads(False)
        return (*outputs, *finals)


def _plain_training_forward(ops, inputs, states, learnable, hyper):
    """(outputs, final states, saved values) of the neuron's plain training kernels: through the call signature's
    plan (its launch prepared once) where there is one."""
    plan = ops.plan(inputs, states, learnable, hyper, False, True)
    if plan is not None:
        outputs, finals, buffers = plan.forward(inputs, states, learnable)
    else:
        result = ops.forward_impl(inputs, states, learnable, hyper, False, True, True)
        n_out, n_states = len(ops.layout.outputs), len(states)
        outputs, finals, buffers = result[:n_out], result[n_out:n_out + n_states], result[n_out + n_states:]
    sources = {Kind.INPUT: inputs, Kind.STATE: states, Kind.OUTPUT: outputs}
    return outputs, finals, pick_saved(ops.layout.saved, sources, buffers)


def _reproduces(fed_back, sent):
    """Whether spikes `fed_back` [T, B, H] are the bits `sent`, as a 0-d bool tensor (no device sync)."""
    return all_spikes(fed_back) & (pack_spikes(fed_back) == sent).all()


def replayed_current(compiled, current, sent, weight, bias, config=DEFAULT_RECURRENT):
    """The input the neuron sees at every step: `current` plus `s[t - 1] W^T` (none at the first step) plus the bias,
    where s are the spikes packed in `sent` ([T, ceil(B * H / 8)] bytes), all steps at once by the generated replay
    kernel. It runs the forward's product in the forward's tiles on the same operands, so it rounds as the forward
    did and the neuron's steps come out the same."""
    current, sent = current.contiguous(), sent.contiguous()
    n_steps, batch, hidden = current.shape
    # The kernel reads the spikes unpacked, as the forward's product reads them. One that read the bits itself
    # computed its operands, and Triton lowered that product otherwise: on an H100 its float32 sums no longer matched
    # the forward's bit for bit, and its float64 one did not compile. The unpacked copy lives for this launch only.
    fed = unpack_spikes(sent, current.shape[1:], current.dtype)
    total = torch.empty_like(current)
    tiling = call_tiling(config, batch, hidden, current.dtype, current.device)
    grid = (n_steps, tiling.rows(batch), tiling.split)
    args = [current, fed, weight, weight.stride(0), weight.stride(1), bias, bias.stride(0) if bias.dim() else 0, total,
            n_steps, batch, hidden]
    constexprs = {"F64": current.dtype == torch.float64, "DOT_PRECISION": dot_precision(current.dtype),
                  "BLOCK_B": tiling.block_b, "BLOCK": tiling.block, "BLOCK_K": tiling.block_k,
                  "STATIONARY_WEIGHT": tiling.stationary, "ROW_BY_ROW": tiling.row_by_row}
    compiled.launches("replay")(grid, args, constexprs, num_warps=config.warps(tiling), num_stages=tiling.stages)
    return total


def run_replayed(compiled, neuron_ops, inputs, states, learnable, hyper, weight, bias, sent, checks,
                 config=DEFAULT_RECURRENT):
    """(outputs, final states) of a differentiable fused forward (inputs in one of `REPLAYED_DTYPES`) whose fed-back
    spikes an earlier run over the same steps and states gave, packed in `sent` ([T, ceil(B * H / 8)] bytes): the
    long-sequence mode re-runs its segments this way (`ReplayedRecurrentFunction`). Appends to `checks` whether the
    outputs are those spikes (a 0-d bool tensor); where one is False the results are not the earlier run's, and the
    caller runs again without the replay. Undelayed layers, eager calls only."""
    first = inputs[0]
    bias = bias if bias is not None else cached_zero(first.dtype, first.device)
    run = FusedRun(compiled, hyper, len(inputs), len(states), len(learnable), config)
    result = ReplayedRecurrentFunction.apply(ReplayedRun(run, neuron_ops, sent, checks), *inputs, *states, *learnable,
                                             weight, bias)
    n_out = len(compiled.layout.layout.outputs)
    return list(result[:n_out]), list(result[n_out:])
