"""`flexgen.DelayedLinear`'s hand-written Triton backends: two taps per synapse (`fused`), one tensor-core product
per tap (`taps`, with its tap matrices in `tap_matrices`), and what both share (`ops`: the eager autograd
function and the custom ops torch.compile traces)."""
