/* Products over events: out[b, :] = base[b, :] + sum over the nonzero x[b, i] of x[b, i] * wt[i, :], then + bias;
   the weight transposed ([I, O], contiguous), so each term adds one contiguous row along the outputs (vectorised).
   Exact for any values of x, not only 0 and 1: the sum skips only the zero terms. First each row's nonzero columns
   go to ev_index ([B, I + 1]: the count, then the columns); where there are more than ev_dense_above of them in
   all, nothing is written and 1 is returned (the caller runs the dense product instead), else the product is
   written and 0 returned. base and bias may be NULL; out must not overlap x, wt, base or bias. Rows are spread
   over ev_threads OpenMP threads where the work is large enough. */
#include <stdint.h>

#define EV_PARALLEL_WORK 262144 /* multiply-adds below which one thread runs the product */

#define EV_PRODUCT(ev_scalar, ev_name)                                                                               \
    int ev_name(                                                                                                     \
        int64_t ev_B, int64_t ev_I, int64_t ev_O, const ev_scalar *ev_x, int64_t ev_x_stride,                       \
        const ev_scalar *restrict ev_wt, const ev_scalar *restrict ev_base, int64_t ev_base_stride,                 \
        const ev_scalar *restrict ev_bias, ev_scalar *ev_out, int64_t ev_out_stride, int32_t *restrict ev_index,     \
        int64_t ev_dense_above, int ev_threads) {                                                                    \
        int64_t ev_total = 0;                                                                                        \
        for (int64_t ev_b = 0; ev_b < ev_B; ++ev_b) {                                                                \
            const ev_scalar *ev_xb = ev_x + ev_b * ev_x_stride;                                                      \
            int32_t *ev_columns = ev_index + ev_b * (ev_I + 1) + 1;                                                  \
            int32_t ev_n = 0;                                                                                        \
            for (int64_t ev_i = 0; ev_i < ev_I; ++ev_i) { /* branch-free: a slot is overwritten unless kept */     \
                ev_columns[ev_n] = (int32_t)ev_i;                                                                    \
                ev_n += ev_xb[ev_i] != 0;                                                                            \
            }                                                                                                        \
            ev_columns[-1] = ev_n;                                                                                   \
            ev_total += ev_n;                                                                                        \
        }                                                                                                            \
        if (ev_total > ev_dense_above) return 1;                                                                     \
        _Pragma("omp parallel for num_threads(ev_threads) if (ev_threads > 1 && ev_total * ev_O >= EV_PARALLEL_WORK)") \
        for (int64_t ev_b = 0; ev_b < ev_B; ++ev_b) {                                                                \
            const ev_scalar *ev_xb = ev_x + ev_b * ev_x_stride;                                                      \
            const int32_t *ev_columns = ev_index + ev_b * (ev_I + 1) + 1;                                            \
            const int32_t ev_n = ev_columns[-1];                                                                     \
            ev_scalar *restrict ev_row = ev_out + ev_b * ev_out_stride; /* the sums, in place (L1) */              \
            for (int64_t ev_o = 0; ev_o < ev_O; ++ev_o) ev_row[ev_o] = 0;                                            \
            for (int32_t ev_k = 0; ev_k < ev_n; ++ev_k) {                                                            \
                const ev_scalar ev_v = ev_xb[ev_columns[ev_k]];                                                      \
                const ev_scalar *restrict ev_w = ev_wt + (int64_t)ev_columns[ev_k] * ev_O;                           \
                for (int64_t ev_o = 0; ev_o < ev_O; ++ev_o) ev_row[ev_o] += ev_v * ev_w[ev_o];                       \
            }                                                                                                        \
            if (ev_base) {                                                                                           \
                const ev_scalar *restrict ev_from = ev_base + ev_b * ev_base_stride;                                 \
                for (int64_t ev_o = 0; ev_o < ev_O; ++ev_o) ev_row[ev_o] = ev_from[ev_o] + ev_row[ev_o];             \
            }                                                                                                        \
            if (ev_bias)                                                                                             \
                for (int64_t ev_o = 0; ev_o < ev_O; ++ev_o) ev_row[ev_o] += ev_bias[ev_o];                           \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

EV_PRODUCT(float, flexgen_event_product_f32)
EV_PRODUCT(double, flexgen_event_product_f64)
