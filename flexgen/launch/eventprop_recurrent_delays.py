"""The EventProp reference for a recurrent layer with delayed recurrent connections: neuron k's spike at t reaches
neuron j of the same sample at t + D[j, k] with weight V[j, k] (its states jump by V[j, k] b, as for an input
spike). The printed functions are the feed-forward layer's; what is new is the sample's queue of pending arrivals
(`flexgen.launch.eventprop_arrivals`).

Forward, one sample at a time, in its global time order: its next event is the earliest of its next input event or
grid point, its next pending arrival and the earliest crossing of any of its neurons before them (searched as in
`RecurrentSimulator`; the lowest neuron of a tie fires). A spike queues its N arrivals (those before the end of
the window). All the arrivals of one time run together: their jumps (summed per neuron), then the neurons carried
to g >= 0 fire at that time and reset, and queue their own arrivals; with zero delays those are at the same time
and run next, so zero delays run the undelayed layer's waves. At one time the pending arrivals run before an input
event, and each input event's carried spikes' arrivals before the next; the grid point's record comes last.

Backward, each sample in reverse order of its events. At a group of arrivals (as at an input event): the carried
spikes' resets back, then the jumps: dL/dV[j, k] += lambda_j^T b_j, and the arrival's time error (the quantity an
input event sends to its input's time, lambda^T (f(x-) - f(x+)) and the carried spike's errors) goes to
dL/dD[j, k] and is held by the presynaptic spike of k (dL/dt_k), whose spike adjoint (a crossing) or input event
(a spike carried over by one) takes it when the reverse walk reaches it. Several arrivals at one neuron at exactly
one time share that neuron's time error equally (the error of their common time is exact, its split a choice).
"""
import torch

from .eventprop import EVENT, GRID, SAMPLES, Simulator
from .eventprop_arrivals import ArrivalQueue


class DelayedRecurrentSimulator(Simulator):
    """A recurrent layer whose connections have delays: `forward` and `backward` take the recurrent weight V [N, N]
    and delays D [N, N] (from neuron k to neuron j: V[j, k], D[j, k] >= 0) after the feed-forward layer's
    arguments; `backward` returns dL/dV and dL/dD after `Simulator.backward`'s results."""

    # ----- forward -----
    def forward(self, times, W, params, V, D):
        """times [B, I, K], W [N, I], params one [B*N] tensor each, V and D [N, N]; returns what
        `Simulator.forward` does."""
        if times.dim() != 3:
            raise ValueError("EventProp: a recurrent layer takes input times [B, I, K]")
        B, N = times.shape[0], W.shape[0]
        if bool((D < 0).any()) or not bool(torch.isfinite(D).all()):
            raise ValueError("EventProp: the recurrent delays must be finite and >= 0")
        trace, buffer, x, _, drive = self._start(B, N, W, params)
        samples = []
        for b in range(B):
            rows = slice(b * N, (b + 1) * N)
            lane = _Lane(self, b, N, [s[rows].clone() for s in x], [p[rows] for p in params],
                         [d[rows] for d in drive], buffer, V, D, times.new_zeros(()))
            samples.append(lane.run(self.rounds(times[b:b + 1]), W, trace))
        out, counts = self._spike_times(B, N, buffer, W)
        return out, counts, trace, {"samples": samples, "width": out.shape[-1]}

    # ----- backward -----
    def backward(self, times, W, params, record, grad_times, grad_trace, V, D):
        """What `Simulator.backward` returns, then dL/dV and dL/dD [N, N]."""
        B, N = times.shape[0], W.shape[0]
        d_times, d_W = torch.zeros_like(times), torch.zeros_like(W)
        d_V, d_D = torch.zeros_like(V), torch.zeros_like(D)
        d_params = [torch.zeros_like(p) for p in params]
        # each spike's held error: the loss's dL/dt, then the errors of its arrivals as the walk passes them
        errors = W.new_zeros(B * N, record["width"])
        if grad_times is not None:
            errors += grad_times.reshape(B * N, -1)
        for b, items in enumerate(record["samples"]):
            rows = slice(b * N, (b + 1) * N)
            p, dp, err = [q[rows] for q in params], [d[rows] for d in d_params], errors[rows]
            lam = [torch.zeros_like(p[0]) for _ in self.states]
            for item in reversed(items):
                kind = item[0]
                if kind == "grid":
                    if grad_trace is not None:
                        lam = [l + grad_trace[item[1], b, :, k] for k, l in enumerate(lam)]
                elif kind == "flow":
                    lam = self._flow_back(item[1], lam, item[2], p, dp, torch.arange(N, device=W.device))
                elif kind == "spike":
                    _, n, pre, slot = item
                    lam_pre, terms = self.call("spike_adjoint", pre, [l[n:n + 1] for l in lam], err[n:n + 1, slot],
                                               [q[n:n + 1] for q in p])
                    for d, term in zip(dp, terms):
                        d[n:n + 1] += term
                    for l, a in zip(lam, lam_pre):
                        l[n:n + 1] = a
                else:
                    lam = [l.clone() for l in lam]
                    time_error = torch.zeros_like(lam[0])
                    event = item[1]
                    self._resets_back(lam, event["fired"], event["mid"], event["slots"], p, err, dp, time_error)
                    targets = event["targets"]
                    weight = self._jump_back(lam, targets, event["before"], event["w"], p, dp, time_error)
                    if kind == "input":
                        d_W[targets, event["input"]] += weight
                        d_times[b, event["input"], event["slot"]] += time_error.sum()
                    else:
                        self._arrivals_back(event["arrivals"], targets, weight, time_error, err, d_V, d_D)
            for s, l in zip(self.states, lam):  # a state that starts at a parameter's value
                if isinstance(self.init[s], str):
                    dp[self.parameters.index(self.init[s])] += l
        return d_times, d_W, d_params, d_V, d_D

    @staticmethod
    def _arrivals_back(arrivals, targets, weight, time_error, errors, d_V, d_D):
        """The gradients of one time's arrivals: dL/dV[j, k] (lambda_j^T b_j), and each arrival's time error (its
        neuron's, shared by the arrivals there) to dL/dD[j, k] and to the presynaptic spike's held error."""
        per_row = torch.zeros_like(time_error)
        per_row[targets] = weight
        at = arrivals.target
        share = torch.zeros_like(time_error).index_add_(0, at, torch.ones_like(time_error[at]))
        error = time_error[at] / share[at]
        d_V.index_put_((arrivals.target, arrivals.source), per_row[arrivals.target], accumulate=True)
        d_D.index_put_((arrivals.target, arrivals.source), error, accumulate=True)
        errors.index_put_((arrivals.source, arrivals.slot), error, accumulate=True)


class _Lane:
    """One sample's forward walk: its neurons' states `x` (lists of [N] tensors), parameters `p`, input factor
    `drive`, time `cur` (a 0-dim tensor), queue of pending arrivals and the record of its events in time order."""

    def __init__(self, sim, b, N, x, p, drive, buffer, V, D, cur):
        self.sim, self.b, self.N, self.x, self.p, self.drive = sim, b, N, x, p, drive
        self.buffer, self.V, self.D, self.cur = buffer, V, D, cur
        self.queue = ArrivalQueue(sim.steps * sim.dt, V.device)
        self.last = [None] * N  # each neuron's latest spike time (a neuron fires at most once at one time)
        self.items = []

    def run(self, rounds, W, trace):
        """Walk the sample's breakpoints (`rounds` of this sample alone); returns its record."""
        for r in range(rounds.time.shape[0]):
            t, kind = rounds.time[r, 0], int(rounds.kind[r, 0])
            if kind not in (EVENT, GRID):
                continue
            while True:
                pending = self.queue.next_time()
                target = t if float(t) <= pending else t.new_tensor(pending)
                if float(self.cur) < float(target):
                    self._advance(target)  # to target, or to a crossing before it
                elif pending == float(self.cur):
                    self._arrive()
                else:
                    break
            if kind == GRID:
                n = int(rounds.a[r, 0])
                trace[n, self.b] = torch.stack(self.x, -1)
                self.items.append(("grid", n))
            else:
                i, c = int(rounds.a[r, 0]), int(rounds.c[r, 0])
                event = self._jump(W[:, i], "an input event")
                event.update(input=i, slot=c)
                self.items.append(("input", event))
        return self.items

    def _advance(self, target):
        """Follow the flow from `cur` towards `target`: to the sample's earliest crossing before it (that neuron
        fires, resets and queues its arrivals), or to `target` if none."""
        sim, N, x, p = self.sim, self.N, self.x, self.p
        fr = torch.arange(1, SAMPLES + 1, dtype=self.cur.dtype, device=self.cur.device)[:, None] / SAMPLES
        length = (target - self.cur).expand(N)
        hs = fr * length
        samples = sim.flow(hs, [s[None] for s in x], [q[None] for q in p])
        crossed = sim.call("threshold", samples, [q[None] for q in p])[0][0] >= 0
        start = [s.clone() for s in x]
        if not bool(crossed.any()):
            self.x = [e[-1].clone() for e in samples]
            self.items.append(("flow", start, length))
            self.cur = target.clone()
            return
        first = torch.where(crossed.any(0), crossed.int().argmax(0), SAMPLES)
        cols = (first == first.min()).nonzero()[:, 0]  # the rows with the earliest first sample at g >= 0
        f = first[cols]
        hi = hs[f, cols]
        lo = torch.where(f > 0, hs[(f - 1).clamp(min=0), cols], torch.zeros_like(hi))
        root = sim._root([s[cols] for s in x], [q[cols] for q in p], lo, hi)
        h = root.min()
        n = int(cols[(root == h).nonzero()[0, 0]])  # the lowest neuron of a tie
        self.x = sim.flow(h.expand(N), x, p)
        self.items.append(("flow", start, h.expand(N).clone()))
        self.cur = self.cur + h
        pre = [s[n:n + 1].clone() for s in self.x]
        slot = self._fire(torch.tensor([n], device=self.cur.device))
        post = sim.call("reset", pre, [q[n:n + 1] for q in p])[0]
        for s, q in zip(self.x, post):
            s[n:n + 1] = q
        sim._check_below(self.x, p, [n], "a spike")
        self.items.append(("spike", n, pre, int(slot[0])))
        self._send(torch.tensor([n], device=self.cur.device), slot)

    def _fire(self, neurons):
        """Record spikes of `neurons` (the sample's numbers) at `cur`; returns their buffer slots."""
        now = float(self.cur)
        for n in neurons.tolist():
            self.last[n] = now
        return self.buffer.add(neurons + self.b * self.N, self.cur.expand(len(neurons)))

    def _send(self, neurons, slots):
        """Queue the arrivals of the spikes of `neurons` just fired (at `cur`)."""
        for n, slot in zip(neurons.tolist(), slots.tolist()):
            self.queue.send(self.cur + self.D[:, n], n, slot)

    def _arrive(self):
        """Run every arrival pending at `cur`: their jumps, then the spikes they carry over."""
        arrivals = self.queue.pop(float(self.cur))
        w = torch.zeros_like(self.x[0]).index_put_((arrivals.target,), self.V[arrivals.target, arrivals.source],
                                                   accumulate=True)
        event = self._jump(w, "a recurrent jump", again=True)
        event["arrivals"] = arrivals
        self.items.append(("arrivals", event))

    def _jump(self, w, what, again=False):
        """x += w b at `cur` for every neuron; the neurons carried to g >= 0 fire, reset and queue their arrivals.
        Returns the event's record. again: refuse a neuron carried over again at a time it fired."""
        sim, N, p = self.sim, self.N, self.p
        targets = torch.arange(N, device=w.device)
        before = [s.clone() for s in self.x]
        self.x = [s + w * d for s, d in zip(self.x, self.drive)]
        mid = [s.clone() for s in self.x]
        fired = targets[sim.call("threshold", self.x, p)[0][0] >= 0]
        now = float(self.cur)
        if again:
            for n in fired.tolist():
                if self.last[n] == now:
                    raise ValueError(f"EventProp: a recurrent jump carries neuron {n} (sample {self.b}) over its "
                                     f"threshold again at t = {now:g}, the time it fired: a neuron fires at most "
                                     "once at one time (make its reset, or its excitatory recurrent weights, "
                                     "smaller)")
        slots = self._fire(fired)
        if len(fired):
            post = sim.call("reset", [s[fired] for s in self.x], [q[fired] for q in p])[0]
            for s, q in zip(self.x, post):
                s[fired] = q
            sim._check_below(self.x, p, fired, what)
        self._send(fired, slots)
        return {"targets": targets, "before": before, "w": w, "mid": mid, "fired": fired, "slots": slots}
