/* EventProp for a recurrent layer whose connections have delays (D [N, N], D[j, k] >= 0: neuron k's spike at t
   reaches neuron j at t + D[j, k] with weight V[j, k]), with the algorithm of the torch reference
   (flexgen.launch.eventprop_recurrent_delays), on c_eventprop_recurrent.h's run and log: one sample at a time, in
   its global time order, its pending arrivals in a heap (by time, then in the order they were sent; those at or
   after the end of the window are not queued).
   Forward: the sample's next event is the earliest of its next input event or grid point, its next pending
   arrival and the first crossing before them (bracketed as in epr_advance); a crossing fires, resets and queues
   its neuron's N arrivals; all the arrivals of one time jump together (summed per neuron), the neurons carried to
   g >= 0 fire at that time, reset and queue theirs (a neuron carried over again at a time it fired: EP_TWICE).
   At one time pending arrivals run before an input event; a grid point's states are recorded last.
   Backward: the sample's forward again for its spike times; then each grid interval, the last first, runs again
   from the trace with the arrivals its earlier spikes left pending (rebuilt from those spike times) into a log,
   walked backwards: exp(A^T h) and the parameter integrals between the logged states, the spike adjoints of
   crossings, the resets of carried spikes, the jumps (dL/dW, dL/dV); an input event's errors go to its input
   time, an arrival's (its neuron's, shared by the arrivals there) to dL/dD[j, k] and to the presynaptic spike,
   which holds it (`held`, by its slot) until the walk reaches it. */
#define EPD_GRID 4  /* a logged item beyond c_eventprop_recurrent.h's kinds: the states at a grid point */

typedef struct {
    scalar_t epd_t;
    int64_t epd_seq, epd_j, epd_k, epd_slot;  /* the order it was sent, its neuron, the spiking neuron, its slot */
} epd_arrival_t;

typedef struct {  /* one sample's run with delays: epr_run_t's, the pending arrivals and each neuron's last spike */
    epr_run_t *epd_r;
    const scalar_t *epd_D;
    scalar_t epd_end;
    scalar_t *epd_last;     /* [N] */
    epd_arrival_t *epd_heap;
    int64_t epd_n, epd_max, epd_sent;
    int64_t *epd_group;     /* the arrivals of one time: (j, k, slot) each */
    int64_t epd_group_max;
} epd_run_t;

static int epd_before(const epd_arrival_t *ep_a, const epd_arrival_t *ep_b) {
    return ep_a->epd_t < ep_b->epd_t || (ep_a->epd_t == ep_b->epd_t && ep_a->epd_seq < ep_b->epd_seq);
}

static int epd_push(epd_run_t *ep_q, epd_arrival_t ep_a) {
    epd_arrival_t *ep_heap = eph_room(ep_q->epd_heap, &ep_q->epd_max, ep_q->epd_n + 1, sizeof(epd_arrival_t));
    if (ep_heap == NULL)
        return EP_NO_MEMORY;
    ep_q->epd_heap = ep_heap;
    int64_t ep_i = ep_q->epd_n++;
    while (ep_i > 0 && epd_before(&ep_a, &ep_q->epd_heap[(ep_i - 1) / 2])) {
        ep_q->epd_heap[ep_i] = ep_q->epd_heap[(ep_i - 1) / 2];
        ep_i = (ep_i - 1) / 2;
    }
    ep_q->epd_heap[ep_i] = ep_a;
    return EP_OK;
}

static epd_arrival_t epd_pop(epd_run_t *ep_q) {
    epd_arrival_t *ep_h = ep_q->epd_heap, ep_top = ep_h[0], ep_last = ep_h[--ep_q->epd_n];
    int64_t ep_i = 0;
    for (;;) {
        int64_t ep_c = 2 * ep_i + 1;
        if (ep_c >= ep_q->epd_n)
            break;
        if (ep_c + 1 < ep_q->epd_n && epd_before(&ep_h[ep_c + 1], &ep_h[ep_c]))
            ++ep_c;
        if (!epd_before(&ep_h[ep_c], &ep_last))
            break;
        ep_h[ep_i] = ep_h[ep_c];
        ep_i = ep_c;
    }
    if (ep_q->epd_n > 0)
        ep_h[ep_i] = ep_last;
    return ep_top;
}

static scalar_t epd_next(const epd_run_t *ep_q) {
    return ep_q->epd_n ? ep_q->epd_heap[0].epd_t : INFINITY;
}

/* queue the arrivals of neuron k's spike (its slot) at t */
static int epd_send(epd_run_t *ep_q, int64_t ep_k, int64_t ep_slot, scalar_t ep_t) {
    const int64_t ep_N = ep_q->epd_r->epr_L->ep_N;
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
        const epd_arrival_t ep_a = {ep_t + ep_q->epd_D[ep_j * ep_N + ep_k], ep_q->epd_sent, ep_j, ep_k, ep_slot};
        if (ep_a.epd_t < ep_q->epd_end) {
            ++ep_q->epd_sent;
            if (epd_push(ep_q, ep_a) != EP_OK)
                return EP_NO_MEMORY;
        }
    }
    return EP_OK;
}

/* the states now, logged (kind EPR_STATE, or EPD_GRID with the grid point n in epr_slot) */
static int epd_state(epd_run_t *ep_q, int ep_kind, int64_t ep_n) {
    epr_run_t *ep_r = ep_q->epd_r;
    const int64_t ep_size = ep_r->epr_L->ep_N * EP_NS;
    scalar_t *ep_d;
    if (EPR_LOG(ep_r, ep_d, ep_kind, ep_r->epr_cur, -1, ep_n, ep_size))
        return EP_NO_MEMORY;
    if (ep_d != NULL)
        memcpy(ep_d, ep_r->epr_x, (size_t)ep_size * sizeof(scalar_t));
    return EP_OK;
}

/* x += w b (w: epr_w) of every neuron now, logged with the input event (event >= 0) or the m arrivals of
   epd_group; the neurons it carries over fire, reset and queue their arrivals; then the states, logged */
static int epd_jump(epd_run_t *ep_q, int64_t ep_m, int64_t ep_event) {
    epr_run_t *ep_r = ep_q->epd_r;
    const int64_t ep_N = ep_r->epr_L->ep_N;
    const scalar_t ep_t = ep_r->epr_cur;
    scalar_t *ep_d;
    if (EPR_LOG(ep_r, ep_d, EPR_JUMP, ep_t, -1, -1, ep_N * EP_NS + ep_N + 3 * ep_m))
        return EP_NO_MEMORY;
    if (ep_d != NULL) {
        epr_item_t *ep_item = &ep_r->epr_items[ep_r->epr_n_items - 1];
        ep_item->epr_n = ep_m;
        ep_item->epr_event = ep_event;
        memcpy(ep_d, ep_r->epr_x, (size_t)(ep_N * EP_NS) * sizeof(scalar_t));
        memcpy(ep_d + ep_N * EP_NS, ep_r->epr_w, (size_t)ep_N * sizeof(scalar_t));
        for (int64_t ep_a = 0; ep_a < 3 * ep_m; ++ep_a)
            ep_d[ep_N * EP_NS + ep_N + ep_a] = (scalar_t)ep_q->epd_group[ep_a];
    }
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
        for (int ep_k = 0; ep_k < EP_NS; ++ep_k)
            ep_r->epr_x[ep_j * EP_NS + ep_k] += ep_r->epr_w[ep_j] * ep_r->epr_drive[ep_j * EP_NS + ep_k];
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
        scalar_t *ep_x = ep_r->epr_x + ep_j * EP_NS, ep_mid[EP_NS];
        if (eph_g(ep_x, epr_p(ep_r, ep_j)) < 0)
            continue;
        if (ep_event < 0 && ep_q->epd_last[ep_j] == ep_t)
            return EP_TWICE;
        const int64_t ep_slot = epr_spike(ep_r, ep_j, ep_t);
        if (EPR_LOG(ep_r, ep_d, EPR_RESET, ep_t, ep_j, ep_slot, EP_NS))
            return EP_NO_MEMORY;
        if (ep_d != NULL)
            memcpy(ep_d, ep_x, sizeof ep_mid);
        memcpy(ep_mid, ep_x, sizeof ep_mid);
        epf_reset(ep_mid, epr_p(ep_r, ep_j), ep_x);
        if (eph_g(ep_x, epr_p(ep_r, ep_j)) >= 0)
            return EP_RESET_ABOVE;
        ep_q->epd_last[ep_j] = ep_t;
        if (epd_send(ep_q, ep_j, ep_slot, ep_t) != EP_OK)
            return EP_NO_MEMORY;
    }
    return epd_state(ep_q, EPR_STATE, -1);
}

/* every arrival pending now, together */
static int epd_arrive(epd_run_t *ep_q) {
    epr_run_t *ep_r = ep_q->epd_r;
    const int64_t ep_N = ep_r->epr_L->ep_N;
    int64_t ep_m = 0;
    memset(ep_r->epr_w, 0, (size_t)ep_N * sizeof(scalar_t));
    while (ep_q->epd_n && ep_q->epd_heap[0].epd_t == ep_r->epr_cur) {
        int64_t *ep_group = eph_room(ep_q->epd_group, &ep_q->epd_group_max, 3 * (ep_m + 1), sizeof(int64_t));
        if (ep_group == NULL)
            return EP_NO_MEMORY;
        ep_q->epd_group = ep_group;
        const epd_arrival_t ep_a = epd_pop(ep_q);
        ep_q->epd_group[3 * ep_m] = ep_a.epd_j;
        ep_q->epd_group[3 * ep_m + 1] = ep_a.epd_k;
        ep_q->epd_group[3 * ep_m + 2] = ep_a.epd_slot;
        ep_r->epr_w[ep_a.epd_j] += ep_r->epr_V[ep_a.epd_j * ep_N + ep_a.epd_k];
        ++ep_m;
    }
    return epd_jump(ep_q, ep_m, -1);
}

/* every neuron from cur towards target: to the sample's earliest crossing before it (that neuron fires, resets
   and queues its arrivals), or to target */
static int epd_advance(epd_run_t *ep_q, scalar_t ep_target) {
    epr_run_t *ep_r = ep_q->epd_r;
    int64_t ep_win, ep_slot;
    const int ep_crossed = epr_cross(ep_r, ep_target, &ep_win, &ep_slot);
    if (ep_crossed != EP_OK || ep_win < 0)
        return ep_crossed;
    const scalar_t ep_t = ep_r->epr_cur;
    ep_q->epd_last[ep_win] = ep_t;
    if (epd_send(ep_q, ep_win, ep_slot, ep_t) != EP_OK)
        return EP_NO_MEMORY;
    return epd_state(ep_q, EPR_STATE, -1);
}

/* from cur to t: crossings and pending arrivals on the way, and those at t */
static int epd_reach(epd_run_t *ep_q, scalar_t ep_t) {
    epr_run_t *ep_r = ep_q->epd_r;
    for (;;) {
        const scalar_t ep_pending = epd_next(ep_q), ep_target = ep_t <= ep_pending ? ep_t : ep_pending;
        int ep_rc;
        if (ep_r->epr_cur < ep_target)
            ep_rc = epd_advance(ep_q, ep_target);
        else if (ep_pending == ep_r->epr_cur)
            ep_rc = epd_arrive(ep_q);
        else
            return EP_OK;
        if (ep_rc != EP_OK)
            return ep_rc;
    }
}

/* the sample from grid interval n_begin (its states in epr_x, its first input event *e) through n_end - 1, the
   trace into `trace` (if not NULL) */
static int epd_run(epd_run_t *ep_q, int64_t ep_n_begin, int64_t ep_n_end, int64_t *ep_e, scalar_t *ep_trace) {
    epr_run_t *ep_r = ep_q->epd_r;
    const ep_layer_t *ep_L = ep_r->epr_L;
    const int64_t ep_N = ep_L->ep_N, ep_b = ep_r->epr_b;
    const scalar_t *ep_times = ep_L->ep_ev_time + ep_b * ep_L->ep_M;
    const int64_t *ep_index = ep_L->ep_ev_index + ep_b * ep_L->ep_M, ep_count = ep_L->ep_ev_count[ep_b];
    ep_r->epr_cur = (scalar_t)ep_n_begin * ep_L->ep_dt;
    int ep_rc = epd_state(ep_q, EPR_STATE, -1);
    for (int64_t ep_n = ep_n_begin; ep_n < ep_n_end && ep_rc == EP_OK; ++ep_n) {
        const scalar_t ep_grid = (scalar_t)(ep_n + 1) * ep_L->ep_dt;
        for (; ep_rc == EP_OK && *ep_e < ep_count && ep_times[*ep_e] <= ep_grid; ++*ep_e) {
            ep_rc = epd_reach(ep_q, ep_times[*ep_e]);
            for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
                ep_r->epr_w[ep_j] = ep_L->ep_weight[ep_j * ep_L->ep_I + ep_index[*ep_e] / ep_L->ep_K];
            if (ep_rc == EP_OK)
                ep_rc = epd_jump(ep_q, 0, *ep_e);
        }
        if (ep_rc == EP_OK)
            ep_rc = epd_reach(ep_q, ep_grid);
        if (ep_rc == EP_OK && ep_trace != NULL)
            memcpy(ep_trace + (ep_n * ep_L->ep_B + ep_b) * ep_N * EP_NS, ep_r->epr_x,
                   (size_t)(ep_N * EP_NS) * sizeof(scalar_t));
        if (ep_rc == EP_OK)
            ep_rc = epd_state(ep_q, EPD_GRID, ep_n);
    }
    return ep_rc;
}

static epd_run_t *epd_open(const ep_layer_t *ep_L, const scalar_t *ep_V, const scalar_t *ep_D, int64_t ep_b) {
    epd_run_t *ep_q = calloc(1, sizeof(epd_run_t));
    if (ep_q == NULL)
        return NULL;
    ep_q->epd_r = epr_open(ep_L, ep_V, ep_b);
    ep_q->epd_last = malloc((size_t)ep_L->ep_N * sizeof(scalar_t));
    if (ep_q->epd_r == NULL || ep_q->epd_last == NULL) {
        epr_close(ep_q->epd_r);
        free(ep_q->epd_last);
        free(ep_q);
        return NULL;
    }
    for (int64_t ep_j = 0; ep_j < ep_L->ep_N; ++ep_j)
        ep_q->epd_last[ep_j] = -INFINITY;
    memcpy(ep_q->epd_r->epr_x, ep_L->ep_initial, (size_t)(ep_L->ep_N * EP_NS) * sizeof(scalar_t));
    ep_q->epd_D = ep_D;
    ep_q->epd_end = (scalar_t)ep_L->ep_T * ep_L->ep_dt;
    return ep_q;
}

static void epd_close(epd_run_t *ep_q) {
    if (ep_q == NULL)
        return;
    epr_close(ep_q->epd_r);
    free(ep_q->epd_last);
    free(ep_q->epd_heap);
    free(ep_q->epd_group);
    free(ep_q);
}

int eventprop_recurrent_delayed_forward(int ep_threads, ep_layer_t ep_L, const scalar_t *ep_V, const scalar_t *ep_D,
                                        scalar_t *ep_out, int64_t ep_cap, int64_t *ep_counts, scalar_t *ep_trace) {
    int ep_status = EP_OK;
#pragma omp parallel for num_threads(ep_threads) schedule(dynamic, 1) reduction(max : ep_status)
    for (int64_t ep_b = 0; ep_b < ep_L.ep_B; ++ep_b) {
        epd_run_t *ep_q = epd_open(&ep_L, ep_V, ep_D, ep_b);
        int ep_rc = ep_q == NULL ? EP_NO_MEMORY : EP_OK;
        if (ep_rc == EP_OK) {
            ep_rc = epr_start(ep_q->epd_r, ep_out, ep_cap);
            int64_t ep_e = 0;
            if (ep_rc == EP_OK)
                ep_rc = epd_run(ep_q, 0, ep_L.ep_T, &ep_e, ep_trace);
            ep_rc = epr_finish(ep_q->epd_r, ep_rc, ep_counts);
        }
        epd_close(ep_q);
        ep_status = ep_rc > ep_status ? ep_rc : ep_status;
    }
    return ep_status;
}

/* the start of grid interval n in the backward, from the forward's results: the states recorded at its start, each
   neuron's spikes before it (counts and latest time) and the arrivals they left pending (spikes: [N, hw]) */
static int epd_restart(epd_run_t *ep_q, int64_t ep_n, const scalar_t *ep_trace, const scalar_t *ep_spikes,
                       int64_t ep_hw, const int64_t *ep_counts) {
    epr_run_t *ep_r = ep_q->epd_r;
    const ep_layer_t *ep_L = ep_r->epr_L;
    const int64_t ep_N = ep_L->ep_N, ep_b = ep_r->epr_b, ep_size = ep_N * EP_NS;
    const scalar_t ep_start = (scalar_t)ep_n * ep_L->ep_dt;
    const scalar_t *ep_from = ep_n ? ep_trace + ((ep_n - 1) * ep_L->ep_B + ep_b) * ep_size : ep_L->ep_initial;
    memcpy(ep_r->epr_x, ep_from, (size_t)ep_size * sizeof(scalar_t));
    ep_q->epd_n = ep_q->epd_sent = 0;
    for (int64_t ep_k = 0; ep_k < ep_N; ++ep_k) {
        int64_t ep_s = 0;
        ep_q->epd_last[ep_k] = -INFINITY;
        for (; ep_s < ep_counts[ep_b * ep_N + ep_k] && ep_spikes[ep_k * ep_hw + ep_s] <= ep_start; ++ep_s) {
            const scalar_t ep_t = ep_spikes[ep_k * ep_hw + ep_s];
            ep_q->epd_last[ep_k] = ep_t;
            for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
                const epd_arrival_t ep_a = {ep_t + ep_q->epd_D[ep_j * ep_N + ep_k], ep_q->epd_sent, ep_j, ep_k, ep_s};
                if (ep_a.epd_t > ep_start && ep_a.epd_t < ep_q->epd_end) {
                    ++ep_q->epd_sent;
                    if (epd_push(ep_q, ep_a) != EP_OK)
                        return EP_NO_MEMORY;
                }
            }
        }
        ep_r->epr_count[ep_k] = ep_s;  /* the slots go on from there */
    }
    ep_r->epr_n_items = ep_r->epr_n_data = 0;
    return EP_OK;
}

/* the adjoint back through the logged items of one grid interval, the last first; scratch: lam [N, NS], speed,
   row_error, weight [N] each, held [N, hw]; cnt [N]; *cur: the time lam is at */
static void epd_walk_back(epd_run_t *ep_q, scalar_t *ep_lam, scalar_t *ep_cur, int64_t ep_hw, int64_t *ep_cnt,
                          const scalar_t *ep_grad_trace, const scalar_t *ep_errors, int64_t ep_width,
                          const ep_quadrature_t *ep_qd, scalar_t *ep_d_times, scalar_t *ep_d_w, scalar_t *ep_d_v,
                          scalar_t *ep_d_d, scalar_t *ep_dp) {
    epr_run_t *ep_r = ep_q->epd_r;
    const ep_layer_t *ep_L = ep_r->epr_L;
    const int64_t ep_N = ep_L->ep_N, ep_b = ep_r->epr_b, ep_row0 = ep_b * ep_N, ep_size = ep_N * EP_NS;
    scalar_t *ep_speed = ep_lam + ep_size, *ep_row_error = ep_speed + ep_N, *ep_weight = ep_row_error + ep_N;
    scalar_t *ep_held = ep_weight + ep_N, ep_out[EP_NS], ep_terms[EP_NP + 1];
    for (int64_t ep_m = ep_r->epr_n_items - 1; ep_m >= 0; --ep_m) {
        const epr_item_t *ep_item = &ep_r->epr_items[ep_m];
        const scalar_t *ep_d = ep_r->epr_data + ep_item->epr_at;
        const int64_t ep_j = ep_item->epr_j;
        scalar_t *ep_l = ep_lam + ep_j * EP_NS;
        const scalar_t ep_error = ep_j < 0 ? 0 : ep_held[ep_j * ep_hw + ep_item->epr_slot]
            + (ep_errors != NULL ? ep_errors[(ep_row0 + ep_j) * ep_width + ep_item->epr_slot] : 0);
        if (ep_item->epr_kind == EPR_STATE || ep_item->epr_kind == EPD_GRID) {
            if (*ep_cur > ep_item->epr_t)
                for (int64_t ep_i = 0; ep_i < ep_N; ++ep_i)
                    eph_flow_back(ep_d + ep_i * EP_NS, ep_lam + ep_i * EP_NS, *ep_cur - ep_item->epr_t,
                                  epr_p(ep_r, ep_i), ep_speed[ep_i], ep_qd, ep_dp + (ep_row0 + ep_i) * EP_NP);
            *ep_cur = ep_item->epr_t;
            if (ep_item->epr_kind == EPD_GRID && ep_grad_trace != NULL)
                for (int64_t ep_k = 0; ep_k < ep_size; ++ep_k)
                    ep_lam[ep_k] += ep_grad_trace[(ep_item->epr_slot * ep_L->ep_B + ep_b) * ep_size + ep_k];
        } else if (ep_item->epr_kind == EPR_CROSS) {
            epf_spike_adjoint(ep_d, ep_l, ep_error, epr_p(ep_r, ep_j), ep_out, ep_terms);
            eph_add(ep_dp + (ep_row0 + ep_j) * EP_NP, ep_terms);
            memcpy(ep_l, ep_out, sizeof ep_out);
        } else if (ep_item->epr_kind == EPR_RESET) {
            const scalar_t *ep_p = epr_p(ep_r, ep_j);
            scalar_t ep_f_mid[EP_NS], ep_post[EP_NS], ep_f_post[EP_NS];
            epf_reset_vjp(ep_d, ep_l, ep_p, ep_out, ep_terms);
            epf_rate(ep_d, ep_p, ep_f_mid);
            epf_reset(ep_d, ep_p, ep_post);
            epf_rate(ep_post, ep_p, ep_f_post);
            for (int ep_k = 0; ep_k < EP_NS; ++ep_k)
                ep_row_error[ep_j] += ep_out[ep_k] * ep_f_mid[ep_k] - ep_l[ep_k] * ep_f_post[ep_k];
            ep_row_error[ep_j] += ep_error;
            eph_add(ep_dp + (ep_row0 + ep_j) * EP_NP, ep_terms);
            memcpy(ep_l, ep_out, sizeof ep_out);
        } else {  /* a jump of every neuron: an input event's (event >= 0) or the arrivals of one time */
            const int64_t ep_event = ep_item->epr_event;
            const int64_t ep_at = ep_event >= 0 ? ep_L->ep_ev_index[ep_b * ep_L->ep_M + ep_event] : -1;
            scalar_t ep_total = 0;
            for (int64_t ep_i = 0; ep_i < ep_N; ++ep_i) {
                scalar_t ep_event_error;
                epf_input_adjoint(ep_d + ep_i * EP_NS, ep_lam + ep_i * EP_NS, ep_d[ep_size + ep_i], epr_p(ep_r, ep_i),
                                  &ep_weight[ep_i], ep_terms, &ep_event_error);
                eph_add(ep_dp + (ep_row0 + ep_i) * EP_NP, ep_terms);
                ep_row_error[ep_i] += ep_event_error;
                ep_total += ep_row_error[ep_i];
                if (ep_event >= 0)
                    ep_d_w[ep_i * ep_L->ep_I + ep_at / ep_L->ep_K] += ep_weight[ep_i];
            }
            if (ep_event >= 0)
                ep_d_times[ep_b * ep_L->ep_I * ep_L->ep_K + ep_at] += ep_total;
            const scalar_t *ep_arrivals = ep_d + ep_size + ep_N;
            memset(ep_cnt, 0, (size_t)ep_N * sizeof(int64_t));
            for (int64_t ep_a = 0; ep_a < ep_item->epr_n; ++ep_a)
                ++ep_cnt[(int64_t)ep_arrivals[3 * ep_a]];
            for (int64_t ep_a = 0; ep_a < ep_item->epr_n; ++ep_a) {
                const int64_t ep_to = (int64_t)ep_arrivals[3 * ep_a], ep_from = (int64_t)ep_arrivals[3 * ep_a + 1];
                const scalar_t ep_share = ep_row_error[ep_to] / (scalar_t)ep_cnt[ep_to];
                ep_d_v[ep_to * ep_N + ep_from] += ep_weight[ep_to];
                ep_d_d[ep_to * ep_N + ep_from] += ep_share;
                ep_held[ep_from * ep_hw + (int64_t)ep_arrivals[3 * ep_a + 2]] += ep_share;
            }
            memset(ep_row_error, 0, (size_t)ep_N * sizeof(scalar_t));
        }
    }
}

/* one sample's adjoint: its forward again for its spike times, then each grid interval, the last first, run again
   from its recorded start into a log and walked back; lam0: lambda at t = 0 */
static int epd_sample_adjoint(epd_run_t *ep_q, const scalar_t *ep_trace, const int64_t *ep_counts,
                              const scalar_t *ep_grad_trace, const scalar_t *ep_errors, int64_t ep_width,
                              const ep_quadrature_t *ep_qd, scalar_t *ep_d_times, scalar_t *ep_d_w,
                              scalar_t *ep_d_v, scalar_t *ep_d_d, scalar_t *ep_dp, scalar_t *ep_lam0) {
    epr_run_t *ep_r = ep_q->epd_r;
    const ep_layer_t *ep_L = ep_r->epr_L;
    const int64_t ep_N = ep_L->ep_N, ep_b = ep_r->epr_b, ep_row0 = ep_b * ep_N, ep_size = ep_N * EP_NS;
    int64_t ep_hw = 1;  /* spike slots per neuron */
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
        ep_hw = ep_counts[ep_row0 + ep_j] > ep_hw ? ep_counts[ep_row0 + ep_j] : ep_hw;
    scalar_t *ep_lam = calloc((size_t)(ep_size + 3 * ep_N + 2 * ep_N * ep_hw), sizeof(scalar_t));
    int64_t *ep_cnt = malloc((size_t)(ep_N + ep_L->ep_T + 1) * sizeof(int64_t));
    if (ep_lam == NULL || ep_cnt == NULL) {
        free(ep_lam);
        free(ep_cnt);
        return EP_NO_MEMORY;
    }
    scalar_t *ep_speed = ep_lam + ep_size, *ep_spikes = ep_speed + 3 * ep_N + ep_N * ep_hw;
    int64_t *ep_first = ep_cnt + ep_N;
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
        ep_speed[ep_j] = eph_norm(epr_p(ep_r, ep_j));
    for (int64_t ep_k = 0; ep_k < ep_N * ep_hw; ++ep_k)
        ep_spikes[ep_k] = INFINITY;
    ep_r->epr_out = ep_spikes;
    ep_r->epr_cap = ep_hw;
    int64_t ep_e = 0;
    int ep_rc = epd_run(ep_q, 0, ep_L->ep_T, &ep_e, NULL);
    ep_r->epr_out = NULL;
    ep_r->epr_logging = 1;
    eph_firsts(ep_L, ep_b, ep_first);
    scalar_t ep_cur = (scalar_t)ep_L->ep_T * ep_L->ep_dt;
    for (int64_t ep_n = ep_L->ep_T - 1; ep_n >= 0 && ep_rc == EP_OK; --ep_n) {
        ep_rc = epd_restart(ep_q, ep_n, ep_trace, ep_spikes, ep_hw, ep_counts);
        ep_e = ep_first[ep_n];
        if (ep_rc == EP_OK)
            ep_rc = epd_run(ep_q, ep_n, ep_n + 1, &ep_e, NULL);
        if (ep_rc == EP_OK)
            epd_walk_back(ep_q, ep_lam, &ep_cur, ep_hw, ep_cnt, ep_grad_trace, ep_errors, ep_width, ep_qd,
                          ep_d_times, ep_d_w, ep_d_v, ep_d_d, ep_dp);
    }
    memcpy(ep_lam0 + ep_row0 * EP_NS, ep_lam, (size_t)ep_size * sizeof(scalar_t));
    free(ep_lam);
    free(ep_cnt);
    return ep_rc;
}

int eventprop_recurrent_delayed_backward(int ep_threads, ep_layer_t ep_L, const scalar_t *ep_V, const scalar_t *ep_D,
                                         const scalar_t *ep_trace, const int64_t *ep_counts,
                                         const scalar_t *ep_grad_trace, const scalar_t *ep_errors, int64_t ep_width,
                                         ep_quadrature_t ep_qd, scalar_t *ep_d_times, scalar_t *ep_d_w,
                                         scalar_t *ep_d_v, scalar_t *ep_d_d, scalar_t *ep_d_params,
                                         scalar_t *ep_lam0) {
    int ep_status = EP_OK;
#pragma omp parallel num_threads(ep_threads) reduction(max : ep_status)
    {
        int ep_thread = 0;
#ifdef _OPENMP
        ep_thread = omp_get_thread_num();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t ep_b = 0; ep_b < ep_L.ep_B; ++ep_b) {
            epd_run_t *ep_q = epd_open(&ep_L, ep_V, ep_D, ep_b);
            const int64_t ep_nn = ep_L.ep_N * ep_L.ep_N;
            int ep_rc = ep_q == NULL ? EP_NO_MEMORY
                : epd_sample_adjoint(ep_q, ep_trace, ep_counts, ep_grad_trace, ep_errors, ep_width, &ep_qd,
                                     ep_d_times, ep_d_w + ep_thread * ep_L.ep_N * ep_L.ep_I,
                                     ep_d_v + ep_thread * ep_nn, ep_d_d + ep_thread * ep_nn, ep_d_params, ep_lam0);
            epd_close(ep_q);
            ep_status = ep_rc > ep_status ? ep_rc : ep_status;
        }
    }
    return ep_status;
}
