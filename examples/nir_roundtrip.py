"""NIR round trip: export a flexgen network to the Neuromorphic Intermediate Representation, read it
back, and compare; then import a graph written by snnTorch (when it is installed).

    python examples/nir_roundtrip.py [FILE.nir]

1. A network of continuous-time neurons (flexgen's OdeLIF and OdeCubaLIF, integrated exactly) is
   exported with `flexgen.to_nir` (the neurons as NIR's LIF and CubaLIF equations) and written to
   FILE.nir (default: a temporary file).
2. `flexgen.from_nir(FILE.nir, dt=..., method="exact")` builds a model from it: its spikes are
   identical to the original network's.
3. An snnTorch network (Leaky neurons reset to zero) exported by snnTorch's own exporter is imported
   with `method="euler"` at snnTorch's dt = 1e-4 s, its convention, and gives snnTorch's spikes.
"""
import os
import sys
import tempfile

import torch

import flexgen
from flexgen.neurons import continuous

try:
    import nir
except ImportError as exc:  # an optional dependency of this example
    sys.exit(f"nir_roundtrip.py needs nir and nirtorch ({exc}); pip install nir nirtorch")


def flexgen_network():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(10, 32), continuous.lif(tau=5.0, dt=0.5),
        torch.nn.Linear(32, 4), continuous.cuba_lif(tau_syn=2.0, tau_mem=8.0, w_in=2.0, dt=0.5),
    )
    for module in net:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.uniform_(module.weight, 0.0, 0.5)  # excitatory, so that every layer fires
    return net


def round_trip(path):
    net = flexgen_network()
    x = torch.rand(50, 8, 10) * 2  # [T, batch, inputs]
    graph = flexgen.to_nir(net, x)  # dt: the layers' own (0.5)
    nir.write(path, graph)
    print(f"wrote {path}: " + " -> ".join(f"{name} ({type(node).__name__})" for name, node in graph.nodes.items()))

    imported = flexgen.from_nir(path, dt=0.5, method="exact")
    print(imported)
    want, got = net(x), imported(x)
    assert torch.equal(got, want), "the imported network's spikes differ"
    print(f"flexgen -> NIR -> flexgen: {int(want.sum())} output spikes, identical")


def from_snntorch():
    try:
        import snntorch
        from snntorch.export_nir import export_to_nir
    except ImportError:
        print("snnTorch is not installed: skipping its graph")
        return
    torch.manual_seed(1)
    leaky = dict(init_hidden=True, reset_mechanism="zero", reset_delay=False)
    net = torch.nn.Sequential(
        torch.nn.Linear(10, 32), snntorch.Leaky(beta=torch.full((32,), 0.9), threshold=torch.ones(32), **leaky),
        torch.nn.Linear(32, 4), snntorch.Leaky(beta=torch.full((4,), 0.8), threshold=torch.ones(4), output=True, **leaky),
    )
    for module in net:
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.uniform_(module.weight, 0.0, 0.4)
    x = torch.rand(50, 8, 10)
    graph = export_to_nir(net, x[0, 0])
    for module in net:
        if isinstance(module, snntorch.Leaky):
            module.reset_hidden()
    want = torch.stack([net(step)[0] for step in x])
    got = flexgen.from_nir(graph, dt=1e-4, method="euler")(x)
    assert torch.equal(got, want), "the imported snnTorch network's spikes differ"
    print(f"snnTorch -> NIR -> flexgen: {int(want.sum())} output spikes, identical to snnTorch's")


def main():
    if len(sys.argv) > 1:
        round_trip(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            round_trip(os.path.join(tmp, "network.nir"))
    from_snntorch()
    print("OK")


if __name__ == "__main__":
    main()
