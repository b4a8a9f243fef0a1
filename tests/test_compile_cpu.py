"""torch.compile on the CPU runs the C kernels: the C target's custom ops have the C launcher as their CPU kernel and
fake kernels for tracing, so a compiled (or exported) model keeps the C target's speed and gives the eager values
(fp64: 1e-12, spikes equal), gradients included, without a warning about the torch path."""
import warnings

import pytest
import torch

import flexgen
from conftest import HAS_C_COMPILER
from test_export import inputs, make

pytestmark = pytest.mark.skipif(not HAS_C_COMPILER, reason="needs a C compiler")


def recording(graphs):
    """A torch.compile backend that keeps the graphs' code and runs them as aot_eager does."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


@pytest.mark.parametrize("name", ["lif", "ode", "dense", "recurrent", "delay"])
def test_compiled_model_runs_the_c_kernels_and_equals_eager(name):
    model = make(name, "c")
    x = inputs(6).requires_grad_()
    graphs = []
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs the torch path" (nor any other) warning
        compiled = torch.compile(model, backend=recording(graphs), fullgraph=True)
        got = compiled(x)
        (grad,) = torch.autograd.grad(got.sum(), x)
    flexgen.reset(model)
    expected = model(x)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    assert torch.equal(got, expected) and expected.sum() > 0
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)
    assert "_c_forward" in graphs[0] and "_c_backward" in graphs[-1]  # the C ops, forward and backward


def test_inductor_compiles_around_the_c_kernels():
    model = make("lif", "c")
    x = inputs(6)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = torch.compile(model, fullgraph=True)(x * 0.5 + 1.0)
    flexgen.reset(model)
    assert torch.equal(got, model(x * 0.5 + 1.0)) and got.sum() > 0


def test_an_exported_model_runs_the_c_kernels():
    model = make("dense", "c")
    program = flexgen.export_model(model, (inputs(6),))
    assert any(name.endswith("_c_forward") for name in flexgen.interop.export.flexgen_ops(program))
    torch.testing.assert_close(program.module()(inputs(9)), model(inputs(9)), rtol=0, atol=1e-12)
