"""A stream's step as one kernel that stays on the GPU (`flexgen.Stream(..., mode="persistent")`): no launch and
no wait on a CUDA event per step, the host and the kernel talk through two words in pinned host memory.

The model is one `fused_plan` accepts (Linear/Recurrent pairs). The kernel (`templates/stream_persistent.py.j2`)
calls each layer's `step` tile function (the fused plan's kernels are launches of the same functions) for its
tiles, the layers in turn; its programs count their arrivals between layers instead of ending a launch, so all of
them must be resident at once: one per tile up to one per multiprocessor. A step: the host writes the step's
input into a pinned buffer and a new step word; program 0, polling that word, passes it to the others; they copy
the input to the device and take the layers' tiles (the last layer's write their output to a pinned buffer too),
and program 0 answers with the step's word, which the host polls. The states stay in device buffers, written in place.

After `idle_timeout` seconds without a step the kernel leaves (so that `torch.cuda.synchronize()` and the
device's other work are never held up for longer), and the next step launches it again (a few hundred us
once). `close()` ends it at once.
"""
import time

import torch

from ..cache import load_or_build, make_key
from ..frames import frame, template_sources
from ..launch.config import HALF_DTYPES
from ..launch.recurrent.step import step_arguments
from ..launch.recurrent.tiling import dot_precision
from ..launch.triton_path import cuda_index, on_device_of, sm_count
from ..render.layout import Forward, signature
from .fused_plan import FusedPlan
from .held import StreamError

COPY_BLOCK = 256  # elements a program copies at a time (the step's input)
NO_ANSWER_SECONDS = 10.0  # a step the kernel has not answered by then is an error, not a wait forever
STOP, IDLE = -1, -2  # step words that end the kernel: the host's stop, the kernel's own after idle_timeout
WORDS = 1 << 30  # step words wrap below this


def _row_offsets(unit, k):
    """{parameter: the expression of its address} for the parameters of unit `k`'s step whose row alternates:
    its outputs (row ps_row), the fed-back output (the other row) and, after the first layer, its input (the
    layer before's row ps_row)."""
    n_elem = f"ps_n_batch * l{k}_n_hidden"
    offsets = {}
    for a in unit.compiled.arguments["step"]:
        first = f"l{k}_{a.parameters()[0]}"
        if a.group == Forward.OUTPUTS:
            offsets[a.parameters()[0]] = f"{first} + ps_row * {n_elem}"
        elif a.stem == "rec_previous":
            offsets[a.parameters()[0]] = f"{first} + (1 - ps_row) * {n_elem}"
        elif k > 0 and a.stem == "in_x" and unit.n_in is not None:
            offsets[a.parameters()[0]] = f"{first} + ps_row * ps_n_batch * l{k}_n_in"
        elif k > 0 and a.group == Forward.INPUTS and unit.n_in is None:
            offsets[a.parameters()[0]] = f"{first} + ps_row * {n_elem}"
    return offsets


def _layer_context(unit, k):
    params = signature(unit.compiled.arguments["step"])
    names = [p.replace(": tl.constexpr", "") for p in params]
    offsets = _row_offsets(unit, k)
    return {"index": k, "tile": f"layer{k}_tile", "params": [f"l{k}_{p}" for p in params],
            "call": [offsets.get(n, f"l{k}_{n}") for n in names], "origin": _tile_name(unit)}


def _tile_name(unit):
    return unit.compiled.layout.kernel_name("step") + "_tile"


KERNEL = "stream_persistent"


def kernel_source(units):
    """The persistent kernel's module source for the fused plan's `units`."""
    return frame("stream_persistent.py.j2").render(kernel=KERNEL,
                                                   layers=[_layer_context(u, k) for k, u in enumerate(units)])


def kernel_for(units):
    """The persistent kernel for `units`, from the cache (its key: the frames and the layers' own modules), with
    each layer's tile function bound as `layer<k>_tile`."""
    tiles = [getattr(u.compiled.module, _tile_name(u)) for u in units]
    frames = template_sources()
    key = make_key("stream_persistent", frames["stream_persistent.py.j2"], frames["static/host_flags.py"],
                   *(u.compiled.key for u in units))
    module, _ = load_or_build(key, lambda: (kernel_source(units), {"kind": "stream_persistent",
                                                                   "layers": [u.compiled.key for u in units]}))
    for k, tile in enumerate(tiles):
        setattr(module, f"layer{k}_tile", tile)
    return module, getattr(module, KERNEL)


def _pinned(shape, dtype, device):
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


class PersistentPlan(FusedPlan):
    """The fused plan's step in a kernel that stays resident on `example`'s GPU. `input` (pinned host memory,
    shaped as `example`) is what the next step reads; a step returns `output`, pinned host memory the next step
    overwrites. `idle_timeout`: seconds without a step before the kernel leaves (the next step launches it
    again). `one_step` launches the kernel for each step with one program that takes it and leaves (Triton's
    interpreter, for the tests)."""

    def __init__(self, model, names, example, idle_timeout=1.0, one_step=False, tiling=None):
        super().__init__(model, names, example, capture=False, tiling=tiling)
        if not idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds, got {idle_timeout!r}")
        device, dtype = example.device, example.dtype
        self.device, self.one_step, self.idle_ns = device, bool(one_step), int(idle_timeout * 1e9)
        last = self.units[-1]
        self.input = _pinned(example.shape, dtype, device)
        self.output = _pinned((example.shape[0], last.layer.hidden), dtype, device)
        self._go = _pinned(1, torch.int32, device)
        self._done = _pinned(1, torch.int32, device)
        self._go_word, self._done_word = self._go.numpy(), self._done.numpy()  # the host's views, made once
        self._counts = torch.zeros(len(self.units) + 1, dtype=torch.int64, device=device)
        self._gate = torch.zeros(1, dtype=torch.int32, device=device)
        self._word, self._running, self._side, self._stuck = 0, False, None, None
        module, self._kernel = kernel_for(self.units)
        self.source = module.__flexgen_source__  # the kernel's generated source, as it was loaded
        self._args, self._constexprs = self._arguments(dtype, device)
        batch = example.shape[0]
        tiles = max(u.launches[0].tiling.tiles(batch, u.layer.hidden) * u.launches[0].tiling.k_split
                    for u in self.units)
        self.programs = 1 if self.one_step else max(1, min(tiles, sm_count(cuda_index(device))))
        self.warps = max(u.launches[0].tiling.warps for u in self.units)

    def _arguments(self, dtype, device):
        args, constexprs = [], {}
        for k, unit in enumerate(self.units):
            launch = unit.launches[0]  # its tiling, partial sums and tickets; the rows are the persistent kernel's
            hidden = unit.layer.hidden
            source = self.x if k == 0 else self.units[k - 1].rows[0]  # row 0: the kernel adds the row's offset
            args += step_arguments(unit.compiled, list(unit.states.values()), [unit.rows[0]], unit.rows[0],
                                   unit._learnable, list(unit.layer.cell.hyper.values()), unit.weight, unit.bias,
                                   inputs=None if unit.n_in is not None else [source],
                                   in_x=None if unit.n_in is None else source, in_weight=unit.in_weight,
                                   in_bias=unit.in_bias)
            args += [launch.partial, launch.counts, hidden, unit.n_in or 0]
            tiling = launch.tiling
            constexprs.update({f"L{k}_IN_WEIGHT": unit.in_weight is not None, f"L{k}_IN_BIAS": unit.in_bias is not None,
                               f"L{k}_BLOCK_B": tiling.block_b, f"L{k}_BLOCK": tiling.block,
                               f"L{k}_BLOCK_K": tiling.block_k, f"L{k}_K_SPLIT": tiling.k_split,
                               f"L{k}_CORES": tiling.cores})
        constexprs.update(F64=dtype == torch.float64, HALF_IO=dtype in HALF_DTYPES, DOT_PRECISION=dot_precision(dtype),
                          PS_BLOCK=COPY_BLOCK, ONE_STEP=self.one_step)
        return args, constexprs

    def _launch(self, start):
        """The kernel, waiting for the step word after `start` (one_step: taking step `start`)."""
        self._counts.zero_()
        self._gate.fill_(start)
        tail = [self.input, self.x, self.output, self._counts, self._gate, self._go, self._done, self.x.shape[0],
                self.x.numel(), start, self.idle_ns]
        with on_device_of(self.device):
            self._kernel[(self.programs,)](*self._args, *tail, **self._constexprs, num_warps=self.warps)

    def __call__(self, x=None):
        """One step on `x` (a CPU tensor shaped as the example), or (None) on what `self.input` holds."""
        if self._stuck is not None:
            raise StreamError(self._stuck)
        if x is not None:
            self.input.copy_(x)
        row = self.done % 2
        self._word = (self._word // 2 + 1) % (WORDS // 2) * 2 + row  # a new word of the step's row's parity
        if self.one_step:
            self._launch(self._word)
        else:
            self._answer()
        self.done += 1
        return self.output

    def _answer(self):
        """Write the step word and wait for the kernel's answer (launching it first where it is not running)."""
        word, done = self._word, self._done_word
        if not self._running:
            self._start_before(word)
        self._go_word[0] = word
        since = time.perf_counter()
        while done[0] != word:
            if done[0] == IDLE:  # it left just before the word came: again, for this word
                self._side.synchronize()
                self._start_before(word)
                self._go_word[0] = word
                since = time.perf_counter()
            elif time.perf_counter() - since > NO_ANSWER_SECONDS:  # never waited for again: it may never end
                self._go_word[0] = STOP
                self._running = False
                self._stuck = (f"the persistent kernel has not answered step word {word} in {NO_ANSWER_SECONDS:.0f} "
                               f"s: all of its {self.programs} programs must be resident at once (is other work "
                               "holding the GPU's multiprocessors?); this stream takes no more steps, make a new one "
                               "or use mode='graph'")
                raise StreamError(self._stuck)

    def _start_before(self, word):
        """Launch the kernel so that `word` is the next step it takes."""
        previous = self._previous_word(word)
        self._go_word[0] = previous
        self._done_word[0] = previous
        self._side = self._side or torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            self._launch(previous)
        self._running = True

    @staticmethod
    def _previous_word(word):
        return word - 2 if word >= 2 else word + 2  # any word but `word` itself

    def stop(self):
        """End the kernel (the next step launches it again) and wait for it."""
        if getattr(self, "_running", False) and not self.one_step:
            self._go_word[0] = STOP
            self._side.synchronize()
        self._running = False

    def reset(self):
        self.stop()
        super().reset()
        if hasattr(self, "output"):
            self.output.zero_()
