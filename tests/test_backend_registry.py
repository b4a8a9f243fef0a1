"""The backends as a registry (`flexgen.launch.backends`): one module each, one `choose` with one message per
fallback, and every layer's `last_run`, the backend and path its last call took."""
import warnings

import pytest
import torch

import flexgen
from conftest import HAS_C_COMPILER, INTERPRETER, TRITON_DEVICE
from flexgen.launch import backends, c_path


def test_every_backend_is_registered_once_and_says_what_it_runs():
    assert backends.NAMES == ("auto", "triton", "torch", "c", "eager")
    for name, backend in backends.REGISTRY.items():
        assert backend.name == name and backend.summary and backend.kinds and backend.devices and backend.dtypes
    assert backends.REGISTRY["eager"].orders is None  # higher-order gradients
    assert {b.orders for n, b in backends.REGISTRY.items() if n != "eager"} == {1}
    assert backends.REGISTRY["c"].devices == ("cpu",)
    assert not backends.REGISTRY["eager"].generated


@pytest.mark.parametrize("owner", [lambda b: flexgen.LIF(backend=b), lambda b: flexgen.Recurrent(flexgen.LIF, 4, backend=b),
                                   lambda b: flexgen.Dense(3, 4, flexgen.LIF, backend=b)])
def test_a_backend_name_outside_the_registry_is_refused(owner):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch', 'c', 'eager'\)"):
        owner("cuda")


def test_auto_on_the_cpu_takes_the_c_kernels_where_they_build_else_the_torch_code():
    cpu = torch.device("cpu")
    assert backends.choose("auto", cpu, torch.float32, c_builds=lambda: None).name == "c"
    assert backends.choose("auto", cpu, torch.int32, c_builds=lambda: None).name == "torch"  # not a C dtype
    missing = c_path.CompilerError("no C compiler found (a test's)")
    with pytest.warns(UserWarning, match="the CPU layers run generated torch code.*a test's"):
        assert backends.choose("auto", cpu, torch.float32, c_builds=lambda: missing).name == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert backends.choose("auto", cpu, torch.float32, c_builds=lambda: missing).name == "torch"


def test_named_backends_run_where_they_can_and_say_why_not_where_they_cannot(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert backends.choose("torch", cpu).name == "torch" and backends.choose("eager", cuda).name == "eager"
    assert backends.choose("auto", cuda).name == "triton" and backends.choose("triton", cuda).name == "triton"
    with pytest.raises(RuntimeError, match="backend='c' runs the generated C kernels on CPU tensors .got cuda."):
        backends.choose("c", cuda)
    with pytest.warns(UserWarning, match="backend='c' runs the torch path: no compiler here"):
        assert backends.choose("c", cpu, torch.float64, c_builds=lambda: "no compiler here").name == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
        backends.choose("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.choose("triton", cpu).name == "triton"


def _neuron_backends():
    pairs = [("torch", "torch"), ("eager", "eager")]
    if HAS_C_COMPILER:
        pairs += [("c", "c"), ("auto", "c")]
    if INTERPRETER:
        pairs.append(("triton", "triton"))
    return pairs


@pytest.mark.parametrize("requested,ran", _neuron_backends())
def test_a_neuron_layer_says_which_backend_and_design_its_call_took(requested, ran):
    layer = flexgen.LIF(step_mode="m", backend=requested)
    assert layer.last_run is None
    x = torch.rand(5, 2, 3)
    layer(x)
    assert layer.last_run == backends.Run(ran, "step by step" if ran == "eager" else "plain")
    layer.reset()
    layer(x)  # a known call skips the checks, and says the same
    assert layer.last_run == backends.Run(ran, "step by step" if ran == "eager" else "plain")
    if ran not in ("eager",):
        recompute = flexgen.LIF(step_mode="m", backend=requested, recompute=True)
        recompute(x.requires_grad_()).sum().backward()
        assert recompute.last_run == backends.Run(ran, "recompute")


@pytest.mark.parametrize("requested", ["torch"] + (["c"] if HAS_C_COMPILER else []))
def test_a_delayed_layer_says_whether_the_line_ran_in_the_kernels(requested):
    layer = flexgen.LIF(step_mode="m", backend=requested, delay=flexgen.Delay(3, max_delay=2, delay=1.0))
    layer(torch.rand(5, 2, 3))
    assert layer.last_run == backends.Run(requested, "delay line" if requested == "c" else "delay layer first")


def test_a_recurrent_layer_says_its_path_and_backend():
    stepwise = flexgen.Recurrent(flexgen.LIF, hidden=4, backend="torch")
    stepwise(torch.rand(3, 2, 4))
    assert stepwise.last_run == backends.Run("torch", "stepwise") and stepwise.path == "stepwise"
    eager = flexgen.Recurrent(flexgen.LIF, hidden=4, backend="eager")
    eager(torch.rand(3, 2, 4))
    assert eager.last_run == backends.Run("eager", "eager")


@pytest.mark.skipif(not INTERPRETER, reason="the fused kernels need a GPU or TRITON_INTERPRET=1")
def test_a_fused_recurrent_call_says_triton():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=4, path="fused", backend="triton").to(TRITON_DEVICE).double()
    layer(torch.rand(3, 2, 4, dtype=torch.float64, device=TRITON_DEVICE))
    assert layer.last_run == backends.Run("triton", "fused")


def test_dense_and_chain_say_the_mode_and_their_cells_backend():
    dense = flexgen.Dense(3, 4, flexgen.LIF, backend="torch")
    spikes = (torch.rand(6, 2, 3) < 0.5).float()
    dense(spikes)
    assert dense.last_run == backends.Run("torch", "default")
    chain = flexgen.Chain(flexgen.Dense(3, 4, flexgen.LIF, backend="torch"),
                          flexgen.Dense(4, 2, flexgen.LIF, backend="torch"), checkpoint_every=2)
    chain(spikes.requires_grad_()).sum().backward()
    assert chain.last_run == (backends.Run("torch", "checkpointed"),) * 2


def test_delay_layers_say_how_they_ran():
    delayed = flexgen.DelayedLinear(3, 2, max_delay=2, backend="conv")
    delayed(torch.rand(4, 1, 3))
    assert delayed.last_run == backends.Run("torch", "conv")
    line = flexgen.Delay(3, max_delay=2)
    line(torch.rand(4, 1, 3))
    assert line.last_run == backends.Run("torch", "two taps")
