"""More than 2**31 elements: kernel offsets are 64-bit (GPU only: ~32 GB of fp32 tensors)."""
import pytest
import torch

from specs import lif


@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True])
def test_beyond_2_pow_31_elements(recompute):
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip("needs about 40 GB of free GPU memory")
    T, N = 2, 2**30 + 8  # T * N > 2**31: int32 offsets would wrap in the second step
    x = torch.empty(T, N, device="cuda").uniform_(0.0, 2.5).requires_grad_()
    (s,), _ = lif.apply(x, backend="triton", recompute=recompute)
    s.sum().backward()
    for cols in (slice(0, 4096), slice(N - 4096, N)):
        x_part = x.detach()[:, cols].clone().requires_grad_()
        (s_ref,), _ = lif.apply(x_part, backend="torch")
        s_ref.sum().backward()
        assert torch.equal(s[:, cols], s_ref)
        torch.testing.assert_close(x.grad[:, cols], x_part.grad, rtol=1e-6, atol=1e-6)
