COMPUTE: tl.constexpr = tl.float64 if F64 else tl.float32
# One program: BLOCK_B batch rows (the row tile pid) by BLOCK hidden neurons (the slice pid_h of SPLIT; n_hidden
# padded to SPLIT * BLOCK). A step's recurrent product reads the step before's values of all hidden neurons of its
# rows: with SPLIT > 1 other programs wrote most of them, and a row tile's programs wait for each other every step.
if SPLIT > 1:  # tiles by ticket, in the order programs start: a row tile's programs then all get to run
    rec_ticket = tl.atomic_add(rec_sync_ptr, 1)
    pid = rec_ticket // SPLIT
    pid_h = rec_ticket % SPLIT
else:
    pid = tl.program_id(0)
    pid_h = 0
