"""The classes that carry SpikingJelly's names take its defaults: IF, LIF and PLIF run one step per call, as IFNode,
LIFNode and ParametricLIFNode do; layers made from a spec keep taking [T, ...] sequences."""
import inspect

import pytest
import torch

import flexgen
from conftest import plain_device_backends
from specs import lif

CLASSES = {"IF": ("IFNode", {}), "LIF": ("LIFNode", {"tau": 2.0}), "PLIF": ("ParametricLIFNode", {"init_tau": 2.0})}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_bundled_layer_classes_default_to_single_step(name):
    cls = getattr(flexgen, name)
    assert cls(backend="eager").step_mode == "s"
    assert cls(step_mode="m", backend="eager").step_mode == "m"


def test_layers_made_from_a_spec_default_to_multi_step():
    assert lif(backend="eager").step_mode == "m"
    assert flexgen.neurons.get("Izhikevich")(backend="eager").step_mode == "m"
    assert flexgen.LIF.spec(backend="eager").step_mode == "m"  # the spec behind the class is a spec like any other


@pytest.mark.parametrize("device,backend", plain_device_backends())
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_per_step_loop_gives_the_sequence_result(name, device, backend):
    """SpikingJelly's usage: `for t in range(T): s = node(x[t])`, the state shaped like one step."""
    cls, options = getattr(flexgen, name), CLASSES[name][1]
    x = (torch.rand(6, 3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2.0).to(device)
    node = cls(backend=backend, **options).to(device=device, dtype=torch.float64)
    per_step = torch.stack([node(x[t]) for t in range(6)])
    assert node.v.shape == (3, 5)
    whole = cls(step_mode="m", backend=backend, **options).to(device=device, dtype=torch.float64)
    assert torch.equal(per_step, whole(x)) and per_step.sum() > 0
    torch.testing.assert_close(node.v, whole.v, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_defaults_are_spikingjellys(name):
    neuron = pytest.importorskip("spikingjelly.activation_based.neuron")
    ours = inspect.signature(getattr(flexgen, name)).parameters
    theirs = inspect.signature(getattr(neuron, CLASSES[name][0])).parameters
    assert ours["step_mode"].default == theirs["step_mode"].default == "s"
