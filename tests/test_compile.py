"""torch.compile(fullgraph=True) over a network with flexgen layers: no graph breaks, same results."""
import pytest
import torch

from specs import lif, plif


def count_graph_breaks(fn, *args):
    import torch._dynamo

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_break_count


def make_net(device, recompute=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), lif(tau=3.0, recompute=recompute), torch.nn.Linear(16, 4), plif(recompute=recompute)]
    return torch.nn.Sequential(*layers).to(device)


def multistep(net, x):
    for layer in net:
        if hasattr(layer, "reset"):
            layer.reset()
    return net(x)


@pytest.mark.parametrize(
    "device,compile_backend",
    [("cpu", "aot_eager"), pytest.param("cuda", "inductor", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("recompute", [False, True])
def test_compile_fullgraph_matches_eager(device, compile_backend, recompute):
    net = make_net(device, recompute)
    if device == "cpu":
        for m in net:
            if hasattr(m, "backend"):
                m.backend = "torch"
    x = torch.randn(5, 3, 8, device=device, requires_grad=True)
    assert count_graph_breaks(lambda x: multistep(net, x), x) == 0
    ref = multistep(net, x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in net.parameters()]
    ref_xgrad = x.grad.clone()
    net.zero_grad()
    x.grad = None
    compiled = torch.compile(lambda x: multistep(net, x), fullgraph=True, backend=compile_backend)
    out = compiled(x)
    out.sum().backward()
    assert torch.equal(out, ref)
    torch.testing.assert_close(x.grad, ref_xgrad, rtol=1e-5, atol=1e-6)
    for p, g in zip(net.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
