"""The pending arrivals of one sample of a recurrent EventProp layer with delayed recurrent connections: neuron k's
spike at t reaches neuron j at t + d[j, k], an event of the sample's future. `ArrivalQueue` holds them in time
order (a heap; ties in the order they were sent) and hands out every arrival of one time at once; none is dropped
but those at or after the end of the window, which do nothing (as input events there)."""
import heapq
import math
from typing import NamedTuple

import torch


class Arrivals(NamedTuple):
    """The arrivals of one time: their postsynaptic neurons `target` [m], presynaptic neurons `source` [m] and the
    slots of the presynaptic spikes in the spike buffer `slot` [m] (long tensors; the sample's neuron numbers)."""

    target: torch.Tensor
    source: torch.Tensor
    slot: torch.Tensor


class ArrivalQueue:
    """Arrivals of one sample not yet run, earliest first. `end`: the end of the window (later ones do nothing)."""

    def __init__(self, end, device):
        self.end, self.device = float(end), device
        self._heap, self._sent = [], 0

    def __len__(self):
        return len(self._heap)

    def send(self, times, source, slot):
        """Queue the arrivals of one spike of neuron `source` (its buffer slot `slot`): `times` [N], the time of
        its arrival at each neuron (t + d[:, source]); those at or after the end are left out."""
        for target, time in enumerate(times.tolist()):
            if time < self.end:
                heapq.heappush(self._heap, (time, self._sent, target, int(source), int(slot)))
                self._sent += 1

    def next_time(self):
        """The earliest pending arrival's time (a float; the exact value of the layer's dtype), inf if none."""
        return self._heap[0][0] if self._heap else math.inf

    def pop(self, time):
        """Every pending arrival at exactly `time` (a float), as `Arrivals` (in the order they were sent)."""
        found = []
        while self._heap and self._heap[0][0] == time:
            found.append(heapq.heappop(self._heap)[2:])
        if not found:
            raise ValueError(f"ArrivalQueue.pop: no arrival at t = {time!r}")
        columns = torch.tensor(found, dtype=torch.long, device=self.device).T
        return Arrivals(*columns)
