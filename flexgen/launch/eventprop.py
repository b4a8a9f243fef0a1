"""The EventProp reference in torch: one layer's exact forward (spike times, states on the dt grid) and its
adjoint backward, running the functions `flexgen.render.eventprop` printed (the math is there, not here).

Forward, per sample: the input events (continuous times) and the grid points (n+1) dt are the breakpoints. Between
two, every neuron's states follow the exact flow; a spike is the first root of g on that trajectory: the
segment is sampled at `SAMPLES` points, the first sample with g >= 0 brackets the root, which Newton's method
(bisection where a Newton step leaves the bracket) finds to rounding; the reset applies there and the search goes
on from the spike. An input event adds w b to the states; a neuron that the jump carries to g >= 0 fires at the
event's time. At a grid point the states are recorded (after the events at that time).

Backward, per sample, in reverse time: the adjoint jumps at the grid points (the loss's gradient on the recorded
states), the input events (weight gradient, parameter terms, the error sent to the input spike's time) and the
spikes (`spike_adjoint`: lambda- from lambda+, the spike time's own error E and its parameter terms), and
follows exp(A^T h) between them. The parameter integrals over each piece between events are taken by
Gauss-Legendre quadrature with `NODES` nodes: the integrand is a sum of exponentials in time.
"""
import numpy
import torch

SAMPLES = 16  # samples of g per piece of trajectory when searching for the first crossing
NODES = 12  # Gauss-Legendre nodes per piece for the parameter integrals
NEWTON_STEPS = 100


class SpikeBuffer:
    """Spike times per neuron, in a buffer that doubles when a neuron's row is full (no spike is dropped)."""

    def __init__(self, n, capacity, like):
        self.times = torch.full((n, max(1, capacity)), float("inf"), dtype=like.dtype, device=like.device)
        self.counts = torch.zeros(n, dtype=torch.long, device=like.device)

    @property
    def capacity(self):
        return self.times.shape[1]

    def add(self, neurons, times):
        """Append one spike to each of `neurons` (distinct); returns their slots."""
        slots = self.counts[neurons]
        if len(slots) and int(slots.max()) >= self.capacity:
            grown = torch.full((self.times.shape[0], 2 * self.capacity), float("inf"), dtype=self.times.dtype,
                               device=self.times.device)
            grown[:, :self.capacity] = self.times
            self.times = grown
        self.times[neurons, slots] = times
        self.counts[neurons] += 1
        return slots


class Simulator:
    """One layer's functions and settings: `fns` the printed functions, `init` the initial states (floats or
    parameter names), `dt`, `steps` (T) and `capacity` (the spike buffer's first size per neuron)."""

    def __init__(self, fns, states, parameters, init, dt, steps, capacity):
        self.fns, self.states, self.parameters = fns, states, parameters
        self.init, self.dt, self.steps, self.capacity = init, dt, steps, capacity
        z, w = numpy.polynomial.legendre.leggauss(NODES)
        self.nodes, self.weights = (z + 1) / 2, w / 2

    # ----- the printed functions, on lists of tensors -----
    def call(self, name, *groups):
        args = [a for g in groups for a in (g if isinstance(g, (list, tuple)) else [g])]
        tensors = [a for a in args if torch.is_tensor(a)]
        return [[e if torch.is_tensor(e) else _full(e, tensors) for e in group] for group in self.fns[name](*args)]

    def initial(self, params):
        values = []
        for s in self.states:
            value = self.init[s]
            values.append(params[self.parameters.index(value)].clone() if isinstance(value, str)
                          else torch.full_like(params[0], float(value)))
        return values

    # ----- forward -----
    def forward(self, times, W, params):
        """times [B, I, K] (inf: no spike), W [N, I], params: one [N] tensor each. Returns the output times
        [B, N, K'] (inf-padded), counts [B, N], the states on the grid [T, B, N, S] and the record for the
        backward."""
        B, N = times.shape[0], W.shape[0]
        trace = W.new_zeros(self.steps, B, N, len(self.states))
        buffers, records = [], []
        for b in range(B):
            buffer, record = SpikeBuffer(N, self.capacity, W), {"events": [], "spikes": {}, "after": []}
            self._forward_one(times[b], W, params, buffer, record, trace[:, b])
            buffers.append(buffer)
            records.append(record)
        width = max(1, max(int(buf.counts.max()) if N else 0 for buf in buffers))
        out = W.new_full((B, N, width), float("inf"))
        for b, buf in enumerate(buffers):
            k = min(width, buf.capacity)
            out[b, :, :k] = buf.times[:, :k]
        counts = torch.stack([buf.counts for buf in buffers])
        return out, counts, trace, records

    def breakpoints(self, times_b):
        """(time, kind, index) in order: input events ("event", (i, k)) before grid points ("grid", n) at one
        time; events at or after the end of the window do nothing."""
        end = self.steps * self.dt
        i, k = torch.nonzero(torch.isfinite(times_b) & (times_b < end), as_tuple=True)
        points = [(float(times_b[a, c]), 0, ("event", (int(a), int(c)))) for a, c in zip(i.tolist(), k.tolist())]
        points += [((n + 1) * self.dt, 1, ("grid", n)) for n in range(self.steps)]
        points.sort(key=lambda p: (p[0], p[1]))
        return [(t, what) for t, _, what in points]

    def _forward_one(self, times_b, W, params, buffer, record, trace_b):
        x = self.initial(params)
        if bool((self.call("threshold", x, params)[0][0] >= 0).any()):
            raise ValueError("EventProp: a neuron starts at or above its threshold (g >= 0 at t = 0)")
        cur = torch.zeros_like(x[0])
        drive = self.call("drive", params)[0]
        for t, (kind, index) in self.breakpoints(times_b):
            x, cur = self._advance(x, cur, t, params, buffer, record, len(record["after"]))
            if kind == "grid":
                trace_b[index] = torch.stack(x, -1)
                record["after"].append([s.clone() for s in x])
                continue
            w = W[:, index[0]]
            before = [s.clone() for s in x]
            x = [s + w * d for s, d in zip(x, drive)]
            fired = self.call("threshold", x, params)[0][0] >= 0
            mid = [s.clone() for s in x]
            if bool(fired.any()):
                idx = fired.nonzero()[:, 0]
                slots = buffer.add(idx, torch.full_like(idx, 0, dtype=W.dtype) + t)
                post = self.call("reset", [s[idx] for s in x], _at(params, idx))[0]
                for s, p in zip(x, post):
                    s[idx] = p
                self._check_below(x, params, idx, "an input event")
            else:
                idx = slots = fired.nonzero()[:, 0]
            record["events"].append({"time": t, "index": index, "before": before, "mid": mid, "fired": idx,
                                     "slots": slots})
            record["after"].append([s.clone() for s in x])

    def _check_below(self, x, params, idx, what):
        g = self.call("threshold", [s[idx] for s in x], _at(params, idx))[0][0]
        if bool((g >= 0).any()):
            raise ValueError(f"EventProp: after the reset at {what} the threshold is still crossed (g >= 0): the "
                             "neuron would fire twice at one time; the reset must bring g below 0")

    def _advance(self, x, cur, target, params, buffer, record, piece):
        """Every neuron from its time `cur` to `target`, spiking where g crosses 0 on the way."""
        fr = torch.arange(1, SAMPLES + 1, dtype=cur.dtype, device=cur.device)[:, None] / SAMPLES
        while True:
            idx = (cur < target).nonzero()[:, 0]
            if not len(idx):
                return x, cur
            x0, p0, length = [s[idx] for s in x], _at(params, idx), target - cur[idx]
            hs = fr * length
            samples = self.call("flow", hs, [s[None] for s in x0], [p[None] for p in p0])[0]
            crossed = self.call("threshold", samples, [p[None] for p in p0])[0][0] >= 0
            has = crossed.any(0)
            quiet = ~has
            for s, end in zip(x, samples):
                s[idx[quiet]] = end[-1, quiet]
            cur[idx[quiet]] = target
            if not bool(has.any()):
                return x, cur
            first = crossed.int().argmax(0)[has]
            cols = has.nonzero()[:, 0]
            hi = hs[first, cols]
            lo = torch.where(first > 0, hs[(first - 1).clamp(min=0), cols], torch.zeros_like(hi))
            xs0, ps0 = [s[cols] for s in x0], [p[cols] for p in p0]
            root = self._root(xs0, ps0, lo, hi)
            pre = self.call("flow", root, xs0, ps0)[0]
            neurons = idx[cols]
            t_spike = cur[neurons] + root
            slots = buffer.add(neurons, t_spike)
            _append(record["spikes"], piece, {"neurons": neurons, "time": t_spike, "pre": pre, "slots": slots})
            post = self.call("reset", pre, ps0)[0]
            for s, p in zip(x, post):
                s[neurons] = p
            cur[neurons] = t_spike
            self._check_below(x, params, neurons, "a spike")

    def _root(self, x0, p0, lo, hi):
        """The root of g(flow(s, x0)) in [lo, hi] (g(lo) < 0 <= g(hi)), by Newton safeguarded with bisection."""
        s = hi.clone()
        for _ in range(NEWTON_STEPS):
            xs = self.call("flow", s, x0, p0)[0]
            g = self.call("threshold", xs, p0)[0][0]
            lo = torch.where(g < 0, s, lo)
            hi = torch.where(g >= 0, s, hi)
            step = g / self.call("gdot", xs, p0)[0][0]
            new = s - step
            outside = ~((new > lo) & (new < hi)) | ~torch.isfinite(new)
            new = torch.where(outside, (lo + hi) / 2, new)
            done = (new - s).abs() <= 4 * torch.finfo(s.dtype).eps * (s.abs() + hi.abs())
            s = new
            if bool(done.all()):
                break
        return s

    # ----- backward -----
    def backward(self, times, W, params, records, grad_times, grad_trace):
        """dL/dtimes [B, I, K], dL/dW [N, I], dL/dparams (one [N] tensor each)."""
        d_times, d_W = torch.zeros_like(times), torch.zeros_like(W)
        d_params = [torch.zeros_like(p) for p in params]
        for b, record in enumerate(records):
            self._backward_one(b, times[b], W, params, record, grad_times, grad_trace, d_times[b], d_W, d_params)
        return d_times, d_W, d_params

    def _backward_one(self, b, times_b, W, params, record, grad_times, grad_trace, d_times_b, d_W, d_params):
        points = self.breakpoints(times_b)
        events = iter(reversed(record["events"]))
        lam = [torch.zeros_like(params[0]) for _ in self.states]
        for p in range(len(points) - 1, -1, -1):
            t, (kind, index) = points[p]
            if kind == "grid":
                if grad_trace is not None:
                    lam = [l + grad_trace[index, b, :, k] for k, l in enumerate(lam)]
            else:
                lam = self._event_adjoint(b, next(events), W, params, lam, grad_times, d_times_b, d_W, d_params)
            start = record["after"][p - 1] if p else self.initial(params)
            lam = self._piece_adjoint(b, start, points[p - 1][0] if p else 0.0, t, record["spikes"].get(p),
                                      params, lam, grad_times, d_params)
        for s, l in zip(self.states, lam):  # a state that starts at a parameter's value
            if isinstance(self.init[s], str):
                d_params[self.parameters.index(self.init[s])] += l

    def _event_adjoint(self, b, event, W, params, lam, grad_times, d_times_b, d_W, d_params):
        """Through an input event, backwards: the spikes it caused, then its jump."""
        i, k = event["index"]
        lam = [l.clone() for l in lam]
        fired, time_error = event["fired"], W.new_zeros(())
        if len(fired):
            lam_post, mid, pf = [l[fired] for l in lam], [m[fired] for m in event["mid"]], _at(params, fired)
            h_vjp, terms = self.call("reset_vjp", mid, lam_post, pf)
            f_mid = self.call("rate", mid, pf)[0]
            f_post = self.call("rate", self.call("reset", mid, pf)[0], pf)[0]
            time_error = time_error + sum((a * fm - lp * fp).sum() for a, fm, lp, fp in zip(h_vjp, f_mid, lam_post,
                                                                                            f_post))
            if grad_times is not None:  # the spike's time is the event's
                time_error = time_error + grad_times[b, fired, event["slots"]].sum()
            for d, term in zip(d_params, terms):
                d[fired] += term
            for l, a in zip(lam, h_vjp):
                l[fired] = a
        (weight,), terms, (error,) = self.call("input_adjoint", event["before"], lam, W[:, i], params)
        d_W[:, i] += weight
        for d, term in zip(d_params, terms):
            d += term
        d_times_b[i, k] += time_error + error.sum()
        return lam

    def _piece_adjoint(self, b, start, t0, t1, spikes, params, lam, grad_times, d_params):
        """From t1 back to t0 through the spikes in between (the latest first, per neuron)."""
        lam = [l.clone() for l in lam]
        cur = torch.full_like(lam[0], t1)
        if spikes is not None:
            order = torch.argsort(spikes["time"], descending=True).tolist()
            neurons = spikes["neurons"].tolist()
            while order:
                seen, sel, rest = set(), [], []
                for j in order:  # each neuron's latest spike not yet passed
                    (rest if neurons[j] in seen else sel).append(j)
                    seen.add(neurons[j])
                order = rest
                sel = torch.tensor(sel, device=cur.device)
                nrn, time = spikes["neurons"][sel], spikes["time"][sel]
                pre, pn = [q[sel] for q in spikes["pre"]], _at(params, nrn)
                post = self.call("reset", pre, pn)[0]
                lam_post = self._flow_back(post, [l[nrn] for l in lam], cur[nrn] - time, pn, d_params, nrn)
                error = grad_times[b, nrn, spikes["slots"][sel]] if grad_times is not None else torch.zeros_like(time)
                lam_pre, terms = self.call("spike_adjoint", pre, lam_post, error, pn)
                for d, term in zip(d_params, terms):
                    d[nrn] += term
                for l, a in zip(lam, lam_pre):
                    l[nrn] = a
                cur[nrn] = time
        everyone = torch.arange(len(cur), device=cur.device)
        return self._flow_back(start, lam, cur - t0, params, d_params, everyone)

    def _flow_back(self, x0, lam_end, length, params, d_params, idx):
        """lambda a time `length` before, with the parameter integrals over that piece (x0: its first state)."""
        z = torch.as_tensor(self.nodes, dtype=length.dtype, device=length.device)[:, None]
        weights = torch.as_tensor(self.weights, dtype=length.dtype, device=length.device)[:, None]
        s = z * length
        p1 = [p[None] for p in params]
        xq = self.call("flow", s, [x[None] for x in x0], p1)[0]
        lq = self.call("adjoint_flow", length - s, [l[None] for l in lam_end], p1)[0]
        for d, term in zip(d_params, self.call("integrand", xq, lq, p1)[0]):
            d.index_add_(0, idx, (weights * term).sum(0) * length)
        return self.call("adjoint_flow", length, lam_end, params)[0]


def _append(spikes, piece, found):
    """Add the spikes `found` to those of the piece of trajectory `piece` (the one before breakpoint `piece`)."""
    if piece not in spikes:
        spikes[piece] = found
        return
    have = spikes[piece]
    spikes[piece] = {k: ([torch.cat([a, b]) for a, b in zip(have[k], v)] if isinstance(v, list)
                         else torch.cat([have[k], v])) for k, v in found.items()}


def _at(params, idx):
    return [p[idx] for p in params]


def _full(value, args):
    """A constant result of a printed function (a Python float) as a tensor of the arguments' broadcast shape."""
    shape = ()
    for a in args:
        s = tuple(a.shape)
        if len(s) > len(shape):
            shape, s = s, shape
        shape = shape[:len(shape) - len(s)] + tuple(max(x, y) for x, y in zip(shape[len(shape) - len(s):], s))
    return torch.full(shape, float(value), dtype=args[0].dtype, device=args[0].device)
