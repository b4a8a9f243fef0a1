"""The Triton kernels of an EventProp layer: the functions of `flexgen.derive.eventprop_program` printed by the
Triton printer (`flexgen.printing.triton`) as `@triton.jit` helpers, in the frame `eventprop_kernels.py.j2`,
followed by the event loop and the adjoint sweep, written once for every neuron
(`templates/static/eventprop_triton.py`).

A program holds a block of neurons of one sample (a feed-forward layer) or all of them (a recurrent layer,
static/eventprop_triton_recurrent.py), one lane each, and a lane's states (or adjoint) as one tile [BLOCK, SP]
(SP: the states padded to a power of two, zero beyond), its parameters as [BLOCK, PP]: the static part adds,
stores and sums whole tiles and never names a state. Each printed function takes its argument groups in the order
of `GROUPS` ("h" a value per lane, "x" a tile of states or adjoints, "p" the parameters' tile), reads the
columns its expressions use (a masked sum over the tile's columns: exact), and returns each group as a tile ("x" of
SP columns, "p" of PP) or, for a group of one value ("1"), as a value per lane: `RETURNS`.

Besides the program's functions, three scalars of the linear-flow bound are printed from the same expressions
(where the threshold is affine in the states): `norm` = |A|_inf (the largest row sum of |df/dx|, which also sets the
quadrature's panels), `curvature` = |A f(x)|_inf and `threshold_norm` = |dg/dx|_1. A neuron nonlinear between
events gets `step` and `adjoint_rate` instead of the closed forms, and the frame includes
static/eventprop_triton_substeps.py (its flow and backward by substeps; no bound)."""
import sympy

from ..derive.eventprop_program import Function
from ..errors import SpecError
from ..frames import frame
from ..printing.triton import TritonPrinter, is_literal
from .eventprop_c import threshold_gradient

GROUPS = {"flow": "hxp", "adjoint_flow": "hxp", "rate": "xp", "threshold": "xp", "gdot": "xp", "reset": "xp",
          "reset_vjp": "xxp", "spike_adjoint": "xxhp", "integrand": "xxp", "drive": "p", "input_adjoint": "xxhp",
          "norm": "p", "curvature": "xp", "threshold_norm": "p", "step": "hxp", "adjoint_rate": "xxp"}
RETURNS = {"flow": "x", "adjoint_flow": "x", "rate": "x", "threshold": "1", "gdot": "1", "reset": "x",
           "reset_vjp": "xp", "spike_adjoint": "xp", "integrand": "p", "drive": "x", "input_adjoint": "1p1",
           "norm": "1", "curvature": "1", "threshold_norm": "1", "step": "x", "adjoint_rate": "x"}


class _Printer(TritonPrinter):
    def _where(self, cond, a, b):  # the derived functions hold no condition; a Piecewise would be a derivation bug
        raise AssertionError(f"no condition expected in an EventProp function, got where({cond}, {a}, {b})")


def tile_width(n):
    """The power of two (at least 2) that holds n columns."""
    width = 2
    while width < n:
        width *= 2
    return width


def _maximum(printed):
    """Nested tl.maximum over printed values."""
    out = printed[0]
    for item in printed[1:]:
        out = f"tl.maximum({out}, {item})"
    return out


def bound_functions(program):
    """The `Function`s norm(p), curvature(x, p) and threshold_norm(p) (the last two None where the threshold is
    not affine in the states: no bound then)."""
    (rate,) = [f for f in program.functions if f.name == "rate"]
    (jacobian,) = [f for f in program.functions if f.name == "jacobian"]
    n = len(program.states)
    a = sympy.Matrix(n, n, jacobian.returns[0])
    rows = tuple(sum((sympy.Abs(a[r, c]) for c in range(n)), sympy.Integer(0)) for r in range(n))
    norm = Function("norm", tuple(program.parameters), (), (rows,))
    gradient = threshold_gradient(program)
    if gradient is None:
        return norm, None, None
    f = sympy.Matrix(rate.returns[0])
    curvature = Function("curvature", tuple(program.states) + tuple(program.parameters), (),
                         (tuple(sympy.Abs(e) for e in a * f),))
    q = gradient.returns[0]
    q_norm = Function("threshold_norm", tuple(program.parameters), (),
                      ((sum((sympy.Abs(e) for e in q), sympy.Integer(0)),),))
    return norm, curvature, q_norm


def _tile(items, width, like):
    """A [BLOCK, width] tile of the printed values (zero beyond them): each value times its column's indicator,
    so that a literal takes the tile's float64 (exactly) and a value per lane its lane."""
    columns = "ep_xc" if width == "SP" else "ep_pc"
    terms = [f"tl.zeros([{like}.shape[0], {width}], tl.float64)"]
    for k, item in enumerate(items):
        if item in ("0", "0.0"):
            continue
        per_lane = f"tl.zeros([{like}.shape[0]], tl.float64) + {item}" if is_literal(item) else item
        value = f"({per_lane})[:, None]"
        terms.append(f"tl.where({columns} == {k}, {value}, 0.0)")
    return " + ".join(terms)


def _function_context(function, printer, n_states, n_params, reduce=None):
    """What the frame prints of one function: its parameters, the columns it reads (those its expressions use),
    its assignments and what it returns. reduce="max": the function's one group is reduced to its largest element
    (a value per lane)."""
    used = set()
    for _, e in function.assignments:
        used |= sympy.sympify(e).free_symbols
    for group in function.returns:
        for e in group:
            used |= sympy.sympify(e).free_symbols
    sizes = {"h": None, "x": n_states, "p": n_params}
    columns = {"x": "ep_xc", "p": "ep_pc"}
    args, parameters, loads = list(function.args), [], []
    for k, group in enumerate(GROUPS[function.name]):
        if sizes[group] is None:
            parameters.append(str(args.pop(0)))
            continue
        tile = f"ep_in{k}"
        parameters.append(tile)
        for i in range(sizes[group]):
            arg = args.pop(0)
            if arg in used:
                loads.append(f"{arg} = tl.sum(tl.where({columns[group]} == {i}, {tile}, 0.0), 1)")
    assert not args, f"{function.name}: arguments left over: {args}"
    like = f"ep_in{len(parameters) - 1}"  # the parameters' tile: every function takes it last
    code = [f"{s} = {printer.doprint(sympy.sympify(e))}" for s, e in function.assignments]
    returned = []
    for kind, group in zip(RETURNS[function.name], function.returns):
        items = [printer.doprint(sympy.sympify(e)) for e in group]
        if reduce == "max" or kind == "1":
            value = _maximum(items) if reduce == "max" else items[0]
            returned.append(f"tl.zeros([{like}.shape[0]], tl.float64) + {value}")
        else:
            returned.append(_tile(items, "SP" if kind == "x" else "PP", like))
    return {"name": function.name, "parameters": ", ".join(parameters), "loads": loads, "code": code,
            "returns": ", ".join(returned)}


def triton_source(program, name, substeps=8):
    """The Triton module of one EventProp layer of the neuron `name`: for a neuron linear between events the
    closed forms of exp(A h) and exp(A^T h) (`substeps` is then not used), for any other one step of its method
    (`epf_step`) and the adjoint's rate, which the kernels take `substeps` times a piece
    (static/eventprop_triton_substeps.py: the C kernels' stepped flow and backward)."""
    if not program.linear and (isinstance(substeps, bool) or not isinstance(substeps, int) or substeps < 1):
        raise SpecError(f"{name}: the EventProp Triton kernels take a positive number of substeps for a neuron "
                        f"nonlinear between events, got {substeps!r}")
    printer = _Printer()
    n_states, n_params = len(program.states), len(program.parameters)
    functions = [_function_context(f, printer, n_states, n_params) for f in program.functions
                 if f.name in GROUPS]
    bound = False
    if program.linear:  # |A| (the quadrature's panels) and the linear-flow bound
        norm, curvature, q_norm = bound_functions(program)
        functions.append(_function_context(norm, printer, n_states, n_params, reduce="max"))
        bound = curvature is not None
        if bound:
            functions.append(_function_context(curvature, printer, n_states, n_params, reduce="max"))
            functions.append(_function_context(q_norm, printer, n_states, n_params))
    return frame("eventprop_kernels.py.j2").render(
        name=name, n_states=n_states, n_params=n_params, sp=tile_width(n_states), pp=tile_width(max(n_params, 1)),
        functions=functions, bound=int(bound), linear=int(program.linear),
        substeps=1 if program.linear else substeps)
