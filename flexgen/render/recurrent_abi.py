"""A recurrent layer's kernel ABI: its `RecurrentLayout` (the neuron's layout, the input the recurrent product is
added to and the output fed back into it) and the argument lists of its kernels, the neuron's
(`flexgen.render.layout`) followed by the recurrent weight, bias and delay line."""
import dataclasses

from .layout import Access, Argument, Backward, Forward, Layout, backward_arguments, forward_arguments


@dataclasses.dataclass(frozen=True)
class RecurrentLayout:
    """A recurrent layer's kernels: the neuron's layout, the input the recurrent product is added to (`input`)
    and the output fed back into it (`output`)."""

    layout: Layout
    input: str
    output: str
    delayed: bool = False  # the output is fed back through per-neuron delays (lags and fractions per hidden neuron)
    tapped: bool = False  # delayed, through any taps per hidden neuron ([H, max_delay + 1]) instead of two
    synaptic: bool = False  # a delay per synapse: the weight is tap matrices side by side, [H, N_TAPS H]

    @property
    def input_index(self):
        return self.layout.inputs.index(self.input)

    @property
    def output_index(self):
        return self.layout.outputs.index(self.output)

    @property
    def reads_previous(self):
        """Whether the forward kernels can start from a previous output (`rec_previous`, where `rec_previous_given`):
        an undelayed layer's, whose first step's operand is that one output. Its forward's product reads the step
        before's output only, and may keep its slice of the weight in registers (STATIONARY_WEIGHT)."""
        return not (self.delayed or self.synaptic)

    @property
    def grad_input(self):
        """The backward's name for the gradient of the input, which is also the recurrent current's."""
        return self.layout.grad_inputs[self.input_index]

    @property
    def grad_output(self):
        return self.layout.grad_outputs[self.output_index]

    def kernel_name(self, kind):
        """"forward", "inference" or "backward": the generated function of that kind."""
        return f"{self.layout.neuron}_recurrent_{kind}"

    def to_json(self):
        return {"layout": self.layout.to_json(), "input": self.input, "output": self.output, "delayed": self.delayed,
                "tapped": self.tapped, "synaptic": self.synaptic}

    @classmethod
    def from_json(cls, record):
        return cls(Layout.from_json(record["layout"]), record["input"], record["output"], record.get("delayed", False),
                   record.get("tapped", False), record.get("synaptic", False))


def _delay_line_arguments(layout, group, first):
    """A delayed layer's lags (whole steps) and fractions, one per hidden neuron, or its taps [H, max_delay + 1]."""
    if layout.tapped:
        return [Argument("rec_taps", Access.MATRIX, group, first)]
    return [Argument("rec_lag", Access.COLUMNS, group, first), Argument("rec_frac", Access.COLUMNS, group, first + 1)]


def recurrent_forward_arguments(layout, training):
    """The recurrent forward kernel's arguments: the neuron's, then the recurrent weight and bias, then an undelayed
    layer's previous output [B, H] (its first step's operand, where the launch's `rec_previous_given`); a delayed
    layer's lags and fractions instead, or its taps and the ring of [max_delay + 2, B, H] rows where each step's
    output, through the taps, adds to the operands of the steps after it."""
    args = forward_arguments(layout.layout, training) + [
        Argument("rec_weight", Access.MATRIX, Forward.RECURRENT, 0),
        Argument("rec_bias", Access.COLUMNS, Forward.RECURRENT, 1),
    ]
    if layout.tapped:
        return args + _delay_line_arguments(layout, Forward.RECURRENT, 2) + [
            Argument("rec_ring", Access.ROWS, Forward.RECURRENT, 3)]
    if layout.delayed:
        return args + _delay_line_arguments(layout, Forward.RECURRENT, 2)
    return args + ([Argument("rec_previous", Access.ROWS, Forward.RECURRENT, 2)] if layout.reads_previous else [])


def recurrent_step_arguments(layout):
    """The one-step kernel's arguments (an undelayed layer's, for streams): the inference forward's, then the
    weight [H, n_in] and bias [H] (or 0-d) of the product of the layer's input taken inside the kernel, and that
    input [B, n_in]."""
    if not layout.reads_previous:
        raise ValueError("the one-step kernel is an undelayed recurrent layer's")
    return recurrent_forward_arguments(layout, training=False) + [
        Argument("in_weight", Access.MATRIX, Forward.RECURRENT, 3),
        Argument("in_bias", Access.COLUMNS, Forward.RECURRENT, 4),
        Argument("in_x", Access.ROWS, Forward.RECURRENT, 5),
    ]


def recurrent_backward_arguments(layout):
    """The recurrent backward kernel's arguments: the neuron's, then the recurrent weight (and a delayed layer's
    lags and fractions and the [T, B, H] rows where the fed-back output's gradient collects; or its taps and a ring
    of [max_delay + 2, B, H] rows where each operand's gradient, through the taps, adds to the outputs it read)."""
    args = backward_arguments(layout.layout) + [Argument("rec_weight", Access.MATRIX, Backward.RECURRENT, 0)]
    if layout.delayed:
        line = _delay_line_arguments(layout, Backward.RECURRENT, 1)
        rows = "rec_ring" if layout.tapped else "rec_collected"
        args += line + [Argument(rows, Access.ROWS, Backward.RECURRENT, 1 + len(line))]
    return args
