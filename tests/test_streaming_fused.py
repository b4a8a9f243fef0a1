"""A stream's fused plan (`flexgen.streaming.fused_plan`): each Recurrent layer, with the Linear before it, one
launch of its `step` kernel a step. On Triton's interpreter (CPU tensors, the launches uncaptured) and on CUDA (marked
gpu, captured as two CUDA graphs) it equals the model's multi-step call (fp64: spikes equal, states within 1e-12);
a reset replays a fresh model; in-place weight updates show; what the plan cannot run is named."""
import pytest
import torch

import flexgen
from conftest import HAS_CUDA, INTERPRETER
from flexgen.launch.recurrent.step import CORES_BATCH, StepTiling, step_tiling
from flexgen.streaming.fused_plan import FusedPlan, why_not

T, B = 5, 3
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="CPU tensors on Triton's interpreter")


def model(device="cpu", dtype=torch.float64, seed=0):
    """Linear -> Recurrent LIF (bias) -> Recurrent PLIF (no Linear before it, no bias) -> Linear without bias ->
    Recurrent LIF: weights strong enough that every layer spikes."""
    torch.manual_seed(seed)
    layers = torch.nn.Sequential(
        torch.nn.Linear(5, 6),
        flexgen.Recurrent(flexgen.LIF, hidden=6, bias=True, backend="triton"),
        flexgen.Recurrent(flexgen.PLIF, hidden=6, backend="triton", v_threshold=0.5),
        torch.nn.Linear(6, 4, bias=False),
        flexgen.Recurrent(flexgen.LIF, hidden=4, bias=True, backend="triton"),
    )
    with torch.no_grad():
        layers[0].weight.uniform_(0.0, 0.8)
        layers[1].weight.uniform_(-0.8, 0.5)
        layers[2].weight.uniform_(-0.6, 0.4)
        layers[3].weight.uniform_(0.3, 1.2)
        layers[4].weight.uniform_(-0.8, 0.5)
    return layers.to(device=device, dtype=dtype).eval()


NAMES = {1: "1", 2: "2", 4: "4"}


def plan_of(layers, x, capture=False, tiling=None):
    return FusedPlan(layers, {id(layers[k]): name for k, name in NAMES.items()}, x[0], capture=capture, tiling=tiling)


def multi_step(layers, x):
    with torch.no_grad():
        out = layers(x)
    return out, {name: {**layers[k].final_states, "output": layers[k].final_output} for k, name in NAMES.items()}


def in_place(plan, x_t):
    plan.x.copy_(x_t)
    return plan()


def check(plan, layers, x, steps=None, step=None):
    """The plan's steps from its current state equal the multi-step call of a fresh copy of `layers` (each step
    `step(plan, x[t])`, by default `plan(x[t])`)."""
    want, finals = multi_step(layers, x)
    step = step or (lambda p, x_t: p(x_t))
    got = torch.stack([step(plan, x[t]).clone() for t in range(x.shape[0])])
    assert want.sum() > 0 and torch.equal(got, want)
    for name, kept in plan.states().items():
        for state, value in kept.items():
            assert torch.allclose(value, finals[name][state], rtol=0, atol=1e-12), (name, state)


def inputs(device="cpu", dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(T, B, 5, generator=g, dtype=torch.float64) * 2.0).to(device=device, dtype=dtype)


@needs_interpreter
@pytest.mark.parametrize("tiling", [None, StepTiling(16, 16, 2, k_split=3), StepTiling(1, 4, 2, k_split=3, cores=True)],
                         ids=["whole", "split", "cores"])
def test_the_fused_plan_equals_the_multi_step_call(tiling):
    """Each tile's products in one program, or split between three (every third slice each; the last to
    arrive adds the shares): slices of 2 so that each has some of both products (the interpreter takes
    products narrower than a GPU's least); or split so and summed on CUDA cores, a tile of one batch row."""
    x = inputs()
    layers = model()
    assert why_not(layers, x[0]) is None
    plan = plan_of(layers, x, tiling=tiling)
    check(plan, model(), x)
    plan.reset()  # a reset starts a new sequence: the steps replay a fresh model's
    check(plan, model(), x)
    plan.reset()  # a step on the input written into the plan's buffer (no argument) is the same step
    check(plan, model(), x, step=in_place)


@needs_interpreter
def test_in_place_weight_updates_show_in_the_next_step():
    x = inputs()
    layers = model()
    plan = plan_of(layers, x)
    with torch.no_grad():
        layers[0].weight.mul_(1.5)
        layers[1].weight.add_(0.1)
    changed = model()
    with torch.no_grad():
        changed[0].weight.mul_(1.5)
        changed[1].weight.add_(0.1)
    check(plan, changed, x)


def test_narrow_fp32_batches_sum_their_products_on_cuda_cores():
    """The step's default tiles: fp32 batches of at most CORES_BATCH rows take CUDA-core products over their own
    rows (no padding to tl.dot's 16); wider batches and the other dtypes tl.dot, in tiles of at least 16 rows."""
    cpu = torch.device("cpu")
    for batch in range(1, CORES_BATCH + 1):
        tiling = step_tiling(batch, 512, 700, torch.float32, cpu)
        assert tiling.cores and tiling.block_b == batch
    wide = step_tiling(CORES_BATCH + 1, 512, 700, torch.float32, cpu)
    assert not wide.cores and wide.block_b == 16
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        tiling = step_tiling(1, 512, 700, dtype, cpu)
        assert not tiling.cores and tiling.block_b == 16


def test_the_fused_plan_names_what_it_cannot_run():
    x = inputs()[0]
    lif = lambda **kw: flexgen.Recurrent(flexgen.LIF, hidden=6, **kw)  # noqa: E731
    linear = torch.nn.Linear(5, 6)
    cases = {
        "has a delay": [linear, lif(delay=flexgen.Delay(6, max_delay=2))],
        "scales its recurrent current": [linear, lif(scale=True)],
        "two Linear layers in a row": [linear, torch.nn.Linear(6, 6), lif()],
        "ends with a Linear layer": [linear, lif(), torch.nn.Linear(6, 2)],
        "neither a Linear nor a Recurrent layer": [linear, torch.nn.ReLU(), lif()],
        "not the fused kernels": [linear, lif(backend="torch")],
        "has 6 neurons, its input 5 features": [lif()],
        "takes 6 features, its input has 5": [torch.nn.Linear(6, 6), lif()],
        "has 6 neurons, its input 4 features": [torch.nn.Linear(5, 4), lif()],
    }
    for why, mods in cases.items():
        assert why in why_not(torch.nn.Sequential(*mods).double(), x), why
    assert "[B, features]" in why_not(lif(), x[None])
    assert why_not(torch.nn.Sequential(linear, lif()).double(), x) is None


def _reference_stream(layers, x):
    return flexgen.Stream(layers, x[0], fuse=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="CUDA graphs")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_fused_graphs_equal_the_multi_step_call_on_cuda(dtype):
    x = inputs("cuda", dtype)
    layers = model("cuda", dtype)
    stream = flexgen.Stream(layers, x[0])
    assert stream.fused and "fused" in repr(stream)
    want, finals = multi_step(model("cuda", dtype), x)
    for _ in range(2):  # a reset replays a fresh model
        got = torch.stack([stream(x[t]).clone() for t in range(T)])
        assert want.sum() > 0 and torch.equal(got, want)
        if dtype == torch.float64:
            for name, kept in stream.states().items():
                for state, value in kept.items():
                    assert torch.allclose(value, finals[name][state], rtol=0, atol=1e-12), (name, state)
        stream.reset()
    stream.close()
    unfused = flexgen.Stream(layers, x[0], fuse=False)
    assert not unfused.fused
    unfused.close()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="CUDA graphs")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("tiling", [StepTiling(16, 16, 16, k_split=4), StepTiling(4, 16, 16, k_split=4, cores=True)],
                         ids=["tensor-cores", "cuda-cores"])
def test_split_products_in_captured_graphs_equal_the_multi_step_call(dtype, tiling):
    """Wider layers, each tile's products split between four programs (slices of 16, so each has some), summed
    with tl.dot or on CUDA cores."""
    torch.manual_seed(3)
    layers = torch.nn.Sequential(torch.nn.Linear(70, 48), flexgen.Recurrent(flexgen.LIF, hidden=48, bias=True),
                                 torch.nn.Linear(48, 40), flexgen.Recurrent(flexgen.LIF, hidden=40))
    with torch.no_grad():
        layers[0].weight.uniform_(0.0, 0.2)
        layers[1].weight.uniform_(-0.3, 0.2)
        layers[2].weight.uniform_(0.0, 0.3)
        layers[3].weight.uniform_(-0.3, 0.2)
    layers = layers.to(device="cuda", dtype=dtype).eval()
    x = torch.rand(8, B, 70, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = layers(x)
    plan = FusedPlan(layers, {}, x[0], capture=True, tiling=tiling)
    got = torch.stack([plan(x[t]).clone() for t in range(x.shape[0])])
    assert 0 < want.mean() < 1 and torch.equal(got, want)
