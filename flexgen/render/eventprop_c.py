"""The C kernels of an EventProp layer: the functions of `flexgen.derive.eventprop_program` printed by the C
printer (`flexgen.printing.c`) as static C functions, in the frame `c_eventprop.c.j2`, followed by the event loop
and the adjoint sweep, hand-written once for every neuron (`templates/static/c_eventprop.h`).

Each printed function takes its argument groups in the order of `GROUPS` (a scalar, or an array of the states or
of the parameters) and writes each returned group to an output array: `epf_<name>(in0, in1, ..., out0, ...)`.
The static part calls them by these names only; nothing in it knows a neuron.

A neuron linear between events (`EP_LINEAR 1`) gets its exact flows printed (`epf_flow`, `epf_adjoint_flow`,
`epf_jacobian`). Any other gets one step of its spec's method (`epf_step`) and the adjoint's rate (df/dx)^T lambda
(`epf_adjoint_rate`); the static part then takes `epf_flow(h, ...)` as `EP_SUBSTEPS` steps of length h / substeps
(the torch reference's `Simulator.flow`) and its backward the reference's `_stepped_back`. The substeps are a
define (one library per value: the source, which keys the disk cache, holds it); a linear neuron's source does not
depend on them.

Where the threshold g is affine in the states, its gradient dg/dx (a function of the parameters alone) is printed
too, as `epf_threshold_gradient`, and `EP_BOUND` is 1: the root search then skips a piece between breakpoints on
which a bound from the linear flow shows that g stays below 0 (`eph_quiet` in the static part); a nonlinear
neuron has no such bound (`EP_BOUND` 0)."""
import sympy

from ..derive.eventprop_program import Function
from ..errors import SpecError
from ..frames import frame
from ..printing.c import CPrinter

# the argument groups of each function: "h" a scalar, "x" the states (or an adjoint), "p" the parameters
GROUPS = {"flow": "hxp", "adjoint_flow": "hxp", "jacobian": "p", "rate": "xp", "threshold": "xp", "gdot": "xp",
          "reset": "xp", "reset_vjp": "xxp", "spike_adjoint": "xxhp", "integrand": "xxp", "drive": "p",
          "input_adjoint": "xxhp", "threshold_gradient": "p", "step": "hxp", "adjoint_rate": "xxp"}
LINEAR_ONLY, NONLINEAR_ONLY = {"flow", "adjoint_flow", "jacobian"}, {"step", "adjoint_rate"}
# the backward of a nonlinear neuron keeps a piece's substep states on the stack: (substeps + 1) x states doubles
STACK_DOUBLES = 8192


class _Printer(CPrinter):
    def _where(self, cond, a, b):  # the derived functions hold no condition; a Piecewise would be a derivation bug
        raise AssertionError(f"no condition expected in an EventProp function, got where({cond}, {a}, {b})")


def _function_context(function, printer, n_states, n_params):
    """What the frame prints of one function: its C parameters, the loads of its arguments, its assignments and
    the stores of its results."""
    sizes = {"h": None, "x": n_states, "p": n_params}
    args, parameters, loads = list(function.args), [], []
    for k, group in enumerate(GROUPS[function.name]):
        if sizes[group] is None:
            parameters.append(f"const scalar_t {args.pop(0)}")
            continue
        parameters.append(f"const scalar_t *ep_in{k}")
        loads += [f"const scalar_t {args.pop(0)} = ep_in{k}[{i}];" for i in range(sizes[group])]
    assert not args, f"{function.name}: arguments left over: {args}"
    code = [f"const scalar_t {s} = {printer.doprint(sympy.sympify(e))};" for s, e in function.assignments]
    stores = []
    for k, group in enumerate(function.returns):
        parameters.append(f"scalar_t *ep_out{k}")
        stores += [f"ep_out{k}[{i}] = {printer.doprint(sympy.sympify(e))};" for i, e in enumerate(group)]
    return {"name": function.name, "parameters": ", ".join(parameters), "loads": loads, "code": code,
            "stores": stores}


def threshold_gradient(program):
    """The `Function` dg/dx of the parameters, or None where the threshold is not affine in the states."""
    (threshold,) = [f for f in program.functions if f.name == "threshold"]
    g = sympy.sympify(threshold.returns[0][0])
    gradient = tuple(sympy.diff(g, x) for x in program.states)
    if any(e.free_symbols & set(program.states) for e in gradient):
        return None
    return Function("threshold_gradient", tuple(program.parameters), (), (gradient,))


def max_substeps(program):
    """The most substeps the C kernels take for `program`'s neuron (a piece's substep states live on the stack)."""
    return STACK_DOUBLES // len(program.states) - 1


def c_source(program, name, substeps=8):
    """The C source of one EventProp layer of the neuron `name`: exact flows for a neuron linear between events
    (`substeps` is then not used), else `substeps` steps of its method per piece (SpecError past `max_substeps`)."""
    if not program.linear and not (isinstance(substeps, int) and 1 <= substeps <= max_substeps(program)):
        raise SpecError(f"{name}: the EventProp C kernels take 1 to {max_substeps(program)} substeps for this "
                        f"neuron (a piece's substep states are kept on the stack), got {substeps!r}; the torch "
                        "reference (backend='torch') takes more")
    printer = _Printer()
    n_states, n_params = len(program.states), len(program.parameters)
    functions = [_function_context(f, printer, n_states, n_params) for f in program.functions]
    expected = set(GROUPS) - {"threshold_gradient"} - (NONLINEAR_ONLY if program.linear else LINEAR_ONLY)
    assert {f["name"] for f in functions} == expected, "the EventProp program's functions changed"
    gradient = threshold_gradient(program) if program.linear else None  # the bound needs the linear flow
    if gradient is not None:
        functions.append(_function_context(gradient, printer, n_states, n_params))
    return frame("c_eventprop.c.j2").render(
        header=f"/* EventProp kernels of one dense layer of {name}, generated by flexgen from its equations */",
        name=name, n_states=n_states, n_params=n_params, functions=functions, bound=int(gradient is not None),
        linear=int(program.linear), substeps=None if program.linear else substeps)
