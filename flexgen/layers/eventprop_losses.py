"""Losses for `flexgen.EventPropDense` outputs (`flexgen.layers.eventprop_losses`): torch functions of the spike
times and of the recorded states, so their gradients reach EventProp's backward as dL/dt_k (the spike-time
error E of `flexgen.derive.adjoint`) and as jumps of the adjoint at the grid times.

    first_spike_cross_entropy      cross-entropy over -first spike time / tau (Wunderlich & Pehle's time-to-
                                   first-spike classification)
    label_first_spike_penalty      their regulariser: mean of exp(t_label / tau) - 1, the label neuron's first
                                   spike pulled earlier (the sum of the two is their Yin-Yang loss)
    max_voltage_cross_entropy      cross-entropy over each neuron's largest recorded state value
    exp_weighted_voltage_sum       sum_n exp(-t_n / tau) v(t_n) dt over the grid (loss shaping: an early
                                   response weighs more), the logits of voltage_sum_cross_entropy
    spike_count_regularisation     a spike-time term that moves spikes out of (or into) the window when a
                                   neuron fires more (fewer) times than a target; see its docstring
    silent_label_voltage_push      the label neuron's largest recorded state value pushed up towards the
                                   threshold in samples where it does not fire (its spike time has no gradient)
"""
import torch


def _labels(labels, n_batch):
    if not torch.is_tensor(labels) or labels.dtype != torch.long or labels.shape != (n_batch,):
        raise ValueError(f"labels must be a long tensor of shape [{n_batch}], got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)} {list(getattr(labels, 'shape', []))}")
    return labels


def first_spike_times(times, no_spike_time):
    """Each neuron's first spike time [B, N]; `no_spike_time` (a constant: no gradient) where it has none."""
    first = times[..., 0]
    return torch.where(torch.isfinite(first), first, torch.full_like(first, float(no_spike_time)))


def first_spike_cross_entropy(times, labels, no_spike_time, tau=1.0):
    """Cross-entropy of the logits -t_first / tau (the earliest neuron wins); times [B, N, K]."""
    first = first_spike_times(times, no_spike_time)
    return torch.nn.functional.cross_entropy(-first / tau, _labels(labels, first.shape[0]))


def label_first_spike_penalty(times, labels, no_spike_time, tau):
    """Mean over the batch of exp(t_label / tau) - 1, t_label the first spike time of the label's neuron
    (`no_spike_time`, no gradient, where it has none); times [B, N, K]. Wunderlich & Pehle add it, times a small
    alpha, to `first_spike_cross_entropy` so that the right neuron fires early, not only first."""
    first = first_spike_times(times, no_spike_time)
    labels = _labels(labels, first.shape[0])
    return torch.expm1(first.gather(1, labels[:, None])[:, 0] / tau).mean()


def max_voltage_cross_entropy(trace, labels):
    """Cross-entropy of each neuron's largest value of a state on the grid; trace [T, B, N] (`out.state("v")`)."""
    return torch.nn.functional.cross_entropy(trace.max(dim=0).values, _labels(labels, trace.shape[1]))


def exp_weighted_voltage_sum(trace, dt, tau):
    """sum over the grid of exp(-t_n / tau) v(t_n) dt, t_n = (n + 1) dt: [B, N] from trace [T, B, N]."""
    t = dt * torch.arange(1, trace.shape[0] + 1, dtype=trace.dtype, device=trace.device)
    return (torch.exp(-t / tau)[:, None, None] * trace).sum(0) * dt


def voltage_sum_cross_entropy(trace, labels, dt, tau):
    """Cross-entropy of `exp_weighted_voltage_sum`."""
    return torch.nn.functional.cross_entropy(exp_weighted_voltage_sum(trace, dt, tau),
                                             _labels(labels, trace.shape[1]))


def spike_count_regularisation(times, counts, target, window, strength=1.0):
    """strength * mean over the batch of sum_n (count_n - target) * sum_k (1 - t_k / window).

    A neuron's spike count has no gradient (a spike appears or vanishes at a point where the gradient does not
    exist). This term is a function of the spike times, with the counts as constant coefficients; its exact
    gradient, -strength (count - target) / window per spike, moves the spikes of a neuron that fires too often
    towards the end of the window and those of one that fires too rarely towards its start. A neuron without
    spikes gets no gradient from it."""
    finite = torch.isfinite(times)
    early = torch.where(finite, 1.0 - times / window, torch.zeros_like(times)).sum(-1)
    excess = (counts - target).to(times.dtype)
    return strength * (excess * early).sum() / times.shape[0]


def silent_label_voltage_push(times, trace, labels, threshold):
    """Mean over the batch of relu(threshold - max_n v_label(t_n)) over the samples whose label neuron does not
    fire (zero for the others); times [B, N, K], trace [T, B, N] (`out.state("v")`).

    A neuron without a spike has no spike time to move, so a time-to-first-spike loss gives a silent label neuron
    no gradient at all, and a network whose outputs fall silent stays so. This term gives it one through its
    voltage (EventProp's jumps of the adjoint at the grid times), until the neuron fires again."""
    labels = _labels(labels, times.shape[0])
    if trace.shape[1:] != times.shape[:2]:
        raise ValueError(f"trace must be [T, B, N] for times [B, N, K] = {list(times.shape)}, got "
                         f"{list(trace.shape)}")
    peak = trace.max(dim=0).values.gather(1, labels[:, None])[:, 0]
    silent = ~torch.isfinite(times[..., 0].gather(1, labels[:, None])[:, 0])
    return torch.where(silent, torch.relu(threshold - peak), torch.zeros_like(peak)).mean()
