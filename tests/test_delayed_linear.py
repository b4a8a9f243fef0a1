"""flexgen.DelayedLinear's Triton backends, the two-tap kernels ("fused", flexgen.launch.delay.fused) and the
products per tap ("taps", flexgen.launch.delay.taps), against its convolution and against the `dcls` package's
Dcls1d: values and every gradient, in float64 at 1e-12 (Triton's interpreter on the CPU, the GPU where there is
one)."""
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import flexgen
from conftest import HAS_CUDA, INTERPRETER, TRITON_DEVICE, max_rel_err

ROOT = pathlib.Path(__file__).resolve().parent.parent
needs_triton = pytest.mark.skipif(not (HAS_CUDA or INTERPRETER), reason="needs a CUDA GPU or TRITON_INTERPRET=1")


def pair(n_in, n_out, max_delay, delay, bias=True, dtype=torch.float64, device="cpu", backend="fused",
         interpolation="linear"):
    """The same synapses twice: through the convolution and through `backend`."""
    options = dict(bias=bias, delay=delay, dtype=dtype, interpolation=interpolation, sigma=1.3)
    conv = flexgen.DelayedLinear(n_in, n_out, max_delay, backend="conv", **options)
    fused = flexgen.DelayedLinear(n_in, n_out, max_delay, backend=backend, **options)
    fused.load_state_dict(conv.state_dict())
    return conv.to(device), fused.to(device)


def run(layer, x, grad):
    """The output and the gradients of x, weight, delay and bias (None for a missing bias)."""
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    wanted = [x, layer.weight, layer.delay] + ([layer.bias] if layer.bias is not None else [])
    grads = torch.autograd.grad(y, wanted, grad)
    return [y.detach(), *grads] + ([] if layer.bias is not None else [None])


def assert_same(got, want, tol, names=("output", "grad x", "grad weight", "grad delay", "grad bias")):
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None, name
            continue
        err = max_rel_err(a.cpu().double(), b.cpu().double())
        assert err <= tol, f"{name}: {err:.3g}"


def synapse_delays(kind, n_out, n_in, max_delay, generator):
    if kind == "fractional":
        return torch.rand(n_out, n_in, generator=generator, dtype=torch.float64) * max_delay
    if kind == "whole":
        return torch.randint(0, max_delay + 1, (n_out, n_in), generator=generator).double()
    if kind == "bounds":  # 0 and max_delay exactly, the rest between
        return torch.tensor([0.0, float(max_delay)], dtype=torch.float64).repeat(n_out, (n_in + 1) // 2)[:, :n_in]
    if kind == "outside":  # learnable delays that left the range: used at the nearest bound
        inside = torch.rand(n_out, n_in, generator=generator, dtype=torch.float64) * max_delay
        far = torch.tensor([-2.5, -0.25, max_delay + 0.5, max_delay + 3.75], dtype=torch.float64)
        return torch.where(torch.rand(n_out, n_in, generator=generator) < 0.5, far.repeat(n_out * n_in)[:n_out * n_in]
                           .reshape(n_out, n_in), inside)
    raise ValueError(kind)


CASES = {  # name: (T, B, in, out, max_delay, delays, bias)
    "fractional": (9, 3, 5, 4, 4, "fractional", True),
    "whole": (8, 2, 6, 3, 5, "whole", True),
    "bounds": (7, 2, 4, 3, 3, "bounds", True),
    "outside": (8, 2, 5, 4, 4, "outside", True),
    "max_delay past T": (5, 2, 3, 4, 9, "fractional", True),
    "batch 1": (10, 1, 4, 3, 6, "fractional", True),
    "no bias": (6, 3, 4, 5, 3, "fractional", False),
    "max_delay 0": (6, 2, 3, 2, 0, "whole", True),
    "rows past one tile": (40, 5, 18, 20, 3, "fractional", True),
}


BACKENDS = [("fused", "linear"), ("taps", "linear"), ("taps", "gaussian")]


@needs_triton
@pytest.mark.parametrize("backend,interpolation", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_triton_backends_equal_the_convolution_in_float64(case, backend, interpolation):
    steps, batch, n_in, n_out, max_delay, kind, bias = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    delays = synapse_delays(kind, n_out, n_in, max_delay, g)
    conv, fused = pair(n_in, n_out, max_delay, delays, bias=bias, device=TRITON_DEVICE, backend=backend,
                       interpolation=interpolation)
    x = torch.randn(steps, batch, n_in, generator=g, dtype=torch.float64).to(TRITON_DEVICE)
    grad = torch.randn(steps, batch, n_out, generator=g, dtype=torch.float64).to(TRITON_DEVICE)
    want, got = run(conv, x, grad), run(fused, x, grad)
    assert_same(got, want, 1e-12)
    if max_delay > 0 or interpolation == "linear":  # one gaussian tap is 1 whatever the delay
        assert got[3].abs().max() > 0  # the delays' gradient is not trivially zero


TAP_DELAYS = torch.tensor([[0.0, 0.4, 0.5, 2.0, 2.5], [3.0, -1.0, 7.5, 1.999, 0.25], [1.5, 2.75, 0.5, 3.0, 0.0]],
                          dtype=torch.float64)  # whole, halves, both bounds, outside the range (max_delay 3)


def reference_tap_matrices(weight, delay, max_delay, interpolation, sigma):
    """weight times the torch taps of `_Delays.taps`, [max_delay + 1, out, in], differentiable in both (the
    delays clamped, their gradient passing straight through)."""
    from flexgen.layers.delay_taps import gaussian_taps, linear_taps

    clamped = delay + (delay.clamp(0.0, float(max_delay)) - delay).detach()
    taps = linear_taps(clamped, max_delay) if interpolation == "linear" else gaussian_taps(clamped, max_delay, sigma)
    return (weight.unsqueeze(-1) * taps).permute(2, 0, 1)


@needs_triton
@pytest.mark.parametrize("interpolation,sigma", [("linear", 1.0), ("gaussian", 1.3), ("gaussian", 0.05),
                                                 ("gaussian", 40.0)])
@pytest.mark.parametrize("transposed", [False, True])
def test_tap_matrices_equal_the_torch_taps_in_float64(interpolation, sigma, transposed):
    """The kernel's tap matrices, in both layouts, zero-padded to 16 columns; sigma 1.3 and 0.05 are not fp32
    numbers (the kernel gets 1 / (2 sigma^2) in two fp32 halves) and 0.05 puts the far taps at exp(-1800)."""
    from flexgen.launch.delay.tap_matrices import tap_matrices

    weight = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = reference_tap_matrices(weight, TAP_DELAYS, 3, interpolation, sigma).detach()
    got = tap_matrices(weight.to(TRITON_DEVICE), TAP_DELAYS.to(TRITON_DEVICE), 3, interpolation == "gaussian",
                       sigma, transposed=transposed).cpu()
    if transposed:
        want = want.transpose(1, 2)
    assert got.shape == (4, want.shape[1], 16) and got.dtype == torch.float64
    assert max_rel_err(got[..., :want.shape[2]], want) <= 1e-12
    assert not got[..., want.shape[2]:].any()


@needs_triton
@pytest.mark.parametrize("interpolation,sigma", [("linear", 1.0), ("gaussian", 1.3), ("gaussian", 0.05)])
def test_tap_matrices_gradient_equals_autograd_in_float64(interpolation, sigma):
    """The weight's and delays' gradients of the taps' gradient, against autograd through the torch taps (the
    delays outside the range get theirs as if unclamped)."""
    from flexgen.launch.delay.tap_matrices import tap_matrices_gradient

    g = torch.Generator().manual_seed(2)
    weight = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    delay = TAP_DELAYS.clone().requires_grad_()
    grad_taps = torch.randn(4, 3, 5, generator=g, dtype=torch.float64)
    taps = reference_tap_matrices(weight, delay, 3, interpolation, sigma)
    want = torch.autograd.grad(taps, [weight, delay], grad_taps)
    got = tap_matrices_gradient(grad_taps.to(TRITON_DEVICE), weight.detach().to(TRITON_DEVICE),
                                TAP_DELAYS.to(TRITON_DEVICE), 3, interpolation == "gaussian", sigma)
    for name, a, b in zip(("weight", "delay"), got, want):
        assert max_rel_err(a.cpu(), b) <= 1e-12, name
    assert want[1].abs().min() > 0 if interpolation == "gaussian" else want[1].abs().max() > 0


@needs_triton
def test_tap_matrices_take_the_promoted_dtype():
    from flexgen.launch.delay.tap_matrices import tap_matrices, tap_matrices_gradient

    weight = torch.randn(2, 3, dtype=torch.float32, device=TRITON_DEVICE)
    delay = torch.rand(2, 3, dtype=torch.float64, device=TRITON_DEVICE) * 2
    taps = tap_matrices(weight, delay, 2, True, 0.7)
    assert taps.dtype == torch.float64 and taps.shape == (3, 2, 16)
    grad_weight, grad_delay = tap_matrices_gradient(taps[..., :3].contiguous(), weight, delay, 2, True, 0.7)
    assert (grad_weight.dtype, grad_delay.dtype) == (torch.float32, torch.float64)


OP_BACKENDS = [("fused", False), ("taps", False), ("taps", True)]  # (backend, gaussian taps)


def backend_module(backend):
    from flexgen.launch.delay import taps as delay_taps
    from flexgen.launch.delay import fused as delayed_linear

    return delayed_linear if backend == "fused" else delay_taps


@needs_triton
@pytest.mark.parametrize("backend,gaussian", OP_BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("wanted", ["all", "weight only"])
def test_the_custom_ops_equal_the_eager_function(backend, gaussian, bias, wanted):
    """What torch.compile runs (the backend's forward op, whose autograd formula calls its two gradient ops)
    gives the eager function's values and gradients, also where only some inputs need one."""
    module = backend_module(backend)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 2, 5, generator=g, dtype=torch.float64).to(TRITON_DEVICE)
    weight = torch.randn(3, 5, generator=g, dtype=torch.float64).to(TRITON_DEVICE)
    delay = synapse_delays("outside", 3, 5, 3, g).to(TRITON_DEVICE)
    bias_value = torch.randn(3, generator=g, dtype=torch.float64).to(TRITON_DEVICE) if bias else None
    leaves = [weight] if wanted == "weight only" else [x, weight, delay] + ([bias_value] if bias else [])
    for leaf in leaves:
        leaf.requires_grad_()
    grad = torch.randn(7, 2, 3, generator=g, dtype=torch.float64).to(TRITON_DEVICE)
    options = module.TapOptions(3, gaussian, 0.8)
    eager = module.run(module.BACKEND, module.OPS, x, weight, delay, bias_value, options, module.DEFAULT)
    op = module.OPS.forward(x, weight, delay, bias_value, 3, gaussian, 0.8)
    assert max_rel_err(op, eager) <= 1e-12
    for a, b in zip(torch.autograd.grad(op, leaves, grad), torch.autograd.grad(eager, leaves, grad)):
        assert max_rel_err(a, b) <= 1e-12


@needs_triton
@pytest.mark.parametrize("backend,gaussian", OP_BACKENDS)
def test_the_custom_ops_pass_torchs_op_checks(backend, gaussian):
    """Schema and autograd registration everywhere; fake tensors and AOT dispatch where the kernels compile (the
    interpreter runs the kernels on fake tensors)."""
    module = backend_module(backend)
    x = torch.randn(6, 2, 5, dtype=torch.float64, device=TRITON_DEVICE, requires_grad=True)
    weight = torch.randn(3, 5, dtype=torch.float64, device=TRITON_DEVICE, requires_grad=True)
    delay = (torch.rand(3, 5, dtype=torch.float64, device=TRITON_DEVICE) * 3).requires_grad_()
    checks = ("test_schema", "test_autograd_registration")
    if HAS_CUDA:
        checks += ("test_faketensor", "test_aot_dispatch_dynamic")
    result = torch.library.opcheck(module.OPS.forward, (x, weight, delay, None, 3, gaussian, 0.8), test_utils=checks)
    assert set(result.values()) == {"SUCCESS"}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,interpolation", BACKENDS)
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_torch_compile_fullgraph_runs_the_triton_backends(backend, interpolation, compile_backend, dtype, tol):
    """torch.compile(fullgraph=True) traces the backends as custom ops (no graph break): the same values and
    gradients as eager calls (Inductor passes float arguments as fp64: a float32 kernel must not widen)."""
    import torch._dynamo

    torch._dynamo.reset()
    layer = flexgen.DelayedLinear(6, 4, max_delay=5, backend=backend, interpolation=interpolation, sigma=1.3,
                                  dtype=dtype).cuda()
    x = torch.randn(9, 3, 6, dtype=dtype, device="cuda", requires_grad=True)
    grad = torch.randn(9, 3, 4, dtype=dtype, device="cuda")
    leaves = [x, layer.weight, layer.delay, layer.bias]
    want = [layer(x).detach()]
    want += torch.autograd.grad(layer(x), leaves, grad)
    assert torch._dynamo.explain(layer)(x).graph_break_count == 0
    compiled = torch.compile(layer, fullgraph=True, backend=compile_backend)
    y = compiled(x)
    got = [y.detach()] + list(torch.autograd.grad(y, leaves, grad))
    assert_same(got, want, tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,interpolation", BACKENDS)
def test_cuda_graphs_of_the_compiled_layer_follow_eager_calls(backend, interpolation):
    """torch.compile(mode="reduce-overhead") replays the custom ops from CUDA graphs: the same values and
    gradients as eager calls, call after call with new inputs (float64)."""
    import torch._dynamo

    torch._dynamo.reset()
    layer = flexgen.DelayedLinear(6, 4, max_delay=5, backend=backend, interpolation=interpolation, sigma=1.3,
                                  dtype=torch.float64).cuda()
    compiled = torch.compile(layer, mode="reduce-overhead")
    leaves = [layer.weight, layer.delay, layer.bias]
    for call in range(4):
        x = torch.randn(9, 3, 6, dtype=torch.float64, device="cuda", requires_grad=True)
        grad = torch.randn(9, 3, 4, dtype=torch.float64, device="cuda")
        want = [layer(x).detach()] + list(torch.autograd.grad(layer(x), [x] + leaves, grad))
        y = compiled(x)
        got = [y.detach().clone()] + list(torch.autograd.grad(y, [x] + leaves, grad))
        assert_same(got, want, 1e-12)


@needs_triton
def test_auto_runs_each_backend_where_it_is_the_fastest():
    layer = flexgen.DelayedLinear(3, 2, max_delay=4).to(TRITON_DEVICE)
    x = torch.rand(5, 2, 3, device=TRITON_DEVICE, requires_grad=True)
    assert type(layer(x).grad_fn).__name__ == "DelayedLinearFunctionBackward"  # too few rows for the products
    layer.interpolation = "gaussian"
    assert type(layer(x).grad_fn).__name__ == "DelayTapsFunctionBackward"
    layer.backend = "conv"
    assert type(layer(x).grad_fn).__name__ not in ("DelayTapsFunctionBackward", "DelayedLinearFunctionBackward")


@pytest.mark.parametrize("max_delay,steps,batch,dtype,tf32,want", [
    (48, 64, 64, torch.float32, True, "taps"),      # 4096 rows, the shortest delays: TF32 products
    (49, 64, 64, torch.float32, True, "fused"),     # delays past the rule's
    (25, 4095, 1, torch.float32, True, "fused"),    # too few rows to fill the GPU
    (25, 64, 64, torch.float32, False, "fused"),    # TF32 not allowed: the products would take 3xTF32
    (25, 64, 64, torch.float64, True, "fused"),     # fp64 inputs are summed in fp64 by the two-tap kernels
    (25, 100, 127, torch.bfloat16, True, "fused"),  # 16-bit inputs need more rows
    (30, 100, 128, torch.bfloat16, True, "taps"),
    (31, 100, 128, torch.float16, True, "fused"),   # and shorter delays
])
def test_the_auto_rule_for_linear_taps(monkeypatch, max_delay, steps, batch, dtype, tf32, want):
    """The rule alone, on CPU tensors as if Triton ran there (nothing is launched)."""
    from flexgen.layers import delay

    monkeypatch.setattr(delay, "_triton_runs_on", lambda device: True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    layer = flexgen.DelayedLinear(3, 2, max_delay=max_delay)
    assert layer._call_backend(torch.empty(steps, batch, 3, dtype=dtype)) == want
    layer.interpolation = "gaussian"
    assert layer._call_backend(torch.empty(steps, batch, 3, dtype=dtype)) == "taps"
    monkeypatch.setattr(delay, "_triton_runs_on", lambda device: False)
    assert layer._call_backend(torch.empty(steps, batch, 3, dtype=dtype)) == "conv"


@needs_triton
@pytest.mark.parametrize("backend,interpolation", [("fused", "linear"), ("taps", "linear"), ("taps", "gaussian")])
def test_what_the_triton_backends_save(backend, interpolation):
    """Both keep the input, the weights and the delays, nothing [max_delay + 1, out, in] ("taps" builds its tap
    matrices again for the backward)."""
    layer = flexgen.DelayedLinear(4, 3, max_delay=5, dtype=torch.float64, backend=backend,
                                  interpolation=interpolation).to(TRITON_DEVICE)
    x = torch.rand(6, 2, 4, dtype=torch.float64, device=TRITON_DEVICE, requires_grad=True)
    y = layer(x)  # kept alive: its graph holds what was saved
    saved = y.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(6, 2, 4), (3, 4), (3, 4)]


@needs_triton
@pytest.mark.parametrize("backend", ["fused", "taps"])
def test_triton_backends_float32_and_bfloat16_inputs(backend, monkeypatch):
    """fp32 as fp32 arithmetic (the products per tap at 3xTF32, TF32 being off); bf16 inputs read as they are,
    summed in fp32, the output rounded to bf16."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    g = torch.Generator().manual_seed(7)
    delays = synapse_delays("fractional", 5, 6, 7, g)
    conv, fused = pair(6, 5, 7, delays, dtype=torch.float32, device=TRITON_DEVICE, backend=backend)
    spikes = (torch.rand(11, 4, 6, generator=g) < 0.3).float().to(TRITON_DEVICE)
    grad = torch.randn(11, 4, 5, generator=g).to(TRITON_DEVICE)
    reference = run(conv.double(), spikes.double(), grad.double())
    assert_same(run(fused, spikes, grad), reference, 1e-5)
    got = run(fused, spikes.bfloat16(), grad.bfloat16())
    assert got[0].dtype == got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert_same(got, run(conv.double(), spikes.double(), grad.bfloat16().double()), 1e-2)


@needs_triton
@pytest.mark.parametrize("backend,interpolation", BACKENDS)
def test_gradients_match_finite_differences(backend, interpolation):
    g = torch.Generator().manual_seed(8)
    layer = flexgen.DelayedLinear(3, 2, max_delay=4, dtype=torch.float64, backend=backend,
                                  interpolation=interpolation, sigma=0.9,
                                  delay=torch.tensor([[0.4, 2.3, 3.6], [1.2, 0.1, 2.8]], dtype=torch.float64))
    x = torch.randn(7, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    names = ["weight", "bias", "delay"]

    def f(x, weight, bias, delay):
        return torch.func.functional_call(layer.to(TRITON_DEVICE), dict(zip(names, (weight, bias, delay))), (x,))

    params = [getattr(layer, n).detach().clone().to(TRITON_DEVICE).requires_grad_() for n in names]
    assert torch.autograd.gradcheck(f, (x.to(TRITON_DEVICE), *params), eps=1e-6, atol=1e-9)


def dcls_layer(fused, dcls_modules):
    """A Dcls1d "v0" holding the same synapses as `fused`, run as DCLS's SHD model runs it ([B, in, T] padded by
    max_delay on the left). Its kernel tap k weighs padded input t + k, so a delay d sits at index max_delay - d,
    and Dcls1d adds dilated_kernel_size // 2 to its positions before placing them."""
    size = fused.max_delay + 1
    layer = dcls_modules.Dcls1d(fused.in_features, fused.out_features, kernel_count=1, dilated_kernel_size=size,
                                bias=fused.bias is not None, version="v0").double()
    with torch.no_grad():
        layer.weight.copy_(fused.weight.detach().cpu().unsqueeze(-1))
        layer.P.copy_((fused.max_delay - fused.delay.detach().cpu() - size // 2)[None, :, :, None])
        if fused.bias is not None:
            layer.bias.copy_(fused.bias.detach().cpu())
    return layer


def run_dcls(layer, x, grad, max_delay):
    x = x.detach().clone().requires_grad_()
    y = layer(F.pad(x.permute(1, 2, 0), (max_delay, 0))).permute(2, 0, 1)
    grads = torch.autograd.grad(y, [x, layer.weight, layer.P, layer.bias], grad)
    # P = max_delay - delay - const: the delay's gradient is -P's
    return [y.detach(), grads[0], grads[1][:, :, 0], -grads[2][0, :, :, 0], grads[3]]


@needs_triton
@pytest.mark.parametrize("backend", ["fused", "taps"])
@pytest.mark.parametrize("kind", ["fractional", "whole"])
def test_triton_backends_equal_dcls_v0_in_float64(kind, backend):
    """Fractional delays: every value and gradient. Whole delays (0 and max_delay among them): the values and the
    gradients of x, W and bias; the delay's gradient there is one-sided, and dcls takes the other side (towards
    shorter delays: it interpolates in position, max_delay - d), so it is not compared."""
    dcls_modules = pytest.importorskip("DCLS.construct.modules")
    g = torch.Generator().manual_seed(9)
    steps, batch, n_in, n_out, max_delay = 12, 3, 6, 5, 7
    if kind == "fractional":  # multiples of 1/64, never whole: max_delay - d is exact in float64
        delays = (torch.randint(1, 64, (n_out, n_in), generator=g) + 64 * torch.randint(0, max_delay, (n_out, n_in),
                                                                                       generator=g)) / 64.0
    else:
        delays = synapse_delays("whole", n_out, n_in, max_delay, g)
        delays[0, :2] = torch.tensor([0.0, float(max_delay)])
    _, fused = pair(n_in, n_out, max_delay, delays.double(), device=TRITON_DEVICE, backend=backend)
    reference = dcls_layer(fused, dcls_modules)
    x = torch.randn(steps, batch, n_in, generator=g, dtype=torch.float64)
    grad = torch.randn(steps, batch, n_out, generator=g, dtype=torch.float64)
    want = run_dcls(reference, x, grad, max_delay)
    got = [t if t is None else t.cpu() for t in run(fused, x.to(TRITON_DEVICE), grad.to(TRITON_DEVICE))]
    if kind == "whole":
        got[3] = want[3] = None
    assert_same(got, want, 1e-12)


@pytest.mark.skipif(not hasattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision"),
                    reason="torch before the per-operator fp32_precision flags")
@pytest.mark.parametrize("conv,want", [("ieee", "tf32x3"), ("tf32", "tf32")])
def test_the_products_follow_the_convolutions_own_tf32_flag(conv, want):
    """Set through torch's newer API, the convolutions' flag can differ from the recurrent networks'; then
    torch.backends.cudnn.allow_tf32 raises instead of answering, and the layer reads the convolutions' flag."""
    from flexgen.launch.delay.taps import taps_precision

    flags = torch.backends.cudnn.conv, torch.backends.cudnn.rnn
    before = [flag.fp32_precision for flag in flags]
    try:  # the flags are descriptors that monkeypatch cannot undo
        flags[0].fp32_precision, flags[1].fp32_precision = conv, "tf32" if conv == "ieee" else "ieee"
        with pytest.raises(RuntimeError):
            torch.backends.cudnn.allow_tf32
        assert taps_precision(torch.float32) == want
        assert taps_precision(torch.float64) == "ieee"
    finally:
        for flag, value in zip(flags, before):
            flag.fp32_precision = value


def test_the_forward_tile_narrows_where_it_would_leave_half_the_gpu_idle(monkeypatch):
    from flexgen.launch.delay import taps as delay_taps

    monkeypatch.setattr(delay_taps, "_multiprocessors", lambda device: 132)
    config = delay_taps.DEFAULT
    cuda = torch.device("cuda")
    assert delay_taps._forward_tile(config, 100 * 32, 256, cuda) == config.forward_small  # 50 programs
    assert delay_taps._forward_tile(config, 250 * 32, 256, cuda) == config.forward  # 125 programs


def test_tiles_shrink_to_fit_shared_memory(monkeypatch):
    """fp64 slices of the default tiles need more than an H100's 227 KiB: fewer stages, then smaller tiles."""
    from flexgen.launch.delay import taps as delay_taps

    monkeypatch.setattr(delay_taps, "_shared_memory", lambda device: 232448)
    cuda = torch.device("cuda")
    tile = delay_taps.DEFAULT.correlation  # (128 + 256) x 32 slices, 3 stages
    assert delay_taps._within_shared_memory(tile, 4, cuda) == tile
    assert delay_taps._within_shared_memory(tile, 8, cuda) == tile._replace(stages=2)
    monkeypatch.setattr(delay_taps, "_shared_memory", lambda device: 140 * 1024)
    assert delay_taps._within_shared_memory(tile, 8, cuda) == tile._replace(stages=2, cols=128)


def test_bad_inputs_and_backends():
    layer = flexgen.DelayedLinear(2, 1, max_delay=3, backend="fused")
    with pytest.raises(ValueError, match=r"takes inputs \[T, B, 2\], got \(3, 1, 2, 1\)"):
        layer(torch.zeros(3, 1, 2, 1))
    with pytest.raises(ValueError, match=r"takes inputs \[T, B, 2\], got \(3, 1, 3\)"):
        layer(torch.zeros(3, 1, 3))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.zeros(3, 1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="backend must be one of"):
        flexgen.DelayedLinear(2, 1, max_delay=3, backend="cuda")
    gaussian = flexgen.DelayedLinear(2, 1, max_delay=3, backend="fused", interpolation="gaussian")
    if HAS_CUDA or INTERPRETER:
        with pytest.raises(ValueError, match="needs interpolation='linear'.*backend='taps' runs gaussian taps"):
            gaussian.to(TRITON_DEVICE)(torch.zeros(3, 1, 2, device=TRITON_DEVICE))
    if not INTERPRETER:
        for backend in ("fused", "taps"):
            cpu = flexgen.DelayedLinear(2, 1, max_delay=3, backend=backend)
            with pytest.raises(ValueError, match=f"backend='{backend}'.*needs CUDA inputs.*falls back"):
                cpu(torch.zeros(3, 1, 2))
    with torch.no_grad():
        layer.delay[0, 1] = float("nan")
    if HAS_CUDA or INTERPRETER:
        with pytest.raises(ValueError, match=r"delay of synapse 1 -> 0 \(delay\[0, 1\]\) is NaN"):
            layer.to(TRITON_DEVICE)(torch.zeros(3, 1, 2, device=TRITON_DEVICE))
    assert "backend='fused'" in repr(layer)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,interpolation", BACKENDS)
@pytest.mark.parametrize("shape", [(37, 33, 70, 40, 30), (64, 32, 48, 96, 100), (20, 16, 24, 8, 3),
                                   (50, 130, 700, 256, 25)])
def test_cuda_backends_equal_the_cpu_convolution(shape, backend, interpolation, monkeypatch):
    """Shapes past one tile in every direction, odd and aligned batches, max_delay past T, SHD's 700 -> 256.
    fp32: 1e-5 with TF32 off (3xTF32 for the products per tap); with TF32 on, the products per tap round their
    operands to 10 mantissa bits: 2e-3 relative to the largest value."""
    steps, batch, n_in, n_out, max_delay = shape
    g = torch.Generator().manual_seed(steps)
    delays = synapse_delays("outside", n_out, n_in, max_delay, g)
    delays[0, :3] = torch.tensor([0.0, float(max_delay), 2.0])
    conv, fused = pair(n_in, n_out, max_delay, delays, device="cpu", backend=backend, interpolation=interpolation)
    fused = fused.cuda()
    x = torch.randn(steps, batch, n_in, generator=g, dtype=torch.float64)
    grad = torch.randn(steps, batch, n_out, generator=g, dtype=torch.float64)
    want = run(conv, x, grad)
    assert_same(run(fused, x.cuda(), grad.cuda()), want, 1e-12)
    fused32 = fused.float()
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert_same(run(fused32, x.float().cuda(), grad.float().cuda()), want, 1e-5)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert_same(run(fused32, x.float().cuda(), grad.float().cuda()), want, 1e-5 if backend == "fused" else 2e-3)


@pytest.mark.skipif(HAS_CUDA, reason="where there is a GPU the benchmark runs for real (and Triton 3.6's interpreter "
                    "cannot loop over a kernel argument with NumPy 2.5)")
def test_benchmark_dry_run(tmp_path):
    """benchmarks/bench_delays.py end to end on the CPU at tiny sizes (the interpreter), every candidate recorded."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_delays.py"), "--dry-run", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "bench_delays.json").read_text())
    names = {row["candidate"] for row in record["results"]}
    assert {"flexgen fused", "flexgen conv"} <= names
    assert all(row["fwd_bwd_ms"] > 0 for row in record["results"])
    assert "| candidate |" in (tmp_path / "bench_delays.md").read_text()


def test_the_recorded_table_is_what_its_data_gives(tmp_path):
    """docs/perf/bench_delays.md is the table `--replot` draws from the recorded JSON, and every fused row passed
    its float64 check."""
    recorded = ROOT / "docs" / "perf" / "bench_delays.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_delays.py"), "--replot", str(recorded),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bench_delays.md").read_text() == (ROOT / "docs" / "perf" / "bench_delays.md").read_text()
    rows = json.loads(recorded.read_text())["results"]
    assert all(row["check_passed"] for row in rows if row["candidate"] == "flexgen fused")
