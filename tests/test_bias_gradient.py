"""A bias's gradient, the sum of the current's gradient over steps and batch rows (`summed_over_steps_and_rows`):
accumulated wide, rounded once, and without the staging buffer of torch's CUDA sum over both dimensions at once
(twice the values, up to 132 MiB), which raised the fused recurrent backward's peak memory by 125 MiB at B 32,
T 1000, H 512."""
import pytest
import torch

import flexgen
from conftest import cuda_peak_bytes
from flexgen.launch.abi import summed_over_steps_and_rows


def test_the_sum_over_steps_and_rows_in_float64_is_the_plain_sum():
    values = torch.randn(37, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    summed = summed_over_steps_and_rows(values)
    assert summed.shape == (11,) and summed.dtype == torch.float64
    torch.testing.assert_close(summed, values.sum(dim=(0, 1)), rtol=1e-12, atol=0)


def test_16_bit_values_are_summed_in_float32_and_rounded_once():
    # 257 ones per row: 257 is not a bf16 value (256, 258). Three rows make 771, whose nearest bf16 is 772;
    # rounding each row's sum first would give 3 x 256 = 768.
    values = torch.ones(257, 3, 1, dtype=torch.bfloat16)
    summed = summed_over_steps_and_rows(values)
    assert summed.dtype == torch.bfloat16
    assert summed.item() == 772.0
    assert summed_over_steps_and_rows(values, torch.float32).item() == 771.0


def test_a_float64_result_from_float32_values_is_summed_in_float64():
    values = torch.tensor([2.0 ** 30, 1.0, -(2.0 ** 30)], dtype=torch.float32).reshape(3, 1, 1)
    # a float32 running sum loses the 1 (2^30 + 1 has 31 significant bits; float32 keeps 24)
    assert summed_over_steps_and_rows(values).item() == 0.0
    assert summed_over_steps_and_rows(values, torch.float64).item() == 1.0


@pytest.mark.gpu
def test_the_fused_recurrent_backward_keeps_no_sum_buffer():
    """The layer's training step holds its output, its saved membrane and the input's gradient ([T, B, H] each);
    with torch's sum over (0, 1) for the bias gradient it also held a 125 MiB buffer (an H100 probe, docs/perf/h100/bias_gradient_workspace_2026-11-27.log)."""
    steps, batch, hidden = 1000, 32, 512
    layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True, path="fused").to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.rand(steps, batch, hidden, device="cuda", generator=g) * 0.6).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(steps, batch, hidden, device="cuda", generator=g).to(torch.bfloat16)
    layer(x).backward(grad)  # the first call compiles and keeps its launch plans
    layer.reset()
    x.grad = None
    sequence = steps * batch * hidden * x.element_size()
    assert cuda_peak_bytes(lambda: layer(x).backward(grad)) < 3 * sequence + 16 * 2 ** 20
