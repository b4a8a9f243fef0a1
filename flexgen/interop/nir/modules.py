"""The torch modules an imported NIR graph holds besides flexgen's layers: the graph itself (its nodes' modules run
in order), one-step modules run over whole sequences, NIR's Scale, and the check that a neuron layer gets the number
of neurons its node declares."""
import keyword

import torch


class FeedForward(torch.nn.Module):
    """A feed-forward graph of modules on one tensor. `steps` is [(node, the nodes it takes input from)] in an order
    where every node comes after its inputs (`graph.running_order`): the first node, with no inputs, passes the input
    on (NIR's Input node); every other node takes the sum of its inputs' outputs, in their order, through its module,
    or passes that sum on where it has none (NIR's Output node, the last, whose output is the graph's). `modules` maps
    nodes to their modules, each an attribute named after its node (dots as underscores; names taken by Python or by
    torch get a `nir_node_` prefix). The steps run in a loop, so a graph of any depth runs; an output is let go after
    its last use."""

    def __init__(self, modules, steps):
        super().__init__()
        self._attributes = {}  # node -> the attribute holding its module
        last_use = {}
        for index, (_, inputs) in enumerate(steps):
            for name in inputs:
                last_use[name] = index
        self._steps = [(name, tuple(inputs), [source for source in dict.fromkeys(inputs) if last_use[source] == index])
                       for index, (name, inputs) in enumerate(steps)]
        for name, module in modules.items():
            attribute = name.replace(".", "_")
            if keyword.iskeyword(attribute) or hasattr(self, attribute):
                attribute = "nir_node_" + attribute
            self.add_module(attribute, module)
            self._attributes[name] = attribute

    def node_module(self, name):
        """The module of node `name`, or None for a node without one (the Input and the Output node)."""
        attribute = self._attributes.get(name)
        return None if attribute is None else self._modules[attribute]

    def forward(self, x):
        outputs = {}
        for name, inputs, released in self._steps:
            if inputs:
                x = outputs[inputs[0]]
                for source in inputs[1:]:
                    x = x + outputs[source]
                if name in self._attributes:
                    x = self._modules[self._attributes[name]](x)
            for source in released:
                del outputs[source]
            outputs[name] = x
        return x


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
