"""A fused call without autograd that continues from the layer's kept output takes the product of that output
inside the kernels (`rec_previous`, `rec_previous_given`), as it takes every later step's: no host product before the
launch, and calls one step (or chunk) at a time give what one call over all the steps gives, bit for bit. Other
calls add the product to the first step's input before the kernels, as before."""
import pytest
import torch

import flexgen
from conftest import HAS_CUDA, INTERPRETER, TRITON_DEVICE, count_calls
from flexgen.launch.recurrent.fused import RecurrentConfig
from test_recurrent import make_inputs, make_layer, needs_triton

pytestmark = needs_triton
DTYPES = [torch.float32, torch.float64]


def layer_and_input(name, dtype, steps=6, batch=3, hidden=8, config=None, device=TRITON_DEVICE, path="fused"):
    layer = make_layer(name, "triton", path, hidden, dtype=dtype, config=config).to(device)
    x = [v.detach().to(device, dtype) for v in make_inputs(name, (steps, batch, hidden), "cpu", seed=5)]
    return layer, x


def whole_and_split(layer, x, sizes):
    """(outputs and final states of one call over every step, the same of calls over `sizes` steps each)."""
    with torch.no_grad():
        layer.reset()
        whole = [layer(*x), *[v.clone() for v in layer.final_states.values()]]
        layer.reset()
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        parts = [layer(*[v[a:a + n] for v in x]) for a, n in zip(starts, sizes)]
        split = [torch.cat(parts), *layer.final_states.values()]
    return whole, split


def products_on_the_host(monkeypatch):
    """A list that grows by one for each `torch.addmm` (the host's product of a previous output)."""
    return count_calls(monkeypatch, torch, "addmm")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["LIF", "alif", "current_lif"])
@pytest.mark.parametrize("sizes", [[1] * 6, [2, 3, 1]], ids=["one_step_a_call", "chunks"])
def test_calls_that_continue_equal_one_call_bit_for_bit(monkeypatch, dtype, name, sizes):
    """Before, the first step's product was the host's (cuBLAS or the CPU's, another sum order), and on a GPU a
    one-step call ran a kernel Triton had specialised for n_steps == 1: fp32 states then differed from one call's in
    their last bits."""
    layer, x = layer_and_input(name, dtype)
    host = products_on_the_host(monkeypatch)
    whole, split = whole_and_split(layer, x, sizes)
    assert whole[0].sum() > 0 and whole[0].sum() < whole[0].numel()
    for a, b in zip(whole, split):
        assert torch.equal(a, b)
    assert host == []
    assert any(c.reads_previous for c in layer._known_calls.values())


def test_one_step_a_call_streams_without_a_host_product(monkeypatch):
    layer, (x,) = layer_and_input("LIF", torch.float32)
    layer.step_mode = "s"
    host = products_on_the_host(monkeypatch)
    with torch.no_grad():
        stream = torch.stack([layer(step) for step in x])
        layer.reset()
        layer.step_mode = "m"
        whole = layer(x)
    assert host == [] and torch.equal(stream, whole)


def test_training_calls_keep_the_product_on_the_host(monkeypatch):
    """With autograd the first step's product is the `addmm`'s, whose backward carries the gradient into the
    calls before."""
    layer, (x,) = layer_and_input("alif", torch.float64)
    x.requires_grad_()
    host = products_on_the_host(monkeypatch)
    out = torch.cat([layer(x[:3]), layer(x[3:])])
    grads = torch.autograd.grad(out.sum() + layer.final_states["v"].sum(), [x, layer.weight])
    layer.reset()
    whole = layer(x)
    want = torch.autograd.grad(whole.sum() + layer.final_states["v"].sum(), [x, layer.weight])
    assert len(host) == 1 and torch.equal(out, whole)
    for got, ref in zip(grads, want):
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12 * ref.abs().max().item())


@pytest.mark.parametrize("given", ["values", "kept_clone"])
def test_a_given_previous_output_is_added_on_the_host(monkeypatch, given):
    """Only the layer's own kept output (0 or 1 where the output is a spike) goes to the kernels; any other
    previous output, even equal to it, is added to the first step's input before: the product of spikes in the
    kernels relies on zeros and ones."""
    layer, (x,) = layer_and_input("LIF", torch.float64)
    with torch.no_grad():
        layer(x[:3])
        states = [v.clone() for v in layer.final_states.values()]
        previous = torch.full_like(layer.final_output, 0.5) if given == "values" else layer.final_output.clone()
        host = products_on_the_host(monkeypatch)
        got = layer(x[3:], states=states, previous_output=previous)
        n_host = len(host)
        reference = make_layer("LIF", "torch", "stepwise", 8, dtype=torch.float64)
        want = reference(x[3:].cpu(), states=[v.cpu() for v in states], previous_output=previous.cpu())
    assert n_host == 1 and torch.equal(got.cpu(), want)


def test_a_kept_output_of_another_dtype_is_cast_and_added_on_the_host(monkeypatch):
    """A float32 call, then a float64 one continuing from its output."""
    layer, (x,) = layer_and_input("LIF", torch.float64)
    with torch.no_grad():
        layer(x[:3].float())
        kept = layer.final_output
        host = products_on_the_host(monkeypatch)
        got = layer(x[3:])
        layer.reset()
        layer(x[:3].float())
        want = layer(x[3:], states=list(layer.final_states.values()), previous_output=kept.double())
    assert kept.dtype == torch.float32 and len(host) == 2
    assert got.dtype == torch.float64 and torch.equal(got, want) and 0 < got.sum() < got.numel()


def test_a_call_of_no_steps_keeps_the_output_the_next_call_continues_from():
    """(path "auto": the fused path refuses empty inputs.)"""
    layer, (x,) = layer_and_input("LIF", torch.float64, path="auto")
    whole, _ = whole_and_split(layer, [x], [6])
    with torch.no_grad():
        layer.reset()
        first = layer(x[:2])
        kept = layer.final_output.clone()
        empty = layer(x[2:2])
        after_empty = layer.final_output
        rest = layer(x[2:])
    assert empty.shape == (0, 3, 8) and torch.equal(after_empty, kept)
    assert torch.equal(torch.cat([first, rest]), whole[0])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="the GPU's tilings (slices in step, 64-row tiles)")
@pytest.mark.parametrize("hidden,batch", [(1024, 32), (256, 256), (2048, 8), (300, 17)])
def test_a_stream_on_the_gpu_equals_one_call_bit_for_bit(hidden, batch):
    """Slices of the hidden neurons in step, 64-row tiles, the stationary weight (B 8), a width that is not a power
    of two; fp32 (16-bit calls keep their states in 16 bits between calls: see the test below)."""
    torch.manual_seed(7)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True, path="fused").to("cuda")
    with torch.no_grad():
        layer.weight.mul_(4.0)
    x = torch.rand(12, batch, hidden, device="cuda") * 1.5
    whole, split = whole_and_split(layer, [x], [1] * 5 + [4, 3])
    assert 0 < whole[0].mean() < 1
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="the GPU's tilings (slices in step, 64-row tiles)")
@pytest.mark.parametrize("dtype,hidden,batch", [(torch.bfloat16, 1024, 32), (torch.bfloat16, 256, 256),
                                                (torch.bfloat16, 512, 4), (torch.float16, 300, 17)])
def test_a_16_bit_call_continues_from_the_kept_output_as_the_fp64_step_does(dtype, hidden, batch):
    """A 16-bit call's first step from the kept states and output (stored in 16 bits), against the same step in
    fp64 from those values: the product summed in fp32 inside the kernels, the new membrane stored in 16 bits."""
    torch.manual_seed(8)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True, path="fused").to("cuda", dtype)
    with torch.no_grad():
        layer.weight.mul_(4.0)
        x = (torch.rand(4, batch, hidden, device="cuda") * 1.5).to(dtype)
        layer(x[:3])
        v, s = layer.final_states["v"].double(), layer.final_output.double()
        out = layer(x[3:])[0].double()
    w, b = layer.weight.double(), layer.bias.double()
    h = v + (x[3].double() + s @ w.t() + b - v) / 2.0
    clear = (h - 1.0).abs() > 1e-2  # not within 16-bit rounding of the threshold
    assert 0 < s.mean() < 1 and clear.float().mean() > 0.9
    assert torch.equal(out[clear], (h >= 1.0).double()[clear])
    want = h * (1.0 - out)
    assert torch.allclose(layer.final_states["v"].double()[clear], want[clear], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("config", [RecurrentConfig(stationary=True), RecurrentConfig(block_b=32, block_k=16)],
                         ids=["stationary", "block"])
def test_other_tilings_read_the_previous_output_alike(config):
    """The stationary weight's product (on CUDA cores) and other tiles of `tl.dot`."""
    layer, (x,) = layer_and_input("LIF", torch.float32, config=config)
    whole, split = whole_and_split(layer, [x], [1, 2, 3])
    assert whole[0].sum() > 0
    for a, b in zip(whole, split):
        assert torch.equal(a, b)


@pytest.mark.skipif(not INTERPRETER, reason="the dry run is the interpreter's (TRITON_INTERPRET=1)")
def test_stream_benchmark_dry_run(tmp_path):
    """benchmarks/bench_recurrent_stream.py runs end to end at tiny sizes on the CPU, its flexgen spikes the same
    as the torch step's, and redraws its table from its record."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    script = str(root / "benchmarks" / "bench_recurrent_stream.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(flexgen.__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, script, "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "bench_recurrent_stream.json").read_text())["results"]
    assert (row["dtype"], row["hidden"], row["batch"]) == ("fp32", 16, 2) and row["us_per_call"]["flexgen"] > 0
    assert row["spikes_differ"]["torch eager"] == 0 and 0 < row["spike_rate"] < 1
    redrawn = tmp_path / "redrawn"
    proc = subprocess.run([sys.executable, script, "--replot", str(tmp_path / "bench_recurrent_stream.json"), "--out",
                           str(redrawn)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (redrawn / "bench_recurrent_stream.md").read_text() == (tmp_path / "bench_recurrent_stream.md").read_text()


@pytest.mark.parametrize("grad", [False, True])
def test_a_bad_previous_output_gets_the_checks_errors_on_the_fused_path(grad):
    """(Frozen parameters: under autograd no other tensor of the call asks for gradients.)"""
    layer, (x,) = layer_and_input("LIF", torch.float64)
    layer.requires_grad_(False)
    with torch.set_grad_enabled(grad):
        with pytest.raises(ValueError, match=r"previous_output must broadcast to \[B, 8\] = \[3, 8\], got \[2, 8\]"):
            layer(x, previous_output=torch.zeros(2, 8, dtype=torch.float64, device=TRITON_DEVICE))
        with pytest.raises(TypeError, match="previous_output must be a tensor"):
            layer(x, previous_output=[0.0] * 8)
