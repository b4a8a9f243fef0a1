"""A custom neuron with two states, a learnable parameter and a second output.

    python examples/custom_neuron.py

An adaptive LIF neuron: every spike raises the threshold by `beta * a`, and the
adaptation `a` decays with time constant `tau_a`. It shows the parts of a spec:

* per-step inputs: parameters without a default (`x`);
* states: named in `states=(...)`, passed in as their value before the step,
  returned (after the outputs) as their new value (`v`, `a`);
* hyper-parameters: numeric defaults, overridable per layer (`tau_a`, `beta`, `v_th`);
* learnable parameters: named in `learnable=(...)`, become `nn.Parameter`s (`w`);
* `init`: a state's initial value, a number or a hyper-parameter's name;
* `flexgen.spike(..., surrogate=...)` and `flexgen.detach`.
"""
import torch

import flexgen
from flexgen import surrogate


@flexgen.neuron(states=("v", "a"), learnable=("w",), init={"v": "v_rest"})
def adaptive_lif(x, v, a, w=0.0, tau_a=20.0, beta=0.3, v_th=1.0, v_rest=0.0):
    """Adaptive-threshold LIF; the membrane time constant is 1 + exp(w), learnt."""
    tau = 1.0 + flexgen.exp(w)
    h = v + (x - (v - v_rest)) / tau
    theta = v_th + beta * a
    s = flexgen.spike(h - theta, surrogate=surrogate.ATan(alpha=2.0))
    v_next = h - flexgen.detach(s) * (h - v_rest)   # reset to v_rest; no gradient through the reset
    a_next = a + (s - a) / tau_a
    return s, theta, v_next, a_next                  # outputs s, theta; then the states v, a


def main():
    print(adaptive_lif)
    print(adaptive_lif.equations())

    torch.manual_seed(0)
    x = 2.0 * torch.rand(32, 8, 16)                  # [T, batch, neurons]
    layer = adaptive_lif(beta=0.5, store_state_seqs=True)
    oracle = adaptive_lif(beta=0.5, store_state_seqs=True, backend="eager")
    print(layer)

    s, theta = layer(x)                              # two outputs
    s_ref, theta_ref = oracle(x)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(theta, theta_ref)
    for name in ("v", "a"):                          # the whole state sequences, [T, batch, neurons]
        torch.testing.assert_close(layer.state_seqs[name], oracle.state_seqs[name])
    print(f"spikes: {int(s.sum())}; threshold rose from {theta[0].mean():.3f} to {theta[-1].mean():.3f}")

    # The learnable parameter gets its gradient through the generated backward.
    (s.sum() + theta.mean()).backward()
    (s_ref.sum() + theta_ref.mean()).backward()
    torch.testing.assert_close(layer.w.grad, oracle.w.grad, rtol=1e-4, atol=1e-5)
    print(f"dL/dw = {layer.w.grad.item():.5f} (eager: {oracle.w.grad.item():.5f})")

    # The functional form: no module state, initial states and parameters passed in.
    (s2, _), (v_final, a_final) = adaptive_lif.apply(x, w=torch.tensor(0.0), beta=0.5)
    assert torch.equal(s2, s)
    print("OK: custom neuron matches backend='eager'")


if __name__ == "__main__":
    main()
