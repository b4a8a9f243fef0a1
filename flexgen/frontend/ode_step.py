"""The step function `flexgen.ode` writes from an integrated continuous system.

The step is Python source in the step-function language (flexgen's math
functions by their bare names), compiled under a `<flexgen.ode ...>` file name
registered with `linecache`, so `inspect.getsource(spec.fn)`, tracebacks and
flexgen's own error messages show it. One step:

  1. integrate the states over dt (the method's assignments, `<state>_step`);
  2. refractory: while the counter is above dt/2, the held states keep their value;
  3. fire: s = spike(threshold on the integrated states), 0 while refractory;
  4. reset the states where s = 1 (from the integrated values, all at once);
  5. the counter: down by dt while refractory, set to the period where s = 1.
"""
import dataclasses
import itertools
import linecache

import sympy

from . import functions, surrogate as surrogates
from .names import sanitize_identifier
from ..printing.source import StepSourcePrinter

COUNTER = "refractory_left"  # the state the written step adds to count down a refractory period

_COUNT = itertools.count()
_FUNCTIONS = ("exp", "log", "sqrt", "tanh", "atan", "sigmoid", "abs", "minimum", "maximum", "where", "spike", "detach")


@dataclasses.dataclass(frozen=True)
class WrittenStep:
    """The step function, its source, and the body as `target = code` lines (for `equations()`)."""

    function: object
    source: str
    body: tuple


class _Body:
    """The step's statements, printed as they are added."""

    def __init__(self):
        self.printer = StepSourcePrinter()
        self.lines = []

    def assign(self, target, expr):
        self.lines.append(f"{target} = {self.printer.doprint(expr)}")

    def assign_code(self, target, code):
        self.lines.append(f"{target} = {code}")

    def code(self, expr):
        return self.printer.doprint(expr)


def _events(system, integration, names, body):
    """Steps 2-5 of the module docstring; returns (outputs, new value of each state, counter's new value)."""
    values = dict(zip(system.states, integration.steps))
    refractory = None
    if system.refractory is not None:
        refractory = names("refractory")
        body.lines.insert(0, f"{refractory} = {COUNTER} > 0.5*dt  # counting down a refractory period")
        for state in system.hold:
            held = names(f"{state}_held")
            body.assign_code(held, f"where({refractory}, {state}, {values[state]})")
            values[state] = held
    outputs, new_states = [], dict(values)
    spike = None
    if system.threshold is not None:
        spike = names("s")
        fire = f"spike({body.code(system.threshold.xreplace(values))}, surrogate)"
        body.assign_code(spike, f"where({refractory}, 0.0, {fire})" if refractory is not None else fire)
        outputs.append(spike)
    for k, output in enumerate(system.outputs):
        value = output.xreplace(values)
        if not value.is_Symbol:
            symbol = names(f"out{k + 1}" if spike is not None else f"out{k}")
            body.assign(symbol, value)
            value = symbol
        outputs.append(value)
    if system.reset:
        s_reset = names("s_reset")
        body.assign_code(s_reset, f"detach({spike}) if detach_reset else {spike}")
        for state, expr in system.reset:
            new_states[state] = _reset(state, expr.xreplace(values), values[state], s_reset, names, body)
    counter = None
    if refractory is not None:
        counter = names(f"{COUNTER}_new")
        period = body.code(system.refractory)
        body.assign_code(counter, f"where({refractory}, {COUNTER} - dt, 0.0) + {period}*detach({spike})")
    return outputs, [new_states[s] for s in system.states], counter


def _reset(state, value, integrated, s_reset, names, body):
    """The state after the reset: an increment `integrated + delta*s` where the reset adds to the state,
    else `integrated*(1 - s) + value*s`."""
    new = names(f"{state}_new")
    delta = sympy.simplify(value - integrated)
    if integrated not in delta.free_symbols:
        body.assign(new, integrated + delta * s_reset)
    else:
        body.assign(new, integrated * (1 - s_reset) + value * s_reset)
    return new


def _default(value):
    return repr(float(value))


def _surrogate_default(surrogate, namespace):
    """How the `surrogate` default is written: its repr where that rebuilds it, else a bound name."""
    text = repr(surrogate)
    kind = type(surrogate)
    try:
        rebuilt = eval(text, {kind.__name__: kind})  # noqa: S307 (the repr of a flexgen surrogate)
    except Exception:
        rebuilt = None
    if isinstance(rebuilt, Surrogate) and rebuilt.key() == surrogate.key():
        namespace[kind.__name__] = kind
        return text
    namespace["default_surrogate"] = surrogate
    return "default_surrogate"


Surrogate = surrogates.Surrogate


def _parameters(fn, signature, system, dt, surrogate, namespace):
    """The written step's parameter list: inputs and states, the counter, parameters with their defaults,
    dt, then the options."""
    first = [n for n in signature.parameters if n in signature.inputs or n in signature.states]
    if system.refractory is not None:
        first.append(COUNTER)
    rest = [f"{n}={_default(signature.defaults[n])}" for n in signature.parameters if n not in first]
    rest.append(f"dt={_default(dt)}")
    if system.threshold is not None:
        rest.append(f"surrogate={_surrogate_default(surrogate, namespace)}")
    if system.reset:
        rest.append("detach_reset=False")
    return first + rest


def _header(fn, system, integration):
    code = fn.__code__
    lines = [f"# Written by flexgen.ode from the equations of {fn.__qualname__} "
             f"({code.co_filename}:{code.co_firstlineno}):"]
    lines += [f"#   {line}" for line in system.lines()]
    lines.append(f"# Method: {integration.method} ({integration.reason}); "
                 "the inputs are held constant over a step of length dt.")
    return lines


def write_step(fn, signature, system, integration, names, dt, surrogate):
    """The `WrittenStep` for `system` integrated by `integration` (see the module docstring)."""
    body = _Body()
    for target, expr in integration.assignments:
        body.assign(target, expr)
    outputs, new_states, counter = _events(system, integration, names, body)
    returned = [str(o) for o in outputs] + [str(s) for s in new_states] + ([str(counter)] if counter else [])
    body.lines.append("return " + ", ".join(returned))
    namespace = {f: getattr(functions, f) for f in _FUNCTIONS}
    name = sanitize_identifier(fn.__name__)
    parameters = _parameters(fn, signature, system, dt, surrogate, namespace)
    source = "\n".join(
        [f"def {name}({', '.join(parameters)}):"]
        + [f"    {line}" for line in _header(fn, system, integration) + body.lines]
    ) + "\n"
    filename = f"<flexgen.ode {fn.__qualname__} #{next(_COUNT)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 (source written above from sympy expressions)
    step = namespace[name]
    step.__module__, step.__qualname__, step.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    return WrittenStep(step, source, tuple(body.lines))
