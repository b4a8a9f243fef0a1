"""A published model from its equations to a trained layer: the adaptive exponential integrate-and-fire
neuron (AdEx) of Brette & Gerstner, J. Neurophysiol. 94:3637 (2005), with their parameters.

    python examples/adex_equations.py [--iterations 50] [--min-accuracy 0.9]

1. The equations as the paper writes them, in `flexgen.ode` (units mV, ms, nF, µS, nA):
       C dV/dt = -g_L (V - E_L) + g_L Delta_T exp((V - V_T) / Delta_T) - w + I
       tau_w dw/dt = a (V - E_L) - w
   and at V >= V_peak: V <- V_r, w <- w + b.
2. What flexgen derived from them (`spec.equations()`): the discrete update and its backward.
3. The model's signature: spike-frequency adaptation under a step current (the intervals between
   spikes grow as w builds up).
4. Training: four input patterns drive six AdEx neurons through a Linear layer, whose weights learn
   to make every neuron fire a target number of spikes per pattern in 100 ms (gradients through the
   derived backward, ATan's surrogate for the spike, no gradient through the reset). Exits with status
   1 if fewer than --min-accuracy of the counts end up exact.

The method is explicit Euler at dt = 0.25 ms: exact integration needs equations linear in the states,
and RK methods evaluate the exponential at their trial states beyond the spike, where it overflows.
"""
import argparse
import sys

import torch

import flexgen
from flexgen import Dynamics, exp, surrogate


@flexgen.ode(states=("v", "w"), method="euler", dt=0.25, init={"v": "e_l"}, surrogate=surrogate.ATan())
def adex(x, v, w, c=0.281, g_l=0.030, e_l=-70.6, v_t=-50.4, delta_t=2.0, tau_w=144.0, a=0.004, b=0.0805,
         v_reset=-70.6, v_peak=20.0):
    """AdEx with the parameters of Brette & Gerstner (2005); x is the input current in nA."""
    return Dynamics(
        {"v": (-g_l * (v - e_l) + g_l * delta_t * exp((v - v_t) / delta_t) - w + x) / c,
         "w": (a * (v - e_l) - w) / tau_w},
        threshold=v >= v_peak,
        reset={"v": v_reset, "w": w + b},
    )


def adaptation():
    """Spike times under a 1 nA step current: the intervals grow."""
    layer = adex()
    steps = 1200  # 300 ms at dt = 0.25 ms
    with torch.no_grad():
        s = layer(torch.full((steps, 1), 1.0))
    times = (torch.nonzero(s[:, 0]).flatten() * 0.25).tolist()
    intervals = [b - a for a, b in zip(times, times[1:])]
    print(f"1 nA for 300 ms: {len(times)} spikes at {', '.join(f'{t:.1f}' for t in times)} ms")
    print(f"inter-spike intervals: {', '.join(f'{i:.1f}' for i in intervals)} ms")
    assert len(intervals) >= 3 and intervals[-1] > intervals[0], "AdEx should adapt: longer intervals"


def train(iterations, steps=400):
    torch.manual_seed(0)
    patterns = torch.eye(4)                                    # four input patterns
    target = torch.randint(1, 6, (4, 6)).float()               # spikes wanted per (pattern, neuron) in 100 ms
    readin = torch.nn.Linear(4, 6, bias=False)
    torch.nn.init.uniform_(readin.weight, 0.5, 1.0)            # input currents in nA
    neurons = adex(detach_reset=True)  # no gradient through the reset: it jumps from tens of mV to the peak
    optimiser = torch.optim.Adam(readin.parameters(), lr=0.02)
    x = patterns.expand(steps, 4, 4)                           # [T, pattern, input]: each pattern held 100 ms
    for iteration in range(iterations + 1):
        neurons.reset()
        counts = neurons(readin(x)).sum(dim=0)                 # [pattern, neuron]
        loss = torch.nn.functional.mse_loss(counts, target)
        accuracy = (counts == target).float().mean().item()
        if iteration % 10 == 0:
            print(f"iteration {iteration:3d}: loss {loss.item():7.3f}, exact counts {accuracy:.0%}")
        if iteration < iterations:
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    args = parser.parse_args()
    print(adex.equations())
    adaptation()
    accuracy = train(args.iterations)
    print(f"final exact counts: {accuracy:.0%}")
    if accuracy < args.min_accuracy:
        print(f"below --min-accuracy {args.min_accuracy:.0%}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
