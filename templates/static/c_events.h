/* Products over events: out[b, :] = base[b, :] + sum over the nonzero x[b, i] of x[b, i] * W[:, i], then + bias.
   The weight comes tiled and transposed, wt [ceil(O / EV_TILE), I, EV_TILE] (columns past O zero): each term adds
   one contiguous EV_TILE-wide piece of a row, and a tile of outputs (one 256-byte piece per input, all tiles'
   pieces of one input apart) stays in the core's L2 cache while every batch row's events run over it. Exact for any
   values of x, not only 0 and 1: the sum skips only the zero terms, and each output's terms are added in the order
   of the inputs, from 0, as the untiled sum adds them. First each row's nonzero columns go to ev_index
   ([B, I + 1]: the count, then the columns); where there are more than ev_dense_above of them in all, nothing is
   written and 1 is returned (the caller runs the dense product instead), else the product is written and 0
   returned. base and bias may be NULL; out must not overlap x, wt, base or bias. (tile, row) pairs are spread over
   ev_threads OpenMP threads where the work is large enough. */
#include <stdint.h>
#include <string.h>

#define EV_PARALLEL_WORK 262144 /* multiply-adds below which one thread runs the product */
#define EV_TILE_BYTES 256       /* a tile's width: 64 fp32 or 32 fp64 outputs, eight 32-byte vectors of sums */

#if defined(__GNUC__) /* gcc and clang: the tile's sums in eight vector registers */
#define EV_TILE_SUMS(ev_scalar, ev_suffix)                                                                           \
    typedef ev_scalar ev_vector_##ev_suffix __attribute__((vector_size(32)));                                        \
    static inline void ev_tile_sums_##ev_suffix(ev_scalar *restrict ev_sums, const ev_scalar *ev_xb,                 \
                                                const int32_t *ev_columns, int32_t ev_n,                             \
                                                const ev_scalar *restrict ev_tile) {                                 \
        enum { ev_lanes = 32 / sizeof(ev_scalar), ev_width = EV_TILE_BYTES / sizeof(ev_scalar) };                   \
        ev_vector_##ev_suffix ev_acc[8];                                                                             \
        for (int ev_j = 0; ev_j < 8; ++ev_j) ev_acc[ev_j] = (ev_vector_##ev_suffix){0};                              \
        for (int32_t ev_k = 0; ev_k < ev_n; ++ev_k) {                                                                \
            const ev_scalar ev_v = ev_xb[ev_columns[ev_k]];                                                          \
            const ev_scalar *restrict ev_w = ev_tile + (int64_t)ev_columns[ev_k] * ev_width;                         \
            for (int ev_j = 0; ev_j < 8; ++ev_j) {                                                                   \
                ev_vector_##ev_suffix ev_piece;                                                                      \
                memcpy(&ev_piece, ev_w + ev_j * ev_lanes, sizeof ev_piece);                                          \
                ev_acc[ev_j] += ev_v * ev_piece;                                                                     \
            }                                                                                                        \
        }                                                                                                            \
        memcpy(ev_sums, ev_acc, sizeof ev_acc);                                                                      \
    }
#else /* another compiler: the same sums, in the same order, through memory */
#define EV_TILE_SUMS(ev_scalar, ev_suffix)                                                                           \
    static inline void ev_tile_sums_##ev_suffix(ev_scalar *restrict ev_sums, const ev_scalar *ev_xb,                 \
                                                const int32_t *ev_columns, int32_t ev_n,                             \
                                                const ev_scalar *restrict ev_tile) {                                 \
        enum { ev_width = EV_TILE_BYTES / sizeof(ev_scalar) };                                                       \
        for (int ev_j = 0; ev_j < ev_width; ++ev_j) ev_sums[ev_j] = 0;                                               \
        for (int32_t ev_k = 0; ev_k < ev_n; ++ev_k) {                                                                \
            const ev_scalar ev_v = ev_xb[ev_columns[ev_k]];                                                          \
            const ev_scalar *restrict ev_w = ev_tile + (int64_t)ev_columns[ev_k] * ev_width;                         \
            for (int ev_j = 0; ev_j < ev_width; ++ev_j) ev_sums[ev_j] += ev_v * ev_w[ev_j];                          \
        }                                                                                                            \
    }
#endif

#define EV_PRODUCT(ev_scalar, ev_suffix)                                                                             \
    EV_TILE_SUMS(ev_scalar, ev_suffix)                                                                               \
    int flexgen_event_product_##ev_suffix(                                                                           \
        int64_t ev_B, int64_t ev_I, int64_t ev_O, const ev_scalar *ev_x, int64_t ev_x_stride,                       \
        const ev_scalar *restrict ev_wt, const ev_scalar *restrict ev_base, int64_t ev_base_stride,                 \
        const ev_scalar *restrict ev_bias, ev_scalar *ev_out, int64_t ev_out_stride, int32_t *restrict ev_index,     \
        int64_t ev_dense_above, int ev_threads) {                                                                    \
        enum { ev_width = EV_TILE_BYTES / sizeof(ev_scalar) };                                                       \
        const int64_t ev_tiles = (ev_O + ev_width - 1) / ev_width;                                                   \
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
        const int ev_parallel = ev_threads > 1 && ev_total * ev_O >= EV_PARALLEL_WORK;                               \
        _Pragma("omp parallel for collapse(2) num_threads(ev_threads) if (ev_parallel)")                             \
        for (int64_t ev_t = 0; ev_t < ev_tiles; ++ev_t) {                                                            \
            for (int64_t ev_b = 0; ev_b < ev_B; ++ev_b) {                                                            \
                const int32_t *ev_columns = ev_index + ev_b * (ev_I + 1) + 1;                                        \
                ev_scalar ev_sums[ev_width];                                                                         \
                ev_tile_sums_##ev_suffix(ev_sums, ev_x + ev_b * ev_x_stride, ev_columns, ev_columns[-1],             \
                                         ev_wt + ev_t * ev_I * ev_width);                                            \
                const int64_t ev_o0 = ev_t * ev_width;                                                               \
                const int64_t ev_n_out = ev_O - ev_o0 < ev_width ? ev_O - ev_o0 : ev_width;                          \
                ev_scalar *restrict ev_row = ev_out + ev_b * ev_out_stride + ev_o0;                                  \
                const ev_scalar *restrict ev_from = ev_base ? ev_base + ev_b * ev_base_stride + ev_o0 : NULL;        \
                for (int64_t ev_o = 0; ev_o < ev_n_out; ++ev_o) {                                                    \
                    ev_scalar ev_value = ev_from ? ev_from[ev_o] + ev_sums[ev_o] : ev_sums[ev_o];                    \
                    ev_row[ev_o] = ev_bias ? ev_value + ev_bias[ev_o0 + ev_o] : ev_value;                            \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

EV_PRODUCT(float, f32)
EV_PRODUCT(double, f64)
