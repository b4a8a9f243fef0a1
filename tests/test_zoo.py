"""The neuron zoo against hand-written torch steps of the published equations, and the registry."""
import doctest
import math
import re
import warnings

import pytest
import torch

import flexgen
from conftest import HAS_C_COMPILER, device_backends, max_rel_err
from reference import RefSpike, atan_grad, sigmoid_grad
from flexgen.neurons import continuous, zoo


def fire(z, grad_fn=sigmoid_grad):
    return RefSpike.apply(z, grad_fn)


def ref_alif(x, v, a, p):
    alpha, rho = math.exp(-1.0 / p["tau"]), math.exp(-1.0 / p["tau_a"])
    h = alpha * v + (1 - alpha) * x
    b = 1.0 + p["beta"] * a
    z = fire(h - b)
    return [z], [h - z * b, rho * a + (1 - rho) * z]


def fire_above(z, grad_fn):
    """[z > 0] (snnTorch's step), with grad_fn's (symmetric) gradient."""
    return 1.0 - RefSpike.apply(-z, grad_fn)


def ref_synaptic(x, syn, mem, p):
    r = fire_above(mem - 1.0, atan_grad).detach()
    syn = p["alpha"] * syn + x
    mem = p["beta"] * mem + syn - r
    return [fire_above(mem - 1.0, atan_grad)], [syn, mem]


def ref_izhikevich(x, v, u, p):
    a, b, c, d, dt = 0.02, 0.2, -65.0, 8.0, p["dt"]
    v_next = v + dt * (0.04 * v**2 + 5 * v + 140 - u + x)
    u_next = u + dt * a * (b * v - u)
    z = fire(v_next - 30.0)
    return [z], [v_next * (1 - z) + c * z, u_next + d * z]


def ref_qif(x, v, p):
    h = v + (x + (v - 0.0) * (v - 0.8)) / 2.0
    z = fire(h - 1.0)
    return [z], [h * (1 - z) - 0.1 * z]


def ref_eif(x, v, p):
    h = v + (x + 0.0 - v + torch.exp(v - 0.8)) / 2.0
    z = fire(h - 1.0)
    return [z], [h * (1 - z) - 0.1 * z]


def ref_adex(x, v, w, p):
    C, gL, EL, VT, DT, tauw, a, b, dt = 0.281, 0.03, -70.6, -50.4, 2.0, 144.0, 0.004, 0.0805, 0.1
    dv = (-gL * (v - EL) + gL * DT * torch.exp((v - VT) / DT) - w + x) / C
    dw = (a * (v - EL) - w) / tauw
    v_next, w_next = v + dt * dv, w + dt * dw
    z = fire(v_next - 20.0)
    return [z], [v_next * (1 - z) + EL * z, w_next + b * z]


def ref_resonate(x, u, v, p):
    zc = torch.complex(u, v)  # z' = (b + i omega) z + x, in complex arithmetic
    zc = zc + 0.1 * (complex(-0.1, 2 * math.pi) * zc + x)
    z = fire(zc.imag - 1.0)
    return [z], [zc.real * (1 - z), zc.imag * (1 - z)]


def ref_adaptive_mix(x, y, v, a, p):
    h = v + (x - v) / 2.0
    theta = 1.0 + 0.5 * a
    s = fire(h - theta, atan_grad)
    m = torch.sigmoid(y)
    return [s, h], [m * h * (1 - s) + (1 - m) * (h - s * theta), a + (s - a) / 4.0]


# name -> (spec, reference step, input ranges, initial-state ranges, params passed to both)
CASES = {
    "ALIF": (zoo.alif, ref_alif, [(0.0, 3.0)], [(0.0, 0.5), (0.0, 0.5)], {"tau": 2.0, "tau_a": 5.0, "beta": 1.8}),
    "Synaptic": (zoo.synaptic, ref_synaptic, [(-0.2, 0.8)], [(0.0, 0.5), (0.0, 1.3)], {"alpha": 0.7, "beta": 0.6}),
    "Izhikevich": (zoo.izhikevich, ref_izhikevich, [(0.0, 15.0)], [(-70.0, 25.0), (-15.0, -5.0)], {"dt": 0.5}),
    "QIF": (zoo.qif, ref_qif, [(0.0, 2.0)], [(-0.1, 0.9)], {}),
    "EIF": (zoo.eif, ref_eif, [(0.0, 2.0)], [(-0.1, 0.9)], {}),
    "AdEx": (zoo.adex, ref_adex, [(0.0, 2.0)], [(-55.0, -38.0), (0.0, 0.1)], {}),
    "ResonateAndFire": (zoo.resonate_and_fire, ref_resonate, [(0.0, 20.0)], [(-0.5, 0.5), (-0.5, 0.5)], {}),
    "AdaptiveMix": (zoo.adaptive_mix, ref_adaptive_mix, [(0.0, 3.0), (-2.0, 2.0)], [(0.0, 0.5), (0.0, 0.5)], {}),
}


def uniform(shape, low, high, g):
    return torch.rand(*shape, generator=g, dtype=torch.float64) * (high - low) + low


def run_reference(ref, inputs, states, params):
    outputs = []
    for t in range(inputs[0].shape[0]):
        outs, states = ref(*[x[t] for x in inputs], *states, params)
        outputs.append(outs)
    return [torch.stack([o[k] for o in outputs]) for k in range(len(outputs[0]))], states


def rel_err(a, b):
    return max_rel_err(a, b)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_published_equations(name, device, backend):
    check_against_published_equations(name, device, backend, "auto")


@pytest.mark.skipif(not HAS_C_COMPILER, reason="needs a C compiler")
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_both_designs_of_the_c_kernels_match_published_equations(name, recompute):
    """backend="auto" picks one design per neuron; here each neuron runs both (their C compiles, too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the C kernels run: no fallback message
        check_against_published_equations(name, "cpu", "c", recompute)


def check_against_published_equations(name, device, backend, recompute):
    spec, ref, input_ranges, state_ranges, params = CASES[name]
    g = torch.Generator().manual_seed(sorted(CASES).index(name))
    T, N = 6, 8
    inputs = [uniform((T, N), lo, hi, g).to(device).requires_grad_() for lo, hi in input_ranges]
    states = [uniform((N,), lo, hi, g).to(device).requires_grad_() for lo, hi in state_ranges]
    outputs, finals = spec.apply(*inputs, states=states, backend=backend, recompute=recompute, **params)
    ref_outputs, ref_finals = run_reference(ref, inputs, states, params)

    assert len(outputs) == len(ref_outputs) and len(finals) == len(ref_finals)
    spikes = outputs[0]
    assert torch.equal(spikes, ref_outputs[0]), "spikes differ from the published equations"
    assert 0 < spikes.sum() < spikes.numel(), "the case should both fire and not fire"
    for got, want in zip(outputs[1:] + finals, ref_outputs[1:] + ref_finals):
        assert rel_err(got, want) <= 1e-12  # float64: the same equations, reordered by the generator

    weights = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(device) for o in ref_outputs + ref_finals]
    leaves = inputs + states

    def loss(outs, fins):
        return sum((o * w).sum() for o, w in zip(list(outs) + list(fins), weights))

    grads = torch.autograd.grad(loss(outputs, finals), leaves)
    ref_grads = torch.autograd.grad(loss(ref_outputs, ref_finals), leaves)
    for got, want in zip(grads, ref_grads):
        assert want.norm() > 0
        assert rel_err(got, want) <= 1e-12  # float64: the same equations, reordered by the generator


def test_available_lists_every_bundled_neuron():
    names = flexgen.neurons.available()
    assert set(names) == {"IF", "LIF", "PLIF"} | set(CASES) | set(continuous.BUNDLED)
    for name, entry in names.items():
        assert flexgen.neurons.get(name) is entry
        assert flexgen.neurons.get(name.upper()) is entry
        assert isinstance(flexgen.neurons.spec(name), flexgen.NeuronSpec)
    assert flexgen.neurons.get("LIF") is flexgen.LIF and flexgen.IF.spec is flexgen.neurons.if_step
    with pytest.raises(KeyError, match="available: IF, LIF"):
        flexgen.neurons.get("HodgkinHuxley")


def test_every_bundled_neuron_says_where_it_fires():
    for name in flexgen.neurons.available():
        doc = flexgen.neurons.spec(name).__doc__
        assert re.search(r"Fires where\s+\S+ (>=|>) \S+", doc), name


@pytest.mark.parametrize("device,backend", device_backends())
def test_synaptic_fires_above_the_threshold_not_on_it(device, backend):
    """snnTorch's Synaptic fires on mem > threshold: from rest, x = 1 lands mem exactly on 1 and does not fire."""
    x = torch.tensor([[1.0], [1.0]], dtype=torch.float64, device=device)
    (s,), (syn, mem) = zoo.synaptic.apply(x, backend=backend, alpha=0.5, beta=0.5)
    assert s.flatten().tolist() == [0.0, 1.0]  # step 2: syn = 1.5, mem = 0.5 + 1.5 = 2
    assert syn.item() == 1.5 and mem.item() == 2.0


@pytest.mark.parametrize("name", sorted(CASES))
def test_docstring_has_equations_source_and_runs(name):
    spec = CASES[name][0]
    doc = spec.__doc__
    assert "Θ(" in doc and any(c.isdigit() for c in doc.split("\n")[0] + doc)
    test = doctest.DocTestParser().get_doctest(doc, dict(vars(zoo)), name, None, 0)
    assert test.examples
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test, out=lambda text: None)
    assert runner.summarize(verbose=False).failed == 0


def test_zoo_layers_keep_state_between_calls():
    layer = zoo.izhikevich(backend="eager")
    assert layer.v == -65.0 and layer.u == -13.0
    layer(torch.full((5, 3), 10.0))
    first = layer.v.clone()
    layer(torch.full((5, 3), 10.0))
    assert not torch.equal(layer.v, first)
    layer.reset()
    assert layer.v == -65.0
