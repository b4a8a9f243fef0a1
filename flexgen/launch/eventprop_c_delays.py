"""The host side of the EventProp C kernels of a recurrent layer with delayed recurrent connections
(`templates/static/c_eventprop_recurrent_delays.h`): `CSimulator`'s, on the kernels `eventprop_recurrent_delayed_*`,
which take the recurrent delays D [N, N] after the recurrent weight V, with the results of the torch reference
(`flexgen.launch.eventprop_recurrent_delays.DelayedRecurrentSimulator`), which it stands in for. The backward runs
each sample's forward once more for its spike times, then each grid interval again from the trace, with the
arrivals pending at its start rebuilt from the spike times before it, into a log of that interval's events."""
import ctypes

import torch

from .eventprop_c import CSimulator, Layer, Quadrature


class DelayedCSimulator(CSimulator):
    """`CSimulator` of a recurrent layer with delays: forward and backward take V and D [N, N] last (as
    `DelayedRecurrentSimulator`'s), and backward returns dL/dV and dL/dD last."""

    def __init__(self, library, states, parameters, init, dt, steps, capacity):
        super().__init__(library, states, parameters, init, dt, steps, capacity, recurrent=True)
        coupling = [ctypes.c_void_p] * 2
        self.forward_fn = library.eventprop_recurrent_delayed_forward
        self.forward_fn.argtypes = [ctypes.c_int, Layer] + coupling + [ctypes.c_void_p, ctypes.c_int64,
                                                                       ctypes.c_void_p, ctypes.c_void_p]
        self.backward_fn = library.eventprop_recurrent_delayed_backward
        self.backward_fn.argtypes = [ctypes.c_int, Layer] + coupling + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            Quadrature] + [ctypes.c_void_p] * 6

    def forward(self, times, W, params, V, D):
        if bool((D < 0).any()) or not bool(torch.isfinite(D).all()):
            raise ValueError("EventProp: the recurrent delays must be finite and >= 0")
        return super().forward(times, W, params, V, D)
