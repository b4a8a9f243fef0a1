"""Half-precision training against float64, and the forward keeping the backward's comparisons when it
rounds saved values to the I/O dtype (benchmarks/accuracy.py measures the same at full size)."""
import pytest
import sympy
import torch

import flexgen
from conftest import device_backends
from specs import ALL, adaptive_mix, lif, plif

T, NEURONS = 16, 2000


def spikes_and_grad(x, weight, **options):
    x = x.detach().clone().requires_grad_()
    (s,), _ = lif.apply(x, **options)
    (grad,) = torch.autograd.grad((s.to(weight.dtype) * weight).sum(), [x])
    return s, grad


def relative_error(grad, ref):
    return ((grad.double() - ref).norm() / ref.norm()).item()


def half_inputs(dtype, device, seed=5, neurons=NEURONS):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, neurons, generator=g) * 1.5 + 0.8).to(dtype).to(device)
    weight = torch.randn(T, neurons, generator=g).to(dtype).to(device)
    return x, weight


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype,plain_bound,recompute_bound", [(torch.float16, 1e-3, 1e-3), (torch.bfloat16, 1e-2, 1e-2)])
def test_half_precision_gradients_against_float64(device, backend, dtype, plain_bound, recompute_bound):
    """Arithmetic runs in fp32 for half inputs. The plain design saves h rounded to the I/O dtype (its
    backward sees h within half a step of that dtype); the recompute design keeps h in fp32. Either way
    the gradient is about as accurate as its own rounding to the I/O dtype allows."""
    x, weight = half_inputs(dtype, device)
    s_ref, grad_ref = spikes_and_grad(x.double(), weight.double(), backend="eager")
    s_plain, grad_plain = spikes_and_grad(x, weight.float(), backend=backend, recompute=False)
    s_recomputed, grad_recomputed = spikes_and_grad(x, weight.float(), backend=backend, recompute=True)
    assert s_plain.dtype == dtype and grad_plain.dtype == dtype
    assert torch.equal(s_plain.double(), s_ref) and torch.equal(s_recomputed, s_plain)
    assert relative_error(grad_plain, grad_ref) < plain_bound
    assert relative_error(grad_recomputed, grad_ref) < recompute_bound


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_saved_h_gives_the_backward_the_forwards_spikes(device, backend, dtype):
    """LIF's backward tests h >= v_th on the saved h for the reset's derivative. Rounding h to the I/O
    dtype would move it across v_th for about one element in 10^4 (fp16) or 10^3 (bf16); the forward
    stores the other neighbour there, so the test gives every spike the forward fired, and h stays
    within one step of the dtype."""
    x, _ = half_inputs(dtype, device, neurons=20000)
    v_th = 1.0
    (s,), _ = lif.apply(x.requires_grad_(), backend=backend, recompute=False)
    (h_saved,) = [t for t in s.grad_fn.saved_tensors if t.dim() and t.shape[0] == T]
    # the C target runs 16-bit calls through its fp32 kernels and saves in fp32: nothing is rounded
    assert h_saved.dtype == (torch.float32 if backend == "c" else dtype)
    assert torch.equal((h_saved.float() >= v_th).to(dtype), s)
    h = _exact_h(x.float(), tau=2.0, v_th=v_th)
    assert ((h.to(dtype).float() >= v_th) != (h >= v_th)).any()  # rounding to nearest would flip some
    step = torch.finfo(h_saved.dtype).eps * h.abs().clamp(min=1.0)
    assert torch.all((h_saved.float() - h).abs() <= step)


def _exact_h(x, tau, v_th):
    """LIF's pre-spike potential per step, in fp32, as the kernels compute it."""
    v, hs = torch.zeros_like(x[0]), []
    for step in x:
        h = v + (step - v) * (1.0 / tau)
        hs.append(h)
        v = h * (1.0 - (h >= v_th).float())
    return torch.stack(hs)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name", ["lif", "plif", "exp_quadratic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_plain_and_recompute_gradients_agree_in_half_precision(device, backend, name, dtype):
    """The recompute backward re-runs the forward in fp32; the plain one reads values rounded to the I/O
    dtype. With the comparisons kept, they differ by rounding only: no element by a branch."""
    spec = ALL[name]
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(T, 4000, generator=g) * 1.5 + 0.7).to(dtype).to(device).requires_grad_() for _ in spec.signature.inputs]
    params = {w: torch.tensor(-0.3, dtype=dtype, device=device, requires_grad=True) for w in spec.signature.learnable}
    plain, recomputed = (_input_gradients(spec, inputs, params, backend, recompute) for recompute in (False, True))
    for a, b in zip(plain, recomputed):
        assert ((a.float() - b.float()).abs() <= 1e-2 * b.float().abs().max()).all()


def _input_gradients(spec, inputs, params, backend, recompute):
    outputs, _ = spec.apply(*inputs, backend=backend, recompute=recompute, **params)
    g = torch.Generator().manual_seed(1)
    loss = sum((t.float() * torch.randn(t.shape, generator=g).to(t.device)).sum() for t in outputs)
    return torch.autograd.grad(loss, inputs)


def test_decisions_are_the_backwards_comparisons_on_written_values():
    h, v, a, v_th, beta = sympy.symbols("h v a v_th beta", real=True)
    assert lif.derivation().decisions == ((h, (sympy.Ge(h - v_th, 0),)),)
    (owner, comparisons), = plif.derivation().decisions  # PLIF saves x (an input: exact) and v (a state)
    assert owner == v and len(comparisons) == 1 and comparisons[0].free_symbols >= {v, sympy.Symbol("x", real=True)}
    # adaptive_mix saves its input y, its state a and its output h: the threshold test reads a and h
    assert adaptive_mix.derivation().decisions == ((a, (sympy.Ge(-a * beta + h - v_th, 0),)),)
    assert "# the backward tests h - v_th >= 0: stored in fp16/bf16, h keeps the forward's outcome" in lif.equations()


def test_decisions_cover_where_conditions():
    @flexgen.neuron(states=("v",))
    def clipped(x, v, v_th=1.0):
        h = v + x
        s = flexgen.spike(h - v_th)
        leak = flexgen.where(h > 0.5, h * 0.9, h)  # dleak/dh depends on h > 0.5
        return s, flexgen.frontend.functions.clamp(leak * (1.0 - s), -1.0, 2.0)

    (owner, comparisons), = clipped.derivation().decisions
    assert str(owner) == "h"
    assert {str(c) for c in comparisons} >= {"h - v_th >= 0", "h > 0.5"}


@pytest.mark.parametrize("device,backend", device_backends())
def test_fp32_and_fp64_store_the_values_unchanged(device, backend):
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(T, 50, dtype=dtype, device=device, requires_grad=True)
        (s,), _ = lif.apply(x, backend=backend, recompute=False)
        (h_saved,) = [t for t in s.grad_fn.saved_tensors if t.dim() and t.shape[0] == T]
        # The kernel rounds each step's h to the storage dtype; float32 accumulates its rounding over the T steps.
        atol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(h_saved, _exact_h(x.detach(), tau=2.0, v_th=1.0).to(dtype), rtol=0, atol=atol)
