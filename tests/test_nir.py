"""NIR import (flexgen.from_nir) and export (flexgen.to_nir): round trips, the NIR equations, graphs
written by snnTorch's and SpikingJelly's own exporters, and what NIR cannot express."""
import math
import pickle

import numpy
import pytest
import torch

import flexgen
from conftest import device_backends
from flexgen.neurons import continuous

nir = pytest.importorskip("nir")
pytest.importorskip("nirtorch")


def lif_node(n, tau, r, v_leak=0.0, v_threshold=1.0, v_reset=0.0):
    return nir.LIF(tau=numpy.full(n, tau), r=numpy.full(n, r), v_leak=numpy.full(n, v_leak),
                   v_threshold=numpy.full(n, v_threshold), v_reset=numpy.full(n, v_reset))


def affine(n_out, n_in, seed):
    g = numpy.random.default_rng(seed)
    return nir.Affine(weight=g.normal(size=(n_out, n_in)).astype(numpy.float32),
                      bias=g.normal(size=n_out).astype(numpy.float32) * 0.1)


def reset(model):
    for module in model.modules():
        if hasattr(module, "reset") and module is not model:
            module.reset()


# --- the NIR equations ------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("method", ["euler", "exact"])
def test_imported_neurons_follow_nirs_equations(method, device, backend):
    """LIF, CubaLIF, IF, LI, I and CubaLI against the NIR equations stepped by hand (forward Euler, or the
    exact solution with the input held), in float64."""
    dt, tau, tau_syn, r, v_leak, w_in = 0.25, 2.0, 0.5, 1.5, 0.25, 2.0
    n = 6
    nodes = {
        "LIF": lif_node(n, tau, r, v_leak, v_threshold=1.0, v_reset=-0.5),
        "CubaLIF": nir.CubaLIF(tau_syn=numpy.full(n, tau_syn), tau_mem=numpy.full(n, tau), r=numpy.full(n, r),
                               v_leak=numpy.full(n, v_leak), v_threshold=numpy.ones(n), v_reset=numpy.full(n, -0.5),
                               w_in=numpy.full(n, w_in)),
        "IF": nir.IF(r=numpy.full(n, r), v_threshold=numpy.ones(n), v_reset=numpy.full(n, -0.5)),
        "LI": nir.LI(tau=numpy.full(n, tau), r=numpy.full(n, r), v_leak=numpy.full(n, v_leak)),
        "I": nir.I(r=numpy.full(n, r)),
        "CubaLI": nir.CubaLI(tau_syn=numpy.full(n, tau_syn), tau_mem=numpy.full(n, tau), r=numpy.full(n, r),
                             v_leak=numpy.full(n, v_leak), w_in=numpy.full(n, w_in)),
    }
    x = torch.rand(8, 2, n, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 3
    for kind, node in nodes.items():
        model = flexgen.from_nir(nir.NIRGraph.from_list(node), dt=dt, method=method, backend=backend).to(device).double()
        got = model(x.to(device)).cpu()
        want = reference(kind, x, dt, method, tau, tau_syn, r, v_leak, w_in)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{kind} ({method})")
        if kind in ("LIF", "CubaLIF", "IF"):
            assert 0 < got.sum() < got.numel(), kind


def reference(kind, x, dt, method, tau, tau_syn, r, v_leak, w_in):
    """The node's output over the steps, from its equations."""
    i = torch.zeros_like(x[0])
    v = torch.zeros_like(x[0])
    outputs = []
    for xt in x:
        if kind in ("CubaLIF", "CubaLI"):
            if method == "euler":
                i, v = i + dt * (w_in * xt - i) / tau_syn, v + dt * (v_leak - v + r * i) / tau
            else:  # the coupled solution: i relaxes to w_in x, v to v_leak + r w_in x, through both decays
                a, b = math.exp(-dt / tau_syn), math.exp(-dt / tau)
                i_inf = w_in * xt
                v_inf = v_leak + r * i_inf
                i, v = i_inf + (i - i_inf) * a, v_inf + (v - v_inf) * b + r * tau_syn * (b - a) / (tau - tau_syn) * (i - i_inf)
        elif kind in ("IF", "I"):
            v = v + dt * r * xt
        else:
            step = (v + dt * (v_leak - v + r * xt) / tau) if method == "euler" else (
                v_leak + r * xt + (v - v_leak - r * xt) * math.exp(-dt / tau))
            v = step
        if kind in ("LI", "I", "CubaLI"):
            outputs.append(v)
            continue
        s = (v >= 1.0).double()
        v = v * (1 - s) - 0.5 * s
        outputs.append(s)
    return torch.stack(outputs)


# --- round trips -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,backend", device_backends())
def test_flexgen_to_nir_to_flexgen_gives_identical_spikes(device, backend):
    torch.manual_seed(6)
    channel_w = torch.tensor([-0.5, 0.0, 0.7, -1.0])
    plif = flexgen.PLIF(per_channel=4, step_mode="m")
    with torch.no_grad():
        plif.w.copy_(channel_w)
    cases = {
        "exact": torch.nn.Sequential(torch.nn.Linear(5, 6), continuous.lif(tau=3.0, r=1.5, v_rest=0.1, dt=0.5),
                                     torch.nn.Linear(6, 4), continuous.cuba_lif(tau_syn=2.0, tau_mem=4.0, w_in=3.0, dt=0.5)),
        "euler": torch.nn.Sequential(torch.nn.Linear(5, 6), flexgen.LIF(tau=2.5, v_reset=-0.2, step_mode="m"), torch.nn.Linear(6, 4),
                                     plif, torch.nn.Linear(4, 3, bias=False), flexgen.IF(v_threshold=0.5, step_mode="m")),
    }
    x = torch.rand(10, 3, 5) * 3
    for (method, net), dt in zip(cases.items(), (0.5, 1e-3)):
        for module in net:
            if isinstance(module, flexgen.NeuronModule):
                module.backend = backend
            else:
                torch.nn.init.uniform_(module.weight, 0.1, 0.8)  # excitatory: every layer fires
        net = net.to(device)
        graph = flexgen.to_nir(net, x.to(device), dt=None if method == "exact" else dt)
        imported = flexgen.from_nir(graph, dt=dt, method=method, backend=backend).to(device)
        reset(net)
        want = net(x.to(device))
        got = imported(x.to(device))
        assert torch.equal(got, want) and 0 < want.sum() < want.numel(), method


def test_nir_to_flexgen_to_nir_keeps_the_graph(tmp_path):
    n = 4
    graph = nir.NIRGraph.from_list(
        affine(n, 3, 0),
        nir.CubaLIF(tau_syn=numpy.full(n, 2e-3), tau_mem=numpy.array([5e-3, 6e-3, 7e-3, 8e-3]), r=numpy.full(n, 2.0),
                    v_leak=numpy.zeros(n), v_threshold=numpy.ones(n), v_reset=numpy.zeros(n), w_in=numpy.full(n, 3.0)),
        nir.Scale(scale=numpy.array([1.0, -1.0, 0.5, 2.0], dtype=numpy.float32)),
        nir.Linear(weight=numpy.ones((2, n), dtype=numpy.float32)),
        nir.LI(tau=numpy.full(2, 1e-3), r=numpy.ones(2), v_leak=numpy.zeros(2)),
    )
    path = tmp_path / "graph.nir"
    nir.write(path, graph)
    model = flexgen.from_nir(path, dt=1e-4, backend="torch")
    cuba = model.graph.cubalif
    assert cuba.tau_mem.shape == (4,) and cuba.spec.signature.learnable == ("tau_mem",)
    again = flexgen.to_nir(model, torch.zeros(3, 2, 3))
    assert set(again.edges) == set(graph.edges) and set(again.nodes) == set(graph.nodes)
    # NIR keeps the dtype it is given (float64 here, the weights float32). from_nir holds a value equal for all
    # neurons as a float64 hyper-parameter, and one per channel (tau_mem) as a learnable parameter in float32, torch's
    # default dtype: so tau_mem comes back as its float32 rounding (4.8e-8 relative) and every other field exactly.
    held_in_float32 = {("cubalif", "tau_mem")}
    for name, node in graph.nodes.items():
        exported = again.nodes[name]
        assert type(exported) is type(node)
        for field in ("weight", "bias", "scale", "tau", "tau_syn", "tau_mem", "r", "v_leak", "v_threshold", "v_reset", "w_in"):
            if hasattr(node, field):
                want = numpy.asarray(getattr(node, field))
                if (name, field) in held_in_float32:
                    want = want.astype(numpy.float32).astype(want.dtype)
                numpy.testing.assert_array_equal(numpy.broadcast_to(getattr(exported, field), want.shape), want,
                                                 err_msg=f"{name}.{field}")


def test_convolutional_graph_runs_every_step_through_the_convolution():
    n_out = 2 * 2 * 2
    conv = nir.Conv2d(input_shape=(4, 4), weight=numpy.ones((2, 1, 2, 2), dtype=numpy.float32), stride=1, padding=0,
                      dilation=1, groups=1, bias=numpy.zeros(2, dtype=numpy.float32))
    graph = nir.NIRGraph.from_list(
        conv,
        nir.IF(r=numpy.full((2, 3, 3), 1e4), v_threshold=numpy.full((2, 3, 3), 2.0), v_reset=numpy.zeros((2, 3, 3))),
        nir.SumPool2d(kernel_size=numpy.array([2, 2]), stride=numpy.array([1, 1]), padding=numpy.array([0, 0])),
        nir.Flatten(input_type={"input": numpy.array([2, 2, 2])}, start_dim=0, end_dim=-1),
        nir.Linear(weight=numpy.eye(n_out, dtype=numpy.float32)),
    )
    model = flexgen.from_nir(graph, dt=1e-4, backend="torch")
    x = torch.rand(5, 3, 1, 4, 4)
    got = model(x)
    # by hand: conv (sums of 2x2 patches), IF with r dt = 1, sum-pool, flatten
    patches = torch.nn.functional.conv2d(x.flatten(0, 1), torch.ones(2, 1, 2, 2)).unflatten(0, (5, 3))
    v, spikes = torch.zeros_like(patches[0]), []
    for step in patches:
        v = v + step
        s = (v >= 2.0).float()
        v = v * (1 - s)
        spikes.append(s)
    pooled = torch.nn.functional.avg_pool2d(torch.stack(spikes).flatten(0, 1), 2, stride=1, divisor_override=1)
    torch.testing.assert_close(got, pooled.unflatten(0, (5, 3)).flatten(2), rtol=0, atol=1e-6)
    again = flexgen.to_nir(model, x)
    assert [type(node).__name__ for node in again.nodes.values()] == ["Input", "Conv2d", "IF", "SumPool2d", "Flatten", "Linear", "Output"]


def test_imported_models_pickle():
    graph = nir.NIRGraph.from_list(affine(3, 2, 1), nir.LIF(tau=numpy.array([1e-3, 2e-3, 3e-3]), r=numpy.ones(3) * 10,
                                                            v_leak=numpy.zeros(3), v_threshold=numpy.ones(3)))
    model = flexgen.from_nir(graph, backend="torch")
    x = torch.rand(4, 2, 2) * 3
    copy = pickle.loads(pickle.dumps(model))
    assert torch.equal(copy(x), model(x))


# --- other libraries' exporters ----------------------------------------------------------------------

def test_snntorch_graph_reproduces_snntorch():
    """snnTorch's Leaky (reset to zero at once, as NIR's LIF) exported by snnTorch: its tau = dt / (1 - beta),
    r = tau / dt at dt = 1e-4 s is forward Euler, so from_nir(method="euler") gives snnTorch's spikes and
    membrane potentials (to float32 rounding of the exported time constants: 1e-5)."""
    snn = pytest.importorskip("snntorch")
    export_nir = pytest.importorskip("snntorch.export_nir")
    torch.manual_seed(7)
    options = dict(init_hidden=True, reset_mechanism="zero", reset_delay=False)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 16), snn.Leaky(beta=torch.full((16,), 0.9), threshold=torch.ones(16), **options),
        torch.nn.Linear(16, 4), snn.Leaky(beta=torch.full((4,), 0.8), threshold=torch.ones(4), output=True, **options),
    )
    for module in net:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.uniform_(module.weight, 0.0, 0.4)  # excitatory: both layers fire
    x = torch.rand(25, 3, 8)
    graph = export_nir.export_to_nir(net, x[0, 0])
    for module in net:
        if isinstance(module, snn.Leaky):
            module.reset_hidden()
    spikes, membranes = zip(*(net(step) for step in x))
    model = flexgen.from_nir(graph, dt=1e-4, method="euler", backend="torch")
    got = model(x)
    assert torch.equal(got, torch.stack(spikes)) and got.sum() > 10
    torch.testing.assert_close(getattr(model.graph, "3").v, membranes[-1], rtol=1e-5, atol=1e-5)


def test_spikingjelly_graph_reproduces_spikingjelly():
    """SpikingJelly's LIFNode exported by SpikingJelly (tau_NIR = tau dt, r = 1: forward Euler)."""
    pytest.importorskip("spikingjelly.activation_based.nir_exchange", reason="SpikingJelly is not installed beside torch here")
    from spikingjelly.activation_based import functional, neuron
    from spikingjelly.activation_based.nir_exchange import export_to_nir

    torch.manual_seed(8)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), neuron.LIFNode(tau=2.0, step_mode="m"),
                              torch.nn.Linear(16, 4), neuron.LIFNode(tau=3.0, step_mode="m"))
    x = torch.rand(25, 3, 8) * 3
    graph = export_to_nir(net, x)
    functional.reset_net(net)
    want = net(x)
    got = flexgen.from_nir(graph, dt=1e-4, method="euler", backend="torch")(x)
    assert torch.equal(got, want)


# --- what NIR cannot express -------------------------------------------------------------------------

def test_unsupported_graphs_and_layers_are_clear_errors():
    recurrent = nir.NIRGraph(  # a loop through two weights: not a recurrent layer's
        nodes={"input": nir.Input(input_type={"input": numpy.array([2])}), "lif": lif_node(2, 1e-3, 10.0),
               "w": nir.Linear(weight=numpy.eye(2, dtype=numpy.float32)),
               "u": nir.Linear(weight=numpy.eye(2, dtype=numpy.float32)),
               "output": nir.Output(output_type={"output": numpy.array([2])})},
        edges=[("input", "lif"), ("lif", "w"), ("w", "u"), ("u", "lif"), ("lif", "output")],
    )
    with pytest.raises(NotImplementedError, match="recurrent .*lif -> w -> u -> lif.*recurrent layer's loop"):
        flexgen.from_nir(recurrent)
    varying = nir.NIRGraph.from_list(nir.LIF(tau=numpy.array([[1e-3, 2e-3], [1e-3, 1e-3]]), r=numpy.ones((2, 2)),
                                             v_leak=numpy.zeros((2, 2)), v_threshold=numpy.ones((2, 2))))
    with pytest.raises(NotImplementedError, match="'lif' .*tau differs between neurons of one channel"):
        flexgen.from_nir(varying)
    with pytest.raises(NotImplementedError, match="Threshold node is not supported"):
        flexgen.from_nir(nir.NIRGraph.from_list(nir.Threshold(threshold=numpy.ones(2))))
    x = torch.zeros(2, 1, 3)
    with pytest.raises(NotImplementedError, match="'izhikevich' has no NIR node"):
        flexgen.to_nir(torch.nn.Sequential(torch.nn.Linear(3, 3), flexgen.neurons.zoo.izhikevich()), x)
    with pytest.raises(NotImplementedError, match="soft reset"):
        flexgen.to_nir(torch.nn.Sequential(torch.nn.Linear(3, 3), flexgen.LIF(v_reset=None, step_mode="m")), x)
    two_steps = torch.nn.Sequential(continuous.lif(dt=0.5), torch.nn.Linear(3, 3), continuous.lif(dt=0.25))
    with pytest.raises(ValueError, match="layer '2' runs at dt=0.25, the graph at dt=0.5"):
        flexgen.to_nir(two_steps, x)


def test_a_missing_nir_package_says_how_to_install_it(monkeypatch):
    """Import needs nir; export nirtorch too."""
    graph = nir.NIRGraph(nodes={"input": nir.Input(numpy.array([2])), "output": nir.Output(numpy.array([2]))},
                         edges=[("input", "output")])
    with monkeypatch.context() as patch:
        patch.setitem(__import__("sys").modules, "nir", None)  # None: an import of it fails
        with pytest.raises(ImportError, match="pip install nir nirtorch"):
            flexgen.from_nir(graph)
    monkeypatch.setitem(__import__("sys").modules, "nirtorch", None)
    with pytest.raises(ImportError, match="pip install nir nirtorch"):
        flexgen.to_nir(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.rand(3, 1, 2))


# --- graphs and values checked before anything is built ---------------------------------------------

@pytest.fixture
def within_seconds():
    """Fail a test (rather than hang the suite) if its body runs longer than 20 s."""
    import signal

    def expired(signum, frame):
        raise TimeoutError("from_nir did not return within 20 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _io(n=2):
    return {"input": nir.Input(input_type={"input": numpy.array([n])}),
            "output": nir.Output(output_type={"output": numpy.array([n])})}


def test_a_graph_with_nodes_but_no_edges_fails_fast_from_memory_and_from_a_file(tmp_path, within_seconds):
    graph = nir.NIRGraph(nodes={**_io(), "lif": lif_node(2, 1e-3, 10.0)}, edges=[])
    message = r"the graph has 3 Input nodes \[.*'input_lif'.*\].*exactly one"
    with pytest.raises(ValueError, match=message):
        flexgen.from_nir(graph)
    path = tmp_path / "no_edges.nir"
    nir.write(path, graph)
    with pytest.raises(ValueError, match=message):
        flexgen.from_nir(path)


def _chain():
    """input -> lif -> output, built and type-checked by nir; the tests below break it afterwards, as a graph
    edited in place, or made by another tool, may be broken (nir fixes or refuses some faults when building)."""
    return nir.NIRGraph(nodes={**_io(), "lif": lif_node(2, 1e-3, 10.0)}, edges=[("input", "lif"), ("lif", "output")])


@pytest.mark.parametrize("edges,fragment", [
    ([("input", "lif"), ("lif", "output"), ("input", "dead_end")], r"\['dead_end'\] on no path leading to an Output"),
    ([("input", "lif"), ("lif", "output"), ("island", "dead_end")], r"\['dead_end', 'island'\] on no path reached from"),
    ([("input", "lif"), ("lif", "outptu")], r"edge \('lif', 'outptu'\) to 'outptu', which is not one of its nodes"),
    ([("input", "output")], r"\['lif'\] on no path reached from"),
])
def test_every_node_must_lie_on_a_path_from_input_to_output(edges, fragment, within_seconds):
    graph = _chain()
    mentioned = {end for edge in edges for end in edge}
    if "dead_end" in mentioned:
        graph.nodes["dead_end"] = lif_node(2, 1e-3, 10.0)
    if "island" in mentioned:
        graph.nodes["island"] = nir.Linear(weight=numpy.eye(2, dtype=numpy.float32))
    graph.edges = edges
    with pytest.raises(ValueError, match=fragment):
        flexgen.from_nir(graph)


def _long_chain(length):
    """input -> `length` nodes -> output: Scale nodes near 1, every 10th node an Affine node near the identity and
    every 100th a LIF node (NIRGraph's own type inference, quadratic in the nodes, is left out)."""
    g = numpy.random.default_rng(3)
    nodes, edges, previous = _io(), [], "input"
    for k in range(length):
        name = f"n{k}"
        if k % 100 == 99:
            nodes[name] = lif_node(2, 2e-3, 40.0)
        elif k % 10 == 9:
            nodes[name] = nir.Affine(weight=(numpy.eye(2) + 0.05 * g.normal(size=(2, 2))).astype(numpy.float32),
                                     bias=(0.05 * g.normal(size=2)).astype(numpy.float32))
        else:
            nodes[name] = nir.Scale(scale=(1 + 0.01 * g.normal(size=2)).astype(numpy.float32))
        edges.append((previous, name))
        previous = name
    edges.append((previous, "output"))
    return nir.NIRGraph(nodes=nodes, edges=edges, type_check=False)


def test_a_chain_of_thousands_of_nodes_imports_and_runs(within_seconds):
    """The graph checks and the model walk the graph in loops, not along call stacks (a chain of 1,000 nodes
    overflowed Python's stack before), and in time linear in its size."""
    graph = _long_chain(3000)
    model = flexgen.from_nir(graph, dt=1e-4, method="exact", backend="torch").double()
    by_hand = []
    for name, node in graph.nodes.items():
        if isinstance(node, nir.Affine):
            linear = torch.nn.Linear(2, 2)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(node.weight))
                linear.bias.copy_(torch.from_numpy(node.bias))
            by_hand.append(linear)
        elif isinstance(node, nir.Scale):
            by_hand.append(flexgen.interop.nir.Scale(torch.from_numpy(node.scale)))
        elif isinstance(node, nir.LIF):
            by_hand.append(continuous.lif(tau=2e-3, r=40.0, dt=1e-4, backend="torch"))
    assert len(by_hand) == 3000
    by_hand = torch.nn.Sequential(*by_hand).double()
    x = torch.rand(6, 2, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    got, want = model(x), by_hand(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert 0 < want.abs().sum()


def test_a_cycle_in_a_large_graph_is_still_named(within_seconds):
    graph = _long_chain(3000)
    graph.edges.append(("n2990", "n10"))
    with pytest.raises(NotImplementedError, match=r"the graph is recurrent \(n10 -> n11 -> n12 -> .* -> n2990 -> n10\)"):
        flexgen.from_nir(graph)


def test_a_graph_without_an_output_node_is_refused():
    graph = _chain()
    del graph.nodes["output"]
    graph.edges = [("input", "lif")]
    with pytest.raises(ValueError, match=r"has 0 Output nodes \[\]"):
        flexgen.from_nir(graph)


def test_shapes_that_disagree_along_an_edge_are_refused():
    graph = _chain()
    graph.nodes["lif"] = lif_node(4, 1e-3, 10.0)
    with pytest.raises(ValueError, match=r"'input' outputs shape \[2\] but 'lif' takes shape \[4\]"):
        flexgen.from_nir(graph)


def test_a_neuron_node_takes_only_the_number_of_neurons_it_declares():
    model = flexgen.from_nir(nir.NIRGraph.from_list(lif_node(4, 1e-3, 10.0)), backend="torch")
    assert model(torch.rand(3, 2, 4)).shape == (3, 2, 4)
    with pytest.raises(ValueError, match=r"'lif' \(LIF\) declares \[4\] neurons, got inputs \[3, 2, 3\]"):
        model(torch.rand(3, 2, 3))


@pytest.mark.parametrize("tau,fragment", [
    (float("nan"), "tau holds NaN or infinite values"),
    (float("inf"), "tau holds NaN or infinite values"),
    (0.0, "tau is a time constant and must be positive, got 0"),
    (-1e-3, "tau is a time constant and must be positive, got -0.001"),
])
def test_nir_parameters_must_be_finite_and_time_constants_positive(tau, fragment):
    with pytest.raises(ValueError, match=fragment):
        flexgen.from_nir(nir.NIRGraph.from_list(lif_node(2, tau, 10.0)))
    cuba = nir.CubaLIF(tau_syn=numpy.full(2, 1e-3), tau_mem=numpy.array([2e-3, tau]), r=numpy.ones(2),
                       v_leak=numpy.zeros(2), v_threshold=numpy.ones(2), v_reset=numpy.zeros(2), w_in=numpy.ones(2))
    with pytest.raises(ValueError, match=fragment.replace("tau", "tau_mem")):
        flexgen.from_nir(nir.NIRGraph.from_list(cuba))


def delayed(x, steps):
    """Channel c of [T, B, C] moved steps[c] whole steps later, zeros before."""
    y = torch.zeros_like(x)
    for c, d in enumerate(steps):
        y[d:, :, c] = x[:x.shape[0] - d, :, c]
    return y


def test_delay_nodes_import_as_whole_steps():
    """tau / dt steps; 3e-4 / 1e-4 is 2.9999999999999996 in floats and still a shift of exactly 3 steps."""
    graph = nir.NIRGraph.from_list(nir.Delay(delay=numpy.array([0.0, 2e-4, 5e-4, 3e-4])))
    model = flexgen.from_nir(graph, dt=1e-4)
    x = torch.rand(8, 2, 4)
    assert torch.equal(model(x), delayed(x, [0, 2, 5, 3]))


@pytest.mark.parametrize("delays", [[1.0, 0.0, 4.0], [2.5, 0.25, 3.0]])
def test_delay_round_trip(delays):
    model = torch.nn.Sequential(
        flexgen.Delay(3, max_delay=4, delay=torch.tensor(delays), learnable=False), torch.nn.Linear(3, 2))
    x = torch.rand(7, 2, 3)
    graph = flexgen.to_nir(model, x, dt=1e-3)
    (node,) = [n for n in graph.nodes.values() if isinstance(n, nir.Delay)]
    assert numpy.allclose(node.delay, numpy.array(delays) * 1e-3, rtol=1e-12, atol=0)
    again = flexgen.from_nir(graph, dt=1e-3)
    assert torch.equal(again(x), model(x))


def test_a_neuron_layers_delay_line_exports_as_a_delay_node_before_it():
    delays = torch.tensor([1.0, 0.0, 3.0, 2.0])
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4),
        flexgen.LIF(tau=2.0, step_mode="m", backend="torch",
                    delay=flexgen.Delay(4, max_delay=3, delay=delays, learnable=False)))
    with torch.no_grad():  # a current that makes the neurons fire
        model[0].weight.copy_(torch.eye(4) * 2.0)
        model[0].bias.zero_()
    x = torch.rand(9, 2, 4) * 2
    graph = flexgen.to_nir(model, x, dt=1e-3)
    (line,) = [name for name, node in graph.nodes.items() if isinstance(node, nir.Delay)]
    (neuron,) = [name for name, node in graph.nodes.items() if isinstance(node, nir.LIF)]
    assert line == f"{neuron}_delay"
    assert (line, neuron) in graph.edges and sum(target == neuron for _, target in graph.edges) == 1
    assert numpy.allclose(graph.nodes[line].delay, delays.double().numpy() * 1e-3, rtol=1e-12, atol=0)
    again = flexgen.from_nir(graph, dt=1e-3, backend="torch")
    assert torch.equal(again(x), model(x))
    assert model(x).any()


def test_dense_layers_are_refused_by_name():
    layer = flexgen.Dense(3, 3, flexgen.LIF)
    with pytest.raises(NotImplementedError, match="Dense layers are not exported to NIR yet"):
        flexgen.to_nir(torch.nn.Sequential(torch.nn.Linear(3, 3), layer), torch.rand(4, 2, 3))


# --- recurrent layers: NIR's loop through a weight back into the neuron --------------------------------------

def recurrent_graph(hidden=4, delay=None, bias=True, seed=0):
    rng = numpy.random.default_rng(seed)
    weight = rng.normal(0.0, 1.0, (hidden, hidden)).astype(numpy.float32)
    back = (nir.Affine(weight=weight, bias=rng.normal(0.0, 0.1, hidden).astype(numpy.float32)) if bias
            else nir.Linear(weight=weight))
    nodes = {"input": nir.Input(input_type={"input": numpy.array([3])}),
             "fc": nir.Linear(weight=rng.normal(0.0, 1.0, (hidden, 3)).astype(numpy.float32)),
             "lif": lif_node(hidden, 2e-3, 20.0), "rec": back,
             "output": nir.Output(output_type={"output": numpy.array([hidden])})}
    edges = [("input", "fc"), ("fc", "lif"), ("rec", "lif"), ("lif", "output")]
    if delay is None:
        edges.append(("lif", "rec"))
    else:
        nodes["line"] = nir.Delay(delay=numpy.asarray(delay, dtype=float))
        edges += [("lif", "line"), ("line", "rec")]
    return nir.NIRGraph(nodes=nodes, edges=edges)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("delay", [None, [0.0, 1e-4, 2e-4, 3e-4]])
def test_a_recurrent_loop_imports_as_a_recurrent_layer(delay, bias):
    """The loop lif -> rec (-> line) -> lif becomes one flexgen.Recurrent, whose steps equal the neuron run one step
    at a time on its input plus the weight times its output one step (plus the delay) before."""
    graph = recurrent_graph(delay=delay, bias=bias)
    model = flexgen.from_nir(graph, dt=1e-4, backend="torch").double()
    layer = model.graph.node_module("lif")
    assert isinstance(layer, flexgen.Recurrent) and model.graph.node_module("rec") is None
    x = torch.rand(12, 2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    got = model(x)
    weight, fc = layer.weight.detach(), model.graph.node_module("fc")
    bias_value = layer.bias.detach() if bias else 0.0
    steps = [0] * 4 if delay is None else [round(d / 1e-4) for d in delay]
    cell, sent = layer.cell, []
    cell.reset()
    with torch.no_grad():
        current = fc(x)
        for t in range(x.shape[0]):
            back = torch.stack([sent[t - 1 - d][:, h] if t - 1 - d >= 0 else torch.zeros(2, dtype=x.dtype)
                                for h, d in enumerate(steps)], dim=1)
            sent.append(cell((current[t] + back @ weight.t() + bias_value)[None])[0])
    assert torch.equal(got, torch.stack(sent)) and got.sum() > 0


@pytest.mark.parametrize("delay", [None, [0.0, 1.0, 2.0, 3.0]])
def test_recurrent_layers_round_trip(delay):
    """to_nir writes a Recurrent layer as a subgraph with NIR's loop (its Delay as a Delay node); from_nir reads it
    back as the same layer, and the imported model exports again to the same graph."""
    torch.manual_seed(0)
    line = None if delay is None else flexgen.Delay(4, 3, delay=torch.tensor(delay), learnable=False)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), flexgen.Recurrent(
        continuous.lif, hidden=4, bias=True, dt=1e-4, tau=2e-3, r=20.0, delay=line, backend="torch"))
    with torch.no_grad():
        model[1].weight.mul_(3)
    x = torch.rand(12, 2, 3, generator=torch.Generator().manual_seed(2)) * 10
    graph = flexgen.to_nir(model, x)
    loop = graph.nodes["_1"]
    kinds = {name: type(node).__name__ for name, node in loop.nodes.items()}
    assert kinds["neuron"] == "LIF" and kinds["feedback"] == "Affine" and (kinds.get("delay") == "Delay") == bool(delay)
    imported = flexgen.from_nir(graph, dt=1e-4, method="exact", backend="torch")
    expected = model(x)
    assert torch.equal(imported(x), expected) and expected.sum() > 0
    again = flexgen.from_nir(flexgen.to_nir(imported, x), dt=1e-4, method="exact", backend="torch")
    assert torch.equal(again(x), expected)


def test_a_recurrent_layer_with_scale_is_refused():
    layer = flexgen.Recurrent(continuous.lif, hidden=3, scale=True, backend="torch")
    with pytest.raises(NotImplementedError, match="scale= or a SynapseDelay has no NIR form"):
        flexgen.to_nir(torch.nn.Sequential(torch.nn.Linear(3, 3), layer), torch.rand(4, 2, 3))


def test_bad_delay_nodes_and_layers():
    with pytest.raises(ValueError, match="delays must be finite and >= 0"):
        flexgen.from_nir(nir.NIRGraph.from_list(nir.Delay(delay=numpy.array([1e-4, -1e-4]))))
    with pytest.raises(NotImplementedError, match="differ within a channel"):
        flexgen.from_nir(nir.NIRGraph.from_list(nir.Delay(delay=numpy.array([[1e-4, 2e-4], [0.0, 0.0]]))))
    gaussian = torch.nn.Sequential(flexgen.Delay(2, max_delay=3, delay=1.0, interpolation="gaussian"),
                                   torch.nn.Linear(2, 2))
    with pytest.raises(NotImplementedError, match="gaussian taps has no NIR node"):
        flexgen.to_nir(gaussian, torch.rand(4, 1, 2))
