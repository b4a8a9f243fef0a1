/* EventProp for a recurrent layer (recurrent weight V [N, N], V[j, k] from neuron k to neuron j), on the same
   printed functions and helpers as c_eventprop.h, with the algorithm of the torch reference
   (flexgen.launch.eventprop_recurrent): one sample at a time, its N neurons together in global time order.
   Forward: between two breakpoints (the sample's input events, the grid points) every neuron's first crossing is
   bracketed by EP_SAMPLES samples (none for a neuron whose bound, eph_quiet, shows that it cannot cross); the
   earliest (the lowest neuron on a tie) is found by Newton's method, all the
   sample's neurons follow the flow to it, the neuron fires and resets, and the instant runs in waves: the spikes
   of a wave send their jumps (summed) to every neuron, the neurons carried to g >= 0 fire at that time, reset and
   make the next wave (a neuron carried over again at the time it fired: EP_TWICE). An input event's jump starts
   its instant's wave 0 the same way.
   Backward: each sample's grid intervals last to first; an interval's forward is run again from the trace into a
   log of its instants (crossings, jumps, the resets of carried spikes, the states after each instant), which the
   adjoint walks backwards: exp(A^T h) and the parameter integrals between instants for every neuron, then each
   instant from its last wave: the resets (reset_vjp), the jumps (input_adjoint: dL/dV, dL/dW), their errors for
   the instant's time summed, which go to the input spike's time or into the crossing neuron's spike adjoint.
   Parallel over samples; weight gradients go to per-thread partial sums. */
#define EP_TWICE 5
#define EPR_CROSS 0
#define EPR_RESET 1
#define EPR_JUMP 2
#define EPR_STATE 3

typedef struct {  /* one logged step of an instant; its values at data[at...] */
    int epr_kind;
    scalar_t epr_t;
    int64_t epr_j, epr_slot, epr_at, epr_n, epr_event;  /* neuron, its spike's slot, data offset, spikers, event */
} epr_item_t;

typedef struct {  /* one sample's run: its states and scratch, where its spikes and its log go */
    const ep_layer_t *epr_L;
    const scalar_t *epr_V;
    int64_t epr_b;
    scalar_t epr_cur;
    scalar_t *epr_x, *epr_x1, *epr_drive, *epr_w;  /* [N, NS], [N, NS], [N, NS], [N] */
    int64_t *epr_first, *epr_spikers, *epr_count;   /* [N] each; count: this run's spikes per neuron */
    char *epr_fired;                                /* [N] */
    scalar_t *epr_out;                              /* the sample's output slots [N, cap], or NULL */
    int64_t epr_cap;
    int epr_logging;
    epr_item_t *epr_items;
    int64_t epr_n_items, epr_max_items;
    scalar_t *epr_data;
    int64_t epr_n_data, epr_max_data;
} epr_run_t;

static const scalar_t *epr_p(const epr_run_t *ep_r, int64_t ep_j) {
    return ep_r->epr_L->ep_params + ep_j * EP_NP;
}

/* a logged step with room for `size` values (NULL: out of memory, or no log is kept) */
static scalar_t *epr_log(epr_run_t *ep_r, int ep_kind, scalar_t ep_t, int64_t ep_j, int64_t ep_slot, int64_t ep_size) {
    if (!ep_r->epr_logging)
        return NULL;
    epr_item_t *ep_items = eph_room(ep_r->epr_items, &ep_r->epr_max_items, ep_r->epr_n_items + 1, sizeof(epr_item_t));
    if (ep_items == NULL)
        return NULL;
    ep_r->epr_items = ep_items;
    scalar_t *ep_data = eph_room(ep_r->epr_data, &ep_r->epr_max_data, ep_r->epr_n_data + ep_size, sizeof(scalar_t));
    if (ep_data == NULL)
        return NULL;
    ep_r->epr_data = ep_data;
    epr_item_t *ep_item = &ep_r->epr_items[ep_r->epr_n_items++];
    ep_item->epr_kind = ep_kind;
    ep_item->epr_t = ep_t;
    ep_item->epr_j = ep_j;
    ep_item->epr_slot = ep_slot;
    ep_item->epr_at = ep_r->epr_n_data;
    ep_item->epr_n = 0;
    ep_item->epr_event = -1;
    ep_r->epr_n_data += ep_size;
    return ep_r->epr_data + ep_item->epr_at;
}

#define EPR_LOG(ep_r, ep_dst, ...) \
    ((ep_dst) = epr_log(ep_r, __VA_ARGS__), (ep_r)->epr_logging && (ep_dst) == NULL)

/* neuron j fires at t: its slot (from this run's first) */
static int64_t epr_spike(epr_run_t *ep_r, int64_t ep_j, scalar_t ep_t) {
    const int64_t ep_slot = ep_r->epr_count[ep_j]++;
    if (ep_r->epr_out != NULL && ep_slot < ep_r->epr_cap)
        ep_r->epr_out[ep_j * ep_r->epr_cap + ep_slot] = ep_t;
    return ep_slot;
}

/* the jump x_j += w_j b_j of every neuron (w: epr_w), logged with the spikers (n of them; an input event: -1 and
   its index), then the neurons it carries over fire and reset; returns how many (in epr_spikers) or < 0 */
static int64_t epr_jump(epr_run_t *ep_r, scalar_t ep_t, int64_t ep_n, int64_t ep_event) {
    const int64_t ep_N = ep_r->epr_L->ep_N;
    scalar_t *ep_d;
    if (EPR_LOG(ep_r, ep_d, EPR_JUMP, ep_t, -1, -1, ep_N * EP_NS + ep_N + (ep_n > 0 ? ep_n : 0)))
        return -EP_NO_MEMORY;
    if (ep_d != NULL) {
        epr_item_t *ep_item = &ep_r->epr_items[ep_r->epr_n_items - 1];
        ep_item->epr_n = ep_n;
        ep_item->epr_event = ep_event;
        memcpy(ep_d, ep_r->epr_x, (size_t)(ep_N * EP_NS) * sizeof(scalar_t));
        memcpy(ep_d + ep_N * EP_NS, ep_r->epr_w, (size_t)ep_N * sizeof(scalar_t));
        for (int64_t ep_k = 0; ep_k < ep_n; ++ep_k)
            ep_d[ep_N * EP_NS + ep_N + ep_k] = (scalar_t)ep_r->epr_spikers[ep_k];
    }
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
        for (int ep_k = 0; ep_k < EP_NS; ++ep_k)
            ep_r->epr_x[ep_j * EP_NS + ep_k] += ep_r->epr_w[ep_j] * ep_r->epr_drive[ep_j * EP_NS + ep_k];
    int64_t ep_fired = 0;
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
        scalar_t *ep_x = ep_r->epr_x + ep_j * EP_NS, ep_mid[EP_NS];
        if (eph_g(ep_x, epr_p(ep_r, ep_j)) < 0)
            continue;
        if (ep_r->epr_fired[ep_j])
            return -EP_TWICE;
        const int64_t ep_slot = epr_spike(ep_r, ep_j, ep_t);
        if (EPR_LOG(ep_r, ep_d, EPR_RESET, ep_t, ep_j, ep_slot, EP_NS))
            return -EP_NO_MEMORY;
        if (ep_d != NULL)
            memcpy(ep_d, ep_x, sizeof ep_mid);
        memcpy(ep_mid, ep_x, sizeof ep_mid);
        epf_reset(ep_mid, epr_p(ep_r, ep_j), ep_x);
        if (eph_g(ep_x, epr_p(ep_r, ep_j)) >= 0)
            return -EP_RESET_ABOVE;
        ep_r->epr_fired[ep_j] = 1;
        ep_r->epr_spikers[ep_fired++] = ep_j;
    }
    return ep_fired;
}

/* the waves of an instant at t whose first n spikes (epr_spikers, reset) are given; then its states, logged */
static int epr_cascade(epr_run_t *ep_r, scalar_t ep_t, int64_t ep_n) {
    const int64_t ep_N = ep_r->epr_L->ep_N;
    while (ep_n > 0) {
        for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
            scalar_t ep_sum = 0;
            for (int64_t ep_k = 0; ep_k < ep_n; ++ep_k)
                ep_sum += ep_r->epr_V[ep_j * ep_N + ep_r->epr_spikers[ep_k]];
            ep_r->epr_w[ep_j] = ep_sum;
        }
        ep_n = epr_jump(ep_r, ep_t, ep_n, -1);
        if (ep_n < 0)
            return (int)-ep_n;
    }
    scalar_t *ep_d;
    if (EPR_LOG(ep_r, ep_d, EPR_STATE, ep_t, -1, -1, ep_N * EP_NS))
        return EP_NO_MEMORY;
    if (ep_d != NULL)
        memcpy(ep_d, ep_r->epr_x, (size_t)(ep_N * EP_NS) * sizeof(scalar_t));
    return EP_OK;
}

/* every neuron from cur towards target: to the sample's earliest crossing before it, where that neuron (*win, its
   spike's slot *slot) fires and resets, or to target (*win = -1) */
static int epr_cross(epr_run_t *ep_r, scalar_t ep_target, int64_t *ep_win, int64_t *ep_slot) {
    const int64_t ep_N = ep_r->epr_L->ep_N;
    const scalar_t ep_length = ep_target - ep_r->epr_cur;
    scalar_t ep_xs[EP_NS];
    int64_t ep_soonest = EP_SAMPLES;
    *ep_win = -1;
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
        const scalar_t *ep_x0 = ep_r->epr_x + ep_j * EP_NS, *ep_p = epr_p(ep_r, ep_j);
        ep_r->epr_first[ep_j] = EP_SAMPLES;
        if (eph_quiet(ep_x0, ep_p, ep_length)) {  /* no crossing on the piece: its end alone */
            epf_flow(ep_length, ep_x0, ep_p, ep_r->epr_x1 + ep_j * EP_NS);
            continue;
        }
        for (int ep_k = 0; ep_k < EP_SAMPLES && ep_k <= ep_soonest; ++ep_k) {
            epf_flow(((scalar_t)(ep_k + 1) / EP_SAMPLES) * ep_length, ep_x0, ep_p, ep_xs);
            if (eph_g(ep_xs, ep_p) >= 0) {
                ep_r->epr_first[ep_j] = ep_k;
                ep_soonest = ep_k < ep_soonest ? ep_k : ep_soonest;
                break;
            }
        }
        memcpy(ep_r->epr_x1 + ep_j * EP_NS, ep_xs, sizeof ep_xs);  /* at the end, where no neuron crosses */
    }
    if (ep_soonest == EP_SAMPLES) {
        memcpy(ep_r->epr_x, ep_r->epr_x1, (size_t)(ep_N * EP_NS) * sizeof(scalar_t));
        ep_r->epr_cur = ep_target;
        return EP_OK;
    }
    const scalar_t ep_lo = ep_soonest ? ((scalar_t)ep_soonest / EP_SAMPLES) * ep_length : 0;
    const scalar_t ep_hi = ((scalar_t)(ep_soonest + 1) / EP_SAMPLES) * ep_length;
    scalar_t ep_best = INFINITY;
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
        if (ep_r->epr_first[ep_j] == ep_soonest) {
            const scalar_t ep_root = eph_root(ep_r->epr_x + ep_j * EP_NS, epr_p(ep_r, ep_j), ep_lo, ep_hi);
            if (ep_root < ep_best) {
                ep_best = ep_root;
                *ep_win = ep_j;
            }
        }
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
        epf_flow(ep_best, ep_r->epr_x + ep_j * EP_NS, epr_p(ep_r, ep_j), ep_xs);
        memcpy(ep_r->epr_x + ep_j * EP_NS, ep_xs, sizeof ep_xs);
    }
    ep_r->epr_cur += ep_best;
    const scalar_t ep_t = ep_r->epr_cur;
    scalar_t *ep_x = ep_r->epr_x + *ep_win * EP_NS, ep_pre[EP_NS], *ep_d;
    memcpy(ep_pre, ep_x, sizeof ep_pre);
    *ep_slot = epr_spike(ep_r, *ep_win, ep_t);
    if (EPR_LOG(ep_r, ep_d, EPR_CROSS, ep_t, *ep_win, *ep_slot, EP_NS))
        return EP_NO_MEMORY;
    if (ep_d != NULL)
        memcpy(ep_d, ep_pre, sizeof ep_pre);
    epf_reset(ep_pre, epr_p(ep_r, *ep_win), ep_x);
    if (eph_g(ep_x, epr_p(ep_r, *ep_win)) >= 0)
        return EP_RESET_ABOVE;
    return EP_OK;
}

/* every neuron from cur to target, instant by instant at the sample's earliest crossings */
static int epr_advance(epr_run_t *ep_r, scalar_t ep_target) {
    const int64_t ep_N = ep_r->epr_L->ep_N;
    while (ep_r->epr_cur < ep_target) {
        int64_t ep_win, ep_slot;
        const int ep_crossed = epr_cross(ep_r, ep_target, &ep_win, &ep_slot);
        if (ep_crossed != EP_OK || ep_win < 0)
            return ep_crossed;
        const scalar_t ep_t = ep_r->epr_cur;
        memset(ep_r->epr_fired, 0, (size_t)ep_N);
        ep_r->epr_fired[ep_win] = 1;
        ep_r->epr_spikers[0] = ep_win;
        int ep_rc = epr_cascade(ep_r, ep_t, 1);
        if (ep_rc != EP_OK)
            return ep_rc;
    }
    return EP_OK;
}

/* the sample from grid interval n_begin (its first event: *e) through n_end - 1 */
static int epr_run(epr_run_t *ep_r, int64_t ep_n_begin, int64_t ep_n_end, int64_t *ep_e, scalar_t *ep_trace) {
    const ep_layer_t *ep_L = ep_r->epr_L;
    const int64_t ep_N = ep_L->ep_N, ep_b = ep_r->epr_b;
    const scalar_t *ep_times = ep_L->ep_ev_time + ep_b * ep_L->ep_M;
    const int64_t *ep_index = ep_L->ep_ev_index + ep_b * ep_L->ep_M, ep_count = ep_L->ep_ev_count[ep_b];
    ep_r->epr_cur = (scalar_t)ep_n_begin * ep_L->ep_dt;
    for (int64_t ep_n = ep_n_begin; ep_n < ep_n_end; ++ep_n) {
        const scalar_t ep_grid = (scalar_t)(ep_n + 1) * ep_L->ep_dt;
        for (; *ep_e < ep_count && ep_times[*ep_e] <= ep_grid; ++*ep_e) {
            int ep_rc = epr_advance(ep_r, ep_times[*ep_e]);
            if (ep_rc != EP_OK)
                return ep_rc;
            for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
                ep_r->epr_w[ep_j] = ep_L->ep_weight[ep_j * ep_L->ep_I + ep_index[*ep_e] / ep_L->ep_K];
            memset(ep_r->epr_fired, 0, (size_t)ep_N);
            const int64_t ep_fired = epr_jump(ep_r, ep_times[*ep_e], 0, *ep_e);
            if (ep_fired < 0)
                return (int)-ep_fired;
            ep_rc = epr_cascade(ep_r, ep_times[*ep_e], ep_fired);
            if (ep_rc != EP_OK)
                return ep_rc;
        }
        int ep_rc = epr_advance(ep_r, ep_grid);
        if (ep_rc != EP_OK)
            return ep_rc;
        if (ep_trace != NULL)
            memcpy(ep_trace + (ep_n * ep_L->ep_B + ep_b) * ep_N * EP_NS, ep_r->epr_x,
                   (size_t)(ep_N * EP_NS) * sizeof(scalar_t));
    }
    return EP_OK;
}

/* a sample's run with its scratch (NULL where out of memory) */
static epr_run_t *epr_open(const ep_layer_t *ep_L, const scalar_t *ep_V, int64_t ep_b) {
    const int64_t ep_N = ep_L->ep_N;
    epr_run_t *ep_r = calloc(1, sizeof(epr_run_t));
    if (ep_r == NULL)
        return NULL;
    ep_r->epr_L = ep_L;
    ep_r->epr_V = ep_V;
    ep_r->epr_b = ep_b;
    ep_r->epr_x = malloc((size_t)(3 * ep_N * EP_NS + ep_N) * sizeof(scalar_t));
    ep_r->epr_first = malloc((size_t)(3 * ep_N) * sizeof(int64_t));
    ep_r->epr_fired = malloc((size_t)ep_N);
    if (ep_r->epr_x == NULL || ep_r->epr_first == NULL || ep_r->epr_fired == NULL) {
        free(ep_r->epr_x);
        free(ep_r->epr_first);
        free(ep_r->epr_fired);
        free(ep_r);
        return NULL;
    }
    ep_r->epr_x1 = ep_r->epr_x + ep_N * EP_NS;
    ep_r->epr_drive = ep_r->epr_x1 + ep_N * EP_NS;
    ep_r->epr_w = ep_r->epr_drive + ep_N * EP_NS;
    ep_r->epr_spikers = ep_r->epr_first + ep_N;
    ep_r->epr_count = ep_r->epr_spikers + ep_N;
    memset(ep_r->epr_count, 0, (size_t)ep_N * sizeof(int64_t));
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
        epf_drive(epr_p(ep_r, ep_j), ep_r->epr_drive + ep_j * EP_NS);
    return ep_r;
}

static void epr_close(epr_run_t *ep_r) {
    if (ep_r == NULL)
        return;
    free(ep_r->epr_x);
    free(ep_r->epr_first);
    free(ep_r->epr_fired);
    free(ep_r->epr_items);
    free(ep_r->epr_data);
    free(ep_r);
}

/* a sample's forward starts from the states in epr_x: its spike times go to its rows of out ([B, N, cap]);
   EP_STARTS_ABOVE where a neuron starts at or above its threshold */
static int epr_start(epr_run_t *ep_r, scalar_t *ep_out, int64_t ep_cap) {
    const ep_layer_t *ep_L = ep_r->epr_L;
    int ep_rc = EP_OK;
    for (int64_t ep_j = 0; ep_j < ep_L->ep_N; ++ep_j)
        if (eph_g(ep_r->epr_x + ep_j * EP_NS, epr_p(ep_r, ep_j)) >= 0)
            ep_rc = EP_STARTS_ABOVE;
    ep_r->epr_out = ep_out + ep_r->epr_b * ep_L->ep_N * ep_cap;
    ep_r->epr_cap = ep_cap;
    return ep_rc;
}

/* a sample's forward ends (`ep_rc` its status so far): its spike counts; EP_FULL where a neuron fired more often
   than its row of out holds */
static int epr_finish(const epr_run_t *ep_r, int ep_rc, int64_t *ep_counts) {
    const int64_t ep_N = ep_r->epr_L->ep_N;
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
        ep_counts[ep_r->epr_b * ep_N + ep_j] = ep_r->epr_count[ep_j];
        if (ep_rc == EP_OK && ep_r->epr_count[ep_j] > ep_r->epr_cap)
            ep_rc = EP_FULL;
    }
    return ep_rc;
}

int eventprop_recurrent_forward(int ep_threads, ep_layer_t ep_L, const scalar_t *ep_V, scalar_t *ep_out,
                                int64_t ep_cap, int64_t *ep_counts, scalar_t *ep_trace) {
    int ep_status = EP_OK;
#pragma omp parallel for num_threads(ep_threads) schedule(dynamic, 1) reduction(max : ep_status)
    for (int64_t ep_b = 0; ep_b < ep_L.ep_B; ++ep_b) {
        epr_run_t *ep_r = epr_open(&ep_L, ep_V, ep_b);
        int ep_rc = ep_r == NULL ? EP_NO_MEMORY : EP_OK;
        if (ep_rc == EP_OK) {
            memcpy(ep_r->epr_x, ep_L.ep_initial, (size_t)(ep_L.ep_N * EP_NS) * sizeof(scalar_t));
            ep_rc = epr_start(ep_r, ep_out, ep_cap);
            int64_t ep_e = 0;
            if (ep_rc == EP_OK)
                ep_rc = epr_run(ep_r, 0, ep_L.ep_T, &ep_e, ep_trace);
            ep_rc = epr_finish(ep_r, ep_rc, ep_counts);
        }
        epr_close(ep_r);
        ep_status = ep_rc > ep_status ? ep_rc : ep_status;
    }
    return ep_status;
}

/* the adjoint through one instant's logged steps from `m` back to its first (lam [N, NS], in place); returns the
   index of the step before it */
static int64_t epr_instant_adjoint(epr_run_t *ep_r, int64_t ep_m, scalar_t *ep_lam, const int64_t *ep_base,
                                   const scalar_t *ep_errors, int64_t ep_width, scalar_t *ep_d_times,
                                   scalar_t *ep_d_w, scalar_t *ep_d_v, scalar_t *ep_dp) {
    const ep_layer_t *ep_L = ep_r->epr_L;
    const int64_t ep_N = ep_L->ep_N, ep_row0 = ep_r->epr_b * ep_N;
    scalar_t ep_time_error = 0, ep_out[EP_NS], ep_terms[EP_NP + 1];
    for (; ep_m >= 0 && ep_r->epr_items[ep_m].epr_kind != EPR_STATE; --ep_m) {
        const epr_item_t *ep_item = &ep_r->epr_items[ep_m];
        const scalar_t *ep_d = ep_r->epr_data + ep_item->epr_at;
        const int64_t ep_j = ep_item->epr_j;
        scalar_t *ep_l = ep_lam + ep_j * EP_NS;
        const scalar_t ep_error = ep_errors != NULL && ep_j >= 0
                                ? ep_errors[(ep_row0 + ep_j) * ep_width + ep_base[ep_j] + ep_item->epr_slot] : 0;
        if (ep_item->epr_kind == EPR_CROSS) {
            epf_spike_adjoint(ep_d, ep_l, ep_time_error + ep_error, epr_p(ep_r, ep_j), ep_out, ep_terms);
            eph_add(ep_dp + (ep_row0 + ep_j) * EP_NP, ep_terms);
            memcpy(ep_l, ep_out, sizeof ep_out);
            return ep_m - 1;
        }
        if (ep_item->epr_kind == EPR_RESET) {
            const scalar_t *ep_p = epr_p(ep_r, ep_j);
            scalar_t ep_f_mid[EP_NS], ep_post[EP_NS], ep_f_post[EP_NS];
            epf_reset_vjp(ep_d, ep_l, ep_p, ep_out, ep_terms);
            epf_rate(ep_d, ep_p, ep_f_mid);
            epf_reset(ep_d, ep_p, ep_post);
            epf_rate(ep_post, ep_p, ep_f_post);
            for (int ep_k = 0; ep_k < EP_NS; ++ep_k)
                ep_time_error += ep_out[ep_k] * ep_f_mid[ep_k] - ep_l[ep_k] * ep_f_post[ep_k];
            ep_time_error += ep_error;
            eph_add(ep_dp + (ep_row0 + ep_j) * EP_NP, ep_terms);
            memcpy(ep_l, ep_out, sizeof ep_out);
            continue;
        }
        /* a jump of every neuron: an input event's (event >= 0) or the spikes of a wave */
        for (int64_t ep_i = 0; ep_i < ep_N; ++ep_i) {
            scalar_t ep_weight, ep_event_error;
            epf_input_adjoint(ep_d + ep_i * EP_NS, ep_lam + ep_i * EP_NS, ep_d[ep_N * EP_NS + ep_i], epr_p(ep_r, ep_i),
                              &ep_weight, ep_terms, &ep_event_error);
            eph_add(ep_dp + (ep_row0 + ep_i) * EP_NP, ep_terms);
            ep_time_error += ep_event_error;
            if (ep_item->epr_event >= 0) {
                const int64_t ep_at = ep_L->ep_ev_index[ep_r->epr_b * ep_L->ep_M + ep_item->epr_event];
                ep_d_w[ep_i * ep_L->ep_I + ep_at / ep_L->ep_K] += ep_weight;
            }
            for (int64_t ep_k = 0; ep_k < ep_item->epr_n; ++ep_k)
                ep_d_v[ep_i * ep_N + (int64_t)ep_d[ep_N * EP_NS + ep_N + ep_k]] += ep_weight;
        }
        if (ep_item->epr_event >= 0) {
            const int64_t ep_at = ep_L->ep_ev_index[ep_r->epr_b * ep_L->ep_M + ep_item->epr_event];
            ep_d_times[ep_r->epr_b * ep_L->ep_I * ep_L->ep_K + ep_at] += ep_time_error;
            return ep_m - 1;
        }
    }
    return ep_m;
}

/* one sample's adjoint, last interval first (the log: its intervals run again); lam0: lambda at t = 0 */
static int epr_sample_adjoint(epr_run_t *ep_r, const scalar_t *ep_trace, const int64_t *ep_counts,
                              const scalar_t *ep_grad_trace, const scalar_t *ep_errors, int64_t ep_width,
                              const ep_quadrature_t *ep_q, int64_t *ep_first, scalar_t *ep_d_times,
                              scalar_t *ep_d_w, scalar_t *ep_d_v, scalar_t *ep_dp, scalar_t *ep_lam0) {
    const ep_layer_t *ep_L = ep_r->epr_L;
    const int64_t ep_N = ep_L->ep_N, ep_b = ep_r->epr_b, ep_row0 = ep_b * ep_N, ep_size = ep_N * EP_NS;
    scalar_t *ep_lam = calloc((size_t)(2 * ep_size + ep_N), sizeof(scalar_t));
    int64_t *ep_base = malloc((size_t)ep_N * sizeof(int64_t));
    if (ep_lam == NULL || ep_base == NULL) {
        free(ep_lam);
        free(ep_base);
        return EP_NO_MEMORY;
    }
    scalar_t *ep_start = ep_lam + ep_size, *ep_speed = ep_start + ep_size;
    for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j) {
        ep_speed[ep_j] = eph_norm(epr_p(ep_r, ep_j));
        ep_base[ep_j] = ep_counts[ep_row0 + ep_j];
    }
    eph_firsts(ep_L, ep_b, ep_first);
    ep_r->epr_logging = 1;
    int ep_rc = EP_OK;
    for (int64_t ep_n = ep_L->ep_T - 1; ep_n >= 0 && ep_rc == EP_OK; --ep_n) {
        const scalar_t *ep_from = ep_n ? ep_trace + ((ep_n - 1) * ep_L->ep_B + ep_b) * ep_size : ep_L->ep_initial;
        memcpy(ep_start, ep_from, (size_t)ep_size * sizeof(scalar_t));
        memcpy(ep_r->epr_x, ep_start, (size_t)ep_size * sizeof(scalar_t));
        memset(ep_r->epr_count, 0, (size_t)ep_N * sizeof(int64_t));
        ep_r->epr_n_items = ep_r->epr_n_data = 0;
        int64_t ep_e = ep_first[ep_n];
        ep_rc = epr_run(ep_r, ep_n, ep_n + 1, &ep_e, NULL);
        if (ep_rc != EP_OK)
            break;
        for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
            ep_base[ep_j] -= ep_r->epr_count[ep_j];
        if (ep_grad_trace != NULL)
            for (int64_t ep_k = 0; ep_k < ep_size; ++ep_k)
                ep_lam[ep_k] += ep_grad_trace[(ep_n * ep_L->ep_B + ep_b) * ep_size + ep_k];
        scalar_t ep_cur = (scalar_t)(ep_n + 1) * ep_L->ep_dt;
        for (int64_t ep_m = ep_r->epr_n_items - 1; ep_m >= 0;) {
            const epr_item_t *ep_state = &ep_r->epr_items[ep_m];  /* an instant ends with its states */
            for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
                eph_flow_back(ep_r->epr_data + ep_state->epr_at + ep_j * EP_NS, ep_lam + ep_j * EP_NS,
                              ep_cur - ep_state->epr_t, epr_p(ep_r, ep_j), ep_speed[ep_j], ep_q,
                              ep_dp + (ep_row0 + ep_j) * EP_NP);
            ep_cur = ep_state->epr_t;
            ep_m = epr_instant_adjoint(ep_r, ep_m - 1, ep_lam, ep_base, ep_errors, ep_width, ep_d_times, ep_d_w,
                                       ep_d_v, ep_dp);
        }
        for (int64_t ep_j = 0; ep_j < ep_N; ++ep_j)
            eph_flow_back(ep_start + ep_j * EP_NS, ep_lam + ep_j * EP_NS, ep_cur - (scalar_t)ep_n * ep_L->ep_dt,
                          epr_p(ep_r, ep_j), ep_speed[ep_j], ep_q, ep_dp + (ep_row0 + ep_j) * EP_NP);
    }
    memcpy(ep_lam0 + ep_row0 * EP_NS, ep_lam, (size_t)ep_size * sizeof(scalar_t));
    free(ep_lam);
    free(ep_base);
    return ep_rc;
}

int eventprop_recurrent_backward(int ep_threads, ep_layer_t ep_L, const scalar_t *ep_V, const scalar_t *ep_trace,
                                 const int64_t *ep_counts, const scalar_t *ep_grad_trace, const scalar_t *ep_errors,
                                 int64_t ep_width, ep_quadrature_t ep_q, scalar_t *ep_d_times, scalar_t *ep_d_w,
                                 scalar_t *ep_d_v, scalar_t *ep_d_params, scalar_t *ep_lam0) {
    int ep_status = EP_OK;
#pragma omp parallel num_threads(ep_threads) reduction(max : ep_status)
    {
        int ep_thread = 0;
#ifdef _OPENMP
        ep_thread = omp_get_thread_num();
#endif
        int64_t *ep_first = malloc((size_t)(ep_L.ep_T + 1) * sizeof(int64_t));
        if (ep_first == NULL)
            ep_status = EP_NO_MEMORY;
#pragma omp for schedule(dynamic, 1)
        for (int64_t ep_b = 0; ep_b < ep_L.ep_B; ++ep_b) {
            if (ep_first == NULL)
                continue;
            epr_run_t *ep_r = epr_open(&ep_L, ep_V, ep_b);
            int ep_rc = ep_r == NULL ? EP_NO_MEMORY
                : epr_sample_adjoint(ep_r, ep_trace, ep_counts, ep_grad_trace, ep_errors, ep_width, &ep_q, ep_first,
                                     ep_d_times, ep_d_w + ep_thread * ep_L.ep_N * ep_L.ep_I,
                                     ep_d_v + ep_thread * ep_L.ep_N * ep_L.ep_N, ep_d_params, ep_lam0);
            epr_close(ep_r);
            ep_status = ep_rc > ep_status ? ep_rc : ep_status;
        }
        free(ep_first);
    }
    return ep_status;
}
