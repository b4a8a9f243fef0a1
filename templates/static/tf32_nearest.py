@triton.jit
def tf32_nearest(rec_part):
    """float32 `rec_part` rounded to TF32's 10 mantissa bits, to nearest (ties away from zero): a TF32 product
    reads it exactly (it drops the low 13 bits, which would round every value toward zero alike)."""
    return ((rec_part.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
