"""Common mistakes in using a neuron get a message that says what happened and what to write instead."""
import textwrap

import numpy
import pytest
import torch

import flexgen
from conftest import plain_device_backends
from flexgen import cli
from specs import lif


# ---------------------------------------------------------------- calling the spec on the input


def test_calling_the_spec_on_the_input_says_to_build_the_layer_first():
    x = torch.rand(4, 3)
    with pytest.raises(TypeError) as info:
        lif(x)
    message = str(info.value)
    assert "builds a layer from the neuron 'lif'" in message and "lif()(x)" in message and "lif.apply(x)" in message
    assert "tensor(" not in message  # the input is not dumped


def test_calling_a_bundled_layer_class_on_the_input_says_the_same():
    with pytest.raises(flexgen.SpecError, match=r"LIF: hyper-parameter 'tau' was given a tensor of shape \(4, 3\).*LIF\(\.\.\.\)\(x\)"):
        flexgen.LIF(torch.rand(4, 3))


# ---------------------------------------------------------------- hyper-parameters


@pytest.mark.parametrize("value,fragment", [
    ("3", "hyper-parameter 'tau' must be a number, got str '3'"),
    (True, "must be a number, got bool True"),
    (None, "must be a number, got NoneType None"),
    (float("nan"), "hyper-parameter 'tau' is nan; it must be a finite number"),
    (torch.tensor([2.0, 3.0]), "was given a tensor of shape (2,)"),
    (torch.tensor(2.0, requires_grad=True), "was given a tensor that requires grad"),
])
def test_a_hyper_parameter_must_be_a_finite_number(value, fragment):
    for make in (lambda: lif(tau=value, backend="eager"), lambda: lif.apply(torch.rand(2, 3), tau=value)):
        with pytest.raises(flexgen.SpecError) as info:
            make()
        assert fragment in str(info.value) and str(info.value).startswith("lif: ")
        if isinstance(value, torch.Tensor):
            assert "learnable=('tau',)" in str(info.value) and "per_channel" in str(info.value)


def test_numbers_of_any_kind_are_hyper_parameters():
    for value in (3, 3.0, numpy.float64(3.0), numpy.int32(3), torch.tensor(3.0), torch.tensor(3)):
        assert lif(tau=value, backend="eager").hyper["tau"] == 3.0


def test_bundled_layers_check_their_hyper_parameters_too():
    with pytest.raises(flexgen.SpecError, match="IF: hyper-parameter 'v_threshold' must be a number, got str"):
        flexgen.IF(v_threshold="1")
    with pytest.raises(flexgen.SpecError, match="PLIF: hyper-parameter 'init_tau' must be a number, got str"):
        flexgen.PLIF(init_tau="2")
    with pytest.raises(flexgen.SpecError, match="LIF: hyper-parameter 'v_reset' was given a tensor"):
        flexgen.LIF(v_reset=torch.zeros(3))
    assert flexgen.LIF(tau=3, v_reset=None).tau == 3.0


# ---------------------------------------------------------------- a second backward without reset()


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_second_backward_without_reset_names_reset_and_detach(device, backend):
    layer = flexgen.LIF(step_mode="m", backend=backend)
    x = torch.rand(4, 3, device=device, requires_grad=True)
    layer(x).sum().backward()
    second = layer(x).sum()
    with pytest.raises(RuntimeError) as info:
        second.backward()
    message = str(info.value)
    assert "layer.reset()" in message and "layer.detach()" in message and "retain_graph=True" in message


@pytest.mark.parametrize("device,backend", plain_device_backends())
def test_detach_keeps_the_states_and_cuts_their_graph(device, backend):
    layer = flexgen.LIF(step_mode="m", backend=backend)
    x = (torch.rand(4, 3, device=device) * 1.5).requires_grad_()
    layer(x).sum().backward()
    layer.detach()
    v = layer.v
    assert not v.requires_grad and v.abs().sum() > 0
    x.grad = None
    layer(x).sum().backward()  # stops at this call: no error
    (s,), _ = layer.spec.apply(x, states=[v], backend=backend, **layer.hyper)
    (expected,) = torch.autograd.grad(s.sum(), x)
    assert torch.equal(x.grad, expected)


def test_same_graph_twice_gets_the_message_too():
    s = flexgen.LIF(step_mode="m", backend="torch")(torch.rand(4, 3, requires_grad=True)).sum()
    s.backward()
    with pytest.raises(RuntimeError, match="flexgen neuron call whose saved values an earlier backward already freed"):
        s.backward()


# ---------------------------------------------------------------- the command line


def test_show_of_a_file_without_a_name_explains_the_syntax(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "my_neurons.py"
    path.write_text(textwrap.dedent("""
        import flexgen

        @flexgen.neuron(states=("v",))
        def leaky(x, v, beta=0.9):
            s = flexgen.spike(v - 1.0)
            return s, beta * v + x - s
    """))
    for target in (str(path), f"{path}:"):
        assert cli.main(["show", target]) == 1
        err = capsys.readouterr().err
        assert "names a file or module, not a neuron: write FILE.py:NAME or MODULE:NAME" in err
        assert f"e.g. {path}:leaky; neurons in it: leaky" in err
    empty = tmp_path / "empty.py"
    empty.write_text("X = 1\n")
    assert cli.main(["show", str(empty)]) == 1
    assert f"e.g. {empty}:NAME; it defines no @flexgen.neuron" in capsys.readouterr().err
    assert cli.main(["show", "no_such_neuron"]) == 1
    assert "a neuron of your own is written FILE.py:NAME or MODULE:NAME" in capsys.readouterr().err
