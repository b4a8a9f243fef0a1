"""What keeping a forward value for the backward costs (`read_cost`), and which values are 0 or 1 at every
step (`binary_values`), which the kernels keep in bytes."""
import sympy

from ..frontend.symbolic import SpikeBase, detach


def is_binary(expr, binary):
    """Whether `expr` is 0 or 1 for every value of its operands, given the symbols in `binary` are: a spike, a
    product, `1 - b`, a power, a `where`, a minimum or a maximum of such values, detached or not."""
    if expr.is_Number:
        return expr.is_zero or _is_one(expr)
    if expr.is_Symbol:
        return expr in binary
    if isinstance(expr, SpikeBase):
        return True
    if isinstance(expr, (detach, sympy.Max, sympy.Min)) or expr.is_Mul:
        return all(is_binary(a, binary) for a in expr.args)
    if expr.is_Pow:
        return expr.exp.is_Integer and expr.exp > 0 and is_binary(expr.base, binary)
    if isinstance(expr, sympy.Piecewise):
        return all(is_binary(value, binary) for value, _ in expr.args)
    if expr.is_Add and len(expr.args) == 2 and any(_is_one(a) for a in expr.args):  # 1 - b
        coeff, rest = [a for a in expr.args if not _is_one(a)][0].as_coeff_Mul()
        return (coeff + 1).is_zero and is_binary(rest, binary)
    return False


def _is_one(expr):
    """Whether `expr` is the number 1, as an Integer or a Float (sympy 1.13 on: Float(1.0) != 1)."""
    return expr.is_Number and (expr - 1).is_zero


def binary_values(trace, forward):
    """The values of the step that are 0 or 1 whatever its inputs, and the states that are after the first step
    (their new value is one of those values; their first is the caller's initial state)."""
    binary = set()
    for a in forward:
        if is_binary(a.expr, binary):
            binary.add(a.target)
    states = {trace.leaves[n] for n, new in zip(trace.states, trace.next_states) if is_binary(new, binary)}
    return binary | states


# What keeping a value for the backward costs, in bytes per fp32 value: an input or output is read again; another
# value is written and read back, in floats, or in bytes where it is 0 or 1. (One saved set serves every dtype, cut
# with fp32's sizes: in 16-bit I/O a byte is half a float, not a quarter, so there a byte written and read costs
# what re-reading an input does.)
READ_AGAIN, WRITTEN_AND_READ, IN_BYTES = 4, 8, 2


def read_cost(trace, binary):
    inputs = {trace.leaves[n] for n in trace.inputs}
    outputs = set(trace.outputs)

    def cost(s):
        if s in inputs or s in outputs:
            return READ_AGAIN
        return IN_BYTES if s in binary else WRITTEN_AND_READ

    return cost

