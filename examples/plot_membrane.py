"""Plot the membrane potential and spikes of a few LIF neurons.

    python examples/plot_membrane.py [output.png]      (default: membrane.png next to this file)

With `store_state_seqs=True` a layer keeps the whole sequence of each state,
`layer.state_seqs["v"]` ([T, ...], the value after every step), besides the
outputs. The plot shows, for three neurons driven by different constant
currents, the pre-spike potential h (recomputed from v), the threshold and the
spike times. Needs matplotlib (drawn with the Agg backend: no display needed).
"""
import os
import sys

import torch

import flexgen

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError as exc:
    sys.exit(f"plot_membrane.py needs matplotlib ({exc}); pip install matplotlib")


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s)


def main(argv):
    path = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "membrane.png")
    n_steps, tau, v_th = 60, 5.0, 1.0
    currents = torch.tensor([0.9, 1.2, 2.0])                  # one constant input current per neuron
    noise = 0.15 * torch.randn(n_steps, 3, generator=torch.Generator().manual_seed(0))
    x = currents + noise                                      # [T, 3]

    layer = lif(tau=tau, v_th=v_th, store_state_seqs=True)
    s = layer(x)                                              # spikes [T, 3]
    v_seq = layer.state_seqs["v"]                             # v after each step (0 right after a spike), [T, 3]
    v_before = torch.cat([torch.zeros(1, 3), v_seq[:-1]])     # v before each step
    h = v_before + (x - v_before) / tau                       # the potential the threshold is compared with

    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 6))
    t = torch.arange(n_steps)
    for k, ax in enumerate(axes):
        ax.plot(t, h[:, k], label="h (before reset)")
        ax.plot(t, v_seq[:, k], label="v (after reset)", alpha=0.6)
        ax.axhline(v_th, color="gray", linestyle="--", linewidth=1, label="v_th")
        spikes = t[s[:, k] > 0]
        ax.vlines(spikes, v_th, v_th + 0.3, color="red", label="spike")
        ax.set_ylabel(f"input {currents[k]:.1f}")
        print(f"neuron {k}: input {currents[k]:.1f}, {len(spikes)} spikes at steps {spikes.tolist()}")
    axes[0].legend(loc="lower right", fontsize="small", ncol=4)
    axes[-1].set_xlabel("time step")
    fig.suptitle(f"LIF neurons (tau={tau}, v_th={v_th})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"saved {os.path.abspath(path)}")


if __name__ == "__main__":
    main(sys.argv)
