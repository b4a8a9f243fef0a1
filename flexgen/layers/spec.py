"""The front end: `@flexgen.neuron` turns a step function into a `NeuronSpec`.

Hands the compile stage (`flexgen.compile`) a spec: the function, the roles of its parameters, its options.

`@flexgen.neuron(states=...)` reads the function's signature (which parameters
are per-step inputs, states, runtime hyper-parameters, static options
and learnable parameters) and returns a `NeuronSpec`: call it to get a layer,
ask it for the generated source or the derived equations.
"""
import dataclasses
import importlib
import inspect
import math
import numbers
import pickle

import torch

from ..frontend.captured import lasting_key, outside_values
from .. import kinds
from ..compile import compile_kernels
from ..errors import SpecError
from ..frontend.hyper import describe_number
from .neuron import NeuronModule, run
from ..frontend.names import check_spec_name, sanitize_identifier


@dataclasses.dataclass(frozen=True)
class Signature:
    """Roles of the step function's parameters, in signature order."""

    parameters: tuple
    inputs: tuple
    states: tuple
    hyper: tuple
    learnable: tuple
    static: tuple
    defaults: dict
    init: dict
    learnable_alphas: tuple = ()  # (option, parameter): a surrogate option whose alpha is the learnable parameter

    def bind_alphas(self, static_values, values):
        """`static_values` with each learnable-alpha surrogate reading its alpha from `values[parameter]`."""
        bound = dict(static_values)
        for option, parameter in self.learnable_alphas:
            bound[option] = bound[option].with_alpha(values[parameter])
        return bound


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_finite(value):
    """math.isfinite, False for an integer beyond the float range (10**400) instead of an OverflowError."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_option(value):
    """A specialisation option's value: None, a bool, a str, or an object with a key() method (a surrogate)."""
    return value is None or isinstance(value, (bool, str)) or callable(getattr(value, "key", None))


def _location(fn):
    """'name (file:line)' of a step function, for error messages."""
    code = fn.__code__
    return f"{fn.__name__!r} ({code.co_filename}:{code.co_firstlineno})"


def _name_list(names, group, where):
    """`names` (states or learnable) as a tuple of validated, distinct identifiers."""
    if isinstance(names, str) or not isinstance(names, (tuple, list)):
        raise SpecError(f"{where}: {group} must be a tuple of names, got {names!r}")
    for n in names:
        try:
            check_spec_name(n, group[:-1] if group == "states" else group)
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None
    duplicates = sorted({n for n in names if list(names).count(n) > 1})
    if duplicates:
        raise SpecError(f"{where}: {group} name(s) {duplicates} given more than once")
    return tuple(names)


def _is_array(value):
    kind = type(value)
    return any(f"{c.__module__}.{c.__name__}" in ("torch.Tensor", "numpy.ndarray") for c in kind.__mro__)


def _check_captured(fn, where):
    """SpecError for a tensor or array the step reads from an enclosing scope or a global.

    Captured numbers are fine: tracing bakes them in as constants (so they are
    part of the cache key).
    """
    try:
        captured = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return
    for scope, names in (("an enclosing function", captured.nonlocals), ("the module's globals", captured.globals)):
        for name, value in names.items():
            if _is_array(value):
                kind = type(value).__module__ + "." + type(value).__qualname__
                raise SpecError(
                    f"{where}: the step captures {name!r}, a {kind}, from {scope}; a step cannot read tensors "
                    "from outside: pass it in as an input, a learnable parameter or a numeric hyper-parameter"
                )


def parse_signature(fn, states, learnable, init):
    """Classify fn's parameters; SpecError for anything flexgen cannot use."""
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise SpecError(f"@flexgen.neuron needs a Python function, got {type(fn).__name__}")
    where = _location(fn)
    states = _name_list(states, "states", where)
    learnable = _name_list(learnable, "learnable", where)
    _check_captured(fn, where)
    params = inspect.signature(fn).parameters
    inputs, hyper, static, defaults = [], [], [], {}
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise SpecError(f"{where}: *args/**kwargs ({p}) are not supported; name every input, state and parameter")
        try:
            check_spec_name(name, "parameter")
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None
        has_default = p.default is not p.empty
        if name in states:
            continue
        if name in learnable:
            if not has_default or not _is_number(p.default) or not _is_finite(p.default):
                raise SpecError(f"{where}: learnable parameter {name!r} needs a finite numeric default "
                                "(its initial value)")
            defaults[name] = float(p.default)
        elif not has_default:
            inputs.append(name)
        elif _is_number(p.default):
            if not _is_finite(p.default):
                raise SpecError(f"{where}: default of {name!r} is {describe_number(p.default)}; "
                                "hyper-parameters must be finite numbers a float can hold")
            hyper.append(name)
            defaults[name] = float(p.default)
        elif _is_option(p.default):
            static.append(name)
            defaults[name] = p.default
        else:
            raise SpecError(
                f"{where}: default of {name!r} is a {type(p.default).__name__}; use a number (runtime "
                "hyper-parameter), or a bool/None/str/surrogate (a static option)"
            )
    for group, names in (("states", states), ("learnable", learnable)):
        for n in names:
            if n not in params:
                raise SpecError(f"{where}: {group} name {n!r} is not a parameter of the function")
    overlap = set(states) & set(learnable)
    if overlap:
        raise SpecError(f"{where}: {sorted(overlap)} cannot be both a state and learnable")
    if not inputs:
        raise SpecError(f"{where}: the step needs at least one per-step input (a parameter without default)")
    if init is not None and not isinstance(init, dict):
        raise SpecError(f"{where}: init must be a dict mapping state names to values, got {type(init).__name__}")
    init = dict(init or {})
    for s, value in init.items():
        if not isinstance(s, str) or s not in states:
            raise SpecError(f"{where}: init given for {s!r}, which is not a state")
        if isinstance(value, str):
            if value not in hyper and value not in static:
                raise SpecError(f"{where}: init of {s!r} names {value!r}, which is not a hyper-parameter")
        elif not _is_number(value) or not _is_finite(value):
            raise SpecError(f"{where}: init of {s!r} must be a finite number or a hyper-parameter name")
    return Signature(
        parameters=tuple(params),
        inputs=tuple(inputs),
        states=states,
        hyper=tuple(hyper),
        learnable=learnable,
        static=tuple(static),
        defaults=defaults,
        init={s: init.get(s, 0.0) for s in states},
    )


def _identifier(name):
    """The neuron's name in kernel, op and module names: ASCII identifier characters only."""
    return sanitize_identifier(name)


class NeuronSpec:
    """A neuron defined by its step function; call it to build a layer.

    >>> import torch, flexgen
    >>> @flexgen.neuron(states=("v",))
    ... def if_neuron(x, v, v_th=1.0):
    ...     h = v + x
    ...     s = flexgen.spike(h - v_th)
    ...     return s, h * (1.0 - s)
    >>> layer = if_neuron(v_th=0.5)
    >>> layer(torch.tensor([[0.2], [0.4]])).flatten().tolist()
    [0.0, 1.0]
    """

    def __init__(self, fn, states=(), learnable=(), init=None):
        self.fn = fn
        self.name = _identifier(fn.__name__)
        self.signature = parse_signature(fn, states, learnable, init)
        self.__doc__ = fn.__doc__
        self.__name__ = fn.__name__
        self.__wrapped__ = fn
        self._traces, self._compiled, self._latest = {}, {}, {}

    # learnable parameter -> why a layer's call refuses it NaN or infinite (an `OdeSpec`'s refractory period)
    finite_learnable = {}

    def __repr__(self):
        sig = self.signature
        return (f"<flexgen neuron {self.fn.__name__}: inputs {sig.inputs}, states {sig.states}, "
                f"hyper {sig.hyper}, learnable {sig.learnable}>")

    def __reduce__(self):
        """Pickle by reference: the spec is found again as `module.qualname` when loaded."""
        module, qualname = self.fn.__module__, self.fn.__qualname__
        try:
            found = _spec_by_reference(module, qualname)
        except (ImportError, AttributeError, TypeError):
            found = None
        if found is not self:
            raise pickle.PicklingError(
                f"cannot pickle flexgen neuron {qualname!r} (module {module!r}): specs are pickled by reference, "
                "so the decorated function must be importable at module level under its own name "
                "(not defined inside a function, not rebound)"
            )
        return _spec_by_reference, (module, qualname)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self  # immutable: copies of a model share their specs (and generated kernels)

    def static_values(self, overrides=None):
        values = {k: self.signature.defaults[k] for k in self.signature.static}
        for k, v in (overrides or {}).items():
            if k not in values:
                raise TypeError(f"{self.fn.__name__}: {k!r} is not a static option ({list(values)})")
            if not _is_option(v):
                raise SpecError(f"{self.fn.__name__}: option {k!r} takes None, a bool, a str or an object with a key() "
                                f"method (a surrogate), got a {type(v).__name__}")
            values[k] = v
        return values

    def signature_for(self, static):
        """The signature with the learnable parameters these options add: `<option>_alpha` for every
        surrogate option built with learnable_alpha=True (initialised to its alpha)."""
        sig = self.signature
        alphas = tuple((k, f"{k}_alpha") for k, v in static.items() if getattr(v, "learnable_alpha", False))
        if not alphas:
            return sig
        for option, parameter in alphas:
            if parameter in sig.parameters:
                raise SpecError(
                    f"{_location(self.fn)}: option {option!r} has a learnable alpha, which would be the learnable "
                    f"parameter {parameter!r}, but the step already has a parameter of that name; rename it"
                )
        defaults = {**sig.defaults, **{p: float(static[o].alpha) for o, p in alphas}}
        learnable = sig.learnable + tuple(p for _, p in alphas)
        return dataclasses.replace(sig, learnable=learnable, defaults=defaults, learnable_alphas=alphas)

    @staticmethod
    def static_key(static):
        return repr(sorted((k, v.key() if hasattr(v, "key") else v) for k, v in static.items()))

    def lasting_key(self, static):
        """What this spec's kernels for `static` are generated from, as text that means the same in another process
        (`flexgen.frontend.captured.lasting_key`), or None: the compile stage keys a record of their cache key by it."""
        step, signature = lasting_key(self.fn), repr(self.signature_for(static))
        if step is None or " at 0x" in signature:  # (an object in the signature printed by its address)
            return None
        return repr((self.name, signature, self.static_key(static), step))

    def trace(self, **static):
        """The traced step (`flexgen.frontend.trace.Trace`) for these static options and the current values of what the
        step reads from outside (module constants, closures: see `flexgen.frontend.captured`)."""
        static = self.static_values(static)
        key = (self.static_key(static), outside_values(self.fn))
        if key not in self._traces:
            from ..frontend import trace as tracing  # (sympy: layers whose kernels are cached never trace)

            tr = tracing.trace(self.fn, self.signature_for(static), static)
            self._traces[key] = dataclasses.replace(tr, name=self.name)
        return self._traces[key]

    def n_outputs(self, static=None):
        return len(self.trace(**(static or {})).outputs)

    def derivation(self, **static):
        """Forward and backward equations and the saved set (`flexgen.derive.derivation.Derivation`)."""
        from ..derive.derivation import derive

        return derive(self.trace(**static))

    def compiled(self, kind="plain", options=None, /, **static):
        """The loaded kernels of a layer `kind` of this neuron (`flexgen.kinds`: "plain", the neuron layer's own,
        `flexgen.kinds.plain.CompiledNeuron`; "delayed" with options `input`, `max_delay`, `tapped`, `held`;
        "recurrent" with options `input`, `output`, `delayed`, `tapped`, `synaptic`; or a registered or given
        `flexgen.kinds.Kind`) for the kind's `options` (a dict) and these static options: generated once, then
        cached, and memoised per the current values of what the step reads from outside."""
        kind = kinds.get(kind)
        options = kind.options(**(options or {}))
        static = self.static_values(static)
        latest_key = (kind.name, options, self.static_key(static))
        if torch.compiler.is_compiling() and latest_key in self._latest:
            # While torch.compile traces (a copied layer looking its kernels up again), nothing can be generated,
            # and reading the outside values would break the graph: the kernels these options last got.
            return self._latest[latest_key]
        memo_key = (*latest_key, outside_values(self.fn))
        if memo_key not in self._compiled:
            self._compiled[memo_key] = compile_kernels(self, static, kind, options)
        self._latest[latest_key] = self._compiled[memo_key]
        return self._compiled[memo_key]

    def source(self, kind="forward", max_delay=None, interpolation="linear", continued=False, **static):
        """Generated source: "forward", "inference", "backward", "forward_recompute", "backward_recompute" (Triton),
        "torch_forward", "torch_backward" (the torch path), "c" (the C target) or "module". With `max_delay`, the
        kernels of a layer whose first input goes through a delay line of that length (`delay=`): "forward",
        "inference", "backward" (Triton), "c" or "module"; with `interpolation="gaussian"` those whose line weighs
        every step by taps; with `continued=True` those of the calls that continue a line held from earlier calls."""
        if max_delay is not None:
            line = {"input": self.signature.inputs[0], "max_delay": max_delay, "tapped": interpolation != "linear",
                    "held": bool(continued)}
            compiled = self.compiled("delayed", line, **static)
        else:
            compiled = self.compiled(**static)
        if kind == "module":
            return compiled.module_source()
        if kind not in compiled.meta["sources"]:
            raise ValueError(f"kind must be one of {sorted(compiled.meta['sources']) + ['module']}, got {kind!r}")
        return compiled.meta["sources"][kind]

    def equations(self, **static):
        """The derived forward, saved set and backward equations, as text."""
        return self.compiled(**static).meta["equations"]

    def adjoint(self):
        """The EventProp adjoint system: only for a neuron given by its equations (`flexgen.ode`)."""
        raise SpecError(f"{self.name} is a step function (@flexgen.neuron): EventProp needs the neuron's "
                        "differential equations; write it with @flexgen.ode")

    def __call__(self, step_mode="m", store_state_seqs=False, backend="auto", recompute="auto", **params):
        """A `torch.nn.Module` running this neuron; keyword arguments override hyper-parameters.

        With `recompute=True` training saves no per-step values: the backward re-runs the forward steps;
        the default "auto" does so on CUDA where that moves fewer bytes (see `NeuronModule`).
        """
        if _is_array(step_mode):
            name = self.fn.__name__
            raise TypeError(
                f"{name}(...) builds a layer from the neuron {name!r}; it was given a {type(step_mode).__name__} "
                f"(as step_mode), so it was probably called on the input. Build the layer, then call it: "
                f"`layer = {name}(); layer(x)` (or `{name}()(x)`); `{name}.apply(x)` runs it without a layer"
            )
        return NeuronModule(
            self, step_mode=step_mode, store_state_seqs=store_state_seqs, backend=backend, recompute=recompute, **params
        )

    def apply(self, *inputs, states=None, backend="auto", store_state_seqs=False, recompute="auto", **params):
        """Functional form: `(outputs, final_states) = spec.apply(x_seq, ..., states=[v0], **params)`.

        Without module state: `states` (a list, default: the declared initial
        values) and learnable parameters (tensors in `params`) are passed in.
        """
        return run(self, inputs, states, params, backend=backend, store_state_seqs=store_state_seqs,
                   recompute=recompute)


def _spec_by_reference(module, qualname):
    """The `NeuronSpec` named `qualname` in `module` (the loader behind pickling)."""
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, NeuronSpec):
        raise TypeError(f"{module}.{qualname} is a {type(obj).__name__}, not a flexgen neuron")
    return obj


def neuron(states=(), learnable=(), init=None):
    """Decorator: turn a step function into a `NeuronSpec`.

    The function takes per-step inputs (parameters without default), the
    states named in `states` (their value before the step), hyper-parameters
    (numeric defaults; overridable per layer) and returns its outputs followed
    by the new value of each state. `learnable` parameters become
    `nn.Parameter`s initialised to their default. `init` maps a state to its
    initial value: a number or the name of a hyper-parameter (default 0).

    >>> import flexgen
    >>> @flexgen.neuron(states=("v",))
    ... def lif(x, v, tau=2.0, v_th=1.0):
    ...     h = v + (x - v) / tau
    ...     s = flexgen.spike(h - v_th)
    ...     return s, h * (1.0 - s)
    >>> lif.signature.hyper
    ('tau', 'v_th')
    """
    if callable(states) and not isinstance(states, (tuple, list, str)):
        raise SpecError("use @flexgen.neuron(states=(...)) with parentheses")
    if isinstance(states, str):
        states = (states,)
    if isinstance(learnable, str):
        learnable = (learnable,)

    def decorate(fn):
        return NeuronSpec(fn, states=states, learnable=learnable, init=init)

    return decorate
