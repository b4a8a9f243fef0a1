"""A stream whose step is one kernel that stays on the GPU (`mode="persistent"`, `flexgen.streaming.persistent`).
On Triton's interpreter the kernel runs one program that takes a step and leaves (the same code but the polling):
it equals the model's multi-step call (fp64: spikes equal, states within 1e-12), products split or not, after a
reset and on its input written in place. On CUDA (marked gpu) the resident kernel equals the fused graphs to the
bit, leaves when idle without holding up `torch.cuda.synchronize()` and starts again at the next step."""
import time

import pytest
import torch

import flexgen
from conftest import HAS_CUDA, INTERPRETER
from flexgen.launch.recurrent.step import StepTiling
from flexgen.streaming.held import StreamError
from flexgen.streaming.persistent import PersistentPlan, kernel_source
from test_streaming_fused import NAMES, check, inputs, model

needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="CPU tensors on Triton's interpreter")
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRETER, reason="a resident kernel on a CUDA GPU")


def plan_of(layers, x, tiling=None, **options):
    return PersistentPlan(layers, {id(layers[k]): name for k, name in NAMES.items()}, x[0], one_step=True,
                          tiling=tiling, **options)


def in_place(plan, x_t):
    plan.input.copy_(x_t)
    return plan()


@needs_interpreter
@pytest.mark.parametrize("tiling", [None, StepTiling(16, 16, 2, k_split=3), StepTiling(1, 4, 2, k_split=3, cores=True)],
                         ids=["whole", "split", "cores"])
def test_the_persistent_kernel_equals_the_multi_step_call(tiling):
    x = inputs()
    plan = plan_of(model(), x, tiling)
    check(plan, model(), x)
    plan.reset()  # a new sequence: a fresh model's steps
    check(plan, model(), x)
    plan.reset()
    check(plan, model(), x, step=in_place)


@needs_interpreter
def test_a_persistent_stream_takes_host_steps_and_names_what_it_cannot_run():
    x = inputs()
    stream = flexgen.Stream(model(), x[0], mode="persistent", idle_timeout=0.5)
    assert stream.fused and "persistent" in repr(stream)
    got = torch.stack([stream(x[t]).clone() for t in range(x.shape[0])])
    with torch.no_grad():
        want = model()(x)
    assert want.sum() > 0 and torch.equal(got, want)
    assert stream.input.shape == x[0].shape and stream.input.device.type == "cpu"
    assert "def stream_persistent(" in stream.source() and "layer2_tile(" in stream.source()
    with pytest.raises(StreamError, match="made for steps"):
        stream(x[0, :2])
    with pytest.raises(StreamError, match="takes its steps from the host"):
        stream(torch.zeros_like(x[0], device="meta"))
    stream.close()
    with pytest.raises(StreamError, match="Linear/Recurrent pairs"):
        flexgen.Stream(torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.ReLU()).double().eval(), x[0],
                       mode="persistent")
    with flexgen.Stream(model(), x[0], mode="eager") as eager, pytest.raises(StreamError, match="no kernel of its own"):
        eager.source()
    with pytest.raises(ValueError, match="idle_timeout is for mode='persistent'"):
        flexgen.Stream(model(), x[0], mode="eager", idle_timeout=1.0)
    with pytest.raises(ValueError, match="positive number of seconds"):
        plan_of(model(), x, idle_timeout=0)


def test_a_persistent_stream_needs_a_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = inputs()
    with pytest.raises(StreamError, match="keeps a kernel running on a GPU"):
        flexgen.Stream(model(), x[0], mode="persistent")


@needs_interpreter
def test_the_kernel_source_calls_each_layers_tile_function_on_its_rows():
    """The rows that alternate: a layer's outputs go to row ps_row, its fed-back output is read from the other,
    the next layer's input is the layer before's row ps_row (through the Linear, or straight to the neuron)."""
    flat = " ".join(kernel_source(plan_of(model(), inputs()).units).split())
    assert "# layer1_tile = plif_step_recurrent_step_tile" in flat  # where each layer's step comes from
    for k in range(3):
        assert f"layer{k}_tile(" in flat
        assert f"l{k}_rec_previous_ptr + (1 - ps_row) * ps_n_batch * l{k}_n_hidden" in flat
        assert f"ps_counts_ptr + {k}, ps_target" in flat  # layer k waits for stage k: the input, or layer k - 1
    assert "l1_x_ptr + ps_row * ps_n_batch * l1_n_hidden" in flat  # layer 1 has no Linear: the neuron's input
    assert "l2_in_x_ptr + ps_row * ps_n_batch * l2_n_in" in flat  # layer 2's Linear reads layer 1's row
    assert "l0_in_x_ptr," in flat  # layer 0's Linear reads the step's input, copied from the host


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_resident_kernel_equals_the_fused_graphs(dtype):
    x = inputs("cuda", dtype, seed=4)
    graph = flexgen.Stream(model("cuda", dtype), x[0])
    stream = flexgen.Stream(model("cuda", dtype), x[0], mode="persistent", idle_timeout=0.3)
    try:
        for _ in range(2):  # a reset replays a fresh model
            for t in range(x.shape[0]):
                assert torch.equal(stream(x[t].cpu()), graph(x[t]).cpu())
            for name, kept in graph.states().items():
                for state, value in kept.items():
                    assert torch.equal(stream.states()[name][state], value), (name, state)
            stream.reset(), graph.reset()
        stream.input.copy_(x[2].cpu())  # a step on the pinned input written in place
        assert torch.equal(stream(), graph(x[2]).cpu())
    finally:
        stream.close(), graph.close()


@pytest.mark.gpu
@needs_cuda
def test_the_resident_kernel_leaves_when_idle_and_starts_again():
    x = inputs("cuda", torch.float32, seed=5)
    graph = flexgen.Stream(model("cuda", torch.float32), x[0])
    stream = flexgen.Stream(model("cuda", torch.float32), x[0], mode="persistent", idle_timeout=0.2)
    try:
        assert torch.equal(stream(x[0].cpu()), graph(x[0]).cpu())
        time.sleep(0.4)
        started = time.perf_counter()
        torch.cuda.synchronize()  # the kernel has left: nothing holds the device
        assert time.perf_counter() - started < 0.1
        for t in range(1, x.shape[0]):  # the next step starts it again, from the states it left
            assert torch.equal(stream(x[t].cpu()), graph(x[t]).cpu())
        stream.close()
        started = time.perf_counter()
        torch.cuda.synchronize()  # close ends it at once
        assert time.perf_counter() - started < 0.1
    finally:
        stream.close(), graph.close()


class _FakeKernel:
    """Stands in for the resident kernel on the host's side of the protocol: a thread that answers each new step
    word in the plan's pinned words, or (`idle_at`) leaves with IDLE instead of answering that step once, or
    (`silent`) never answers."""

    def __init__(self, plan, idle_at=None, silent=False):
        import threading

        self.plan, self.idle_at, self.silent, self.launches, self.threading = plan, idle_at, silent, [], threading
        self.thread = None

    def start_before(self, word):  # PersistentPlan._start_before's part: the words set, a kernel "launched"
        from flexgen.streaming import persistent

        previous = persistent.PersistentPlan._previous_word(word)
        self.plan._go.numpy()[0] = previous
        self.plan._done.numpy()[0] = previous
        self.launches.append(word)
        self.thread = self.threading.Thread(target=self.run, args=(previous,), daemon=True)
        self.thread.start()
        self.plan._running = True

    def run(self, seen):
        from flexgen.streaming import persistent

        go, done = self.plan._go.numpy(), self.plan._done.numpy()
        while True:
            word = int(go[0])
            if word == seen:
                time.sleep(1e-4)
                continue
            if word < 0:
                done[0] = word
                return
            if self.silent:
                return
            if self.idle_at is not None and len(self.launches) == 1 and word == self.idle_at:
                done[0] = persistent.IDLE  # left just as the word came
                return
            done[0] = word
            seen = word

    def synchronize(self):
        self.thread.join(5)


def _resident_on_the_host(fake_options, monkeypatch):
    x = inputs()
    plan = plan_of(model(), x)
    plan.one_step = False
    fake = _FakeKernel(plan, **fake_options)
    monkeypatch.setattr(plan, "_start_before", fake.start_before)
    plan._side = fake
    return plan, fake, x


@needs_interpreter
def test_the_host_relaunches_a_kernel_that_left_idle_and_the_step_is_answered(monkeypatch):
    plan, fake, x = _resident_on_the_host({}, monkeypatch)
    first = plan._word
    plan(x[0]), plan(x[1])
    assert len(fake.launches) == 1 and plan._done.numpy()[0] == plan._word != first
    plan.stop()  # the kernel asked to end (-1) and waited for
    assert plan._go.numpy()[0] == -1 and not plan._running
    plan, fake, x = _resident_on_the_host({"idle_at": None}, monkeypatch)
    plan(x[0])
    fake.idle_at = (plan._word // 2 + 1) * 2 + plan.done % 2  # the next step's word: the kernel leaves on it
    plan(x[1])
    assert len(fake.launches) == 2 and fake.launches[1] == plan._word  # launched again for that very step
    assert plan._done.numpy()[0] == plan._word
    plan.stop()


@needs_interpreter
def test_a_step_left_unanswered_ends_the_stream(monkeypatch):
    from flexgen.streaming import persistent

    monkeypatch.setattr(persistent, "NO_ANSWER_SECONDS", 0.2)
    plan, fake, x = _resident_on_the_host({"silent": True}, monkeypatch)
    with pytest.raises(StreamError, match="has not answered step word"):
        plan(x[0])
    assert plan._go.numpy()[0] == persistent.STOP and not plan._running
    with pytest.raises(StreamError, match="takes no more steps"):
        plan(x[1])
    assert len(fake.launches) == 1  # never a second kernel beside the first
