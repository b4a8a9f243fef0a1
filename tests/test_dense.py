"""flexgen.Dense: dense synapses feeding a neuron layer, and its long-sequence mode (checkpoint_every=K).

The long-sequence path must give what the default path gives: in fp64 the same spikes and gradients equal to
1e-12 relative (the weight gradient sums its segments in another order), for every kind of cell, every K, with
initial states and previous outputs that take gradients, and final states used in the loss.
"""
import warnings

import pytest
import torch

import flexgen
from flexgen.launch.bitpack import pack_spikes, unpack_spikes
from flexgen.layers.dense import projected
from flexgen.launch.autograd import SECOND_ORDER

from conftest import TRITON_DEVICE, cuda_peak_bytes, device_backends, max_rel_err

F64 = 1e-12


def spikes(shape, p=0.4, seed=0, dtype=torch.float64, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) < p).to(dtype).to(device)


def cells(backend):
    """name -> a function making a fresh neuron argument for Dense(5, 6, ...)."""
    return {
        "LIF class": lambda: flexgen.LIF,
        "PLIF per neuron": lambda: flexgen.PLIF(per_channel=6, backend=backend),
        "ALIF (two states)": lambda: flexgen.neurons.alif(tau=2.0, tau_a=5.0, backend=backend),
        "Recurrent LIF": lambda: flexgen.Recurrent(flexgen.LIF, hidden=6, bias=True, backend=backend),
        "Recurrent ALIF": lambda: flexgen.Recurrent(flexgen.neurons.alif, hidden=6, backend=backend, tau=2.0, tau_a=5.0),
        # delay lines up to 3 steps: a segment shorter than the line continues from outputs of several segments back
        "Recurrent LIF, delayed": lambda: flexgen.Recurrent(flexgen.LIF, hidden=6, bias=True, backend=backend,
                                                            delay=flexgen.Delay(6, 3, delay=DELAYS)),
    }


DELAYS = torch.tensor([0.0, 0.5, 1.25, 2.0, 2.75, 3.0])


def pair(make_neuron, backend, every, device="cpu", dtype=torch.float64, seed=0):
    """(long-sequence layer, default layer) with equal parameters, weights scaled so that neurons fire."""
    torch.manual_seed(seed)
    neuron = make_neuron()
    kwargs = {} if isinstance(neuron, torch.nn.Module) else {"backend": backend}
    long = flexgen.Dense(5, 6, neuron, checkpoint_every=every, **kwargs)
    torch.manual_seed(seed)
    plain = flexgen.Dense(5, 6, make_neuron(), **kwargs)
    with torch.no_grad():
        long.weight.mul_(4.0)
        plain.load_state_dict(long.state_dict())
    return long.to(device, dtype), plain.to(device, dtype)


def run_and_grad(layer, x, seed=1, **call):
    """Outputs, the final states, and the gradients of a random weighting of outputs and final states with respect
    to the input, the parameters and the given initial states or previous output."""
    out = layer(x, **call)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum() for o in outs)
    loss = loss + sum(s.pow(2).sum() for s in layer.final_states.values())
    wrt = [x, *layer.parameters(), *(call.get("states") or []), *([call["previous_output"]] if "previous_output" in call else [])]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [o.detach() for o in outs], {k: v.detach() for k, v in layer.final_states.items()}, grads


def assert_same(long_result, plain_result):
    (lo, ls, lg), (po, ps, pg) = long_result, plain_result
    for a, b in zip(lo, po):
        assert torch.equal(a, b)
    for k in ps:
        assert max_rel_err(ls[k], ps[k]) <= F64
    for a, b in zip(lg, pg):
        assert (a is None) == (b is None)
        if a is not None:
            assert max_rel_err(a, b) <= F64


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("name", list(cells("torch")))
@pytest.mark.parametrize("every", [1, 4, 11, 40])
def test_long_sequence_path_equals_default(device, backend, name, every):
    long, plain = pair(cells(backend)[name], backend, every, device)
    x = spikes((11, 3, 5), device=device).requires_grad_()
    got, want = run_and_grad(long, x), run_and_grad(plain, x)
    assert any(o.sum() > 0 for o in want[0]) and any(o.sum() < o.numel() for o in want[0]), "no spikes to compare"
    assert_same(got, want)


@pytest.mark.parametrize("name,previous_steps", [("ALIF (two states)", None), ("Recurrent ALIF", 1),
                                                  ("Recurrent LIF, delayed", 1), ("Recurrent LIF, delayed", 3)])
def test_initial_states_and_previous_output_get_gradients(name, previous_steps):
    long, plain = pair(cells("torch")[name], "torch", 3)
    x = spikes((8, 2, 5)).requires_grad_()
    g = torch.Generator().manual_seed(5)
    states = [torch.rand(2, 6, generator=g, dtype=torch.float64).requires_grad_() for _ in long.final_states or
              long.cell.spec.signature.states]
    call = {"states": states}
    if previous_steps == 1:
        call["previous_output"] = spikes((2, 6), seed=7).requires_grad_()
    elif previous_steps:  # a delayed cell's history of outputs, oldest first
        call["previous_output"] = spikes((previous_steps, 2, 6), seed=7).requires_grad_()
    got, want = run_and_grad(long, x, **call), run_and_grad(plain, x, **call)
    assert all(g is not None for g in got[2][-3:])
    assert_same(got, want)


@pytest.mark.parametrize("name", ["LIF class", "Recurrent ALIF", "Recurrent LIF, delayed"])
def test_one_call_equals_two_halves(name):
    long, _ = pair(cells("torch")[name], "torch", 2)
    x = spikes((10, 2, 5), seed=3)
    whole = long(x)
    first = long(x[:5])
    call = {"states": list(long.final_states.values())}
    if long.recurrent:  # a delayed cell continues from the outputs its delay lines still hold
        call["previous_output"] = long.cell.sent if long.cell.delay is not None else long.final_output
    second = long(x[5:], **call)
    assert torch.equal(torch.cat([first, second]), whole)


def test_the_backward_keeps_one_bit_per_input_value_and_the_checkpoints():
    long, _ = pair(cells("torch")["Recurrent LIF"], "torch", 4)
    x = spikes((64, 3, 5)).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = long(x)
    out.sum().backward()
    # the segments before the last keep their input as bits (15 bits -> 2 bytes per step); the last one, run with
    # autograd in the forward, keeps its own values of its 4 steps, never a view of the whole input
    parameters = {p.untyped_storage().data_ptr() for p in long.parameters()}
    kept = [t for t in saved if t.untyped_storage().data_ptr() not in parameters]
    assert [(t.dtype, tuple(t.shape)) for t in kept if t.dtype == torch.uint8] == [(torch.uint8, (60, 2))]
    one_segment = 4 * 3 * 6 * 8  # bytes of 4 steps of [3, 6] float64 values
    assert all(t.untyped_storage().nbytes() <= one_segment for t in kept if t.dtype != torch.uint8)
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", [(3, 2, 5), (4, 1, 8), (2, 3, 1), (1, 2, 17)])
def test_spikes_pack_to_bits_and_back(shape):
    x = spikes(shape, dtype=torch.float32)
    packed = pack_spikes(x)
    assert packed.dtype == torch.uint8 and packed.shape == (shape[0], -(-shape[1] * shape[2] // 8))
    assert torch.equal(unpack_spikes(packed, shape[1:], torch.float32), x)


def test_bits_are_in_documented_order():
    x = torch.tensor([[1.0, 0, 0, 0, 0, 0, 0, 1, 1]])
    assert pack_spikes(x).tolist() == [[129, 1]]


@pytest.mark.parametrize("bad", [0.5, 2.0, -1.0, float("nan")])
def test_non_spike_input_is_refused_in_the_long_sequence_mode(bad):
    long, plain = pair(cells("torch")["LIF class"], "torch", 4)
    x = spikes((6, 2, 5))
    x[3, 1, 2] = bad
    with pytest.raises(ValueError, match=r"only 0 and 1 \(spikes\); x\[3, 1, 2\].*without checkpoint_every"):
        long(x.requires_grad_())
    plain(x).sum().backward()  # the default path takes any current
    with torch.no_grad():
        long(x)  # without a gradient to keep, the long-sequence layer runs the default path


def test_second_order_is_refused():
    long, _ = pair(cells("torch")["LIF class"], "torch", 4)
    x = spikes((6, 2, 5)).requires_grad_()
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(long(x).sum(), x, create_graph=True)
    assert "differentiable once" in SECOND_ORDER


def test_autocast_replays_in_the_backward():
    long, plain = pair(cells("torch")["Recurrent LIF"], "torch", 16, dtype=torch.float32)
    x = spikes((12, 3, 5), dtype=torch.float32).requires_grad_()
    results = []
    for layer in (long, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        assert out.dtype == torch.bfloat16
        results.append((out, torch.autograd.grad(out.float().sum(), [x, layer.weight])))
    (a, ga), (b, gb) = results
    assert torch.equal(a, b) and all(torch.equal(u, v) for u, v in zip(ga, gb))


@pytest.mark.parametrize("every,error", [(0, ValueError), (-2, ValueError), (True, TypeError), (2.5, TypeError),
                                         ("auto", TypeError)])
def test_bad_checkpoint_every(every, error):
    with pytest.raises(error, match="checkpoint_every must be a positive number of steps"):
        flexgen.Dense(3, 2, flexgen.LIF, checkpoint_every=every)


def test_bad_layers_and_calls():
    with pytest.raises(ValueError, match="in_features must be a positive number"):
        flexgen.Dense(0, 2, flexgen.LIF)
    with pytest.raises(ValueError, match="Recurrent layer of 4 neurons"):
        flexgen.Dense(3, 2, flexgen.Recurrent(flexgen.LIF, hidden=4))
    with pytest.raises(TypeError, match="Dense needs a flexgen neuron"):
        flexgen.Dense(3, 2, torch.nn.ReLU())

    @flexgen.neuron(states=("v",))
    def two_inputs(x, y, v):
        h = v + x * y
        s = flexgen.spike(h - 1.0)
        return s, h * (1.0 - s)

    with pytest.raises(ValueError, match="takes 2 inputs"):
        flexgen.Dense(3, 2, two_inputs)
    layer = flexgen.Dense(3, 2, flexgen.LIF, backend="torch")
    with pytest.raises(ValueError, match=r"takes inputs \[T, B, 3\], got \(4, 3\)"):
        layer(torch.zeros(4, 3))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.zeros(4, 1, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="previous_output is for a recurrent cell"):
        layer(torch.zeros(4, 1, 3), previous_output=torch.zeros(1, 2))


def test_triton_path_runs_the_long_sequence_mode():
    """The generated kernels (on the GPU, or the interpreter on the CPU) under the long-sequence path."""
    long, plain = pair(cells("triton")["Recurrent LIF"], "triton", 3, TRITON_DEVICE, torch.float32)
    x = spikes((7, 2, 5), dtype=torch.float32, device=TRITON_DEVICE).requires_grad_()
    got, want = run_and_grad(long, x), run_and_grad(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    for a, b in zip(got[2], want[2]):
        assert max_rel_err(a, b) <= 1e-5  # fp32: the weight gradient's segments sum in another order


@flexgen.neuron(states=("v",))
def graded(x, v, tau=2.0, v_th=1.0):
    """A LIF that also gives its membrane potential `h` (not a spike), for a layer that feeds `h` back."""
    h = v + (x - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h, h - flexgen.detach(s) * v_th


def count_fused_runs(monkeypatch):
    """Counts of the fused recurrent forward's training launches and of the replays that ran (not None)."""
    import flexgen.launch.recurrent.fused as fused
    import flexgen.layers.recurrent_paths as recurrent

    counts = {"training forwards": 0, "replays": 0}
    forward, replay = fused.fused_forward, recurrent.run_replayed

    def counted_forward(compiled, call, *args, **kwargs):
        counts["training forwards"] += call.save
        return forward(compiled, call, *args, **kwargs)

    def counted_replay(*args, **kwargs):
        result = replay(*args, **kwargs)
        counts["replays"] += result is not None
        return result

    monkeypatch.setattr(fused, "fused_forward", counted_forward)
    monkeypatch.setattr(recurrent, "run_replayed", counted_replay)
    return counts


REPLAY_DTYPES = [pytest.param(torch.float64, id="fp64"), pytest.param(torch.float32, id="fp32")] \
    if TRITON_DEVICE == "cpu" else [pytest.param(torch.float32, id="fp32", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", REPLAY_DTYPES)
@pytest.mark.parametrize("name,given", [("Recurrent LIF", False), ("Recurrent ALIF", True)])
def test_segments_replay_the_fed_back_spikes_instead_of_rerunning_the_fused_forward(monkeypatch, dtype, name, given):
    """The backward re-runs a recurrent cell's segment from the spikes it fed back in the forward (kept as bits):
    one product for the segment's recurrent currents and the neuron's plain kernels, then the fused backward. Only
    the last segment, run with autograd in the forward, launches the fused training forward."""
    counts = count_fused_runs(monkeypatch)
    long, plain = pair(cells("triton")[name], "triton", 3, TRITON_DEVICE, dtype)
    x = spikes((11, 2, 5), dtype=dtype, device=TRITON_DEVICE).requires_grad_()
    call = {}
    if given:  # initial states and a previous output that take gradients: the first segment starts from them
        g = torch.Generator().manual_seed(5)
        call["states"] = [torch.rand(2, 6, generator=g, dtype=dtype).to(TRITON_DEVICE).requires_grad_()
                          for _ in long.cell.spec.signature.states]
        call["previous_output"] = spikes((2, 6), seed=7, dtype=dtype, device=TRITON_DEVICE).requires_grad_()
    got = run_and_grad(long, x, **call)
    assert counts == {"training forwards": 1, "replays": 3}  # segments of steps 0-2, 3-5, 6-8 replay; 9-10 ran
    want = run_and_grad(plain, x, **call)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0]))
    tolerance = F64 if dtype == torch.float64 else 1e-5  # fp32: products and sums in another order
    for a, b in zip(got[2], want[2]):
        assert max_rel_err(a, b) <= tolerance


def test_a_replay_checks_that_it_reproduced_the_outputs_it_was_given(monkeypatch):
    """`Recurrent.replaying` appends to its checks whether the replay's outputs are the ones it was given: True
    for what an ordinary call gave (and the same outputs and gradients as that call), False for others."""
    counts = count_fused_runs(monkeypatch)
    dtype = REPLAY_DTYPES[0].values[0]
    torch.manual_seed(0)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=6, bias=True, backend="triton").to(TRITON_DEVICE, dtype)
    x = (3.0 * torch.rand(7, 2, 6, dtype=dtype)).to(TRITON_DEVICE).requires_grad_()
    with torch.no_grad():
        right = layer(x)
    results = []
    for fed in (right, 1.0 - right, None):
        layer.reset()
        counts.update({"training forwards": 0, "replays": 0})
        checks = []
        with layer.replaying(None if fed is None else pack_spikes(fed), checks):
            out = layer(x)
        assert [bool(c) for c in checks] == {0: [True], 1: [False], 2: []}[len(results)]
        assert counts == ({"training forwards": 0, "replays": 1} if fed is not None else
                          {"training forwards": 1, "replays": 0})
        weights = torch.arange(7.0, dtype=dtype, device=TRITON_DEVICE).view(7, 1, 1)
        results.append((out.detach(), torch.autograd.grad((out * weights).sum(), [x, layer.weight, layer.bias])))
    (replayed, replayed_grads), _, (plain, plain_grads) = results
    assert 0 < plain.sum() < plain.numel() and torch.equal(replayed, plain)
    for a, b in zip(replayed_grads, plain_grads):
        assert max_rel_err(a, b) <= (F64 if dtype == torch.float64 else 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("hidden,batch", [(512, 32), (1024, 32), (256, 256)])
def test_a_replay_is_the_fused_forward_bit_for_bit_on_the_gpu(dtype, hidden, batch):
    """At the shapes of real layers (the fused kernels in slices of the hidden neurons), a replay's spikes, final
    states and gradients are exactly the fused forward's: its product runs in the forward's tiles."""
    torch.manual_seed(hidden + batch)
    layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True).to("cuda", dtype)
    with torch.no_grad():
        layer.weight.mul_(3.0)
    x = (1.2 * torch.rand(96, batch, hidden, dtype=dtype, device="cuda")).requires_grad_()
    weights = torch.randn(x.shape, dtype=dtype, device="cuda")
    with torch.no_grad():
        fed = layer(x)
    results, checks = [], []
    for replayed in (pack_spikes(fed), None):
        layer.reset()
        with layer.replaying(replayed, checks):
            out = layer(x)
        loss = (out * weights).sum() + layer.final_states["v"].sum()
        results.append((out, layer.final_states["v"], *torch.autograd.grad(loss, [x, layer.weight, layer.bias])))
    assert [bool(c) for c in checks] == [True] and 0 < fed.sum() < fed.numel()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_backward_whose_replays_came_out_otherwise_runs_again_without_them(monkeypatch):
    """Where a segment's replay does not reproduce the forward's spikes (here: made to read the wrong ones), the
    backward is done again with every segment re-running the fused forward: the gradients are the default path's."""
    from flexgen.layers import long_sequence as dense

    counts = count_fused_runs(monkeypatch)
    replayed = dense._replayed
    monkeypatch.setattr(dense, "_replayed", lambda kept: None if kept is None else replayed(kept) ^ 0xFF)
    dtype = REPLAY_DTYPES[0].values[0]
    long, plain = pair(cells("triton")["Recurrent LIF"], "triton", 3, TRITON_DEVICE, dtype)
    x = spikes((11, 2, 5), dtype=dtype, device=TRITON_DEVICE).requires_grad_()
    got = run_and_grad(long, x)
    assert counts == {"training forwards": 1 + 3, "replays": 3}  # the replays, then the segments again
    want = run_and_grad(plain, x)
    for a, b in zip(got[2], want[2]):
        assert max_rel_err(a, b) <= (F64 if dtype == torch.float64 else 1e-5)


def test_replaying_refuses_anything_but_the_calls_spikes_as_bits():
    layer = flexgen.Recurrent(flexgen.LIF, hidden=6, backend="triton").to(TRITON_DEVICE, REPLAY_DTYPES[0].values[0])
    x = torch.rand(5, 2, 6, dtype=layer.weight.dtype, device=TRITON_DEVICE, requires_grad=True)
    for sent in (torch.zeros(5, 2, 6, dtype=x.dtype, device=TRITON_DEVICE),  # spikes, not their bits
                 torch.zeros(4, 2, dtype=torch.uint8, device=TRITON_DEVICE)):  # the bits of 4 steps, not 5
        with pytest.raises(ValueError, match=r"replaying takes the spikes as bits, \[T, ceil\(B \* H / 8\)\] = "
                                             r"\[5, 2\] uint8"), layer.replaying(sent, []):
            layer(x)


def test_outputs_that_are_not_spikes_are_not_replayed(monkeypatch):
    """A cell that feeds back its membrane potential cannot keep it as bits: its segments re-run the fused forward,
    and the gradients are the default path's."""
    counts = count_fused_runs(monkeypatch)
    long, plain = pair(lambda: flexgen.Recurrent(graded, hidden=6, output_name="h", backend="triton"), "triton", 3,
                       TRITON_DEVICE, REPLAY_DTYPES[0].values[0])
    x = spikes((8, 2, 5), dtype=long.weight.dtype, device=TRITON_DEVICE).requires_grad_()
    got = run_and_grad(long, x)
    assert counts == {"training forwards": 3, "replays": 0}
    want = run_and_grad(plain, x)
    for a, b in zip(got[2], want[2]):
        assert max_rel_err(a, b) <= (F64 if a.dtype == torch.float64 else 1e-5)


def test_the_forward_keeps_the_fed_back_spikes_as_bits(monkeypatch):
    """Besides the input's bits and the checkpoints, a recurrent cell on the fused path keeps one bit per neuron
    and step of the segments before the last."""
    long, _ = pair(cells("triton")["Recurrent LIF"], "triton", 4, TRITON_DEVICE, REPLAY_DTYPES[0].values[0])
    x = spikes((64, 3, 5), dtype=long.weight.dtype, device=TRITON_DEVICE).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = long(x)
    bits = [tuple(t.shape) for t in saved if t.dtype == torch.uint8]
    assert bits == [(60, 2)] + [(4, 3)] * 15  # 15 bits (3 x 5) and 18 bits (3 x 6) per step, in whole bytes
    out.sum().backward()


def chains(every, backend="torch", device="cpu", dtype=torch.float64, delayed=False):
    """(chain with checkpoint_every, the same layers run one by one): LIF -> recurrent ALIF (its feedback through
    delay lines where `delayed`) -> PLIF per neuron."""
    def layers():
        torch.manual_seed(4)
        delay = flexgen.Delay(7, 4, delay=torch.linspace(0.0, 4.0, 7)) if delayed else None
        made = [flexgen.Dense(5, 6, flexgen.LIF, backend=backend),
                flexgen.Dense(6, 7, flexgen.Recurrent(flexgen.neurons.alif, hidden=7, backend=backend, tau=2.0,
                                                      tau_a=5.0, delay=delay)),
                flexgen.Dense(7, 4, flexgen.PLIF(per_channel=4, backend=backend))]
        with torch.no_grad():
            for layer in made:
                layer.weight.mul_(4.0)
        return made

    return (flexgen.Chain(*layers(), checkpoint_every=every).to(device, dtype),
            flexgen.Chain(*layers()).to(device, dtype))


@pytest.mark.parametrize("device,backend", device_backends())
@pytest.mark.parametrize("every", [1, 4, 11, 40])
@pytest.mark.parametrize("delayed", [False, True], ids=["", "delayed"])
def test_chain_long_sequence_path_equals_default(device, backend, every, delayed):
    long, plain = chains(every, backend, device, delayed=delayed)
    g = torch.Generator().manual_seed(2)
    x = (2.0 * torch.rand(11, 3, 5, generator=g, dtype=torch.float64)).to(device).requires_grad_()  # any values
    results = []
    for chain in (long, plain):
        out = chain(x)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype).to(device)
        loss = (out * w).sum() + sum(s.pow(2).sum() for layer in chain.layers for s in layer.final_states.values())
        loss = loss + chain.layers[1].final_output.sum() * 0.5
        results.append((out.detach(), torch.autograd.grad(loss, [x, *chain.parameters()])))
    (a, ga), (b, gb) = results
    assert 0 < b.sum() < b.numel(), "no spikes to compare"
    assert torch.equal(a, b)
    for u, v in zip(ga, gb):
        assert max_rel_err(u, v) <= F64


def test_chain_keeps_only_its_input_and_parameters():
    long, _ = chains(4)
    x = torch.rand(64, 3, 5, dtype=torch.float64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = long(x)
    assert saved[0] is x
    # besides the input: the parameters, the checkpoints ([3, 7] states) and the last segment's values (4 steps,
    # run with autograd in the forward; its input is a view of the caller's)
    one_segment = 4 * 3 * 7 * 8
    assert all(t.untyped_storage().nbytes() <= one_segment for t in saved[1:]
               if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr())
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_bad_chains():
    with pytest.raises(ValueError, match="at least one Dense layer"):
        flexgen.Chain()
    with pytest.raises(TypeError, match="layer 1 is Linear"):
        flexgen.Chain(flexgen.Dense(3, 2, flexgen.LIF), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="layer 0 gives 2 outputs, layer 1 takes 3 inputs"):
        flexgen.Chain(flexgen.Dense(3, 2, flexgen.LIF), flexgen.Dense(3, 2, flexgen.LIF))
    with pytest.raises(ValueError, match="checkpoint_every must be a positive number"):
        flexgen.Chain(flexgen.Dense(3, 2, flexgen.LIF), checkpoint_every=0)
    with pytest.raises(ValueError, match=r"takes inputs \[T, B, 3\]"):
        flexgen.Chain(flexgen.Dense(3, 2, flexgen.LIF), checkpoint_every=2)(torch.zeros(4, 1, 2))


@pytest.mark.parametrize("chained", [False, True])
def test_nothing_of_a_segment_outlives_the_backward(chained):
    """The re-run segments' tensors (here the input rebuilt from bits, [16, 2, 5]) are gone once the backward ends,
    and the recurrent cell reports where the whole call ended, not where a re-run segment did."""
    import gc

    def make(n_in):
        return flexgen.Dense(n_in, 5, flexgen.Recurrent(flexgen.LIF, hidden=5, backend="torch"),
                             checkpoint_every=None if chained else 16)

    layers = [make(7), make(5)]
    model = flexgen.Chain(*layers, checkpoint_every=16 if chained else None)
    x = spikes((40, 2, 7), dtype=torch.float32).requires_grad_()
    model(x).sum().backward()
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on every live object touches deprecated module attributes too
        warnings.simplefilter("ignore")
        live = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    segment_sized = [t for t in live if t.shape in ((16, 2, 5), (16, 10))]
    assert segment_sized == []
    for layer in layers:
        assert layer.cell.final_output is layer.final_output
        assert all(layer.cell.final_states[k] is v for k, v in layer.final_states.items())


def test_the_backward_hands_the_segments_the_loss_gradient_as_it_is(monkeypatch):
    """The last segment's outputs are placed into the function's output without autograd's in-place copy, which
    would hand the function a new [T, ...] gradient (the output's size) in place of the loss's own: here the
    expanded gradient of a sum, which holds one number."""
    from flexgen.layers import long_sequence as dense

    received = []
    backward = dense._Segments.backward

    def spy(ctx, *grads):
        received.append(grads[0])
        return backward(ctx, *grads)

    monkeypatch.setattr(dense._Segments, "backward", staticmethod(spy))
    long, plain = pair(cells("torch")["Recurrent ALIF"], "torch", 4)
    x = spikes((18, 2, 5)).requires_grad_()
    long(x).sum().backward()
    (grad,) = received
    assert grad.shape == (18, 2, 6) and grad.stride() == (0, 0, 0)
    y = x.detach().clone().requires_grad_()
    plain(y).sum().backward()
    assert max_rel_err(x.grad, y.grad) <= F64


def test_the_last_segment_runs_on_a_copy_the_function_hands_over(monkeypatch):
    """The last segment's input comes out of the long-sequence function (its gradient goes back through it into
    the input's), not as a slice of the input: a slice would keep the caller's whole input alive and make autograd
    build a [T, ...] gradient of zeros around the slice's."""
    from flexgen.layers import long_sequence as dense

    inputs = []
    run_segment = dense._run_segment

    def spy(plan, x, params, runs, sent=None, checks=None):
        inputs.append(x)
        return run_segment(plan, x, params, runs, sent, checks)

    monkeypatch.setattr(dense, "_run_segment", spy)
    long, plain = pair(cells("torch")["LIF class"], "torch", 4)
    x = spikes((18, 2, 5)).requires_grad_()
    long(x).sum().backward()
    (last,) = [t for t in inputs if t.shape[0] == 2]  # 18 steps: four segments of 4 re-run, the last of 2
    assert type(last.grad_fn).__name__ == "_SegmentsBackward" and last._base is None
    y = x.detach().clone().requires_grad_()
    plain(y).sum().backward()
    assert max_rel_err(x.grad, y.grad) <= F64


def segments_node(tensor):
    """The long-sequence autograd function's node in `tensor`'s graph."""
    todo, seen = [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if type(node).__name__ == "_SegmentsBackward":
            return node
        seen.add(node)
        todo += [next_node for next_node, _ in node.next_functions]
    raise AssertionError("no _Segments node in the graph")


def test_the_checkpoints_are_freed_by_the_backward_unless_the_graph_is_retained():
    long, _ = pair(cells("torch")["Recurrent ALIF"], "torch", 3)
    x = spikes((10, 2, 5)).requires_grad_()
    out = long(x)
    node = segments_node(long.final_states["v"])  # lives as long as the layer's final states
    n_params = len(list(long.parameters()))
    # bits, parameters, and the starts of the second and third segments (v, a, output); the fourth and last one
    # keeps its own graph from the forward
    assert len(node.saved_tensors) == 1 + n_params + 2 * 3
    out.sum().backward(retain_graph=True)
    first, x.grad = x.grad, None
    out.sum().backward()
    assert torch.equal(x.grad, first)
    with pytest.raises(RuntimeError, match="freed"):
        node.saved_tensors
    from flexgen.launch.autograd import FREED_GRAPH
    with pytest.raises(RuntimeError, match="second time") as info:
        out.sum().backward()
    assert str(info.value) == FREED_GRAPH


def test_the_current_is_f_linears_with_the_bias_added_apart():
    g = torch.Generator().manual_seed(3)
    x, weight, bias = (torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_()
                       for shape in ((7, 3, 5), (4, 5), (4,)))
    ours, theirs = projected(x, weight, bias), torch.nn.functional.linear(x, weight, bias)
    assert max_rel_err(ours, theirs) < F64
    grad = torch.randn(7, 3, 4, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(ours, (x, weight, bias), grad),
                    torch.autograd.grad(theirs, (x, weight, bias), grad)):
        assert max_rel_err(a, b) < F64
    assert torch.equal(projected(x, weight, None), torch.nn.functional.linear(x, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert projected(x.float(), weight.float(), bias.float()).dtype == torch.bfloat16


@pytest.mark.gpu
def test_a_dense_layers_bias_gradient_keeps_no_sum_buffer():
    """F.linear's bias gradient (a sum over T B rows at once) staged a buffer of twice the gradient, up to 132 MiB
    (docs/perf/h100/dense_bias_probe_2026-11-27.log); the bias now costs the step a [B, out] sum at most."""
    x = spikes((1000, 32, 700), p=0.1, dtype=torch.float32, device="cuda")

    def peak(bias):
        layer = flexgen.Dense(700, 512, flexgen.LIF, bias=bias).cuda()
        layer(x).sum().backward()  # the first call compiles
        return cuda_peak_bytes(lambda: layer(x).sum().backward())

    assert peak(True) - peak(False) < 4 * 2 ** 20


def test_a_backend_that_a_configured_cell_would_ignore_is_refused():
    with pytest.raises(ValueError, match=r"built with backend='auto'.*build it with backend='torch'"):
        flexgen.Dense(5, 6, flexgen.LIF(tau=2.0), backend="torch")
    with pytest.raises(ValueError, match=r"built with backend='c'"):
        flexgen.Dense(5, 6, flexgen.Recurrent(flexgen.LIF, hidden=6, backend="c"), backend="torch")
    layer = flexgen.Dense(5, 6, flexgen.LIF(tau=2.0, backend="torch"), backend="torch")  # the same: accepted
    layer(torch.rand(3, 2, 5))
    assert layer.last_run.backend == "torch"
