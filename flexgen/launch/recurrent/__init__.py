"""Launching a recurrent layer's kernels: the fused time loop with the product inside (`fused`, its custom ops in
`ops`, its tiling in `tiling`), the step-by-step path (`stepped`), the feedback's delay lines as the host runs
them (`lines`) and the long-sequence mode's replays (`replay`)."""
