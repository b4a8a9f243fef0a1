"""Fake kernels of a neuron layer's custom ops: tensors of the shapes and dtypes the real ops return, without
running them. torch.compile and torch.export trace the ops through these; shaped by the call alone (no loop over
T), they keep the number of steps a symbol where export asks for it (`torch.export.Dim`)."""

from ..allocate import buffer_shapes_dtypes
from ..config import compute_dtype


def fake_forward(layout, saved_in_compute, real):
    """The forward op's fake kernel for the layout `layout`. Off Triton it allocates what the CPU paths return:
    outputs and final states in the I/O dtype, saved buffers in the I/O dtype (the torch path) or in the compute
    dtype (`saved_in_compute`: the C target), bytes for binary values; with Triton it runs `real` itself (which
    launches nothing on fake tensors)."""

    def forward(inputs, states, learnable, hyper, state_seqs, save, use_triton):
        if use_triton:
            return real(inputs, states, learnable, hyper, state_seqs, save, use_triton)
        like = inputs[0]
        shape, dtype = tuple(like.shape), like.dtype
        new = lambda s, dt=dtype: like.new_empty(s, dtype=dt)  # noqa: E731
        outputs = [new(shape) for _ in layout.outputs]
        finals = [new(shape if state_seqs else shape[1:]) for _ in layout.states]
        saved_dtype = compute_dtype(dtype) if saved_in_compute else dtype
        saved = [new(s, dt) for s, dt in buffer_shapes_dtypes(layout, shape, saved_dtype)] if save else []
        return outputs + finals + saved

    return forward


def fake_backward(layout, real):
    """The backward op's fake kernel: off Triton, what the CPU paths return (the inputs' gradients in the I/O
    dtype, the initial states' gradients, one gradient per learnable value in its shape and dtype); with Triton,
    `real` itself."""

    def backward(saved, grad_outputs, grad_states, learnable, hyper, state_seqs, use_triton, grad_init):
        if use_triton:
            return real(saved, grad_outputs, grad_states, learnable, hyper, state_seqs, use_triton, grad_init)
        like = grad_outputs[0]
        shape = tuple(like.shape)
        grad_inputs = [like.new_empty(shape) for _ in layout.grad_inputs]
        grad_prev = [like.new_empty(shape[1:]) for _ in layout.carried]
        return grad_inputs + grad_prev + [w.new_empty(w.shape) for w in learnable]

    return backward


def unsaved_backward(ctx, grads):
    raise RuntimeError(
        "flexgen: a backward reached a neuron call that ran without keeping what its backward needs: the call was "
        "recorded under torch.no_grad() or torch.inference_mode() (an exported program traced there, for "
        "instance). Export or trace the model with gradients enabled to train through the result, or run it "
        "under torch.no_grad()")



