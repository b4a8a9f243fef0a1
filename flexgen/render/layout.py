"""Between derive and render/launch: the kernel ABI, what the generated kernels read and write, in which order.

Hands a `Layout` (every tensor named, the saved set typed) and its argument lists to render, which prints them as
kernel signatures, and to launch, which fills the same lists with a call's tensors. The C target's parameter lists
are in `flexgen.render.c_abi`, a recurrent layer's layout and argument lists in `flexgen.render.recurrent_abi`.
"""
import dataclasses
import enum

# Values per neuron the recompute backward keeps in registers for one chunk of steps: the chunk is as
# long as that allows (4 steps when the backward reads one value per step). Longer chunks write fewer
# checkpoints but hold more registers: on an H200, LIF's recompute backward reached 30-88 % of copy
# bandwidth with 8-step chunks and 47-97 % with 4 (docs/perf/NOTES.md).
RECOMPUTE_VALUES = 4


class Kind(enum.Enum):
    """Where a value the backward reads comes from."""

    INPUT = "input"  # a per-step input, read again through its strides
    OUTPUT = "output"  # an output the forward wrote anyway
    STATE = "state"  # an initial state (recompute: the first chunk re-runs from it; plain: the first value of a
    # state kept in bytes, which the bytes cannot hold)
    BUFFER = "buffer"  # a per-step value the training forward writes only for the backward
    CHECKPOINT = "checkpoint"  # the states before every chunk but the first (recompute)


@dataclasses.dataclass(frozen=True)
class SavedValue:
    """One value the backward reads per step; `index` among the inputs, outputs or states it is (0 for the rest).
    `binary`: a buffer of a value that is 0 or 1 at every step (a state: at every step after the first), kept in
    bytes (`allocate.BINARY`); a state's first value is read from its initial state, saved too."""

    name: str
    kind: Kind
    index: int = 0
    binary: bool = False

    @property
    def written_for_backward(self):
        return self.kind in (Kind.BUFFER, Kind.CHECKPOINT)

    @property
    def stem(self):
        """The kernels' name for this tensor: a saved buffer is `<value>_buf` (the value itself is a local)."""
        return f"{self.name}_buf" if self.kind is Kind.BUFFER else self.name


def pick_saved(saved, sources, buffers):
    """The tensors of `saved` (SavedValues, in order): an input, state or output from `sources` (Kind -> tensors, by
    index), the rest one after another from `buffers`."""
    buffers = iter(buffers)
    return [sources[s.kind][s.index] if s.kind in sources else next(buffers) for s in saved]


@dataclasses.dataclass(frozen=True)
class Variant:
    """Plain (`chunk` 0): the training forward writes the saved values of every step. Recompute: it writes only
    the states every `chunk` steps, and the backward re-runs each chunk's forward steps from them."""

    chunk: int = 0

    @property
    def recompute(self):
        return self.chunk > 0

    @property
    def suffix(self):
        return "_recompute" if self.recompute else ""


PLAIN = Variant()


@dataclasses.dataclass(frozen=True)
class Layout:
    """Names and order of everything one variant's kernels read and write."""

    neuron: str
    inputs: tuple
    states: tuple
    hyper: tuple
    learnable: tuple
    outputs: tuple
    next_states: tuple
    saved: tuple  # SavedValue, in the backward kernel's argument order
    grad_outputs: tuple
    carried: tuple  # the gradients carried backwards through time, one per state
    grad_inputs: tuple
    grad_prev_states: tuple
    grad_learnable: tuple
    variant: Variant = PLAIN
    step_saved: tuple = ()  # recompute: what the plain backward reads per step, which the re-run forward keeps
    # an input the kernels read through a per-channel delay line (`flexgen.kinds.delayed.delayed_layout`), or ""
    delayed: str = ""
    max_delay: int = 0  # the delay line's length, in steps
    tapped: bool = False  # the line weighs every step of it by per-channel taps instead of reading two
    held: bool = False  # the kernels also read the max_delay input steps before the call's first (`held_line`)

    @property
    def delay_parameter(self):
        """The learnable value that holds the delayed input's delays (one per channel, or one)."""
        return delay_parameter(self.delayed)

    @property
    def taps_parameter(self):
        """A tapped line's taps [channels, max_delay + 1], passed after the learnable values."""
        return f"{self.delayed}_taps"

    @property
    def sent_rows(self):
        """A tapped line's [T, N] rows where the backward keeps each step's gradient of the delayed value (it
        gathers the input's gradient from them), passed after the partial sums; then the taps' partial sums per
        neuron, [max_delay + 1, N] (`taps_partials`)."""
        return f"{self.delayed}_sent"

    @property
    def taps_partials(self):
        return f"partial_{self.taps_parameter}"

    @property
    def held_line(self):
        """A line continued from earlier calls: the delayed input's max_delay steps before this call's first,
        [max_delay, N] rows, oldest first (zeros before the sequence began), passed after the taps or delays; its
        gradient rows (`held_grad`) come after the partial sums."""
        return f"{self.delayed}_held"

    @property
    def held_grad(self):
        return f"grad_{self.held_line}"

    @property
    def buffers(self):
        """The saved values the training forward writes only for the backward, in the order it writes them."""
        return tuple(s for s in self.saved if s.written_for_backward)

    def saved_bytes_per_step(self, io_bytes, compute_bytes):
        """Bytes per neuron and step that keeping what the backward needs costs, besides reading the inputs,
        writing the outputs and the gradients once: saved values written and read back, saved inputs or
        outputs read again; with recompute, the inputs read again and the checkpoints written and read once
        a chunk."""
        if self.variant.recompute:
            return io_bytes * len(self.inputs) + 2 * compute_bytes * len(self.buffers) / self.variant.chunk
        return sum(_bytes_per_step(s, io_bytes) for s in self.saved)

    def kernel_name(self, kind):
        """"forward", "inference" or "backward": the generated function of that kind for this variant."""
        return f"{self.neuron}_{kind}" + ("" if kind == "inference" else self.variant.suffix)

    def to_json(self):
        record = dataclasses.asdict(self)
        for key in ("saved", "step_saved"):
            record[key] = [{"name": s.name, "kind": s.kind.value, "index": s.index, "binary": s.binary}
                           for s in getattr(self, key)]
        record["variant"] = {"chunk": self.variant.chunk}
        return record

    @classmethod
    def from_json(cls, record):
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
        for key in ("saved", "step_saved"):
            fields[key] = tuple(SavedValue(s["name"], Kind(s["kind"]), s["index"], s.get("binary", False))
                                for s in record[key])
        fields["variant"] = Variant(**record["variant"])
        return cls(**fields)


def _bytes_per_step(value, io_bytes):
    if value.kind is Kind.STATE:  # read once, not per step
        return 0
    if value.kind is Kind.BUFFER:
        return 2 if value.binary else 2 * io_bytes
    return io_bytes


def plain_layout(derivation):
    """The plain variant's layout of a derivation."""
    tr = derivation.trace
    inputs, outputs = tuple(tr.inputs), tuple(str(o) for o in tr.outputs)
    saved, first_values = [], []
    for s in map(str, derivation.saved):
        if s in inputs:
            saved.append(SavedValue(s, Kind.INPUT, inputs.index(s)))
        elif s in outputs:
            saved.append(SavedValue(s, Kind.OUTPUT, outputs.index(s)))
        else:
            saved.append(SavedValue(s, Kind.BUFFER, binary=s in derivation.binary))
            if s in derivation.binary and s in tr.states:
                first_values.append(SavedValue(s, Kind.STATE, tr.states.index(s)))
    saved += first_values
    return Layout(
        neuron=tr.name,
        inputs=inputs,
        states=tuple(tr.states),
        hyper=tuple(tr.hyper),
        learnable=tuple(tr.learnable),
        outputs=outputs,
        next_states=tuple(str(s) for s in tr.next_states),
        saved=tuple(saved),
        grad_outputs=tuple(map(str, derivation.grad_outputs)),
        carried=tuple(map(str, derivation.grad_states)),
        grad_inputs=tuple(map(str, derivation.grad_inputs)),
        grad_prev_states=tuple(map(str, derivation.grad_prev_states)),
        grad_learnable=tuple(map(str, derivation.grad_learnable)),
    )


def recompute_layout(plain):
    """The recompute variant of a plain layout.

    The training forward saves nothing per step: it checkpoints the states
    (in the compute dtype, so the re-run is exact) before every `chunk`-th
    step. The backward reads the inputs, the initial states and those
    checkpoints, re-runs each chunk's forward steps and walks them backwards.
    """
    saved = [SavedValue(x, Kind.INPUT, i) for i, x in enumerate(plain.inputs)]
    saved += [SavedValue(v, Kind.STATE, i) for i, v in enumerate(plain.states)]
    saved += [SavedValue(f"{v}_ckpt", Kind.CHECKPOINT, i) for i, v in enumerate(plain.states)]
    per_step = [s for s in plain.saved if s.kind is not Kind.STATE]
    chunk = max(1, RECOMPUTE_VALUES // max(1, len(per_step)))
    return dataclasses.replace(plain, saved=tuple(saved), step_saved=plain.saved, variant=Variant(chunk))


def delay_parameter(input):
    return f"{input}_delay"


def delay_gradient(input):
    return f"grad_{input}_delay"


# ---------------------------------------------------------------- the argument lists


class Access(enum.Enum):
    """How a kernel addresses one tensor: the parameters it takes for it, as suffixes of the tensor's stem."""

    STRIDED = ("_ptr", "_st", "_sn", "_bcast: tl.constexpr")  # [T, ...] by step and neuron stride; bcast: stride 0
    TAPS = ("_ptr", "_inner", "_size", "_sc", "_sk")  # a tapped line's taps [channels, K] by channel and tap stride
    STEP = ("_ptr", "_sn")  # one step (an initial state) by neuron stride
    CARRIED = ("_ptr", "_st", "_sn")  # incoming state gradients: per step (state sequences) or for the last one
    ROWS = ("_ptr",)  # contiguous rows of N neurons
    PARAMETER = ("_ptr", "_inner", "_size", "_chan: tl.constexpr")  # one value, or one per channel
    # A hyper-parameter: a number (Triton takes a Python float as fp32), or in fp64 runs a 0-d fp64 tensor the
    # kernel loads once, so fp64 runs compute with the hyper-parameters' fp64 values.
    SCALAR = ("",)
    MATRIX = ("_ptr", "_sr", "_sc")  # a recurrent weight [H, H] by row and column stride
    COLUMNS = ("_ptr", "_sc")  # one value per hidden neuron (a recurrent bias) by stride; stride 0: one for all


class Forward(enum.IntEnum):
    """Where the forward kernels' tensors come from: a launch fills these groups in this order."""

    INPUTS = 0
    STATES = 1
    LEARNABLE = 2
    OUTPUTS = 3
    FINALS = 4
    BUFFERS = 5
    HYPER = 6
    RECURRENT = 7  # recurrent kernels: the recurrent weight and bias


class Backward(enum.IntEnum):
    """Where the backward kernel's tensors come from."""

    SAVED = 0
    GRAD_OUTPUTS = 1
    GRAD_STATES = 2
    LEARNABLE = 3
    GRAD_INPUTS = 4
    GRAD_PREV = 5
    PARTIALS = 6
    HYPER = 7
    RECURRENT = 8  # recurrent kernels: the recurrent weight


@dataclasses.dataclass(frozen=True)
class Argument:
    """One tensor (or hyper-parameter) a kernel takes: its stem, how it is addressed, which caller value it is."""

    stem: str
    access: Access
    group: int
    index: int

    def parameters(self):
        return [self.stem + suffix for suffix in self.access.value]


def forward_arguments(layout, training):
    """The forward kernel's arguments (the inference kernel's without `training`), before n_steps, n_elem and
    the constexprs."""
    args = [Argument(x, Access.STRIDED, Forward.INPUTS, i) for i, x in enumerate(layout.inputs)]
    for i, v in enumerate(layout.states):
        args += [Argument(v, Access.STEP, Forward.STATES, i), Argument(f"{v}_seq", Access.ROWS, Forward.FINALS, i)]
    args += [Argument(o, Access.ROWS, Forward.OUTPUTS, i) for i, o in enumerate(layout.outputs)]
    if training:
        args += [Argument(b.stem, Access.ROWS, Forward.BUFFERS, i) for i, b in enumerate(layout.buffers)]
    args += [Argument(w, Access.PARAMETER, Forward.LEARNABLE, i) for i, w in enumerate(layout.learnable)]
    if layout.tapped:
        args.append(Argument(layout.taps_parameter, Access.TAPS, Forward.LEARNABLE, len(layout.learnable)))
    if layout.held:
        args.append(Argument(layout.held_line, Access.ROWS, Forward.LEARNABLE, len(layout.learnable) + layout.tapped))
    return args + [Argument(p, Access.SCALAR, Forward.HYPER, i) for i, p in enumerate(layout.hyper)]


_SAVED_ACCESS = {Kind.INPUT: Access.STRIDED, Kind.STATE: Access.STEP}


def backward_arguments(layout):
    """The backward kernel's arguments, before n_steps, n_elem and the constexprs."""
    args = [Argument(s.stem, _SAVED_ACCESS.get(s.kind, Access.ROWS), Backward.SAVED, i)
            for i, s in enumerate(layout.saved)]
    args += [Argument(g, Access.STRIDED, Backward.GRAD_OUTPUTS, i) for i, g in enumerate(layout.grad_outputs)]
    args += [Argument(g, Access.CARRIED, Backward.GRAD_STATES, i) for i, g in enumerate(layout.carried)]
    args += [Argument(g, Access.ROWS, Backward.GRAD_INPUTS, i) for i, g in enumerate(layout.grad_inputs)]
    args += [Argument(f"{g}_prev", Access.ROWS, Backward.GRAD_PREV, i) for i, g in enumerate(layout.carried)]
    args += [Argument(w, Access.PARAMETER, Backward.LEARNABLE, i) for i, w in enumerate(layout.learnable)]
    args += [Argument(f"partial_{w}", Access.ROWS, Backward.PARTIALS, i) for i, w in enumerate(layout.learnable)]
    n = len(layout.learnable)
    if layout.tapped:
        args += [Argument(layout.taps_parameter, Access.TAPS, Backward.LEARNABLE, n),
                 Argument(layout.sent_rows, Access.ROWS, Backward.PARTIALS, n),
                 Argument(layout.taps_partials, Access.ROWS, Backward.PARTIALS, n + 1)]
    if layout.held:
        args += [Argument(layout.held_line, Access.ROWS, Backward.LEARNABLE, n + layout.tapped),
                 Argument(layout.held_grad, Access.ROWS, Backward.PARTIALS, n + 2 * layout.tapped)]
    return args + [Argument(p, Access.SCALAR, Backward.HYPER, i) for i, p in enumerate(layout.hyper)]


def signature(arguments):
    """The parameter names a kernel declares for `arguments`, in order."""
    return [name for a in arguments for name in a.parameters()]

