"""Every layer kind under torch.distributed: 2 CPU processes with gloo, wrapped in DistributedDataParallel or FSDP2
(`fully_shard`), train like one process on the whole batch.

One spawned run per wrapper checks every layer kind on the torch and C backends (`MODELS` x `BACKENDS`) and sends
back numbers; the tests below assert on them, one test per layer kind and property:

* gradients: each rank takes its half of the batch; the averaged gradients equal one process's on the whole
  batch (float64, within 1e-12);
* states: each rank's layers keep the states of its own half ([B / 2, ...]), equal to that half of the one-process
  run's (the ranks' halves differ, so nothing is shared or broadcast);
* compiled: the wrapped model under `torch.compile` (aot_eager: no C++ build in CI) gives the same gradients;
* accumulation: two micro-batches, the first without gradient synchronisation (DDP's `no_sync()`, FSDP2's
  `set_requires_gradient_sync(False)`), give one process's gradients of both batches.

Each run also builds the kernels of both ranks into one fresh cache at once. The NCCL variant (`gpu`) runs the
Triton paths: the fused recurrent kernels, a checkpointed `Dense` and `DelayedLinear`'s fused kernels.
"""
import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist

from conftest import HAS_C_COMPILER
from ranks import GLOO, run_ranks

T, BATCH, FEATURES = 6, 8, 5
BACKENDS = ("torch", "c") if HAS_C_COMPILER else ("torch",)
MODELS = ("neuron", "ode", "recurrent", "dense", "chain", "delay", "delayed_linear", "synapse_delay")
try:
    from torch.distributed.fsdp import fully_shard  # torch >= 2.6
except ImportError:  # pragma: no cover (older torch)
    fully_shard = None
WRAPPERS = ("ddp", pytest.param("fsdp2", marks=pytest.mark.skipif(fully_shard is None,
                                                                   reason="FSDP2 (fully_shard) needs torch >= 2.6")))
pytestmark = pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")


@functools.lru_cache(maxsize=None)
def specs():
    import flexgen

    @flexgen.neuron(states=("v",), learnable=("w",))
    def dist_plif(x, v, w=-0.2, v_th=0.9):
        h = v + (x - v) * flexgen.sigmoid(w)
        s = flexgen.spike(h - v_th)
        return s, h * (1.0 - s)

    @flexgen.ode(states=("v",), learnable=("tau",), method="exact")
    def dist_ode_lif(x, v, tau=3.0, v_th=0.8):
        return flexgen.Dynamics({"v": (x - v) / tau}, threshold=v - v_th, reset={"v": 0.0})

    return dist_plif, dist_ode_lif


def build(kind, backend, device="cpu", dtype=torch.float64):
    """A small float64 model of layer kind `kind` on `backend` ("torch" or "c"; "triton" on a GPU), [T, B, 5] ->
    [T, B, 3]."""
    import flexgen

    spec_plif, spec_ode = specs()
    # FSDP2 shards no 0-dim parameter: the learnable parameters are given as one-element tensors (docs/multi-gpu.md).
    plif = functools.partial(spec_plif, w=torch.tensor([-0.2]))
    ode_lif = functools.partial(spec_ode, tau=torch.tensor([3.0]))
    torch.manual_seed(0)
    linear = functools.partial(torch.nn.Linear, dtype=dtype)
    if kind == "neuron":
        model = torch.nn.Sequential(linear(5, 6), plif(backend=backend), linear(6, 3))
    elif kind == "ode":
        model = torch.nn.Sequential(linear(5, 6), ode_lif(backend=backend), linear(6, 3))
    elif kind == "recurrent":
        model = torch.nn.Sequential(linear(5, 6), flexgen.Recurrent(flexgen.LIF, 6, backend=backend, bias=True),
                                    linear(6, 3))
    elif kind == "dense":  # one Dense layer in the long-sequence mode, between other modules
        model = torch.nn.Sequential(flexgen.Dense(5, 6, plif(backend=backend), checkpoint_every=2),
                                    linear(6, 3))
    elif kind == "chain":
        # A configured layer or a Recurrent layer brings its own backend (Dense's backend= builds a cell from a spec).
        model = flexgen.Chain(flexgen.Dense(5, 6, flexgen.LIF(tau=2.0, backend=backend)),
                              flexgen.Dense(6, 3, flexgen.Recurrent(flexgen.LIF, 3, backend=backend)),
                              checkpoint_every=2)
    elif kind == "delay":  # a Delay layer, and a neuron layer's own delay line (in the C kernels on "c")
        model = torch.nn.Sequential(
            linear(5, 6), flexgen.Delay(6, max_delay=3, delay=torch.rand(6) * 3),
            plif(backend=backend, delay=flexgen.Delay(6, max_delay=2, delay=torch.rand(6) * 2)), linear(6, 3))
    elif kind == "delayed_linear":
        dl_backend = "fused" if backend == "triton" else "conv"
        model = torch.nn.Sequential(flexgen.DelayedLinear(5, 6, max_delay=3, backend=dl_backend),
                                    plif(backend=backend), linear(6, 3))
    elif kind == "synapse_delay":
        model = torch.nn.Sequential(
            linear(5, 6), flexgen.Recurrent(flexgen.LIF, 6, backend=backend, delay=flexgen.SynapseDelay(6, 2)),
            linear(6, 3))
    else:
        raise ValueError(kind)
    return model.to(device=device, dtype=dtype)


def batches(count, device="cpu", dtype=torch.float64):
    """`count` global batches: input spikes [T, BATCH, 5] (a checkpointed `Dense` takes spikes only) and targets."""
    g = torch.Generator().manual_seed(1)
    return [((torch.rand(T, BATCH, FEATURES, generator=g) < 0.5).to(device, dtype),
             torch.randn(BATCH, 3, generator=g, dtype=dtype).to(device)) for _ in range(count)]


def loss_of(model, x, y):
    import flexgen

    flexgen.reset(model)
    return torch.nn.functional.mse_loss(model(x).mean(0), y)


def kept_states(model):
    """Every state a layer of `model` keeps after a call, by module name and state name."""
    import flexgen

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, flexgen.NeuronModule):
            kept = module._states
        elif isinstance(module, (flexgen.Recurrent, flexgen.Dense)):
            kept = module.final_states
        else:
            continue
        found.update({f"{name.removeprefix('module.')}.{k}": v.detach() for k, v in kept.items()})
    return found


def runs(model):
    """{module name: (backend, path)} of what each flexgen layer's last call ran (`layer.last_run`)."""
    import flexgen

    kinds = (flexgen.NeuronModule, flexgen.Recurrent, flexgen.Dense, flexgen.DelayedLinear)
    return {name.removeprefix("module."): tuple(m.last_run) for name, m in model.named_modules()
            if isinstance(m, kinds) and m.last_run is not None}


def full_grads(model):
    """Each parameter's gradient by name, whole (an FSDP2 shard gathered), "module." of DDP left out."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name.removeprefix("module.")] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return grads


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def grad_errors(got, want):
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(rel_err(got[k], want[k]) for k in want)


def wrap(model, how, device_ids=None):
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    import flexgen

    # Each layer its own FSDP unit, as a real model is sharded, then the root; a Chain is one unit (it runs its
    # Dense layers' weights itself, without calling their forward: see test_chain_refuses_inner_units).
    if not isinstance(model, flexgen.Chain):
        for layer in model.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
    return fully_shard(model)


def inner_units_error(rank, world):
    """The error of a checkpointed Chain whose Dense layers are FSDP2 units of their own."""
    model = build("chain", "torch")
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    x, y = batches(1)[0]
    try:
        loss_of(model, x[:, :BATCH // world], y[:BATCH // world])
    except RuntimeError as exc:
        return str(exc)
    return None


def no_sync(model, how):
    if how == "ddp":
        return model.no_sync()
    model.set_requires_gradient_sync(False)
    return _resync(model)


class _resync:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        return self.model

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def check_kind(rank, world, kind, backend, how, compile_too, device="cpu", device_ids=None):
    """The numbers the tests assert on, for one layer kind on one backend (see the module)."""
    share = BATCH // world
    own = slice(rank * share, (rank + 1) * share)
    (x, y), (x2, y2) = batches(2, device)
    single = build(kind, backend, device)
    model = wrap(copy.deepcopy(single), how, device_ids)
    result = {}

    def one_process(*pairs):
        single.zero_grad()
        for xi, yi in pairs:
            loss_of(single, xi, yi).backward()
        return {k: p.grad.clone() for k, p in single.named_parameters()}

    want = one_process((x, y))
    want_states = kept_states(single)
    loss_of(model, x[:, own], y[own]).backward()
    result["grad_err"] = grad_errors(full_grads(model), want)
    got_states = kept_states(model)
    assert got_states.keys() == want_states.keys() and want_states, (sorted(got_states), sorted(want_states))
    result["state_shapes_ok"] = all(v.shape[0] == share for v in got_states.values())
    result["state_err"] = max(rel_err(got_states[k], want_states[k][own]) for k in want_states)
    result["runs"] = runs(model)
    result["states_differ"] = any(not torch.equal(want_states[k][:share], want_states[k][share:2 * share])
                                  for k in want_states)

    model.zero_grad()
    with no_sync(model, how):
        (loss_of(model, x[:, own], y[own])).backward()
    if how == "ddp":  # not synchronised yet: each rank holds the gradients of its own half
        result["unsynced_err"] = grad_errors(full_grads(model), one_process((x[:, own], y[own])))
    loss_of(model, x2[:, own], y2[own]).backward()
    result["no_sync_err"] = grad_errors(full_grads(model), one_process((x, y), (x2, y2)))

    if compile_too:
        compiled = torch.compile(model, backend="aot_eager")
        model.zero_grad()
        loss_of(compiled, x[:, own], y[own]).backward()
        result["compiled_err"] = grad_errors(full_grads(model), want)
        torch._dynamo.reset()
    return result


def check_all(rank, world, kinds, backends):
    """{(wrapper, kind, backend): numbers} for both wrappers; one spawned run."""
    found = {}
    for how in ("ddp", "fsdp2") if fully_shard is not None else ("ddp",):
        for kind in kinds:
            for backend in backends:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    # Compiled, the layers run the generated torch code (the C target runs outside torch.compile).
                    found[how, kind, backend] = check_kind(rank, world, kind, backend, how, backend == "torch")
                found[how, kind, backend]["views"] = {
                    str(w.message).split("(")[1].split(")")[0] for w in caught
                    if "returned a view tensor" in str(w.message)}
    if fully_shard is not None:
        found["fsdp2", "inner units"] = inner_units_error(rank, world)
    return found


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """how -> each rank's {(kind, backend): numbers}, one spawned run per wrapper for the whole module."""
    runs = []

    def results(how):
        if not runs:
            runs.append(run_ranks(check_all, tmp_path_factory.mktemp("ranks"), MODELS, BACKENDS, timeout=900))
        return [{key[1] if len(key) == 2 else key[1:]: numbers for key, numbers in rank.items() if key[0] == how}
                for rank in runs[0]]

    return results


CASES = [(kind, backend) for kind in MODELS for backend in BACKENDS]


@pytest.mark.parametrize("how", WRAPPERS)
@pytest.mark.parametrize("kind,backend", CASES)
def test_gradients_equal_one_process_on_the_whole_batch(distributed, how, kind, backend):
    for rank in distributed(how):
        assert rank[kind, backend]["grad_err"] <= 1e-12


@pytest.mark.parametrize("how", WRAPPERS)
@pytest.mark.parametrize("kind,backend", CASES)
def test_the_layers_ran_on_the_backend_asked_for(distributed, how, kind, backend):
    """What the other tests compare ran where they say: the C target's kernels, or the generated torch code
    (DelayedLinear's convolution is torch's on the CPU)."""
    for rank in distributed(how):
        found = rank[kind, backend]["runs"]
        assert found, kind
        for name, (ran, path) in found.items():
            assert ran == ("torch" if path == "conv" else backend), (name, ran, path)


@pytest.mark.parametrize("how", WRAPPERS)
@pytest.mark.parametrize("kind,backend", CASES)
def test_each_rank_keeps_the_states_of_its_own_half(distributed, how, kind, backend):
    for rank in distributed(how):
        numbers = rank[kind, backend]
        assert numbers["state_shapes_ok"] and numbers["state_err"] <= 1e-12 and numbers["states_differ"]


@pytest.mark.parametrize("how", WRAPPERS)
@pytest.mark.parametrize("kind,backend", CASES)
def test_compiled_model_gives_the_same_gradients(distributed, how, kind, backend):
    if backend != "torch":
        pytest.skip("compiled, the layers run the generated torch code (the C target runs outside torch.compile)")
    for rank in distributed(how):
        assert rank[kind, backend]["compiled_err"] <= 1e-12


@pytest.mark.parametrize("how", WRAPPERS)
@pytest.mark.parametrize("kind,backend", CASES)
def test_accumulation_without_sync_equals_one_process(distributed, how, kind, backend):
    for rank in distributed(how):
        assert rank[kind, backend]["no_sync_err"] <= 1e-12
        if how == "ddp":
            assert rank[kind, backend]["unsynced_err"] <= 1e-12


@pytest.mark.skipif(fully_shard is None, reason="FSDP2 (fully_shard) needs torch >= 2.6")
def test_chain_refuses_inner_units(distributed):
    """FSDP2 gathers a unit's parameters when its forward runs; a checkpointed Chain reads its layers' weights
    itself, so sharding a Dense layer inside it on its own must fail with a message that says what to do."""
    for rank in distributed("fsdp2"):
        message = rank["inner units"]
        assert message is not None and "still sharded" in message and "Apply fully_shard to the Chain" in message


@pytest.mark.skipif(fully_shard is None, reason="FSDP2 (fully_shard) needs torch >= 2.6")
@pytest.mark.parametrize("kind,backend", CASES)
def test_fsdp2_sees_no_view_from_delayed_linear_or_the_c_target(distributed, kind, backend):
    """FSDP2 (torch 2.13) warns when a unit returns a view: an in-place change of it would skip the hook that
    gathers the parameters for the backward. DelayedLinear and the C target's neuron kernels return tensors of
    their own (at no copy); torch.nn.Linear on [T, B, F] inputs and the generated torch code return views."""
    for rank in distributed("fsdp2"):
        views = rank[kind, backend]["views"]
        assert "FSDPDelayedLinear" not in views
        if backend == "c":
            assert "FSDPNeuronModule" not in views


GPU_MODELS = ("recurrent", "dense", "chain", "delayed_linear")  # the fused recurrent kernels, checkpointed Dense
# (fused recurrent cell in the Chain), DelayedLinear's fused kernels


def check_gpus(rank, world):
    wrappers = ("ddp", "fsdp2") if fully_shard is not None else ("ddp",)
    return {(how, kind): check_kind(rank, world, kind, "triton", how, True, device=f"cuda:{rank}",
                                    device_ids=[rank] if how == "ddp" else None)
            for how in wrappers for kind in GPU_MODELS}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
def test_nccl_two_gpus_match_one_gpu(tmp_path):
    """The Triton paths on 2 GPUs (float64): gradients, per-rank states, accumulation and compiled gradients as on
    one GPU with the whole batch."""
    for numbers_of_rank in run_ranks(check_gpus, tmp_path, backend="nccl", timeout=600):
        for (how, kind), numbers in numbers_of_rank.items():
            where = f"{how}, {kind}"
            assert numbers["grad_err"] <= 1e-12, where
            assert numbers["no_sync_err"] <= 1e-12 and numbers["compiled_err"] <= 1e-12, where
            assert numbers["state_shapes_ok"] and numbers["state_err"] <= 1e-12 and numbers["states_differ"], where
            paths = {path for _, path in numbers["runs"].values()}
            want = {"recurrent": "fused", "dense": "checkpointed", "chain": "checkpointed",
                    "delayed_linear": "fused"}[kind]
            assert want in paths, (where, numbers["runs"])
