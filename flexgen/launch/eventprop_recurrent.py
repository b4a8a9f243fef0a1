"""The EventProp reference for a recurrent layer: `Simulator` with a recurrent weight V [N, N], neuron j of a
sample receiving every spike of neuron k of the same sample at its time with weight V[j, k] (its states jump by
V[j, k] b, b = df/du, as for an input spike). The printed functions are the feed-forward layer's; what changes is
the order of the events.

Forward: the rows of one sample are coupled, so each sample (a lane) goes in global time order. Between two of its
breakpoints (input events, grid points) every row's first crossing is searched as in `Simulator._advance`; the
earliest crossing of the sample's rows (the lowest neuron on a tie) is the sample's next instant: all its rows
follow the flow to that time, the neuron fires and resets, and the search goes on from there. An instant (a
crossing, or an input event's jump) runs in waves: the spikes of a wave send their jumps (summed over the wave) to
every neuron of the sample, after their own resets (a self-connection V[k, k] acts on the reset state); the
neurons those jumps carry to g >= 0 fire at the same time, reset, and make the next wave. A neuron fires at most
once at one time: a jump that carries a neuron that already fired at that time over its threshold again is refused.

Backward, in reverse time across each sample's neurons: through an instant's waves from the last (the carried
spikes' resets, then the jumps: dL/dV[j, k] = lambda_j^T b_j at k's spike, the parameter terms, and each jump's and
reset's error for the instant's time, lambda-^T f(x-) - lambda+^T f(x+)), then its first event: an input event
sends the summed error to the input spike's time; a crossing neuron's spike adjoint takes it as held error (the
error its spike causes in every postsynaptic neuron of the layer, and the loss's dL/dt_k).
"""
import torch

from .eventprop import EVENT, GRID, SAMPLES, Simulator, _at, _rows_of


class RecurrentSimulator(Simulator):
    """A layer whose neurons receive each other's spikes: `forward` and `backward` take the recurrent weight V
    [N, N] (V[j, k]: from neuron k to neuron j) after the feed-forward layer's arguments, and `backward` returns
    dL/dV after its results."""

    # ----- forward -----
    def forward(self, times, W, params, V):
        """times [B, I, K], W [N, I], params one [B*N] tensor each, V [N, N]; returns what `Simulator.forward`
        does (each sample's rows walk its breakpoints together)."""
        if times.dim() != 3:
            raise ValueError("EventProp: a recurrent layer takes input times [B, I, K] (arrivals per neuron, "
                             "[B, N, I, K], are the feed-forward layer's)")
        B, N = times.shape[0], W.shape[0]
        rounds = self.rounds(times)
        trace, buffer, x, cur, drive = self._start(B, N, W, params)
        record = {"rounds": rounds, "events": {}, "instants": {}, "after": []}
        for r in range(rounds.time.shape[0]):
            target = rounds.time[r].repeat_interleave(N)
            x = self._advance_coupled(x, cur, target, params, V, drive, buffer, record, r)
            grid = _rows_of((rounds.kind[r] == GRID).nonzero()[:, 0], N)
            if len(grid):
                trace.view(self.steps, B * N, -1)[rounds.a[r, grid // N], grid] = torch.stack(x, -1)[grid]
            event = (rounds.kind[r] == EVENT).nonzero()[:, 0]
            if len(event):
                x = self._event(x, W, params, drive, rounds, r, event, N, buffer, record)
                found = record["events"][r]
                x, found["waves"] = self._cascade(x, found["fired"], target, params, V, drive, buffer)
            record["after"].append([s.clone() for s in x])
        return (*self._spike_times(B, N, buffer, W), trace, record)

    def _advance_coupled(self, x, cur, target, params, V, drive, buffer, record, piece):
        """Every sample from its time `cur` to its `target` (per row; a sample's rows share both), instant by
        instant: the earliest crossing among the sample's rows fires, its jumps reach the sample's neurons."""
        N = V.shape[0]
        fr = torch.arange(1, SAMPLES + 1, dtype=cur.dtype, device=cur.device)[:, None] / SAMPLES
        while True:
            idx = (cur < target).nonzero()[:, 0]
            if not len(idx):
                return x
            x0, p0, length = [s[idx] for s in x], _at(params, idx), target[idx] - cur[idx]
            hs = fr * length
            samples = self.flow(hs, [s[None] for s in x0], [p[None] for p in p0])
            crossed = self.call("threshold", samples, [p[None] for p in p0])[0][0] >= 0
            lane = idx // N
            # each sample's earliest crossing lies among its rows with the earliest first sample at g >= 0
            first = torch.where(crossed.any(0), crossed.int().argmax(0), SAMPLES)
            soonest = torch.full((len(cur) // N,), SAMPLES, dtype=first.dtype, device=first.device)
            has = (first < SAMPLES) & (first == soonest.scatter_reduce(0, lane, first, "amin")[lane])
            root = torch.full_like(length, float("inf"))
            if bool(has.any()):
                first = first[has]
                cols = has.nonzero()[:, 0]
                hi = hs[first, cols]
                lo = torch.where(first > 0, hs[(first - 1).clamp(min=0), cols], torch.zeros_like(hi))
                root[cols] = self._root([s[cols] for s in x0], [p[cols] for p in p0], lo, hi)
            best = torch.full((len(cur) // N,), float("inf"), dtype=cur.dtype, device=cur.device)
            h = best.scatter_reduce(0, lane, root, "amin")[lane]  # the sample's earliest crossing
            quiet = torch.isinf(h)
            for s, end in zip(x, samples):
                s[idx[quiet]] = end[-1, quiet]
            cur[idx[quiet]] = target[idx[quiet]]
            moving = (~quiet).nonzero()[:, 0]
            if not len(moving):
                return x
            states = self.flow(h[moving], [s[moving] for s in x0], [p[moving] for p in p0])
            for s, q in zip(x, states):
                s[idx[moving]] = q
            cur[idx[moving]] += h[moving]
            earliest = ((root == h) & ~quiet).nonzero()[:, 0]  # ascending: the lowest neuron of a tie first
            keep = torch.ones_like(earliest, dtype=torch.bool)
            keep[1:] = lane[earliest[1:]] != lane[earliest[:-1]]
            neurons = idx[earliest[keep]]
            pre = [s[neurons].clone() for s in x]
            slots = buffer.add(neurons, cur[neurons])
            post = self.call("reset", pre, _at(params, neurons))[0]
            for s, q in zip(x, post):
                s[neurons] = q
            self._check_below(x, params, neurons, "a spike")
            x, waves = self._cascade(x, neurons, cur, params, V, drive, buffer)
            rows = _rows_of(neurons // N, N)
            record["instants"].setdefault(piece, []).append(
                {"neurons": neurons, "time": cur[neurons].clone(), "pre": pre, "slots": slots, "waves": waves,
                 "after": [s[rows].clone() for s in x]})

    def _cascade(self, x, spikers, time, params, V, drive, buffer):
        """The waves of an instant whose first spikes are `spikers` (rows, already reset; `time` per row): their
        jumps to every neuron of their samples, the spikes those cause, and so on. Returns (x, the waves)."""
        N = V.shape[0]
        waves, fired_now = [], torch.zeros_like(x[0], dtype=torch.bool)
        fired_now[spikers] = True
        while len(spikers):
            w = torch.zeros_like(x[0])
            w.view(-1, N).index_add_(0, spikers // N, V[:, spikers % N].T.to(w.dtype))
            lanes = torch.unique(spikers // N)
            rows = _rows_of(lanes, N)
            before = [s.clone() for s in x]
            for s, d in zip(x, drive):
                s[rows] += w[rows] * d[rows]
            mid = [s.clone() for s in x]
            fired = rows[self.call("threshold", [s[rows] for s in x], _at(params, rows))[0][0] >= 0]
            again = fired[fired_now[fired]]
            if len(again):
                k = int(again[0])
                raise ValueError(f"EventProp: a recurrent jump carries neuron {k % N} (sample {k // N}) over its "
                                 f"threshold again at t = {float(time[k]):g}, the time it fired: a neuron fires "
                                 "at most once at one time (make its reset, or its excitatory recurrent weights, "
                                 "smaller)")
            slots = buffer.add(fired, time[fired])
            if len(fired):
                post = self.call("reset", [s[fired] for s in x], _at(params, fired))[0]
                for s, q in zip(x, post):
                    s[fired] = q
                self._check_below(x, params, fired, "a recurrent jump")
            fired_now[fired] = True
            waves.append({"spikers": spikers, "lanes": lanes, "rows": rows, "w": w, "before": before, "mid": mid,
                          "fired": fired, "slots": slots})
            spikers = fired
        return x, waves

    # ----- backward -----
    def backward(self, times, W, params, record, grad_times, grad_trace, V):
        """What `Simulator.backward` returns, then dL/dV [N, N]."""
        B, N = times.shape[0], W.shape[0]
        d_times, d_W, d_V = torch.zeros_like(times), torch.zeros_like(W), torch.zeros_like(V)
        d_params = [torch.zeros_like(p) for p in params]
        errors = grad_times.reshape(B * N, -1) if grad_times is not None else None
        rounds = record["rounds"]
        lam = [torch.zeros_like(params[0]) for _ in self.states]
        for r in range(rounds.time.shape[0] - 1, -1, -1):
            grid = _rows_of((rounds.kind[r] == GRID).nonzero()[:, 0], N)
            if len(grid) and grad_trace is not None:
                g = torch.zeros(B * N, len(self.states), dtype=W.dtype, device=W.device)
                g[grid] = grad_trace.reshape(self.steps, B * N, -1)[rounds.a[r, grid // N], grid]
                lam = [l + g[:, k] for k, l in enumerate(lam)]
            if r in record["events"]:
                event = record["events"][r]
                lam, time_error = [l.clone() for l in lam], torch.zeros_like(lam[0])
                self._waves_back(event["waves"], lam, params, errors, d_V, d_params, time_error)
                lanes = event["lanes"]
                d_times[lanes, rounds.a[r, lanes], rounds.c[r, lanes]] += time_error.view(-1, N).sum(1)[lanes]
                lam = self._event_adjoint(event, rounds, r, W, params, lam, errors, d_times, d_W, d_params)
            t1 = rounds.time[r].repeat_interleave(N)
            t0 = rounds.time[r - 1].repeat_interleave(N) if r else torch.zeros_like(t1)
            start = record["after"][r - 1] if r else self.initial(params)
            lam = self._instants_back(start, t0, t1, record["instants"].get(r, ()), params, lam, errors, d_V,
                                      d_params)
        for s, l in zip(self.states, lam):  # a state that starts at a parameter's value
            if isinstance(self.init[s], str):
                d_params[self.parameters.index(self.init[s])] += l
        return d_times, d_W, d_params, d_V

    def _waves_back(self, waves, lam, params, errors, d_V, d_params, time_error):
        """Backwards (in place on `lam`) through an instant's waves, the last first: the resets of the spikes
        each wave's jumps caused, then the jumps (dL/dV). The time errors go to `time_error` (per row)."""
        N = d_V.shape[0]
        for wave in reversed(waves):
            self._resets_back(lam, wave["fired"], wave["mid"], wave["slots"], params, errors, d_params, time_error)
            weight = self._jump_back(lam, wave["rows"], wave["before"], wave["w"], params, d_params, time_error)
            per_lane = weight.view(-1, N)  # rows lane-major, lanes ascending
            at = torch.searchsorted(wave["lanes"], wave["spikers"] // N)
            d_V.index_add_(1, wave["spikers"] % N, per_lane[at].T.to(d_V.dtype))

    def _instants_back(self, start, t0, t1, instants, params, lam, errors, d_V, d_params):
        """From t1 back to t0 (per row) through the crossing instants in between, each sample's latest first."""
        N = d_V.shape[0]
        lam, cur = [l.clone() for l in lam], t1.clone()
        for instant in reversed(instants):
            neurons = instant["neurons"]
            lanes = neurons // N
            rows = _rows_of(lanes, N)
            time = instant["time"].repeat_interleave(N)
            back = self._flow_back(instant["after"], [l[rows] for l in lam], cur[rows] - time, _at(params, rows),
                                   d_params, rows)
            for l, b in zip(lam, back):
                l[rows] = b
            time_error = torch.zeros_like(lam[0])
            self._waves_back(instant["waves"], lam, params, errors, d_V, d_params, time_error)
            held = time_error.view(-1, N).sum(1)[lanes]  # the errors its spike causes, at its time
            if errors is not None:
                held = held + errors[neurons, instant["slots"]]
            lam_pre, terms = self.call("spike_adjoint", instant["pre"], [l[neurons] for l in lam], held,
                                       _at(params, neurons))
            for d, term in zip(d_params, terms):
                d[neurons] += term
            for l, a in zip(lam, lam_pre):
                l[neurons] = a
            cur[rows] = time
        everyone = torch.arange(len(cur), device=cur.device)
        return self._flow_back(start, lam, cur - t0, params, d_params, everyone)
