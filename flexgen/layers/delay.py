"""Delays over time, fractional and learnable: per channel (`Delay`) and per synapse (`DelayedLinear`; in a
recurrent layer's feedback, `SynapseDelay`).

    Delay:          y_t[b, c, ...] = sum_k w_c[k] x_{t-k}[b, c, ...]
    DelayedLinear:  y_t[b, j] = sum_i W[j, i] sum_k w_ji[k] x_{t-k}[b, i] + bias[j]

(x_t = 0 for t < 0, k = 0 .. max_delay.) The taps w spread a delay d over the steps around it: "linear" puts
1 - frac(d) on floor(d) and frac(d) on the step after (an integer delay is an exact shift), "gaussian" puts a
Gaussian of width `sigma` centred on d, normalised over the taps (dilated convolutions with learnable spacings,
DCLS, train delays this way, annealing sigma towards zero). Either way the output is differentiable in d: the
linear taps give the one-sided derivative x_{t-floor(d)-1} - x_{t-floor(d)}, defined at integer delays too.

How the taps run: `Delay` with linear taps reads its input twice, floor(d) and floor(d) + 1 steps back; with gaussian
taps it is one depthwise convolution over time. `DelayedLinear`, where Triton runs, either reads each synapse's two
linear taps in fused kernels (`flexgen.launch.delay.fused`) or sums one tensor-core product per tap
(`flexgen.launch.delay.taps`); elsewhere it is one convolution with a dense kernel [out, in, max_delay + 1] of
weights times taps, as the `dcls` package builds it. The delays' checks, their clamp and the taps' math are in
`flexgen.layers.delay_taps`.
"""
import numbers
import os
import weakref

import torch

from ..launch.backends import Run
from ..launch.delay.conv import causal_conv
from .tracing import refuse_jit_trace
from .delay_taps import check_range, checked_sigma, clamped_delays, first_index, gaussian_taps, initial_delays, linear_taps

__all__ = ["Delay", "DelayedLinear", "SynapseDelay", "INTERPOLATIONS"]

INTERPOLATIONS = ("linear", "gaussian")


class _Delays(torch.nn.Module):
    """What `Delay` and `DelayedLinear` share: the delays (a parameter or a buffer, `shape`), their range and
    interpolation, and the taps made from them. Subclasses name a delay in messages (`_where`)."""

    def __init__(self, shape, max_delay, delay, learnable, interpolation, sigma, dtype):
        super().__init__()
        if isinstance(max_delay, bool) or not isinstance(max_delay, numbers.Integral) or max_delay < 0:
            raise ValueError(f"max_delay must be a whole number of steps >= 0, got {max_delay!r}")
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        self.max_delay, self.interpolation, self.sigma = int(max_delay), interpolation, sigma
        values = initial_delays(delay, shape, dtype, self._where)
        self._checked = _CheckedDelays()
        self.last_run = None  # the `flexgen.launch.backends.Run` the last call took
        if learnable:
            self.delay = torch.nn.Parameter(values)
        else:
            check_range(values, self.max_delay, self._where)
            self.register_buffer("delay", values)

    @property
    def learnable(self):
        """Whether the delays are a parameter (kept in the module's parameters, not its buffers: a
        `torch.func.functional_call` swaps in a plain tensor, which is still learnable)."""
        return "delay" in self._parameters

    def _options(self):
        items = [f"max_delay={self.max_delay}", f"interpolation={self.interpolation!r}"]
        if self.interpolation == "gaussian":
            items.append(f"sigma={self.sigma!r}")
        return items + ([] if self.learnable else ["learnable=False"])

    @torch.no_grad()
    def clamp_(self):
        """Put the delays back in [0, max_delay] (after an optimizer step, say); returns the layer."""
        self.delay.clamp_(0.0, float(self.max_delay))
        return self

    @torch.no_grad()
    def round_(self):
        """Round the delays to whole steps (within range): with linear taps the layer then shifts exactly."""
        self.delay.clamp_(0.0, float(self.max_delay)).round_()
        return self

    def line_delays(self):
        """The delays as a call uses them, checked: a NaN is an error naming its place, and so is a fixed delay
        outside [0, max_delay] (a learnable one is used at the nearest bound). The check reads the delays on the
        host, which waits for the GPU, so it runs only when the delays changed since the last one (another tensor,
        or an in-place update: an optimizer step, `clamp_()`, `load_state_dict`); writes through `.data` are not
        seen."""
        delay = self.delay
        if torch.compiler.is_compiling():  # a check on the host would break the graph: the device asserts
            torch._assert_async(~torch.isnan(delay).any(), "flexgen.Delay: a delay is NaN")
            if not self.learnable:
                inside = ((delay >= 0) & (delay <= self.max_delay)).all()
                torch._assert_async(inside, f"flexgen.Delay: a fixed delay is outside [0, {self.max_delay}]")
            return delay
        checked = self.__dict__.setdefault("_checked", _CheckedDelays())  # (layers pickled before it existed)
        if not checked.holds(delay):
            self._check(delay)
            checked.remember(delay)
        return delay

    def _check(self, delay):
        if torch.isnan(delay).any():
            raise ValueError(f"the delay of {self._where(first_index(torch.isnan(delay)))} is NaN")
        if not self.learnable:
            check_range(delay, self.max_delay, self._where)

    def taps(self):
        """The taps [*delay.shape, max_delay + 1]: tap k of a delay weighs the input k steps back."""
        clamped = self._clamped_delays()
        if self.interpolation == "linear":
            return linear_taps(clamped, self.max_delay)
        if self.interpolation == "gaussian":
            return gaussian_taps(clamped, self.max_delay, self.sigma)
        raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")

    def _clamped_delays(self):
        """The checked delays at the nearest bound of [0, max_delay], with the delays' own gradient."""
        return clamped_delays(self.line_delays(), self.max_delay)




class _CheckedDelays:
    """The delays a layer last checked: the tensor (weakly: a new one never matches a freed one), its storage and
    its version counter, which in-place updates advance. Copies and pickles start empty."""

    def __init__(self):
        self.tensor, self.storage, self.version = None, None, None

    def __reduce__(self):
        return (_CheckedDelays, ())

    def holds(self, delay):
        return (self.tensor is not None and self.tensor() is delay and self.storage == delay.data_ptr()
                and self.version == delay._version)

    def remember(self, delay):
        if type(delay) not in (torch.Tensor, torch.nn.Parameter) or torch._C._are_functorch_transforms_active():
            return
        try:
            self.tensor, self.storage, self.version = weakref.ref(delay), delay.data_ptr(), delay._version
        except RuntimeError:  # inference tensors keep no version: checked every call
            self.tensor = None


class Delay(_Delays):
    """Delays each of `channels` channels (dim 2 of [T, B, C, ...] inputs) by its own number of steps, at most
    `max_delay`; steps before the start read zeros, so delays past T give zeros.

    `delay`: the initial delays, one number for all channels or one per channel (default 0). With `learnable=True`
    (the default) they are a parameter, `layer.delay`, that may leave [0, max_delay] as it trains: the forward then
    uses the nearest bound (however far out: 1e9 and +-inf too, on every path) and passes the gradient on as if it
    were not clamped (so a delay can come back);
    `clamp_()` puts the values themselves back in range, `round_()` rounds them to whole steps (for inference
    after training with fractional delays). Fixed delays (`learnable=False`) outside [0, max_delay] are refused.
    `layer.last_run` says how the last call ran (`Run("torch", "two taps")` or `Run("torch", "convolution")`).
    `interpolation` is "linear" or "gaussian" (with `sigma`, in steps, > 0; set `layer.sigma` to anneal it).

    >>> import torch, flexgen
    >>> layer = flexgen.Delay(2, max_delay=3, delay=torch.tensor([0.0, 2.0]), learnable=False)
    >>> layer(torch.arange(1.0, 5.0).reshape(4, 1, 1).expand(4, 1, 2)).squeeze(1).T.tolist()
    [[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 2.0]]
    """

    def __init__(self, channels, max_delay, delay=0.0, learnable=True, interpolation="linear", sigma=1.0,
                 dtype=None):
        self.channels = _count("channels", channels)
        super().__init__((self.channels,), max_delay, delay, learnable, interpolation, sigma, dtype)

    @staticmethod
    def _where(index):
        return f"channel {index[0]}"

    def extra_repr(self):
        return ", ".join([f"channels={self.channels}"] + self._options())

    def check_input(self, x):
        """A clear error unless `x` is a floating [T, B, channels, ...] tensor."""
        _check_sequence(x, self.channels, "Delay", f"[T, B, {self.channels}, ...]", dim=2)

    def forward(self, x):
        refuse_jit_trace("Delay")
        self.check_input(x)
        path = "two taps" if self.interpolation == "linear" else "convolution"
        object.__setattr__(self, "last_run", Run("torch", path))  # (`layer.last_run`: what the last call took)
        if self.interpolation == "linear":
            return self._two_taps(x)
        taps = self.taps().to(x.dtype)
        steps, rest = x.shape[0], x.shape[1:]
        # [T, B, C, ...] -> [B * ..., C, T]: channels as the convolution's groups, time as its length
        series = x.movedim(0, -1).movedim(1, -2).reshape(-1, self.channels, steps)
        out = causal_conv(series, taps.unsqueeze(1), self.max_delay, groups=self.channels)
        moved = (rest[0], *rest[2:], rest[1], steps)
        return out.reshape(moved).movedim(-2, 1).movedim(-1, 0)

    def _two_taps(self, x):
        """Linear taps as two shifted reads of x, (1 - frac) x_{t - lag} + frac x_{t - lag - 1} per channel: two
        multiply-adds per value where the convolution does max_delay + 1."""
        clamped = self._clamped_delays()
        lag = clamped.detach().floor()
        frac = (clamped - lag).to(x.dtype)
        lag = lag.long()
        near = _steps_back(x, lag)
        far = _steps_back(x, lag + 1).masked_fill(_per_channel(lag >= self.max_delay, x), 0.0)  # past the line
        return near + _per_channel(frac, x) * (far - near)


def _per_channel(values, x):
    """[C] values shaped to broadcast against [T, B, C, ...] x."""
    return values.reshape((1, 1, -1) + (1,) * (x.dim() - 3))


def _steps_back(x, lag):
    """x_{t - lag[c]} for every step t and channel c of [T, B, C, ...] x, zeros before the first step."""
    steps = x.shape[0]
    source = torch.arange(steps, device=x.device)[:, None] - lag.to(x.device)[None, :]  # [T, C]
    as_x = (steps, 1, -1) + (1,) * (x.dim() - 3)
    taken = x.gather(0, source.clamp_min(0).reshape(as_x).expand(x.shape))
    return taken.masked_fill((source < 0).reshape(as_x).expand(x.shape), 0.0)


class DelayedLinear(_Delays):
    """`in_features` -> `out_features` synapses, each with a weight and a delay of its own:
    y_t[b, j] = sum_i weight[j, i] x_{t - delay[j, i]}[b, i] + bias[j], for [T, B, in_features] inputs.

    `weight` [out, in] and `bias` [out] start as `torch.nn.Linear`'s. `delay` [out, in] starts at the given
    number or tensor, or (None, the default) spread uniformly over [0, max_delay] as DCLS starts its positions.
    Delays, range rule, `clamp_()`, `round_()`, `interpolation` and `sigma` are as for `flexgen.Delay`.

    `backend` picks how a call runs where Triton does (CUDA inputs, or CPU inputs under TRITON_INTERPRET=1):
    "fused" reads each synapse's two linear taps in Triton kernels (exact in the inputs' precision); "taps" sums
    max_delay + 1 matrix products, one per tap, on the tensor cores (any interpolation; fp32 products use TF32
    where torch allows it for convolutions, `torch.backends.cudnn.allow_tf32`, else 3xTF32); "conv" is one
    convolution with the dense [out, in, max_delay + 1] kernel, as the `dcls` package builds it, and runs
    anywhere. "auto" (the default) takes "taps" for gaussian taps and for linear taps where it is the faster
    (fp32 weights, TF32 allowed, max_delay <= 48, enough time x batch rows: see docs/delays.md), "fused" for
    the other linear taps, and "conv" where Triton does not run. "fused" and "taps" are errors where Triton does
    not run ("fused" also with gaussian taps); `layer.last_run` says which one the last call ran (a `Run`: "triton"
    with "fused" or "taps", "torch" with "conv"). All give the same values and gradients up to the products'
    precision; only "conv" can be differentiated twice ("fused" and "taps" refuse a second backward with a clear
    error).

    >>> import torch, flexgen
    >>> layer = flexgen.DelayedLinear(2, 1, max_delay=2, delay=torch.tensor([[0.0, 2.0]]), bias=False)
    >>> with torch.no_grad():
    ...     _ = layer.weight.copy_(torch.tensor([[1.0, 10.0]]))
    >>> pulse = torch.zeros(4, 1, 2)
    >>> pulse[0] = 1.0                                   # both inputs fire at step 0
    >>> layer(pulse).flatten().tolist()                  # input 0 arrives at once, input 1 two steps later
    [1.0, 0.0, 10.0, 0.0]
    """

    def __init__(self, in_features, out_features, max_delay, bias=True, delay=None, learnable=True,
                 interpolation="linear", sigma=1.0, dtype=None, backend="auto"):
        self.in_features, self.out_features = _count("in_features", in_features), _count("out_features", out_features)
        if backend not in DELAYED_LINEAR_BACKENDS:
            raise ValueError(f"backend must be one of {DELAYED_LINEAR_BACKENDS}, got {backend!r}")
        self.backend = backend
        shape = (self.out_features, self.in_features)
        super().__init__(shape, max_delay, _spread(shape, max_delay, dtype) if delay is None else delay, learnable,
                         interpolation, sigma, dtype)
        reference = torch.nn.Linear(self.in_features, self.out_features, bias=bias, dtype=dtype)
        self.weight = reference.weight
        self.bias = reference.bias

    @staticmethod
    def _where(index):
        return f"synapse {index[1]} -> {index[0]} (delay[{index[0]}, {index[1]}])"

    def extra_repr(self):
        backend = [] if self.backend == "auto" else [f"backend={self.backend!r}"]
        return ", ".join([f"in_features={self.in_features}", f"out_features={self.out_features}",
                          f"bias={self.bias is not None}"] + self._options() + backend)

    def forward(self, x):
        refuse_jit_trace("DelayedLinear")
        _check_sequence(x, self.in_features, "DelayedLinear", f"[T, B, {self.in_features}]", dim=2, exact_dims=3)
        backend = self._call_backend(x)
        object.__setattr__(self, "last_run", Run("torch" if backend == "conv" else "triton", backend))
        if backend == "fused":
            from ..launch.delay.fused import delayed_linear

            return delayed_linear(x, self.weight, self.line_delays(), self.bias, self.max_delay)
        if backend == "taps":
            from ..launch.delay.taps import delay_taps

            gaussian = self.interpolation == "gaussian"
            sigma = checked_sigma(self.sigma) if gaussian else 1.0
            return delay_taps(x, self.weight, self.line_delays(), self.bias, self.max_delay, gaussian, sigma)
        kernel = self.weight.unsqueeze(-1) * self.taps()  # [out, in, max_delay + 1]
        series = x.permute(1, 2, 0).to(kernel.dtype)  # [B, in, T]
        out = causal_conv(series, kernel, self.max_delay, bias=self.bias)  # [B, out, T]
        # One pass into a [T, B, out] tensor of its own: a permuted view would make the next layer's product copy it
        # (and FSDP2 warns of a module that returns a view); the bias is added in the convolution.
        return torch.empty(out.shape[2], out.shape[0], out.shape[1], dtype=x.dtype,
                           device=x.device).copy_(out.permute(2, 0, 1))

    def _call_backend(self, x):
        """The backend this call runs: `backend`, or for "auto" the fastest that runs here (see the class)."""
        if self.backend == "conv":
            return "conv"
        if not _triton_runs_on(x.device):
            if self.backend != "auto":
                raise ValueError(f"DelayedLinear(backend={self.backend!r}) needs CUDA inputs, or CPU inputs under "
                                 f"TRITON_INTERPRET=1 (got {x.device.type}); backend='auto' falls back to the "
                                 "convolution")
            return "conv"
        if self.backend == "fused" and self.interpolation != "linear":
            raise ValueError(f"DelayedLinear(backend='fused') needs interpolation='linear' (got "
                             f"{self.interpolation!r}); backend='taps' runs gaussian taps")
        if self.backend != "auto":
            return self.backend
        if self.interpolation != "linear":
            return "taps"
        return "taps" if _taps_are_faster(x, self.weight, self.max_delay) else "fused"


class SynapseDelay(_Delays):
    """A delay for each synapse of a recurrent layer's feedback, `Recurrent(..., delay=flexgen.SynapseDelay(hidden,
    max_delay))`: the output of neuron i reaches neuron j `delay[j, i]` steps after the step before (synapse
    i -> j), I_t[j] = x_t[j] + sum_i W[j, i] s_{t - 1 - delay[j, i]}[i].

    `delay` [hidden, hidden] starts at the given number or tensor, or (None, the default) spread uniformly over
    [0, max_delay] as `DelayedLinear`'s do. Delays, range rule, `clamp_()`, `round_()`, `interpolation` and `sigma`
    are as for `flexgen.Delay`. Calling the module on a weight [hidden, hidden] gives its tap matrices
    (`tap_matrices`), what the layer's products read.

    >>> import torch, flexgen
    >>> delay = flexgen.SynapseDelay(2, max_delay=2, delay=torch.tensor([[0.0, 2.0], [1.0, 0.0]]), learnable=False)
    >>> delay(torch.ones(2, 2)).tolist()           # [M_0 | M_1 | M_2]: synapse i -> j in tap delay[j, i]
    [[1.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]]
    """

    def __init__(self, hidden, max_delay, delay=None, learnable=True, interpolation="linear", sigma=1.0, dtype=None):
        self.hidden = _count("hidden", hidden)
        shape = (self.hidden, self.hidden)
        super().__init__(shape, max_delay, _spread(shape, max_delay, dtype) if delay is None else delay, learnable,
                         interpolation, sigma, dtype)

    @staticmethod
    def _where(index):
        return f"synapse {index[1]} -> {index[0]} (delay[{index[0]}, {index[1]}])"

    def extra_repr(self):
        return ", ".join([f"hidden={self.hidden}"] + self._options())

    def forward(self, weight):
        return self.tap_matrices(weight)

    def tap_matrices(self, weight):
        """The recurrent weight [hidden, hidden] through the delays: max_delay + 1 matrices side by side,
        [hidden, (max_delay + 1) hidden], where M_k = weight times each synapse's tap k (see `taps`) weighs the
        outputs k + 1 steps back; differentiable in the weight and the delays."""
        if weight.shape != (self.hidden, self.hidden):
            raise ValueError(f"SynapseDelay({self.hidden}) delays a weight [{self.hidden}, {self.hidden}], got "
                             f"{list(weight.shape)}")
        taps = self.taps()
        matrices = weight.unsqueeze(-1) * taps.to(torch.promote_types(taps.dtype, weight.dtype))  # [j, i, k]
        return matrices.permute(0, 2, 1).reshape(self.hidden, (self.max_delay + 1) * self.hidden)


DELAYED_LINEAR_BACKENDS = ("auto", "fused", "taps", "conv")
# Where "auto" runs linear taps as K + 1 TF32 products rather than two taps per synapse, by the inputs' dtype:
# (the largest max_delay, the fewest rows T x B). Short delays, and enough rows to fill the GPU; 16-bit inputs,
# which the two-tap kernels read at half the bytes, need shorter delays and more rows. From 700 -> 256 synapses
# on an H100 (docs/perf/h100/delay_taps_rule.log).
TAPS_RULE = {torch.float32: (48, 4096), torch.float16: (30, 12800), torch.bfloat16: (30, 12800)}


def _taps_are_faster(x, weight, max_delay):
    from ..launch.delay.taps import taps_precision

    if x.dtype not in TAPS_RULE or weight.dtype != torch.float32 or taps_precision(weight.dtype) != "tf32":
        return False
    longest, fewest_rows = TAPS_RULE[x.dtype]
    return max_delay <= longest and x.shape[0] * x.shape[1] >= fewest_rows


def _triton_runs_on(device):
    """CUDA tensors, or CPU tensors when Triton's interpreter is on."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fed_from_sent(current, sent, kernel, groups):
    """What the outputs sent before a call ([S, B, H], oldest first) feed through delay lines into the call's first
    steps: [min(T, reach), B, H] in the dtype of its input `current` [T, B, H], summed in the wider of that and the
    lines' `kernel`'s ([H, H / groups, reach], a convolution's: step t reads sent step t - 1 - k with tap k)."""
    reach = kernel.shape[-1]
    sent = sent[-reach:].to(current.dtype).expand(-1, *current.shape[1:])
    # before the call: the last `reach` steps (zeros where fewer were sent), then zeros for the call's own steps
    padding = current.new_zeros((2 * reach - sent.shape[0], *current.shape[1:]))
    series = torch.cat([padding[:reach - sent.shape[0]], sent, padding[reach - sent.shape[0]:]])
    wide = torch.promote_types(kernel.dtype, current.dtype)
    grouped = series.permute(1, 2, 0).to(wide)  # [B, H, 2 * reach]
    # fed[t] = sum_k kernel[..., k] series[t - k]; the call's steps 0 .. n - 1 read the sent ones
    fed = causal_conv(grouped, kernel.to(wide), reach - 1, groups=groups)
    n = min(current.shape[0], reach)
    return fed[..., reach - 1:reach - 1 + n].permute(2, 0, 1).to(current.dtype)


def _check_sequence(x, size, owner, expected, dim, exact_dims=None):
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or x.shape[dim] != size or (exact_dims and x.dim() != exact_dims):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{owner} takes inputs {expected}, got {shape}")
    if not x.is_floating_point():
        raise TypeError(f"{owner} takes floating-point inputs, got {x.dtype}")


def _count(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return int(value)


def _spread(shape, max_delay, dtype):
    """Default per-synapse delays: uniform over [0, max_delay], as DCLS starts its positions (0 where max_delay is
    not a number: `_Delays` then says what is wrong with it)."""
    return torch.rand(shape, dtype=dtype) * max_delay if isinstance(max_delay, numbers.Real) else 0.0


def checked_feedback_delay(delay, hidden):
    """`delay` as a Recurrent option: None, a `flexgen.Delay` of `hidden` channels or a `flexgen.SynapseDelay` of
    `hidden` neurons."""
    if delay is None:
        return None
    if isinstance(delay, SynapseDelay):
        if delay.hidden != hidden:
            raise ValueError(f"delay is a SynapseDelay of {delay.hidden} neurons; a recurrent layer of {hidden} "
                             f"neurons needs flexgen.SynapseDelay({hidden}, max_delay=...)")
        return delay
    if not isinstance(delay, Delay):
        raise TypeError(f"delay must be a flexgen.Delay(hidden, max_delay, ...) (per-neuron delays of the fed-back "
                        f"output) or a flexgen.SynapseDelay(hidden, max_delay, ...) (one per synapse), got "
                        f"{type(delay).__name__}")
    if delay.channels != hidden:
        raise ValueError(f"delay has {delay.channels} channels; a recurrent layer of {hidden} neurons needs one per "
                         f"neuron: flexgen.Delay({hidden}, max_delay=...)")
    return delay
