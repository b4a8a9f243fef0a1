"""The host side of the EventProp Triton kernels (`templates/static/eventprop_triton.py`): one feed-forward layer's
forward and backward on CUDA tensors (or CPU tensors in Triton's interpreter), with the results of the C kernels
(`flexgen.launch.eventprop_c`) and the torch reference, which it stands in for. The kernels compute in float64.

A program holds `BLOCK` neurons of one sample; they walk their sample's input events together, or, with arrival
times per neuron ([B, N, I, K]: per-synapse delays), each its own (a loop as long as the lane with the most). The
forward writes each neuron's spike times into `capacity` slots
and runs again with a larger buffer where one fired more often (no spike is dropped). The backward runs each grid
interval's forward again from the recorded grid states into per-lane logs of the interval's spikes and events:
their room is the most spikes any neuron fired in one interval (counted from the forward's spike times) and the
most input events of one interval; a log found too small (a spike time on a grid point counted in the next
interval) is doubled and the backward run again."""
import numpy
import torch

from .eventprop import NODES
from .eventprop_c import FEW_NODES, FEW_REACH, MESSAGES
from .eventprop_events import F64, CHUNK_ELEMENTS, event_lists, interval_firsts, neuron_tables

FULL, LOG_FULL = 1, 6
BLOCK = 32  # neurons per program
NUM_WARPS = 1


def module_constant(value):
    """A constant of the kernels' module (a tl.constexpr, or a plain int under Triton's interpreter) as an int."""
    return int(getattr(value, "value", value))


def _check(status):
    if status in MESSAGES:
        raise ValueError(MESSAGES[status])


def _rule(nodes, room, device):
    """Gauss-Legendre nodes and weights on [0, 1], zero-padded to `room` entries."""
    z, w = numpy.polynomial.legendre.leggauss(nodes)
    out = torch.zeros(2, room, dtype=F64)
    out[0, :nodes], out[1, :nodes] = torch.as_tensor((z + 1) / 2), torch.as_tensor(w / 2)
    return out.to(device)


class TritonSimulator:
    """One feed-forward layer on the Triton kernels: `module` the generated module
    (`flexgen.kinds.eventprop.EVENTPROP.triton_module`), `init` the initial states (floats or parameter names),
    `dt`, `steps`, `capacity` (the spike buffer's first size per neuron)."""

    def __init__(self, module, states, parameters, init, dt, steps, capacity):
        self.module, self.states, self.parameters, self.init = module, states, parameters, init
        self.dt, self.steps, self.capacity = dt, steps, capacity

    def _layer(self, times, weight, params):
        """The call's tables: the event lists (a row per sample, or per sample and neuron for arrival times
        [B, N, I, K], per-synapse delays), the first event of each interval, W^T, the neurons' tables."""
        device = times.device
        events = event_lists(times, self.steps, self.dt)
        firsts = interval_firsts(events, self.steps, self.dt)
        p, init = neuron_tables(params, weight.shape[0], self.parameters, self.states, self.init, device)
        return {"events": events, "firsts": firsts, "weight_t": weight.detach().to(F64).t().contiguous(), "p": p,
                "init": init}

    def _launch(self, kernel, B, N, *args, **constexprs):
        grid = (B, (N + BLOCK - 1) // BLOCK)
        if args[0].device.type == "cuda":
            with torch.cuda.device(args[0].device):
                kernel[grid](*args, EP_BLOCK=BLOCK, num_warps=NUM_WARPS, **constexprs)
        else:
            kernel[grid](*args, EP_BLOCK=BLOCK, num_warps=NUM_WARPS, **constexprs)

    def _spike_times(self, launch, B, N, device):
        """The forward's spike times: `launch(out, counts, status, capacity)` runs the kernel into buffers of
        `capacity` slots a neuron, again with a larger one where a neuron fired more often (no spike is dropped).
        Returns out [B*N, width] (width: the most spikes of a neuron), counts [B*N]."""
        capacity = self.capacity
        while True:
            out = torch.full((B * N, capacity), float("inf"), dtype=F64, device=device)
            counts = torch.zeros(B * N, dtype=torch.int64, device=device)
            status = torch.zeros(1, dtype=torch.int32, device=device)
            launch(out, counts, status, capacity)
            code = int(status.item())
            _check(code)
            if code != FULL:
                break
            capacity = 1 << int(counts.max() - 1).bit_length()  # the next power of two that holds every spike
        self.capacity_used = capacity
        return out[:, :max(1, int(counts.max()))], counts

    def forward(self, times, W, params):
        """As `Simulator.forward`; the record is the trace and the counts (the backward runs the forward again)."""
        B, N, K = times.shape[0], W.shape[0], times.shape[-1]
        lay = self._layer(times, W, params)
        ev = lay["events"]
        trace = torch.empty(self.steps, B, N, len(self.states), dtype=F64, device=times.device)
        consts = torch.tensor([self.dt], dtype=F64, device=times.device)

        def launch(out, counts, status, capacity):
            self._launch(self.module.eventprop_forward, B, N, ev.time, ev.index, lay["firsts"], lay["weight_t"],
                         lay["p"], lay["init"], out, counts, trace, status, consts, B, N, ev.M, K, self.steps,
                         capacity, EP_PER_LANE=times.dim() == 4)

        out, counts = self._spike_times(launch, B, N, times.device)
        record = {"trace": trace, "counts": counts, "spike_times": out}
        return out.to(W.dtype).reshape(B, N, -1), counts.view(B, N), trace.to(W.dtype), record

    def _adjoint_inputs(self, grad_times, grad_trace, B, N, device):
        """What every backward kernel reads besides the layer: the spike times' errors [B*N, width] (or a
        placeholder) and width, the trace's gradient (float32 read as it is: the kernel widens it as it loads; or
        a placeholder) and whether each is there, the quadrature rules and consts (dt, the few-node reach)."""
        placeholder = torch.zeros(1, dtype=F64, device=device)
        errors = None if grad_times is None else grad_times.to(F64).reshape(B * N, -1).contiguous()
        g_trace = None if grad_trace is None else grad_trace.to(torch.promote_types(grad_trace.dtype,
                                                                                   torch.float32)).contiguous()
        return {"errors": placeholder if errors is None else errors, "width": 0 if errors is None else errors.shape[1],
                "g_trace": placeholder if g_trace is None else g_trace, "has_trace_grad": g_trace is not None,
                "has_errors": errors is not None, "rule": _rule(NODES, NODES, device),
                "few": _rule(FEW_NODES, NODES, device),
                "consts": torch.tensor([self.dt, FEW_REACH], dtype=F64, device=device)}

    def _gradients(self, d_times, d_w, d_params, lam0, dtype):
        """dL/dtimes, dL/dW and one dL/dparam [B*N] each in `dtype`, with lambda at t = 0 added to the parameters
        a state starts at."""
        for k, s in enumerate(self.states):
            if isinstance(self.init[s], str):
                d_params[:, self.parameters.index(self.init[s])] += lam0[:, k]
        return d_times.to(dtype), d_w.to(dtype), [d_params[:, k].to(dtype) for k in range(len(self.parameters))]

    def _log_size(self, spike_times):
        """The most spikes of one neuron in one grid interval (at least 1), from the forward's spike times [lanes,
        width] (ascending, inf past each lane's count): the longest run of equal intervals in a row, a chunk of
        lanes at a time (`CHUNK_ELEMENTS` entries), so that the temporaries stay small."""
        grid = torch.arange(1, self.steps + 1, dtype=F64, device=spike_times.device) * self.dt
        lanes, width = spike_times.shape
        slots = torch.arange(width, device=spike_times.device)
        most = 1
        chunk = max(1, CHUNK_ELEMENTS // max(1, width))
        for at in range(0, lanes, chunk):
            part = spike_times[at:at + chunk]
            finite = torch.isfinite(part)
            if not bool(finite.any()):
                continue
            interval = torch.searchsorted(grid, part.clamp(max=float(grid[-1])).contiguous())
            starts = torch.ones_like(finite)
            starts[:, 1:] = interval[:, 1:] != interval[:, :-1]  # a run of one interval's spikes starts here
            first = torch.where(starts, slots, 0).cummax(1).values
            most = max(most, int(torch.where(finite, slots - first + 1, 0).max()))
        return most

    def backward(self, times, W, params, record, grad_times, grad_trace, parameter_grads=True):
        """As `CSimulator.backward` (parameter_grads=False: the quadrature of the parameter integrals is skipped,
        dL/dparams then holds only the terms at the events and at t = 0)."""
        B, I, K = times.shape[0], *times.shape[-2:]
        N, S, P = W.shape[0], len(self.states), len(self.parameters)
        device = times.device
        lay = self._layer(times, W, params)
        ev, firsts = lay["events"], lay["firsts"]
        adj = self._adjoint_inputs(grad_times, grad_trace, B, N, device)
        sp = module_constant(self.module.SP)  # the module's tile of states
        event_room = max(1, int((firsts[:, 1:] - firsts[:, :-1]).max()))
        log_size = self._log_size(record["spike_times"])
        while True:
            d_times = torch.zeros(times.shape, dtype=F64, device=device)
            d_w = torch.zeros(N, I, dtype=F64, device=device)
            d_params = torch.zeros(B * N, max(P, 1), dtype=F64, device=device)
            lam0 = torch.zeros(B * N, S, dtype=F64, device=device)
            status = torch.zeros(1, dtype=torch.int32, device=device)
            log_spikes = torch.empty(B * N * log_size * (3 + sp), dtype=F64, device=device)
            log_events = torch.empty(B * N * event_room * (2 + 2 * sp), dtype=F64, device=device)
            (z, w), (few_z, few_w) = adj["rule"], adj["few"]
            self._launch(self.module.eventprop_backward, B, N, ev.time, ev.index, firsts, lay["weight_t"], lay["p"],
                         lay["init"], record["trace"], record["counts"], adj["g_trace"], adj["errors"],
                         adj["width"], NODES if parameter_grads else 0, z, w, FEW_NODES, few_z, few_w,
                         log_spikes, log_events, log_size, event_room, d_times, d_w, d_params, lam0, status,
                         adj["consts"], B, N, I, ev.M, K, self.steps, EP_HAS_TRACE_GRAD=adj["has_trace_grad"],
                         EP_HAS_ERRORS=adj["has_errors"], EP_PER_LANE=times.dim() == 4)
            code = int(status.item())
            _check(code)
            if code != LOG_FULL:
                break
            log_size *= 2
        return self._gradients(d_times, d_w, d_params, lam0, W.dtype)
