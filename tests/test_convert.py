"""flexgen.convert against the peers themselves: snnTorch's neurons step by step (both call styles), atomicity,
the report, checkpoints both ways, dtype and device, and whole models (snnTorch's tutorial networks,
SpikingJelly's spiking ResNet) with the same spikes and gradients."""
import copy
import logging

import pytest
import torch

import flexgen
from conftest import device_backends, max_rel_err

snn = pytest.importorskip("snntorch")
from snntorch import surrogate as snn_surrogate  # noqa: E402

T = 6


def rel_err(a, b):
    return max_rel_err(a, b)


# snnTorch's spikes are float32 in a float64 model, so the gradient that reaches its surrogate's backward, and the
# surrogate gradient it returns, are rounded to float32 (relative 6e-8 each) before they flow back in float64.
SNNTORCH_FLOAT32_GRADIENTS = 1e-6


STATES = {"Leaky": ("mem",), "Lapicque": ("mem",), "Synaptic": ("syn", "mem"), "Alpha": ("syn_exc", "syn_inh", "mem"),
          "RLeaky": ("mem",), "RSynaptic": ("syn", "mem")}


def peer_name(layer):
    return getattr(layer, "peer", type(layer).__name__)


def state_names(layer):
    return STATES[peer_name(layer)]


def is_recurrent(layer):
    return peer_name(layer) in ("RLeaky", "RSynaptic")


def run_steps(layer, x, initial):
    """Step `layer` over x[t] the way its options ask for; per step the spikes and the states. A recurrent
    layer's previous spikes are passed back in first, as snnTorch's tutorials do (`initial` starts with them)."""
    names = state_names(layer)
    carried, spikes, trace = list(initial), [], []
    for t in range(x.shape[0]):
        if layer.init_hidden:
            out = layer(x[t])
            spk = out[0] if layer.output else out
            states = [getattr(layer, n) for n in names]
        else:
            spk, *states = layer(x[t], *carried) if carried else layer(x[t])
            carried = [spk, *states] if is_recurrent(layer) else states
        spikes.append(spk)
        trace.append(states)
    return torch.stack(spikes), [torch.stack([s[i] for s in trace]) for i in range(len(names))]


def feed_float64_spikes(ref):
    """snnTorch's spikes are float32 whatever the model's dtype, which its own float64 recurrent nn.Linear or
    Conv2d refuses from the second step on: cast them on the way in (exact for 0/1 spikes). The module, its
    tensors and its update stay snnTorch's."""
    recurrent = getattr(ref, "recurrent", None)
    if isinstance(recurrent, (torch.nn.Linear, torch.nn.Conv2d)):
        recurrent.register_forward_pre_hook(lambda module, args: (args[0].to(module.weight.dtype),))


def compare_with_snntorch(make, backend, shape=(3, 4), initial_states=True, device="cpu"):
    """The converted layer against snnTorch's own on the same float64 inputs: spikes equal, states to float64's
    rounding (1e-12 relative), the gradients of inputs, initial states and learnt parameters to float32's
    (`SNNTORCH_FLOAT32_GRADIENTS`)."""
    torch.manual_seed(0)
    ref = make().double().to(device)
    new = flexgen.convert(copy.deepcopy(ref), backend=backend)
    assert type(new).__module__ == "flexgen.interop.peers.snntorch"
    feed_float64_spikes(ref)
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(T, *shape, generator=g, dtype=torch.float64) * 1.6 - 0.3).to(device).requires_grad_()
    names = state_names(ref)
    initial = []
    if initial_states and not ref.init_hidden:
        carried = ("spk", *names) if is_recurrent(ref) else names
        initial = [(torch.rand(shape, generator=g, dtype=torch.float64) * 0.8).to(device).requires_grad_() for _ in carried]
    weights = [torch.randn(T, *shape, generator=g, dtype=torch.float64).to(device) for _ in range(len(names) + 1)]

    def loss_and_grads(layer):
        spikes, states = run_steps(layer, x, initial)
        loss = sum((o * w).sum() for o, w in zip([spikes, *states], weights))
        params = [p for _, p in sorted(layer.named_parameters()) if p.requires_grad]  # learn_recurrent=False: frozen
        return spikes, states, params, torch.autograd.grad(loss, [x, *initial, *params], allow_unused=True)

    spikes, states, params, grads = loss_and_grads(new)
    ref_spikes, ref_states, ref_params, ref_grads = loss_and_grads(ref)
    assert [p.shape for p in params] == [p.shape for p in ref_params] and len(params) == sum(p.requires_grad for p in ref.parameters())
    assert torch.equal(spikes, ref_spikes.to(spikes.dtype))  # snnTorch's spikes are float32 in a float64 model
    assert 0 < spikes.count_nonzero() < spikes.numel(), "the case should both fire and not fire"
    for got, want in zip(states, ref_states):
        assert got.dtype == want.dtype and rel_err(got, want) <= 1e-12
    for got, want in zip(grads, ref_grads):
        if want is None:  # a parameter snnTorch's update does not read (Lapicque's beta)
            assert got is None or got.abs().max() == 0
        else:
            assert got.shape == want.shape and rel_err(got, want) <= SNNTORCH_FLOAT32_GRADIENTS
    return new


LEAKY_CASES = {
    "subtract": dict(beta=0.8, threshold=0.7),
    "zero-learn-beta": dict(beta=0.8, reset_mechanism="zero", learn_beta=True),
    "none-learn-threshold": dict(beta=0.7, reset_mechanism="none", learn_threshold=True, threshold=1.5),
    "graded": dict(beta=0.9, graded_spikes_factor=2.5, learn_graded_spikes_factor=True, learn_beta=True),
    "output-hidden": dict(beta=0.8, init_hidden=True, output=True, learn_beta=True),
    "hidden": dict(beta=0.8, init_hidden=True, learn_threshold=True),
    "no-reset-delay": dict(beta=0.8, reset_delay=False, learn_beta=True, learn_threshold=True),
    "zero-no-reset-delay": dict(beta=0.8, reset_mechanism="zero", reset_delay=False, learn_beta=True),
    "sigmoid": dict(beta=0.8, spike_grad=snn_surrogate.sigmoid(slope=5), learn_beta=True),
    "fast-sigmoid": dict(beta=0.8, spike_grad=snn_surrogate.fast_sigmoid(slope=10), learn_threshold=True),
    "atan": dict(beta=0.8, spike_grad=snn_surrogate.atan(alpha=3.0), learn_beta=True),
    "out-of-range-beta": dict(beta=1.3, threshold=2.0, learn_beta=True),
}


@pytest.mark.parametrize("case", sorted(LEAKY_CASES))
def test_leaky_matches_snntorch(case):
    compare_with_snntorch(lambda: snn.Leaky(**LEAKY_CASES[case]), "torch")


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("case", ["zero-learn-beta", "graded", "no-reset-delay"])
def test_leaky_matches_snntorch_on_every_backend(case, device, backend):
    compare_with_snntorch(lambda: snn.Leaky(**LEAKY_CASES[case]), backend, device=device)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("beta_shape", [(4,), (4, 3)], ids=["per-channel", "per-neuron"])
def test_leaky_with_a_beta_per_neuron_matches_snntorch(beta_shape, device, backend):
    """snnTorch's beta may hold one value per neuron; 1-d, it broadcasts against the last dim as in torch."""
    beta = torch.linspace(0.5, 0.95, int(torch.tensor(beta_shape).prod())).reshape(beta_shape)
    shape = (2, 4) if len(beta_shape) == 1 else (2, 4, 3)
    new = compare_with_snntorch(lambda: snn.Leaky(beta=beta, learn_beta=True), backend, shape=shape, device=device)
    assert new.beta.shape == beta_shape


def test_leaky_1d_beta_against_the_last_dim_of_a_conv_step():
    """A [W] beta on [B, C, H, W] steps: torch broadcasting (the last dim), not flexgen's per-channel reading."""
    compare_with_snntorch(lambda: snn.Leaky(beta=torch.tensor([0.6, 0.7, 0.9]), learn_beta=True), "torch",
                          shape=(2, 3, 2, 3))


SYNAPTIC_CASES = {
    "subtract": dict(alpha=0.9, beta=0.8, learn_alpha=True),
    "zero": dict(alpha=0.8, beta=0.7, reset_mechanism="zero", learn_beta=True, learn_threshold=True),
    "none-hidden": dict(alpha=0.9, beta=0.6, reset_mechanism="none", init_hidden=True, learn_alpha=True),
    "output-hidden-no-delay": dict(alpha=0.9, beta=0.8, init_hidden=True, output=True, reset_delay=False,
                                   learn_beta=True),
}


@pytest.mark.parametrize("case", sorted(SYNAPTIC_CASES))
def test_synaptic_matches_snntorch(case):
    compare_with_snntorch(lambda: snn.Synaptic(**SYNAPTIC_CASES[case]), "torch")


ALPHA_CASES = {  # snnTorch's own Alpha cannot learn alpha (it reassigns the Parameter)
    "zero": dict(alpha=0.9, beta=0.8, learn_beta=True),
    "subtract": dict(alpha=0.9, beta=0.7, reset_mechanism="subtract", learn_threshold=True),
    "none-hidden": dict(alpha=0.95, beta=0.8, reset_mechanism="none", init_hidden=True, output=True, learn_beta=True),
}


@pytest.mark.parametrize("case", sorted(ALPHA_CASES))
def test_alpha_matches_snntorch(case):
    compare_with_snntorch(lambda: snn.Alpha(**ALPHA_CASES[case]), "torch")


LAPICQUE_CASES = {
    "beta": dict(beta=0.9, threshold=0.3, learn_threshold=True),  # R and time_step are integer buffers here
    "rc-zero": dict(R=5.0, C=0.2, time_step=0.1, reset_mechanism="zero"),
    "beta-c-hidden": dict(beta=0.8, C=0.5, init_hidden=True, output=True, learn_threshold=True),
}


@pytest.mark.parametrize("case", sorted(LAPICQUE_CASES))
def test_lapicque_matches_snntorch(case):
    compare_with_snntorch(lambda: snn.Lapicque(**LAPICQUE_CASES[case]), "torch")


RLEAKY_CASES = {
    "subtract": dict(beta=0.8, linear_features=4),
    "zero-learn-beta": dict(beta=0.8, linear_features=4, reset_mechanism="zero", learn_beta=True),
    "none-learn-threshold": dict(beta=0.7, linear_features=4, reset_mechanism="none", learn_threshold=True,
                                 threshold=1.5),
    "fixed-recurrent": dict(beta=0.8, linear_features=4, learn_recurrent=False, learn_threshold=True),
    "one-to-one": dict(beta=0.8, all_to_all=False, V=0.5, learn_beta=True),
    "one-to-one-per-neuron-zero": dict(beta=0.8, all_to_all=False, V=torch.tensor([0.5, -0.75, 1.0, 0.25]),
                                       reset_mechanism="zero", learn_threshold=True),
    "one-to-one-fixed": dict(beta=0.9, all_to_all=False, V=0.25, learn_recurrent=False),
    "no-reset-delay": dict(beta=0.8, linear_features=4, reset_delay=False, learn_beta=True, learn_threshold=True),
    "zero-no-reset-delay": dict(beta=0.8, all_to_all=False, V=0.5, reset_mechanism="zero", reset_delay=False),
    "hidden": dict(beta=0.8, linear_features=4, init_hidden=True, learn_threshold=True),
    "output-hidden": dict(beta=0.8, all_to_all=False, V=-0.5, init_hidden=True, output=True, learn_beta=True),
    "sigmoid": dict(beta=0.8, linear_features=4, spike_grad=snn_surrogate.sigmoid(slope=5), learn_beta=True),
}


@pytest.mark.parametrize("case", sorted(RLEAKY_CASES))
def test_rleaky_matches_snntorch(case):
    compare_with_snntorch(lambda: snn.RLeaky(**RLEAKY_CASES[case]), "torch")


RSYNAPTIC_CASES = {
    "subtract": dict(alpha=0.9, beta=0.7, linear_features=4, learn_alpha=True),
    "zero": dict(alpha=0.8, beta=0.8, linear_features=4, reset_mechanism="zero", learn_beta=True, learn_threshold=True),
    "none-fixed-recurrent": dict(alpha=0.7, beta=0.9, linear_features=4, reset_mechanism="none", learn_recurrent=False),
    "one-to-one": dict(alpha=0.8, beta=0.7, all_to_all=False, V=torch.tensor([0.5, -1.0, 0.25, 2.0]), learn_alpha=True),
    "output-hidden": dict(alpha=0.8, beta=0.7, linear_features=4, init_hidden=True, output=True, learn_beta=True),
}


@pytest.mark.parametrize("case", sorted(RSYNAPTIC_CASES))
def test_rsynaptic_matches_snntorch(case):
    compare_with_snntorch(lambda: snn.RSynaptic(**RSYNAPTIC_CASES[case]), "torch")


def test_convolutional_rleaky_matches_snntorch():
    compare_with_snntorch(lambda: snn.RLeaky(beta=0.8, conv2d_channels=2, kernel_size=3), "torch", shape=(2, 2, 3, 3))


@pytest.mark.parametrize("peer", ["RLeaky", "RSynaptic"])
def test_recurrent_layers_match_snntorch_in_float32_as_it_runs(peer):
    """Without the float64 cast: snnTorch's all-to-all recurrent layers as they run, in float32."""
    torch.manual_seed(2)
    ref = snn.RLeaky(beta=0.8, linear_features=5) if peer == "RLeaky" else snn.RSynaptic(0.8, 0.7, linear_features=5)
    new = flexgen.convert(copy.deepcopy(ref), backend="torch")
    x = (torch.rand(T, 3, 5) * 1.5).requires_grad_()
    ref_spikes, ref_states = run_steps(ref, x, [])
    spikes, states = run_steps(new, x, [])
    assert torch.equal(spikes, ref_spikes) and 0 < spikes.sum() < spikes.numel()
    for got, want in zip(states, ref_states):
        assert rel_err(got, want) <= 1e-6
    weights = torch.randn_like(ref_states[-1])
    wanted = torch.autograd.grad((ref_spikes.sum() + (ref_states[-1] * weights).sum()), [x, ref.recurrent.weight])
    got = torch.autograd.grad((spikes.sum() + (states[-1] * weights).sum()), [x, new.recurrent.weight])
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(got, wanted))


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("peer", ["RLeaky", "RSynaptic"])
def test_recurrent_layers_match_snntorch_on_every_backend(peer, device, backend):
    cases = {"RLeaky": (snn.RLeaky, RLEAKY_CASES["zero-learn-beta"]), "RSynaptic": (snn.RSynaptic, RSYNAPTIC_CASES["zero"])}
    make, options = cases[peer]
    compare_with_snntorch(lambda: make(**options), backend, device=device)


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("peer", ["Synaptic", "Alpha", "Lapicque"])
def test_synaptic_alpha_lapicque_match_snntorch_on_every_backend(peer, device, backend):
    cases = {"Synaptic": SYNAPTIC_CASES["zero"], "Alpha": ALPHA_CASES["subtract"], "Lapicque": LAPICQUE_CASES["rc-zero"]}
    compare_with_snntorch(lambda: getattr(snn, peer)(**cases[peer]), backend, device=device)


@pytest.mark.parametrize("peer", ["Leaky", "Synaptic", "Alpha", "Lapicque"])
def test_fires_strictly_above_the_threshold_like_snntorch(peer):
    """An input that lands the membrane exactly on the threshold does not fire (snnTorch: mem > threshold)."""
    make = {  # after one step of x = 1 from rest, mem is exactly the threshold
        "Leaky": lambda: snn.Leaky(beta=0.5),  # mem = 1
        "Synaptic": lambda: snn.Synaptic(alpha=0.5, beta=0.5),  # syn = 1, mem = 1
        "Alpha": lambda: snn.Alpha(alpha=0.5, beta=0.25, threshold=0.0),  # mem = 2 (x - x) = 0
        "Lapicque": lambda: snn.Lapicque(R=1.0, C=1.0, time_step=1.0),  # mem = x
    }[peer]
    ref = make().double()
    new = flexgen.convert(copy.deepcopy(ref), backend="torch")
    assert isinstance(new, flexgen.NeuronModule)
    x = torch.tensor([[1.0], [1.0]], dtype=torch.float64)
    ref_spikes, ref_states = run_steps(ref, x, [])
    spikes, states = run_steps(new, x, [])
    assert ref_states[-1][0].item() == states[-1][0].item() == ref.threshold.item()  # exactly on it
    assert ref_spikes[0].item() == spikes[0].item() == 0.0
    assert torch.equal(spikes, ref_spikes)


# ---- the tutorial call style --------------------------------------------------


def test_tutorial_style_init_and_state_passing():
    leaky = flexgen.convert(snn.Leaky(beta=0.9), backend="torch")
    mem = leaky.init_leaky()
    assert mem.shape == (0,)  # snnTorch's empty state: replaced by zeros of the first input's shape
    spk, mem = leaky(torch.full((2, 3), 0.6), mem)
    assert torch.equal(mem, torch.full((2, 3), 0.6)) and spk.sum() == 0
    spk, mem = leaky(torch.full((2, 3), 0.6), mem=mem)
    assert spk.sum() == 6 and torch.allclose(mem, torch.full((2, 3), 1.14))
    assert torch.equal(leaky.init_leaky(), torch.zeros(2, 3))  # zeros of the last state's shape, as snnTorch
    spk, mem = leaky(torch.full((2, 3), 0.6))  # no state passed: the layer's own (reset by init_leaky)
    assert torch.equal(mem, torch.full((2, 3), 0.6))
    syn = flexgen.convert(snn.Synaptic(alpha=0.5, beta=0.5), backend="torch")
    syn_state, mem_state = syn.init_synaptic()
    spk, syn_state, mem_state = syn(torch.ones(3), syn_state, mem_state)
    assert syn_state.tolist() == mem_state.tolist() == [1.0, 1.0, 1.0]
    assert len(flexgen.convert(snn.Alpha(alpha=0.9, beta=0.8), backend="torch").init_alpha()) == 3
    assert flexgen.convert(snn.Lapicque(beta=0.9), backend="torch").init_lapicque().shape == (0,)


def test_recurrent_tutorial_style_and_hidden_states():
    rlif = flexgen.convert(snn.RLeaky(beta=0.5, all_to_all=False, V=0.5), backend="torch")
    spk, mem = rlif.init_rleaky()
    assert spk.shape == mem.shape == rlif.spk.shape == (0,)  # snnTorch's empty states, zeros at the first call
    spk, mem = rlif(torch.full((2, 3), 1.2), spk, mem)
    assert spk.sum() == 6 and torch.allclose(mem, torch.full((2, 3), 1.2))
    spk, mem = rlif(torch.full((2, 3), 0.1), spk=spk, mem=mem)  # mem = 0.6 + 0.1 + V * 1 - 1 (subtract)
    assert torch.allclose(mem, torch.full((2, 3), 0.2)) and spk.sum() == 0 and torch.equal(rlif.spk, spk)
    spk, syn, mem = flexgen.convert(snn.RSynaptic(0.5, 0.5, linear_features=3), backend="torch").init_rsynaptic()
    assert spk.shape == syn.shape == mem.shape == (0,)
    with pytest.raises(TypeError, match=r"at most 2 state\(s\) \('spk', 'mem'\)"):
        rlif(torch.ones(2), torch.zeros(2), torch.zeros(2), torch.zeros(2))

    hidden = flexgen.convert(snn.RLeaky(beta=0.5, all_to_all=False, V=0.5, init_hidden=True), backend="torch")
    with pytest.raises(TypeError, match=r"states \(spk, mem\) are not passed while init_hidden=True"):
        hidden(torch.ones(2), torch.zeros(2))
    x = torch.full((2,), 1.2, requires_grad=True)
    assert hidden.spk == 0.0 and torch.equal(hidden(x), torch.ones(2))
    hidden(x)
    assert hidden.mem.requires_grad and hidden.spk.requires_grad
    hidden.detach_hidden()
    assert not hidden.mem.requires_grad and not hidden.spk.requires_grad
    hidden.reset_hidden()
    assert hidden.spk == 0.0 and hidden.mem == 0.0
    hidden(x)
    assert torch.allclose(hidden.mem, x)  # from rest: no recurrent current at the first step


def test_call_errors_name_the_states():
    leaky = flexgen.convert(snn.Leaky(beta=0.9, init_hidden=True), backend="torch")
    with pytest.raises(TypeError, match="init_hidden=True"):
        leaky(torch.ones(2), torch.zeros(2))
    syn = flexgen.convert(snn.Synaptic(alpha=0.5, beta=0.5), backend="torch")
    with pytest.raises(TypeError, match="unexpected or repeated state argument 'v'"):
        syn(torch.ones(2), v=torch.zeros(2))
    with pytest.raises(TypeError, match=r"at most 2 state\(s\)"):
        syn(torch.ones(2), torch.zeros(2), torch.zeros(2), torch.zeros(2))


def test_hidden_states_reset_and_detach():
    leaky = flexgen.convert(snn.Leaky(beta=0.5, init_hidden=True, output=True), backend="torch")
    x = torch.full((2,), 0.6, requires_grad=True)
    leaky(x)
    assert leaky.mem.requires_grad
    leaky.detach_hidden()
    assert not leaky.mem.requires_grad and torch.equal(leaky.mem, x.detach())
    leaky.reset_hidden()
    _, mem = leaky(x)
    assert torch.equal(mem, x)
    net = torch.nn.Sequential(leaky)
    net(x)
    flexgen.reset(net)
    assert torch.equal(net(x)[1], x)


# ---- atomicity and the report --------------------------------------------------


def two_layer_model(second):
    return torch.nn.Sequential(torch.nn.Linear(3, 4), snn.Leaky(beta=0.9), torch.nn.Linear(4, 4), second)


@pytest.mark.parametrize("unsupported", [
    lambda: snn.RSynaptic(alpha=0.9, beta=0.8, linear_features=4, reset_delay=False),
    lambda: snn.RLeaky(beta=0.9, linear_features=4, inhibition=True),
    lambda: snn.Leaky(beta=0.9, state_quant=lambda m: m),
    lambda: snn.Leaky(beta=0.9, surrogate_disable=True),
    lambda: snn.Leaky(beta=0.9, spike_grad=snn_surrogate.triangular()),
    lambda: snn.SLSTM(4, 4),
], ids=["RSynaptic-no-reset-delay", "RLeaky-inhibition", "state_quant", "surrogate_disable", "triangular", "SLSTM"])
def test_unsupported_neuron_raises_before_changing_anything(unsupported):
    model = two_layer_model(unsupported())
    before = list(model)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(flexgen.ConversionError, match="the model was left unchanged") as info:
        flexgen.convert(model)
    assert list(model) == before and all(a is b for a, b in zip(model, before))
    assert set(model.state_dict()) == set(state)
    assert "  3 (snntorch." in str(info.value)


def test_rsynaptic_without_reset_delay_is_refused_with_the_reason():
    with pytest.raises(flexgen.ConversionError, match="RSynaptic with reset_delay=False is not converted: its forward"):
        flexgen.convert(two_layer_model(snn.RSynaptic(alpha=0.9, beta=0.8, linear_features=4, reset_delay=False)))


def test_recurrent_layers_are_converted_and_reported(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), snn.RLeaky(beta=0.9, linear_features=4),
                                snn.RSynaptic(alpha=0.9, beta=0.8, all_to_all=False, V=0.5))
    with caplog.at_level(logging.INFO, logger="flexgen.convert"):
        _, report = flexgen.convert(model, report=True, backend="torch")
    assert [(s.name, s.before, s.after) for s in report.swapped] == [
        ("1", "snntorch._neurons.rleaky.RLeaky", "flexgen.interop.peers.snntorch.SnnTorchRLeaky"),
        ("2", "snntorch._neurons.rsynaptic.RSynaptic", "flexgen.interop.peers.snntorch.SnnTorchRSynaptic"),
    ]
    assert report.left == []  # the recurrent nn.Linear goes with its neuron: not listed on its own
    assert "swapped 1: snntorch._neurons.rleaky.RLeaky -> flexgen.interop.peers.snntorch.SnnTorchRLeaky" in caplog.text


def test_every_problem_is_listed():
    model = torch.nn.Sequential(snn.SLSTM(4, 4), snn.Leaky(beta=0.9, inhibition=True))
    with pytest.raises(flexgen.ConversionError, match="cannot replace 2 neuron") as info:
        flexgen.convert(model)
    assert "0 (snntorch." in str(info.value) and "inhibition" in str(info.value)


def test_a_subclass_of_a_supported_neuron_is_not_taken_for_it():
    class Custom(snn.Leaky):
        pass

    with pytest.raises(flexgen.ConversionError, match="Custom has no flexgen equivalent"):
        flexgen.convert(torch.nn.Sequential(Custom(beta=0.9)))


def test_strict_false_converts_the_rest_and_reports_what_it_left(caplog):
    model = two_layer_model(snn.SLSTM(4, 4))
    with caplog.at_level(logging.INFO, logger="flexgen.convert"):
        result, report = flexgen.convert(model, strict=False, report=True, backend="torch")
    assert result is model and isinstance(model[1], flexgen.NeuronModule) and isinstance(model[3], snn.SLSTM)
    assert [(s.name, s.before, s.after) for s in report.swapped] == [
        ("1", "snntorch._neurons.leaky.Leaky", "flexgen.interop.peers.snntorch.SnnTorchLeaky")
    ]
    assert [(m.name, m.kind) for m in report.left] == [("3", "snntorch._neurons.slstm.SLSTM")]
    assert "SLSTM has no flexgen equivalent" in report.left[0].reason
    assert "swapped 1: snntorch._neurons.leaky.Leaky -> flexgen.interop.peers.snntorch.SnnTorchLeaky" in caplog.text
    assert "left    3: snntorch._neurons.slstm.SLSTM (snntorch._neurons.slstm.SLSTM has no flexgen" in caplog.text


def test_synaptic_is_converted_not_left():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), snn.Synaptic(alpha=0.9, beta=0.8))
    _, report = flexgen.convert(model, report=True, backend="torch")
    assert [s.name for s in report.swapped] == ["1"] and report.left == []
    assert isinstance(model[1], flexgen.NeuronModule)


def test_a_shared_neuron_stays_shared_and_a_neuron_model_is_replaced():
    leaky = snn.Leaky(beta=0.9)
    outer = torch.nn.Sequential(torch.nn.Sequential(leaky), leaky)
    _, report = flexgen.convert(outer, report=True, backend="torch")
    assert outer[0][0] is outer[1] and isinstance(outer[1], flexgen.NeuronModule) and len(report.swapped) == 1
    assert isinstance(flexgen.convert(snn.Leaky(beta=0.9), backend="torch"), flexgen.NeuronModule)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        flexgen.convert("not a model")


# ---- checkpoints, dtype, device ---------------------------------------------------


CHECKPOINT_CASES = {
    "Leaky": lambda: snn.Leaky(beta=torch.tensor([0.7, 0.8, 0.9]), learn_beta=True, graded_spikes_factor=2.0),
    "Synaptic": lambda: snn.Synaptic(alpha=0.9, beta=0.8, learn_alpha=True, learn_threshold=True),
    "Alpha": lambda: snn.Alpha(alpha=0.9, beta=0.8, threshold=0.1, learn_beta=True),
    "Lapicque": lambda: snn.Lapicque(beta=0.9, threshold=0.2, learn_threshold=True),  # its beta's C cannot deepcopy
    "RLeaky": lambda: snn.RLeaky(beta=0.9, linear_features=3, learn_beta=True, reset_mechanism="zero"),
    "RSynaptic": lambda: snn.RSynaptic(alpha=0.9, beta=0.8, all_to_all=False, V=torch.tensor([0.5, 1.0, -0.5])),
    "RSynaptic-fixed-V": lambda: snn.RSynaptic(alpha=0.9, beta=0.8, all_to_all=False, V=0.5, learn_recurrent=False),
}


@pytest.mark.parametrize("peer", sorted(CHECKPOINT_CASES))
def test_checkpoints_load_both_ways_strictly(peer):
    torch.manual_seed(7)  # the weights and inputs must make every case fire, whichever tests ran before
    make = CHECKPOINT_CASES[peer]
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), make())
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for value in trained.state_dict().values():
            if value.is_floating_point():
                value.mul_(1.05)  # "training" moved every value; the structure stayed
    checkpoint = trained.state_dict()

    converted = flexgen.convert(copy.deepcopy(model), backend="torch")
    assert isinstance(converted[1], flexgen.NeuronModule)
    assert set(converted.state_dict()) == set(model.state_dict())
    converted.load_state_dict(checkpoint, strict=True)  # saved before convert, loaded after
    x = torch.rand(T, 2, 3) * 4.0 - 1.0
    ref_spikes, _ = run_steps(trained[1], trained[0](x), [])
    spikes, _ = run_steps(converted[1], converted[0](x), [])
    assert torch.equal(spikes, ref_spikes) and spikes.sum() > 0

    fresh = make()
    fresh_model = torch.nn.Sequential(torch.nn.Linear(3, 3), fresh)
    fresh_model.load_state_dict(converted.state_dict(), strict=True)  # saved after convert, loaded into snnTorch
    for name, value in trained.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[name], value)


def test_checkpoint_with_another_reset_mechanism_is_refused():
    converted = flexgen.convert(snn.Leaky(beta=0.9), backend="torch")
    checkpoint = snn.Leaky(beta=0.9, reset_mechanism="zero").state_dict()
    with pytest.raises(RuntimeError, match="reset_mechanism is 'zero', this converted layer's is 'subtract'"):
        converted.load_state_dict(checkpoint)


def test_conversion_keeps_the_peers_tensors_dtype_and_device():
    leaky = snn.Leaky(beta=0.9, learn_beta=True).double()
    with torch.no_grad():
        leaky.beta.fill_(0.123456789012345678)
    optimizer = torch.optim.SGD(leaky.parameters(), lr=0.1)
    converted = flexgen.convert(leaky, backend="torch")
    assert converted.beta is leaky.beta  # shared: an optimizer built before convert keeps training it
    assert converted.beta.dtype == converted.threshold.dtype == torch.float64
    assert converted.beta.item() == 0.123456789012345678 and isinstance(converted.threshold, torch.Tensor)
    assert not isinstance(converted.threshold, torch.nn.Parameter)  # a buffer, as in snnTorch
    _, mem = converted(torch.ones(2, 3, dtype=torch.float64))
    _, mem = converted(torch.ones(2, 3, dtype=torch.float64), mem)
    mem.sum().backward()
    optimizer.step()
    assert converted.beta.item() != 0.123456789012345678
    assert flexgen.convert(snn.Leaky(beta=0.9).to("meta")).beta.device.type == "meta"


# ---- whole models ------------------------------------------------------------------


class TutorialNet(torch.nn.Module):
    """snnTorch tutorial 5's network: two Leaky layers, states passed explicitly (init_hidden=False)."""

    def __init__(self, beta=0.95):
        super().__init__()
        self.fc1, self.lif1 = torch.nn.Linear(12, 10), snn.Leaky(beta=beta)
        self.fc2, self.lif2 = torch.nn.Linear(10, 4), snn.Leaky(beta=beta)

    def forward(self, x):
        mem1, mem2 = self.lif1.init_leaky(), self.lif2.init_leaky()
        spk_rec, mem_rec = [], []
        for step in range(x.shape[0]):
            spk1, mem1 = self.lif1(self.fc1(x[step]), mem1)
            spk2, mem2 = self.lif2(self.fc2(spk1), mem2)
            spk_rec.append(spk2)
            mem_rec.append(mem2)
        return torch.stack(spk_rec), torch.stack(mem_rec)


def tutorial_cnn():
    """snnTorch tutorial 6's convolutional network (init_hidden=True, fast_sigmoid, output=True at the end)."""
    grad = snn_surrogate.fast_sigmoid(slope=25)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.MaxPool2d(2), snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True),
        torch.nn.Conv2d(4, 6, 3), torch.nn.MaxPool2d(2), snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True),
        torch.nn.Flatten(), torch.nn.Linear(6 * 2 * 2, 5),
        snn.Leaky(beta=0.5, spike_grad=grad, init_hidden=True, output=True),
    )


def livelier(model, gain):
    """The model with its weights scaled up, so that every layer fires within a few steps."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(gain)
    return model


def assert_same_training_step(ref, new, ref_forward, new_forward, batches):
    """Two batches through both models (states start afresh each time): same spikes, same gradients (float32,
    snnTorch's spikes are float32 whatever the model's dtype)."""
    for x in batches:
        for model in (ref, new):
            model.zero_grad()
        ref_spikes, ref_mem = ref_forward(ref, x)
        spikes, mem = new_forward(new, x)
        assert torch.equal(spikes, ref_spikes) and 0 < spikes.sum() < spikes.numel()
        assert rel_err(mem, ref_mem) <= 1e-6
        (ref_spikes.sum() + (ref_mem ** 2).sum()).backward()
        (spikes.sum() + (mem ** 2).sum()).backward()
        for (name, p), q in zip(new.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) <= 1e-5, name


def test_snntorch_tutorial_network_round_trip():
    torch.manual_seed(3)
    ref = livelier(TutorialNet(), 4.0)
    new = flexgen.convert(copy.deepcopy(ref), backend="torch")
    assert isinstance(new.lif1, flexgen.NeuronModule) and isinstance(new.lif2, flexgen.NeuronModule)
    g = torch.Generator().manual_seed(4)
    batches = [torch.rand(8, 5, 12, generator=g) * 2.0 for _ in range(2)]
    run = lambda model, x: model(x)  # noqa: E731
    assert_same_training_step(ref, new, run, run, batches)


def test_snntorch_tutorial_cnn_round_trip():
    from snntorch import utils

    torch.manual_seed(5)
    ref = livelier(tutorial_cnn(), 3.0)
    new = flexgen.convert(copy.deepcopy(ref), backend="torch")
    assert sum(isinstance(m, flexgen.NeuronModule) for m in new) == 3

    def forward(reset):
        def run(model, x):
            reset(model)
            outputs = [model(x[t]) for t in range(x.shape[0])]
            return torch.stack([o[0] for o in outputs]), torch.stack([o[1] for o in outputs])
        return run

    g = torch.Generator().manual_seed(6)
    batches = [torch.rand(4, 3, 1, 14, 14, generator=g) * 3.0 for _ in range(2)]
    assert_same_training_step(ref, new, forward(utils.reset), forward(flexgen.reset), batches)


@pytest.mark.parametrize("device,backend", device_backends())
def test_zoo_synaptic_fires_like_snntorch_synaptic(device, backend):
    """The zoo's `synaptic` names snnTorch's Synaptic: same spikes (on > threshold), states and gradients."""
    from flexgen.neurons import zoo

    ref = snn.Synaptic(alpha=0.75, beta=0.5, threshold=1.0).double()
    x = torch.tensor([[1.0, 0.3], [1.0, 0.9], [0.25, 1.2], [0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    ref_spikes, (ref_syn, ref_mem) = run_steps(ref, x, [])  # step 1: mem = 1.0, on the threshold: no spike
    (spikes,), (syn, mem) = zoo.synaptic.apply(x.to(device), alpha=0.75, beta=0.5, backend=backend)
    assert ref_mem[0, 0].item() == 1.0 and ref_spikes[0, 0].item() == 0.0
    assert torch.equal(spikes.cpu(), ref_spikes.to(spikes.dtype)) and 0 < spikes.sum() < spikes.numel()
    assert rel_err(syn.cpu(), ref_syn[-1]) <= 1e-12 and rel_err(mem.cpu(), ref_mem[-1]) <= 1e-12
    weights = torch.linspace(-1.0, 1.0, x.numel(), dtype=torch.float64).reshape(x.shape)
    (grad,) = torch.autograd.grad((spikes.cpu() * weights).sum() + mem.sum().cpu(), x)
    (ref_grad,) = torch.autograd.grad((ref_spikes * weights).sum() + ref_mem[-1].sum(), x)
    assert rel_err(grad, ref_grad) <= SNNTORCH_FLOAT32_GRADIENTS


def _twice_used_leaky():
    torch.manual_seed(3)
    leaky = snn.Leaky(beta=0.8, init_hidden=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), leaky, torch.nn.Linear(4, 4), leaky)
    return model


def test_a_neuron_held_in_two_slots_becomes_one_layer_in_both_with_the_same_results():
    original = _twice_used_leaky()
    model = copy.deepcopy(original)  # deepcopy keeps the two slots one module
    _, report = flexgen.convert(model, report=True, backend="torch")
    assert model[1] is model[3] and isinstance(model[3], flexgen.NeuronModule)
    assert [(s.name, s.also) for s in report.swapped] == [("1", ("3",))]
    assert "(also at 3)" in str(report)
    x = 2.0 * torch.randn(T, 2, 4)  # float32: snnTorch's spikes are float32 whatever the model's dtype
    for layer in (original[1], model[1]):
        layer.reset_mem()
    expected, got = _each_slot_step_by_step(original, x), _each_slot_step_by_step(model, x)
    assert expected[0].sum() > 0 and expected[2].abs().max() > 1.0
    for g, e in zip(got, expected):  # float32's default tolerances: the same update in float32
        torch.testing.assert_close(g, e)


def _each_slot_step_by_step(model, x):
    """Per step: the first slot's spikes, the second's, and the potential the two slots share."""
    first, second, mem = [], [], []
    for x_t in x:
        first.append(model[1](model[0](x_t)))
        second.append(model[3](model[2](first[-1])))
        mem.append(model[3].mem)
    return torch.stack(first), torch.stack(second), torch.stack(mem)


def test_forward_hooks_pre_hooks_and_full_backward_hooks_carry_over_and_their_handles_still_remove_them():
    model = _twice_used_leaky()
    leaky, seen = model[1], []
    handles = [
        leaky.register_forward_pre_hook(lambda m, args: seen.append(("pre", type(m).__name__))),
        leaky.register_forward_pre_hook(lambda m, args, kwargs: seen.append(("pre-kw", len(kwargs))), with_kwargs=True),
        leaky.register_forward_hook(lambda m, args, out: seen.append(("post", out.shape[-1]))),
        leaky.register_forward_hook(lambda m, args, out: seen.append(("always", 0)), always_call=True),
        leaky.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(("backward", len(grad_out)))),
    ]
    flexgen.convert(model, backend="torch")
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen.count(("pre", "SnnTorchLeaky")) == 2 and seen.count(("pre-kw", 0)) == 2
    assert seen.count(("post", 4)) == 2 and seen.count(("always", 0)) == 2 and seen.count(("backward", 1)) == 2
    for handle in handles:
        handle.remove()
    seen.clear()
    model[1].reset_mem()
    model(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert seen == []


def test_a_legacy_backward_hook_is_refused_by_name_and_left_with_strict_false():
    model = _twice_used_leaky()

    def my_legacy_hook(module, grad_in, grad_out):
        return None

    model[1].register_backward_hook(my_legacy_hook)
    with pytest.raises(flexgen.ConversionError, match="my_legacy_hook.*register_full_backward_hook"):
        flexgen.convert(model, backend="torch")
    assert isinstance(model[1], snn.Leaky)
    _, report = flexgen.convert(model, report=True, backend="torch", strict=False)
    assert isinstance(model[1], snn.Leaky) and [m.name for m in report.left] == ["1"]
