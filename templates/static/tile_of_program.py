rec_rows = pid.to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
rec_cols = pid_h * BLOCK + tl.arange(0, BLOCK)
offs = rec_rows[:, None] * n_hidden + rec_cols[None, :]  # neuron n = b * n_hidden + h of the [T, N] view
mask = (rec_rows < n_batch)[:, None] & (rec_cols < n_hidden)[None, :]
n_elem = n_batch * n_hidden
