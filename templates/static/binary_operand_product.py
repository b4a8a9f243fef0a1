if DOT_PRECISION == "tf32x3":
    # 0 and 1 are exact in TF32, so two TF32 products (of the weight's big and small parts) give
    # tf32x3's sum. A slice's sum starts from zero and joins the running sum outside the tensor
    # cores, as tf32x3's does: their accumulation drops the low bits of a large running sum.
    rec_weight_big = tf32_nearest(rec_weight)
    rec_weight_small = tf32_nearest(rec_weight - rec_weight_big)
    rec_slice = tl.dot(rec_operand, rec_weight_small, input_precision="tf32", out_dtype=COMPUTE)
    rec_slice = tl.dot(rec_operand, rec_weight_big, rec_slice, input_precision="tf32",
                       out_dtype=COMPUTE)
    rec_current += rec_slice
else:
    rec_current = tl.dot(rec_operand, rec_weight, rec_current, input_precision=DOT_PRECISION,
                         out_dtype=COMPUTE)
