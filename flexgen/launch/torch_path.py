"""The CPU path: the generated torch loops (`torch_forward`, `torch_backward` of the generated module) on
[T, N] views in the compute dtype, with what the Triton path does around its kernels."""
import torch

from ..render.layout import Kind, pick_saved
from .allocate import n_checkpoints
from .abi import per_neuron, reduce_to_param
from .config import compute_dtype


def rows(t, n_steps, n_elem):
    """`t` as a [T, N] view where its strides allow, else a contiguous copy."""
    if t.dim() == 0:  # one value for every step and neuron
        return t.expand(n_steps, n_elem)
    try:
        return t.view(n_steps, n_elem)
    except RuntimeError:
        return t.reshape(n_steps, n_elem)


def flat(t, n_elem):
    if t.dim() == 0:
        return t.expand(n_elem)
    try:
        return t.view(n_elem)
    except RuntimeError:
        return t.reshape(n_elem)


def torch_forward(kernels, call):
    """The generated torch code on [T, N] views, in the compute dtype; results in the inputs' shape."""
    module, layout, shape, n_elem = kernels.module, kernels.layout, call.shape, call.n_elem
    n_steps, step_shape = shape[0], shape[1:]
    dtype = call.inputs[0].dtype
    compute = compute_dtype(dtype)
    xs = [rows(x, n_steps, n_elem).to(compute) for x in call.inputs]
    vs = [flat(v, n_elem).to(compute) for v in call.states]
    ws = [per_neuron(w, step_shape).to(compute) for w in call.learnable]
    hyper = [torch.full((), p, dtype=compute, device=xs[0].device) for p in call.hyper]  # (traceable: no lifted constant)
    chunk = layout.variant.chunk if call.save else 0
    outputs, finals, buffers = module.torch_forward(
        xs, vs, ws, hyper, call.state_seqs or bool(chunk), call.save and not chunk, dtype
    )
    if chunk:  # checkpoints: the states before steps chunk, 2 chunk, ... (in the compute dtype)
        rows_kept = n_checkpoints(n_steps, chunk)
        # Copies: an op's outputs may not alias each other.
        buffers = [f[chunk - 1::chunk][:rows_kept].reshape(rows_kept, *step_shape).clone() for f in finals]
        finals = finals if call.state_seqs else [f[-1].clone() for f in finals]
    final_shape = shape if call.state_seqs else step_shape
    return (
        [o.to(dtype).view(shape) for o in outputs]
        + [f.to(dtype).view(final_shape) for f in finals]
        + (buffers if chunk else [b.view(shape) if s.binary else b.to(dtype).view(shape)
                                  for b, s in zip(buffers, layout.buffers)])
    )


def torch_backward(kernels, call):
    module, layout, shape, n_elem = kernels.module, kernels.layout, call.shape, call.n_elem
    n_steps, step_shape = shape[0], shape[1:]
    like = call.grad_outputs[0]
    compute = compute_dtype(like.dtype)
    saved = [_saved_rows(s, t, n_steps, n_elem).to(compute) for s, t in zip(layout.saved, call.saved)]
    grad_outputs = [rows(g, n_steps, n_elem).to(compute) for g in call.grad_outputs]
    grad_states = [(rows(g, n_steps, n_elem) if call.state_seqs else flat(g, n_elem)).to(compute)
                   for g in call.grad_states]
    hyper = [torch.tensor(p, dtype=compute, device=like.device) for p in call.hyper]
    params = [per_neuron(w, step_shape).to(compute) for w in call.learnable]
    if layout.variant.recompute:
        results = _backward_by_chunks(module, layout, saved, grad_outputs, grad_states, params, hyper, call.state_seqs)
    else:
        results = module.torch_backward(saved, grad_outputs, grad_states, params, hyper, call.state_seqs)
    grad_inputs, grad_init, grad_learnable = results
    return (
        [g.to(like.dtype).view(shape) for g in grad_inputs]
        + [g.to(like.dtype).view(step_shape) for g in grad_init]
        + [reduce_to_param(g, w, step_shape).to(w.dtype) for g, w in zip(grad_learnable, call.learnable)]
    )


def _saved_rows(value, t, n_steps, n_elem):
    """A saved tensor as the torch loops read it: [T, N] per step, [N] for an initial state, rows of checkpoints."""
    if value.kind is Kind.STATE:
        return flat(t, n_elem)
    if value.kind is Kind.CHECKPOINT:
        return t.reshape(-1, n_elem)
    return rows(t, n_steps, n_elem)


def _backward_by_chunks(module, layout, saved, grad_outputs, grad_states, params, hyper, state_seqs):
    """The recompute backward in torch ops: chunks last to first, each re-run forward from its checkpoint.

    Runs the generated torch code on each chunk: its forward saves what the plain backward reads, its
    backward (with per-step state gradients) takes the gradient carried in from the chunk after it.
    """
    n_in, n_states, chunk = len(layout.inputs), len(layout.states), layout.variant.chunk
    xs, starts, checkpoints = saved[:n_in], saved[n_in:n_in + n_states], saved[n_in + n_states:]
    n_steps = grad_outputs[0].shape[0]
    like = grad_outputs[0][0]
    carried = [torch.zeros_like(like) if state_seqs else g for g in grad_states]
    grad_chunks, grad_learnable = [], [torch.zeros_like(like) for _ in params]
    for first in reversed(range(0, n_steps, chunk)):
        last = min(first + chunk, n_steps)
        states = starts if first == 0 else [c[first // chunk - 1] for c in checkpoints]
        chunk_xs = [x[first:last] for x in xs]
        outputs, _, buffers = module.torch_forward(chunk_xs, states, params, hyper, False, True, like.dtype)
        buffers = [b.to(like.dtype) for b in buffers]  # values kept in bytes, as the compute dtype again
        step_saved = pick_saved(layout.step_saved, {Kind.INPUT: chunk_xs, Kind.STATE: states, Kind.OUTPUT: outputs},
                                buffers)
        state_grads = []
        for g, c in zip(grad_states, carried):
            per_step = (g[first:last].clone() if state_seqs
                        else torch.zeros((last - first, *like.shape), dtype=like.dtype, device=like.device))
            per_step[-1] += c  # what the later chunks carried back into this chunk's last step
            state_grads.append(per_step)
        chunk_outputs = [g[first:last] for g in grad_outputs]
        grads, carried, learnable = module.torch_backward(step_saved, chunk_outputs, state_grads, params, hyper, True)
        grad_chunks.append(grads)
        grad_learnable = [a + b for a, b in zip(grad_learnable, learnable)]
    grad_inputs = [torch.cat([grads[i] for grads in reversed(grad_chunks)]) for i in range(n_in)]
    return grad_inputs, carried, grad_learnable
