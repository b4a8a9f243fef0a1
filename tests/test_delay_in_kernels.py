"""delay= on neuron layers: the delay line inside the generated Triton kernels' time loop equals the `Delay` layer
run before the neuron (float64: spikes equal, gradients of the input, the delays and the neuron's parameters at
1e-12 elementwise)."""
import copy
import pickle

import pytest
import torch

import flexgen
from conftest import (HAS_C_COMPILER, HAS_CUDA, INTERPRETER, assert_budget_run_equals_the_default,
                      assert_func_grads_fused_equal_eager, assert_recurrent_same, max_rel_err, recurrent_grads)
from flexgen.render.contexts import TAP_CHUNK

# Where the fused kernels run: Triton's interpreter ("cpu"), the C target ("cpu-c"), a GPU ("cuda").
FUSED = (["cpu"] if INTERPRETER else []) + (["cpu-c"] if HAS_C_COMPILER else []) + [
    pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(where):
    return "cpu" if where.startswith("cpu") else where


def _fused_backend(where):
    return "c" if where == "cpu-c" else "triton"


# The lines the kernels read: two taps (linear), or every step weighed by its channel's tap (gaussian).
TAPS = {"linear": {}, "gaussian": {"interpolation": "gaussian", "sigma": 0.8}}


def _line(taps, where):
    """One (device, taps) case; a device given as a pytest.param (the GPU) keeps its marks."""
    device = where.values[0] if hasattr(where, "values") else where
    return pytest.param(device, taps, id=f"{taps}-{device}", marks=getattr(where, "marks", ()))


LINES = [_line(taps, where) for taps in TAPS for where in FUSED]
MAX_DELAY = 4


@flexgen.neuron(states=("v", "i"))
def two_input_synapse(x, bias, v, i, alpha=0.7, beta=0.8, v_th=0.4):
    """A two-state neuron with a second input: only the first goes through the delay line."""
    i_new = alpha * i + x + 0.5 * bias
    h = beta * v + i_new
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s), i_new


def delays(dtype, device, channels=6):
    """Fractional, whole, 0, max_delay and, learnable, outside [0, max_delay] on both sides."""
    values = [0.0, 1.3, 2.0, MAX_DELAY, -0.7, MAX_DELAY + 2.5, 3.75, 0.5]
    return torch.tensor(values[:channels], dtype=dtype, device=device)


def layer_pair(make, device, dtype=torch.float64, channels=6, learnable=True, initial=None, **delay_options):
    """The same layer twice: the fused kernels (backend "triton") and the reference (backend "torch": the Delay
    layer, then the neuron's generated torch code), with equal starting delays."""
    initial = delays(dtype, _device(device), channels) if initial is None else initial
    pair = []
    for backend in (_fused_backend(device), "torch"):
        delay = flexgen.Delay(channels, MAX_DELAY, delay=initial.clone(), learnable=learnable, dtype=dtype,
                              **delay_options).to(_device(device))
        pair.append(make(backend, delay).to(_device(device)))
    return pair


def grads_of(layer, inputs, weights):
    """The layer's outputs and the gradients of a weighted sum of its outputs and final states with respect to its
    inputs and every parameter (the delays among them)."""
    out = layer(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    loss = sum((o * w).sum() for o, w in zip(out, weights))
    loss = loss + sum((v ** 2).sum() for v in layer._states.values())
    wrt = [x for x in inputs if x.requires_grad] + [p for _, p in sorted(layer.named_parameters())]
    return out, torch.autograd.grad(loss, wrt)


def runs_the_delay_layer(output):
    """Whether autograd's graph of a layer's output goes through the `Delay` layer's own operations (its
    depthwise convolution or its gathers) rather than the kernels' delay line alone."""
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__.startswith(("Convolution", "Gather")):
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False


def assert_same(fused, reference, inputs, tolerance=1e-12, in_kernels=True):
    """The two layers' outputs are equal and their gradients within `tolerance`; with `in_kernels` the first one's
    delay line is the kernels' (no `Delay` layer operation in its graph) and the reference's is not."""
    weights = [torch.rand_like(x) for x in inputs[:1]]
    if in_kernels:  # from empty lines: a call that continues one runs the Delay layer
        fused.reset()
        reference.reset()
        assert not runs_the_delay_layer(fused(*inputs))
        assert runs_the_delay_layer(reference(*inputs))
        fused.reset()
        reference.reset()
    out_f, grads_f = grads_of(fused, inputs, weights)
    out_r, grads_r = grads_of(reference, inputs, weights)
    for a, b in zip(out_f, out_r):
        assert torch.equal(a, b)
    for name, a, b in zip(_names(fused, inputs), grads_f, grads_r):
        assert max_rel_err(a, b) <= tolerance, name


def _names(layer, inputs):
    inputs = [f"input {k}" for k, x in enumerate(inputs) if x.requires_grad]
    return inputs + sorted(n for n, _ in layer.named_parameters())


def spiking_input(shape, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 0.8).to(_device(device)).requires_grad_()


@pytest.mark.parametrize("device,taps", LINES)
@pytest.mark.parametrize("neuron", ["IF", "LIF", "PLIF"])
def test_bundled_neurons_with_a_delay_line_match_the_delay_layer(device, taps, neuron):
    def make(backend, delay):
        options = dict(per_channel=6, dtype=torch.float64) if neuron == "PLIF" else {}
        return getattr(flexgen, neuron)(v_threshold=0.5, step_mode="m", backend=backend, delay=delay, **options)

    fused, reference = layer_pair(make, device, **TAPS[taps])
    assert_same(fused, reference, [spiking_input((11, 3, 6), device)])


@flexgen.neuron(states=("v",))
def input_gated(x, v, beta=0.8, v_th=0.5):
    """Its input scales the leak, so the backward reads the delayed input again at every step."""
    h = beta * v * (1.0 - 0.3 * x) + x
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s)


@pytest.mark.parametrize("device,taps", LINES)
def test_a_backward_that_reads_the_delayed_input_again_over_several_chunks(device, taps):
    """Two whole chunks of the kernels' sums over steps and a partial one, read from the last step back."""
    fused, reference = layer_pair(lambda backend, delay: input_gated(step_mode="m", backend=backend, delay=delay),
                                  device, **TAPS[taps])
    if taps == "gaussian":
        backward = input_gated.source("backward", max_delay=MAX_DELAY, interpolation="gaussian")
        assert "x_chunk += x_tap*x_value" in backward
    assert_same(fused, reference, [spiking_input((2 * TAP_CHUNK + 9, 2, 6), device, seed=3)])


@pytest.mark.parametrize("device,taps", LINES)
def test_inner_dims_an_expanded_input_and_fixed_delays(device, taps):
    def make(backend, delay):
        return flexgen.LIF(tau=3.0, v_threshold=0.4, step_mode="m", backend=backend, delay=delay)

    channels = 4
    fixed = torch.tensor([0.0, 2.0, 1.5, MAX_DELAY], dtype=torch.float64, device=_device(device))
    fused, reference = layer_pair(make, device, channels=channels, learnable=False, initial=fixed, **TAPS[taps])
    assert_same(fused, reference, [spiking_input((9, 2, channels, 3), device)])
    base = spiking_input((9, 1, channels, 1), device, seed=1)
    expanded = base.expand(9, 2, channels, 3)  # stride 0 over batch and the inner dim
    assert_same(fused, reference, [expanded])
    fused, reference = layer_pair(make, device, channels=channels, initial=fixed, **TAPS[taps])  # learnable
    assert_same(fused, reference, [spiking_input((9, 2, channels, 3), device, seed=2)])


@pytest.mark.parametrize("device,taps", LINES)
def test_a_two_state_neuron_delays_its_first_input_only(device, taps):
    def make(backend, delay):
        return two_input_synapse(backend=backend, delay=delay, store_state_seqs=True)

    fused, reference = layer_pair(make, device, channels=5, **TAPS[taps])
    x = spiking_input((8, 2, 5), device)
    bias = spiking_input((8, 2, 5), device, seed=3)
    assert_same(fused, reference, [x, bias])
    for name in ("v", "i"):  # the two designs may round the delayed current differently in the last place
        assert max_rel_err(fused.state_seqs[name], reference.state_seqs[name]) <= 1e-12


@pytest.mark.parametrize("device,taps", LINES)
def test_random_shapes_lines_and_widths(device, taps):
    """Twelve random layers: T from 1 to two chunks and a part (the kernels sum a gaussian line TAP_CHUNK steps at
    a time), one channel or several, inner dims or none, max_delay from 0, fractional
    delays inside and outside the range, gaussian widths from narrow to wide; each equals the Delay layer followed by
    the neuron in float64."""
    rng = torch.Generator().manual_seed(7)

    def draw(low, high):
        return int(torch.randint(low, high + 1, (), generator=rng))

    for _ in range(12):
        steps, batch, channels = draw(1, 2 * TAP_CHUNK + 9), draw(1, 3), draw(1, 5)
        inner, max_delay = draw(1, 2), draw(0, 6)
        initial = (torch.rand(channels, generator=rng, dtype=torch.float64) * (max_delay + 2) - 1).to(_device(device))
        options = dict(TAPS[taps], sigma=float(torch.rand((), generator=rng)) * 3 + 0.2) if taps == "gaussian" else {}
        pair = []
        for backend in (_fused_backend(device), "torch"):
            delay = flexgen.Delay(channels, max_delay, delay=initial.clone(), dtype=torch.float64, **options)
            pair.append(flexgen.LIF(v_threshold=0.3, step_mode="m", backend=backend, delay=delay).to(_device(device)))
        shape = (steps, batch, channels) + ((inner,) if inner > 1 else ())
        x = (torch.rand(shape, generator=rng, dtype=torch.float64) * 0.8).to(_device(device)).requires_grad_()
        assert_same(*pair, [x])


@pytest.mark.parametrize("device,taps", LINES)
def test_max_delay_beyond_the_sequence_reads_zeros(device, taps):
    def make(backend, delay):
        return flexgen.LIF(v_threshold=0.2, step_mode="m", backend=backend, delay=delay)

    late = torch.full((3,), float(MAX_DELAY), dtype=torch.float64, device=_device(device))
    narrow = {**TAPS[taps], "sigma": 0.3} if taps == "gaussian" else {}  # taps within the sequence weigh <= 0.004
    fused, reference = layer_pair(make, device, channels=3, initial=late, **narrow)
    x = spiking_input((MAX_DELAY, 2, 3), device)  # T = max_delay: every step reads before the start
    assert_same(fused, reference, [x])
    fused.reset()  # else the line holds this x, which the next call reads
    assert not fused(x).any()


@pytest.mark.parametrize("device", FUSED)
def test_given_states_and_inference_without_grad(device):
    def make(backend, delay):
        return flexgen.LIF(v_threshold=0.5, step_mode="m", backend=backend, delay=delay)

    fused, reference = layer_pair(make, device)
    x = spiking_input((7, 2, 6), device).detach()
    with torch.no_grad():
        assert torch.equal(fused(x), reference(x))  # the second call starts from the kept states
        assert torch.equal(fused(x), reference(x))
        assert max_rel_err(fused.v, reference.v) <= 1e-12  # rounded differently in the last place on a GPU


@pytest.mark.parametrize("device,taps", LINES)
def test_fp32_fused_delays_match_the_delay_layer(device, taps):
    def make(backend, delay):
        return flexgen.LIF(v_threshold=0.5, step_mode="m", backend=backend, delay=delay)

    fused, reference = layer_pair(make, device, dtype=torch.float32, **TAPS[taps])
    x = spiking_input((10, 4, 6), device).detach().float().requires_grad_()
    assert_same(fused, reference, [x], tolerance=1e-5)


@pytest.mark.parametrize("taps", TAPS)
def test_the_eager_backend_runs_the_delay_layer_first(taps):
    x = spiking_input((8, 2, 6), "cpu")
    pair = layer_pair(lambda b, d: flexgen.LIF(v_threshold=0.5, step_mode="m", backend="eager" if b != "torch" else b,
                                               delay=d), "cpu", **TAPS[taps])
    assert_same(*pair, [x], in_kernels=False)
    pair[0].reset()
    assert runs_the_delay_layer(pair[0](x))


def test_the_generated_kernels_show_the_delay_line():
    from flexgen.neurons.integrate_fire import lif_step

    assert "x_carried = tl.load(x_ptr + x_src * x_st" in lif_step.source("forward", max_delay=7)
    assert "x_far_on_line = x_lag < 7" in lif_step.source("inference", max_delay=7)
    assert "acc_x_delay += grad_x_delay" in lif_step.source("backward", max_delay=7)
    assert lif_step.source("module", max_delay=7).startswith("# Generated by flexgen")
    assert "x_lag_buf[offs - pid] = (int64_t)x_clamped;" in lif_step.source("c", max_delay=7)
    with pytest.raises(ValueError, match="kind must be one of"):
        lif_step.source("torch_forward", max_delay=7)  # the torch path runs the Delay layer before its own code
    forward = lif_step.source("forward", max_delay=7, interpolation="gaussian")
    assert "for x_tap_index in range(8):" in forward and "x_chunk += x_tap*x_value" in forward
    assert f"x = tl.sum(tl.where(tl.arange(0, {TAP_CHUNK})[:, None] == x_slot, x_chunk, 0.0), axis=0)" in forward
    backward = lif_step.source("backward", max_delay=7, interpolation="gaussian")
    assert "tl.store(x_sent_ptr + row * n_elem + offs, grad_x, mask=mask)" in backward
    assert "x_gathered += x_later*x_tap" in backward and "x_tap_products = x_sent_value*x_value" in backward
    assert "x_chunk += x_tap*x_value" not in backward  # LIF's backward step does not read its input again
    held = lif_step.source("forward", max_delay=7, continued=True)
    assert "x_carried += tl.load(x_held_ptr + (x_src + 7) * n_elem + offs" in held
    assert "x_held_ptr" not in lif_step.source("forward", max_delay=7)
    held_backward = lif_step.source("backward", max_delay=7, continued=True)
    assert "tl.store(grad_x_held_ptr + (x_dst + 7) * n_elem + offs, x_spread, mask=mask & (x_dst < 0))" in held_backward
    assert "x_spread = x_frac*x_later" in held_backward  # the held step only the first step reads (far)
    c = lif_step.source("c", max_delay=7, interpolation="gaussian", continued=True)
    assert "x_held_ptr + (step - x_tap_index + 7) * n_elem" in c and "grad_x_held_ptr[x_line * n_elem + offs]" in c
    assert "every step of it weighed by the channel's taps" in lif_step.source("module", max_delay=7,
                                                                               interpolation="gaussian")
    c = lif_step.source("c", max_delay=7, interpolation="gaussian")
    assert "x += x_tap*x_value;" in c and "x_gathered += x_later*x_tap;" in c
    assert "x_tap_grad += x_sent_value*x_value;" in c


# ---------------------------------------------------------------- a neuron layer's line across calls

CHUNKINGS = {
    "one-step-then-longer-than-the-line": [1, 6, 4],
    "shorter-than-the-line": [2, 1, 3, 3, 2],
    "one-step-each": [1] * 11,
}


def chunked_grads(layer, x, weight, sizes):
    """Outputs and gradients (input, then every parameter by name) of a weighted output sum, x given to the layer
    in consecutive chunks of `sizes` steps (one step per call, unsqueezed, for a single-step layer)."""
    x = x.detach().clone().requires_grad_()
    outs, start = [], 0
    for size in sizes:
        piece = x[start:start + size]
        outs.append(layer(piece) if layer.step_mode == "m" else layer(piece[0])[None])
        start += size
    assert start == x.shape[0]
    out = torch.cat(outs)
    names, params = zip(*sorted(layer.named_parameters()))
    return out, dict(zip(("input", *names), torch.autograd.grad((out * weight).sum(), [x, *params])))


@pytest.mark.parametrize("chunking", CHUNKINGS)
@pytest.mark.parametrize("where", FUSED + ["torch", "eager"])
@pytest.mark.parametrize("taps", TAPS)
def test_calls_on_consecutive_chunks_equal_one_call(where, chunking, taps):
    device = "cpu" if where in ("torch", "eager") else where
    sizes = CHUNKINGS[chunking]
    step_mode = "s" if chunking == "one-step-each" else "m"

    def make(step_mode):
        backend = where if where in ("torch", "eager") else _fused_backend(where)
        delay = flexgen.Delay(6, MAX_DELAY, delay=delays(torch.float64, "cpu"), dtype=torch.float64, **TAPS[taps])
        return flexgen.LIF(v_threshold=0.5, step_mode=step_mode, backend=backend, delay=delay).to(_device(device))

    x = spiking_input((sum(sizes), 3, 6), device)
    weight = torch.rand(x.shape, dtype=torch.float64, device=_device(device))
    whole = chunked_grads(make("m"), x, weight, [x.shape[0]])
    layer = make(step_mode)
    assert_recurrent_same(chunked_grads(layer, x, weight, sizes), whole)
    assert torch.equal(layer.line, x[-MAX_DELAY:].detach())  # the input's last max_delay steps, as a copy
    assert layer.line._base is None


@pytest.mark.parametrize("sizes", [[1] * 11, [2, 1, 3, 1, 1, 3]], ids=["one-step-each", "short-chunks"])
@pytest.mark.parametrize("where", FUSED + ["torch"])
@pytest.mark.parametrize("taps", TAPS)
def test_streaming_without_a_gradient_appends_to_the_line_in_place(where, sizes, taps):
    """Calls shorter than the line that record no gradient append their steps to one buffer of 2 x max_delay rows
    (the line a view of its last max_delay, moved to the front when full) instead of copying the line each call:
    outputs and states equal one call's, and the line holds the input's last max_delay steps."""
    device = "cpu" if where == "torch" else where
    step_mode = "s" if len(sizes) == 11 else "m"

    def make(step_mode):
        backend = "torch" if where == "torch" else _fused_backend(where)
        delay = flexgen.Delay(6, MAX_DELAY, delay=delays(torch.float64, "cpu"), dtype=torch.float64, **TAPS[taps])
        return flexgen.LIF(v_threshold=0.5, step_mode=step_mode, backend=backend, delay=delay).to(_device(device))

    x = spiking_input((sum(sizes), 3, 6), device)
    whole = make("m")
    with torch.no_grad():
        want = whole(x)
        layer, outs, buffers, start = make(step_mode), [], set(), 0
        for size in sizes:
            piece = x[start:start + size]
            outs.append(layer(piece) if step_mode == "m" else layer(piece[0])[None])
            start += size
            assert layer.line._base is layer._line_buffer.rows  # a view of the buffer, no line of its own
            buffers.add(layer._line_buffer.rows.data_ptr())
    assert torch.equal(torch.cat(outs), want) and 0 < want.sum() < want.numel()
    assert torch.equal(layer.v, whole.v)
    assert len(buffers) == 1 and layer._line_buffer.rows.shape[0] == 2 * MAX_DELAY
    assert torch.equal(layer.line, x[-MAX_DELAY:])


@pytest.mark.parametrize("where", FUSED + ["torch"])
def test_a_streamed_line_is_copied_where_a_gradient_is_recorded_and_dropped_with_the_layer_state(where):
    """A call that records a gradient continues a streamed line but makes a line of its own (the old one may be
    saved for its backward, which a write into the buffer would fail), also when only the delays learn; pickling
    keeps the line alone, not the buffer; reset() and .to() drop the buffer."""
    device = "cpu" if where == "torch" else where

    def make():
        backend = "torch" if where == "torch" else _fused_backend(where)
        delay = flexgen.Delay(6, MAX_DELAY, delay=delays(torch.float64, "cpu"), dtype=torch.float64)
        return flexgen.LIF(v_threshold=0.5, step_mode="m", backend=backend, delay=delay).to(_device(device))

    x = spiking_input((9, 3, 6), device).detach()
    layer, whole = make(), make()
    with torch.no_grad():
        first = torch.cat([layer(x[:2]), layer(x[2:3])])
    assert layer._line_buffer is not None
    piece = x[3:5].clone().requires_grad_()
    second = layer(piece)
    assert layer._line_buffer is None and layer.line._base is None and layer.line.requires_grad
    assert torch.equal(torch.cat([first, second.detach()]), whole(x[:5]).detach())
    second.sum().backward()
    assert piece.grad is not None
    with torch.no_grad():
        layer(x[5:6])
    learning = make()  # learnable delays, inputs without a gradient: their gradient reads every call's line
    out = torch.cat([learning(x[:2]), learning(x[2:3]), learning(x[3:4])])
    assert learning._line_buffer is None
    (out * torch.arange(1.0, 5.0, dtype=torch.float64, device=x.device)[:, None, None]).sum().backward()
    assert learning.delay.delay.grad is not None and learning.delay.delay.grad.abs().sum() > 0
    copied = pickle.loads(pickle.dumps(layer))
    assert copied._line_buffer is None and torch.equal(copied.line, layer.line)
    assert copied.line.untyped_storage().nbytes() == layer.line.numel() * layer.line.element_size()
    layer.to(torch.float32)
    assert layer._line_buffer is None
    layer.reset()
    assert layer.line is None and layer._line_buffer is None


@pytest.mark.parametrize("device,taps", LINES)
@pytest.mark.parametrize("neuron", ["LIF", "two_input_synapse"])
def test_calls_that_continue_a_line_run_it_in_the_kernels(device, taps, neuron):
    """Chunked calls of a fused layer (the first shorter than the line, the next longer, then steps past it): every
    call after the first reads the held steps in the kernels (no `Delay` layer operation in its graph) and its
    results equal the `Delay` layer's run over the line and the call's steps; the backward reaches the earlier
    calls' input through the line. With a second input (not delayed) and two states too."""
    def make(backend, delay):
        if neuron == "LIF":
            return flexgen.LIF(v_threshold=0.5, step_mode="m", backend=backend, delay=delay)
        return two_input_synapse(step_mode="m", backend=backend, delay=delay)

    fused, reference = layer_pair(make, device, **TAPS[taps])
    x = spiking_input((13, 3, 6), device)
    extra = [spiking_input((13, 3, 6), device, seed=1)] if neuron == "two_input_synapse" else []
    weight = torch.rand(x.shape, dtype=torch.float64, device=_device(device))
    results = []
    for layer in (fused, reference):
        outs = []
        for start, stop in ((0, 2), (2, 9), (9, 13)):
            outs.append(layer(x[start:stop], *[e[start:stop] for e in extra]))
            outs[-1] = outs[-1][0] if isinstance(outs[-1], tuple) else outs[-1]
            assert runs_the_delay_layer(outs[-1]) == (layer is reference)
        out = torch.cat(outs)
        names, params = zip(*sorted(layer.named_parameters()))
        results.append((out, names, torch.autograd.grad((out * weight).sum(), [x, *extra, *params])))
    (out_f, names, grads_f), (out_r, _, grads_r) = results
    assert torch.equal(out_f, out_r)
    for name, a, b in zip(("input", *["extra"] * len(extra), *names), grads_f, grads_r):
        assert max_rel_err(a, b) <= 1e-12, name
    assert grads_f[0][:2].abs().sum() > 0  # the first call's steps got gradients from the later calls too


@pytest.mark.parametrize("device,taps", LINES)
def test_inference_calls_continue_a_line_in_the_kernels(device, taps):
    """Without autograd the continued calls run the inference kernel with the held line."""
    fused, reference = layer_pair(lambda backend, delay: flexgen.LIF(v_threshold=0.5, step_mode="m", backend=backend,
                                                                      delay=delay), device, **TAPS[taps])
    x = spiking_input((9, 2, 6), device).detach()
    with torch.no_grad():
        for start, stop in ((0, 1), (1, 3), (3, 9)):
            assert torch.equal(fused(x[start:stop]), reference(x[start:stop]))
    assert max_rel_err(fused.v, reference.v) <= 1e-12 and torch.equal(fused.line, reference.line)


@pytest.mark.parametrize("where", FUSED)
def test_a_detached_line_cuts_the_backward_at_the_call(where):
    """Truncated backpropagation: after `detach()` the next call's kernels still read the held steps, but no
    gradient reaches the earlier call's input; the line's values are the same, so the outputs equal the attached
    run's."""
    make = lambda: flexgen.LIF(v_threshold=0.5, step_mode="m", backend=_fused_backend(where), delay=flexgen.Delay(
        6, MAX_DELAY, delay=delays(torch.float64, "cpu"), dtype=torch.float64)).to(_device(where))
    x = spiking_input((8, 2, 6), where)
    attached, cut = make(), make()
    attached(x[:4]), cut(x[:4])
    cut.detach()
    out_a, out_c = attached(x[4:]), cut(x[4:])
    assert torch.equal(out_a, out_c)
    grad_a, = torch.autograd.grad(out_a.sum() + attached.v.sum(), x)
    grad_c, = torch.autograd.grad(out_c.sum() + cut.v.sum(), x)
    assert grad_a[:4].abs().sum() > 0 and torch.equal(grad_c[:4], torch.zeros_like(grad_c[:4]))
    assert torch.equal(grad_a[4:], grad_c[4:])


def test_a_backward_that_wants_no_starting_gradients_leaves_the_held_rows_out():
    """Without GRAD_INIT (states and line detached) the backward allocates no [max_delay, N] rows for the held
    line's gradient (its slot holds the first input gradient, which the kernel does not write there) and gives
    None for it."""
    from flexgen.launch import allocate
    from flexgen.launch.abi import learnable_gradients
    from flexgen.neurons.integrate_fire import lif_step

    layout = lif_step.compiled("delayed", {"input": "x", "max_delay": MAX_DELAY, "held": True}).layout
    shape, line = (5, 2, 3), torch.zeros(MAX_DELAY, 2, 3)
    learnable = [torch.tensor(2.0), line]  # the delay (one for all channels), the held line
    for grad_init in (True, False):
        grad_inputs, _, partials = allocate.backward_results(layout, shape, torch.float32, "cpu", [torch.float32],
                                                             len(learnable), grad_init)
        assert (partials[-1] is grad_inputs[0]) == (not grad_init)
        grads = learnable_gradients(layout, partials, learnable, shape[1:], held_grad=grad_init)
        assert (grads[-1] is None) == (not grad_init)
        assert grad_init is False or grads[-1].shape == line.shape


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph_runs_a_delayed_layer_and_continues_its_line(device):
    """Under torch.compile(fullgraph=True) (aot_eager) a delayed layer traces without a graph break: the kernels
    with the delay line were looked up when it was made (on a GPU the first call runs them as custom ops), and
    the continued line is torch operations. Chunks equal the eager layer's, which keeps the same line."""
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")

    def make():
        return flexgen.LIF(step_mode="m", v_threshold=0.3, backend="torch" if device == "cpu" else "triton",
                           delay=flexgen.Delay(6, 3, delay=torch.tensor([0.0, 1.0, 1.5, 2.0, 3.0, 2.5]))).to(device)

    eager, compiled = make(), make()
    x = spiking_input((10, 2, 6), "cpu").detach().float().to(device)
    call = torch.compile(lambda layer, x: layer(x), fullgraph=True, backend="aot_eager")
    want = torch.cat([eager(x[:4]), eager(x[4:])])
    assert torch.equal(torch.cat([call(compiled, x[:4]), call(compiled, x[4:])]), want)
    assert torch.equal(compiled.line, eager.line)


def test_reset_detach_copies_and_conversions_of_the_line():
    layer = flexgen.LIF(v_threshold=0.5, step_mode="m", backend="torch", delay=flexgen.Delay(6, MAX_DELAY))
    assert layer.line is None
    x = spiking_input((7, 2, 6), "cpu").float().detach().requires_grad_()
    first = layer(x)
    assert layer.line.requires_grad  # the graph of the call that filled it, as the states keep theirs
    layer.detach()
    assert not layer.line.requires_grad and torch.equal(layer.line, x[-MAX_DELAY:].detach())
    kept = copy.deepcopy(layer)
    assert torch.equal(kept.line, layer.line)
    assert torch.equal(pickle.loads(pickle.dumps(layer)).line, layer.line)
    layer.double()
    assert layer.line.dtype == torch.float64
    layer.reset()
    assert layer.line is None
    assert torch.equal(layer(x.double()), first.double())  # a fresh start after reset()


def test_a_line_from_another_batch_is_a_clear_error():
    layer = flexgen.LIF(step_mode="m", backend="torch", delay=flexgen.Delay(3, 2))
    layer(torch.rand(4, 2, 3))
    with pytest.raises(ValueError, match=r"holds inputs of shape \[2, 3\].*call layer.reset\(\)"):
        layer(torch.rand(4, 5, 3))
    layer.reset()
    assert layer(torch.rand(4, 5, 3)).shape == (4, 5, 3)


@pytest.mark.parametrize("where", FUSED)
def test_a_replaced_delay_continues_what_the_line_holds(where):
    """A layer whose `delay` is replaced by a shorter, longer or zero one keeps going: the new line reads what the old
    one held as far as it reaches (equal to the Delay layer over the held steps and the call's)."""
    make = lambda backend, k: flexgen.Delay(3, k, delay=torch.tensor([0.5, 1.0, float(k)]), dtype=torch.float64)
    layers = [flexgen.LIF(v_threshold=0.3, step_mode="m", backend=b, delay=make(b, 4)).to(_device(where))
              for b in (_fused_backend(where), "torch")]
    x = spiking_input((14, 2, 3), where).detach()
    for start, stop, k in ((0, 6, 4), (6, 9, 2), (9, 11, 6), (11, 12, 0), (12, 14, 3)):
        outs = []
        for layer in layers:
            layer.delay = make(layer.backend, k).to(_device(where))
            outs.append(layer(x[start:stop]))
        assert torch.equal(*outs), (start, k)


def test_a_line_on_another_device_is_a_clear_error():
    layer = flexgen.LIF(step_mode="m", backend="torch", delay=flexgen.Delay(3, 2))
    layer(torch.rand(4, 2, 3))
    object.__setattr__(layer, "line", layer.line.to("meta"))  # as if the input had moved without the layer
    with pytest.raises(ValueError, match=r"holds inputs on meta from earlier calls, this call's are on cpu.*\.to\(\)"):
        layer(torch.rand(4, 2, 3))


def test_a_line_of_no_steps_holds_nothing():
    layer = flexgen.LIF(step_mode="m", backend="torch", delay=flexgen.Delay(3, 0))
    layer(torch.rand(4, 2, 3))
    assert layer.line is None


@pytest.mark.parametrize("owner", ["Dense", "Recurrent"])
def test_layers_that_run_the_neuron_themselves_refuse_a_delayed_neuron(owner):
    lif = flexgen.LIF(step_mode="m", delay=flexgen.Delay(4, 2))
    with pytest.raises(ValueError, match=f"{owner} runs its neuron's kernels itself, without the layer's delay= line"):
        flexgen.Dense(5, 4, lif) if owner == "Dense" else flexgen.Recurrent(lif, hidden=4)


@pytest.mark.parametrize("name", ["line", "delay", "backend"])
def test_learnable_parameters_and_states_may_not_take_the_layers_own_names(name):
    learnable = flexgen.neuron(states=("v",), learnable=(name,))(
        eval(f"lambda x, v, {name}=0.5: (flexgen.spike(v + x - {name}), (v + x) * 0.5)", {"flexgen": flexgen}))
    with pytest.raises(TypeError, match=f"the learnable parameter '{name}' would be hidden by the layer's own"):
        learnable()
    state = flexgen.neuron(states=(name,))(
        eval(f"lambda x, {name}: (flexgen.spike({name} + x - 1.0), ({name} + x) * 0.5)", {"flexgen": flexgen}))
    with pytest.raises(TypeError, match=f"the state '{name}' would be hidden by the layer's own"):
        state()


def test_delay_must_be_a_delay_layer():
    with pytest.raises(TypeError, match="delay must be a flexgen.Delay"):
        flexgen.LIF(step_mode="m", delay=3)


def test_a_neuron_parameter_named_delay_is_refused():
    @flexgen.neuron(states=("v",))
    def lagging(x, v, delay=0.5):
        s = flexgen.spike(v + x * delay - 1.0)
        return s, (v + x * delay) * (1.0 - s)

    with pytest.raises(TypeError, match="parameter named 'delay'"):
        lagging(delay=flexgen.Delay(2, 1))


@pytest.mark.parametrize("backend", ["triton", "torch"] if INTERPRETER else ["torch"])
def test_bad_channels_and_nan_delays_are_clear_errors(backend):
    layer = flexgen.LIF(step_mode="m", backend=backend, delay=flexgen.Delay(3, 2))
    with pytest.raises(ValueError, match=r"Delay takes inputs \[T, B, 3, \.\.\.\]"):
        layer(torch.rand(4, 2, 5))
    with torch.no_grad():
        layer.delay.delay[1] = float("nan")
    with pytest.raises(ValueError, match="the delay of channel 1 is NaN"):
        layer(torch.rand(4, 2, 3))


def test_fixed_delays_out_of_range_are_refused_when_made():
    with pytest.raises(ValueError, match="outside"):
        flexgen.LIF(step_mode="m", delay=flexgen.Delay(2, 3, delay=torch.tensor([1.0, 5.0]), learnable=False))


def norm_err(got, truth):
    """|got - truth| / |truth|, in float64."""
    return ((got.double() - truth.double()).norm() / truth.double().norm()).item()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("taps", TAPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_and_bf16_inputs_through_the_fused_delay_line(taps, dtype):
    """16-bit spikes are exact, so the truth is the reference layer in float64 on the same input. The kernels
    compute in fp32; the reference in 16 bits is the less accurate of the two (in bf16 its delays' gradient is 20 %
    off the truth, the kernels' 0.6 %), so each is measured against the truth, not against each other."""
    def make(backend, delay):
        return flexgen.LIF(v_threshold=0.5, step_mode="m", backend=backend, delay=delay)

    fused, reference = layer_pair(make, "cuda", dtype=torch.float32, **TAPS[taps])
    truth = copy.deepcopy(reference).double()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.rand(12, 4, 6, device="cuda", generator=g) < 0.3).to(dtype).requires_grad_()
    out_f, grads_f = grads_of(fused, [x], [torch.ones_like(x)])
    exact = x.detach().double().requires_grad_()
    out_t, grads_t = grads_of(truth, [exact], [torch.ones_like(exact)])
    assert out_f[0].dtype == dtype and torch.equal(out_f[0].double(), out_t[0])
    assert norm_err(grads_f[0], grads_t[0]) < 1e-2  # the input's gradient is stored in 16 bits
    assert norm_err(grads_f[1], grads_t[1]) < 2e-2  # the delays' gradient sums 16-bit stored rows


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("taps", TAPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_chunks_that_continue_a_line_equal_one_call(taps, dtype):
    """In 16 bits a continued call reads the held steps as the whole call reads its own input, so the spikes are
    equal. The gradients sum three calls' 16-bit results (the input's rows the line carried, a gaussian line's taps
    gradient, rounded to the taps' 16-bit dtype per call) where one call rounds once: within three roundings."""
    layer = flexgen.LIF(v_threshold=0.5, step_mode="m", delay=flexgen.Delay(
        6, MAX_DELAY, delay=delays(torch.float32, "cpu"), **TAPS[taps])).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.rand(12, 4, 6, device="cuda", generator=g) < 0.3).to(dtype).requires_grad_()
    results = []
    for pieces in ([12], [3, 5, 4]):
        layer.reset()
        out = torch.cat([layer(p) for p in x.split(pieces)])
        results.append((out, *torch.autograd.grad(out.float().sum(), [x, layer.delay.delay])))
    (whole, gx_w, gd_w), (chunked, gx_c, gd_c) = results
    assert out.dtype == dtype and torch.equal(whole, chunked)
    tolerance = max(1e-2, 3 * torch.finfo(dtype).eps)
    assert norm_err(gx_c, gx_w) < tolerance and norm_err(gd_c, gd_w) < tolerance


# ---------------------------------------------------------------- delays in a recurrent layer's feedback

HIDDEN = 6


def recurrent_layer(backend, path="auto", neuron="LIF", interpolation="linear", step_mode="m", dtype=torch.float64):
    torch.manual_seed(1)  # the same weight and bias for every layer of a test
    delay = flexgen.Delay(HIDDEN, MAX_DELAY, delay=delays(dtype, "cpu", HIDDEN), dtype=dtype,
                          interpolation=interpolation, sigma=0.8)
    spec = flexgen.LIF if neuron == "LIF" else flexgen.neurons.alif
    options = dict(v_threshold=0.5) if neuron == "LIF" else dict(tau=2.0, v_threshold=0.5)
    return flexgen.Recurrent(spec, hidden=HIDDEN, backend=backend, path=path, bias=True, delay=delay,
                             step_mode=step_mode, **options).to(dtype)


def recurrent_input(seed=0, steps=10):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(steps, 3, HIDDEN, generator=g, dtype=torch.float64) * 1.2


@pytest.mark.parametrize("neuron", ["LIF", "ALIF"])
def test_recurrent_delays_on_every_path_match_the_eager_loop(neuron):
    """The fused kernels, the step-wise path on the CPU (one autograd function over the neuron's torch code or C
    kernels, the delay lines as gathers) and on Triton's per-step kernels, against the eager loop."""
    x, weight = recurrent_input(), torch.rand(10, 3, HIDDEN, dtype=torch.float64)
    want = recurrent_grads(recurrent_layer("eager", neuron=neuron), x, weight)
    runs = [("torch", "auto", "stepwise")] + ([("c", "auto", "stepwise")] if HAS_C_COMPILER else [])
    runs += [("triton", "fused", "fused"), ("triton", "stepwise", "stepwise")] if INTERPRETER else []
    for backend, path, taken in runs:
        layer = recurrent_layer(backend, path, neuron=neuron)
        assert_recurrent_same(recurrent_grads(layer, x, weight), want)
        assert layer.path == taken
    assert want[1]["delay.delay"].abs().sum() > 0  # the delays do get a gradient
    cpu = recurrent_layer("torch")
    assert type(cpu(x.requires_grad_()).grad_fn).__name__ == "_SteppedBackward"  # one function, not a step each


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="needs a CUDA GPU")
@pytest.mark.parametrize("neuron", ["LIF", "ALIF"])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("interpolation", ["linear", "gaussian"])
def test_fused_recurrent_delays_in_float64_on_the_gpu_match_the_eager_loop(neuron, split, interpolation):
    """float64 on the GPU: the fused kernels (one program per row tile, or the hidden neurons in four slices in
    step) give the eager loop's spikes, and its gradients within 1e-12."""
    from flexgen.launch.compat import fp64_dot_error
    from flexgen.launch.recurrent.fused import RecurrentConfig

    if fp64_dot_error(torch.cuda.current_device()) is not None:
        pytest.skip("this Triton has no float64 tl.dot on the GPU")
    hidden, g = 64, torch.Generator().manual_seed(4)
    x = torch.rand(12, 3, hidden, generator=g, dtype=torch.float64) * 1.2
    weight = torch.rand(12, 3, hidden, generator=g, dtype=torch.float64)
    spec, options = (flexgen.LIF, {}) if neuron == "LIF" else (flexgen.neurons.alif, {"tau": 2.0})
    results = []
    for backend, device in (("triton", "cuda"), ("eager", "cpu")):
        torch.manual_seed(1)
        delay = flexgen.Delay(hidden, MAX_DELAY, delay=torch.rand(hidden, generator=torch.Generator().manual_seed(2))
                              * MAX_DELAY, dtype=torch.float64, interpolation=interpolation, sigma=0.8)
        layer = flexgen.Recurrent(spec, hidden=hidden, backend=backend, bias=True, delay=delay, v_threshold=0.5,
                                  config=RecurrentConfig(split=split), **options).to(device, torch.float64)
        out, grads = recurrent_grads(layer, x.to(device), weight.to(device))
        results.append((out.cpu(), {k: v.cpu() for k, v in grads.items()}))
        assert layer.path == ("fused" if backend == "triton" else "eager")
    assert results[1][0].sum() > 0 and results[1][1]["delay.delay"].abs().sum() > 0
    assert_recurrent_same(*results)


@pytest.mark.parametrize("neuron", ["LIF", "ALIF"])
def test_gaussian_recurrent_delays_on_every_path_match_the_eager_loop(neuron):
    """Gaussian taps in the fused kernels (every step of the line in the forward's product, the later operands'
    gradients gathered in the backward), in the step-wise paths, against the eager loop."""
    x, weight = recurrent_input(2), torch.rand(10, 3, HIDDEN, dtype=torch.float64)
    want = recurrent_grads(recurrent_layer("eager", neuron=neuron, interpolation="gaussian"), x, weight)
    runs = [("torch", "auto", "stepwise")] + ([("c", "auto", "stepwise")] if HAS_C_COMPILER else [])
    runs += [("triton", "auto", "fused"), ("triton", "stepwise", "stepwise")] if INTERPRETER else []
    for backend, path, taken in runs:
        layer = recurrent_layer(backend, path, neuron=neuron, interpolation="gaussian")
        assert_recurrent_same(recurrent_grads(layer, x, weight), want)
        assert layer.path == taken
    assert want[1]["delay.delay"].abs().min() > 0


@pytest.mark.skipif(not INTERPRETER, reason="the fused kernels on the CPU run in Triton's interpreter")
def test_a_long_gaussian_recurrent_line_spans_several_blocks_of_taps():
    """max_delay 40: the kernels load 16 taps at a time at these tiles (TapLine.constexprs), so the line is three
    blocks, the last partly past N_TAPS; 45 steps, so early steps have fewer outputs behind them than taps."""
    from flexgen.launch.recurrent.lines import TapLine
    from flexgen.launch.recurrent.fused import Tiling

    line = TapLine(torch.zeros(16, 41), torch.float32)
    assert line.constexprs(Tiling(block_b=16, block=8, split=2, block_k=16)) == {"N_TAPS": 41, "TAP_BLOCK": 16}
    g = torch.Generator().manual_seed(9)
    x, weight = torch.rand(45, 2, 16, generator=g, dtype=torch.float64) * 1.2, torch.rand(45, 2, 16, generator=g,
                                                                                          dtype=torch.float64)
    results = []
    for backend, path in (("triton", "fused"), ("eager", "auto")):
        torch.manual_seed(1)
        delay = flexgen.Delay(16, 40, delay=torch.rand(16, generator=torch.Generator().manual_seed(2)) * 40,
                              dtype=torch.float64, interpolation="gaussian", sigma=6.0)
        layer = flexgen.Recurrent(flexgen.LIF, hidden=16, backend=backend, path=path, bias=True, delay=delay,
                                  v_threshold=0.5).to(torch.float64)
        with torch.no_grad():
            layer.weight.mul_(4.0)  # feedback strong enough to matter
        results.append(recurrent_grads(layer, x, weight))
    assert results[1][0].sum() > 0 and results[1][1]["delay.delay"].abs().min() > 0
    assert_recurrent_same(*results)


def test_the_taps_follow_the_layers_interpolation():
    """DCLS's recipe trains with gaussian taps, then rounds the delays and switches to linear ones: each call
    takes the kernels of the interpolation the layer has then."""
    layer = recurrent_layer("triton" if INTERPRETER else "torch", interpolation="gaussian")
    x = recurrent_input(6)
    gaussian = layer(x)
    layer.reset()
    layer.delay.round_()
    layer.delay.interpolation = "linear"
    shifted = layer(x)
    reference = recurrent_layer("eager", interpolation="gaussian")
    reference.delay.round_()
    reference.delay.interpolation = "linear"
    assert torch.equal(shifted, reference(x))
    assert not torch.equal(gaussian, shifted)
    if INTERPRETER:
        assert "rec_lag_ptr" in layer.source("forward")
        layer.delay.interpolation = "gaussian"
        assert "rec_taps_ptr" in layer.source("forward")


@pytest.mark.parametrize("neuron", ["LIF", "ALIF"])
@pytest.mark.parametrize("backend", ["torch"] + (["c"] if HAS_C_COMPILER else []))
def test_gaussian_recurrent_delays_on_the_cpu_are_one_function(backend, neuron):
    """On the CPU gaussian taps run in the step-wise autograd function (every tap a row of the window each step
    reads), in one call and in chunks, with the eager loop's spikes and gradients (the delays' through the taps)."""
    x, weight = recurrent_input(5, steps=11), torch.rand(11, 3, HIDDEN, dtype=torch.float64)
    want = recurrent_grads(recurrent_layer("eager", neuron=neuron, interpolation="gaussian"), x, weight)
    assert want[1]["delay.delay"].abs().min() > 0  # every delay gets a gradient through its taps
    for chunks in ((None,), (slice(0, 2), slice(2, 9), slice(9, 11))):
        layer = recurrent_layer(backend, neuron=neuron, interpolation="gaussian")
        assert_recurrent_same(recurrent_grads(layer, x, weight, chunks), want)
    assert type(layer(x.requires_grad_()).grad_fn).__name__ in ("_SteppedBackward", "_SteppedRowsBackward")


@pytest.mark.parametrize("backend", ["torch", "eager"] + (["c"] if HAS_C_COMPILER else []) +
                         (["triton"] if INTERPRETER else []))
def test_recurrent_delay_lines_carry_over_between_calls(backend):
    """One call on T steps equals calls on pieces of it (shorter and longer than the delay line) and T one-step
    calls: the layer keeps the outputs its delay lines still hold."""
    x, weight = recurrent_input(3), torch.rand(10, 3, HIDDEN, dtype=torch.float64)
    for interpolation in ("linear", "gaussian"):
        want = recurrent_grads(recurrent_layer(backend, interpolation=interpolation), x, weight)
        for chunks in [(slice(0, 2), slice(2, 3), slice(3, 9), slice(9, 10)), (slice(0, 6), slice(6, 10))]:
            layer = recurrent_layer(backend, interpolation=interpolation)
            assert_recurrent_same(recurrent_grads(layer, x, weight, chunks), want)
        steps = [slice(t, t + 1) for t in range(10)]
        layer = recurrent_layer(backend, step_mode="s", interpolation=interpolation)
        assert_recurrent_same(recurrent_grads(layer, x, weight, steps), want)


def test_reset_and_detach_of_a_delayed_recurrent_layer():
    layer = recurrent_layer("torch")
    x = recurrent_input(4)
    first = layer(x)
    assert layer.sent.shape == (MAX_DELAY + 1, 3, HIDDEN)
    assert torch.equal(layer.sent, first[-(MAX_DELAY + 1):])
    layer.detach()
    assert not layer.sent.requires_grad
    layer.reset()
    assert layer.sent is None
    assert torch.equal(layer(x), first)  # from the start again


def test_recurrent_delays_keep_their_fraction_in_16_bit_runs():
    """A recurrent layer's linear delays reach its lines (fused and step-wise) in their own dtype: in bf16 a delay
    of 130.5 would round to a whole step (bf16 holds no fraction past 128) and 20.3 to 20.25."""
    from flexgen.launch.recurrent.lines import line_of
    delay = flexgen.Delay(3, 200, delay=torch.tensor([130.5, 20.3, 7.0]))
    layer = flexgen.Recurrent(flexgen.LIF, hidden=3, backend="torch", delay=delay)
    x = torch.rand(4, 2, 3).to(torch.bfloat16)
    line = line_of(layer._line_values(x), delay.max_delay, layer.weight.to(torch.bfloat16))
    assert line.lag.tolist() == [130, 20, 7]
    assert line.frac.float().tolist() == pytest.approx([0.5, 0.3, 0.0], abs=2e-3)  # frac itself in bf16
    assert layer(x).dtype == torch.bfloat16  # the step-wise path takes them too


def test_a_gaussian_recurrent_lines_taps_gradient_is_summed_in_the_taps_dtype():
    """A 16-bit call's taps gradient (the fused path's, on the host) comes in the taps' own dtype, each tap's sum
    over steps and rows unrounded: rounded to bf16 each sum would be off by up to 2^-8 of itself, every call."""
    from flexgen.launch.recurrent.lines import line_of
    g = torch.Generator().manual_seed(4)
    taps = torch.rand(5, 4, generator=g)
    fed_back = (torch.rand(30, 3, 5, generator=g) < 0.4).to(torch.bfloat16)
    grad_current = torch.randn(30, 3, 5, generator=g).to(torch.bfloat16)
    weight = torch.randn(5, 5, generator=g).to(torch.bfloat16)
    line = line_of(taps, 3, weight)
    assert line.taps.dtype == torch.bfloat16 and line.grad_dtype == torch.float32
    _, grad_taps = line.gradients(grad_current, fed_back, weight, False, True)
    assert grad_taps.dtype == torch.float32
    operand = (grad_current @ weight).double()  # the formula's grad_I W, as the line takes it (bf16)
    want = torch.stack([(operand[j + 1:] * fed_back[:29 - j].double()).sum((0, 1)) for j in range(4)], dim=1)
    assert max_rel_err(grad_taps.double(), want) <= 1e-6  # float32 sums of exact products


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_chunks_of_a_gaussian_recurrent_line_equal_one_call(dtype):
    """Chunked 16-bit calls of a fused recurrent layer with gaussian delays: spikes equal to one call's, and the
    delays' gradient within three 16-bit roundings of it (each call's taps gradient comes in float32). A continued
    call adds what its held outputs feed back to its inputs on the host, in the I/O dtype, where one call's kernels
    add it in float32: the spikes are equal for these inputs (before, when the host computed that part from taps
    rounded to 16 bits, they were not). The weight is seeded: that difference can still flip a spike whose 16-bit
    current lies within a rounding of the threshold. Unseeded, the weight came from whatever state earlier tests
    left, and one H100 run flipped spikes in float16; of seeds 0-7, seed 1 flips 8 of 288 spikes in bfloat16 and the
    other 15 (seed, dtype) runs are equal (docs/perf/h100/gaussian_line_16bit_chunks_seeds.log)."""
    torch.manual_seed(0)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=HIDDEN, path="fused", bias=True, v_threshold=0.5, delay=flexgen.Delay(
        HIDDEN, MAX_DELAY, delay=delays(torch.float32, "cpu", HIDDEN), interpolation="gaussian", sigma=0.8)).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.rand(12, 4, HIDDEN, device="cuda", generator=g) * 1.5).to(dtype).requires_grad_()
    results = []
    for pieces in ([12], [3, 5, 4]):
        layer.reset()
        out = torch.cat([layer(p) for p in x.split(pieces)])
        assert layer.path == "fused"
        weights = torch.arange(1.0, 13.0, device="cuda")[:, None, None]
        results.append((out, *torch.autograd.grad((out.float() * weights).sum(), [x, layer.delay.delay])))
    (whole, gx_w, gd_w), (chunked, gx_c, gd_c) = results
    assert out.dtype == dtype and torch.equal(whole, chunked) and 0 < whole.sum() < whole.numel()
    tolerance = max(1e-2, 3 * torch.finfo(dtype).eps)
    assert norm_err(gx_c, gx_w) < tolerance and norm_err(gd_c, gd_w) < tolerance


def test_recurrent_delay_must_have_one_channel_per_neuron():
    with pytest.raises(ValueError, match="needs one per neuron"):
        flexgen.Recurrent(flexgen.LIF, hidden=4, delay=flexgen.Delay(3, 2))
    with pytest.raises(TypeError, match="delay must be a flexgen.Delay"):
        flexgen.Recurrent(flexgen.LIF, hidden=4, delay=2)


@pytest.mark.parametrize("budget", ["4KiB", "1GiB"])
def test_a_long_sequence_mode_under_a_budget_carries_the_delay_lines_across_segments(budget):
    """Each segment continues from the outputs the delay lines still hold (max_delay + 1 steps, taken from earlier
    segments where a segment is shorter): the default path's spikes, and its gradients within 1e-12."""
    def layer(**options):
        torch.manual_seed(3)
        cell = flexgen.Recurrent(flexgen.LIF, hidden=4, backend="torch", v_threshold=0.5,
                                 delay=flexgen.Delay(4, 5, delay=torch.tensor([0.0, 1.5, 3.25, 5.0])))
        made = flexgen.Dense(3, 4, cell, backend="torch", **options).double()
        with torch.no_grad():
            made.weight.mul_(3.0)
        return made

    assert_budget_run_equals_the_default(layer, budget)  # 4 KiB: segments of 11 steps


def test_a_history_of_previous_outputs_must_have_steps_and_the_layers_shape():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=4, backend="torch", delay=flexgen.Delay(4, 2))
    x = torch.rand(3, 2, 4)
    with pytest.raises(ValueError, match=r"history \[S, B, H\] needs at least one step"):
        layer(x, previous_output=torch.zeros(0, 2, 4))
    with pytest.raises(ValueError, match=r"previous_output must broadcast to \[B, 4\] = \[2, 4\], got \[3, 4\]"):
        layer(x, previous_output=torch.zeros(2, 3, 4))


def test_the_recurrent_kernels_show_the_delay_line():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=4, delay=flexgen.Delay(4, 2))
    forward, backward = layer.source("forward"), layer.source("backward")
    assert "rec_operand = rec_far*rec_frac + rec_near*(1.0 - rec_frac)" in forward
    assert "rec_collected_ptr" in backward and "rec_to_far = rec_current*rec_frac" in backward
    layer.delay.interpolation = "gaussian"
    forward, backward, module = layer.source("forward"), layer.source("backward"), layer.source("module")
    assert "N_TAPS: tl.constexpr, TAP_BLOCK: tl.constexpr" in forward and "rec_products = rec_pushed*rec_tap" in forward
    assert "rec_ring_ptr" in forward and "rec_ring_ptr" in backward and "rec_collected_ptr" not in backward
    assert "weighed by the neuron's taps" in module


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interpolation", ["linear", "gaussian"])
def test_fused_recurrent_delays_on_the_gpu_match_the_step_wise_path(dtype, interpolation):
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(40, 16, HIDDEN, generator=g) * 1.2).to("cuda", dtype)
    weight = torch.rand(40, 16, HIDDEN, device="cuda").to(dtype)
    got = recurrent_grads(recurrent_layer("triton", "fused", dtype=torch.float32, interpolation=interpolation).cuda(),
                          x, weight)
    want = recurrent_grads(recurrent_layer("triton", "stepwise", dtype=torch.float32,
                                           interpolation=interpolation).cuda(), x, weight)
    if dtype == torch.float32:
        assert (got[0] != want[0]).float().mean().item() < 1e-3
        for name in want[1]:
            assert max_rel_err(got[1][name], want[1][name]) < 1e-3, name
        return
    # In bf16 the two paths round their operands differently and a flipped spike changes every later gradient, so
    # each is measured against the float64 truth on the same (exact) input: the fused path flips fewer spikes and
    # is the closer of the two on every gradient (the delays' gradient, W (C1 - C0), is a difference of two close
    # sums, which magnifies the step-wise path's rounding most).
    truth = recurrent_grads(recurrent_layer("torch", "stepwise", interpolation=interpolation).cuda(), x.double(),
                            weight.double())
    paths = {"fused": got, "stepwise": want}
    flips = {path: (out.double() != truth[0]).float().mean().item() for path, (out, _) in paths.items()}
    assert flips["fused"] <= min(flips["stepwise"], 1e-2)
    for name in truth[1]:
        fused_err, stepwise_err = norm_err(got[1][name], truth[1][name]), norm_err(want[1][name], truth[1][name])
        assert fused_err < 5e-2 and fused_err <= stepwise_err, name


@pytest.mark.parametrize("device,taps", LINES)
@pytest.mark.parametrize("chunks", [(7,), (1, 6), (3, 4)])
def test_torch_func_grad_through_a_fused_delay_line(device, taps, chunks):
    """torch.func.grad of one call, or of calls on chunks that continue the line (one shorter than the line)."""
    x = spiking_input((7, 2, 3), device).detach()
    weight = torch.arange(7.0, dtype=torch.float64, device=_device(device))[:, None, None]
    grads = []
    for backend in (_fused_backend(device), "torch"):  # under torch.func the C target's layer runs the torch path
        delay = flexgen.Delay(3, 2, delay=torch.tensor([0.5, 1.0, 2.0]), dtype=torch.float64,
                              **TAPS[taps]).to(_device(device))
        layer = flexgen.LIF(step_mode="m", v_threshold=0.3, backend=backend, delay=delay)

        def loss(params, x, layer=layer):
            flexgen.reset(layer)
            outs = [torch.func.functional_call(layer, params, (piece,)) for piece in x.split(list(chunks))]
            return (torch.cat(outs) * weight).sum()

        grads.append(torch.func.grad(loss)(dict(layer.named_parameters()), x)["delay.delay"])
    assert grads[1].abs().sum() > 0
    assert max_rel_err(grads[0], grads[1]) <= 1e-12


@pytest.mark.parametrize("interpolation", ["linear", "gaussian"])
def test_torch_func_grad_through_fused_recurrent_delays(interpolation):
    if not INTERPRETER:
        pytest.skip("float64 fused recurrent kernels run in Triton's interpreter only")
    x, weight = recurrent_input(6).detach(), torch.rand(10, 3, HIDDEN, dtype=torch.float64)
    def make_layer(backend, path):
        return recurrent_layer(backend, path, interpolation=interpolation)

    assert_func_grads_fused_equal_eager(make_layer, x, weight)


def test_a_step_name_the_delay_line_would_reuse_is_refused():
    @flexgen.neuron(states=("v",))
    def clashing(x, v, x_lag=0.5):
        x_near = x * x_lag
        s = flexgen.spike(v + x_near - 1.0)
        return s, (v + x_near) * (1.0 - s)

    with pytest.raises(flexgen.SpecError, match=r"names its values \['x_lag', 'x_near'\]"):
        clashing.source("forward", max_delay=3)
    assert "x_near" in clashing.source("forward")  # without a delay line the names are the step's own
