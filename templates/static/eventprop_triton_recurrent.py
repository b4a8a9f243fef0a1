# EventProp for a recurrent layer (weight_rec V [N, N], V[j, k] from neuron k to neuron j) on the same printed
# functions and helpers: the algorithm of the C kernels (static/c_eventprop_recurrent.h) with one program per
# sample and its N neurons as the lanes of one block, in global time order. Forward: from the sample's time `cur`
# towards the next breakpoint (an input event, a grid point) every lane's first crossing is bracketed by EP_SAMPLES
# samples (none where eph_quiet shows it cannot cross); the earliest (the lowest lane on a tie) is found by Newton's
# method, every lane follows the flow to it, that neuron fires and resets, and the instant runs in waves: the
# spikes of a wave send their jumps (a column of V each) to every lane, the lanes carried to g >= 0 fire at that
# time, reset and make the next wave (a lane carried over again at the time it fired: EPR_TWICE). An input event's
# jump starts its instant's first wave the same way. Backward: the grid intervals last to first; an interval's
# forward runs again from the trace into the program's log of items (below), which the adjoint walks backwards:
# exp(A^T h) and the parameter integrals between instants, then each instant from its last item (each item's own
# piece of the adjoint: a jump's input adjoint, a wave's resets' VJP or a crossing's spike adjoint).
EPR_TWICE = tl.constexpr(5)
EPR_CROSS = tl.constexpr(0)  # a crossing: lane j's states before its reset (columns 0..SP), its slot (column SP + 1)
EPR_RESETS = tl.constexpr(1)  # a wave's resets: every lane's states before (0..SP), the fired lanes' slots or -1
EPR_JUMP = tl.constexpr(2)  # a jump: every lane's states before (0..SP), its weight (SP), spiker flags (SP + 1)
EPR_STATE = tl.constexpr(3)  # the end of an instant: every lane's states (0..SP)
EPR_HEAD = tl.constexpr(4)  # an item's header: kind, time, lane j (a crossing's), input event (a jump's, or -1)
EPR_LANE = tl.constexpr(SP + 2)  # an item's columns per lane


@triton.jit
def epr_put(ep_log, ep_nit, ep_room, ep_err, ep_kind, ep_t, ep_j, ep_event, ep_x, ep_a, ep_b, ep_lanes, ep_live,
            EP_LOG: tl.constexpr, EP_BLOCK: tl.constexpr):
    """Item nit of the log (room items of EPR_HEAD + EP_BLOCK EPR_LANE values): the header, each live lane's x
    tile and its two columns a, b. Returns (nit + 1, err): EP_LOG_FULL where the log had no room."""
    if EP_LOG:
        ep_keep = (ep_lanes * 0 + ep_nit) < ep_room  # (as vectors: Triton's interpreter masks by vectors only)
        ep_item = ep_log + ep_nit.to(tl.int64) * (EPR_HEAD + EP_BLOCK * EPR_LANE)
        ep_head = tl.arange(0, 4)
        ep_zero = tl.zeros([4], tl.float64)  # (each field widened to float64 exactly)
        ep_values = tl.where(ep_head == 0, ep_zero + ep_kind, tl.where(ep_head == 1, ep_zero + ep_t, tl.where(
            ep_head == 2, ep_zero + ep_j, ep_zero + ep_event)))
        tl.store(ep_item + ep_head, ep_values, mask=(ep_head * 0 + ep_nit) < ep_room)
        ep_row = ep_item + EPR_HEAD + ep_lanes * EPR_LANE
        ep_cs = tl.arange(0, SP)[None, :]
        tl.store(ep_row[:, None] + ep_cs, ep_x, mask=(ep_live & ep_keep)[:, None])
        tl.store(ep_row + SP, ep_a, mask=ep_live & ep_keep)
        tl.store(ep_row + SP + 1, ep_b, mask=ep_live & ep_keep)
        ep_err = tl.where((ep_nit >= ep_room) & (ep_err == 0), EP_LOG_FULL, ep_err)
        ep_nit += 1
    return ep_nit, ep_err


@triton.jit
def epr_fire(ep_x, ep_t, ep_p, ep_new, ep_count, ep_err, ep_out, ep_cap, ep_lanes, EP_LOG: tl.constexpr):
    """The lanes `new` fire at t: their slots (this run's counts), their spike times to out[lane, slot] (forward),
    their resets. Returns x, slot (-1 elsewhere), count, err."""
    ep_slot = tl.where(ep_new, ep_count, -1)
    if not EP_LOG:
        tl.store(ep_out + ep_lanes * ep_cap + ep_count, tl.zeros_like(ep_count).to(tl.float64) + ep_t,
                 mask=ep_new & (ep_count < ep_cap))
    ep_count += ep_new.to(tl.int64)
    ep_post = epf_reset(ep_x, ep_p)
    ep_err = tl.where(tl.max((ep_new & (epf_threshold(ep_post, ep_p) >= 0)).to(tl.int32), 0) > 0, EP_RESET_ABOVE,
                      ep_err)
    return tl.where(ep_new[:, None], ep_post, ep_x), ep_slot, ep_count, ep_err


@triton.jit
def epr_waves(ep_x, ep_t, ep_w, ep_event, ep_wave, ep_fired, ep_p, ep_drive, ep_count, ep_err, ep_nit, ep_v_t,
              ep_N, ep_lanes, ep_live, ep_out, ep_cap, ep_log, ep_room, EP_LOG: tl.constexpr, EP_BLOCK: tl.constexpr):
    """The instant at t from its first jump (weights w, from the input event `event`, or -1 and w unused for the
    spikes `wave`, already reset): each jump logged, applied, the lanes carried over fire and reset and make the
    next wave, until a wave is empty; then the instant's states, logged. Returns x, count, err, nit."""
    ep_first = ep_event >= 0  # (a tensor: the callers pass the event's index or a tensor -1)
    while (_any(ep_wave) | ep_first) & (ep_err == 0):
        if ep_first == 0:  # a wave's jump: the sum of its spikers' columns of V, in lane order
            ep_w = tl.zeros_like(ep_t + ep_lanes.to(tl.float64))
            ep_rest = ep_wave
            while _any(ep_rest):
                ep_k = tl.min(tl.where(ep_rest, ep_lanes, EP_BLOCK), 0)
                ep_w += tl.load(ep_v_t + ep_k.to(tl.int64) * ep_N + ep_lanes, mask=ep_live, other=0.0)
                ep_rest = ep_rest & (ep_lanes != ep_k)
        ep_nit, ep_err = epr_put(ep_log, ep_nit, ep_room, ep_err, EPR_JUMP, ep_t, -1,
                                 tl.where(ep_first, ep_event, -1), ep_x, ep_w, ep_wave.to(tl.float64), ep_lanes,
                                 ep_live, EP_LOG, EP_BLOCK)
        ep_x = tl.where(ep_live[:, None], ep_x + ep_w[:, None] * ep_drive, ep_x)
        ep_new = ep_live & (epf_threshold(ep_x, ep_p) >= 0)
        ep_err = tl.where(_any(ep_new & ep_fired) & (ep_err == 0), EPR_TWICE, ep_err)
        ep_mid = ep_x
        ep_x, ep_slot, ep_count, ep_err = epr_fire(ep_x, ep_t, ep_p, ep_new, ep_count, ep_err, ep_out, ep_cap,
                                                   ep_lanes, EP_LOG)
        if _any(ep_new):
            ep_nit, ep_err = epr_put(ep_log, ep_nit, ep_room, ep_err, EPR_RESETS, ep_t, -1, -1, ep_mid,
                                     ep_slot.to(tl.float64), ep_slot.to(tl.float64), ep_lanes, ep_live, EP_LOG,
                                     EP_BLOCK)
        ep_fired = ep_fired | ep_new
        ep_wave = ep_new
        ep_first = ep_first & False
    ep_nit, ep_err = epr_put(ep_log, ep_nit, ep_room, ep_err, EPR_STATE, ep_t, -1, -1, ep_x, ep_w, ep_w, ep_lanes,
                             ep_live, EP_LOG, EP_BLOCK)
    return ep_x, ep_count, ep_err, ep_nit


@triton.jit
def epr_advance(ep_x, ep_cur, ep_target, ep_p, ep_drive, ep_count, ep_err, ep_nit, ep_v_t, ep_N, ep_lanes, ep_live,
                ep_out, ep_cap, ep_log, ep_room, EP_LOG: tl.constexpr, EP_BLOCK: tl.constexpr):
    """Every lane from the sample's time cur to target, instant by instant at the sample's earliest crossings.
    Returns x, cur, count, err, nit."""
    while (ep_cur < ep_target) & (ep_err == 0):
        ep_length = ep_target - ep_cur
        ep_lengths = tl.zeros_like(ep_lanes.to(tl.float64)) + ep_length
        ep_search = ep_live & (eph_quiet(ep_x, ep_p, ep_lengths) == 0)
        ep_first = tl.full(ep_lengths.shape, EP_SAMPLES, tl.int32)
        for ep_k in range(0, tl.where(_any(ep_search), EP_SAMPLES, 0)):
            ep_h = tl.zeros_like(ep_lengths) + ((ep_k + 1) / EP_SAMPLES) * ep_length
            ep_up = ep_search & (ep_first == EP_SAMPLES) & (epf_threshold(epf_flow(ep_h, ep_x, ep_p), ep_p) >= 0)
            ep_first = tl.where(ep_up, ep_k, ep_first)
        ep_soonest = tl.min(ep_first, 0)
        if ep_soonest == EP_SAMPLES:  # no lane crosses before target
            ep_x = tl.where(ep_live[:, None], epf_flow(ep_lengths, ep_x, ep_p), ep_x)
            ep_cur = ep_target
        else:
            ep_lo = tl.zeros_like(ep_lengths) + (ep_soonest / EP_SAMPLES) * ep_length
            ep_hi = tl.zeros_like(ep_lengths) + ((ep_soonest + 1) / EP_SAMPLES) * ep_length
            ep_need = ep_first == ep_soonest
            ep_root = eph_root(ep_x, ep_p, ep_lo, ep_hi, ep_need)
            ep_best = tl.min(tl.where(ep_need, ep_root, float("inf")), 0)
            ep_j = tl.min(tl.where(ep_need & (ep_root == ep_best), ep_lanes, EP_BLOCK), 0)
            ep_x = tl.where(ep_live[:, None], epf_flow(tl.zeros_like(ep_lengths) + ep_best, ep_x, ep_p), ep_x)
            ep_cur = ep_cur + ep_best
            ep_win = ep_lanes == ep_j
            ep_pre = ep_x
            ep_x, ep_slot, ep_count, ep_err = epr_fire(ep_x, ep_cur, ep_p, ep_win, ep_count, ep_err, ep_out, ep_cap,
                                                       ep_lanes, EP_LOG)
            ep_nit, ep_err = epr_put(ep_log, ep_nit, ep_room, ep_err, EPR_CROSS, ep_cur, ep_j, -1, ep_pre,
                                     ep_slot.to(tl.float64), ep_slot.to(tl.float64), ep_lanes, ep_win, EP_LOG,
                                     EP_BLOCK)
            ep_x, ep_count, ep_err, ep_nit = epr_waves(
                ep_x, ep_cur, ep_lengths, ep_j * 0 - 1, ep_win, ep_win, ep_p, ep_drive, ep_count, ep_err, ep_nit,
                ep_v_t, ep_N, ep_lanes, ep_live, ep_out, ep_cap, ep_log, ep_room, EP_LOG, EP_BLOCK)
    return ep_x, ep_cur, ep_count, ep_err, ep_nit


@triton.jit
def epr_interval(ep_x, ep_n, ep_b, ep_p, ep_drive, ep_count, ep_err, ep_nit, ep_ev_time, ep_ev_index, ep_firsts,
                 ep_weight_t, ep_v_t, ep_N, ep_M, ep_K, ep_T, ep_dt, ep_lanes, ep_live, ep_out, ep_cap, ep_log,
                 ep_room, EP_LOG: tl.constexpr, EP_BLOCK: tl.constexpr):
    """The sample through grid interval n from x at n dt: its input events (each an instant), then the grid point.
    Returns x, count, err, nit."""
    ep_cur = ep_n * ep_dt + 0.0
    ep_e0 = tl.load(ep_firsts + ep_b * (ep_T + 1) + ep_n)
    ep_e1 = tl.load(ep_firsts + ep_b * (ep_T + 1) + ep_n + 1)
    ep_none = ep_lanes < 0
    for ep_e in range(ep_e0, ep_e1):
        ep_at = tl.load(ep_ev_time + ep_b * ep_M + ep_e)
        ep_x, ep_cur, ep_count, ep_err, ep_nit = epr_advance(
            ep_x, ep_cur, ep_at, ep_p, ep_drive, ep_count, ep_err, ep_nit, ep_v_t, ep_N, ep_lanes, ep_live, ep_out,
            ep_cap, ep_log, ep_room, EP_LOG, EP_BLOCK)
        ep_index = tl.load(ep_ev_index + ep_b * ep_M + ep_e)
        ep_w = tl.load(ep_weight_t + (ep_index // ep_K) * ep_N + ep_lanes, mask=ep_live, other=0.0)
        if ep_err == 0:
            ep_x, ep_count, ep_err, ep_nit = epr_waves(
                ep_x, ep_at, ep_w, ep_e, ep_none, ep_none, ep_p, ep_drive, ep_count, ep_err, ep_nit, ep_v_t, ep_N,
                ep_lanes, ep_live, ep_out, ep_cap, ep_log, ep_room, EP_LOG, EP_BLOCK)
    ep_x, ep_cur, ep_count, ep_err, ep_nit = epr_advance(
        ep_x, ep_cur, (ep_n + 1) * ep_dt + 0.0, ep_p, ep_drive, ep_count, ep_err, ep_nit, ep_v_t, ep_N, ep_lanes,
        ep_live, ep_out, ep_cap, ep_log, ep_room, EP_LOG, EP_BLOCK)
    return ep_x, ep_count, ep_err, ep_nit


@triton.jit(do_not_specialize=["ep_B", "ep_N", "ep_M", "ep_K", "ep_T", "ep_cap"])  # one kernel for every call
def eventprop_recurrent_forward(ep_ev_time, ep_ev_index, ep_firsts, ep_weight_t, ep_v_t, ep_params, ep_initial,
                                ep_out, ep_counts, ep_trace, ep_status, ep_consts, ep_B, ep_N, ep_M, ep_K, ep_T,
                                ep_cap, EP_BLOCK: tl.constexpr):
    """Grid (samples, 1): each sample's neurons (lanes, N <= BLOCK) through the window; spike times (out [B*N,
    cap]), counts and grid states (trace [T, B, N, NS]); status as eventprop_forward's (EPR_TWICE besides)."""
    ep_b = tl.program_id(0)
    ep_dt = tl.load(ep_consts)
    ep_clipped, ep_live, ep_p, ep_x = eph_lanes(ep_params, ep_initial, ep_N, EP_BLOCK)
    ep_lanes = tl.arange(0, EP_BLOCK)  # (each lane its own id: eph_lanes repeats the last neuron past N)
    ep_cs = tl.arange(0, SP)[None, :]
    ep_row = (ep_b * ep_N + ep_lanes).to(tl.int64)
    ep_err = tl.where(_any(ep_live & (epf_threshold(ep_x, ep_p) >= 0)), EP_STARTS_ABOVE, 0)
    ep_drive = epf_drive(ep_p)
    ep_count = tl.zeros(ep_lanes.shape, tl.int64)
    ep_out = ep_out + ep_b.to(tl.int64) * ep_N * ep_cap
    for ep_n in range(0, ep_T):
        if ep_err == 0:
            ep_x, ep_count, ep_err, ep_items = epr_interval(
                ep_x, ep_n, ep_b, ep_p, ep_drive, ep_count, ep_err, ep_b * 0, ep_ev_time, ep_ev_index, ep_firsts,
                ep_weight_t, ep_v_t, ep_N, ep_M, ep_K, ep_T, ep_dt, ep_lanes, ep_live, ep_out, ep_cap, ep_out, 0,
                False, EP_BLOCK)
            ep_at = ((ep_n * ep_B + ep_b).to(tl.int64) * ep_N + ep_lanes) * NS
            tl.store(ep_trace + ep_at[:, None] + ep_cs, ep_x, mask=ep_live[:, None] & (ep_cs < NS))
    tl.store(ep_counts + ep_row, ep_count, mask=ep_live)
    ep_err = tl.where((ep_err == 0) & _any(ep_live & (ep_count > ep_cap)), EP_FULL, ep_err)
    tl.atomic_max(ep_status, ep_err)


@triton.jit
def epr_item(ep_log, ep_m, ep_lanes, ep_live, EP_BLOCK: tl.constexpr):
    """Log item m: (kind, time, lane j, input event, the lanes' x tile, column a, column b)."""
    ep_item = ep_log + ep_m.to(tl.int64) * (EPR_HEAD + EP_BLOCK * EPR_LANE)
    ep_row = ep_item + EPR_HEAD + ep_lanes * EPR_LANE
    ep_cs = tl.arange(0, SP)[None, :]
    return (tl.load(ep_item), tl.load(ep_item + 1), tl.load(ep_item + 2).to(tl.int32),
            tl.load(ep_item + 3).to(tl.int64), tl.load(ep_row[:, None] + ep_cs, mask=ep_live[:, None], other=0.0),
            tl.load(ep_row + SP, mask=ep_live, other=0.0), tl.load(ep_row + SP + 1, mask=ep_live, other=0.0))


@triton.jit
def epr_own_errors(ep_errors, ep_row, ep_width, ep_base, ep_c, ep_mask, EP_HAS_ERRORS: tl.constexpr):
    """The errors dL/dt of the spike times themselves, of the lanes `mask` whose slot in this interval is c."""
    ep_own = tl.zeros_like(ep_c)
    if EP_HAS_ERRORS:
        ep_slot = ep_base + tl.maximum(ep_c, 0.0).to(tl.int64)
        ep_own = tl.load(ep_errors + ep_row * ep_width + ep_slot, mask=ep_mask, other=0.0)
    return ep_own


@triton.jit(do_not_specialize=["ep_width", "ep_nodes", "ep_few_nodes", "ep_room", "ep_B", "ep_N", "ep_I", "ep_M",
                               "ep_K", "ep_T"])  # one kernel for every call
def eventprop_recurrent_backward(ep_ev_time, ep_ev_index, ep_firsts, ep_weight_t, ep_v_t, ep_params, ep_initial,
                                 ep_trace, ep_counts, ep_grad_trace, ep_errors, ep_width, ep_nodes, ep_z, ep_w,
                                 ep_few_nodes, ep_few_z, ep_few_w, ep_log, ep_room, ep_d_times, ep_d_weight,
                                 ep_d_v_t, ep_d_params, ep_lam0, ep_status, ep_consts, ep_B, ep_N, ep_I, ep_M, ep_K,
                                 ep_T, EP_BLOCK: tl.constexpr, EP_HAS_TRACE_GRAD: tl.constexpr,
                                 EP_HAS_ERRORS: tl.constexpr):
    """Grid (samples, 1): each sample's adjoint, last interval first; an interval's forward runs again into the
    program's log (room items). d_times [B, I*K], d_weight [N, I] and d_v_t [N, N] (dL/dV transposed: row k the
    column of neuron k's spikes) are added to atomically; d_params [B*N, NP] and lam0 [B*N, NS] stored; status as
    eventprop_backward's."""
    ep_b = tl.program_id(0)
    ep_dt = tl.load(ep_consts)
    ep_few_reach = tl.load(ep_consts + 1)
    ep_clipped, ep_live, ep_p, ep_x_init = eph_lanes(ep_params, ep_initial, ep_N, EP_BLOCK)
    ep_lanes = tl.arange(0, EP_BLOCK)
    ep_cs = tl.arange(0, SP)[None, :]
    ep_row = (ep_b * ep_N + ep_lanes).to(tl.int64)
    ep_drive = epf_drive(ep_p)
    ep_speed = epf_norm(ep_p)
    ep_log = ep_log + ep_b.to(tl.int64) * ep_room * (EPR_HEAD + EP_BLOCK * EPR_LANE)
    ep_lam = tl.zeros_like(ep_x_init)
    ep_dp = tl.zeros_like(ep_p)
    ep_base = tl.load(ep_counts + ep_row, mask=ep_live, other=0)
    ep_err = ep_b * 0
    for ep_back in range(0, ep_T):
        ep_n = ep_T - 1 - ep_back
        if ep_err == 0:
            ep_at = ((tl.maximum(ep_n - 1, 0) * ep_B + ep_b).to(tl.int64) * ep_N + ep_lanes) * NS  # (n = 0: x_init)
            ep_start = tl.load(ep_trace + ep_at[:, None] + ep_cs, mask=ep_live[:, None] & (ep_cs < NS), other=0.0)
            ep_start = tl.where(ep_n > 0, ep_start, ep_x_init)
            ep_x_end, ep_count, ep_err, ep_nit = epr_interval(
                ep_start, ep_n, ep_b, ep_p, ep_drive, tl.zeros_like(ep_base), ep_err, ep_b * 0, ep_ev_time,
                ep_ev_index, ep_firsts, ep_weight_t, ep_v_t, ep_N, ep_M, ep_K, ep_T, ep_dt, ep_lanes, ep_live,
                ep_log, 0, ep_log, ep_room, True, EP_BLOCK)
            tl.debug_barrier()  # the log written above is read below, by other threads of the program
            ep_base = ep_base - ep_count
            if EP_HAS_TRACE_GRAD:
                ep_at = ((ep_n * ep_B + ep_b).to(tl.int64) * ep_N + ep_lanes) * NS
                ep_lam += tl.load(ep_grad_trace + ep_at[:, None] + ep_cs, mask=ep_live[:, None] & (ep_cs < NS),
                                  other=0.0)
            ep_cur = (ep_n + 1) * ep_dt + 0.0
            ep_m = tl.where(ep_err == 0, ep_nit - 1, -1)
            while ep_m >= 0:
                # the instant's states (its last item), lambda flowed back to its time
                ep_s_kind, ep_t, ep_s_j, ep_s_event, ep_xs, ep_s_a, ep_s_c = epr_item(ep_log, ep_m, ep_lanes, ep_live,
                                                                                     EP_BLOCK)
                ep_lam, ep_dp = eph_flow_back(ep_xs, ep_lam, ep_dp, tl.zeros_like(ep_speed) + (ep_cur - ep_t), ep_p,
                                              ep_speed, ep_live, ep_nodes, ep_z, ep_w, ep_few_nodes, ep_few_z,
                                              ep_few_w, ep_few_reach)
                ep_cur = ep_t
                ep_m -= 1
                ep_time_error = ep_t * 0.0  # dL/dt of the instant's time, summed over its items
                ep_going = ep_m >= 0
                while ep_going:
                    ep_kind, ep_t_item, ep_j, ep_event, ep_xi, ep_a, ep_c = epr_item(ep_log, ep_m, ep_lanes, ep_live,
                                                                             EP_BLOCK)
                    ep_is_event = (ep_kind == EPR_JUMP) & (ep_event >= 0)
                    if ep_kind == EPR_JUMP:  # every lane's jump: dL/dw of each lane's weight, the time errors
                        ep_d_w, ep_j_terms, ep_j_error = epf_input_adjoint(ep_xi, ep_lam, ep_a, ep_p)
                        ep_time_error += tl.sum(tl.where(ep_live, ep_j_error, 0.0), 0)
                        ep_dp += tl.where(ep_live[:, None], ep_j_terms, 0.0)
                        if ep_is_event:  # an input event's jump: dL/dW and the error of its spike time
                            ep_index = tl.load(ep_ev_index + ep_b * ep_M + ep_event)
                            tl.atomic_add(ep_d_weight + ep_lanes * ep_I + ep_index // ep_K, ep_d_w, mask=ep_live)
                            tl.atomic_add(ep_d_times + ep_b * ep_I * ep_K + ep_index, ep_time_error)
                        # a wave's jump: dL/dV of its spikers' columns
                        ep_rest = ep_live & (ep_c > 0.5) & (ep_lanes * 0 + ep_event < 0)
                        while _any(ep_rest):
                            ep_k = tl.min(tl.where(ep_rest, ep_lanes, EP_BLOCK), 0)
                            tl.atomic_add(ep_d_v_t + ep_k.to(tl.int64) * ep_N + ep_lanes, ep_d_w, mask=ep_live)
                            ep_rest = ep_rest & (ep_lanes != ep_k)
                    elif ep_kind == EPR_RESETS:  # a wave's resets (their time errors join the instant's)
                        ep_resets = ep_live & (ep_c >= 0)
                        ep_own = epr_own_errors(ep_errors, ep_row, ep_width, ep_base, ep_c, ep_resets, EP_HAS_ERRORS)
                        ep_r_out, ep_r_terms = epf_reset_vjp(ep_xi, ep_lam, ep_p)
                        ep_post = epf_reset(ep_xi, ep_p)
                        ep_r_error = tl.sum(ep_r_out * epf_rate(ep_xi, ep_p) - ep_lam * epf_rate(ep_post, ep_p), 1)
                        ep_time_error += tl.sum(tl.where(ep_resets, ep_r_error + ep_own, 0.0), 0)
                        ep_lam = tl.where(ep_resets[:, None], ep_r_out, ep_lam)
                        ep_dp += tl.where(ep_resets[:, None], ep_r_terms, 0.0)
                    elif ep_kind == EPR_CROSS:  # the crossing that began the instant takes its time error
                        ep_cross = ep_live & (ep_lanes == ep_j)
                        ep_own = epr_own_errors(ep_errors, ep_row, ep_width, ep_base, ep_c, ep_cross, EP_HAS_ERRORS)
                        ep_c_out, ep_c_terms = epf_spike_adjoint(ep_xi, ep_lam, ep_own + ep_time_error, ep_p)
                        ep_lam = tl.where(ep_cross[:, None], ep_c_out, ep_lam)
                        ep_dp += tl.where(ep_cross[:, None], ep_c_terms, 0.0)
                    ep_m -= 1
                    ep_going = (ep_m >= 0) & (ep_kind != EPR_CROSS) & (ep_is_event == 0)
            ep_lam, ep_dp = eph_flow_back(ep_start, ep_lam, ep_dp, tl.zeros_like(ep_speed) + (ep_cur - ep_n * ep_dt),
                                          ep_p, ep_speed, ep_live, ep_nodes, ep_z, ep_w, ep_few_nodes, ep_few_z,
                                          ep_few_w, ep_few_reach)
    ep_cp = tl.arange(0, PP)[None, :]
    tl.store(ep_d_params + ep_row[:, None] * NP + ep_cp, ep_dp, mask=ep_live[:, None] & (ep_cp < NP))
    tl.store(ep_lam0 + ep_row[:, None] * NS + ep_cs, ep_lam, mask=ep_live[:, None] & (ep_cs < NS))
    tl.atomic_max(ep_status, ep_err)
