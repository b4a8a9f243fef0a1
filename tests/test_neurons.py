"""IF / LIF / PLIF against an independent, hand-written torch implementation of SpikingJelly's equations."""
import math

import pytest
import torch

import flexgen
from conftest import device_backends, max_rel_err
from reference import RefSpike, RefSpikeAlpha, atan_grad, atan_grads, sigmoid_grad, sigmoid_grads
from flexgen.neurons import if_step, lif_step, plif_step

# The reference computes the same equations op by op; the kernels fuse and reorder them: float64 agrees to
# rounding, float32 to its rounding amplified over the steps.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


SURROGATES = {"sigmoid": (flexgen.surrogate.Sigmoid(), sigmoid_grad), "atan": (flexgen.surrogate.ATan(), atan_grad)}
LEARNABLE_ALPHA = {  # alpha away from the defaults, so a value baked in by mistake shows
    "sigmoid": (flexgen.surrogate.Sigmoid(alpha=3.0, learnable_alpha=True), sigmoid_grads),
    "atan": (flexgen.surrogate.ATan(alpha=1.5, learnable_alpha=True), atan_grads),
}


def reference(kind, x_seq, v, *, v_threshold, v_reset, decay_input, detach_reset, grad_fn, tau=None, w=None, alpha=None):
    """SpikingJelly's node equations, step by step; returns (spikes [T, ...], v after each step [T, ...]).

    With `alpha` (a tensor), `grad_fn(z, alpha)` gives the surrogate's (dg/dz, dg/dalpha).
    """
    v_rest = 0.0 if v_reset is None else v_reset
    spikes, vs = [], []
    for x in x_seq:
        if kind == "IF":
            h = v + x
        else:
            k = 1.0 / tau if kind == "LIF" else torch.sigmoid(w)
            h = v + (x - (v - v_rest)) * k if decay_input else v - (v - v_rest) * k + x
        s = RefSpike.apply(h - v_threshold, grad_fn) if alpha is None else RefSpikeAlpha.apply(h - v_threshold, alpha, grad_fn)
        s_r = s.detach() if detach_reset else s
        v = h - s_r * v_threshold if v_reset is None else h * (1.0 - s_r) + v_reset * s_r
        spikes.append(s)
        vs.append(v)
    return torch.stack(spikes), torch.stack(vs)


def rel_err(a, b):
    return max_rel_err(a, b)


def _grid():
    cases = []
    for decay in (True, False):
        for v_reset in (-0.2, None):
            for detach in (False, True):
                for sur in ("sigmoid", "atan"):
                    cases.append(("LIF", decay, v_reset, detach, sur))
                alternate = "atan" if (decay ^ detach) else "sigmoid"
                cases.append(("PLIF", decay, v_reset, detach, alternate))
                if decay:
                    cases.append(("IF", None, v_reset, detach, "sigmoid" if detach else "atan"))
    cases += [  # learnable alpha
        ("LIF", True, -0.2, False, "sigmoid", True), ("LIF", False, None, True, "atan", True),
        ("PLIF", True, None, False, "atan", True), ("PLIF", False, -0.2, True, "sigmoid", True),
        ("IF", None, -0.2, False, "atan", True),
    ]
    return [c if len(c) == 6 else c + (False,) for c in cases]


GRID = _grid()


def _case_id(case):
    kind, decay, v_reset, detach, sur, learn_alpha = case
    reset = "soft" if v_reset is None else "hard"
    decay = "" if decay is None else ("decay-" if decay else "nodecay-")
    return f"{kind}-{decay}{reset}-{'detach-' if detach else ''}{sur}{'-alpha' if learn_alpha else ''}"


def make_layer(kind, decay, v_reset, detach, surrogate, backend, dtype):
    common = dict(v_threshold=0.8, v_reset=v_reset, surrogate=surrogate, detach_reset=detach, backend=backend,
                  store_v_seq=True, step_mode="m")
    if kind == "IF":
        layer = flexgen.IF(**common)
    elif kind == "LIF":
        layer = flexgen.LIF(tau=1.7, decay_input=decay, **common)
    else:
        layer = flexgen.PLIF(init_tau=2.5, decay_input=decay, **common)
    return layer.to(dtype)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", GRID, ids=_case_id)
def test_options_grid_matches_reference(case, dtype, device, backend):
    kind, decay, v_reset, detach, sur, learn_alpha = case
    surrogate, grad_fn = (LEARNABLE_ALPHA if learn_alpha else SURROGATES)[sur]
    g = torch.Generator().manual_seed(len(GRID) + GRID.index(case))
    x = (torch.rand(3, 8, generator=g, dtype=dtype) * 3.0 - 0.4).to(device).requires_grad_()
    up_s, up_v = (torch.randn(3, 8, generator=g, dtype=dtype).to(device) for _ in range(2))

    layer = make_layer(kind, decay, v_reset, detach, surrogate, backend, dtype).to(device)
    s = layer(x)
    params = ([layer.w] if kind == "PLIF" else []) + ([layer.surrogate_alpha] if learn_alpha else [])
    assert [p for _, p in layer.named_parameters()] == params
    grads = torch.autograd.grad((s * up_s).sum() + (layer.v_seq * up_v).sum(), [x] + params)

    w = layer.w.detach().clone().requires_grad_() if kind == "PLIF" else None
    alpha = torch.tensor(surrogate.alpha, dtype=dtype, device=device, requires_grad=True) if learn_alpha else None
    v0 = torch.full((8,), 0.0 if v_reset is None else v_reset, dtype=dtype, device=device)
    s_ref, v_ref = reference(kind, x, v0, v_threshold=0.8, v_reset=v_reset, decay_input=decay, detach_reset=detach,
                             grad_fn=grad_fn, tau=1.7, w=w, alpha=alpha)
    ref_leaves = [x] + [p for p in (w, alpha) if p is not None]
    ref_grads = torch.autograd.grad((s_ref * up_s).sum() + (v_ref * up_v).sum(), ref_leaves)

    assert s.dtype == dtype and torch.equal(s, s_ref), "spikes differ from the reference"
    assert 0 < s.sum() < s.numel(), "the case should both fire and not fire"
    tol = TOL[dtype]
    assert rel_err(layer.v_seq, v_ref) <= tol and rel_err(layer.v, v_ref[-1]) <= tol
    for k, (got, ref) in enumerate(zip(grads, ref_grads)):
        # w's gradient is a sum over every neuron and step; in fp32 the kernels' summation order
        # (per-block partial sums) and autograd's differ, and the terms partly cancel.
        reduction_tol = 10 * tol if k > 0 and dtype == torch.float32 else tol
        assert ref.norm() > 0 and rel_err(got, ref) <= reduction_tol


def test_structural_options_are_specialisations():
    texts = {
        if_step.trace(soft_reset=s, detach_reset=d).text() for s in (False, True) for d in (False, True)
    }
    assert len(texts) == 4
    texts = {lif_step.trace(decay_input=k, surrogate=sur).text()
             for k in (False, True) for sur in (flexgen.surrogate.Sigmoid(), flexgen.surrogate.ATan())}
    assert len(texts) == 4
    assert set(plif_step.signature.static) == {"decay_input", "soft_reset", "detach_reset", "surrogate"}
    assert plif_step.signature.learnable == ("w",)
    assert flexgen.neurons.spec("LIF") is lif_step and flexgen.LIF.spec is lif_step


def test_soft_reset_maps_to_specialisation_and_starts_at_zero():
    layer = flexgen.LIF(v_reset=None, backend="eager")
    assert layer.static["soft_reset"] is True and layer.v_reset is None and layer.v == 0.0
    hard = flexgen.IF(v_reset=-0.5, backend="eager")
    assert hard.static["soft_reset"] is False and hard.v == -0.5


def test_initial_state_reset_and_single_step():
    layer = flexgen.LIF(tau=2.0, v_reset=-0.1, step_mode="s", backend="eager")
    x = torch.tensor([0.3, 2.5])
    s1 = layer(x)
    h = -0.1 + (x - 0.0) / 2.0  # v = v_reset initially: h = v + (x - (v - v_reset)) / tau
    assert torch.equal(s1, (h >= 1.0).float())
    torch.testing.assert_close(layer.v, torch.where(s1 > 0, torch.tensor(-0.1), h))
    layer(x)
    layer.reset()
    assert layer.v == -0.1
    torch.testing.assert_close(layer(x), s1)


def test_v_seq_needs_store_v_seq():
    layer = flexgen.IF(step_mode="m", backend="eager")
    layer(torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="store_v_seq=True"):
        layer.v_seq


def test_plif_w_initialisation_and_validation():
    layer = flexgen.PLIF(init_tau=4.0, backend="eager")
    assert isinstance(layer.w, torch.nn.Parameter)
    assert layer.w.item() == pytest.approx(-math.log(3.0))
    assert 1.0 / torch.sigmoid(layer.w).item() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="init_tau"):
        flexgen.PLIF(init_tau=1.0)


def test_surrogate_argument_checked_and_spikingjelly_alias():
    with pytest.raises(TypeError, match="Surrogate"):
        flexgen.LIF(surrogate=torch.sigmoid, backend="eager")
    layer = flexgen.LIF(surrogate_function=flexgen.surrogate.ATan(), backend="eager")
    assert layer.static["surrogate"] == flexgen.surrogate.ATan()


@pytest.mark.parametrize("device,backend", device_backends())
def test_plif_per_channel_parameters_get_per_channel_gradients(device, backend):
    """PLIF(per_channel=C): one w per channel (dim 2 of [T, B, C, H]), its gradient reduced per channel."""
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(3, 2, 4, 5, generator=g, dtype=torch.float64) * 3.0 - 0.4).to(device).requires_grad_()
    up = torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64).to(device)
    layer = flexgen.PLIF(init_tau=2.0, per_channel=4, step_mode="m", backend=backend)
    layer = layer.to(device=device, dtype=torch.float64)
    with torch.no_grad():
        layer.w.copy_(torch.tensor([-1.0, -0.3, 0.2, 0.9], dtype=torch.float64))
    assert layer.w.shape == (4,)
    s = layer(x)
    grads = torch.autograd.grad((s * up).sum(), [x, layer.w])

    # Independent reference: each channel is a scalar-w PLIF run by hand in eager torch.
    w_ref = layer.w.detach().clone().requires_grad_()
    v = torch.zeros(2, 4, 5, dtype=torch.float64, device=device)
    spikes = []
    k = torch.sigmoid(w_ref).reshape(4, 1)
    for t in range(3):
        h = v + (x[t] - v) * k
        s_t = RefSpike.apply(h - 1.0, sigmoid_grad)
        v = h * (1.0 - s_t)
        spikes.append(s_t)
    s_ref = torch.stack(spikes)
    ref = torch.autograd.grad((s_ref * up).sum(), [x, w_ref])
    assert torch.equal(s, s_ref)
    for got, want in zip(grads, ref):
        assert rel_err(got, want) <= TOL[torch.float64]


@pytest.mark.parametrize("device,backend", device_backends())
def test_per_channel_learnable_alpha(device, backend):
    """PLIF(per_channel=C, surrogate=...(learnable_alpha=True)): w and the surrogate's alpha per channel."""
    g = torch.Generator().manual_seed(8)
    x = (torch.rand(3, 2, 4, 5, generator=g, dtype=torch.float64) * 3.0 - 0.4).to(device).requires_grad_()
    up = torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64).to(device)
    surrogate = flexgen.surrogate.ATan(alpha=1.5, learnable_alpha=True)
    layer = flexgen.PLIF(init_tau=2.0, per_channel=4, surrogate=surrogate, step_mode="m", backend=backend)
    layer = layer.to(device=device, dtype=torch.float64)
    with torch.no_grad():
        layer.surrogate_alpha.copy_(torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64))
    assert layer.w.shape == layer.surrogate_alpha.shape == (4,)
    assert set(layer.state_dict()) == {"w", "surrogate_alpha"}
    s = layer(x)
    grads = torch.autograd.grad((s * up).sum(), [x, layer.w, layer.surrogate_alpha])

    w_ref, a_ref = (p.detach().clone().requires_grad_() for p in (layer.w, layer.surrogate_alpha))
    v = torch.zeros(2, 4, 5, dtype=torch.float64, device=device)
    spikes = []
    for t in range(3):
        h = v + (x[t] - v) * torch.sigmoid(w_ref).reshape(4, 1)
        s_t = RefSpikeAlpha.apply(h - 1.0, a_ref.reshape(4, 1), atan_grads)
        v = h * (1.0 - s_t)
        spikes.append(s_t)
    ref = torch.autograd.grad((torch.stack(spikes) * up).sum(), [x, w_ref, a_ref])
    assert torch.equal(s, torch.stack(spikes))
    for got, want in zip(grads, ref):
        assert want.norm() > 0 and rel_err(got, want) <= TOL[torch.float64]


def test_per_channel_parameter_must_match_the_channel_dim():
    layer = flexgen.PLIF(per_channel=3, step_mode="m", backend="torch")
    with pytest.raises(ValueError, match="one per channel"):
        layer(torch.rand(2, 1, 4, 5))
