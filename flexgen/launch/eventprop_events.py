"""What the EventProp kernels (C and Triton) read of one call: each lane's input events in time order, the first
event of each grid interval, and the neurons' parameters and initial states as tables. A lane is a sample (its
neurons see the same events) or, for arrival times [B, N, I, K] (per-synapse delays), one row (sample, neuron).
Everything is float64 (the kernels compute in it) and stays on the device of the times."""
from typing import NamedTuple

import torch

F64 = torch.float64


class Events(NamedTuple):
    """time [lanes, M] ascending (inf past each lane's count), index [lanes, M] (input * K + slot of each event),
    count [lanes], M (at least 1)."""

    time: torch.Tensor
    index: torch.Tensor
    count: torch.Tensor
    M: int


CHUNK_ELEMENTS = 1 << 20  # entries of padded per-lane tables taken at once: lanes go in chunks (small temporaries)


def event_lists(times, steps, dt):
    """Each lane's events of `times` ([B, I, K] or [B, N, I, K], inf: no spike) in the window [0, steps dt),
    sorted by time (at equal times in input-major order, as the torch reference takes them). The lanes are sorted
    a chunk at a time (`CHUNK_ELEMENTS` entries): the sort's copies of the padded times (float64 keys, int64
    positions) would otherwise be several times the lists themselves."""
    I, K = times.shape[-2:]
    flat = times.detach().reshape(-1, I * K)
    lanes, end = flat.shape[0], steps * dt
    chunks = range(0, lanes, max(1, CHUNK_ELEMENTS // max(1, I * K)))

    def keyed(at):  # the chunk's times in float64 (compared with the window's end there), inf where no event
        part = flat[at:at + chunks.step].to(F64)
        return torch.where(torch.isfinite(part) & (part < end), part, torch.full_like(part, float("inf")))

    count = torch.cat([torch.isfinite(keyed(at)).sum(1) for at in chunks] or [flat.new_zeros(0, dtype=torch.int64)])
    M = max(1, int(count.max()) if len(count) else 1)
    time = torch.empty(lanes, M, dtype=F64, device=flat.device)
    index = torch.empty(lanes, M, dtype=torch.int64, device=flat.device)
    for at in chunks:
        ordered, where = torch.sort(keyed(at), dim=1, stable=True)
        time[at:at + chunks.step], index[at:at + chunks.step] = ordered[:, :M], where[:, :M]
    return Events(time, index, count.contiguous(), M)


def interval_firsts(events, steps, dt):
    """[lanes, steps + 1]: the index of each grid interval's first event (interval n holds the events in
    (n dt, (n + 1) dt], the first also those at 0; the last column is the count), by the same grid values the
    kernels compute, (n + 1) * dt in float64."""
    grid = torch.arange(1, steps + 1, dtype=F64, device=events.time.device) * dt
    inside = torch.searchsorted(events.time, grid.expand(events.time.shape[0], steps).contiguous(), right=True)
    inside = torch.minimum(inside, events.count[:, None])
    return torch.cat([torch.zeros_like(inside[:, :1]), inside], 1).contiguous()


def neuron_tables(params, n, parameters, states, init, device):
    """(p [n, P], initial [n, S]) in float64 on `device`: `params` one value per row (sample-major; the first n
    are sample 0's neurons, the same for every sample), `init` each state's start (a float, or a parameter's
    name)."""
    if params:
        p = torch.stack([q.detach().to(device=device, dtype=F64)[:n] for q in params], 1).contiguous()
    else:
        p = torch.zeros(n, 1, dtype=F64, device=device)
    start = [p[:, parameters.index(v)] if isinstance(v, str) else torch.full((n,), float(v), dtype=F64,
                                                                              device=device)
             for v in (init[s] for s in states)]
    return p, torch.stack(start, 1).contiguous()
