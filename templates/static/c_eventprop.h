/* EventProp (Wunderlich & Pehle 2021) for one dense layer, on the functions printed above (epf_flow, epf_threshold,
   ...): the same algorithm as the torch reference (flexgen.launch.eventprop), one row (sample, neuron) at a time.
   Forward: each row walks its lane's input events (sorted) merged with the grid points (n+1) dt, events first
   at equal times; between two breakpoints the first root of g on the exact flow is bracketed by EP_SAMPLES
   samples (none where a bound from the linear flow, eph_quiet, shows that g stays below 0 there) and found by
   Newton's method safeguarded by bisection; a spike resets the states and the search goes on;
   an input event adds w b and fires where g >= 0 after it. Spike times go to a row's slots [0, cap); the count
   goes on past cap (the host grows the buffer and runs again). The grid states are written to the trace.
   Backward: each row's grid intervals last to first; an interval's forward is run again from the trace (the same
   code, so the same values) into a log of its spikes and events, which the adjoint then walks backwards: exp(A^T h)
   between them, the parameter integrals by Gauss-Legendre panels no longer than 1 / |A|_inf (fewer nodes on panels
   short against that rate; no nodes where no parameter is trained), the jumps at
   spikes and events. Parallel over rows (forward) and samples (backward: a sample's input-time errors are summed
   over its neurons; weight gradients go to per-thread partial sums). A lane is a sample (its neurons see the same
   events) or, with per_row (per-synapse delays: each neuron its own arrival times), one row: the event lists and
   the input-time errors are then per row.
   A neuron nonlinear between events (EP_LINEAR 0) has no closed form: its flow over a piece of length h is
   EP_SUBSTEPS steps of its method (epf_step) of length h / EP_SUBSTEPS, the root search runs on that trajectory
   (no bound: EP_BOUND 0), and the backward's eph_flow_back recomputes the piece by substeps, integrates the adjoint
   by RK4 in reverse time on it and the parameter integrals by Simpson's rule (the reference's _stepped_back). */
#include <float.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define EP_SAMPLES 16
#define EP_NEWTON_STEPS 100
#define EP_MAX_PANELS 64
#define EP_OK 0
#define EP_FULL 1
#define EP_STARTS_ABOVE 2
#define EP_RESET_ABOVE 3
#define EP_NO_MEMORY 4
#define EP_SPIKE 0
#define EP_EVENT 1

#if !EP_LINEAR
/* the flow of a neuron nonlinear between events: EP_SUBSTEPS steps of its method, as the printed flow of a linear
   one (epf_flow(h, x0, p, out)) */
static inline void epf_flow(const scalar_t ep_h, const scalar_t *ep_x0, const scalar_t *ep_p, scalar_t *ep_out) {
    scalar_t ep_x[EP_NS];
    memcpy(ep_x, ep_x0, sizeof ep_x);
    for (int ep_k = 0; ep_k < EP_SUBSTEPS; ++ep_k) {
        epf_step(ep_h / EP_SUBSTEPS, ep_x, ep_p, ep_out);
        memcpy(ep_x, ep_out, sizeof ep_x);
    }
}
#endif

typedef struct {
    /* samples, neurons, inputs, grid steps, events per lane (padded), input slots; per_row: 1 where each row is a
       lane of its own, 0 where the lanes are the samples */
    int64_t ep_B, ep_N, ep_I, ep_T, ep_M, ep_K, ep_per_row;
    scalar_t ep_dt;
    const scalar_t *ep_ev_time;   /* [lanes, M] ascending per lane; ev_count[lane] of them are events */
    const int64_t *ep_ev_index;   /* [lanes, M] input * K + slot of each event */
    const int64_t *ep_ev_count;   /* [lanes] */
    const scalar_t *ep_weight;    /* [N, I] */
    const scalar_t *ep_params;    /* [N, EP_NP] */
    const scalar_t *ep_initial;   /* [N, EP_NS] */
} ep_layer_t;

typedef struct {  /* one spike or input event of an interval, as the backward reads it */
    scalar_t ep_t, ep_w;
    int ep_kind, ep_fired;
    int64_t ep_event, ep_slot;  /* an event's index among its lane's; the spike's slot from the interval's first */
    scalar_t ep_a[EP_NS], ep_b[EP_NS];  /* spike: a = the states before it; event: a before, b after the jump */
} ep_item_t;

typedef struct {  /* where a row's spikes go: the output slots (forward) and the log of items (backward) */
    scalar_t *ep_out;
    int64_t ep_cap, ep_count;
    ep_item_t *ep_items;
    int64_t ep_n_items, ep_max_items;
} ep_sink_t;

static int64_t eph_lane(const ep_layer_t *ep_L, int64_t ep_b, int64_t ep_j) {  /* the lane of row (b, j) */
    return ep_L->ep_per_row ? ep_b * ep_L->ep_N + ep_j : ep_b;
}

static scalar_t eph_g(const scalar_t *ep_x, const scalar_t *ep_p) {
    scalar_t ep_g;
    epf_threshold(ep_x, ep_p, &ep_g);
    return ep_g;
}

/* `buffer` (room for *room elements of `size` bytes) grown to hold `need` of them: doubled, or to `need` if more,
   and to 64 at least; NULL where out of memory (the buffer is then as it was). Every growing log and queue of the
   EventProp kernels goes through it: no event is dropped for want of room. */
static void *eph_room(void *ep_buffer, int64_t *ep_room, int64_t ep_need, size_t ep_size) {
    if (ep_need <= *ep_room)
        return ep_buffer;
    int64_t ep_grown = 2 * *ep_room > ep_need ? 2 * *ep_room : ep_need;
    ep_grown = ep_grown < 64 ? 64 : ep_grown;
    void *ep_to = realloc(ep_buffer, (size_t)ep_grown * ep_size);
    if (ep_to != NULL)
        *ep_room = ep_grown;
    return ep_to;
}

/* 1 where g provably stays below 0 on the flow from x0 over [0, length] (no crossing: the samples of the root
   search need not run). With f0 = f(x0), A = df/dx, q = dg/dx (g affine in the states) and a = |A|_inf:
   g(s) = g0 + s q.f0 + int_0^s (s - u) q.A exp(A u) f0 du <= g0 + s max(q.f0, 0) + |q|_1 |A f0|_inf s^2 e^(a s) / 2,
   which grows with s; the margin covers the rounding of the sampled values. */
static int eph_quiet(const scalar_t *ep_x0, const scalar_t *ep_p, scalar_t ep_length) {
#if EP_BOUND
    scalar_t ep_a[EP_NS * EP_NS], ep_f[EP_NS], ep_q[EP_NS], ep_rate = 0, ep_af = 0, ep_qn = 0, ep_xn = 0, ep_gdot;
    epf_jacobian(ep_p, ep_a);
    epf_rate(ep_x0, ep_p, ep_f);
    epf_threshold_gradient(ep_p, ep_q);
    epf_gdot(ep_x0, ep_p, &ep_gdot);
    for (int ep_r = 0; ep_r < EP_NS; ++ep_r) {
        scalar_t ep_row = 0, ep_dot = 0;
        for (int ep_c = 0; ep_c < EP_NS; ++ep_c) {
            ep_row += fabs(ep_a[ep_r * EP_NS + ep_c]);
            ep_dot += ep_a[ep_r * EP_NS + ep_c] * ep_f[ep_c];
        }
        ep_rate = ep_row > ep_rate ? ep_row : ep_rate;
        ep_af = fabs(ep_dot) > ep_af ? fabs(ep_dot) : ep_af;
        ep_qn += fabs(ep_q[ep_r]);
        const scalar_t ep_reach = fabs(ep_x0[ep_r]) + ep_length * fabs(ep_f[ep_r]);
        ep_xn = ep_reach > ep_xn ? ep_reach : ep_xn;
    }
    const scalar_t ep_g0 = eph_g(ep_x0, ep_p);
    const scalar_t ep_rise = ep_length * (ep_gdot > 0 ? ep_gdot : 0)
                           + ep_qn * ep_af * ep_length * ep_length * exp(ep_rate * ep_length) / 2;
    const scalar_t ep_margin = 1e-9 * (1 + fabs(ep_g0) + ep_qn * ep_xn);
    return isfinite(ep_rise) && ep_g0 + 1.001 * ep_rise + ep_margin < 0;
#else
    (void)ep_x0; (void)ep_p; (void)ep_length;
    return 0;
#endif
}

static ep_item_t *eph_log(ep_sink_t *ep_sink, int ep_kind, scalar_t ep_t) {
    const int64_t ep_slot = ep_sink->ep_count;
    if (ep_sink->ep_out != NULL && ep_sink->ep_count < ep_sink->ep_cap && ep_kind == EP_SPIKE)
        ep_sink->ep_out[ep_sink->ep_count] = ep_t;
    if (ep_kind == EP_SPIKE)
        ep_sink->ep_count += 1;
    if (ep_sink->ep_max_items < 0)
        return NULL;  /* the forward keeps no log */
    ep_item_t *ep_items = eph_room(ep_sink->ep_items, &ep_sink->ep_max_items, ep_sink->ep_n_items + 1,
                                   sizeof(ep_item_t));
    if (ep_items == NULL)
        return NULL;
    ep_sink->ep_items = ep_items;
    ep_item_t *ep_item = &ep_sink->ep_items[ep_sink->ep_n_items++];
    ep_item->ep_t = ep_t;
    ep_item->ep_kind = ep_kind;
    ep_item->ep_fired = 0;
    ep_item->ep_slot = ep_slot;
    return ep_item;
}

/* the root of g(flow(s, x0)) in [lo, hi] (g(lo) < 0 <= g(hi)) */
static scalar_t eph_root(const scalar_t *ep_x0, const scalar_t *ep_p, scalar_t ep_lo, scalar_t ep_hi) {
    scalar_t ep_s = ep_hi, ep_xs[EP_NS];
    for (int ep_k = 0; ep_k < EP_NEWTON_STEPS; ++ep_k) {
        epf_flow(ep_s, ep_x0, ep_p, ep_xs);
        scalar_t ep_g = eph_g(ep_xs, ep_p), ep_gdot;
        if (ep_g < 0)
            ep_lo = ep_s;
        if (ep_g >= 0)
            ep_hi = ep_s;
        epf_gdot(ep_xs, ep_p, &ep_gdot);
        scalar_t ep_next = ep_s - ep_g / ep_gdot;
        if (!(ep_next > ep_lo && ep_next < ep_hi) || !isfinite(ep_next))
            ep_next = (ep_lo + ep_hi) / 2;
        int ep_done = fabs(ep_next - ep_s) <= 4 * DBL_EPSILON * (fabs(ep_s) + fabs(ep_hi));
        ep_s = ep_next;
        if (ep_done)
            break;
    }
    return ep_s;
}

/* from *cur to target, spiking where g crosses 0 on the way */
static int eph_advance(scalar_t *ep_x, scalar_t *ep_cur, scalar_t ep_target, const scalar_t *ep_p, ep_sink_t *ep_sink) {
    scalar_t ep_x0[EP_NS], ep_xs[EP_NS], ep_pre[EP_NS];
    while (*ep_cur < ep_target) {
        memcpy(ep_x0, ep_x, sizeof ep_x0);
        const scalar_t ep_length = ep_target - *ep_cur;
        scalar_t ep_lo = 0, ep_hi = 0;
        int ep_first = -1;
        if (eph_quiet(ep_x0, ep_p, ep_length)) {  /* the last sample's flow alone: no crossing on the piece */
            epf_flow(ep_length, ep_x0, ep_p, ep_x);
            *ep_cur = ep_target;
            return EP_OK;
        }
        for (int ep_k = 0; ep_k < EP_SAMPLES && ep_first < 0; ++ep_k) {
            ep_lo = ep_hi;
            ep_hi = ((scalar_t)(ep_k + 1) / EP_SAMPLES) * ep_length;
            epf_flow(ep_hi, ep_x0, ep_p, ep_xs);
            if (eph_g(ep_xs, ep_p) >= 0)
                ep_first = ep_k;
        }
        if (ep_first < 0) {
            memcpy(ep_x, ep_xs, sizeof ep_xs);
            *ep_cur = ep_target;
            return EP_OK;
        }
        const scalar_t ep_root = eph_root(ep_x0, ep_p, ep_first ? ep_lo : 0, ep_hi);
        epf_flow(ep_root, ep_x0, ep_p, ep_pre);
        const scalar_t ep_t = *ep_cur + ep_root;
        ep_item_t *ep_item = eph_log(ep_sink, EP_SPIKE, ep_t);
        if (ep_item != NULL)
            memcpy(ep_item->ep_a, ep_pre, sizeof ep_pre);
        else if (ep_sink->ep_max_items >= 0)
            return EP_NO_MEMORY;
        epf_reset(ep_pre, ep_p, ep_x);
        *ep_cur = ep_t;
        if (eph_g(ep_x, ep_p) >= 0)
            return EP_RESET_ABOVE;
    }
    return EP_OK;
}

/* one row from the grid interval n_begin (its first event: *e) through n_end - 1, from the states x */
static int eph_run(const ep_layer_t *ep_L, int64_t ep_b, int64_t ep_j, scalar_t *ep_x, int64_t ep_n_begin,
                   int64_t ep_n_end, int64_t *ep_e,
                  ep_sink_t *ep_sink, scalar_t *ep_trace) {
    const int64_t ep_lane = eph_lane(ep_L, ep_b, ep_j);
    const scalar_t *ep_p = ep_L->ep_params + ep_j * EP_NP, *ep_times = ep_L->ep_ev_time + ep_lane * ep_L->ep_M;
    const int64_t *ep_index = ep_L->ep_ev_index + ep_lane * ep_L->ep_M, ep_count = ep_L->ep_ev_count[ep_lane];
    scalar_t ep_drive[EP_NS], ep_cur = (scalar_t)ep_n_begin * ep_L->ep_dt;
    epf_drive(ep_p, ep_drive);
    for (int64_t ep_n = ep_n_begin; ep_n < ep_n_end; ++ep_n) {
        const scalar_t ep_grid = (scalar_t)(ep_n + 1) * ep_L->ep_dt;
        for (; *ep_e < ep_count && ep_times[*ep_e] <= ep_grid; ++*ep_e) {
            int ep_rc = eph_advance(ep_x, &ep_cur, ep_times[*ep_e], ep_p, ep_sink);
            if (ep_rc != EP_OK)
                return ep_rc;
            const scalar_t ep_w = ep_L->ep_weight[ep_j * ep_L->ep_I + ep_index[*ep_e] / ep_L->ep_K];
            scalar_t ep_before[EP_NS];
            memcpy(ep_before, ep_x, sizeof ep_before);
            for (int ep_k = 0; ep_k < EP_NS; ++ep_k)
                ep_x[ep_k] = ep_x[ep_k] + ep_w * ep_drive[ep_k];
            const int ep_fired = eph_g(ep_x, ep_p) >= 0;
            if (ep_sink->ep_max_items >= 0) {
                ep_item_t *ep_item = eph_log(ep_sink, EP_EVENT, ep_times[*ep_e]);
                if (ep_item == NULL)
                    return EP_NO_MEMORY;
                ep_item->ep_w = ep_w;
                ep_item->ep_event = *ep_e;
                ep_item->ep_fired = ep_fired;
                memcpy(ep_item->ep_a, ep_before, sizeof ep_before);
                memcpy(ep_item->ep_b, ep_x, sizeof ep_before);
            }
            if (ep_fired) {
                scalar_t ep_mid[EP_NS];
                memcpy(ep_mid, ep_x, sizeof ep_mid);
                if (ep_sink->ep_out != NULL && ep_sink->ep_count < ep_sink->ep_cap)
                    ep_sink->ep_out[ep_sink->ep_count] = ep_times[*ep_e];
                ep_sink->ep_count += 1;
                epf_reset(ep_mid, ep_p, ep_x);
                if (eph_g(ep_x, ep_p) >= 0)
                    return EP_RESET_ABOVE;
            }
        }
        int ep_rc = eph_advance(ep_x, &ep_cur, ep_grid, ep_p, ep_sink);
        if (ep_rc != EP_OK)
            return ep_rc;
        if (ep_trace != NULL)
            memcpy(ep_trace + ((ep_n * ep_L->ep_B + ep_b) * ep_L->ep_N + ep_j) * EP_NS, ep_x, EP_NS * sizeof(scalar_t));
    }
    return EP_OK;
}

int eventprop_forward(int ep_threads, ep_layer_t ep_L, scalar_t *ep_out, int64_t ep_cap, int64_t *ep_counts,
                      scalar_t *ep_trace) {
    int ep_status = EP_OK;
#pragma omp parallel for num_threads(ep_threads) schedule(dynamic, 16) reduction(max : ep_status)
    for (int64_t ep_row = 0; ep_row < ep_L.ep_B * ep_L.ep_N; ++ep_row) {
        const int64_t ep_b = ep_row / ep_L.ep_N, ep_j = ep_row % ep_L.ep_N;
        scalar_t ep_x[EP_NS];
        memcpy(ep_x, ep_L.ep_initial + ep_j * EP_NS, sizeof ep_x);
        int ep_rc = EP_OK;
        if (eph_g(ep_x, ep_L.ep_params + ep_j * EP_NP) >= 0)
            ep_rc = EP_STARTS_ABOVE;
        ep_sink_t ep_sink = {ep_out + ep_row * ep_cap, ep_cap, 0, NULL, 0, -1};
        int64_t ep_e = 0;
        if (ep_rc == EP_OK)
            ep_rc = eph_run(&ep_L, ep_b, ep_j, ep_x, 0, ep_L.ep_T, &ep_e, &ep_sink, ep_trace);
        ep_counts[ep_row] = ep_sink.ep_count;
        if (ep_rc == EP_OK && ep_sink.ep_count > ep_cap)
            ep_rc = EP_FULL;
        ep_status = ep_rc > ep_status ? ep_rc : ep_status;
    }
    return ep_status;
}

typedef struct {  /* the quadrature: NODES Gauss-Legendre nodes and weights on [0, 1]; a panel short against the
                     rates (rate x length <= few_reach) takes the rule of few_nodes nodes instead */
    int64_t ep_nodes;
    const scalar_t *ep_z, *ep_w;
    int64_t ep_few_nodes;
    const scalar_t *ep_few_z, *ep_few_w;
    scalar_t ep_few_reach;
} ep_quadrature_t;

#if EP_LINEAR
/* lambda a time `length` earlier (in place), adding the parameter integrals over the piece from x0 on */
static void eph_flow_back(const scalar_t *ep_x0, scalar_t *ep_lam, scalar_t ep_length, const scalar_t *ep_p,
                          scalar_t ep_rate,
                         const ep_quadrature_t *ep_q, scalar_t *ep_dp) {
    scalar_t ep_xq[EP_NS], ep_lq[EP_NS], ep_term[EP_NP + 1], ep_acc[EP_NP + 1] = {0};
    const scalar_t ep_need = ceil(ep_rate * ep_length);
    const int64_t ep_panels = ep_need < 1 ? 1 : ep_need > EP_MAX_PANELS ? EP_MAX_PANELS : (int64_t)ep_need;
    const int ep_few = ep_rate * ep_length <= ep_q->ep_few_reach * ep_panels;
    const int64_t ep_nodes = ep_few ? ep_q->ep_few_nodes : ep_q->ep_nodes;
    const scalar_t *ep_z = ep_few ? ep_q->ep_few_z : ep_q->ep_z, *ep_w = ep_few ? ep_q->ep_few_w : ep_q->ep_w;
    for (int64_t ep_m = 0; ep_m < ep_panels; ++ep_m)
        for (int64_t ep_k = 0; ep_k < ep_nodes; ++ep_k) {
            const scalar_t ep_s = ((ep_m + ep_z[ep_k]) / ep_panels) * ep_length;
            epf_flow(ep_s, ep_x0, ep_p, ep_xq);
            epf_adjoint_flow(ep_length - ep_s, ep_lam, ep_p, ep_lq);
            epf_integrand(ep_xq, ep_lq, ep_p, ep_term);
            for (int ep_i = 0; ep_i < EP_NP; ++ep_i)
                ep_acc[ep_i] += (ep_w[ep_k] / ep_panels) * ep_term[ep_i];
        }
    for (int ep_i = 0; ep_i < EP_NP; ++ep_i)
        ep_dp[ep_i] += ep_acc[ep_i] * ep_length;
    epf_adjoint_flow(ep_length, ep_lam, ep_p, ep_lq);
    memcpy(ep_lam, ep_lq, sizeof ep_lq);
}

static scalar_t eph_norm(const scalar_t *ep_p) {  /* |A|_inf: the largest row sum of |df/dx| */
    scalar_t ep_a[EP_NS * EP_NS], ep_rate = 0;
    epf_jacobian(ep_p, ep_a);
    for (int ep_r = 0; ep_r < EP_NS; ++ep_r) {
        scalar_t ep_sum = 0;
        for (int ep_c = 0; ep_c < EP_NS; ++ep_c)
            ep_sum += fabs(ep_a[ep_r * EP_NS + ep_c]);
        ep_rate = ep_sum > ep_rate ? ep_sum : ep_rate;
    }
    return ep_rate;
}
#else
/* lambda a time `length` earlier (in place), adding the parameter integrals over the piece from x0 on, for a
   neuron nonlinear between events: the trajectory recomputed by EP_SUBSTEPS steps of its method (and a half step
   from each node for the midpoints), the adjoint (epf_adjoint_rate: (df/dx)^T lambda) by RK4 in reverse time on
   it, the integrals by Simpson's rule with lambda at the midpoints by cubic Hermite interpolation, in the
   reference's order (Simulator._stepped_back); no integrals where no parameter is trained (the quadrature has no
   nodes then). The rate of the linear backward's panels is not used. */
static void eph_flow_back(const scalar_t *ep_x0, scalar_t *ep_lam, scalar_t ep_length, const scalar_t *ep_p,
                          scalar_t ep_rate, const ep_quadrature_t *ep_q, scalar_t *ep_dp) {
    scalar_t ep_nodes[(EP_SUBSTEPS + 1) * EP_NS], ep_xm[EP_NS], ep_arg[EP_NS], ep_before[EP_NS], ep_mid[EP_NS];
    scalar_t ep_k1[EP_NS], ep_k2[EP_NS], ep_k3[EP_NS], ep_k4[EP_NS], ep_slope[EP_NS];
    scalar_t ep_ta[EP_NP + 1], ep_tb[EP_NP + 1], ep_tc[EP_NP + 1], ep_acc[EP_NP + 1] = {0};
    const int ep_integrals = ep_q->ep_nodes > 0;
    const scalar_t ep_h = ep_length / EP_SUBSTEPS;
    (void)ep_rate;
    memcpy(ep_nodes, ep_x0, EP_NS * sizeof(scalar_t));
    for (int ep_k = 0; ep_k < EP_SUBSTEPS; ++ep_k)
        epf_step(ep_h, ep_nodes + ep_k * EP_NS, ep_p, ep_nodes + (ep_k + 1) * EP_NS);
    for (int ep_k = EP_SUBSTEPS - 1; ep_k >= 0; --ep_k) {
        const scalar_t *ep_xa = ep_nodes + (ep_k + 1) * EP_NS, *ep_xc = ep_nodes + ep_k * EP_NS;
        epf_step(ep_h / 2, ep_xc, ep_p, ep_xm);
        epf_adjoint_rate(ep_xa, ep_lam, ep_p, ep_k1);
        for (int ep_i = 0; ep_i < EP_NS; ++ep_i)
            ep_arg[ep_i] = ep_lam[ep_i] + 0.5 * ep_h * ep_k1[ep_i];
        epf_adjoint_rate(ep_xm, ep_arg, ep_p, ep_k2);
        for (int ep_i = 0; ep_i < EP_NS; ++ep_i)
            ep_arg[ep_i] = ep_lam[ep_i] + 0.5 * ep_h * ep_k2[ep_i];
        epf_adjoint_rate(ep_xm, ep_arg, ep_p, ep_k3);
        for (int ep_i = 0; ep_i < EP_NS; ++ep_i)
            ep_arg[ep_i] = ep_lam[ep_i] + 1.0 * ep_h * ep_k3[ep_i];
        epf_adjoint_rate(ep_xc, ep_arg, ep_p, ep_k4);
        for (int ep_i = 0; ep_i < EP_NS; ++ep_i)
            ep_before[ep_i] = ep_lam[ep_i] + ep_h / 6 * (ep_k1[ep_i] + 2 * ep_k2[ep_i] + 2 * ep_k3[ep_i] + ep_k4[ep_i]);
        if (ep_integrals) {
            epf_adjoint_rate(ep_xc, ep_before, ep_p, ep_slope);
            for (int ep_i = 0; ep_i < EP_NS; ++ep_i)
                ep_mid[ep_i] = (ep_lam[ep_i] + ep_before[ep_i]) / 2 + ep_h / 8 * (ep_k1[ep_i] - ep_slope[ep_i]);
            epf_integrand(ep_xa, ep_lam, ep_p, ep_ta);
            epf_integrand(ep_xm, ep_mid, ep_p, ep_tb);
            epf_integrand(ep_xc, ep_before, ep_p, ep_tc);
            for (int ep_i = 0; ep_i < EP_NP; ++ep_i)
                ep_acc[ep_i] += ep_h / 6 * (ep_ta[ep_i] + 4 * ep_tb[ep_i] + ep_tc[ep_i]);
        }
        memcpy(ep_lam, ep_before, sizeof ep_before);
    }
    if (ep_integrals)
        for (int ep_i = 0; ep_i < EP_NP; ++ep_i)
            ep_dp[ep_i] += ep_acc[ep_i];
}

static scalar_t eph_norm(const scalar_t *ep_p) {  /* no |A|: the stepped backward takes no panels */
    (void)ep_p;
    return 0;
}
#endif

static void eph_add(scalar_t *ep_to, const scalar_t *ep_terms) {
    for (int ep_i = 0; ep_i < EP_NP; ++ep_i)
        ep_to[ep_i] += ep_terms[ep_i];
}

/* the adjoint through one logged item (an event: its spike, then its jump), backwards; lam is lambda after it */
static void eph_item_adjoint(const ep_layer_t *ep_L, const ep_item_t *ep_item, int64_t ep_b, int64_t ep_j,
                             int64_t ep_slot, scalar_t *ep_lam, const scalar_t *ep_errors, int64_t ep_width,
                             scalar_t *ep_d_times, scalar_t *ep_d_w,
                            scalar_t *ep_dp) {
    const scalar_t *ep_p = ep_L->ep_params + ep_j * EP_NP;
    const scalar_t ep_error = ep_errors != NULL && (ep_item->ep_kind == EP_SPIKE || ep_item->ep_fired)
                           ? ep_errors[(ep_b * ep_L->ep_N + ep_j) * ep_width + ep_slot] : 0;
    scalar_t ep_out[EP_NS], ep_terms[EP_NP + 1];
    if (ep_item->ep_kind == EP_SPIKE) {
        epf_spike_adjoint(ep_item->ep_a, ep_lam, ep_error, ep_p, ep_out, ep_terms);
        eph_add(ep_dp, ep_terms);
        memcpy(ep_lam, ep_out, sizeof ep_out);
        return;
    }
    scalar_t ep_time_error = 0;
    if (ep_item->ep_fired) {
        scalar_t ep_f_mid[EP_NS], ep_post[EP_NS], ep_f_post[EP_NS];
        epf_reset_vjp(ep_item->ep_b, ep_lam, ep_p, ep_out, ep_terms);
        epf_rate(ep_item->ep_b, ep_p, ep_f_mid);
        epf_reset(ep_item->ep_b, ep_p, ep_post);
        epf_rate(ep_post, ep_p, ep_f_post);
        for (int ep_k = 0; ep_k < EP_NS; ++ep_k)
            ep_time_error += ep_out[ep_k] * ep_f_mid[ep_k] - ep_lam[ep_k] * ep_f_post[ep_k];
        ep_time_error += ep_error;
        eph_add(ep_dp, ep_terms);
        memcpy(ep_lam, ep_out, sizeof ep_out);
    }
    scalar_t ep_weight, ep_event_error;
    epf_input_adjoint(ep_item->ep_a, ep_lam, ep_item->ep_w, ep_p, &ep_weight, ep_terms, &ep_event_error);
    const int64_t ep_lane = eph_lane(ep_L, ep_b, ep_j);
    const int64_t ep_at = ep_L->ep_ev_index[ep_lane * ep_L->ep_M + ep_item->ep_event];
    ep_d_w[ep_j * ep_L->ep_I + ep_at / ep_L->ep_K] += ep_weight;
    eph_add(ep_dp, ep_terms);
    ep_d_times[ep_lane * ep_L->ep_I * ep_L->ep_K + ep_at] += ep_time_error + ep_event_error;
}

/* the input events' first index per grid interval of a lane: first[n] (first[T]: the count) */
static void eph_firsts(const ep_layer_t *ep_L, int64_t ep_lane, int64_t *ep_first) {
    const scalar_t *ep_times = ep_L->ep_ev_time + ep_lane * ep_L->ep_M;
    int64_t ep_e = 0;
    for (int64_t ep_n = 0; ep_n < ep_L->ep_T; ++ep_n) {
        ep_first[ep_n] = ep_e;
        const scalar_t ep_grid = (scalar_t)(ep_n + 1) * ep_L->ep_dt;
        while (ep_e < ep_L->ep_ev_count[ep_lane] && ep_times[ep_e] <= ep_grid)
            ++ep_e;
    }
    ep_first[ep_L->ep_T] = ep_e;
}

/* one row's adjoint, last interval first; lam0: lambda at t = 0 */
static int eph_row_adjoint(const ep_layer_t *ep_L, int64_t ep_b, int64_t ep_j, const int64_t *ep_first,
                           const scalar_t *ep_trace,
                           const int64_t *ep_counts, const scalar_t *ep_grad_trace, const scalar_t *ep_errors,
                           int64_t ep_width, const ep_quadrature_t *ep_q, ep_sink_t *ep_sink, scalar_t *ep_d_times,
                           scalar_t *ep_d_w, scalar_t *ep_dp,
                           scalar_t *ep_lam0) {
    const int64_t ep_row = ep_b * ep_L->ep_N + ep_j;
    const scalar_t *ep_p = ep_L->ep_params + ep_j * EP_NP;
    const scalar_t ep_speed = eph_norm(ep_p);
    scalar_t ep_lam[EP_NS] = {0}, ep_start[EP_NS], ep_x[EP_NS], ep_after[EP_NS];
    int64_t ep_remaining = ep_counts[ep_row];
    for (int64_t ep_n = ep_L->ep_T - 1; ep_n >= 0; --ep_n) {
        const scalar_t *ep_from = ep_n ? ep_trace + (((ep_n - 1) * ep_L->ep_B + ep_b) * ep_L->ep_N + ep_j) * EP_NS
                                       : ep_L->ep_initial + ep_j * EP_NS;
        memcpy(ep_start, ep_from, sizeof ep_start);
        memcpy(ep_x, ep_start, sizeof ep_x);
        ep_sink->ep_count = 0;
        ep_sink->ep_n_items = 0;
        int64_t ep_e = ep_first[ep_n];
        int ep_rc = eph_run(ep_L, ep_b, ep_j, ep_x, ep_n, ep_n + 1, &ep_e, ep_sink, NULL);
        if (ep_rc != EP_OK)
            return ep_rc;
        const int64_t ep_base = ep_remaining - ep_sink->ep_count;
        ep_remaining = ep_base;
        if (ep_grad_trace != NULL)
            for (int ep_k = 0; ep_k < EP_NS; ++ep_k)
                ep_lam[ep_k] += ep_grad_trace[ep_row * EP_NS + (ep_n * ep_L->ep_B * ep_L->ep_N) * EP_NS + ep_k];
        scalar_t ep_cur = (scalar_t)(ep_n + 1) * ep_L->ep_dt;
        for (int64_t ep_m = ep_sink->ep_n_items - 1; ep_m >= 0; --ep_m) {
            const ep_item_t *ep_item = &ep_sink->ep_items[ep_m];
            if (ep_item->ep_kind == EP_SPIKE)
                epf_reset(ep_item->ep_a, ep_p, ep_after);
            else if (ep_item->ep_fired)
                epf_reset(ep_item->ep_b, ep_p, ep_after);
            else
                memcpy(ep_after, ep_item->ep_b, sizeof ep_after);
            eph_flow_back(ep_after, ep_lam, ep_cur - ep_item->ep_t, ep_p, ep_speed, ep_q, ep_dp);
            eph_item_adjoint(ep_L, ep_item, ep_b, ep_j, ep_base + ep_item->ep_slot, ep_lam, ep_errors, ep_width,
                             ep_d_times, ep_d_w, ep_dp);
            ep_cur = ep_item->ep_t;
        }
        eph_flow_back(ep_start, ep_lam, ep_cur - (scalar_t)ep_n * ep_L->ep_dt, ep_p, ep_speed, ep_q, ep_dp);
    }
    memcpy(ep_lam0, ep_lam, sizeof ep_lam);
    return EP_OK;
}

int eventprop_backward(int ep_threads, ep_layer_t ep_L, const scalar_t *ep_trace, const int64_t *ep_counts,
                       const scalar_t *ep_grad_trace, const scalar_t *ep_errors, int64_t ep_width, ep_quadrature_t ep_q,
                       scalar_t *ep_d_times, scalar_t *ep_d_w, scalar_t *ep_d_params, scalar_t *ep_lam0) {
    int ep_status = EP_OK;
#pragma omp parallel num_threads(ep_threads) reduction(max : ep_status)
    {
        int ep_thread = 0;
#ifdef _OPENMP
        ep_thread = omp_get_thread_num();
#endif
        ep_sink_t ep_sink = {NULL, 0, 0, NULL, 0, 0};
        int64_t *ep_first = malloc((size_t)(ep_L.ep_T + 1) * sizeof(int64_t));
        if (ep_first == NULL)
            ep_status = EP_NO_MEMORY;
#pragma omp for schedule(dynamic, 1)
        for (int64_t ep_b = 0; ep_b < ep_L.ep_B; ++ep_b) {
            if (ep_first == NULL)
                continue;
            for (int64_t ep_j = 0; ep_j < ep_L.ep_N; ++ep_j) {
                const int64_t ep_row = ep_b * ep_L.ep_N + ep_j;
                if (ep_j == 0 || ep_L.ep_per_row)
                    eph_firsts(&ep_L, eph_lane(&ep_L, ep_b, ep_j), ep_first);
                int ep_rc = eph_row_adjoint(&ep_L, ep_b, ep_j, ep_first, ep_trace, ep_counts, ep_grad_trace,
                                            ep_errors, ep_width, &ep_q, &ep_sink, ep_d_times,
                                            ep_d_w + ep_thread * ep_L.ep_N * ep_L.ep_I, ep_d_params + ep_row * EP_NP,
                                            ep_lam0 + ep_row * EP_NS);
                ep_status = ep_rc > ep_status ? ep_rc : ep_status;
            }
        }
        free(ep_first);
        free(ep_sink.ep_items);
    }
    return ep_status;
}
