"""Half-precision training against float64: what saving values in the I/O dtype costs (benchmarks/accuracy.py
measures the same at full size)."""
import pytest
import torch

from conftest import device_backends
from specs import lif

T, NEURONS = 16, 2000


def spikes_and_grad(x, weight, **options):
    x = x.detach().clone().requires_grad_()
    (s,), _ = lif.apply(x, **options)
    (grad,) = torch.autograd.grad((s.to(weight.dtype) * weight).sum(), [x])
    return s, grad


def relative_error(grad, ref):
    return ((grad.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype,plain_bound,recompute_bound", [(torch.float16, 1e-2, 1e-3), (torch.bfloat16, 3e-2, 1e-2)])
def test_half_precision_gradients_against_float64(device, backend, dtype, plain_bound, recompute_bound):
    """Arithmetic runs in fp32 for half inputs; the plain design saves h rounded to the I/O dtype, so its
    backward sees a slightly different h (and, where rounding moved h across the threshold, the other
    branch of the reset). The recompute design keeps h in fp32: only the gradient's own rounding is left."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(T, NEURONS, generator=g) * 1.5 + 0.8).to(dtype).to(device)
    weight = torch.randn(T, NEURONS, generator=g).to(dtype).to(device)
    s_ref, grad_ref = spikes_and_grad(x.double(), weight.double(), backend="eager")
    s_plain, grad_plain = spikes_and_grad(x, weight.float(), backend=backend, recompute=False)
    s_recomputed, grad_recomputed = spikes_and_grad(x, weight.float(), backend=backend, recompute=True)
    assert s_plain.dtype == dtype and grad_plain.dtype == dtype
    assert torch.equal(s_plain.double(), s_ref) and torch.equal(s_recomputed, s_plain)
    plain, recomputed = relative_error(grad_plain, grad_ref), relative_error(grad_recomputed, grad_ref)
    assert plain < plain_bound and recomputed < recompute_bound
    if dtype == torch.float16:  # in bf16 the gradient's own rounding is of the same size as what h's adds
        assert recomputed < plain / 5


@pytest.mark.parametrize("device,backend", device_backends())
def test_saved_values_are_in_the_io_dtype(device, backend):
    x = torch.randn(T, 3, dtype=torch.float16, device=device, requires_grad=True)
    (s,), _ = lif.apply(x, backend=backend, recompute=False)
    per_step = [t for t in s.grad_fn.saved_tensors if t.dim() and t.shape[0] == T]
    assert [t.dtype for t in per_step] == [torch.float16]
