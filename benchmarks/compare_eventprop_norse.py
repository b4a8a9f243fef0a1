"""EventProp's weight gradients against Norse's adjoint LIF (`norse.torch.functional.adjoint.lif_adjoint`).

    python benchmarks/compare_eventprop_norse.py [--out DIR] [--dts 0.1 0.03 0.01 0.003]

Norse integrates the current-based LIF (dv/dt = (i - v) / tau_mem, di/dt = -i / tau_syn, input spikes jumping i
by their weight) with Euler steps of dt and runs a hand-written adjoint backward per step. flexgen's
`EventPropDense` solves the same neuron exactly between events and computes the exact gradient. One layer (6
inputs, 4 neurons, 2 samples, up to 2 input spikes per input at times on a 0.1 ms grid, so that every dt has
them on its grid), fp64, loss sum_k c_k v(t_k) over the membrane potentials at t_k = 1, ..., 30 ms. Both
gradients of the loss with respect to the weight are compared (relative Euclidean distance) for several dt and
three cases: tau_syn = tau_mem (to a relative 1e-6: the exact flow divides by their difference) without and with
output spikes, and tau_syn = tau_mem / 2. Norse is not a dependency: `pip install norse`. Writes
eventprop_norse_<date>.md and .json to --out (default: print only).
"""
import argparse
import datetime
import json
import os
import platform
import time

import torch

import flexgen

B, INPUTS, NEURONS, T_OBS, K = 2, 6, 4, 30, 3
CASES = {  # name: (tau_mem, tau_syn, weight scale)
    "tau_syn = tau_mem, no output spike": (10.0, 10.00001, 0.1),
    "tau_syn = tau_mem, output spikes": (10.0, 10.00001, 1.0),
    "tau_syn = tau_mem / 2, output spikes": (10.0, 5.0, 1.0),
}


def problem(seed=0):
    """Input spike times [B, INPUTS, K] (inf-padded), a weight draw in [0.1, 1.3) and the loss's weights c."""
    g = torch.Generator().manual_seed(seed)
    times = (torch.randint(0, 250, (B, INPUTS, K), generator=g) * 0.1).sort(-1).values.double()
    times[..., K - 1] = float("inf")
    weight = torch.rand(NEURONS, INPUTS, generator=g, dtype=torch.float64) * 1.2 + 0.1
    c = torch.randn(T_OBS, B, NEURONS, generator=g, dtype=torch.float64)
    return times, weight, c


def flexgen_gradient(times, weight, c, tau_mem, tau_syn):
    @flexgen.ode(states=("v", "i"))
    def cuba(x, v, i, tau_m=tau_mem, tau_s=tau_syn, v_th=1.0):
        return flexgen.Dynamics({"v": (i - v) / tau_m, "i": -i / tau_s + x}, threshold=v >= v_th,
                                reset={"v": 0.0})

    layer = flexgen.EventPropDense(INPUTS, NEURONS, cuba, dt=1.0, steps=T_OBS)
    with torch.no_grad():
        layer.weight.copy_(weight)
    out = layer(times)
    (out.state("v") * c).sum().backward()
    return layer.weight.grad.clone(), int(out.counts.sum()), layer.last_run.backend


def norse_gradient(times, weight, c, tau_mem, tau_syn, dt):
    from norse.torch.functional.adjoint.lif_adjoint import lif_adjoint_step
    from norse.torch.functional.lif import LIFParameters, LIFState

    n = int(round(T_OBS / dt))
    spikes = torch.zeros(n, B, INPUTS, dtype=torch.float64)
    for b, i, k in (times < float("inf")).nonzero().tolist():  # the input spike at t starts step t / dt
        spikes[int(round(times[b, i, k].item() / dt)), b, i] += 1
    w = weight.clone().requires_grad_(True)
    p = LIFParameters(tau_syn_inv=torch.tensor(1 / tau_syn, dtype=torch.float64),
                      tau_mem_inv=torch.tensor(1 / tau_mem, dtype=torch.float64))
    zeros = torch.zeros(B, NEURONS, dtype=torch.float64)
    state, loss, fired = LIFState(zeros, zeros, zeros), 0.0, 0
    observed = {int(round((k + 1) / dt)) - 1: k for k in range(T_OBS)}  # step m ends at (m + 1) dt
    for m in range(n):
        z, state = lif_adjoint_step(spikes[m], state, w, torch.zeros(NEURONS, NEURONS, dtype=torch.float64), p, dt)
        fired += int(z.sum())
        if m in observed:
            loss = loss + (state.v * c[observed[m]]).sum()
    loss.backward()
    return w.grad, fired


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--dts", nargs="+", type=float, default=[0.1, 0.03, 0.01, 0.003], help="Norse's steps, ms")
    args = p.parse_args(argv)
    try:
        import norse
    except ImportError:
        raise SystemExit("Norse is not installed: pip install norse")
    times, weight, c = problem()
    rows = []
    for case, (tau_mem, tau_syn, scale) in CASES.items():
        exact, spikes, backend = flexgen_gradient(times, weight * scale, c, tau_mem, tau_syn)
        for dt in args.dts:
            start = time.perf_counter()
            theirs, fired = norse_gradient(times, weight * scale, c, tau_mem, tau_syn, dt)
            ratio = float((theirs * exact).sum() / (exact * exact).sum())  # the best scalar fit
            rows.append({"case": case, "tau_mem": tau_mem, "tau_syn": tau_syn, "dt": dt, "flexgen_spikes": spikes,
                         "norse_spikes": fired, "relative_difference": float((theirs - exact).norm() / exact.norm()),
                         "norse_over_flexgen": ratio, "norse_seconds": time.perf_counter() - start})
            print(rows[-1], flush=True)
    meta = {"date": datetime.date.today().isoformat(), "machine": f"CPU ({os.cpu_count()} cores)",
            "python": platform.python_version(), "torch": torch.__version__, "norse": norse.__version__,
            "flexgen_backend": backend, "command": "python benchmarks/compare_eventprop_norse.py"
            + (f" --out {args.out}" if args.out else "")}
    if args.out:
        write(meta, rows, args.out)
    return rows


def write(meta, rows, out):
    stem = os.path.join(out, f"eventprop_norse_{meta['date']}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# EventProp's gradients against Norse's adjoint LIF ({meta['machine']}, {meta['date']})", "",
             f"torch {meta['torch']}, Norse {meta['norse']}, flexgen's `EventPropDense` on its "
             f"{meta['flexgen_backend']!r} backend; `{meta['command']}`. One current-based LIF layer (6 inputs, 4 "
             "neurons, 2 samples), fp64, loss sum_k c_k v(t_k) at t_k = 1..30 ms; tau_mem 10 ms. Relative "
             "difference: |g_Norse - g_flexgen| / |g_flexgen| of dL/dW; ratio: the scalar that best maps "
             "flexgen's gradient onto Norse's.", "",
             "| case | tau_syn | Norse dt (ms) | output spikes (flexgen / Norse) | relative difference | ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['tau_syn']:.7g} | {r['dt']:g} | {r['flexgen_spikes']} / {r['norse_spikes']} "
                     f"| {r['relative_difference']:.3e} | {r['norse_over_flexgen']:.4f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
