"""The host side of the EventProp Triton kernels of a recurrent layer
(`templates/static/eventprop_triton_recurrent.py`): `TritonSimulator`'s, on the kernels `eventprop_recurrent_*`,
which take the recurrent weight V [N, N] last, with the results of the C kernels (`eventprop_c.CSimulator` with
`recurrent=True`) and the torch reference (`flexgen.launch.eventprop_recurrent.RecurrentSimulator`).

A program holds one sample, its N neurons as the lanes of one block (at most `MAX_NEURONS`): a recurrent spike
reaches every neuron of its sample at its time, so the sample runs in global time order. The backward runs each
grid interval again from the recorded grid states into the program's log of items (an instant's crossing, its
waves' jumps and resets, its states after), each holding a value per lane; its room is counted from the input
events and the forward's spike times (at most four items an instant and two a spike), and doubled where it did
not hold an interval."""
import torch

from .eventprop import NODES
from .eventprop_c import FEW_NODES
from .eventprop_events import F64, CHUNK_ELEMENTS
from .eventprop_triton import LOG_FULL, TritonSimulator, _check, module_constant

MAX_NEURONS = 2048  # lanes of one program: a sample's neurons


def block_size(n):
    """The program's block of lanes: the power of two (at least 16) that holds n neurons."""
    return max(16, 1 << (n - 1).bit_length())


class RecurrentTritonSimulator(TritonSimulator):
    """`TritonSimulator` of a recurrent layer: forward and backward take V [N, N] last (as `RecurrentSimulator`'s),
    and backward returns dL/dV last."""

    def _launch(self, kernel, B, N, *args, **constexprs):
        block = block_size(N)
        warps = max(1, min(8, block // 64))
        if args[0].device.type == "cuda":
            with torch.cuda.device(args[0].device):
                kernel[(B, 1)](*args, EP_BLOCK=block, num_warps=warps, **constexprs)
        else:
            kernel[(B, 1)](*args, EP_BLOCK=block, num_warps=warps, **constexprs)

    def forward(self, times, W, params, V):
        """As `RecurrentSimulator.forward`; the record is the trace and the counts."""
        B, N, K = times.shape[0], W.shape[0], times.shape[-1]
        lay = self._layer(times, W, params)
        ev = lay["events"]
        v_t = V.detach().to(F64).t().contiguous()
        trace = torch.empty(self.steps, B, N, len(self.states), dtype=F64, device=times.device)
        consts = torch.tensor([self.dt], dtype=F64, device=times.device)

        def launch(out, counts, status, capacity):
            self._launch(self.module.eventprop_recurrent_forward, B, N, ev.time, ev.index, lay["firsts"],
                         lay["weight_t"], v_t, lay["p"], lay["init"], out, counts, trace, status, consts, B, N, ev.M,
                         K, self.steps, capacity)

        out, counts = self._spike_times(launch, B, N, times.device)
        record = {"trace": trace, "counts": counts, "spike_times": out}
        return out.to(W.dtype).reshape(B, N, -1), counts.view(B, N), trace.to(W.dtype), record

    def _sample_spikes(self, spike_times, B):
        """The most spikes of one sample (all its neurons) in one grid interval, from the forward's spike times
        [B*N, width], a chunk of samples at a time."""
        grid = torch.arange(1, self.steps + 1, dtype=F64, device=spike_times.device) * self.dt
        rows = spike_times.reshape(B, -1)
        most = 0
        chunk = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
        for at in range(0, B, chunk):
            part = rows[at:at + chunk]
            finite = torch.isfinite(part)
            interval = torch.searchsorted(grid, part.clamp(max=float(grid[-1])).contiguous())
            key = torch.arange(part.shape[0], device=part.device)[:, None] * self.steps + interval
            counts = torch.bincount(key[finite], minlength=part.shape[0] * self.steps)
            most = max(most, int(counts.max()) if counts.numel() else 0)
        return most

    def _room(self, firsts, spike_times, B):
        """Items of the log for one interval of one sample: an instant (an input event, or a crossing that no
        event caused) is its first item, its states, and per wave a jump and the resets, at most one wave more
        than its spikes: 4 items an instant and 2 a spike hold any interval."""
        events = int((firsts[:, 1:] - firsts[:, :-1]).max())
        spikes = self._sample_spikes(spike_times, B)
        return 4 * (events + spikes) + 2 * spikes + 4

    def backward(self, times, W, params, record, grad_times, grad_trace, V, parameter_grads=True):
        """As `RecurrentSimulator.backward` (parameter_grads as `TritonSimulator.backward`'s): dL/dtimes, dL/dW,
        dL/dparams, dL/dV."""
        B, I, K = times.shape[0], *times.shape[-2:]
        N, S, P = W.shape[0], len(self.states), len(self.parameters)
        device = times.device
        lay = self._layer(times, W, params)
        ev, firsts = lay["events"], lay["firsts"]
        v_t = V.detach().to(F64).t().contiguous()
        adj = self._adjoint_inputs(grad_times, grad_trace, B, N, device)
        room = self._room(firsts, record["spike_times"], B)
        # an item: its header and each lane's columns, as the kernels lay it out
        item = module_constant(self.module.EPR_HEAD) + block_size(N) * module_constant(self.module.EPR_LANE)
        while True:
            d_times = torch.zeros(times.shape, dtype=F64, device=device)
            d_w = torch.zeros(N, I, dtype=F64, device=device)
            d_v_t = torch.zeros(N, N, dtype=F64, device=device)
            d_params = torch.zeros(B * N, max(P, 1), dtype=F64, device=device)
            lam0 = torch.zeros(B * N, S, dtype=F64, device=device)
            status = torch.zeros(1, dtype=torch.int32, device=device)
            log = torch.empty(B * room * item, dtype=F64, device=device)
            (z, w), (few_z, few_w) = adj["rule"], adj["few"]
            self._launch(self.module.eventprop_recurrent_backward, B, N, ev.time, ev.index, firsts,
                         lay["weight_t"], v_t, lay["p"], lay["init"], record["trace"], record["counts"],
                         adj["g_trace"], adj["errors"], adj["width"], NODES if parameter_grads else 0, z, w,
                         FEW_NODES, few_z, few_w, log, room, d_times, d_w, d_v_t, d_params, lam0, status,
                         adj["consts"], B, N, I, ev.M, K, self.steps, EP_HAS_TRACE_GRAD=adj["has_trace_grad"],
                         EP_HAS_ERRORS=adj["has_errors"])
            code = int(status.item())
            _check(code)
            if code != LOG_FULL:
                break
            room *= 2
        return (*self._gradients(d_times, d_w, d_params, lam0, W.dtype), d_v_t.t().to(W.dtype))
