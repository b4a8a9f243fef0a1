"""NIR export: `to_nir` writes the NIR graph of a torch model with flexgen neuron layers, tracing it with nirtorch
and writing each layer as its NIR node."""
import math

import numpy
import torch

from ...layers.delay import Delay
from ...layers.neuron import NeuronModule
from ...layers.ode_spec import OdeSpec
from ...neurons import integrate_fire
from .equations import DEFAULT_DT, parameter_names
from .modules import Scale, SequenceWise
from .packages import optional
from .reading import NIRModel, pair


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
    nir = optional("nir")

    from ...neurons import continuous  # its models cost 0.4 s of sympy at import: loaded when used

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
    nir = optional("nir")

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
    nir = optional("nir")

    if isinstance(module, NeuronModule):
        return _export_neuron(module, shape, dt)
    from ...layers.recurrent import Recurrent

    if isinstance(module, Recurrent):
        neuron, feedback, line = _export_recurrent(module, dt)
        nodes = {"input": nir.Input(input_type={"input": numpy.array([module.hidden])}), "neuron": neuron,
                 "feedback": feedback, "output": nir.Output(output_type={"output": numpy.array([module.hidden])})}
        edges = [("input", "neuron"), ("feedback", "neuron"), ("neuron", "output")]
        if line is None:
            edges.append(("neuron", "feedback"))
        else:  # the loop's delay: a Delay node before the weight
            nodes["delay"] = line
            edges += [("neuron", "delay"), ("delay", "feedback")]
        return nir.NIRGraph(nodes=nodes, edges=edges, type_check=False)
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


def _export_recurrent(layer, dt):
    """(neuron node, feedback node) of a `flexgen.Recurrent`: NIR's recurrent loop, the neuron's output through an
    Affine (with a bias) or Linear node back into the neuron, which reads it one step later."""
    nir = optional("nir")

    if layer.scale is not None or (layer.delay is not None and not isinstance(layer.delay, Delay)):
        raise NotImplementedError("flexgen.to_nir: a Recurrent layer with scale= or a SynapseDelay has no NIR form; "
                                  "one with a feedback weight (a bias, a per-neuron Delay) is exported")
    neuron = _export_neuron(layer.cell, (layer.hidden,), dt)
    weight = layer.weight.detach().cpu().numpy()
    if layer.bias is None:
        feedback = nir.Linear(weight=weight)
    else:
        feedback = nir.Affine(weight=weight, bias=layer.bias.detach().cpu().numpy())
    line = None if layer.delay is None else _export_delay(layer.delay, (layer.hidden,), dt)
    return neuron, feedback, line


def _layers_not_exported():
    """flexgen's layers that `to_nir` refuses by name (imported here: they import this module's neighbours)."""
    from ...layers.dense import Chain, Dense

    return Dense, Chain


def _export_delay(module, shape, dt):
    """A `flexgen.Delay` as NIR's Delay: tau = delay x dt per neuron (the delays as the forward uses them)."""
    nir = optional("nir")

    if module.interpolation != "linear":
        raise NotImplementedError("flexgen.to_nir: NIR's Delay shifts in time; a Delay with gaussian taps has no "
                                  "NIR node (round_() its delays and use interpolation='linear' to export it)")
    steps = module.delay.detach().clamp(0.0, float(module.max_delay)).cpu().double().numpy()
    return nir.Delay(delay=_full(steps * dt, shape))


def _export_step_module(module, shape):
    nir = optional("nir")

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
        return cls(kernel_size=numpy.array(pair(module.kernel_size)), stride=numpy.array(pair(module.stride)),
                   padding=numpy.array(pair(module.padding)))
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
        from ...layers.recurrent import Recurrent

        for module in model.modules():
            if isinstance(module, (NeuronModule, Recurrent)):
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
    nir = optional("nir")

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


def _imported_again(graph, modules, shapes, dt):
    """A graph `from_nir` imported, with its nodes written from the modules it became (`modules`, a FeedForward;
    a subgraph's own): a recurrent loop's neuron and feedback node from its `Recurrent` layer."""
    nir = optional("nir")

    nodes = {}
    for name, node in graph.nodes.items():
        module = modules.node_module(name)
        if isinstance(node, (nir.Input, nir.Output)) or module is None:
            nodes.setdefault(name, node)
        elif isinstance(node, nir.NIRGraph):
            nodes[name] = _imported_again(node, module, shapes, dt)
        elif hasattr(module, "nir_feedback"):  # a recurrent loop: its neuron, weight and delay nodes
            nodes[name], nodes[module.nir_feedback], line = _export_recurrent(module, dt)
            if line is not None:
                nodes[module.nir_delay] = line
        else:
            nodes[name] = _export_module(module, shapes[module], dt)
    return nir.NIRGraph(nodes=nodes, edges=list(graph.edges), metadata=dict(graph.metadata), type_check=False)


def to_nir(model, sample, dt=None):
    """The NIR graph of a torch model with flexgen neuron layers; `sample` is an input [T, B, ...] (run once,
    without gradients, to find the shapes; the layers are reset afterwards). The `Ode` models and layers
    imported from NIR are exported as their equations; SpikingJelly-style `flexgen.IF`/`LIF`/`PLIF`
    (discrete) map onto NIR time constants at `dt` as SpikingJelly's exporter does (tau_NIR = tau dt). A neuron
    layer's `delay=` line becomes a Delay node before its neuron node. `dt` defaults to the continuous-time layers'
    own dt, else 1e-4.
    """
    nir = optional("nir")
    nirtorch = optional("nirtorch")

    dt = _step_size(model, dt)
    shapes = _input_shapes(model, sample)
    if isinstance(model, NIRModel):
        return _imported_again(model.nir_graph, model.graph, shapes, dt)

    delay_lines = {}  # id(neuron node) -> the Delay node of its layer's delay= line

    def export(module):
        node = _export_module(module, shapes[module], dt)
        if isinstance(module, NeuronModule) and module.delay is not None:
            delay_lines[id(node)] = _export_delay(module.delay, shapes[module], dt)
        return node

    from ...layers.recurrent import Recurrent

    leaves = {NeuronModule, torch.nn.Linear, torch.nn.Flatten, Scale, SequenceWise, Delay, Recurrent,
              *_layers_not_exported()}
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
