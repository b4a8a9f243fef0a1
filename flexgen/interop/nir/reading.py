"""NIR import: `from_nir` builds a torch model from a NIR graph, with flexgen layers for its neuron nodes and torch
modules for the others; `NIRModel` is what it returns."""
import math

import numpy
import torch

from ...layers.delay import Delay
from ...layers.neuron import NeuronModule
from .equations import DEFAULT_DT, NEURONS, node_spec, parameter_names
from .graph import check_acyclic, check_graph, declared_shape, fold_recurrence, running_order
from .modules import DeclaredShape, FeedForward, Scale, SequenceWise
from .packages import optional


class NIRModel(torch.nn.Module):
    """What `from_nir` returns: the graph run on [T, B, ...] sequences.

    `graph` runs it (a `FeedForward` holding each node's module as an attribute named after the node; a subgraph
    is a `FeedForward` of its own); `nir_graph` is the graph it was made from;
    `reset()` returns every neuron layer to its initial state. A pickled model is imported again from
    its graph, with its parameters (`state_dict`); the neurons start from their initial states."""

    def __init__(self, graph_module, nir_graph, dt, method, backend):
        super().__init__()
        self.graph, self.nir_graph = graph_module, nir_graph
        self.dt, self.method, self.backend = dt, method, backend

    def forward(self, x):
        return self.graph(x)

    def __reduce__(self):
        return _imported_again, (self.nir_graph, self.dt, self.method, self.backend, self.state_dict())

    def reset(self):
        from ...layers.recurrent import Recurrent

        for module in self.modules():
            if isinstance(module, (NeuronModule, Recurrent)):
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
    declared = declared_shape(getattr(node, "input_type", None))
    if declared and math.prod(declared) > 1:  # a node of one neuron is applied to every feature
        layer.register_forward_pre_hook(DeclaredShape(node_name, kind, declared))
    return layer


def recurrent_layer(node_name, node, feedback_name, feedback, dt, method, backend, delay=None):
    """A `flexgen.Recurrent` of a NIR neuron node and the Affine or Linear node that feeds its output back: the
    neuron reads its input plus the product of its last step's output (NIR's loop, one step around), or of the
    output `delay` (a `flexgen.Delay`, from a Delay node in the loop) steps before that."""
    from ...layers.recurrent import Recurrent

    kind = type(node).__name__
    fields = {name: getattr(node, name) for name in parameter_names(kind)}
    scalars, channels = channel_parameters(node_name, kind, fields)
    if channels:
        raise NotImplementedError(f"flexgen.from_nir: the recurrent neuron node {node_name!r} ({kind}) has parameters "
                                  f"{sorted(channels)} that differ between neurons; a recurrent layer's are one value")
    weight = torch.as_tensor(numpy.asarray(feedback.weight), dtype=torch.float32)
    if weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
        raise ValueError(f"flexgen.from_nir: the feedback node {feedback_name!r} of {node_name!r} has a weight of "
                         f"shape {list(weight.shape)}; a recurrent loop needs a square one")
    has_bias = hasattr(feedback, "bias")
    layer = Recurrent(node_spec(kind, (), method), weight.shape[0], bias=has_bias, backend=backend, delay=delay, dt=dt,
                      **scalars)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if has_bias:
            layer.bias.copy_(torch.as_tensor(numpy.asarray(feedback.bias), dtype=torch.float32))
    layer.nir_feedback = feedback_name  # the node `to_nir` writes the weight back to
    return layer


def _linear(node, bias):
    weight = torch.as_tensor(numpy.asarray(node.weight), dtype=torch.float32)
    module = torch.nn.Linear(weight.shape[-1], weight.shape[-2], bias=bias)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias:
            module.bias.copy_(torch.as_tensor(numpy.asarray(node.bias), dtype=torch.float32))
    return module


def pair(value):
    values = numpy.atleast_1d(numpy.asarray(value)).astype(int).tolist()
    return tuple(values * 2) if len(values) == 1 else tuple(values)


def _conv(node, dims):
    weight = torch.as_tensor(numpy.asarray(node.weight), dtype=torch.float32)
    cls = torch.nn.Conv1d if dims == 1 else torch.nn.Conv2d
    padding = node.padding if isinstance(node.padding, str) else pair(node.padding)[:dims]
    module = cls(weight.shape[1] * int(node.groups), weight.shape[0], tuple(weight.shape[2:]),
                 stride=pair(node.stride)[:dims], padding=padding, dilation=pair(node.dilation)[:dims],
                 groups=int(node.groups), bias=True)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(torch.as_tensor(numpy.asarray(node.bias), dtype=torch.float32))
    return SequenceWise(module)


def _pool(node, summed):
    kernel = pair(node.kernel_size)
    module = torch.nn.AvgPool2d(kernel, stride=pair(node.stride), padding=pair(node.padding),
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


def node_map(dt):
    """NIR node class -> its torch module, for the nodes other than neurons, subgraphs, Input and Output."""
    nir = optional("nir")

    return {
        nir.Affine: lambda node: _linear(node, bias=True),
        nir.Linear: lambda node: _linear(node, bias=False),
        nir.Scale: lambda node: Scale(torch.as_tensor(numpy.asarray(node.scale), dtype=torch.float32)),
        nir.Flatten: _flatten,
        nir.Conv1d: lambda node: _conv(node, 1),
        nir.Conv2d: lambda node: _conv(node, 2),
        nir.SumPool2d: lambda node: _pool(node, summed=True),
        nir.AvgPool2d: lambda node: _pool(node, summed=False),
        nir.Delay: lambda node: _delay(node, dt),
    }


def _feedforward(graph, dt, method, backend, prefix=""):
    """A checked graph as a `FeedForward` of its nodes' modules; a subgraph becomes one of its own (its nodes named
    `<subgraph>.<node>` in messages)."""
    nir = optional("nir")

    mapping = node_map(dt)
    neurons = {getattr(nir, kind) for kind in NEURONS}
    whole = graph
    graph, feedback = fold_recurrence(graph, neurons)
    check_acyclic(graph, f"subgraph {prefix[:-1]!r}" if prefix else "the graph")
    modules = {}
    for name, node in graph.nodes.items():
        if isinstance(node, nir.NIRGraph):
            modules[name] = _feedforward(node, dt, method, backend, f"{prefix}{name}.")
        elif name in feedback:
            weights, line = feedback[name]
            modules[name] = recurrent_layer(prefix + name, node, weights, whole.nodes[weights], dt, method, backend,
                                            None if line is None else _delay(whole.nodes[line], dt))
            modules[name].nir_delay = line
        elif type(node) in neurons:
            modules[name] = neuron_layer(prefix + name, node, dt, method, backend)
        elif not isinstance(node, (nir.Input, nir.Output)):
            modules[name] = mapping.get(type(node), _unsupported)(node)
    return FeedForward(modules, running_order(graph))


def from_nir(graph, dt=DEFAULT_DT, method="euler", backend="auto"):
    """A torch model running a NIR graph (a `nir.NIRGraph` or a path to one), with flexgen layers for its
    neurons: [T, B, ...] in, [T, B, ...] out (see `flexgen.interop.nir` for dt, method and shapes).

    >>> import nir, numpy, torch, flexgen
    >>> graph = nir.NIRGraph.from_list(
    ...     nir.Affine(weight=numpy.eye(2, dtype=numpy.float32), bias=numpy.zeros(2, dtype=numpy.float32)),
    ...     nir.LIF(tau=numpy.full(2, 2e-3), r=numpy.full(2, 20.0), v_leak=numpy.zeros(2),
    ...             v_threshold=numpy.ones(2)))
    >>> model = flexgen.from_nir(graph, dt=1e-4, backend="eager")
    >>> model(torch.full((3, 1, 2), 0.6)).flatten().tolist()
    [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    """
    nir = optional("nir")

    if not isinstance(graph, nir.NIRGraph):
        graph = nir.read(graph)
    check_graph(graph)
    return NIRModel(_feedforward(graph, dt, method, backend).float(), graph, dt, method, backend)
