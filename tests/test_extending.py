"""The layer-kind recipe of docs/extending.md, proven by a kind that lives in the tests (`kind_example/`: its
module and its frame), added without editing a stage module: it compiles through the same stages and cache as the
bundled kinds, and its generated step computes what the neuron computes."""
import pytest
import torch

import flexgen
import flexgen.kinds
from kind_example.step_kind import ONE_STEP


def test_the_kind_is_registered_once_by_its_name():
    assert flexgen.kinds.get("one-step") is ONE_STEP
    assert {"plain", "delayed", "recurrent", "one-step"} <= set(flexgen.kinds.KINDS)
    with pytest.raises(ValueError, match="registered already"):
        flexgen.kinds.register(type(ONE_STEP)())
    with pytest.raises(ValueError, match="kind must be one of"):
        flexgen.neurons.alif.compiled("no-such-kind")


@pytest.mark.parametrize("name", ["lif_step", "alif", "synaptic"])
def test_a_generated_step_equals_the_neurons_step_in_float64(name):
    spec = getattr(flexgen.neurons, name)
    step = spec.compiled("one-step")
    source = step.module_source()
    assert "def step(" in source and f"from the neuron `{spec.name}`" in source
    g = torch.Generator().manual_seed(0)
    x = [2.0 * torch.rand(4, 5, generator=g, dtype=torch.float64) for _ in spec.signature.inputs]
    states = [torch.rand(4, 5, generator=g, dtype=torch.float64) for _ in spec.signature.states]
    defaults = spec.signature.defaults
    hyper = [defaults[h] for h in spec.signature.hyper]
    learnable = [torch.tensor(float(defaults[w]), dtype=torch.float64) for w in spec.signature.learnable]
    got = step(*x, *states, *hyper, *learnable)
    outputs, finals = spec.apply(*[v[None] for v in x], states=states, backend="eager")
    n_out = len(outputs)
    assert len(got) == n_out + len(states)
    for value, want in zip(got[:n_out], outputs):
        torch.testing.assert_close(value, want[0], rtol=1e-12, atol=1e-12)
    for value, want in zip(got[n_out:], finals):
        torch.testing.assert_close(value, want, rtol=1e-12, atol=1e-12)


def test_the_kinds_options_key_its_cache_entries_apart():
    spec = flexgen.neurons.lif_step
    plain, detached = spec.compiled("one-step"), spec.compiled("one-step", {"detach_states": True})
    assert plain.key != detached.key and ".detach()" in detached.module_source()
    assert ".detach()" not in plain.module_source()
    assert spec.compiled("one-step") is plain  # memoised, and loaded from the cache rather than generated again
