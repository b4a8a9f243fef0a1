"""Surrogate gradients: sympy derivative vs hand-written torch formula vs published spot values,
and every surrogate through the generated kernels."""
import math

import pytest
import sympy
import torch

import flexgen
from conftest import device_backends
from flexgen import surrogate as sg
from flexgen.frontend.symbolic import spike_class

# Away from the piecewise surrogates' kinks, so both sides evaluate the same branch.
Z = torch.tensor([-3.1, -1.3, -0.7, -0.33, -0.11, 0.0, 0.07, 0.21, 0.45, 0.9, 1.6, 4.2], dtype=torch.float64)

ALL = [
    sg.Sigmoid(), sg.Sigmoid(alpha=2.5), sg.ATan(), sg.ATan(alpha=3.0), sg.PiecewiseQuadratic(),
    sg.PiecewiseQuadratic(alpha=2.2), sg.SoftSign(), sg.SoftSign(alpha=0.7), sg.Erf(), sg.Erf(alpha=1.3),
    sg.SuperSpike(), sg.SuperSpike(alpha=2.0), sg.Rect(), sg.Rect(alpha=0.6), sg.PiecewiseLeakyReLU(),
    sg.PiecewiseLeakyReLU(w=0.5, c=0.1), sg.FastSigmoid(), sg.FastSigmoid(slope=3.0),
    sg.Custom(lambda z: flexgen.sigmoid(3.0 * z) + 0.1 * flexgen.tanh(z)),
]


def _logistic(u):
    return 1.0 / (1.0 + math.exp(-u))


def sympy_values(surrogate, zs):
    z = sympy.Symbol("z", real=True)
    expr = surrogate.derivative(z)
    fn = sympy.lambdify(z, expr, modules=[{"sigmoid": _logistic}, "math"])
    return torch.tensor([float(fn(float(v))) for v in zs], dtype=torch.float64)


@pytest.mark.parametrize("surrogate", ALL, ids=repr)
def test_torch_grad_matches_sympy_derivative(surrogate):
    got = surrogate.torch_grad(Z)
    assert got.dtype == torch.float64 and got.shape == Z.shape
    torch.testing.assert_close(got, sympy_values(surrogate, Z), rtol=1e-12, atol=1e-14)


def _sig(u):
    return 1.0 / (1.0 + math.exp(-u))


# (surrogate, z, value) from the published formulas, written out independently of flexgen.
SPOT = [
    (sg.Sigmoid(), 0.5, 4.0 * _sig(2.0) * (1.0 - _sig(2.0))),
    (sg.ATan(), 0.5, 1.0 / (1.0 + (math.pi / 2.0) ** 2)),
    (sg.PiecewiseQuadratic(), 0.25, 0.75),
    (sg.PiecewiseQuadratic(), -1.5, 0.0),
    (sg.PiecewiseQuadratic(alpha=2.0), 0.3, 2.0 - 4.0 * 0.3),
    (sg.SoftSign(), 0.5, 2.0 / (2.0 * 4.0)),
    (sg.Erf(), 0.5, 2.0 / math.sqrt(math.pi) * math.exp(-1.0)),
    (sg.SuperSpike(), -1.0, 0.25),
    (sg.SuperSpike(alpha=3.0), 0.5, 3.0 / 2.25),
    (sg.Rect(), 0.49, 1.0),
    (sg.Rect(), -0.51, 0.0),
    (sg.Rect(alpha=2.0), 0.2, 2.0),
    (sg.PiecewiseLeakyReLU(), 0.9, 0.5),
    (sg.PiecewiseLeakyReLU(), -1.2, 0.01),
    (sg.PiecewiseLeakyReLU(w=0.25, c=0.0), 0.1, 2.0),
    (sg.FastSigmoid(), 0.04, 0.25),
    (sg.FastSigmoid(), -0.2, 1.0 / 36.0),
]


@pytest.mark.parametrize("surrogate,z,value", SPOT, ids=[f"{s!r}@{z}" for s, z, _ in SPOT])
def test_published_spot_values(surrogate, z, value):
    assert surrogate.torch_grad(torch.tensor([z], dtype=torch.float64)).item() == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert float(surrogate.derivative(sympy.Float(z))) == pytest.approx(value, rel=1e-12, abs=1e-15)


def test_defaults_match_spikingjelly_and_snntorch():
    assert sg.Sigmoid().alpha == 4.0 and sg.ATan().alpha == 2.0 and sg.PiecewiseQuadratic().alpha == 1.0
    assert sg.SoftSign().alpha == 2.0 and sg.Erf().alpha == 2.0 and sg.SuperSpike().alpha == 1.0
    assert sg.Rect().alpha == 1.0 and (sg.PiecewiseLeakyReLU().w, sg.PiecewiseLeakyReLU().c) == (1.0, 0.01)
    assert sg.FastSigmoid().slope == 25.0
    assert set(sg.available()) == {
        "Sigmoid", "ATan", "PiecewiseQuadratic", "SoftSign", "Erf", "SuperSpike", "Rect", "PiecewiseLeakyReLU", "FastSigmoid",
    }


def test_custom_atan_primitive_equals_atan_surrogate():
    custom = sg.Custom(lambda z: flexgen.atan(math.pi * z) / math.pi + 0.5)
    reference = sg.ATan(alpha=2.0)
    torch.testing.assert_close(custom.torch_grad(Z), reference.torch_grad(Z), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sympy_values(custom, Z), sympy_values(reference, Z), rtol=1e-12, atol=1e-14)


def test_custom_grad_matches_autograd_and_keeps_input_graph():
    custom = sg.Custom(lambda z: flexgen.sigmoid(2.0 * z) * 0.5 + flexgen.exp(-z * z) * 0.1)
    z = Z.clone().requires_grad_()
    expected = torch.autograd.grad((torch.sigmoid(2.0 * z) * 0.5 + torch.exp(-z * z) * 0.1).sum(), z)[0]
    with torch.no_grad():  # the eager spike's backward calls torch_grad with grad mode off
        got = custom.torch_grad(z)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert not z.grad  # the input itself was not differentiated into


def test_keys_identify_surrogates():
    keys = [s.key() for s in ALL]
    assert len(set(keys)) == len(keys)
    assert sg.Sigmoid(alpha=4) == sg.Sigmoid() and hash(sg.Sigmoid(alpha=4)) == hash(sg.Sigmoid())
    assert sg.Sigmoid() != sg.Sigmoid(alpha=2.0) and sg.Rect(alpha=1.0) != sg.SuperSpike(alpha=1.0)
    same = [sg.Custom(lambda z: flexgen.atan(2.0 * z)), sg.Custom(lambda u: flexgen.atan(2.0 * u))]
    assert same[0].key() == same[1].key()
    assert sg.Custom(lambda z: flexgen.atan(2.0 * z)).key() != sg.Custom(lambda z: flexgen.atan(3.0 * z)).key()
    classes = {spike_class(s) for s in ALL}
    assert len(classes) == len(ALL) and len({c.__name__ for c in classes}) == len(ALL)
    assert spike_class(sg.Sigmoid()).__name__ == "spike_sigmoid"


@pytest.mark.parametrize("make", [
    lambda: sg.Sigmoid(alpha=0.0), lambda: sg.ATan(alpha=-1.0), lambda: sg.Erf(alpha=float("inf")),
    lambda: sg.PiecewiseLeakyReLU(w=0.0), lambda: sg.PiecewiseLeakyReLU(c=-0.1), lambda: sg.FastSigmoid(slope=float("nan")),
])
def test_invalid_parameters(make):
    with pytest.raises(ValueError, match="must be a"):
        make()


def test_invalid_custom_primitives():
    with pytest.raises(TypeError, match="callable"):
        sg.Custom(3.0)
    with pytest.raises(ValueError, match="does not depend on z"):
        sg.Custom(lambda z: 0.5)
    with pytest.raises(ValueError, match="flexgen math functions"):
        sg.Custom(lambda z: math.atan(z))


@flexgen.neuron(states=("v",))
def _probe(x, v, surrogate=sg.Sigmoid()):
    h = v * 0.5 + x
    s = flexgen.spike(h - 1.0, surrogate)
    return s, h - s


KERNEL_SURROGATES = [
    sg.ATan(alpha=3.0), sg.PiecewiseQuadratic(), sg.SoftSign(), sg.Erf(), sg.SuperSpike(), sg.Rect(alpha=0.6),
    sg.PiecewiseLeakyReLU(w=0.5, c=0.1), sg.FastSigmoid(), sg.Custom(lambda z: flexgen.atan(math.pi * z) / math.pi + 0.5),
]


def _probe_inputs(seed, device):
    """Inputs around the threshold and an upstream gradient for `_probe`, [4, 16] fp64."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(4, 16, generator=g, dtype=torch.float64) * 2.4 - 0.2).to(device).requires_grad_()
    return x, torch.randn(4, 16, generator=g, dtype=torch.float64).to(device)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("surrogate", KERNEL_SURROGATES, ids=repr)
def test_surrogate_in_generated_kernels(device, backend, surrogate):
    """The printed derivative (Piecewise, Abs, exp, ...) matches the eager spike's torch_grad."""
    x, upstream = _probe_inputs(7, device)
    results = []
    for b in (backend, "eager"):
        (s,), (v,) = _probe.apply(x, backend=b, surrogate=surrogate)
        grad = torch.autograd.grad((s * upstream).sum() + v.sum(), x)[0]
        results.append((s, v, grad))
    (s, v, grad), (s_ref, v_ref, grad_ref) = results
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(v, v_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)
    assert grad.abs().max() > 0


# Learnable alpha: each surrogate's primitive g(z, a), written out independently of flexgen.
def _clamp01(u):
    return u.clamp(0.0, 1.0)


PRIMITIVES = {
    "Sigmoid": lambda z, a: torch.sigmoid(a * z),
    "ATan": lambda z, a: torch.atan(math.pi / 2 * a * z) / math.pi + 0.5,
    "PiecewiseQuadratic": lambda z, a: torch.where(
        z.abs() <= 1 / a, -a * a / 2 * z * z.abs() + a * z + 0.5, (z > 0).to(z.dtype)),
    "SoftSign": lambda z, a: (a * z / (1 + a * z.abs()) + 1) / 2,
    "Erf": lambda z, a: torch.erfc(-a * z) / 2,
    "SuperSpike": lambda z, a: a * z / (1 + z.abs()),
    "Rect": lambda z, a: _clamp01(a * z + 0.5),
}
ALPHA_SURROGATES = [
    sg.Sigmoid(alpha=2.5, learnable_alpha=True), sg.ATan(learnable_alpha=True), sg.PiecewiseQuadratic(alpha=0.8, learnable_alpha=True),
    sg.SoftSign(alpha=0.7, learnable_alpha=True), sg.Erf(learnable_alpha=True), sg.SuperSpike(alpha=2.0, learnable_alpha=True),
    sg.Rect(alpha=0.6, learnable_alpha=True),
]


def sympy_alpha_values(surrogate, zs):
    z = sympy.Symbol("z", real=True)
    fn = sympy.lambdify(z, surrogate.alpha_derivative(z), modules=[{"sigmoid": _logistic}, "math"])
    return torch.tensor([float(fn(float(v))) for v in zs], dtype=torch.float64)


# How far a central difference (g(u + h) - g(u - h)) / 2h in float64 may be from the derivative, with h = 1e-6:
# - rounding: each g(.) is within a few units of 1e-16 |g|, |g| <= 2 here, so each unit moves the quotient by
#   1e-16 * 2 / 1e-6 = 2e-10; FD_ROUNDING allows five (measured on the CPU: at most 8e-11 over all of them);
# - truncation, where g is smooth: h^2 |g_uuu| / 6, at most 3e-12 for these primitives at Z (no kink within h of Z);
# - at z = 0 a primitive with |z| (PiecewiseQuadratic, SoftSign, SuperSpike) has a g_zz that changes sign: there
#   the difference is off by h |g_zz(0+)| / 2 (to first order in h, and at most that), which FD_KINK gives: a^2 / 2,
#   a^2 / 2 and a (measured: 3.2e-7, 2.5e-7, 2.0e-6, these bounds up to rounding). In alpha every g is smooth at Z.
FD_STEP = 1e-6
FD_ROUNDING = 1e-9
FD_KINK = {"PiecewiseQuadratic": lambda a: a * a / 2, "SoftSign": lambda a: a * a / 2, "SuperSpike": lambda a: a}


def assert_within(got, want, bound):
    error = (got - want).abs()
    assert (error <= bound).all(), f"max error {error.max().item():.3e}, at z = {Z[(error - bound).argmax()].item()}"


@pytest.mark.parametrize("surrogate", ALPHA_SURROGATES, ids=repr)
def test_alpha_gradients_are_derivatives_of_the_primitive(surrogate):
    name, a, eps = type(surrogate).__name__, surrogate.alpha, FD_STEP
    g = PRIMITIVES[name]
    by_alpha = (g(Z, a + eps) - g(Z, a - eps)) / (2 * eps)
    by_z = (g(Z + eps, a) - g(Z - eps, a)) / (2 * eps)
    assert_within(surrogate.torch_alpha_grad(Z), by_alpha, FD_ROUNDING)
    assert_within(sympy_alpha_values(surrogate, Z), by_alpha, FD_ROUNDING)
    kink = FD_KINK[name](a) * eps if name in FD_KINK else 0.0
    assert_within(surrogate.torch_grad(Z), by_z, FD_ROUNDING + kink * (Z == 0))  # the same primitive as dg/dz


def test_custom_primitive_with_alpha():
    custom = sg.Custom(lambda z, a: flexgen.atan(math.pi / 2 * a * z) / math.pi + 0.5, alpha=1.5, learnable_alpha=True)
    reference = sg.ATan(alpha=1.5)
    torch.testing.assert_close(custom.torch_grad(Z), reference.torch_grad(Z), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(custom.torch_alpha_grad(Z), reference.torch_alpha_grad(Z), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sympy_alpha_values(custom, Z), sympy_alpha_values(reference, Z), rtol=1e-12, atol=1e-14)
    assert custom.key().endswith("alpha=learnable)")
    assert sg.Custom(lambda z, a: flexgen.sigmoid(a * z), alpha=2.0).key() != sg.Custom(lambda z, a: flexgen.sigmoid(a * z), alpha=3.0).key()


def test_learnable_alpha_keys_leave_the_value_out():
    assert sg.Sigmoid(alpha=2.0, learnable_alpha=True) == sg.Sigmoid(alpha=5.0, learnable_alpha=True)
    assert sg.Sigmoid(alpha=2.0, learnable_alpha=True) != sg.Sigmoid(alpha=2.0)
    assert repr(sg.ATan(learnable_alpha=True)) == "ATan(alpha=2.0, learnable_alpha=True)"


def test_learnable_alpha_bad_inputs():
    with pytest.raises(TypeError, match="unexpected keyword"):  # no alpha to learn
        sg.PiecewiseLeakyReLU(learnable_alpha=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        sg.FastSigmoid(learnable_alpha=True)
    with pytest.raises(TypeError, match="True or False"):
        sg.Sigmoid(learnable_alpha="yes")
    with pytest.raises(ValueError, match="no alpha parameter"):
        sg.Custom(lambda z: flexgen.sigmoid(z), learnable_alpha=True)
    with pytest.raises(ValueError, match="no alpha argument"):
        sg.Custom(lambda z: flexgen.sigmoid(z)).alpha_derivative(sympy.Symbol("z"))
    with pytest.raises(ValueError, match=r"expression in z and alpha"):
        sg.Custom(lambda z, a: flexgen.sigmoid(a * z) + sympy.Symbol("q"), alpha=1.0)
    with pytest.raises(flexgen.SpecError, match="must belong to a layer"):
        flexgen.spike(torch.zeros(2), sg.Sigmoid(learnable_alpha=True))
    with pytest.raises(TypeError, match="Surrogate"):
        flexgen.spike(torch.zeros(2), torch.sigmoid)


def test_learnable_alpha_surrogate_created_inside_the_step_is_a_spec_error():
    @flexgen.neuron(states=("v",))
    def inline(x, v):
        s = flexgen.spike(v + x - 1.0, sg.Sigmoid(learnable_alpha=True))
        return s, v + x - s

    with pytest.raises(flexgen.SpecError, match="must belong to a layer"):
        inline.trace()


def test_learnable_alpha_parameter_name_clash_is_a_spec_error():
    @flexgen.neuron(states=("v",))
    def clash(x, v, surrogate_alpha=1.0, surrogate=sg.Sigmoid()):
        s = flexgen.spike(v + x - surrogate_alpha, surrogate)
        return s, v + x - s

    with pytest.raises(flexgen.SpecError, match="already has a parameter"):
        clash(surrogate=sg.Sigmoid(learnable_alpha=True), backend="torch")


KERNEL_ALPHA_SURROGATES = [
    sg.Sigmoid(alpha=2.5, learnable_alpha=True), sg.PiecewiseQuadratic(alpha=0.8, learnable_alpha=True),
    sg.SoftSign(learnable_alpha=True), sg.Erf(alpha=1.3, learnable_alpha=True), sg.SuperSpike(learnable_alpha=True),
    sg.Rect(alpha=0.6, learnable_alpha=True),
    sg.Custom(lambda z, a: flexgen.sigmoid(a * z) + 0.1 * flexgen.tanh(z), alpha=3.0, learnable_alpha=True),
]


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("surrogate", KERNEL_ALPHA_SURROGATES, ids=repr)
def test_learnable_alpha_in_generated_kernels(device, backend, surrogate):
    """The kernels' alpha gradient (summed over neurons and steps) matches the eager spike's."""
    x, upstream = _probe_inputs(11, device)
    results = []
    for b in (backend, "eager"):
        alpha = torch.tensor(surrogate.alpha, dtype=torch.float64, device=device, requires_grad=True)
        (s,), (v,) = _probe.apply(x, backend=b, surrogate=surrogate, surrogate_alpha=alpha)
        results.append((s, v, *torch.autograd.grad((s * upstream).sum() + v.sum(), [x, alpha])))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert results[0][3].abs() > 0
