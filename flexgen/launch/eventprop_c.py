"""The host side of the EventProp C kernels (`templates/static/c_eventprop.h`): one layer's forward and backward
on CPU tensors, with the same results as the torch reference (`flexgen.launch.eventprop.Simulator`), which it
stands in for. The kernels compute in float64 (other dtypes are converted on the way in and out). A neuron
nonlinear between events has its substeps compiled into the kernels (`EP_SUBSTEPS`), so the host passes the same
arguments for every neuron.

The input events are sorted per sample here (by time; at equal times in input-major order, as the reference
takes them), or per row for arrival times [B, N, I, K] (per-synapse delays: each neuron its own). The forward
writes each neuron's spike times into `capacity` slots; where one fires more often it reports the buffer full
with the true counts, and the forward runs again with a buffer large enough (no spike is dropped). The backward
runs each grid interval's forward again from the recorded grid states, so it keeps no per-event record: the
forward saves the trace (which it returns anyway) and the spike counts."""
import ctypes

import numpy
import torch

from .eventprop import NODES
from .eventprop_events import event_lists, neuron_tables

F64 = torch.float64
FULL, STARTS_ABOVE, RESET_ABOVE, NO_MEMORY, TWICE = 1, 2, 3, 4, 5
MESSAGES = {
    STARTS_ABOVE: "EventProp: a neuron starts at or above its threshold (g >= 0 at t = 0)",
    RESET_ABOVE: "EventProp: after the reset at a spike the threshold is still crossed (g >= 0): the neuron would "
                 "fire twice at one time; the reset must bring g below 0",
    TWICE: "EventProp: a recurrent jump carries a neuron over its threshold again at the time it fired: a neuron "
           "fires at most once at one time (make its reset, or its excitatory recurrent weights, smaller)",
}


class Layer(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int64), ("N", ctypes.c_int64), ("I", ctypes.c_int64), ("T", ctypes.c_int64),
                ("M", ctypes.c_int64), ("K", ctypes.c_int64), ("per_row", ctypes.c_int64), ("dt", ctypes.c_double),
                ("ev_time", ctypes.c_void_p), ("ev_index", ctypes.c_void_p), ("ev_count", ctypes.c_void_p),
                ("weight", ctypes.c_void_p), ("params", ctypes.c_void_p), ("initial", ctypes.c_void_p)]


class Quadrature(ctypes.Structure):
    _fields_ = [("nodes", ctypes.c_int64), ("z", ctypes.c_void_p), ("w", ctypes.c_void_p),
                ("few_nodes", ctypes.c_int64), ("few_z", ctypes.c_void_p), ("few_w", ctypes.c_void_p),
                ("few_reach", ctypes.c_double)]


# A panel whose rate x length is at most FEW_REACH takes FEW_NODES Gauss-Legendre nodes, not NODES: the integrand is
# a sum of exponentials of rates up to 2 |A|_inf (a state times an adjoint), and the n-node rule's relative error on
# e^(mu s) over a panel of length h is at most (mu h)^(2n) (n!)^4 / ((2n + 1) ((2n)!)^3): for n = 4 and
# mu h <= 2 FEW_REACH = 0.25, 9e-15 (pieces between input events are short: rate x length ~ 0.02 at SHD's rates).
FEW_NODES, FEW_REACH = 4, 0.125


def _rule(nodes):
    z, w = numpy.polynomial.legendre.leggauss(nodes)
    return torch.as_tensor((z + 1) / 2, dtype=F64), torch.as_tensor(w / 2, dtype=F64)


def _ptr(t):
    return None if t is None else t.data_ptr()


def _check(status):
    if status == NO_MEMORY:
        raise MemoryError("EventProp C kernels: out of memory for an interval's log of spikes and events")
    if status in MESSAGES:
        raise ValueError(MESSAGES[status])


class CSimulator:
    """One layer on the C kernels: `library` (a `flexgen.kinds.eventprop.EventPropKernels`'s), `init` the initial
    states (floats or parameter names), `dt`, `steps`, `capacity` (the spike buffer's first size per neuron).
    recurrent: the kernels of a recurrent layer (`eventprop_recurrent_*`, each sample's neurons together): forward
    and backward then take the recurrent weight V [N, N] last, and backward returns dL/dV last."""

    def __init__(self, library, states, parameters, init, dt, steps, capacity, recurrent=False):
        self.states, self.parameters, self.init = states, parameters, init
        self.dt, self.steps, self.capacity = dt, steps, capacity
        kind, extra = ("eventprop_recurrent", [ctypes.c_void_p]) if recurrent else ("eventprop", [])
        self.forward_fn = getattr(library, f"{kind}_forward")
        self.forward_fn.argtypes = [ctypes.c_int, Layer] + extra + [ctypes.c_void_p, ctypes.c_int64,
                                                                    ctypes.c_void_p, ctypes.c_void_p]
        self.backward_fn = getattr(library, f"{kind}_backward")
        self.backward_fn.argtypes = [ctypes.c_int, Layer] + extra + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
            Quadrature] + [ctypes.c_void_p] * (4 + len(extra))
        self.nodes, self.weights = _rule(NODES)
        self.few_nodes, self.few_weights = _rule(FEW_NODES)

    def _layer(self, times, weight, params):
        """(the kernels' `Layer`, the tensors it points into: kept alive by the caller)."""
        B, I, K = times.shape[0], *times.shape[-2:]
        N = weight.shape[0]
        ev = event_lists(times, self.steps, self.dt)  # one list of events per lane: a sample, or a row
        p, init = neuron_tables(params, N, self.parameters, self.states, self.init, times.device)
        M = ev.M
        keep = [ev.time, ev.index, ev.count, weight.detach().to(F64).contiguous(), p, init]
        layer = Layer(B, N, I, self.steps, M, K, int(times.dim() == 4), self.dt, *map(_ptr, keep))
        return layer, keep

    def forward(self, times, W, params, *coupling):
        """As `Simulator.forward` (a recurrent layer's: as `RecurrentSimulator.forward`, V last); the record is the
        trace and the counts (the backward runs the forward again)."""
        B, N = times.shape[0], W.shape[0]
        layer, keep = self._layer(times, W, params)
        coupling = [c.detach().to(F64).contiguous() for c in coupling]
        trace = torch.empty(self.steps, B, N, len(self.states), dtype=F64)
        capacity = self.capacity
        while True:
            out = torch.full((B * N, capacity), float("inf"), dtype=F64)
            counts = torch.zeros(B * N, dtype=torch.int64)
            status = self.forward_fn(torch.get_num_threads(), layer, *[c.data_ptr() for c in coupling],
                                     out.data_ptr(), capacity, counts.data_ptr(), trace.data_ptr())
            _check(status)
            if status != FULL:
                break
            capacity = 1 << int(counts.max() - 1).bit_length()  # the next power of two that holds every spike
        self.capacity_used = capacity
        width = max(1, int(counts.max()))
        out = out[:, :width].to(W.dtype)
        return out.reshape(B, N, width), counts.view(B, N), trace.to(W.dtype), {"trace": trace, "counts": counts}

    def backward(self, times, W, params, record, grad_times, grad_trace, *coupling, parameter_grads=True):
        """As `Simulator.backward`: dL/dtimes (the shape of times), dL/dW [N, I], dL/dparams (one [B*N] tensor
        each); a recurrent layer's takes V [N, N] last and returns dL/dV last. parameter_grads=False: no parameter
        needs its gradient, so the kernels skip the quadrature of the parameter integrals (the other gradients are
        the same to the bit; dL/dparams then holds only the terms at the events and at t = 0: do not use it)."""
        B, I, K = times.shape[0], *times.shape[-2:]
        N, S, P = W.shape[0], len(self.states), len(self.parameters)
        layer, keep = self._layer(times, W, params)
        threads = torch.get_num_threads()
        errors = None if grad_times is None else grad_times.to(F64).reshape(B * N, -1).contiguous()
        width = 0 if errors is None else errors.shape[1]
        g_trace = None if grad_trace is None else grad_trace.to(F64).contiguous()
        d_times = torch.zeros(times.shape, dtype=F64)
        d_w = torch.zeros(threads, N, I, dtype=F64)
        d_params = torch.zeros(B * N, max(P, 1), dtype=F64)
        lam0 = torch.zeros(B * N, S, dtype=F64)
        coupling = [c.detach().to(F64).contiguous() for c in coupling]
        d_v = [torch.zeros(threads, N, N, dtype=F64) for _ in coupling]
        quad = Quadrature(NODES if parameter_grads else 0, self.nodes.data_ptr(), self.weights.data_ptr(),
                          FEW_NODES if parameter_grads else 0, self.few_nodes.data_ptr(),
                          self.few_weights.data_ptr(), FEW_REACH)
        status = self.backward_fn(threads, layer, *[c.data_ptr() for c in coupling], record["trace"].data_ptr(),
                                  record["counts"].data_ptr(), _ptr(g_trace), _ptr(errors), width, quad,
                                  d_times.data_ptr(), d_w.data_ptr(), *[d.data_ptr() for d in d_v],
                                  d_params.data_ptr(), lam0.data_ptr())
        _check(status)
        for k, s in enumerate(self.states):  # a state that starts at a parameter's value
            if isinstance(self.init[s], str):
                d_params[:, self.parameters.index(self.init[s])] += lam0[:, k]
        dtype = W.dtype
        return (d_times.to(dtype), d_w.sum(0).to(dtype), [d_params[:, k].to(dtype) for k in range(P)],
                *[d.sum(0).to(dtype) for d in d_v])
