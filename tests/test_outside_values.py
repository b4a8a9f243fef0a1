"""Values a step reads from outside itself key its kernels: rebinding a module constant, a
closure variable or an attribute gives the layers built afterwards the new value, as eager sees it."""
import math
import sys
import types

import pytest
import torch

import flexgen
from flexgen import spike
from flexgen.frontend.captured import outside_values

V_TH = 1.0
config = types.SimpleNamespace(gain=1.0)


def gain(z):
    return z * config.gain


@flexgen.neuron(states=("v",))
def reads_globals(x, v, tau=2.0):
    h = v + (gain(x) - v) / tau
    s = spike(h - V_TH * math.pi / math.pi)
    return s, h * (1.0 - s)


def make_closure(threshold):
    @flexgen.neuron(states=("v",))
    def reads_closure(x, v):
        h = v + x
        s = spike(h - threshold)
        return s, h * (1.0 - s)

    def rebind(value):
        nonlocal threshold
        threshold = value

    return reads_closure, rebind


pytestmark = pytest.mark.usefixtures("private_cache")


X = torch.full((4, 3), 1.5, dtype=torch.float64)


def spikes(spec, backend):
    return spec(backend=backend)(X)


@pytest.mark.parametrize("rebind", [
    lambda monkeypatch: monkeypatch.setattr(sys.modules[__name__], "V_TH", 3.0),
    lambda monkeypatch: monkeypatch.setattr(config, "gain", 10.0),
], ids=["module constant", "attribute read by a helper"])
def test_rebinding_what_the_step_reads_gives_new_layers_the_new_value(rebind, monkeypatch):
    old_layer = reads_globals(backend="torch")
    before = spikes(reads_globals, "torch")
    key = reads_globals.compiled().key
    assert torch.equal(before, spikes(reads_globals, "eager"))
    rebind(monkeypatch)
    after = spikes(reads_globals, "torch")
    assert torch.equal(after, spikes(reads_globals, "eager")) and not torch.equal(after, before)
    assert reads_globals.compiled().key != key
    assert torch.equal(old_layer(X), before)  # a layer keeps the kernels it was built with


def test_rebinding_a_closure_variable_gives_new_layers_the_new_value():
    spec, rebind = make_closure(1.0)
    before = spikes(spec, "torch")
    rebind(3.0)
    after = spikes(spec, "torch")
    assert torch.equal(after, spikes(spec, "eager")) and not torch.equal(after, before)
    assert "3.0" in spec.trace().text()


HELPER_SOURCE = """
def leak(z):
    return {factor} * z
"""


def test_a_helper_redefined_with_other_constants_gives_new_layers_the_new_code():
    """A notebook cell run again defines the helper anew: the kernels built afterwards follow its new code."""
    namespace = {"flexgen": flexgen, "spike": spike}
    exec(HELPER_SOURCE.format(factor=0.5), namespace)
    exec("def step(x, v):\n    h = leak(v) + x\n    s = spike(h - 1.0)\n    return s, h * (1.0 - s)\n", namespace)
    spec = flexgen.neuron(states=("v",))(namespace["step"])
    x = torch.full((3, 2), 0.6, dtype=torch.float64)
    before = spec(backend="torch")(x)
    exec(HELPER_SOURCE.format(factor=1.0), namespace)
    after = spec(backend="torch")(x)
    assert torch.equal(after, spec(backend="eager")(x)) and not torch.equal(after, before)


def test_unchanged_values_reuse_the_kernels():
    first = reads_globals.compiled()
    assert reads_globals.compiled() is first
    assert outside_values(reads_globals.fn) == outside_values(reads_globals.fn)


def test_outside_values_key_numbers_containers_and_keyed_objects():
    surrogate = flexgen.surrogate.ATan()
    table = [1.0, 2.0]

    def step(x):
        return x * table[0] + spike(x, surrogate)

    before = outside_values(step)
    table[0] = 5.0
    assert outside_values(step) != before
    table[0] = 1.0
    assert outside_values(step) == before
    surrogate = flexgen.surrogate.ATan(alpha=3.0)  # noqa: F841 (read by step through its closure)
    assert outside_values(step) != before
