"""What a step function reads from outside itself, as a key: tracing bakes those values into the kernels.

A step may read module-level constants (`V_TH = 1.0`), closure variables, attributes of modules and
objects (`math.pi`, `config.V_TH`) and helper functions that read such values in turn. Tracing turns
them into constants, so the spec keys its traces and kernels by their current values (`outside_values`):
rebinding one gives the layers built afterwards new kernels, as eager execution would see the new value.

Values are keyed by content where that is cheap and safe (numbers, strings, small containers of them,
objects with a `key()` method such as surrogates, helper functions by their code and what they read) and by
identity otherwise. Attributes are read from the object's `__dict__` only, so no property runs.
"""
import dis
import functools
import numbers
import types

_NAME_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_MAX_ITEMS = 64  # containers longer than this are keyed by identity
_MAX_NESTING = 4


@functools.lru_cache(maxsize=1024)
def code_key(code):
    """What a code object computes, as a key: its bytecode, constants (nested code objects by their own key),
    names and defaults-free signature. A helper redefined with other constants (a notebook cell run again) is
    another helper; the step's own code is keyed by the spec it belongs to."""
    consts = tuple(code_key(c) if isinstance(c, types.CodeType) else (type(c).__name__, repr(c))
                   for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
            code.co_kwonlyargcount)


@functools.lru_cache(maxsize=1024)
def _reads(code):
    """(global names, attribute names) that `code` and the code objects nested in it load."""
    names, attributes = set(), set()
    for instruction in dis.get_instructions(code):
        if instruction.opname in _NAME_LOADS:
            names.add(instruction.argval)
        elif instruction.opname in _ATTRIBUTE_LOADS:
            attributes.add(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            nested_names, nested_attributes = _reads(const)
            names |= nested_names
            attributes |= nested_attributes
    return frozenset(names), frozenset(attributes)


def outside_values(fn):
    """A hashable key of the values `fn` reads from its globals and closure (see the module docstring).

    >>> RATE = 0.5
    >>> def step(x):
    ...     return x * RATE
    >>> before = outside_values(step)
    >>> RATE = 0.25
    >>> outside_values(step) == before
    False
    """
    return _function_key(fn, set())


def lasting_key(fn):
    """What `fn` computes, as text that means the same in another process: its code, its defaults and the values
    it reads from outside; None where one of those values is known only by its identity in this process.

    >>> def step(x, tau=2.0):
    ...     return x / tau
    >>> lasting_key(step) == lasting_key(step)
    True
    >>> OBJECT = object()
    >>> def reads_an_object(x):
    ...     return x if OBJECT else -x
    >>> lasting_key(reads_an_object) is None
    True
    """
    defaults = tuple(_value_key(v, (), set(), 0) for v in (fn.__defaults__ or ()))
    kwdefaults = tuple((k, _value_key(v, (), set(), 0)) for k, v in sorted((fn.__kwdefaults__ or {}).items()))
    key = (code_key(fn.__code__), defaults, kwdefaults, outside_values(fn))
    return None if _knows_identity(key) else repr(key)


def _knows_identity(key):
    """Whether a key holds a value keyed by its identity (`("object", id(...), ...)`, see `_value_key`)."""
    if not isinstance(key, tuple):
        return False
    if len(key) == 3 and key[0] == "object" and isinstance(key[1], int):
        return True
    return any(_knows_identity(item) for item in key)


def _function_key(fn, seen):
    if fn in seen:
        return ("recursive", fn.__qualname__)
    seen.add(fn)
    code = fn.__code__
    names, attributes = _reads(code)
    namespace = fn.__globals__
    items = [(name, _value_key(namespace[name], attributes, seen, 0)) for name in sorted(names) if name in namespace]
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
        items.append((name, _value_key(value, attributes, seen, 0)))
    return tuple(items)


def _value_key(value, attributes, seen, depth):
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, numbers.Number):
        return _number_key(value)
    if isinstance(value, types.FunctionType):
        if value.__module__ and value.__module__.split(".")[0] == "flexgen":
            return ("flexgen", value.__module__, value.__qualname__)
        return ("function", value.__qualname__, code_key(value.__code__), _function_key(value, seen))
    if isinstance(value, types.ModuleType):  # `math.pi`: the module by its name, what is read of it by value
        if value.__name__.split(".")[0] == "flexgen":  # (its names load lazily; the generator's hash covers them)
            return ("flexgen", value.__name__)
        return ("module", value.__name__, _attributes_key(value, attributes, seen, depth))
    key = getattr(value, "key", None)
    if callable(key) and not isinstance(value, type):
        try:
            return ("keyed", type(value).__qualname__, key())
        except Exception:  # a key() that needs arguments or fails: fall back to identity
            pass
    if depth < _MAX_NESTING and isinstance(value, (tuple, list, set, frozenset)) and len(value) <= _MAX_ITEMS:
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__,) + tuple(_value_key(v, attributes, seen, depth + 1) for v in items)
    if depth < _MAX_NESTING and isinstance(value, dict) and len(value) <= _MAX_ITEMS:
        return ("dict",) + tuple((_value_key(k, (), seen, depth + 1), _value_key(v, attributes, seen, depth + 1))
                                 for k, v in value.items())
    return ("object", id(value), _attributes_key(value, attributes, seen, depth))


def _number_key(value):
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return ("float", value.hex())
    return (type(value).__name__, repr(value))


def _attributes_key(value, attributes, seen, depth):
    """The attributes among `attributes` in `value.__dict__` (a module's or an object's), keyed."""
    own = getattr(value, "__dict__", None)
    if not isinstance(own, dict) or depth >= _MAX_NESTING:
        return ()
    found = []
    for name in sorted(attributes):
        if name in own and not isinstance(own[name], types.ModuleType):
            found.append((name, _value_key(own[name], attributes, seen, depth + 1)))
    return tuple(found)
