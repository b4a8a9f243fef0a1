/* Products over events: out[b, :] = base[b, :] + sum over the nonzero x[b, i] of x[b, i] * W[:, i], then + bias.
   The weight comes tiled and transposed, wt [ceil(O / EV_TILE), I, EV_TILE] (columns past O zero): each term adds
   one contiguous EV_TILE-wide piece of a row. Exact for any values of x, not only 0 and 1: the sum skips only the
   zero terms, and each output's terms are added in the order of the inputs, from 0, as the untiled sum adds them.
   Two ways through a tile, with the same sums (the caller chooses: ev_by_inputs):
   - by rows: each row's nonzero columns go to ev_index ([B, I + 1]: the count, then
     the columns); a row's sums stay in eight vector registers while its events gather their pieces from the tile
     (one 256-byte piece per input, all tiles' pieces of one input apart), which stays in the L2 cache over the rows;
   - by inputs, in chunks of up to EV_CHUNK_ROWS rows: for each chunk, the rows of each column
     with a nonzero entry go to ev_index (I + 1 offsets, then the rows, column after column); a tile's pieces are
     read once a chunk, in order (at the memory's streaming rate where the tile is in no cache, where the other
     way's gathers wait a latency each), and each piece is added to the sums of the chunk's rows that have that
     input, a [EV_CHUNK_ROWS, EV_TILE] block that stays in the L1 cache.
   Where more than ev_dense_above entries are nonzero in all, nothing is written and 1 is returned (the caller runs
   the dense product instead), else the product is written and 0 returned. ev_index holds
   B * I + max(B, chunks * (I + 1)) int32, chunks = ceil(B / EV_CHUNK_ROWS). base and bias may be NULL; out must not
   overlap x, wt, base or bias. (tile, row) pairs (by rows) or (tile, chunk) pairs (by inputs) are spread over
   ev_threads OpenMP threads where the work is large enough. */
#include <stdint.h>
#include <string.h>

#define EV_PARALLEL_WORK 262144 /* multiply-adds below which one thread runs the product */
#define EV_TILE_BYTES 256       /* a tile's width: 64 fp32 or 32 fp64 outputs, eight 32-byte vectors of sums */
#define EV_CHUNK_ROWS 32        /* rows of a chunk, by inputs: their sums of one tile, 8 KiB, stay in L1 */
#define EV_AHEAD 6              /* by inputs (gcc, clang): pieces asked for this many inputs ahead */

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
    }                                                                                                                \
    static inline void ev_block_sums_##ev_suffix(ev_scalar *restrict ev_block, int64_t ev_b0, int64_t ev_rows,       \
                                                 const ev_scalar *ev_x, int64_t ev_x_stride, int64_t ev_I,           \
                                                 const int32_t *ev_at, const ev_scalar *restrict ev_tile) {          \
        enum { ev_lanes = 32 / sizeof(ev_scalar), ev_width = EV_TILE_BYTES / sizeof(ev_scalar) };                    \
        memset(ev_block, 0, (size_t)ev_rows * EV_TILE_BYTES);                                                        \
        const int32_t *ev_which = ev_at + ev_I + 1; /* the rows, column after column */                              \
        for (int64_t ev_i = 0; ev_i < ev_I; ++ev_i) {                                                                \
            if (ev_i + EV_AHEAD < ev_I) /* the piece EV_AHEAD inputs on, asked for now */                            \
                for (int ev_l = 0; ev_l < EV_TILE_BYTES; ev_l += 64)                                                 \
                    __builtin_prefetch((const char *)(ev_tile + (ev_i + EV_AHEAD) * ev_width) + ev_l, 0, 3);         \
            if (ev_at[ev_i] == ev_at[ev_i + 1]) continue;                                                            \
            ev_vector_##ev_suffix ev_piece[8];                                                                       \
            memcpy(ev_piece, ev_tile + ev_i * ev_width, sizeof ev_piece);                                            \
            for (int32_t ev_k = ev_at[ev_i]; ev_k < ev_at[ev_i + 1]; ++ev_k) {                                       \
                const int64_t ev_b = ev_which[ev_k];                                                                 \
                const ev_scalar ev_v = ev_x[ev_b * ev_x_stride + ev_i];                                              \
                ev_scalar *restrict ev_sums = ev_block + (ev_b - ev_b0) * ev_width;                                  \
                for (int ev_j = 0; ev_j < 8; ++ev_j) {                                                               \
                    ev_vector_##ev_suffix ev_acc;                                                                    \
                    memcpy(&ev_acc, ev_sums + ev_j * ev_lanes, sizeof ev_acc);                                       \
                    ev_acc += ev_v * ev_piece[ev_j];                                                                 \
                    memcpy(ev_sums + ev_j * ev_lanes, &ev_acc, sizeof ev_acc);                                       \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
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
    }                                                                                                                \
    static inline void ev_block_sums_##ev_suffix(ev_scalar *restrict ev_block, int64_t ev_b0, int64_t ev_rows,       \
                                                 const ev_scalar *ev_x, int64_t ev_x_stride, int64_t ev_I,           \
                                                 const int32_t *ev_at, const ev_scalar *restrict ev_tile) {          \
        enum { ev_width = EV_TILE_BYTES / sizeof(ev_scalar) };                                                       \
        for (int64_t ev_j = 0; ev_j < ev_rows * ev_width; ++ev_j) ev_block[ev_j] = 0;                                \
        const int32_t *ev_which = ev_at + ev_I + 1;                                                                  \
        for (int64_t ev_i = 0; ev_i < ev_I; ++ev_i) {                                                                \
            const ev_scalar *restrict ev_w = ev_tile + ev_i * ev_width;                                              \
            for (int32_t ev_k = ev_at[ev_i]; ev_k < ev_at[ev_i + 1]; ++ev_k) {                                       \
                const ev_scalar ev_v = ev_x[ev_which[ev_k] * ev_x_stride + ev_i];                                    \
                ev_scalar *restrict ev_sums = ev_block + (ev_which[ev_k] - ev_b0) * ev_width;                        \
                for (int ev_j = 0; ev_j < ev_width; ++ev_j) ev_sums[ev_j] += ev_v * ev_w[ev_j];                      \
            }                                                                                                        \
        }                                                                                                            \
    }
#endif

#define EV_PRODUCT(ev_scalar, ev_suffix)                                                                             \
    EV_TILE_SUMS(ev_scalar, ev_suffix)                                                                               \
    /* out[b, o0:o0 + n] = base[b, o0:o0 + n] + sums, then + bias: a tile's sums of one row, stored */               \
    static inline void ev_store_##ev_suffix(const ev_scalar *ev_sums, int64_t ev_b, int64_t ev_o0, int64_t ev_O,     \
                                            const ev_scalar *restrict ev_base, int64_t ev_base_stride,               \
                                            const ev_scalar *restrict ev_bias, ev_scalar *ev_out,                    \
                                            int64_t ev_out_stride) {                                                 \
        enum { ev_width = EV_TILE_BYTES / sizeof(ev_scalar) };                                                       \
        const int64_t ev_n_out = ev_O - ev_o0 < ev_width ? ev_O - ev_o0 : ev_width;                                  \
        ev_scalar *restrict ev_row = ev_out + ev_b * ev_out_stride + ev_o0;                                          \
        const ev_scalar *restrict ev_from = ev_base ? ev_base + ev_b * ev_base_stride + ev_o0 : NULL;                \
        for (int64_t ev_o = 0; ev_o < ev_n_out; ++ev_o) {                                                            \
            ev_scalar ev_value = ev_from ? ev_from[ev_o] + ev_sums[ev_o] : ev_sums[ev_o];                            \
            ev_row[ev_o] = ev_bias ? ev_value + ev_bias[ev_o0 + ev_o] : ev_value;                                    \
        }                                                                                                            \
    }                                                                                                                \
    int flexgen_event_product_##ev_suffix(                                                                           \
        int64_t ev_B, int64_t ev_I, int64_t ev_O, const ev_scalar *ev_x, int64_t ev_x_stride,                        \
        const ev_scalar *restrict ev_wt, const ev_scalar *restrict ev_base, int64_t ev_base_stride,                  \
        const ev_scalar *restrict ev_bias, ev_scalar *ev_out, int64_t ev_out_stride, int32_t *restrict ev_index,     \
        int64_t ev_dense_above, int ev_threads, int ev_by_inputs) {                                                  \
        enum { ev_width = EV_TILE_BYTES / sizeof(ev_scalar) };                                                       \
        const int64_t ev_tiles = (ev_O + ev_width - 1) / ev_width;                                                   \
        const int64_t ev_chunks = (ev_B + EV_CHUNK_ROWS - 1) / EV_CHUNK_ROWS;                                        \
        const int64_t ev_span = ev_I + 1 + (int64_t)EV_CHUNK_ROWS * ev_I; /* by inputs: a full chunk's list */       \
        int64_t ev_total = 0;                                                                                        \
        if (ev_by_inputs) { /* for each chunk of rows, the rows of each column's nonzero entries */                  \
            for (int64_t ev_c = 0; ev_c < ev_chunks; ++ev_c) {                                                       \
                const int64_t ev_b0 = ev_c * EV_CHUNK_ROWS;                                                          \
                const int64_t ev_b1 = ev_b0 + EV_CHUNK_ROWS < ev_B ? ev_b0 + EV_CHUNK_ROWS : ev_B;                   \
                int32_t *ev_at = ev_index + ev_c * ev_span, *ev_which = ev_at + ev_I + 1;                            \
                int32_t ev_n = 0;                                                                                    \
                for (int64_t ev_i = 0; ev_i < ev_I; ++ev_i) {                                                        \
                    ev_at[ev_i] = ev_n;                                                                              \
                    for (int64_t ev_b = ev_b0; ev_b < ev_b1; ++ev_b) { /* branch-free, as below */                   \
                        ev_which[ev_n] = (int32_t)ev_b;                                                              \
                        ev_n += ev_x[ev_b * ev_x_stride + ev_i] != 0;                                                \
                    }                                                                                                \
                }                                                                                                    \
                ev_at[ev_I] = ev_n;                                                                                  \
                ev_total += ev_n;                                                                                    \
            }                                                                                                        \
        } else { /* each row's nonzero columns */                                                                    \
            for (int64_t ev_b = 0; ev_b < ev_B; ++ev_b) {                                                            \
                const ev_scalar *ev_xb = ev_x + ev_b * ev_x_stride;                                                  \
                int32_t *ev_columns = ev_index + ev_b * (ev_I + 1) + 1;                                              \
                int32_t ev_n = 0;                                                                                    \
                for (int64_t ev_i = 0; ev_i < ev_I; ++ev_i) { /* branch-free: a slot is overwritten unless kept */   \
                    ev_columns[ev_n] = (int32_t)ev_i;                                                                \
                    ev_n += ev_xb[ev_i] != 0;                                                                        \
                }                                                                                                    \
                ev_columns[-1] = ev_n;                                                                               \
                ev_total += ev_n;                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        if (ev_total > ev_dense_above) return 1;                                                                     \
        const int ev_parallel = ev_threads > 1 && ev_total * ev_O >= EV_PARALLEL_WORK;                               \
        const int64_t ev_units = ev_by_inputs ? ev_chunks : ev_B; /* chunks of rows, or rows */                      \
        _Pragma("omp parallel for collapse(2) num_threads(ev_threads) if (ev_parallel)")                             \
        for (int64_t ev_t = 0; ev_t < ev_tiles; ++ev_t) {                                                            \
            for (int64_t ev_u = 0; ev_u < ev_units; ++ev_u) {                                                        \
                const ev_scalar *ev_tile = ev_wt + ev_t * ev_I * ev_width;                                           \
                if (ev_by_inputs) {                                                                                  \
                    const int64_t ev_b0 = ev_u * EV_CHUNK_ROWS;                                                      \
                    const int64_t ev_rows = ev_B - ev_b0 < EV_CHUNK_ROWS ? ev_B - ev_b0 : EV_CHUNK_ROWS;             \
                    ev_scalar ev_block[EV_CHUNK_ROWS * ev_width];                                                    \
                    ev_block_sums_##ev_suffix(ev_block, ev_b0, ev_rows, ev_x, ev_x_stride, ev_I,                     \
                                              ev_index + ev_u * ev_span, ev_tile);                                   \
                    for (int64_t ev_r = 0; ev_r < ev_rows; ++ev_r)                                                   \
                        ev_store_##ev_suffix(ev_block + ev_r * ev_width, ev_b0 + ev_r, ev_t * ev_width, ev_O,        \
                                             ev_base, ev_base_stride, ev_bias, ev_out, ev_out_stride);               \
                } else {                                                                                             \
                    const int32_t *ev_columns = ev_index + ev_u * (ev_I + 1) + 1;                                    \
                    ev_scalar ev_sums[ev_width];                                                                     \
                    ev_tile_sums_##ev_suffix(ev_sums, ev_x + ev_u * ev_x_stride, ev_columns, ev_columns[-1],         \
                                             ev_tile);                                                               \
                    ev_store_##ev_suffix(ev_sums, ev_u, ev_t * ev_width, ev_O, ev_base, ev_base_stride, ev_bias,     \
                                         ev_out, ev_out_stride);                                                     \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        return 0;                                                                                                    \
    }

EV_PRODUCT(float, f32)
EV_PRODUCT(double, f64)
