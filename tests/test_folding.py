"""Simplification never changes what a step computes: singular constants, the Piecewise branches of
clamps, constants folded beyond fp32, powers of scaled values."""
import math
import os

import pytest
import sympy
import torch

import flexgen
from conftest import line_of, max_rel_err, plain_device_backends
from flexgen import clamp, log, maximum, spike, sqrt
from flexgen.printing import TorchPrinter, TritonPrinter

SYMPY_NAMES = ("zoo", "nan", "oo", "I")


pytestmark = pytest.mark.usefixtures("private_cache")


def generated_files(root):
    return [f for _, _, files in os.walk(root) for f in files if not f.startswith(".lock-")]


def assert_no_sympy_names(spec, **static):
    """No sympy object name reaches a generated source (as a word: `zoo`, `I`, ...)."""
    import re

    for kind in ("forward", "backward", "backward_recompute", "torch_forward", "torch_backward"):
        source = spec.source(kind, **static)
        for name in SYMPY_NAMES:
            assert not re.search(rf"(?<![\w.]){name}(?![\w(])", source), (kind, name)


# ---------------------------------------------------------------- singular constants: a SpecError at build


def divides_by_zero(x, v, zoo=3.0):  # a hyper-parameter named like sympy's complex infinity
    h = v + x / 0
    return h + zoo, h


def log_of_cancelled(x, v):
    h = v + log(x - x)
    return h, h


def root_of_negative(x, I, v):  # an input named like sympy's imaginary unit
    h = v + sqrt(x * 0.0 - 4.0) * I
    return h, h


@pytest.mark.parametrize("step,text,folded", [
    (divides_by_zero, "x / 0", "zoo*x"),
    (log_of_cancelled, "log(x - x)", "zoo"),
    (root_of_negative, "sqrt(x * 0.0 - 4.0)", "2.0*I"),
])
def test_singular_constant_is_a_spec_error_naming_the_line(step, text, folded, private_cache):
    spec = flexgen.neuron(states=("v",))(step)
    with pytest.raises(flexgen.SpecError) as info:
        spec()
    message = str(info.value)
    assert f":{line_of(step, text)}" in message and f"`{folded}`" in message and "finite real" in message, message
    assert generated_files(private_cache) == []


def test_derivative_that_is_not_finite_is_a_spec_error():
    @flexgen.neuron(states=("v",))
    def zero_base(x, v):
        h = v + 0.0 ** x  # the value is fine, d/dx 0**x = 0**x log(0) is not
        return h, h

    with pytest.raises(flexgen.SpecError, match="derivative of .* with respect to x is nan"):
        zero_base.derivation()


@pytest.mark.parametrize("printer", [TritonPrinter(), TorchPrinter()])
def test_printers_refuse_atoms_that_are_not_finite_real_numbers(printer):
    x = sympy.Symbol("x", real=True)
    for value in (sympy.zoo, sympy.oo, -sympy.oo, sympy.nan, sympy.I):
        with pytest.raises(flexgen.SpecError, match="not a finite real number"):
            printer.doprint(x + value)
    assert printer.doprint(x * sympy.pi) == f"{math.pi!r}*x"
    with pytest.raises(flexgen.SpecError, match="beyond the float range"):
        printer.doprint(x * sympy.Integer(2) ** 2000)


# ---------------------------------------------------------------- a clamp's constant branch


@flexgen.neuron(states=("syn_exc", "syn_inh", "mem"), learnable=("alpha", "beta"))
def alpha_neuron(x, syn_exc, syn_inh, mem, alpha=0.9, beta=0.8, threshold=1.0):
    """snnTorch's Alpha neuron as its users write it: decays clamped to [0, 1], tau_alpha from their logs."""
    a = clamp(alpha, 0.0, 1.0)
    b = clamp(beta, 0.0, 1.0)
    exc = a * syn_exc + x
    inh = b * syn_inh - x
    tau_alpha = log(a) / (log(b) - log(a)) + 1.0
    reset = flexgen.detach(spike(mem - threshold))
    mem_new = tau_alpha * (exc + inh) - reset * threshold
    return spike(mem_new - threshold), exc, inh, mem_new


def run_with_grads(spec, backend, x, params, recompute=False):
    x = x.clone().requires_grad_()
    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    outputs, finals = spec.apply(x, backend=backend, recompute=recompute, **params)
    loss = sum((o * (k + 1.5)).sum() for k, o in enumerate(outputs)) + sum((f * 0.7).sum() for f in finals)
    grads = torch.autograd.grad(loss, [x, *params.values()])
    return [*outputs, *finals], grads


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_alpha_neuron_with_clamped_logs_matches_eager(device, backend):
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(6, 2, 5, generator=g, dtype=torch.float64) * 2.0).to(device)
    params = {"alpha": torch.tensor(0.9, dtype=torch.float64, device=device),
              "beta": torch.tensor(0.8, dtype=torch.float64, device=device)}
    ref_values, ref_grads = run_with_grads(alpha_neuron, "eager", x, params)
    for recompute in (False, True):
        values, grads = run_with_grads(alpha_neuron, backend, x, params, recompute)
        # float64: the generated kernels compute the step's expressions, simplified, so they agree with eager to
        # rounding: elementwise within 1e-12 of the reference's largest magnitude (measured on the CPU: 1.1e-15)
        for got, ref in zip(values + list(grads), ref_values + list(ref_grads)):
            assert got.dtype == ref.dtype == torch.float64 and got.shape == ref.shape
            assert max_rel_err(got, ref) <= 1e-12, max_rel_err(got, ref)
    assert_no_sympy_names(alpha_neuron)


def test_a_constant_value_is_a_block_in_the_compute_dtype():
    """The membrane's gradient does not flow back here (grad_mem_prev = 0): a bare 0.0 would be an fp32
    scalar, and as a loop-carried value Triton (not its interpreter) refuses it under fp64."""
    backward = alpha_neuron.source("backward")
    assert "grad_mem_prev = tl.full([BLOCK], 0.0, COMPUTE)" in backward
    assert "grad_mem_prev = 0.0" in alpha_neuron.source("torch_backward")  # torch broadcasts a Python float


@flexgen.neuron(states=("v",))
def at_the_clamp(x, v):
    """Reciprocal, root and log of values that a maximum or clamp sets to exactly 0 (where x <= 0)."""
    r = 1.0 / maximum(x, 0.0)
    q = sqrt(maximum(x - 1.0, 0.0)) + log(clamp(x, 0.0, 1.0))
    h = v + x * 0.5
    return r, q, h


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_values_at_the_clamp_boundary_are_ieee_like_eager(device, backend):
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0]], dtype=torch.float64, device=device)
    ref = at_the_clamp.apply(x, backend="eager")[0]
    got = at_the_clamp.apply(x, backend=backend)[0]
    assert ref[0][0, :2].tolist() == [float("inf")] * 2 and ref[1][0, :2].tolist() == [float("-inf")] * 2
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    assert_no_sympy_names(at_the_clamp)


# ---------------------------------------------------------------- constants folded beyond fp32


@flexgen.neuron(states=("v",))
def squarings(x, v):
    h = x * 0.5
    for _ in range(60):
        h = h * h  # folded, the coefficient would be 0.5 ** (2 ** 60): 0 in any float
    return spike(h - 1.0), v + x


@flexgen.neuron(states=("v",))
def scaled_cube(x, v):
    return (x * 1e-20) ** 3 * 1e15, v + x  # folded: 1e-45 * x**3, where x**3 overflows fp32


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_repeated_squaring_spikes_where_eager_does(device, backend):
    x = torch.tensor([[2.0, 1.0, 2.0000002, 1.9999999, -2.0]], device=device)
    ref = squarings.apply(x, backend="eager")[0][0]
    assert ref.tolist() == [[1.0, 0.0, 1.0, 0.0, 1.0]]
    assert torch.equal(squarings.apply(x, backend=backend)[0][0], ref)


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_scaled_cube_does_not_overflow_where_eager_does_not(device, backend):
    x = torch.tensor([[1e20, 2e20, 1e19, -1e20, 3.0]], device=device, requires_grad=True)
    ref = scaled_cube.apply(x, backend="eager")[0][0]
    got = scaled_cube.apply(x, backend=backend)[0][0]
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0.0)
    (grad_ref,) = torch.autograd.grad(ref.sum(), x)
    (grad_got,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(grad_got, grad_ref, rtol=1e-5, atol=0.0)
