"""Stage 1, trace: run the step function on symbols and record what it computes.

Takes a spec's function and static options; hands derive a `Trace` (a straight-line program over sympy symbols).

Every operation on a traced value (`Var`) appends one assignment to a
straight-line program, so the user's intermediate values (such as the
pre-spike potential `h`) survive as nodes that later stages can save, recompute
and name; plain sympy would fold them away. Local variable names are read back
from the step function's frame when it returns and become the node names.
"""
import dataclasses
import dis
import hashlib
import math
import numbers
import re

import sympy

from ..errors import SpecError
from .inlining import not_real
from .names import FRAME_NAMES, NameAllocator, check_derived_collisions, derived_forms, is_free_name
from .step_source import branch_construct, called_function, fail, flexgen_instead, step_frame
from .symbolic import SpikeBase

# Operations a traced step may record. The bundled neurons record 10 to 40; a step far beyond this is a
# long Python loop, whose kernels would take minutes to derive and compile.
MAX_TRACED_OPERATIONS = 5000

_NOT_REAL = {
    sympy.zoo: "zoo, complex infinity (a division by zero, or the log of zero)",
    sympy.oo: "oo, an infinite value",
    -sympy.oo: "-oo, an infinite value",
    sympy.nan: "nan, an undefined value",
    sympy.I: "I, an imaginary number (the square root, power or log of a negative number)",
}


@dataclasses.dataclass(frozen=True)
class Assign:
    """`target = expr`, one line of a straight-line program."""

    target: sympy.Symbol
    expr: sympy.Expr

    def __str__(self):
        return f"{self.target} = {sympy.sstr(self.expr)}"


@dataclasses.dataclass(frozen=True)
class Trace:
    """The step function as a straight-line program over named symbols.

    `program` computes every node from the leaves (inputs, states as they were
    before the step, hyper-parameters, learnable parameters); `outputs[k]` and
    `next_states[j]` are node symbols.
    """

    name: str
    inputs: tuple
    states: tuple
    hyper: tuple
    learnable: tuple
    static: tuple
    leaves: dict
    program: tuple
    outputs: tuple
    next_states: tuple

    def text(self):
        """Canonical text of the traced step: the cache key is a hash of it."""
        lines = [
            f"neuron {self.name}",
            f"inputs {self.inputs} states {self.states} hyper {self.hyper} learnable {self.learnable}",
            f"static {self.static!r}",
        ]
        lines += [str(a) for a in self.program]
        lines.append(f"outputs {[str(s) for s in self.outputs]}")
        lines.append(f"next_states {[str(s) for s in self.next_states]}")
        spikes = {f.func.surrogate.key() for a in self.program for f in a.expr.atoms(SpikeBase)}
        lines.append(f"surrogates {sorted(spikes)}")
        return "\n".join(lines)

    def digest(self):
        return hashlib.sha256(self.text().encode()).hexdigest()

    def differentiable_leaves(self):
        return [self.leaves[n] for n in self.inputs + self.states + self.learnable]


def is_condition(expr):
    """True for relations and logic (sympy also counts plain symbols as Boolean)."""
    return isinstance(expr, (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction,
                             sympy.logic.boolalg.BooleanAtom))


class Recorder:
    """The straight-line program a traced step records, one node per operation (`emit`), and the step's frame."""

    def __init__(self, fn):
        self.fn = fn
        self.program = []
        self.frame = None  # the step's frame, kept to read its local names after it returns

    def emit(self, expr):
        if self.frame is None:
            self.frame = step_frame(self)
        _check_real(self, expr)
        if len(self.program) >= MAX_TRACED_OPERATIONS:
            fail(self, f"the step records more than {MAX_TRACED_OPERATIONS} operations (a long Python loop?); "
                  "flexgen generates kernels for steps up to that size")
        if is_condition(expr) or expr.is_Atom:
            return Var(self, expr)  # conditions stay inline: sympy needs them whole in Piecewise
        node = sympy.Symbol(f"_node{len(self.program)}", real=True)
        self.program.append(Assign(node, expr))
        return Var(self, node)


def _check_real(recorder, expr):
    """SpecError for an operation whose value, as sympy evaluates it, is not a finite real number."""
    bad = not_real(expr)
    if bad:
        meanings = "; ".join(_NOT_REAL.get(b, f"{b}, not a finite real number") for b in bad)
        fail(recorder, f"this operation has no finite real value for any neuron: its operands are constants "
              f"(or cancel to constants) and sympy evaluates it to `{_readable(recorder, expr)}`, with {meanings}. "
              "Eager torch would give inf or nan here; the kernels take only finite real values. Remove the "
              "singular operation")


def _readable(recorder, expr, max_length=100):
    """`expr` for a message: the step's intermediate values written out while that stays short, else `...`."""
    definitions = {a.target: a.expr for a in recorder.program}
    for _ in range(8):
        expanded = expr.xreplace(definitions)
        if expanded == expr or len(str(expanded)) > max_length:
            break
        expr = expanded
    return re.sub(r"_node\d+", "...", str(expr))


def to_sympy(value, recorder=None):
    """A value met while tracing, as a sympy expression (or a SpecError)."""
    if isinstance(value, Var):
        return value.expr
    if isinstance(value, bool):
        return sympy.true if value else sympy.false
    if isinstance(value, numbers.Integral):
        value = int(value)
        try:
            as_float = float(value)
        except OverflowError:
            fail(recorder, f"the integer constant of {value.bit_length()} bits is beyond the float range; generated "
                  "kernels only take constants a float can hold")
        if abs(value) > 2**53:  # torch refuses integers beyond int64 in the eager path; the kernels round them
            fail(recorder, f"the integer constant {value} is larger than 2**53, the largest integer a float holds "
                  f"exactly, so the paths cannot agree on it; write it as a float ({as_float!r})")
        return sympy.Integer(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            fail(recorder, f"the constant {value!r} is not finite; generated kernels only take finite constants")
        return sympy.Float(float(value))
    if isinstance(value, sympy.Basic):
        return value
    kind = type(value).__module__ + "." + type(value).__qualname__
    hint = " (pass tensors in as inputs or learnable parameters)" if kind.startswith("torch.") else ""
    fail(recorder, f"a value of type {kind} cannot take part in a traced step{hint}")


NOT_A_NUMBER = (
    "a comparison is a condition, not a number. For a 0/1 value use flexgen.where(cond, 1.0, 0.0); for a spike "
    "with a surrogate gradient, flexgen.spike(h - v_th) (it fires where h >= v_th)"
)


def reject_condition(value, what, why=NOT_A_NUMBER, recorder=None):
    """SpecError if `value` (traced, or a sympy expression) is a comparison or logic: `what` needs a number.

    The error names the step's line when the value is traced (or `recorder` is given).
    """
    if isinstance(value, Var):
        value, recorder = value.expr, value.recorder
    if isinstance(value, sympy.Basic) and is_condition(value):
        fail(recorder, f"{what} got a comparison: {why}")


def combine(sympy_fn, *args):
    """Apply a sympy function to traced values, recording the result as one node."""
    recorder = next(a.recorder for a in args if isinstance(a, Var))
    return recorder.emit(sympy_fn(*[to_sympy(a, recorder) for a in args]))


def _binary(op, symbol, reflected=False, logical=False):
    """The operator method `symbol` of Var; only `logical` ones (&, |) take conditions."""

    def method(self, other):
        a, b = self.expr, to_sympy(other, self.recorder)
        if not logical:
            for operand in (a, b):
                reject_condition(operand, f"`{symbol}`", recorder=self.recorder)
        return self.recorder.emit(op(b, a) if reflected else op(a, b))

    return method


class Var:
    """A symbolic value while a step function is traced.

    Arithmetic and comparisons record nodes; anything that would need a
    concrete value (Python `if`, `float()`, math/numpy/torch functions,
    tensor methods) raises SpecError with the offending line.
    """

    __slots__ = ("recorder", "expr")

    def __init__(self, recorder, expr):
        self.recorder = recorder
        self.expr = expr

    __add__ = _binary(lambda a, b: a + b, "+")
    __radd__ = _binary(lambda a, b: a + b, "+", reflected=True)
    __sub__ = _binary(lambda a, b: a - b, "-")
    __rsub__ = _binary(lambda a, b: a - b, "-", reflected=True)
    __mul__ = _binary(lambda a, b: a * b, "*")
    __rmul__ = _binary(lambda a, b: a * b, "*", reflected=True)
    __truediv__ = _binary(lambda a, b: a / b, "/")
    __rtruediv__ = _binary(lambda a, b: a / b, "/", reflected=True)
    __pow__ = _binary(lambda a, b: a**b, "**")
    __rpow__ = _binary(lambda a, b: a**b, "**", reflected=True)
    __lt__ = _binary(sympy.StrictLessThan, "<")
    __le__ = _binary(sympy.LessThan, "<=")
    __gt__ = _binary(sympy.StrictGreaterThan, ">")
    __ge__ = _binary(sympy.GreaterThan, ">=")
    __and__ = _binary(sympy.And, "&", logical=True)
    __rand__ = _binary(sympy.And, "&", reflected=True, logical=True)
    __or__ = _binary(sympy.Or, "|", logical=True)
    __ror__ = _binary(sympy.Or, "|", reflected=True, logical=True)

    def __neg__(self):
        reject_condition(self, "unary `-`")
        return self.recorder.emit(-self.expr)

    def __pos__(self):
        return self

    def __invert__(self):
        return self.recorder.emit(sympy.Not(self.expr))

    def __abs__(self):
        reject_condition(self, "abs()")
        return self.recorder.emit(sympy.Abs(self.expr))

    def __bool__(self):
        construct = branch_construct(self.recorder)
        fail(
            self.recorder,
            f"{construct} cannot branch on a traced value: the step runs once on "
            "symbols, not per neuron. Use flexgen.where(cond, a, b) (and flexgen.minimum/maximum) instead",
        )

    def __float__(self):
        called = called_function(self.recorder)
        what = f"{called}()" if called else "float()/int() (or a `math` function)"
        fail(self.recorder, f"{what} was called on a traced value; "
              "use the flexgen math functions (flexgen.exp, flexgen.log, ...)")

    __int__ = __index__ = __float__

    def __array_ufunc__(self, ufunc, method, *args, **kwargs):
        fail(self.recorder, f"numpy.{ufunc.__name__} is not supported in a step; {flexgen_instead(ufunc.__name__)}")

    __array_function__ = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        recorder = next(a.recorder for a in list(args) + list((kwargs or {}).values()) if isinstance(a, Var))
        name = getattr(func, "__name__", repr(func))
        values = list(args) + list((kwargs or {}).values())
        if any(type(a).__module__.startswith("torch") for a in values):
            fail(recorder, f"a torch.Tensor meets a traced value (in torch.{name}): a step cannot read tensors from "
                  "outside (closures, globals); pass them in as inputs or learnable parameters")
        fail(recorder, f"torch.{name} is not supported in a step; {flexgen_instead(name)}")

    def __iter__(self):
        fail(self.recorder, "a traced value is a single number per neuron; it cannot be iterated or indexed")

    def __len__(self):  # torch.tensor(x), numpy.array(x), len(x)
        called = called_function(self.recorder)
        what = f"{called}()" if called else "len() (or a tensor or array made from it)"
        fail(self.recorder, f"{what} was called on a traced value; in a step every input, state and "
              "hyper-parameter is already one number per neuron: use it directly (`x / tau`, not "
              "`x / torch.tensor(tau)`), with flexgen's math functions (flexgen.exp(tau), flexgen.where, ...)")

    __getitem__ = __iter__

    def __setattr__(self, name, value):
        if name in Var.__slots__:
            object.__setattr__(self, name, value)
        else:
            fail(self.recorder, f"cannot set attribute {name!r} on a traced value")

    def __getattr__(self, name):
        recorder = object.__getattribute__(self, "recorder")
        if name.endswith("_") and not name.startswith("_"):
            fail(recorder, f"the in-place tensor op '.{name}()' is not supported in a step (rebind instead: "
                  "`x = x + 1`, or `x += 1`)")
        fail(recorder, f"'.{name}' is not available on a traced value (tensor methods and in-place ops are not "
              "supported in a step; use the flexgen math functions)")

    def __repr__(self):
        return f"Var({self.expr})"


def _call_recording_locals(recorder, kwargs):
    """Call the step and return (result, its local variables at return); the return line is `captured["__line__"]`.

    The locals come from the step's frame, captured by the first recorded
    operation; a finished frame keeps them. (No sys.setprofile/settrace hook, so
    profilers, debuggers and coverage keep working.)
    """
    result = recorder.fn(**kwargs)
    frame = recorder.frame
    if frame is None:  # the step recorded no operation; a lone `return` still has a line
        returns = [i for i in dis.get_instructions(recorder.fn) if i.opname.startswith("RETURN")]
        lines = {getattr(i, "positions", None) and i.positions.lineno for i in returns} - {None}
        return result, ({"__line__": lines.pop()} if len(lines) == 1 else {})
    captured = dict(frame.f_locals)
    captured["__line__"] = frame.f_lineno
    return result, captured


def trace(fn, signature, static_values):
    """Trace `fn` (described by `signature`, a `flexgen.layers.spec.Signature`) into a Trace."""
    alpha_parameters = [parameter for _, parameter in signature.learnable_alphas]
    roles = {"input": signature.inputs, "state": signature.states, "learnable parameter": signature.learnable}
    try:
        check_derived_collisions(roles, list(signature.parameters) + alpha_parameters)
    except SpecError as exc:
        raise SpecError(f"{fn.__name__!r} ({fn.__code__.co_filename}:{fn.__code__.co_firstlineno}): {exc}") from None
    recorder = Recorder(fn)
    leaves = {}
    kwargs = {}
    for name in signature.parameters:
        if name in signature.static:
            kwargs[name] = static_values[name]
        else:
            leaves[name] = sympy.Symbol(name, real=True)
            kwargs[name] = Var(recorder, leaves[name])
    alphas = {}
    for _, parameter in signature.learnable_alphas:
        leaves[parameter] = sympy.Symbol(parameter, real=True)
        alphas[parameter] = Var(recorder, leaves[parameter])
    kwargs.update(signature.bind_alphas({k: kwargs[k] for k in signature.static}, alphas))
    try:
        result, local_vars = _call_recording_locals(recorder, kwargs)
    except SpecError:
        raise
    except Exception as exc:  # any failure inside the user's step is a spec problem
        tb = exc.__traceback__
        line = None
        while tb is not None:
            if tb.tb_frame.f_code is fn.__code__:
                line = tb.tb_lineno
            tb = tb.tb_next
        where = f" at line {line}" if line else ""
        raise SpecError(f"tracing {fn.__name__!r} failed{where}: {type(exc).__name__}: {exc}") from exc

    where = f"{fn.__code__.co_filename}:{local_vars.pop('__line__', fn.__code__.co_firstlineno)}"
    values = result if isinstance(result, tuple) else (result,)
    n_states = len(signature.states)
    n_outputs = len(values) - n_states
    if n_outputs < 1:
        raise SpecError(
            f"{fn.__name__!r} returned {len(values)} value(s) at {where}; it must return its outputs first, then the "
            f"new value of each state {signature.states} ({n_states} state(s), so at least {n_states + 1} values)"
        )
    exprs = []
    for k, v in enumerate(values):
        try:
            exprs.append(to_sympy(v))
        except SpecError as exc:
            raise SpecError(f"{fn.__name__!r} returned an unusable value #{k} at {where}: {exc}") from None
    for e in exprs:
        if is_condition(e):
            raise SpecError(f"{fn.__name__!r} returned a condition at {where}; "
                            "wrap it as flexgen.where(cond, 1.0, 0.0)")
    return _name_nodes(fn, signature, static_values, leaves, recorder.program, exprs[:n_outputs], exprs[n_outputs:],
                       local_vars)


def _name_nodes(fn, signature, static_values, leaves, program, outputs, next_states, local_vars):
    """Give nodes the step's own variable names where possible, and make outputs and next states nodes."""
    alloc = NameAllocator(set(leaves) | FRAME_NAMES | derived_forms(leaves))
    program = list(program)
    local_names = {}
    for name, value in local_vars.items():
        if isinstance(value, Var) and value.expr not in local_names and is_free_name(name) and name not in leaves:
            local_names[value.expr] = name

    def as_node(expr, stem):
        if isinstance(expr, sympy.Symbol) and expr.name.startswith("_node"):
            return expr
        node = sympy.Symbol(f"_node{len(program)}", real=True)
        program.append(Assign(node, expr))
        local_names.setdefault(node, stem)
        return node

    outputs = [as_node(e, f"out{k}") for k, e in enumerate(outputs)]
    next_states = [as_node(e, f"{s}_new") for s, e in zip(signature.states, next_states)]
    for k, node in enumerate(outputs):
        local_names.setdefault(node, f"out{k}")
    for s, node in zip(signature.states, next_states):
        local_names.setdefault(node, f"{s}_new")

    rename = {}
    for k, a in enumerate(program):
        stem = local_names.get(a.target, f"tmp{k}")
        rename[a.target] = sympy.Symbol(alloc.fresh(stem), real=True)
    program = [Assign(rename[a.target], a.expr.xreplace(rename)) for a in program]
    static = tuple((k, static_values[k]) for k in signature.static)
    return Trace(
        name=fn.__name__,
        inputs=signature.inputs,
        states=signature.states,
        hyper=signature.hyper,
        learnable=signature.learnable,
        static=static,
        leaves=leaves,
        program=tuple(program),
        outputs=tuple(rename[o] for o in outputs),
        next_states=tuple(rename[s] for s in next_states),
    )
