# EventProp (Wunderlich & Pehle 2021) for one dense layer on the functions printed above (epf_flow, epf_threshold,
# ...): the algorithm of the C kernels (static/c_eventprop.h) and the torch reference (flexgen.launch.eventprop),
# a block of neurons of one sample per program, one lane each. The lanes see the same input events (their sample's,
# sorted), so the loops over events and grid intervals are the same for all of them; what differs per lane (the
# pieces cut by its own spikes, the root search, the spikes of the backward's log) runs masked, until no lane has
# work left. Forward: between two breakpoints the first root of g on the exact flow is bracketed by EP_SAMPLES
# samples (none where the linear-flow bound shows that g stays below 0: eph_quiet) and found by Newton's method
# safeguarded by bisection; a spike resets the states and the search goes on; an input event adds w b and fires
# where g >= 0 after it. Backward: a lane's grid intervals last to first; an interval's forward is run again from
# the trace into a log of its spikes (time, the input events before it, slot, states) and its events (fired, slot,
# states before and after the jump), which the adjoint then walks backwards: exp(A^T h) between them, the
# parameter integrals by Gauss-Legendre panels no longer than 1 / |A|_inf, the jumps at spikes and events.
EP_SAMPLES = tl.constexpr(16)
EP_NEWTON_STEPS = tl.constexpr(100)
EP_MAX_PANELS = tl.constexpr(64)
EP_EPSILON = tl.constexpr(2.220446049250313e-16)  # DBL_EPSILON
EP_FULL = tl.constexpr(1)
EP_STARTS_ABOVE = tl.constexpr(2)
EP_RESET_ABOVE = tl.constexpr(3)
EP_LOG_FULL = tl.constexpr(6)
EP_SPIKE_FIELDS = tl.constexpr(3)  # a logged spike: time, input events before it, slot; then its states (SP)
EP_EVENT_FIELDS = tl.constexpr(2)  # a logged event: fired, slot; then the states before and after its jump


@triton.jit
def _any(ep_mask):
    return tl.max(ep_mask.to(tl.int32), 0) > 0


@triton.jit
def eph_quiet(ep_x0, ep_p, ep_length):
    """True where g provably stays below 0 on the flow from x0 over [0, length] (c_eventprop.h's eph_quiet):
    g(s) <= g0 + s max(q.f0, 0) + |q|_1 |A f0|_inf s^2 e^(|A|_inf s) / 2, with a margin for rounding."""
    if BOUND:
        ep_f = epf_rate(ep_x0, ep_p)
        ep_g0 = epf_threshold(ep_x0, ep_p)
        ep_qn = epf_threshold_norm(ep_p)
        ep_xn = tl.max(tl.abs(ep_x0) + ep_length[:, None] * tl.abs(ep_f), 1)
        ep_rise = (ep_length * tl.maximum(epf_gdot(ep_x0, ep_p), 0.0)
                + ep_qn * epf_curvature(ep_x0, ep_p) * ep_length * ep_length * tl.exp(epf_norm(ep_p) * ep_length) / 2)
        ep_margin = 1e-9 * (1 + tl.abs(ep_g0) + ep_qn * ep_xn)
        return (ep_rise < float("inf")) & (ep_g0 + 1.001 * ep_rise + ep_margin < 0)
    else:
        return ep_length != ep_length


@triton.jit
def eph_root(ep_x0, ep_p, ep_lo, ep_hi, ep_need):
    """Where `need`: the root of g(flow(s, x0)) in [lo, hi] (g(lo) < 0 <= g(hi)), Newton safeguarded by bisection."""
    ep_s = ep_hi
    ep_done = ep_need == 0
    ep_k = 0
    while _any(ep_need & (ep_done == 0)) & (ep_k < EP_NEWTON_STEPS):
        ep_xs = epf_flow(ep_s, ep_x0, ep_p)
        ep_g = epf_threshold(ep_xs, ep_p)
        ep_lo = tl.where(ep_g < 0, ep_s, ep_lo)
        ep_hi = tl.where(ep_g >= 0, ep_s, ep_hi)
        ep_step = ep_s - ep_g / epf_gdot(ep_xs, ep_p)
        ep_inside = (ep_step > ep_lo) & (ep_step < ep_hi) & (tl.abs(ep_step) < float("inf"))
        ep_step = tl.where(ep_inside, ep_step, (ep_lo + ep_hi) / 2)
        ep_finished = tl.abs(ep_step - ep_s) <= 4 * EP_EPSILON * (tl.abs(ep_s) + tl.abs(ep_hi))
        ep_s = tl.where(ep_done, ep_s, ep_step)
        ep_done = ep_done | ep_finished
        ep_k += 1
    return ep_s


@triton.jit
def eph_advance(ep_x, ep_cur, ep_target, ep_p, ep_count, ep_err, ep_nsp, ep_seg, ep_live, ep_out_row, ep_cap,
                ep_log_row, ep_log_size, EP_LOG: tl.constexpr):
    """Every lane from its time `cur` to `target`, spiking where g crosses 0 on the way. Forward (LOG 0): the spike
    times go to out_row[count] while count < cap; backward (LOG 1): each spike to the lane's log (`seg`: the input
    events before it in the interval). Returns x, cur, count, err, nsp."""
    ep_active = (ep_cur < ep_target) & (ep_err == 0) & ep_live
    while _any(ep_active):
        ep_length = tl.where(ep_active, ep_target - ep_cur, 0.0)
        ep_search = ep_active & (eph_quiet(ep_x, ep_p, ep_length) == 0)
        ep_lo = tl.zeros_like(ep_length)
        ep_hi = tl.zeros_like(ep_length)
        ep_first = tl.full(ep_length.shape, -1, tl.int32)
        for ep_k in range(0, tl.where(_any(ep_search), EP_SAMPLES, 0)):  # no samples where every lane is quiet
            ep_open = ep_search & (ep_first < 0)
            ep_h = ((ep_k + 1) / EP_SAMPLES) * ep_length
            ep_lo = tl.where(ep_open, ep_hi, ep_lo)
            ep_hi = tl.where(ep_open, ep_h, ep_hi)
            ep_first = tl.where(ep_open & (epf_threshold(epf_flow(ep_h, ep_x, ep_p), ep_p) >= 0), ep_k, ep_first)
        ep_crossed = ep_search & (ep_first >= 0)
        ep_next = tl.where(ep_active[:, None], epf_flow(ep_length, ep_x, ep_p), ep_x)
        ep_then = tl.where(ep_active, ep_target, ep_cur)
        if _any(ep_crossed):  # the spikes: the root, the reset, the search again from there
            ep_root = eph_root(ep_x, ep_p, ep_lo, ep_hi, ep_crossed)
            ep_pre = epf_flow(ep_root, ep_x, ep_p)
            ep_t = ep_cur + ep_root
            if EP_LOG:
                ep_entry = ep_log_row + ep_nsp.to(tl.int64) * (EP_SPIKE_FIELDS + SP)
                ep_keep = ep_crossed & (ep_nsp < ep_log_size)
                tl.store(ep_entry, ep_t, mask=ep_keep)
                tl.store(ep_entry + 1, ep_seg.to(tl.float64), mask=ep_keep)
                tl.store(ep_entry + 2, ep_count.to(tl.float64), mask=ep_keep)
                tl.store(ep_entry[:, None] + EP_SPIKE_FIELDS + tl.arange(0, SP)[None, :], ep_pre,
                         mask=ep_keep[:, None])
                ep_err = tl.where(ep_crossed & (ep_nsp >= ep_log_size), EP_LOG_FULL, ep_err)
                ep_nsp += ep_crossed.to(tl.int32)
            else:
                tl.store(ep_out_row + ep_count, ep_t, mask=ep_crossed & (ep_count < ep_cap))
            ep_count += ep_crossed.to(tl.int64)
            ep_post = epf_reset(ep_pre, ep_p)
            ep_err = tl.where(ep_crossed & (epf_threshold(ep_post, ep_p) >= 0), EP_RESET_ABOVE, ep_err)
            ep_next = tl.where(ep_crossed[:, None], ep_post, ep_next)
            ep_then = tl.where(ep_crossed, ep_t, ep_then)
        ep_x = ep_next
        ep_cur = ep_then
        ep_active = (ep_cur < ep_target) & (ep_err == 0) & ep_live
    return ep_x, ep_cur, ep_count, ep_err, ep_nsp


@triton.jit
def eph_interval(ep_x, ep_cur, ep_n, ep_count, ep_err, ep_nsp, ep_p, ep_drive, ep_lane, ep_jj, ep_live, ep_ev_time,
                 ep_ev_index, ep_firsts, ep_weight_t, ep_N, ep_M, ep_K, ep_T, ep_dt, ep_out_row, ep_cap,
                 ep_log_spikes, ep_log_events, ep_log_size, EP_LOG: tl.constexpr):
    """Every lane through the grid interval n (its input events, then the grid point (n + 1) dt), from x at cur;
    `lane`: each lane's row of the event tables (its sample's, or its own with per-synapse delays). LOG 1: the
    interval's spikes and events go to the lanes' logs. Returns x, cur, count, err, nsp. Each event's time and
    weights are loaded an event ahead (the loads do not wait for the lanes' search)."""
    ep_grid = tl.zeros_like(ep_cur) + (ep_n + 1) * ep_dt
    ep_e0 = tl.load(ep_firsts + ep_lane * (ep_T + 1) + ep_n)
    ep_n_events = tl.load(ep_firsts + ep_lane * (ep_T + 1) + ep_n + 1) - ep_e0
    ep_cols = tl.arange(0, SP)[None, :]
    ep_row = ep_lane * ep_M
    ep_ahead = tl.minimum(ep_e0, ep_M - 1)
    ep_at_next = tl.load(ep_ev_time + ep_row + ep_ahead)
    ep_w_next = tl.load(ep_weight_t + (tl.load(ep_ev_index + ep_row + ep_ahead) // ep_K) * ep_N + ep_jj)
    for ep_k in range(0, tl.max(ep_n_events, 0)):
        ep_has = ep_k < ep_n_events  # the lane's k-th event of the interval (every lane's, on a sample's list)
        ep_at = ep_at_next
        ep_w = ep_w_next
        ep_ahead = tl.minimum(ep_e0 + ep_k + 1, ep_M - 1)
        ep_at_next = tl.load(ep_ev_time + ep_row + ep_ahead)
        ep_w_next = tl.load(ep_weight_t + (tl.load(ep_ev_index + ep_row + ep_ahead) // ep_K) * ep_N + ep_jj)
        ep_x, ep_cur, ep_count, ep_err, ep_nsp = eph_advance(
            ep_x, ep_cur, tl.where(ep_has, ep_at, ep_cur), ep_p, ep_count, ep_err, ep_nsp, ep_n_events * 0 + ep_k,
            ep_live, ep_out_row, ep_cap, ep_log_spikes, ep_log_size, EP_LOG)
        ep_takes = ep_live & ep_has
        ep_mid = tl.where(ep_has[:, None], ep_x + ep_w[:, None] * ep_drive, ep_x)
        ep_fired = (epf_threshold(ep_mid, ep_p) >= 0) & ep_takes & (ep_err == 0)
        if EP_LOG:
            ep_entry = ep_log_events + ep_k * (EP_EVENT_FIELDS + 2 * SP)
            tl.store(ep_entry, ep_fired.to(tl.float64), mask=ep_takes)
            tl.store(ep_entry + 1, ep_count.to(tl.float64), mask=ep_takes)
            tl.store(ep_entry[:, None] + EP_EVENT_FIELDS + ep_cols, ep_x, mask=ep_takes[:, None])
            tl.store(ep_entry[:, None] + EP_EVENT_FIELDS + SP + ep_cols, ep_mid, mask=ep_takes[:, None])
        else:
            tl.store(ep_out_row + ep_count, ep_at, mask=ep_fired & (ep_count < ep_cap))
        ep_count += ep_fired.to(tl.int64)
        ep_post = epf_reset(ep_mid, ep_p)
        ep_err = tl.where(ep_fired & (epf_threshold(ep_post, ep_p) >= 0), EP_RESET_ABOVE, ep_err)
        ep_x = tl.where(ep_fired[:, None], ep_post, ep_mid)
    return eph_advance(ep_x, ep_cur, ep_grid, ep_p, ep_count, ep_err, ep_nsp, ep_n_events, ep_live, ep_out_row,
                       ep_cap, ep_log_spikes, ep_log_size, EP_LOG)


@triton.jit
def eph_lanes(ep_params, ep_initial, ep_N, EP_BLOCK: tl.constexpr):
    """A program's lanes: neuron jj (the last neuron for lanes past N), live, the parameters' tile, the initial
    states' tile."""
    ep_j = tl.program_id(1) * EP_BLOCK + tl.arange(0, EP_BLOCK)
    ep_jj = tl.minimum(ep_j, ep_N - 1)
    ep_cp = tl.arange(0, PP)[None, :]
    ep_cs = tl.arange(0, SP)[None, :]
    ep_p = tl.load(ep_params + ep_jj[:, None] * NP + ep_cp, mask=ep_cp < NP, other=0.0)
    ep_x = tl.load(ep_initial + ep_jj[:, None] * NS + ep_cs, mask=ep_cs < NS, other=0.0)
    return ep_jj, ep_j < ep_N, ep_p, ep_x


@triton.jit
def eph_event_rows(ep_b, ep_jj, ep_N, EP_PER_LANE: tl.constexpr):
    """Each lane's row of the event tables: its own (b N + j: per-synapse delays give each neuron its arrival
    times) or its sample's (b, the same for every lane)."""
    if EP_PER_LANE:
        return (ep_b * ep_N + ep_jj).to(tl.int64)
    else:
        return tl.zeros_like(ep_jj).to(tl.int64) + ep_b


@triton.jit(do_not_specialize=["ep_B", "ep_N", "ep_M", "ep_K", "ep_T", "ep_cap"])  # one kernel for every call
def eventprop_forward(ep_ev_time, ep_ev_index, ep_firsts, ep_weight_t, ep_params, ep_initial, ep_out, ep_counts,
                      ep_trace, ep_status, ep_consts, ep_B, ep_N, ep_M, ep_K, ep_T, ep_cap, EP_BLOCK: tl.constexpr,
                      EP_PER_LANE: tl.constexpr):
    """Grid (samples, blocks of neurons): each lane's spike times (out [B*N, cap]), counts and grid states (trace
    [T, B, N, NS]); status: the largest error code of any lane (EP_FULL: a lane had more than cap spikes);
    consts: dt (float64). PER_LANE: the event tables have a row per lane (B*N), not per sample."""
    ep_b = tl.program_id(0)
    ep_dt = tl.load(ep_consts)
    ep_jj, ep_live, ep_p, ep_x = eph_lanes(ep_params, ep_initial, ep_N, EP_BLOCK)
    ep_cs = tl.arange(0, SP)[None, :]
    ep_row = (ep_b * ep_N + ep_jj).to(tl.int64)
    ep_lane = eph_event_rows(ep_b, ep_jj, ep_N, EP_PER_LANE)
    ep_err = tl.where(ep_live & (epf_threshold(ep_x, ep_p) >= 0), EP_STARTS_ABOVE, 0)
    ep_drive = epf_drive(ep_p)
    ep_cur = tl.zeros_like(epf_threshold(ep_x, ep_p))
    ep_count = tl.zeros(ep_cur.shape, tl.int64)
    ep_nsp = tl.zeros(ep_cur.shape, tl.int32)
    for ep_n in range(0, ep_T):
        ep_x, ep_cur, ep_count, ep_err, ep_nsp = eph_interval(
            ep_x, ep_cur, ep_n, ep_count, ep_err, ep_nsp, ep_p, ep_drive, ep_lane, ep_jj, ep_live, ep_ev_time,
            ep_ev_index, ep_firsts, ep_weight_t, ep_N, ep_M, ep_K, ep_T, ep_dt, ep_out + ep_row * ep_cap, ep_cap,
            ep_out, ep_out, 0, False)
        ep_at = ((ep_n * ep_B + ep_b).to(tl.int64) * ep_N + ep_jj) * NS
        tl.store(ep_trace + ep_at[:, None] + ep_cs, ep_x, mask=ep_live[:, None] & (ep_cs < NS))
    tl.store(ep_counts + ep_row, ep_count, mask=ep_live)
    ep_err = tl.where(ep_live & (ep_err == 0) & (ep_count > ep_cap), EP_FULL, ep_err)
    tl.atomic_max(ep_status, tl.max(ep_err, 0))


@triton.jit
def eph_flow_back(ep_x0, ep_lam, ep_dp, ep_length, ep_p, ep_speed, ep_has, ep_nodes, ep_z, ep_w, ep_few_nodes,
                  ep_few_z, ep_few_w, ep_few_reach):
    """Where `has`: lambda a time `length` earlier, adding the parameter integrals over the piece from x0 on to dp
    (Gauss-Legendre panels no longer than 1 / speed, `nodes` nodes each, or the `few_nodes` of few_z, few_w (padded
    to `nodes`) on a panel short against the rate; `nodes` 0: no integrals). Returns lam, dp. A neuron nonlinear
    between events: eph_stepped_back (its substeps, RK4 and Simpson's rule; speed and the rules are not used)."""
    if LINEAR:
        ep_need = tl.ceil(ep_speed * ep_length)
        ep_panels = tl.where(ep_need < 1, 1.0, tl.where(ep_need > EP_MAX_PANELS, EP_MAX_PANELS * 1.0, ep_need))
        ep_few = ep_speed * ep_length <= ep_few_reach * ep_panels
        ep_lane_nodes = tl.where(ep_few, ep_few_nodes, ep_nodes)
        ep_acc = tl.zeros_like(ep_dp)
        for ep_m in range(0, tl.max(tl.where(ep_has & (ep_nodes > 0), ep_panels, 0.0), 0).to(tl.int32)):
            for ep_k in range(0, ep_nodes):
                ep_valid = ep_has & (ep_m < ep_panels) & (ep_k < ep_lane_nodes)
                ep_zk = tl.where(ep_few, tl.load(ep_few_z + ep_k), tl.load(ep_z + ep_k))
                ep_wk = tl.where(ep_few, tl.load(ep_few_w + ep_k), tl.load(ep_w + ep_k))
                ep_s = ((ep_m + ep_zk) / ep_panels) * ep_length
                ep_term = epf_integrand(epf_flow(ep_s, ep_x0, ep_p), epf_adjoint_flow(ep_length - ep_s, ep_lam, ep_p),
                                        ep_p)
                ep_acc = tl.where(ep_valid[:, None], ep_acc + (ep_wk / ep_panels)[:, None] * ep_term, ep_acc)
        ep_dp = tl.where(ep_has[:, None], ep_dp + ep_acc * ep_length[:, None], ep_dp)
        ep_lam = tl.where(ep_has[:, None], epf_adjoint_flow(ep_length, ep_lam, ep_p), ep_lam)
    else:
        ep_lam, ep_dp = eph_stepped_back(ep_x0, ep_lam, ep_dp, ep_length, ep_p, ep_has, ep_nodes)
    return ep_lam, ep_dp


@triton.jit
def eph_logged_spike(ep_spikes, ep_last, ep_k, ep_live):
    """(entry, has): the log entry of each lane's spike `last`, and where it is one after the interval's k-th input
    event (a spike not yet walked back)."""
    ep_entry = ep_spikes + tl.maximum(ep_last, 0).to(tl.int64) * (EP_SPIKE_FIELDS + SP)
    ep_seg = tl.load(ep_entry + 1, mask=ep_live & (ep_last >= 0), other=-1.0)
    return ep_entry, ep_live & (ep_last >= 0) & (ep_seg == ep_k)


@triton.jit(do_not_specialize=["ep_width", "ep_nodes", "ep_few_nodes", "ep_log_size", "ep_event_room", "ep_B", "ep_N",
                               "ep_I", "ep_M", "ep_K", "ep_T"])  # one kernel for every call
def eventprop_backward(ep_ev_time, ep_ev_index, ep_firsts, ep_weight_t, ep_params, ep_initial, ep_trace, ep_counts,
                       ep_grad_trace, ep_errors, ep_width, ep_nodes, ep_z, ep_w, ep_few_nodes, ep_few_z, ep_few_w,
                       ep_log_spikes, ep_log_events, ep_log_size, ep_event_room, ep_d_times, ep_d_weight, ep_d_params,
                       ep_lam0, ep_status, ep_consts, ep_B, ep_N, ep_I, ep_M, ep_K, ep_T, EP_BLOCK: tl.constexpr,
                       EP_HAS_TRACE_GRAD: tl.constexpr, EP_HAS_ERRORS: tl.constexpr, EP_PER_LANE: tl.constexpr):
    """Grid (samples, blocks of neurons): each lane's adjoint, last interval first. d_times [B, I*K] (PER_LANE:
    [B*N, I*K], a row per lane as its event tables) and d_weight [N, I] are added to atomically; d_params
    [B*N, NP] and lam0 [B*N, NS] (lambda at t = 0) stored. The logs: log_size spikes and event_room events per
    lane and interval (status EP_LOG_FULL where the spikes did not fit); consts: dt and the reach of the few-node
    rule (float64)."""
    ep_b = tl.program_id(0)
    ep_dt = tl.load(ep_consts)
    ep_few_reach = tl.load(ep_consts + 1)
    ep_jj, ep_live, ep_p, ep_x_init = eph_lanes(ep_params, ep_initial, ep_N, EP_BLOCK)
    ep_cs = tl.arange(0, SP)[None, :]
    ep_row = (ep_b * ep_N + ep_jj).to(tl.int64)
    ep_lane = eph_event_rows(ep_b, ep_jj, ep_N, EP_PER_LANE)
    ep_drive = epf_drive(ep_p)
    ep_speed = epf_norm(ep_p)
    ep_spikes = ep_log_spikes + ep_row * ep_log_size * (EP_SPIKE_FIELDS + SP)
    ep_events = ep_log_events + ep_row * ep_event_room * (EP_EVENT_FIELDS + 2 * SP)
    ep_lam = tl.zeros_like(ep_x_init)
    ep_dp = tl.zeros_like(ep_p)
    ep_remaining = tl.load(ep_counts + ep_row, mask=ep_live, other=0)
    ep_err = tl.zeros(ep_remaining.shape, tl.int32)
    for ep_back in range(0, ep_T):
        ep_n = ep_T - 1 - ep_back
        ep_at = ((tl.maximum(ep_n - 1, 0) * ep_B + ep_b).to(tl.int64) * ep_N + ep_jj) * NS  # (n = 0: x_init)
        ep_start = tl.load(ep_trace + ep_at[:, None] + ep_cs, mask=ep_cs < NS, other=0.0)
        ep_start = tl.where(ep_n > 0, ep_start, ep_x_init)
        ep_x, ep_cur, ep_count, ep_err, ep_nsp = eph_interval(
            ep_start, tl.zeros_like(ep_speed) + ep_n * ep_dt, ep_n, tl.zeros_like(ep_remaining), ep_err,
            tl.zeros_like(ep_err), ep_p, ep_drive, ep_lane, ep_jj, ep_live, ep_ev_time, ep_ev_index, ep_firsts,
            ep_weight_t, ep_N, ep_M, ep_K, ep_T, ep_dt, ep_errors, 0, ep_spikes, ep_events, ep_log_size, True)
        ep_base = ep_remaining - ep_count
        ep_remaining = ep_base
        if EP_HAS_TRACE_GRAD:
            ep_at = ((ep_n * ep_B + ep_b).to(tl.int64) * ep_N + ep_jj) * NS
            ep_lam += tl.load(ep_grad_trace + ep_at[:, None] + ep_cs, mask=ep_live[:, None] & (ep_cs < NS), other=0.0)
        ep_now = tl.zeros_like(ep_speed) + (ep_n + 1) * ep_dt
        ep_e0 = tl.load(ep_firsts + ep_lane * (ep_T + 1) + ep_n)
        ep_n_events = tl.load(ep_firsts + ep_lane * (ep_T + 1) + ep_n + 1) - ep_e0
        ep_most = tl.max(ep_n_events, 0)
        ep_last = ep_nsp - 1
        for ep_step in range(0, ep_most + 1):
            ep_k = ep_most - ep_step
            # the spikes after the interval's k-th input event, last first
            ep_entry, ep_has = eph_logged_spike(ep_spikes, ep_last, ep_k, ep_live)
            while _any(ep_has):
                ep_t = tl.load(ep_entry, mask=ep_has, other=0.0)
                ep_pre = tl.load(ep_entry[:, None] + EP_SPIKE_FIELDS + ep_cs, mask=ep_has[:, None], other=0.0)
                ep_lam, ep_dp = eph_flow_back(epf_reset(ep_pre, ep_p), ep_lam, ep_dp,
                                              tl.where(ep_has, ep_now - ep_t, 0.0), ep_p, ep_speed, ep_has,
                                              ep_nodes, ep_z, ep_w, ep_few_nodes, ep_few_z, ep_few_w, ep_few_reach)
                ep_error = tl.zeros_like(ep_t)
                if EP_HAS_ERRORS:
                    ep_slot = ep_base + tl.load(ep_entry + 2, mask=ep_has, other=0.0).to(tl.int64)
                    ep_error = tl.load(ep_errors + ep_row * ep_width + ep_slot, mask=ep_has, other=0.0)
                ep_out, ep_terms = epf_spike_adjoint(ep_pre, ep_lam, ep_error, ep_p)
                ep_lam = tl.where(ep_has[:, None], ep_out, ep_lam)
                ep_dp = tl.where(ep_has[:, None], ep_dp + ep_terms, ep_dp)
                ep_now = tl.where(ep_has, ep_t, ep_now)
                ep_last = tl.where(ep_has, ep_last - 1, ep_last)
                ep_entry, ep_has = eph_logged_spike(ep_spikes, ep_last, ep_k, ep_live)
            if ep_k > 0:  # then each lane's (k-1)-th event itself, where it has one
                ep_has = ep_live & (ep_k <= ep_n_events)
                ep_e = tl.minimum(ep_e0 + ep_k - 1, ep_M - 1)
                ep_t = tl.load(ep_ev_time + ep_lane * ep_M + ep_e)
                ep_index = tl.load(ep_ev_index + ep_lane * ep_M + ep_e)
                ep_entry = ep_events + (ep_k - 1) * (EP_EVENT_FIELDS + 2 * SP)
                ep_fired = (tl.load(ep_entry, mask=ep_has, other=0.0) > 0) & ep_has
                ep_before = tl.load(ep_entry[:, None] + EP_EVENT_FIELDS + ep_cs, mask=ep_has[:, None], other=0.0)
                ep_mid = tl.load(ep_entry[:, None] + EP_EVENT_FIELDS + SP + ep_cs, mask=ep_has[:, None], other=0.0)
                ep_post = epf_reset(ep_mid, ep_p)
                ep_lam, ep_dp = eph_flow_back(tl.where(ep_fired[:, None], ep_post, ep_mid), ep_lam, ep_dp,
                                              tl.where(ep_has, ep_now - ep_t, 0.0), ep_p, ep_speed, ep_has, ep_nodes,
                                              ep_z, ep_w, ep_few_nodes, ep_few_z, ep_few_w, ep_few_reach)
                ep_error = tl.zeros_like(ep_now)
                if EP_HAS_ERRORS:
                    ep_slot = ep_base + tl.load(ep_entry + 1, mask=ep_has, other=0.0).to(tl.int64)
                    ep_error = tl.load(ep_errors + ep_row * ep_width + ep_slot, mask=ep_fired, other=0.0)
                ep_out, ep_terms = epf_reset_vjp(ep_mid, ep_lam, ep_p)
                ep_time_error = tl.sum(ep_out * epf_rate(ep_mid, ep_p) - ep_lam * epf_rate(ep_post, ep_p), 1) + ep_error
                ep_time_error = tl.where(ep_fired, ep_time_error, 0.0)
                ep_dp = tl.where(ep_fired[:, None], ep_dp + ep_terms, ep_dp)
                ep_lam = tl.where(ep_fired[:, None], ep_out, ep_lam)
                ep_weight = tl.load(ep_weight_t + (ep_index // ep_K) * ep_N + ep_jj)
                ep_d_w, ep_terms, ep_event_error = epf_input_adjoint(ep_before, ep_lam, ep_weight, ep_p)
                tl.atomic_add(ep_d_weight + ep_jj * ep_I + ep_index // ep_K, ep_d_w, mask=ep_has)
                ep_dp = tl.where(ep_has[:, None], ep_dp + ep_terms, ep_dp)
                ep_sent = tl.where(ep_has, ep_time_error + ep_event_error, 0.0)
                if EP_PER_LANE:  # each lane's own arrival
                    tl.atomic_add(ep_d_times + ep_lane * (ep_I * ep_K) + ep_index, ep_sent, mask=ep_has)
                else:  # the sample's event, the same index in every lane: one sum
                    tl.atomic_add(ep_d_times + ep_b * ep_I * ep_K + tl.max(ep_index, 0), tl.sum(ep_sent, 0))
                ep_now = tl.where(ep_has, ep_t, ep_now)
        ep_lam, ep_dp = eph_flow_back(ep_start, ep_lam, ep_dp, ep_now - ep_n * ep_dt, ep_p, ep_speed, ep_live,
                                      ep_nodes, ep_z, ep_w, ep_few_nodes, ep_few_z, ep_few_w, ep_few_reach)
    ep_cp = tl.arange(0, PP)[None, :]
    tl.store(ep_d_params + ep_row[:, None] * NP + ep_cp, ep_dp, mask=ep_live[:, None] & (ep_cp < NP))
    tl.store(ep_lam0 + ep_row[:, None] * NS + ep_cs, ep_lam, mask=ep_live[:, None] & (ep_cs < NS))
    tl.atomic_max(ep_status, tl.max(ep_err, 0))
