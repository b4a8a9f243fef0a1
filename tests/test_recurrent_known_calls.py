"""A Recurrent layer's known calls: a fused call is kept under the layer's call key, and later calls with that key
skip the checks and the launches' signatures (`KnownRecurrentCall`), from the initial states or continuing kept
ones. Anything the key holds that changes sends the call through the checks again."""
import contextlib
import copy
import pickle

import pytest
import torch

import flexgen
from conftest import count_calls
from flexgen.launch.recurrent.fused import RecurrentConfig
from test_recurrent import FUSED_DTYPE, TRITON_DEVICE, make_inputs, make_layer, needs_triton, run_and_grad

pytestmark = needs_triton


def fused_layer(name="alif", scale=False, path="fused"):
    return make_layer(name, "triton", path, hidden=6, scale=scale, dtype=FUSED_DTYPE)


def inputs_of(name="alif", batch=3, seed=3):
    return [x.detach().to(FUSED_DTYPE).requires_grad_() for x in make_inputs(name, (5, batch, 6), TRITON_DEVICE, seed)]


def count_checked_calls(monkeypatch, layer):
    """A list that grows by one for each call of `layer` that goes through its checks."""
    return count_calls(monkeypatch, layer, "_checked_forward")


def fresh_call(layer, inputs):
    """Outputs, final states, final output and the gradients of a random loss, from the initial states."""
    layer.reset()
    outputs, finals, grads = run_and_grad(layer, inputs)
    return [*outputs, *finals, layer.final_output, *[g for g in grads if g is not None]]


def assert_equal(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name,scale", [("alif", False), ("current_lif", True), ("adaptive_mix", False)])
def test_calls_after_the_first_skip_the_checks_and_give_its_results(monkeypatch, name, scale):
    layer = fused_layer(name, scale)
    inputs = inputs_of(name)
    checked = count_checked_calls(monkeypatch, layer)
    results = [fresh_call(layer, inputs) for _ in range(3)]
    assert len(checked) == 1 and len(layer._known_calls) == 1 and layer.path == "fused"
    assert results[0][0].sum() > 0, "no spikes: the comparison would not test the feedback"
    for got in results[1:]:
        assert_equal(got, results[0])


def test_inference_calls_are_known_apart_from_training_calls(monkeypatch):
    layer = fused_layer()
    inputs = inputs_of()
    checked = count_checked_calls(monkeypatch, layer)
    trained = fresh_call(layer, inputs)
    with torch.no_grad():
        inferred = []
        for _ in range(3):
            layer.reset()
            inferred.append(layer(*inputs))
    assert len(checked) == 2 and len(layer._known_calls) == 2
    assert all(torch.equal(out, trained[0]) for out in inferred)


TF32 = torch.backends.cuda.matmul.allow_tf32
OTHER_DTYPE = torch.float32 if FUSED_DTYPE == torch.float64 else torch.bfloat16


def _frozen_weight(layer, inputs, monkeypatch):
    layer.weight.requires_grad_(False)


def _other_tf32_setting(layer, inputs, monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = not TF32  # (restored by the test)


# What a call key holds, each changed after the layer knows a call: change(layer, inputs, monkeypatch) changes the
# layer and returns the inputs the call passes (None: the same).
CHANGES = {
    "grad mode": lambda layer, inputs, monkeypatch: None,  # the call runs under no_grad (NO_GRAD)
    "inputs need no gradient": lambda layer, inputs, monkeypatch: [x.detach() for x in inputs],
    "frozen weight": _frozen_weight,
    "no bias": lambda layer, inputs, monkeypatch: setattr(layer, "bias", None),
    "hyper-parameter": lambda layer, inputs, monkeypatch: layer.cell.hyper.__setitem__("tau", 3.0),
    "launch settings": lambda layer, inputs, monkeypatch: setattr(layer, "config", RecurrentConfig(num_warps=2)),
    "path": lambda layer, inputs, monkeypatch: setattr(layer, "requested_path", "stepwise"),
    "tf32": _other_tf32_setting,
    "input dtype": lambda layer, inputs, monkeypatch: [x.detach().to(OTHER_DTYPE).requires_grad_() for x in inputs],
    "batch": lambda layer, inputs, monkeypatch: [x[:, :2].detach().requires_grad_() for x in inputs],
    "input layout": lambda layer, inputs, monkeypatch: [
        x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_() for x in inputs],
}
NO_GRAD = {"grad mode"}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_call_whose_key_changed_goes_through_the_checks(monkeypatch, change):
    layer = fused_layer()
    twin = copy.deepcopy(layer)  # never called before the change: its call is a first one
    inputs = inputs_of()
    checked = count_checked_calls(monkeypatch, layer)
    fresh_call(layer, inputs), fresh_call(layer, inputs)
    assert len(checked) == 1
    results = []
    try:
        for target in (layer, twin):
            changed = CHANGES[change](target, inputs, monkeypatch) or inputs
            with torch.no_grad() if change in NO_GRAD else contextlib.nullcontext():
                target.reset()
                results.append([target(*changed), target.path])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = TF32
    assert len(checked) == 2
    (got, got_path), (want, want_path) = results
    assert got_path == want_path == ("stepwise" if change == "path" else "fused")
    assert torch.equal(got, want)


def test_bad_inputs_after_known_calls_get_the_checks_errors():
    layer = fused_layer()
    inputs = inputs_of()
    fresh_call(layer, inputs), fresh_call(layer, inputs)
    layer.reset()
    with pytest.raises(ValueError, match=r"a recurrent layer of 6 neurons takes inputs \[T, B, 6\]"):
        layer(inputs[0][..., :5])
    layer.reset()
    layer(inputs[0].detach())
    with pytest.raises(ValueError, match="whose batch had 3 rows; this call has 2"):
        layer(inputs[0][:, :2].detach())  # continues from the kept states


def test_calls_that_continue_the_kept_states_equal_one_call_after_known_calls():
    layer = fused_layer()
    x = inputs_of()[0].detach()
    with torch.no_grad():
        for _ in range(2):
            layer.reset()
            whole = layer(x)
        layer.reset()
        chunks = torch.cat([layer(x[:2]), layer(x[2:])])
    assert torch.equal(chunks, whole)
    assert whole.sum() > 0


def without_known_calls(monkeypatch, layer):
    monkeypatch.setattr(layer, "_call_key", lambda *args: None)


def run_in_chunks(monkeypatch, known):
    """Two sequences of truncated backpropagation's chunks: the first chunk starts from the initial states, the
    later ones continue the kept states and output (which carry the graph of the chunks before). The outputs and
    gradients of the first sequence (the second's are the same) and how many calls took the checks."""
    layer = fused_layer()
    if not known:
        without_known_calls(monkeypatch, layer)
    checked = count_checked_calls(monkeypatch, layer)
    x = inputs_of()[0].detach()
    x = torch.cat([x, x.flip(0)]).requires_grad_()  # 10 steps: 5 chunks of 2
    results = []
    for _ in range(2):
        layer.reset()
        out = torch.cat([layer(chunk) for chunk in x.split(2)])
        results.append([out, *torch.autograd.grad((out * x).sum(), [x, *layer.parameters()])])
    assert_equal(results[1], results[0])
    return results[0], len(checked)


def test_chunks_that_continue_the_kept_states_are_known_after_the_second(monkeypatch):
    known, n_known = run_in_chunks(monkeypatch, True)
    checked, n_checked = run_in_chunks(monkeypatch, False)
    assert (n_known, n_checked) == (2, 10)
    assert_equal(known, checked)
    assert known[0].sum() > 0


def test_one_step_a_call_streams_through_known_calls(monkeypatch):
    """`step_mode="s"`: a call per step, each after the first continuing the kept states and output."""
    streams = []
    for known in (True, False):
        layer = fused_layer()
        layer.step_mode = "s"
        if not known:
            without_known_calls(monkeypatch, layer)
        checked = count_checked_calls(monkeypatch, layer)
        x = inputs_of()[0].detach()
        with torch.no_grad():
            streams.append(torch.stack([layer(step) for step in x]))
        assert len(checked) == (2 if known else len(x))
    assert torch.equal(streams[0], streams[1]) and streams[0].sum() > 0


def test_given_states_are_known_unless_the_checks_change_them(monkeypatch):
    """States the checks pass on as they are ([B, H] in the inputs' dtype) make a known call; states they expand or
    cast never do, and every such call takes the checks."""
    layer = fused_layer()
    checked = count_checked_calls(monkeypatch, layer)
    x = inputs_of()[0].detach()
    n_states = len(layer.spec.signature.states)
    for shape, dtype, n_checked in (((3, 6), FUSED_DTYPE, 1), ((6,), FUSED_DTYPE, 3), ((3, 6), OTHER_DTYPE, 3)):
        checked.clear()
        states = [torch.full(shape, 0.3, dtype=dtype, device=TRITON_DEVICE) for _ in range(n_states)]
        with torch.no_grad():
            outs = [layer(x, states=states) for _ in range(3)]
        assert len(checked) == n_checked
        assert all(torch.equal(out, outs[0]) for out in outs)
    assert len(layer._known_calls) == 1


def test_kernels_that_did_not_fit_forget_the_known_calls(monkeypatch):
    from triton.runtime.errors import OutOfResources

    import flexgen.layers.recurrent_paths as recurrent

    layer = fused_layer(path="auto")
    inputs = inputs_of()
    fresh_call(layer, inputs)
    assert len(layer._known_calls) == 1
    fits = recurrent.run_fused

    def fits_three_rows(compiled, inputs, *args, **kwargs):
        if inputs[0].shape[1] != 3:
            raise OutOfResources(300000, 232448, "shared memory")
        return fits(compiled, inputs, *args, **kwargs)

    monkeypatch.setattr(recurrent, "run_fused", fits_three_rows)
    with pytest.warns(UserWarning, match="need more than the GPU has"):
        layer.reset()
        layer(*[x[:, :2] for x in inputs])
    assert layer._known_calls == {}
    fresh_call(layer, inputs)
    assert layer.path == "stepwise"  # the dtype did not fit: every call of it runs step by step now


def test_copies_and_pickles_do_not_take_the_known_calls():
    layer = fused_layer()
    inputs = inputs_of()
    want = fresh_call(layer, inputs)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert copied._known_calls == {} and len(layer._known_calls) == 1
        assert_equal(fresh_call(copied, inputs)[:3], want[:3])
        assert len(copied._known_calls) == 1


def test_a_layer_pickled_before_known_calls_existed_loads_and_runs():
    layer = fused_layer()
    state = layer.__getstate__()
    del state["_known_calls"]
    old = flexgen.Recurrent.__new__(flexgen.Recurrent)
    old.__setstate__(state)
    inputs = inputs_of()
    assert_equal(fresh_call(old, inputs), fresh_call(layer, inputs))
