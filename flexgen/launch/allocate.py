"""What a call allocates: outputs, final states, saved buffers or checkpoints, gradients."""
import torch

from .config import compute_dtype, numel


def n_checkpoints(n_steps, chunk):
    """Rows of states the recompute forward writes: one before every chunk of `chunk` steps but the first."""
    return max(0, -(-n_steps // chunk) - 1)


# The dtype of a saved value that is 0 or 1 at every step (`SavedValue.binary`): a byte, not a float.
BINARY = torch.uint8


def buffer_shapes_dtypes(layout, shape, dtype):
    """(shape, dtype) of each buffer the training forward writes.

    Saved values: one per step, in the I/O dtype, or in bytes where they are 0
    or 1. Checkpoints (recompute): a few rows of states in the compute dtype, so
    the backward's re-run of the forward steps gives what the forward computed,
    bit for bit.
    """
    chunk = layout.variant.chunk
    if chunk:
        return [((n_checkpoints(shape[0], chunk), *shape[1:]), compute_dtype(dtype)) for _ in layout.buffers]
    return [(tuple(shape), BINARY if b.binary else dtype) for b in layout.buffers]


def buffers(layout, shape, dtype, device):
    return [torch.empty(s, dtype=dt, device=device) for s, dt in buffer_shapes_dtypes(layout, shape, dtype)]


def forward_results(layout, shape, dtype, device, state_dtypes, state_seqs, save):
    """(outputs, final states or their sequences, buffers) of a forward."""
    outputs = [torch.empty(shape, dtype=dtype, device=device) for _ in layout.outputs]
    finals = [torch.empty(shape if state_seqs else shape[1:], dtype=dt, device=device) for dt in state_dtypes]
    return outputs, finals, buffers(layout, shape, dtype, device) if save else []


def backward_results(layout, shape, dtype, device, state_dtypes, n_learnable, grad_init):
    """(input gradients, initial states' gradients or None, per-neuron partial sums of the parameters' gradients);
    without `grad_init` a held line's gradient rows are not written: the first input gradient fills their slot."""
    grad_inputs = [torch.empty(shape, dtype=dtype, device=device) for _ in layout.inputs]
    grad_prev = [torch.empty(shape[1:], dtype=dt, device=device) for dt in state_dtypes] if grad_init else None
    n_summed = n_learnable - layout.tapped - layout.held
    partials = [torch.empty((numel(shape[1:]),), dtype=compute_dtype(dtype), device=device) for _ in range(n_summed)]
    partials += line_rows(layout, shape[0], numel(shape[1:]), compute_dtype(dtype), device, held_grad=grad_init)
    if layout.held and not grad_init:  # a slot the kernel does not write without GRAD_INIT
        partials.append(grad_inputs[0])
    return grad_inputs, grad_prev, partials


def line_rows(layout, n_steps, n_elem, dtype, device, held_grad=True):
    """The delay line's rows after the partial sums: a tapped line's (`tapped_rows`), then, with `held_grad`, a
    held line's gradient [max_delay, N]."""
    made = tapped_rows(layout, n_steps, n_elem, dtype, device) if layout.tapped else []
    if layout.held and held_grad:
        made.append(torch.empty((layout.max_delay, n_elem), dtype=dtype, device=device))
    return made


def tapped_rows(layout, n_steps, n_elem, dtype, device):
    """A tapped line's backward rows: every step's gradient of the delayed value [T, N], then the taps' sums per
    tap and neuron [K, N]."""
    return [torch.empty((rows, n_elem), dtype=dtype, device=device) for rows in (n_steps, layout.max_delay + 1)]


def empty_forward(layout, call):
    """T = 0 or no neurons: empty outputs; states pass through unchanged."""
    like, shape = call.inputs[0], call.shape
    outputs = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in layout.outputs]
    finals = [
        torch.empty(shape, dtype=v.dtype, device=v.device) if call.state_seqs else v.expand(shape[1:]).clone()
        for v in call.states
    ]
    saved = buffers(layout, shape, like.dtype, like.device) if call.save else []
    return outputs + finals + saved
