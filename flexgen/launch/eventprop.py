"""The EventProp reference in torch: one layer's exact forward (spike times, states on the dt grid) and its
adjoint backward, running the functions `flexgen.render.eventprop` printed (the math is there, not here).

Forward, all samples at once (one row per sample and neuron): each sample's input events (continuous times) and
the grid points (n+1) dt are its breakpoints, taken round by round (round r: every sample's r-th breakpoint).
Arrival times [B, N, I, K] (per-synapse delays: each neuron its own) make each row a lane of its own: its own
breakpoints, an event reaching that row alone; the input-time errors then come back per row, [B, N, I, K].
Between two, every row follows the exact flow; a spike is the first root of g on that trajectory: the
piece is sampled at `SAMPLES` points, the first sample with g >= 0 brackets the root, which Newton's method
(bisection where a Newton step leaves the bracket) finds to rounding; the reset applies there and the search goes
on from the spike. An input event adds w b to the states; a neuron that the jump carries to g >= 0 fires at the
event's time. At a grid point the states are recorded (after the events at that time).

Backward, round by round in reverse time: the adjoint jumps at the grid points (the loss's gradient on the recorded
states), the input events (weight gradient, parameter terms, the error sent to the input spike's time) and the
spikes (`spike_adjoint`: lambda- from lambda+, the spike time's own error E and its parameter terms), and
follows exp(A^T h) between them. The parameter integrals over each piece between events are taken by
Gauss-Legendre quadrature with `NODES` nodes per panel, panels no longer than 1 / |A|_inf: the integrand is a sum
of exponentials in time with rates up to 2 |A|_inf.
"""
import math
from typing import NamedTuple

import numpy
import torch

EVENT, GRID, IDLE = 0, 1, 2  # the kinds of breakpoint (an idle one pads a sample with fewer breakpoints)
SAMPLES = 16  # samples of g per piece of trajectory when searching for the first crossing
NODES = 12  # Gauss-Legendre nodes per piece for the parameter integrals
NEWTON_STEPS = 100
MAX_PANELS = 64  # at most this many quadrature panels per piece


class Rounds(NamedTuple):
    """Each lane's breakpoints, [rounds, lanes]: time, kind, and (input, slot) of an event or (n, 0) of a grid
    point. A lane is a sample (its N rows see the same events) or, for arrivals per row, one row."""

    time: torch.Tensor
    kind: torch.Tensor
    a: torch.Tensor
    c: torch.Tensor


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

    def __init__(self, fns, states, parameters, init, dt, steps, capacity, linear=True, substeps=8):
        self.fns, self.states, self.parameters = fns, states, parameters
        self.init, self.dt, self.steps, self.capacity = init, dt, steps, capacity
        self.linear, self.substeps = linear, substeps  # substeps per piece (at most dt long) of a nonlinear neuron
        z, w = numpy.polynomial.legendre.leggauss(NODES)
        self.nodes, self.weights = (z + 1) / 2, w / 2

    # ----- the printed functions, on lists of tensors -----
    def call(self, name, *groups):
        args = [a for g in groups for a in (g if isinstance(g, (list, tuple)) else [g])]
        tensors = [a for a in args if torch.is_tensor(a)]
        return [[e if torch.is_tensor(e) else _full(e, tensors) for e in group] for group in self.fns[name](*args)]

    def flow(self, h, x, params):
        """The states a time h later without events: exact (linear), or `substeps` steps of the spec's method of
        length h / substeps (h is at most dt: a piece between breakpoints), a smooth function of h."""
        if self.linear:
            return self.call("flow", h, x, params)[0]
        for _ in range(self.substeps):
            x = self.call("step", h / self.substeps, x, params)[0]
        return x

    def initial(self, params):
        values = []
        for s in self.states:
            value = self.init[s]
            values.append(params[self.parameters.index(value)].clone() if isinstance(value, str)
                          else torch.full_like(params[0], float(value)))
        return values

    # ----- forward -----
    def forward(self, times, W, params):
        """times [B, I, K] (inf: no spike) or arrivals per row [B, N, I, K], W [N, I], params: one [B*N] tensor
        each (the rows: sample-major). Returns the output times [B, N, K'] (inf-padded), counts [B, N], the
        states on the grid [T, B, N, S] and the record for the backward."""
        B, N = times.shape[0], W.shape[0]
        rounds = self.rounds(times.reshape(-1, *times.shape[-2:]))
        rep = 1 if times.dim() == 4 else N  # rows per lane
        trace, buffer, x, cur, drive = self._start(B, N, W, params)
        record = {"rounds": rounds, "events": {}, "spikes": {}, "after": []}
        for r in range(rounds.time.shape[0]):
            x, cur = self._advance(x, cur, rounds.time[r].repeat_interleave(rep), params, buffer, record, r)
            grid = _rows_of((rounds.kind[r] == GRID).nonzero()[:, 0], rep)
            if len(grid):
                trace.view(self.steps, B * N, -1)[rounds.a[r, grid // rep], grid] = torch.stack(x, -1)[grid]
            event = (rounds.kind[r] == EVENT).nonzero()[:, 0]
            if len(event):
                x = self._event(x, W, params, drive, rounds, r, event, rep, buffer, record)
            record["after"].append([s.clone() for s in x])
        return (*self._spike_times(B, N, buffer, W), trace, record)

    def _start(self, B, N, W, params):
        """A forward's start: the state trace [T, B, N, S], the spike buffer, the initial states (none may start
        at or above its threshold), each row's time 0 and the input's factor b."""
        trace = W.new_zeros(self.steps, B, N, len(self.states))
        buffer = SpikeBuffer(B * N, self.capacity, W)
        x = self.initial(params)
        if bool((self.call("threshold", x, params)[0][0] >= 0).any()):
            raise ValueError("EventProp: a neuron starts at or above its threshold (g >= 0 at t = 0)")
        return trace, buffer, x, torch.zeros_like(x[0]), self.call("drive", params)[0]

    @staticmethod
    def _spike_times(B, N, buffer, W):
        """The buffer's spike times [B, N, K'] (inf-padded, K' the most of any row) and counts [B, N]."""
        width = max(1, int(buffer.counts.max()))
        out = W.new_full((B * N, width), float("inf"))
        out[:, :min(width, buffer.capacity)] = buffer.times[:, :width]
        return out.view(B, N, width), buffer.counts.view(B, N)

    def rounds(self, times):
        """Each lane's breakpoints in order (times [lanes, I, K]), round by round: input events before the grid
        point at one time; events at or after the end of the window do nothing; a lane with fewer breakpoints
        idles at the end."""
        end = self.steps * self.dt
        per_sample = []
        for times_b in times:
            i, k = torch.nonzero(torch.isfinite(times_b) & (times_b < end), as_tuple=True)
            points = [(float(times_b[a, c]), EVENT, a, c) for a, c in zip(i.tolist(), k.tolist())]
            points += [((n + 1) * self.dt, GRID, n, 0) for n in range(self.steps)]
            points.sort(key=lambda q: (q[0], q[1]))
            per_sample.append(points)
        width = max(len(q) for q in per_sample)
        rows = [q + [(end, IDLE, 0, 0)] * (width - len(q)) for q in per_sample]
        columns = list(zip(*[list(zip(*row)) for row in rows]))  # (time, kind, a, c) x samples x rounds
        dtypes = (times.dtype, torch.long, torch.long, torch.long)
        return Rounds(*(torch.tensor(c, dtype=d, device=times.device).T for c, d in zip(columns, dtypes)))

    def _event(self, x, W, params, drive, rounds, r, event, rep, buffer, record):
        """The input events of round r (one per lane in `event`): the jumps, then the spikes they cause."""
        N = W.shape[0]
        rows = _rows_of(event, rep)
        w = torch.zeros_like(x[0])
        w[rows] = W[rows % N, rounds.a[r, rows // rep]]
        before = [s.clone() for s in x]
        x = [s + w * d for s, d in zip(x, drive)]
        mid = [s.clone() for s in x]
        fired = rows[self.call("threshold", [s[rows] for s in x], _at(params, rows))[0][0] >= 0]
        slots = buffer.add(fired, rounds.time[r].repeat_interleave(rep)[fired])
        if len(fired):
            post = self.call("reset", [s[fired] for s in x], _at(params, fired))[0]
            for s, q in zip(x, post):
                s[fired] = q
            self._check_below(x, params, fired, "an input event")
        record["events"][r] = {"lanes": event, "rep": rep, "rows": rows, "w": w, "before": before, "mid": mid,
                               "fired": fired, "slots": slots}
        return x

    def _check_below(self, x, params, idx, what):
        g = self.call("threshold", [s[idx] for s in x], _at(params, idx))[0][0]
        if bool((g >= 0).any()):
            raise ValueError(f"EventProp: after the reset at {what} the threshold is still crossed (g >= 0): the "
                             "neuron would fire twice at one time; the reset must bring g below 0")

    def _advance(self, x, cur, target, params, buffer, record, piece):
        """Every row from its time `cur` to its `target`, spiking where g crosses 0 on the way."""
        fr = torch.arange(1, SAMPLES + 1, dtype=cur.dtype, device=cur.device)[:, None] / SAMPLES
        while True:
            idx = (cur < target).nonzero()[:, 0]
            if not len(idx):
                return x, cur
            x0, p0, length = [s[idx] for s in x], _at(params, idx), target[idx] - cur[idx]
            hs = fr * length
            samples = self.flow(hs, [s[None] for s in x0], [p[None] for p in p0])
            crossed = self.call("threshold", samples, [p[None] for p in p0])[0][0] >= 0
            has = crossed.any(0)
            quiet = ~has
            for s, end in zip(x, samples):
                s[idx[quiet]] = end[-1, quiet]
            cur[idx[quiet]] = target[idx[quiet]]
            if not bool(has.any()):
                return x, cur
            first = crossed.int().argmax(0)[has]
            cols = has.nonzero()[:, 0]
            hi = hs[first, cols]
            lo = torch.where(first > 0, hs[(first - 1).clamp(min=0), cols], torch.zeros_like(hi))
            xs0, ps0 = [s[cols] for s in x0], [p[cols] for p in p0]
            root = self._root(xs0, ps0, lo, hi)
            pre = self.flow(root, xs0, ps0)
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
            xs = self.flow(s, x0, p0)
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
    def backward(self, times, W, params, record, grad_times, grad_trace):
        """dL/dtimes (the shape of times), dL/dW [N, I], dL/dparams (one [B*N] tensor each: per row)."""
        B, N = times.shape[0], W.shape[0]
        d_times, d_W = torch.zeros_like(times), torch.zeros_like(W)
        d_params = [torch.zeros_like(p) for p in params]
        errors = grad_times.reshape(B * N, -1) if grad_times is not None else None
        rounds = record["rounds"]
        lam = [torch.zeros_like(params[0]) for _ in self.states]
        rep = 1 if times.dim() == 4 else N  # rows per lane
        for r in range(rounds.time.shape[0] - 1, -1, -1):
            grid = _rows_of((rounds.kind[r] == GRID).nonzero()[:, 0], rep)
            if len(grid) and grad_trace is not None:
                g = torch.zeros(B * N, len(self.states), dtype=W.dtype, device=W.device)
                g[grid] = grad_trace.reshape(self.steps, B * N, -1)[rounds.a[r, grid // rep], grid]
                lam = [l + g[:, k] for k, l in enumerate(lam)]
            if r in record["events"]:
                lam = self._event_adjoint(record["events"][r], rounds, r, W, params, lam, errors, d_times, d_W,
                                          d_params)
            t1 = rounds.time[r].repeat_interleave(rep)
            t0 = rounds.time[r - 1].repeat_interleave(rep) if r else torch.zeros_like(t1)
            start = record["after"][r - 1] if r else self.initial(params)
            lam = self._piece_adjoint(start, t0, t1, record["spikes"].get(r), params, lam, errors, d_params)
        for s, l in zip(self.states, lam):  # a state that starts at a parameter's value
            if isinstance(self.init[s], str):
                d_params[self.parameters.index(self.init[s])] += l
        return d_times, d_W, d_params

    def _event_adjoint(self, event, rounds, r, W, params, lam, errors, d_times, d_W, d_params):
        """Through the input events of round r, backwards: the spikes they caused, then their jumps."""
        N = W.shape[0]
        lam = [l.clone() for l in lam]
        rows, lanes, rep = event["rows"], event["lanes"], event["rep"]
        time_error = torch.zeros_like(lam[0])  # per row, summed per lane below
        self._resets_back(lam, event["fired"], event["mid"], event["slots"], params, errors, d_params, time_error)
        weight = self._jump_back(lam, rows, event["before"], event["w"], params, d_params, time_error)
        d_W.index_put_((rows % N, rounds.a[r, rows // rep]), weight, accumulate=True)
        per_lane = time_error.view(-1, rep).sum(1)[lanes]
        d_times.view(-1, *d_times.shape[-2:])[lanes, rounds.a[r, lanes], rounds.c[r, lanes]] += per_lane
        return lam

    def _resets_back(self, lam, fired, mid, slots, params, errors, d_params, time_error):
        """Backwards (in place on `lam`) through the resets of `fired`, spikes that a jump caused at its time (`mid`:
        the states after the jump): lambda- = H^T lambda+, the parameter terms, and each spike's time error
        (lambda-^T f(x-) - lambda+^T f(x+) and the loss's dL/dt) added to `time_error`."""
        if not len(fired):
            return
        lam_post, mid, pf = [l[fired] for l in lam], [m[fired] for m in mid], _at(params, fired)
        h_vjp, terms = self.call("reset_vjp", mid, lam_post, pf)
        f_mid = self.call("rate", mid, pf)[0]
        f_post = self.call("rate", self.call("reset", mid, pf)[0], pf)[0]
        time_error[fired] += sum(a * fm - lp * fp for a, fm, lp, fp in zip(h_vjp, f_mid, lam_post, f_post))
        if errors is not None:  # the spike's time is the event's
            time_error[fired] += errors[fired, slots]
        for d, term in zip(d_params, terms):
            d[fired] += term
        for l, a in zip(lam, h_vjp):
            l[fired] = a

    def _jump_back(self, lam, rows, before, w, params, d_params, time_error):
        """Backwards through the jumps x += w b of `rows` (`before`: the states before them; lambda is unchanged):
        the parameter terms, each jump's time error into `time_error`; returns dL/dw per row (lambda^T b)."""
        (weight,), terms, (error,) = self.call("input_adjoint", [b[rows] for b in before], [l[rows] for l in lam],
                                               w[rows], _at(params, rows))
        for d, term in zip(d_params, terms):
            d[rows] += term
        time_error[rows] += error
        return weight

    def _piece_adjoint(self, start, t0, t1, spikes, params, lam, errors, d_params):
        """From t1 back to t0 (per row) through the spikes in between (the latest first, per row)."""
        lam = [l.clone() for l in lam]
        cur = t1.clone()
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
                error = errors[nrn, spikes["slots"][sel]] if errors is not None else torch.zeros_like(time)
                lam_pre, terms = self.call("spike_adjoint", pre, lam_post, error, pn)
                for d, term in zip(d_params, terms):
                    d[nrn] += term
                for l, a in zip(lam, lam_pre):
                    l[nrn] = a
                cur[nrn] = time
        everyone = torch.arange(len(cur), device=cur.device)
        return self._flow_back(start, lam, cur - t0, params, d_params, everyone)

    def _flow_back(self, x0, lam_end, length, params, d_params, idx):
        """lambda a time `length` before, with the parameter integrals over that piece (x0: its first state), by
        Gauss-Legendre on panels no longer than 1 / |A|_inf (the integrand's rates are at most 2 |A|_inf)."""
        if not self.linear:
            return self._stepped_back(x0, lam_end, length, params, d_params, idx)
        n = len(self.states)
        entries = torch.stack(self.call("jacobian", params)[0], -1).abs()
        rate = entries.view(*entries.shape[:-1], n, n).sum(-1).amax(-1)
        panels = int(min(MAX_PANELS, max(1, math.ceil(float((rate * length).max())))))
        z = torch.as_tensor(self.nodes, dtype=length.dtype, device=length.device)
        z = ((torch.arange(panels, dtype=length.dtype, device=length.device)[:, None] + z) / panels).flatten()[:, None]
        weights = torch.as_tensor(self.weights, dtype=length.dtype, device=length.device).repeat(panels)[:, None]
        weights = weights / panels
        s = z * length
        p1 = [p[None] for p in params]
        xq = self.call("flow", s, [x[None] for x in x0], p1)[0]
        lq = self.call("adjoint_flow", length - s, [l[None] for l in lam_end], p1)[0]
        for d, term in zip(d_params, self.call("integrand", xq, lq, p1)[0]):
            d.index_add_(0, idx, (weights * term).sum(0) * length)
        return self.call("adjoint_flow", length, lam_end, params)[0]


    def _stepped_back(self, x0, lam_end, length, params, d_params, idx):
        """`_flow_back` for a nonlinear neuron: the trajectory recomputed by substeps of the spec's method (and
        half-substeps for the midpoints), the adjoint by RK4 in reverse time on it, the integrals by Simpson's rule
        with lambda at the midpoints from cubic Hermite interpolation: all of fourth order in the substep."""
        n = self.substeps
        h = length / n
        nodes, mids = [x0], []
        for _ in range(n):
            mids.append(self.call("step", h / 2, nodes[-1], params)[0])
            nodes.append(self.call("step", h, nodes[-1], params)[0])

        def rate(x, lam):
            return self.call("adjoint_rate", x, lam, params)[0]

        def along(lam, k, scale):
            return [l + scale * h * d for l, d in zip(lam, k)]

        lam, totals = list(lam_end), None
        for k in range(n - 1, -1, -1):
            k1 = rate(nodes[k + 1], lam)
            k2 = rate(mids[k], along(lam, k1, 0.5))
            k3 = rate(mids[k], along(lam, k2, 0.5))
            k4 = rate(nodes[k], along(lam, k3, 1.0))
            before = [l + h / 6 * (a + 2 * b + 2 * c + d) for l, a, b, c, d in zip(lam, k1, k2, k3, k4)]
            slope = rate(nodes[k], before)
            mid = [(a + b) / 2 + h / 8 * (s1 - s2) for a, b, s1, s2 in zip(lam, before, k1, slope)]
            parts = zip(self.call("integrand", nodes[k + 1], lam, params)[0],
                        self.call("integrand", mids[k], mid, params)[0],
                        self.call("integrand", nodes[k], before, params)[0])
            piece = [h / 6 * (a + 4 * b + c) for a, b, c in parts]
            totals = piece if totals is None else [t + q for t, q in zip(totals, piece)]
            lam = before
        for d, total in zip(d_params, totals):
            d.index_add_(0, idx, total.expand_as(length))
        return lam


def _append(spikes, piece, found):
    """Add the spikes `found` to those of the piece of trajectory `piece` (the one before breakpoint `piece`)."""
    if piece not in spikes:
        spikes[piece] = found
        return
    have = spikes[piece]
    spikes[piece] = {k: ([torch.cat([a, b]) for a, b in zip(have[k], v)] if isinstance(v, list)
                         else torch.cat([have[k], v])) for k, v in found.items()}


def _rows_of(lanes, rep):
    """The rows of `lanes` (each lane `rep` consecutive rows)."""
    if rep == 1:
        return lanes
    return (lanes[:, None] * rep + torch.arange(rep, device=lanes.device)).flatten()


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
