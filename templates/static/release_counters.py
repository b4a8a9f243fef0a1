if SPLIT > 1:  # the counters are kept for the next launch: the last program out zeroes them
    rec_row_tiles = tl.cdiv(n_batch, BLOCK_B)
    if tl.atomic_add(rec_sync_ptr + 1 + rec_row_tiles, 1) == rec_row_tiles * SPLIT - 1:
        for rec_counter in range(0, 2 + rec_row_tiles):
            tl.atomic_xchg(rec_sync_ptr + rec_counter, 0)
