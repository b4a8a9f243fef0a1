"""flexgen.convert on SpikingJelly models: a spiking ResNet (built here, SpikingJelly's own needs torchvision)
with the same spikes and gradients, checkpoints both ways, dtype, atomicity and the report.

SpikingJelly is not in the `test` extra (it requires torchvision, which pulls its own torch): these tests run
where it is installed."""
import copy

import pytest
import torch

import flexgen
from conftest import max_rel_err

pytest.importorskip("spikingjelly.activation_based.neuron")
from spikingjelly.activation_based import functional, layer, neuron, surrogate  # noqa: E402


class BasicBlock(torch.nn.Module):
    """A ResNet basic block with spiking neurons in place of ReLUs (SpikingJelly's spiking ResNet layout)."""

    def __init__(self, channels_in, channels_out, stride, make_neuron):
        super().__init__()
        self.conv1 = layer.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1, self.sn1 = layer.BatchNorm2d(channels_out), make_neuron()
        self.conv2 = layer.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2, self.sn2 = layer.BatchNorm2d(channels_out), make_neuron()
        self.downsample = None
        if stride != 1 or channels_in != channels_out:
            self.downsample = torch.nn.Sequential(
                layer.Conv2d(channels_in, channels_out, 1, stride, bias=False), layer.BatchNorm2d(channels_out)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.sn1(self.bn1(self.conv1(x)))
        return self.sn2(self.bn2(self.conv2(out)) + identity)


def spiking_resnet(make_neuron):
    net = torch.nn.Sequential(
        layer.Conv2d(2, 4, 3, 1, 1, bias=False), layer.BatchNorm2d(4), make_neuron(), layer.MaxPool2d(2),
        BasicBlock(4, 4, 1, make_neuron), BasicBlock(4, 8, 2, make_neuron),
        layer.AdaptiveAvgPool2d((1, 1)), layer.Flatten(), layer.Linear(8, 3),
    )
    functional.set_step_mode(net, "m")
    return net


NEURONS = {
    "IFNode": lambda: neuron.IFNode(surrogate_function=surrogate.ATan(), detach_reset=True),
    "LIFNode": lambda: neuron.LIFNode(tau=2.0, decay_input=False, v_reset=None),
    "ParametricLIFNode": lambda: neuron.ParametricLIFNode(init_tau=2.0, surrogate_function=surrogate.Sigmoid(alpha=3.0)),
}


def record_spikes(model):
    """name -> the spikes each neuron layer puts out on the next call (by forward hooks)."""
    spikes = {}
    for name, module in model.named_modules():
        if isinstance(module, (neuron.BaseNode, flexgen.NeuronModule)):
            module.register_forward_hook(lambda m, args, out, name=name: spikes.__setitem__(name, out))
    return spikes


@pytest.mark.parametrize("kind", sorted(NEURONS))
def test_spiking_resnet_round_trip(kind):
    torch.manual_seed(7)
    ref = spiking_resnet(NEURONS[kind]).double()
    new = flexgen.convert(copy.deepcopy(ref), backend="torch")
    assert not any(isinstance(m, neuron.BaseNode) for m in new.modules())
    assert sum(isinstance(m, flexgen.NeuronModule) for m in new.modules()) == 5
    ref_spikes, spikes = record_spikes(ref), record_spikes(new)
    g = torch.Generator().manual_seed(8)
    for _ in range(2):  # two batches: the states start afresh after each reset
        x = torch.rand(4, 2, 2, 8, 8, generator=g, dtype=torch.float64) * 2.0
        for model in (ref, new):
            model.zero_grad()
        functional.reset_net(ref)
        flexgen.reset(new)
        y_ref, y = ref(x), new(x)
        assert set(spikes) == set(ref_spikes) and len(spikes) == 5
        for name in ref_spikes:
            assert torch.equal(spikes[name], ref_spikes[name]), name
            assert 0 < spikes[name].sum() < spikes[name].numel(), name
        # float64, the same expressions up to their order: elementwise within 1e-12 of the largest magnitude
        # (measured on the CPU: at most 3.6e-15, gradients included)
        assert max_rel_err(y, y_ref) <= 1e-12
        (y_ref ** 2).sum().backward()
        (y ** 2).sum().backward()
        for (name, p), q in zip(new.named_parameters(), ref.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-12, (name, max_rel_err(p.grad, q.grad))


def test_checkpoints_load_both_ways_strictly():
    torch.manual_seed(9)
    model = spiking_resnet(NEURONS["ParametricLIFNode"])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    checkpoint = model.state_dict()
    converted = flexgen.convert(spiking_resnet(NEURONS["ParametricLIFNode"]), backend="torch")
    assert set(converted.state_dict()) == set(checkpoint)
    converted.load_state_dict(checkpoint, strict=True)
    back = spiking_resnet(NEURONS["ParametricLIFNode"])
    back.load_state_dict(converted.state_dict(), strict=True)
    for name, value in checkpoint.items():
        assert torch.equal(back.state_dict()[name], value), name


def test_plif_keeps_its_float64_w():
    node = neuron.ParametricLIFNode(init_tau=3.0, step_mode="m").double()
    with torch.no_grad():
        node.w.fill_(0.123456789012345678)
    converted = flexgen.convert(node, backend="torch")
    assert converted.w is node.w and converted.w.dtype == torch.float64 and converted.w.item() == 0.123456789012345678


def test_unsupported_neuron_raises_before_changing_anything_and_the_report_names_the_rest():
    model = torch.nn.Sequential(layer.Linear(3, 4), neuron.LIFNode(), layer.Linear(4, 4), neuron.IzhikevichNode())
    before = list(model)
    with pytest.raises(flexgen.ConversionError, match="IzhikevichNode has no flexgen equivalent"):
        flexgen.convert(model)
    assert all(a is b for a, b in zip(model, before))
    _, report = flexgen.convert(model, strict=False, report=True, backend="torch")
    assert [s.name for s in report.swapped] == ["1"] and isinstance(model[1], flexgen.LIF)
    left = {m.name: m.reason for m in report.left}
    assert "IzhikevichNode has no flexgen equivalent" in left["3"]
    assert left["0"] == left["2"] == "not a neuron: runs unchanged"
