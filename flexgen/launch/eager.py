"""The eager backend: the step function itself, run on tensors, step by step.

No code generation is involved: torch autograd differentiates the user's own
function (spikes use the surrogates' hand-written torch gradients). This is
the `backend="eager"` for debugging and the oracle every test compares the
generated kernels against.
"""
import contextlib

import torch

from ..frontend.functions import STEP_DTYPE


def run_eager(spec, static, inputs, states, learnable, hyper, state_seqs):
    """Run `spec`'s step over the leading dim of `inputs`.

    inputs: [T, *shape] tensors; states: tensors of the step shape;
    learnable, hyper: dicts name -> tensor / float. Returns (outputs, states),
    outputs as [T, *shape] tensors, states final or as [T, *shape] sequences.
    """
    sig = spec.signature_for(static)
    options = sig.bind_alphas(static, learnable)
    learnable = {w: learnable[w] for w in spec.signature.learnable}  # the rest are alphas, bound in `options`
    n_steps = inputs[0].shape[0]
    states = list(states)
    outputs, sequences = [], [[] for _ in states]
    like = inputs[0][0] if n_steps else None
    with _numbers_in(like):
        for t in range(n_steps):
            result = _one_step(spec, sig, options, inputs, states, learnable, hyper, t, like)
            split = len(result) - len(states)
            outputs.append(result[:split])
            states = result[split:]
            for seq, s in zip(sequences, states):
                seq.append(s)
    n_outputs = spec.n_outputs(static)
    if n_steps == 0:
        empty = [torch.empty(inputs[0].shape, dtype=inputs[0].dtype, device=inputs[0].device) for _ in range(n_outputs)]
        finals = ([torch.empty(inputs[0].shape, dtype=s.dtype, device=s.device) for s in states] if state_seqs
                  else states)
        return empty, finals
    stacked = [torch.stack([o[k] for o in outputs]) for k in range(n_outputs)]
    finals = [torch.stack(seq) for seq in sequences] if state_seqs else states
    return stacked, finals


def _one_step(spec, sig, options, inputs, states, learnable, hyper, t, like):
    """The step function on step `t`: its results (outputs, then new states) as tensors like `like`."""
    # Copies: an in-place op in the step (`x += 1` on a tensor) must not write into the caller's
    # inputs or into states autograd has saved; the traced backends treat it as rebinding.
    kwargs = dict(zip(sig.inputs, (x[t].clone() for x in inputs)))
    kwargs.update(zip(sig.states, (s.clone() for s in states)))
    kwargs.update(learnable)
    kwargs.update(hyper)
    kwargs.update(options)
    result = spec.fn(**kwargs)
    result = result if isinstance(result, tuple) else (result,)
    return [_as_step_tensor(r, like) for r in result]


@contextlib.contextmanager
def _numbers_in(like):
    """Numbers the step turns into tensors by themselves take the step's dtype (see functions.STEP_DTYPE)."""
    token = STEP_DTYPE.set(None if like is None else like.dtype)
    try:
        yield
    finally:
        STEP_DTYPE.reset(token)


def _as_step_tensor(value, like):
    if not isinstance(value, torch.Tensor):  # a number: made in the step's dtype directly (via float32 it would round)
        value = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    elif value.dtype != like.dtype:  # the step's dtype is the inputs'
        value = value.to(like.dtype)
    return torch.broadcast_to(value, like.shape)


def recurrent_input(x, previous, weight, bias):
    """A recurrent layer's input at one step: `x`, plus the output fed back from the step before (`previous`,
    None at the first step: zero) times `weight` transposed (as `torch.nn.Linear` applies its weight), plus `bias`
    (or None)."""
    current = x if previous is None else x + previous @ weight.t()
    return current if bias is None else current + bias


def run_recurrent_eager(spec, static, inputs, states, learnable, hyper, weight, bias, input_index, output_index,
                        taps=None):
    """A recurrent layer of `spec` as a plain loop: `recurrent_input`, then the step function itself, step by step,
    differentiated by torch autograd. inputs: [T, B, H] tensors; states: tensors of shape [B, H]; learnable, hyper:
    dicts as for `run_eager`; taps: see `run_recurrent_loop`. Returns (outputs as [T, B, H] tensors, final states)."""
    def step(xs, states):
        return run_eager(spec, static, xs, states, learnable, hyper, False)

    return run_recurrent_loop(step, inputs, states, weight, bias, input_index, output_index, spec.n_outputs(static),
                              taps)


def delayed_feedback(sent, taps):
    """What a delayed layer feeds back at the next step: sum_k taps[h, k] * sent[-1 - k][:, h] over the outputs sent so
    far (`sent`, oldest first; fewer than the taps: zeros before them)."""
    reach = min(len(sent), taps.shape[1])
    recent = torch.stack(list(reversed(sent[-reach:])))  # [reach, B, H], the latest first: tap k reads sent[-1 - k]
    return torch.einsum("kbh,hk->bh", recent, taps[:, :reach])


def synaptic_feedback(sent, n_taps):
    """What a layer with a delay per synapse feeds back at the next step: the outputs sent 1 .. `n_taps` steps
    before it side by side, [B, n_taps H], the operand of its tap matrices [H, n_taps H] (zeros before the first)."""
    latest = list(reversed(sent[-n_taps:]))
    return torch.cat(latest + [torch.zeros_like(sent[-1])] * (n_taps - len(latest)), dim=-1)


def run_recurrent_loop(step, inputs, states, weight, bias, input_index, output_index, n_outputs, taps=None):
    """The time loop of a recurrent layer, one call of `step(inputs, states) -> (outputs, states)` per step, on
    [1, B, H] inputs; the input at `input_index` gets the recurrent current (`recurrent_input`) from the output at
    `output_index` of the step before, or with `taps` ([H, max_delay + 1], a `flexgen.Delay`'s) from the outputs
    of the steps before through each neuron's delay line (`delayed_feedback`). A `weight` [H, n H] is n tap
    matrices side by side (a delay per synapse, `flexgen.SynapseDelay`), which read the outputs of the last n steps
    (`synaptic_feedback`). Returns (outputs as [T, B, H] tensors, final states)."""
    per_step, previous, sent = [], None, []
    n_taps = weight.shape[1] // weight.shape[0]
    for t in range(inputs[0].shape[0]):
        xs = [x[t:t + 1] for x in inputs]
        xs[input_index] = recurrent_input(xs[input_index], previous, weight, bias)
        outputs, states = step(xs, states)
        sent.append(outputs[output_index][0])
        if taps is not None:
            previous = delayed_feedback(sent, taps)
        else:
            previous = sent[-1] if n_taps == 1 else synaptic_feedback(sent, n_taps)
        per_step.append(outputs)
    if not per_step:
        like = inputs[0]
        return [torch.empty(like.shape, dtype=like.dtype, device=like.device) for _ in range(n_outputs)], list(states)
    return [torch.cat(o) for o in zip(*per_step)], list(states)
