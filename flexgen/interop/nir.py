"""NIR import and export: `flexgen.from_nir(graph)` and `flexgen.to_nir(model, sample)`.

NIR (the Neuromorphic Intermediate Representation, the `nir` package) states
neurons as continuous-time equations; `nirtorch` maps a graph onto torch
modules and traces torch models back into graphs. Here NIR's neuron nodes
become `flexgen.ode` layers (the equations below, integrated by `method`) and
its other nodes torch modules; the torch side of both directions is nirtorch's.

    LIF         tau dv/dt = (v_leak - v) + r x;  fires where v >= v_threshold, v <- v_reset
    CubaLIF     tau_syn di/dt = -i + w_in x;  tau_mem dv/dt = (v_leak - v) + r i;  fires as LIF
    IF          dv/dt = r x;  fires as LIF
    LI          tau dv/dt = (v_leak - v) + r x;  outputs v
    I           dv/dt = r x;  outputs v                (NIR's Integrator)
    CubaLI      CubaLIF's equations without firing;  outputs v

Conventions (a NIR graph carries neither a step size nor a method):

* `dt` is the step in the graph's time unit. The exporters of snnTorch and
  SpikingJelly write time constants in seconds for dt = 1e-4 s (the default),
  mapping a discrete decay beta onto tau = dt / (1 - beta): that is forward
  Euler, so `method="euler"` (the default) with their dt reproduces those
  libraries' neurons; `method="exact"` integrates NIR's equations exactly
  (decay exp(-dt / tau) instead of 1 - dt / tau).
* States start at 0. NIR fires where v > v_threshold, flexgen where
  v >= v_threshold (they differ only where v equals the threshold).
* Shapes: NIR shapes leave out the batch; the imported model takes and returns
  [T, B, ...] sequences, running each neuron layer over all T steps at once
  (recurrent graphs, which need one step at a time, are not supported).
  NIR's Flatten dimensions count from the first dimension after the batch.
* A neuron parameter that differs between neurons must differ only along the
  first (channel) dimension: it becomes a per-channel parameter of the layer.
"""
import functools
import importlib
import math

import numpy
import torch

from ..layers.delay import Delay
from ..layers.neuron import NeuronModule
from ..neurons import integrate_fire
from ..layers.ode_spec import Dynamics, OdeSpec, ode


def _optional(package):
    """nir or nirtorch, imported on first use: they are optional (`pip install "flexgen-snn[nir]"`)."""
    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(f"flexgen's NIR import and export need the {package!r} package: "
                          'pip install nir nirtorch (or pip install "flexgen-snn[nir]")') from exc


DEFAULT_DT = 1e-4


# --- NIR's neuron equations --------------------------------------------------------------------------

def nir_lif(x, v, tau=1.0, r=1.0, v_leak=0.0, v_threshold=1.0, v_reset=0.0):
    return Dynamics({"v": (v_leak - v + r * x) / tau}, threshold=v >= v_threshold, reset={"v": v_reset})


def nir_cuba_lif(x, i, v, tau_syn=1.0, tau_mem=2.0, r=1.0, v_leak=0.0, v_threshold=1.0, v_reset=0.0, w_in=1.0):
    return Dynamics({"i": (w_in * x - i) / tau_syn, "v": (v_leak - v + r * i) / tau_mem},
                    threshold=v >= v_threshold, reset={"v": v_reset})


def nir_if(x, v, r=1.0, v_threshold=1.0, v_reset=0.0):
    return Dynamics({"v": r * x}, threshold=v >= v_threshold, reset={"v": v_reset})


def nir_li(x, v, tau=1.0, r=1.0, v_leak=0.0):
    return Dynamics({"v": (v_leak - v + r * x) / tau}, outputs=(v,))


def nir_integrator(x, v, r=1.0):
    return Dynamics({"v": r * x}, outputs=(v,))


def nir_cuba_li(x, i, v, tau_syn=1.0, tau_mem=2.0, r=1.0, v_leak=0.0, w_in=1.0):
    return Dynamics({"i": (w_in * x - i) / tau_syn, "v": (v_leak - v + r * i) / tau_mem}, outputs=(v,))


# NIR node class name -> (equations, states); the equations' parameters are the node's fields.
NEURONS = {
    "LIF": (nir_lif, ("v",)),
    "CubaLIF": (nir_cuba_lif, ("i", "v")),
    "IF": (nir_if, ("v",)),
    "LI": (nir_li, ("v",)),
    "I": (nir_integrator, ("v",)),
    "CubaLI": (nir_cuba_li, ("i", "v")),
}


def parameter_names(kind):
    fn, states = NEURONS[kind]
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return [n for n in names if n != "x" and n not in states]


@functools.lru_cache(maxsize=None)
def node_spec(kind, learnable=(), method="euler"):
    """The `OdeSpec` of NIR's `kind` neuron with these parameters learnable (those that differ between
    channels), integrated by `method`. Made once per combination; pickled as this call."""
    fn, states = NEURONS[kind]
    spec = ode(states=states, method=method, learnable=learnable, dt=DEFAULT_DT)(fn)
    spec.rebuild = (node_spec, (kind, learnable, method))
    spec.nir_kind = kind
    return spec


# --- import ------------------------------------------------------------------------------------------

class SequenceWise(torch.nn.Module):
    """A module for one step ([B, ...]) applied to every step of a [T, B, ...] sequence at once."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        steps, batch = x.shape[:2]
        y = self.module(x.flatten(0, 1))
        return y.unflatten(0, (steps, batch))


class Scale(torch.nn.Module):
    """NIR's Scale: the input times a fixed factor per neuron."""

    def __init__(self, scale):
        super().__init__()
        self.register_buffer("scale", torch.as_tensor(scale))

    def forward(self, x):
        return x * self.scale


class NIRModel(torch.nn.Module):
    """What `from_nir` returns: the graph as nirtorch's `GraphModule`, run on [T, B, ...] sequences.

    `nir_graph` is the graph it was made from (its node names are the modules' names);
    `reset()` returns every neuron layer to its initial state. A pickled model is imported again from
    its graph, with its parameters (`state_dict`); the neurons start from their initial states."""

    def __init__(self, graph_module, nir_graph, dt, method, backend):
        super().__init__()
        self.graph, self.nir_graph = graph_module, nir_graph
        self.dt, self.method, self.backend = dt, method, backend

    def forward(self, x):
        output, _ = self.graph(x)
        return output

    def __reduce__(self):
        return _imported_again, (self.nir_graph, self.dt, self.method, self.backend, self.state_dict())

    def reset(self):
        for module in self.modules():
            if isinstance(module, NeuronModule):
                module.reset()


def _imported_again(graph, dt, method, backend, state):
    model = from_nir(graph, dt=dt, method=method, backend=backend)
    model.load_state_dict(state)
    return model


def _uniform(values):
    flat = values.reshape(-1)
    return flat.size and bool(numpy.all(flat == flat[0]))


def _check_values(node_name, kind, name, values):
    if not numpy.all(numpy.isfinite(values)):
        raise ValueError(f"NIR node {node_name!r} ({kind}): {name} holds NaN or infinite values; every parameter "
                         "must be a finite number")
    if name.startswith("tau") and numpy.any(values <= 0):
        raise ValueError(f"NIR node {node_name!r} ({kind}): {name} is a time constant and must be positive, got "
                         f"{values.min():g} as its smallest value")


def channel_parameters(node_name, kind, fields):
    """({name: number} for parameters equal for all neurons, {name: [C] array} for the others)."""
    scalars, channels = {}, {}
    for name, values in fields.items():
        values = numpy.asarray(values, dtype=numpy.float64)
        _check_values(node_name, kind, name, values)
        if _uniform(values):
            scalars[name] = float(values.reshape(-1)[0])
            continue
        first = values.reshape(values.shape[0], -1)
        if not numpy.all(first == first[:, :1]):
            raise NotImplementedError(
                f"NIR node {node_name!r} ({kind}): {name} differs between neurons of one channel (shape "
                f"{values.shape}); flexgen layers take one value per layer or per channel (the first dimension)"
            )
        channels[name] = first[:, 0]
    sizes = {len(v) for v in channels.values()}
    if len(sizes) > 1:
        raise NotImplementedError(f"NIR node {node_name!r} ({kind}): per-channel parameters of different lengths "
                                  f"{sorted(sizes)}")
    return scalars, channels


def neuron_layer(node_name, node, dt, method, backend):
    """The flexgen layer of a NIR neuron node."""
    kind = type(node).__name__
    fields = {name: getattr(node, name) for name in parameter_names(kind)}
    scalars, channels = channel_parameters(node_name, kind, fields)
    spec = node_spec(kind, tuple(sorted(channels)), method)
    per_channel = len(next(iter(channels.values()))) if channels else None
    learnable = {name: torch.tensor(values, dtype=torch.float32) for name, values in channels.items()}
    layer = spec(dt=dt, backend=backend, per_channel=per_channel, **scalars, **learnable)
    declared = _declared_shape(getattr(node, "input_type", None))
    if declared and math.prod(declared) > 1:  # a node of one neuron is applied to every feature
        layer.register_forward_pre_hook(DeclaredShape(node_name, kind, declared))
    return layer


class DeclaredShape:
    """A forward pre-hook: the neuron layer of a NIR node takes [T, B, *shape] of the shape its node declares
    (its parameters may be one value for all neurons, which would broadcast to any shape)."""

    def __init__(self, node_name, kind, shape):
        self.node_name, self.kind, self.shape = node_name, kind, tuple(shape)

    def __call__(self, layer, args):
        got = tuple(args[0].shape[2:])
        if got != self.shape:
            raise ValueError(f"NIR node {self.node_name!r} ({self.kind}) declares {list(self.shape)} neurons, "
                             f"got inputs {list(args[0].shape)}: [T, B, {', '.join(map(str, self.shape))}] expected")


def _linear(node, bias):
    weight = torch.as_tensor(numpy.asarray(node.weight), dtype=torch.float32)
    module = torch.nn.Linear(weight.shape[-1], weight.shape[-2], bias=bias)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias:
            module.bias.copy_(torch.as_tensor(numpy.asarray(node.bias), dtype=torch.float32))
    return module


def _pair(value):
    values = numpy.atleast_1d(numpy.asarray(value)).astype(int).tolist()
    return tuple(values * 2) if len(values) == 1 else tuple(values)


def _conv(node, dims):
    weight = torch.as_tensor(numpy.asarray(node.weight), dtype=torch.float32)
    cls = torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d
    padding = node.padding if isinstance(node.padding, str) else _pair(node.padding)[:dims]
    module = cls(weight.shape[1] * int(node.groups), weight.shape[0], tuple(weight.shape[2:]),
                 stride=_pair(node.stride)[:dims], padding=padding, dilation=_pair(node.dilation)[:dims],
                 groups=int(node.groups), bias=True)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(torch.as_tensor(numpy.asarray(node.bias), dtype=torch.float32))
    return SequenceWise(module)


def _pool(node, summed):
    kernel = _pair(node.kernel_size)
    module = torch.nn.AvgPool2d(kernel, stride=_pair(node.stride), padding=_pair(node.padding),
                                divisor_override=1 if summed else None)
    return SequenceWise(module)


def _flatten(node):
    """NIR's dimensions count from after the batch; the sequences have two leading dimensions."""
    end = node.end_dim + 2 if node.end_dim >= 0 else node.end_dim
    return torch.nn.Flatten(node.start_dim + 2, end)


def _delay(node, dt):
    """NIR's Delay, y(t) = x(t - tau) with tau in the graph's time unit, as fixed delays of tau / dt steps (whole
    steps where tau / dt is within 1e-9 of one; else linear taps between the two steps around it)."""
    tau = numpy.asarray(node.delay, dtype=float)
    steps = numpy.atleast_1d(tau / dt)
    channels = steps.reshape(steps.shape[0], -1)
    if not numpy.isfinite(channels).all() or (channels < 0).any():
        raise ValueError(f"flexgen.from_nir: a Delay node's delays must be finite and >= 0, got {tau.tolist()}")
    if not (channels == channels[:, :1]).all():
        raise NotImplementedError("flexgen.from_nir: a Delay node whose delays differ within a channel (beyond the "
                                  "first dimension) has no flexgen layer; flexgen.Delay delays whole channels")
    per_channel = channels[:, 0]
    whole = numpy.round(per_channel)
    per_channel = numpy.where(numpy.abs(per_channel - whole) <= 1e-9, whole, per_channel)
    return Delay(len(per_channel), max_delay=int(math.ceil(per_channel.max())), learnable=False,
                 delay=torch.as_tensor(per_channel, dtype=torch.float32))


def _unsupported(node):
    raise NotImplementedError(f"flexgen.from_nir: NIR's {type(node).__name__} node is not supported")


def _check_graph(graph, where="the graph"):
    """Refuse, before anything is built, a graph nirtorch cannot run: edges to unknown nodes, other than one Input
    and one Output node, a node off every path from the Input to the Output node (nirtorch loops forever on such
    graphs), or an edge between nodes whose declared shapes differ."""
    nir = _optional("nir")

    names = list(graph.nodes)
    following, preceding = {}, {}
    for source, target in graph.edges:
        for end in (source, target):
            if end not in graph.nodes:
                raise ValueError(f"flexgen.from_nir: {where} has an edge ({source!r}, {target!r}) to {end!r}, which is "
                                 f"not one of its nodes {names}")
        following.setdefault(source, []).append(target)
        preceding.setdefault(target, []).append(source)
    ends = {kind: [n for n, node in graph.nodes.items() if isinstance(node, getattr(nir, kind))]
            for kind in ("Input", "Output")}
    for kind, found in ends.items():
        if len(found) != 1:
            raise ValueError(
                f"flexgen.from_nir: {where} has {len(found)} {kind} nodes {found}; the model it becomes takes one "
                f"sequence and returns one, so it needs exactly one (nir.NIRGraph gives every node left without "
                f"edges an Input and an Output node of its own, named input_<node> and output_<node>)"
            )
    for kind, links, relation in (("Input", following, "reached from"), ("Output", preceding, "leading to")):
        off_path = [n for n in names if n not in _reachable(ends[kind], links)]
        if off_path:
            raise ValueError(
                f"flexgen.from_nir: {where} has node(s) {off_path} on no path {relation} an {kind} node "
                f"{ends[kind]} ({len(graph.edges)} edge(s)); every node must lie on a path from an Input to an Output"
            )
    for source, target in graph.edges:
        _check_edge_shapes(graph, source, target, where)
    for name, node in graph.nodes.items():
        if isinstance(node, nir.NIRGraph):
            _check_graph(node, f"subgraph {name!r}")


def _reachable(starts, links):
    seen, todo = set(starts), list(starts)
    while todo:
        for following in links.get(todo.pop(), ()):
            if following not in seen:
                seen.add(following)
                todo.append(following)
    return seen


def _declared_shape(types):
    """The one shape a node declares for its input or output, or None where it declares none (or several)."""
    if not types or len(types) != 1:
        return None
    shape = next(iter(types.values()))
    return None if shape is None else tuple(int(d) for d in numpy.asarray(shape).reshape(-1))


def _check_edge_shapes(graph, source, target, where):
    produced = _declared_shape(getattr(graph.nodes[source], "output_type", None))
    expected = _declared_shape(getattr(graph.nodes[target], "input_type", None))
    if produced is not None and expected is not None and produced != expected:
        raise ValueError(f"flexgen.from_nir: in {where}, {source!r} outputs shape {list(produced)} "
                         f"but {target!r} takes shape {list(expected)} (edge {source!r} -> {target!r})")


def _check_feedforward(graph, where="the graph"):
    nir = _optional("nir")

    edges = {}
    for source, target in graph.edges:
        edges.setdefault(source, []).append(target)
    state = {}

    def visit(name, path):
        state[name] = "open"
        for following in edges.get(name, ()):
            if state.get(following) == "open":
                cycle = " -> ".join(path[path.index(following):] + [following]) if following in path else following
                raise NotImplementedError(
                    f"flexgen.from_nir: {where} is recurrent ({cycle}); flexgen layers run all time steps at once, "
                    "which a recurrent connection does not allow"
                )
            if following not in state:
                visit(following, path + [following])
        state[name] = "done"

    for name in graph.nodes:
        if name not in state:
            visit(name, [name])
    for name, node in graph.nodes.items():
        if isinstance(node, nir.NIRGraph):
            _check_feedforward(node, f"subgraph {name!r}")


def _node_names(graph, prefix=""):
    """id(node) -> its name in the graph (dotted in subgraphs), for messages."""
    nir = _optional("nir")

    names = {}
    for name, node in graph.nodes.items():
        names[id(node)] = prefix + name
        if isinstance(node, nir.NIRGraph):
            names.update(_node_names(node, f"{prefix}{name}."))
    return names


def node_map(graph, dt, method, backend):
    """NIR node class -> torch module, for `nirtorch.nir_to_torch`."""
    nir = _optional("nir")

    names = _node_names(graph)

    def neuron(node):
        return neuron_layer(names.get(id(node), type(node).__name__), node, dt, method, backend)

    mapping = {
        nir.Affine: lambda node: _linear(node, bias=True),
        nir.Linear: lambda node: _linear(node, bias=False),
        nir.Scale: lambda node: Scale(torch.as_tensor(numpy.asarray(node.scale), dtype=torch.float32)),
        nir.Flatten: _flatten,
        nir.Conv1d: lambda node: _conv(node, 1),
        nir.Conv2d: lambda node: _conv(node, 2),
        nir.SumPool2d: lambda node: _pool(node, summed=True),
        nir.AvgPool2d: lambda node: _pool(node, summed=False),
        nir.Delay: lambda node: _delay(node, dt),
        nir.Threshold: _unsupported,
    }
    for kind in NEURONS:
        mapping[getattr(nir, kind)] = neuron
    return mapping


def from_nir(graph, dt=DEFAULT_DT, method="euler", backend="auto"):
    """A torch model running a NIR graph (a `nir.NIRGraph` or a path to one), with flexgen layers for its
    neurons: [T, B, ...] in, [T, B, ...] out (see the module docstring for dt, method and shapes).

    >>> import nir, numpy, torch, flexgen
    >>> graph = nir.NIRGraph.from_list(
    ...     nir.Affine(weight=numpy.eye(2, dtype=numpy.float32), bias=numpy.zeros(2, dtype=numpy.float32)),
    ...     nir.LIF(tau=numpy.full(2, 2e-3), r=numpy.full(2, 20.0), v_leak=numpy.zeros(2),
    ...             v_threshold=numpy.ones(2)))
    >>> model = flexgen.from_nir(graph, dt=1e-4, backend="eager")
    >>> model(torch.full((3, 1, 2), 0.6)).flatten().tolist()
    [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    """
    nir = _optional("nir")
    nirtorch = _optional("nirtorch")

    if not isinstance(graph, nir.NIRGraph):
        graph = nir.read(graph)
    _check_graph(graph)
    _check_feedforward(graph)
    mapping = node_map(graph, dt, method, backend)
    graph_module = nirtorch.nir_to_torch(graph, mapping)
    return NIRModel(graph_module, graph, dt, method, backend)


# --- export ------------------------------------------------------------------------------------------

def _full(value, shape):
    value = (value.detach().cpu().double().numpy() if isinstance(value, torch.Tensor)
             else numpy.asarray(value, dtype=float))
    if value.ndim == 1 and len(shape) and value.shape[0] == shape[0] != 1:  # per channel
        value = value.reshape((-1,) + (1,) * (len(shape) - 1))
    return numpy.broadcast_to(value, shape).copy()


def _values(layer):
    """name -> value (number or tensor) of every hyper- and learnable parameter of a layer."""
    values = dict(layer.hyper)
    values.update({w: getattr(layer, w) for w in layer.spec.signature_for(layer.static).learnable})
    return values


def _export_neuron(layer, shape, dt):
    nir = _optional("nir")

    from ..neurons import continuous  # its models cost 0.4 s of sympy at import: loaded when used

    spec, values, static = layer.spec, _values(layer), layer.static
    kind = getattr(spec, "nir_kind", None)
    if kind is not None:
        return getattr(nir, kind)(**{name: _full(values[name], shape) for name in parameter_names(kind)})
    if spec is continuous.lif:
        return nir.LIF(tau=_full(values["tau"], shape), r=_full(values["r"], shape),
                       v_leak=_full(values["v_rest"], shape), v_threshold=_full(values["v_th"], shape),
                       v_reset=_full(values["v_reset"], shape))
    if spec is continuous.cuba_lif:
        return nir.CubaLIF(
            tau_syn=_full(values["tau_syn"], shape), tau_mem=_full(values["tau_mem"], shape),
            r=_full(values["r"], shape), v_leak=_full(values["v_leak"], shape),
            v_threshold=_full(values["v_th"], shape), v_reset=_full(values["v_reset"], shape),
            w_in=_full(values["w_in"], shape),
        )
    if spec in (integrate_fire.if_step, integrate_fire.lif_step, integrate_fire.plif_step):
        return _export_integrate_fire(layer, spec, values, static, shape, dt)
    raise NotImplementedError(
        f"flexgen.to_nir: {spec.name!r} has no NIR node; NIR has LIF, CubaLIF, IF, LI, I and CubaLI "
        "(exported from flexgen.IF/LIF/PLIF, the Ode LIF models and layers imported from NIR)"
    )


def _export_integrate_fire(layer, spec, values, static, shape, dt):
    """SpikingJelly-style IF/LIF/PLIF as NIR nodes by the exporters' Euler convention, tau_NIR = tau dt."""
    nir = _optional("nir")

    if static["soft_reset"]:
        raise NotImplementedError(
            f"flexgen.to_nir: {type(layer).__name__} with a soft reset (v_reset=None) has no NIR node: NIR's "
            "neurons reset to v_reset"
        )
    threshold, reset = _full(values["v_threshold"], shape), _full(values["v_reset"], shape)
    if spec is integrate_fire.if_step:
        return nir.IF(r=_full(1.0 / dt, shape), v_threshold=threshold, v_reset=reset)
    tau = values["tau"] if spec is integrate_fire.lif_step else 1.0 / torch.sigmoid(values["w"].detach())
    r = 1.0 if static["decay_input"] else tau
    return nir.LIF(tau=_full(tau * dt, shape), r=_full(r, shape), v_leak=reset, v_threshold=threshold, v_reset=reset)


def _export_module(module, shape, dt):
    nir = _optional("nir")

    if isinstance(module, NeuronModule):
        return _export_neuron(module, shape, dt)
    if isinstance(module, torch.nn.Linear):
        weight = module.weight.detach().cpu().numpy()
        if module.bias is None:
            return nir.Linear(weight=weight)
        return nir.Affine(weight=weight, bias=module.bias.detach().cpu().numpy())
    if isinstance(module, Scale):
        return nir.Scale(scale=module.scale.cpu().numpy())
    if isinstance(module, torch.nn.Flatten):
        if module.start_dim < 2 and module.start_dim >= 0:
            raise NotImplementedError("flexgen.to_nir: a Flatten over the time or batch dimension has no NIR node")
        end = module.end_dim - 2 if module.end_dim >= 0 else module.end_dim
        return nir.Flatten(input_type={"input": numpy.array(shape)}, start_dim=module.start_dim - 2, end_dim=end)
    if isinstance(module, SequenceWise):
        return _export_step_module(module.module, shape)
    if isinstance(module, Delay):
        return _export_delay(module, shape, dt)
    if isinstance(module, _layers_not_exported()):
        raise NotImplementedError(f"flexgen.to_nir: {type(module).__name__} layers are not exported to NIR yet; "
                                  "a feed-forward model of torch.nn.Linear and flexgen neuron layers is")
    raise NotImplementedError(f"flexgen.to_nir: no NIR node for {type(module).__name__}")


def _layers_not_exported():
    """flexgen's layers that `to_nir` refuses by name (imported here: they import this module's neighbours)."""
    from ..layers.dense import Chain, Dense
    from ..layers.recurrent import Recurrent

    return Recurrent, Dense, Chain


def _export_delay(module, shape, dt):
    """A `flexgen.Delay` as NIR's Delay: tau = delay x dt per neuron (the delays as the forward uses them)."""
    nir = _optional("nir")

    if module.interpolation != "linear":
        raise NotImplementedError("flexgen.to_nir: NIR's Delay shifts in time; a Delay with gaussian taps has no "
                                  "NIR node (round_() its delays and use interpolation='linear' to export it)")
    steps = module.delay.detach().clamp(0.0, float(module.max_delay)).cpu().double().numpy()
    return nir.Delay(delay=_full(steps * dt, shape))


def _export_step_module(module, shape):
    nir = _optional("nir")

    if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d)):
        cls = nir.Conv1d if isinstance(module, torch.nn.Conv1d) else nir.Conv2d
        spatial = shape[1:] if len(shape) > 1 else None
        bias = (module.bias.detach().cpu().numpy() if module.bias is not None
                else numpy.zeros(module.out_channels, numpy.float32))
        return cls(input_shape=spatial if cls is nir.Conv2d else (spatial[0] if spatial else None),
                   weight=module.weight.detach().cpu().numpy(), stride=_unpair(module.stride),
                   padding=module.padding if isinstance(module.padding, str) else _unpair(module.padding),
                   dilation=_unpair(module.dilation), groups=module.groups, bias=bias)
    if isinstance(module, torch.nn.AvgPool2d):
        cls = nir.SumPool2d if module.divisor_override == 1 else nir.AvgPool2d
        return cls(kernel_size=numpy.array(_pair(module.kernel_size)), stride=numpy.array(_pair(module.stride)),
                   padding=numpy.array(_pair(module.padding)))
    raise NotImplementedError(f"flexgen.to_nir: no NIR node for {type(module).__name__} in a SequenceWise")


def _unpair(value):
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return values[0] if len(values) == 1 else numpy.array(values)


def _input_shapes(model, sample):
    """Each module's input shape without the time and batch dimensions, from a run on `sample`."""
    shapes, hooks = {}, []

    def record(module, args):
        if args and isinstance(args[0], torch.Tensor):
            shapes.setdefault(module, tuple(args[0].shape[2:]))

    for module in model.modules():
        hooks.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for hook in hooks:
            hook.remove()
        for module in model.modules():
            if isinstance(module, NeuronModule):
                module.reset()
    return shapes


def _step_size(model, dt):
    """The graph's dt: `dt`, else the one the continuous-time layers run at (they must agree: a NIR
    graph has no step size, so an importer runs every neuron at one)."""
    steps = {name: layer.hyper["dt"] for name, layer in model.named_modules()
             if isinstance(layer, NeuronModule) and isinstance(layer.spec, OdeSpec)}
    chosen = dt if dt is not None else next(iter(steps.values()), DEFAULT_DT)
    for name, step in steps.items():
        if not math.isclose(step, chosen, rel_tol=1e-6):
            raise ValueError(
                f"flexgen.to_nir: layer {name!r} runs at dt={step:g}, the graph at dt={chosen:g}; a NIR graph has no "
                "step size (an importer runs all its neurons at one), so export layers that share one dt"
            )
    return chosen


def _with_delay_nodes(graph, delay_lines):
    """`graph` with a neuron layer's delay line (`delay=`) as a Delay node of its own on the edges into the
    neuron, named `<neuron>_delay`: NIR has no neuron with a delayed input."""
    nir = _optional("nir")

    if not delay_lines:
        return graph
    names = {id(node): name for name, node in graph.nodes.items()}
    nodes, edges = dict(graph.nodes), list(graph.edges)
    for node_id, delay_node in delay_lines.items():
        neuron = names[node_id]
        line = f"{neuron}_delay"
        if line in nodes:
            raise ValueError(f"flexgen.to_nir: the graph already has a node named {line!r}")
        nodes[line] = delay_node
        edges = [(source, line if target == neuron else target) for source, target in edges] + [(line, neuron)]
    return nir.NIRGraph(nodes=nodes, edges=edges, metadata=dict(graph.metadata))


def to_nir(model, sample, dt=None):
    """The NIR graph of a torch model with flexgen neuron layers; `sample` is an input [T, B, ...] (run once,
    without gradients, to find the shapes; the layers are reset afterwards). The `Ode` models and layers
    imported from NIR are exported as their equations; SpikingJelly-style `flexgen.IF`/`LIF`/`PLIF`
    (discrete) map onto NIR time constants at `dt` as SpikingJelly's exporter does (tau_NIR = tau dt). A neuron
    layer's `delay=` line becomes a Delay node before its neuron node. `dt` defaults to the continuous-time layers'
    own dt, else 1e-4.
    """
    nir = _optional("nir")
    nirtorch = _optional("nirtorch")

    dt = _step_size(model, dt)
    shapes = _input_shapes(model, sample)
    if isinstance(model, NIRModel):
        modules = dict(model.graph.named_children())
        nodes = {}
        for name, node in model.nir_graph.nodes.items():
            module = modules.get(name.replace(".", "_"))
            if isinstance(node, (nir.Input, nir.Output)) or module is None:
                nodes[name] = node
            else:
                nodes[name] = _export_module(module, shapes[module], dt)
        return nir.NIRGraph(nodes=nodes, edges=list(model.nir_graph.edges), metadata=dict(model.nir_graph.metadata))

    delay_lines = {}  # id(neuron node) -> the Delay node of its layer's delay= line

    def export(module):
        node = _export_module(module, shapes[module], dt)
        if isinstance(module, NeuronModule) and module.delay is not None:
            delay_lines[id(node)] = _export_delay(module.delay, shapes[module], dt)
        return node

    leaves = {NeuronModule, torch.nn.Linear, torch.nn.Flatten, Scale, SequenceWise, Delay, *_layers_not_exported()}
    for module in model.modules():
        if isinstance(module, NeuronModule):
            leaves.add(type(module))
    graph = nirtorch.torch_to_nir(model, {cls: export for cls in leaves}, default_dict=None, type_check=False)
    graph = _with_delay_nodes(graph, delay_lines)
    for node in graph.nodes.values():
        if isinstance(node, nir.Input):
            node.input_type = {"input": numpy.array(sample.shape[2:])}
            node.output_type = {"output": numpy.array(sample.shape[2:])}
    graph.infer_types()
    return graph


__all__ = ["from_nir", "to_nir", "NIRModel", "SequenceWise", "Scale", "node_spec", "NEURONS"]
