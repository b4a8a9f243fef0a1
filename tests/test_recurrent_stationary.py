"""The fused recurrent kernels' stationary weight: for small batches each program keeps its slice of the weight in
registers for every step and sums the recurrent product on CUDA cores (`RecurrentConfig.stationary`)."""
import re

import pytest
import torch

import flexgen
from conftest import HAS_CUDA, INTERPRETER, TRITON_DEVICE
from flexgen.launch.bitpack import pack_spikes
from flexgen.launch.recurrent.fused import RecurrentConfig
from flexgen.launch.recurrent.tiling import config_of, config_values
from test_recurrent import (FP64_FUSED, FUSED_DTYPE, H100_SMS, assert_fused_on_gpu_follows_the_fp64_loop,
                            assert_matches_eager, make_inputs, make_layer, needs_triton)

STATIONARY = RecurrentConfig(stationary=True)
needs_fp64_fused = pytest.mark.skipif(
    not FP64_FUSED, reason="the fused kernels' float64 products need the interpreter or a GPU whose Triton takes "
                           "float64 tl.dot")


@pytest.mark.parametrize("dtype,hidden,batch,expected", [
    # (block_b, block, split, block_k, stages, stationary, row_by_row): tiles of at most 8 rows; the narrowest slices
    # that give each SM one program (at least 4 neurons), at most 64 KiB of the weight each; the product a batch row
    # at a time above 256 KiB
    (torch.float32, 256, 8, (8, 4, 64, 256, 1, True, False)),
    (torch.float32, 512, 8, (8, 4, 128, 512, 1, True, False)),
    (torch.float32, 1024, 8, (8, 8, 128, 1024, 1, True, False)),
    (torch.float32, 2048, 8, (8, 8, 256, 2048, 1, True, True)),  # 256 programs of 4 warps: two per SM
    (torch.float32, 2048, 4, (4, 8, 256, 2048, 1, True, False)),
    (torch.float32, 1000, 3, (4, 8, 128, 1024, 1, True, False)),  # padded rows and neurons
    (torch.float32, 2048, 1, (1, 8, 256, 2048, 1, True, True)),  # one row: a row at a time
    (torch.float32, 1024, 16, (8, 8, 128, 1024, 1, True, False)),  # two row tiles of 8: 256 programs at once
    (torch.float32, 2048, 12, (8, 8, 256, 2048, 1, True, True)),  # 512 programs in two waves (B 9-12 only)
    (torch.float32, 2048, 9, (8, 8, 256, 2048, 1, True, True)),
    (torch.float32, 300, 12, (8, 4, 128, 512, 1, True, False)),
    (torch.bfloat16, 1024, 4, (4, 8, 128, 1024, 1, True, False)),  # 16-bit: one program per SM
    (torch.float16, 256, 8, (8, 4, 64, 256, 1, True, False)),
])
def test_small_batches_keep_the_weight_stationary_by_default(dtype, hidden, batch, expected):
    config = RecurrentConfig()
    tiling = config.tiling(batch, hidden, dtype, H100_SMS)
    assert tiling == expected
    held = H100_SMS if dtype != torch.float32 else config.resident(tiling, H100_SMS) * (1 + (batch > 8))
    assert config.warps(tiling) == 4 and tiling.rows(batch) * tiling.split <= held
    assert tiling.block * tiling.block_k * 4 <= 64 * 1024
    assert config.constexprs(tiling)["STATIONARY_WEIGHT"] and config.constexprs(tiling)["ROW_BY_ROW"] == expected[6]


@pytest.mark.parametrize("config,dtype,hidden,batch,plain", [
    (RecurrentConfig(), torch.float32, 256, 17, True),  # more rows than 16
    (RecurrentConfig(), torch.float32, 2048, 16, True),  # 512 programs: two waves pay only up to B 12
    (RecurrentConfig(), torch.float32, 2048, 13, True),
    (RecurrentConfig(), torch.bfloat16, 2048, 8, True),  # 16-bit: 256 programs, two per SM
    (RecurrentConfig(), torch.bfloat16, 512, 9, True),  # 16-bit: more rows than 8
    (RecurrentConfig(), torch.float64, 1024, 8, True),
    (RecurrentConfig(), torch.float32, 128, 8, True),  # narrower than measured
    (RecurrentConfig(), torch.float32, 4096, 8, True),  # 64 KiB a program would take 1024 programs
    (RecurrentConfig(), torch.float32, 1024, 8, False),  # a delayed layer's kernels
    (RecurrentConfig(block_k=64), torch.float32, 1024, 8, True),  # settings of the sliced tiling
    (RecurrentConfig(split=16), torch.float32, 1024, 8, True),
    (RecurrentConfig(num_stages=2), torch.float32, 1024, 8, True),
    (RecurrentConfig(max_tile=1024), torch.float32, 1024, 8, True),
    (RecurrentConfig(stationary=False), torch.float32, 1024, 8, True),
])
def test_other_calls_take_the_weight_in_slices(config, dtype, hidden, batch, plain):
    tiling = config.tiling(batch, hidden, dtype, H100_SMS, plain)
    assert not isinstance(tiling, str) and not tiling.stationary and not tiling.row_by_row


def test_asked_for_it_keeps_the_weight_in_any_dtype_and_the_interpreter_runs_one_program():
    assert STATIONARY.tiling(300, 1024, torch.bfloat16, H100_SMS) == (8, 8, 128, 1024, 1, True, False)
    assert STATIONARY.tiling(8, 1024, torch.float64, H100_SMS) == (8, 8, 128, 1024, 1, True, True)
    assert RecurrentConfig(stationary=True, split=16).tiling(2, 256, torch.float32, H100_SMS) == \
        (2, 16, 16, 256, 1, True, False)
    assert STATIONARY.tiling(3, 37, torch.float64, None) == (4, 64, 1, 64, 1, True, False)
    assert STATIONARY.tiling(5, 100, torch.float64, None) == (8, 128, 1, 128, 1, True, True)


@pytest.mark.parametrize("config,hidden,plain,match", [
    (STATIONARY, 1024, False, "only the kernels of layers without delays keep the weight"),
    (RecurrentConfig(stationary=True, block_b=16), 1024, True, "chooses its own block_b and block_k"),
    (RecurrentConfig(stationary=True, split=3), 1024, True, "split=3 must be a power of two from 1 to 1024"),
    (RecurrentConfig(stationary=True, split=2), 1024, True, "keeps at most 64 KiB of the weight, and hidden=1024 "
                                                            "gives 4 KiB a neuron"),
    (STATIONARY, 32768, True, "keeps at most 64 KiB"),
    (STATIONARY, 8192, True, "hidden=8192 in slices of 2 takes 4096 programs in step with each other, and this GPU "
                             "holds 264 at once"),
])
def test_a_stationary_weight_that_cannot_run_says_why(config, hidden, plain, match):
    reason = config.tiling(4, hidden, torch.float32, H100_SMS, plain)
    assert isinstance(reason, str) and re.search(match, reason), reason
    assert "needs a GPU" in RecurrentConfig(stationary=True, split=2).tiling(3, 40, torch.float64, None)


@needs_triton
def test_a_delayed_layer_asked_to_keep_the_weight_refuses_the_fused_path():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=16, path="fused", config=STATIONARY, backend="triton",
                              delay=flexgen.Delay(16, max_delay=3)).to(TRITON_DEVICE)
    with pytest.raises(ValueError, match="only the kernels of layers without delays keep the weight"):
        layer(torch.rand(4, 2, 16, device=TRITON_DEVICE))


def test_custom_ops_get_the_stationary_setting_back():
    for stationary in (None, True, False):
        config = RecurrentConfig(stationary=stationary, split=4)
        assert config_of(config_values(config)) == config


@needs_fp64_fused
@pytest.mark.parametrize("name", ["LIF", "alif", "adaptive_mix"])
@pytest.mark.parametrize("shape", [(5, 3, 37), (4, 1, 20), (3, 5, 100)], ids=["tile", "one_row", "row_by_row"])
def test_a_stationary_weight_matches_the_eager_loop_in_float64(name, shape):
    """Spikes equal, states and gradients within 1e-12. On the interpreter (one program) the product is summed at
    once over all rows ([4, 64, 64]), over one row, and a row at a time (8 rows of 128 neurons); on a GPU the slices
    of 4 neurons wait for each other every step (16, 8 and 32 programs)."""
    assert_matches_eager(name, "triton", "fused", shape, config=STATIONARY)


@needs_triton
@pytest.mark.parametrize("batch,hidden", [(3, 37), (8, 300)], ids=["B3", "B8"])
def test_the_stationary_inference_kernel_matches_the_training_forward(batch, hidden):
    layer = make_layer("alif", "triton", "fused", hidden=hidden, dtype=FUSED_DTYPE, config=STATIONARY)
    x = make_inputs("alif", (4, batch, hidden), TRITON_DEVICE, seed=6)[0].to(FUSED_DTYPE)
    trained = layer(x)
    layer.reset()
    with torch.no_grad():
        inferred = layer(x)
    assert trained.sum() > 0 and not inferred.requires_grad and torch.equal(inferred, trained)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="slices of the hidden neurons wait for each other: GPU only")
@pytest.mark.parametrize("dtype,tol,hidden,batch", [
    (torch.float32, 1e-4, 300, 5), (torch.float32, 1e-4, 1024, 8), (torch.float32, 1e-4, 2048, 8),
    (torch.float32, 1e-4, 2048, 2), (torch.float32, 1e-4, 1024, 13), (torch.float32, 1e-4, 2048, 11),
    (torch.bfloat16, 3e-2, 1024, 4),
    (torch.bfloat16, 3e-2, 512, 1)])
def test_a_stationary_weight_on_the_gpu_follows_the_fp64_loop(dtype, tol, hidden, batch):
    """The default for small batches: summed at once (H 300, 1024; B 2), a row at a time (B 8, H 2048; B 1), two
    row tiles (B 13), two row tiles in two waves (B 11, H 2048), 16-bit I/O."""
    config = RecurrentConfig()
    from flexgen.launch.recurrent.fused import resident_programs
    assert config.tiling(batch, hidden, dtype, resident_programs(torch.device("cuda"))).stationary
    # (seed 3 puts a neuron of H 2048, B 8 within fp32's rounding of its threshold at step 10: one spike flips there
    # in both tilings, the weight in slices too)
    assert_fused_on_gpu_follows_the_fp64_loop(dtype, tol, (12, batch, hidden), config, seed=1)


@needs_triton
@pytest.mark.parametrize("batch,hidden", [(3, 37), (5, 100), (1, 20)] if INTERPRETER else
                         [(8, 1024), (8, 2048), (1, 512)], ids=["tile", "row_by_row", "one_row"])
def test_a_replay_reproduces_the_stationary_forward_bit_for_bit(batch, hidden):
    """The long-sequence mode's replay of a segment sums each step's product as the forward did, so the neuron's
    steps give the spikes it was given back (or the segment would run again)."""
    torch.manual_seed(4)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True, backend="triton", config=STATIONARY)
    layer = layer.to(TRITON_DEVICE, torch.float32)
    x = torch.rand(9, batch, hidden, device=TRITON_DEVICE) * 3.0
    with torch.no_grad():
        given = layer(x)
    layer.reset()
    checks = []
    with layer.replaying(pack_spikes(given), checks):
        out = layer(x.requires_grad_())
    assert 0 < given.sum() < given.numel() and [bool(c) for c in checks] == [True] and torch.equal(out, given)
