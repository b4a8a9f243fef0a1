@triton.jit
def other_neighbour(exact, nearest):
    """The 16-bit value next to `nearest` (`exact` rounded to nearest) on the other side of `exact`."""
    toward_zero = exact.to(nearest.dtype, fp_downcast_rounding="rtz")
    away_from_zero = (toward_zero.to(tl.int16, bitcast=True) + 1).to(nearest.dtype, bitcast=True)
    return tl.where(nearest == toward_zero, away_from_zero, toward_zero)
