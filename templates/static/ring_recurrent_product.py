rec_current = tl.zeros([BLOCK_B, BLOCK], dtype=COMPUTE)
for rec_k in range(0, n_hidden, BLOCK_K):
    rec_ks = rec_k + tl.arange(0, BLOCK_K)
    rec_operand = tl.load(rec_ring_ptr + (row % (N_TAPS + 1)) * n_elem + rec_rows[:, None] * n_hidden + rec_ks[None, :],
                          mask=(rec_rows < n_batch)[:, None] & (rec_ks < n_hidden)[None, :], other=0.0,
                          cache_modifier=".cg")  # past the SM's L1: other programs wrote them
    rec_weight = tl.load(rec_weight_ptr + rec_ks[:, None] * rec_weight_sc + rec_cols[None, :] * rec_weight_sr,
                         mask=(rec_ks < n_hidden)[:, None] & (rec_cols < n_hidden)[None, :], other=0.0)
    rec_current = tl.dot(rec_operand.to(rec_weight.dtype), rec_weight, rec_current, input_precision=DOT_PRECISION,
                         out_dtype=COMPUTE)
