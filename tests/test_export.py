"""torch.export of models with flexgen layers (`flexgen.export_model`, `save_exported`, `load_exported`): the
exported program equals the eager model on the CPU (fp64: 1e-12, spikes equal), under gradients, no_grad and
inference_mode, with the number of steps symbolic where the layers allow it; a saved program loads in a fresh
process."""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

import flexgen
from flexgen import Dynamics, spike
from conftest import HAS_C_COMPILER

BACKENDS = ["torch"] + (["c"] if HAS_C_COMPILER else [])
CPU_DEFAULT = "c" if HAS_C_COMPILER else "torch"  # what backend="auto" runs on the CPU
MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = spike(h - v_th)
    return s, h * (1.0 - s)


@flexgen.ode(states=("v", "w"), method="exact")
def adaptive(x, v, w, tau=3.0, tau_w=5.0, v_th=0.8):
    return Dynamics({"v": (x - v - w) / tau, "w": -w / tau_w}, threshold=v - v_th, reset={"v": 0.0, "w": w + 0.2})


def models(backend):
    """name -> a function making the model, in fp64, [T, 2, 5] in."""
    dense = lambda n_in, n_out: flexgen.Dense(n_in, n_out, flexgen.LIF, backend=backend)  # noqa: E731
    return {
        "lif": lambda: lif(tau=3.0, backend=backend),
        "ode": lambda: adaptive(backend=backend),
        "recurrent": lambda: flexgen.Recurrent(lif, hidden=5, backend=backend),
        "dense": lambda: dense(5, 4),
        "chain": lambda: flexgen.Chain(dense(5, 4), dense(4, 3)),
        "chain_checkpointed": lambda: flexgen.Chain(dense(5, 4), dense(4, 3), checkpoint_every=2),
        "delayed_linear": lambda: torch.nn.Sequential(flexgen.DelayedLinear(5, 4, max_delay=3, backend="conv"),
                                                      lif(backend=backend)),
        "delay": lambda: lif(delay=flexgen.Delay(5, 3, delay=torch.tensor([0.0, 1.0, 2.5, 3.0, 1.5])),
                             backend=backend),
    }


def make(name, backend, seed=0):
    torch.manual_seed(seed)
    model = models(backend)[name]().double()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("weight"):
                p.mul_(4)  # stronger currents: every layer of a chain fires
    return model


def close(a, b):
    """Spikes equal, other values within 1e-12."""
    a, b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        assert u.shape == v.shape and u.dtype == v.dtype
        torch.testing.assert_close(u, v, rtol=0, atol=1e-12)


def inputs(T, seed=1):
    return torch.randn(T, 2, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(models("torch")))
def test_exported_program_equals_eager(name, mode, backend=CPU_DEFAULT):
    model = make(name, backend)
    x = inputs(6)
    with MODES[mode]():
        program = flexgen.export_model(model, (x,))
        flexgen.reset(model)
        expected = model(x)
        got = program.module()(x)
    close(got, expected)
    assert expected.abs().sum() > 0  # something fired (the comparison sees spikes)
    assert flexgen.interop.export.flexgen_ops(program)  # the kernels run inside the program, not a trace of them


@pytest.mark.parametrize("name", ["lif", "recurrent", "chain_checkpointed"])
def test_exported_program_equals_eager_on_the_torch_path(name):
    test_exported_program_equals_eager(name, "grad", backend="torch")


@pytest.mark.parametrize("name", ["lif", "ode", "dense", "chain_checkpointed", "delayed_linear", "delay"])
def test_the_number_of_steps_is_symbolic(name):
    model = make(name, CPU_DEFAULT)
    program = flexgen.export_model(model, (inputs(6),))
    for T in (4, 9):
        x = inputs(T, seed=T)
        flexgen.reset(model)
        close(program.module()(x), model(x))


def test_a_recurrent_program_holds_its_steps_and_refuses_another_length():
    """On the CPU a recurrent layer runs its steps one by one: the program holds T of them, and says so when
    called with another T (torch's check of the input's shape), never computing a wrong length."""
    model = make("recurrent", "torch")
    program = flexgen.export_model(model, (inputs(6),))
    with pytest.raises(Exception, match=r"size\(\)\[0\] == 6|shape\[0\].*6"):
        program.module()(inputs(7))


def test_a_program_traced_without_gradients_refuses_a_backward():
    """Traced under no_grad, the program's ops keep nothing for a backward: a gradient through it is an error
    saying so, not a wrong value."""
    model = make("lif", "torch")
    with torch.no_grad():
        program = flexgen.export_model(model, (inputs(6),))
    x = inputs(6).requires_grad_()
    y = program.module()(x)  # the forward runs
    with pytest.raises(RuntimeError, match="no_grad"):
        y.sum().backward()


def test_export_leaves_earlier_states_out_of_the_program():
    model = make("lif", "torch")
    model(inputs(6) * 3)  # states left behind
    program = flexgen.export_model(model, (inputs(6),))
    close(program.module()(inputs(6, seed=3)), model(inputs(6, seed=3)))  # export reset the layer


LOAD = """
import sys, torch
import flexgen
if sys.argv[2] == "trust":  # an empty cache: refused without trust_kernels, loaded with it
    try:
        flexgen.load_exported(sys.argv[1])
        raise SystemExit("loaded without kernels")
    except LookupError as exc:
        assert "no kernels here for the op(s) flexgen::" in str(exc) and "trust_kernels=True" in str(exc), exc
program = flexgen.load_exported(sys.argv[1], trust_kernels=sys.argv[2] == "trust")
io = torch.load(sys.argv[3])
torch.testing.assert_close(program.module()(io["x"]), io["y"], rtol=0, atol=1e-12)
print("equal")
"""


def _run(args, cache):
    env = dict(os.environ, FLEXGEN_CACHE_DIR=str(cache))
    env.pop("TRITON_INTERPRET", None)  # the CPU paths alone: Triton is not imported
    root = os.path.dirname(os.path.dirname(os.path.abspath(flexgen.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", LOAD, *args], env=env, capture_output=True, text=True, timeout=300)


def test_a_saved_program_loads_in_a_fresh_process(tmp_path, backend=CPU_DEFAULT):
    """From this machine's kernel cache (the op names say which entries), or from the kernels the file carries
    (trust_kernels=True) where the cache lacks them; a clear error where neither has them."""
    model = make("chain", backend)
    x = inputs(6)
    program = flexgen.export_model(model, (x,))
    path, io = tmp_path / "model.pt2", tmp_path / "io.pt"
    flexgen.save_exported(program, str(path))
    torch.save({"x": inputs(8), "y": model(inputs(8))}, io)
    cache = os.environ["FLEXGEN_CACHE_DIR"]
    done = _run([str(path), "cache", str(io)], cache)
    assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-3000:]
    done = _run([str(path), "trust", str(io)], tmp_path / "empty-cache")
    assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-3000:]


def test_a_program_saved_by_torch_loads_from_the_cache(tmp_path):
    model = make("lif", "torch")
    program = flexgen.export_model(model, (inputs(6),))
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))  # no list of kernels: the cache alone
    close(flexgen.load_exported(str(path)).module()(inputs(8)), model(inputs(8)))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit itself is deprecated in newer torch
@pytest.mark.parametrize("name", ["lif", "recurrent", "dense", "chain", "delayed_linear", "delay"])
def test_jit_trace_is_refused_with_a_pointer_to_export(name):
    """torch.jit.trace would miss the C kernels' work (ctypes calls) and fix the time loops to the traced length:
    every flexgen layer refuses it, naming torch.export."""
    model = make(name, CPU_DEFAULT)
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace cannot record a flexgen layer.*export_model"):
        torch.jit.trace(model, (inputs(6),), check_trace=False)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_functional_call_refuses_jit_trace_too():
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace cannot record"):
        torch.jit.trace(lambda x: lif.apply(x)[0], (inputs(6),), check_trace=False)


AOTI_RUN = """
import sys, torch
runner = torch._inductor.aoti_load_package(sys.argv[1])
io = torch.load(sys.argv[2])
torch.testing.assert_close(runner(io["x"]), io["y"], rtol=0, atol=1e-12)
print("equal", "flexgen" in sys.modules)
"""


@pytest.mark.slow
def test_an_aot_inductor_package_runs_without_flexgen(tmp_path):
    """Where the ops are triton_ops (Triton importable: a GPU, or the interpreter as in these tests), AOTInductor
    compiles the torch path's loops (T fixed) into the package, which a process without flexgen runs; the C
    target's ops stay calls to Python custom ops, which such a process lacks (docs: Deploying)."""
    model = make("lif", "torch")
    program = flexgen.export_model(model, (inputs(6),), dynamic_steps=False)
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "model.pt2"))
    torch.save({"x": inputs(6, seed=5), "y": model(inputs(6, seed=5))}, tmp_path / "io.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", AOTI_RUN, path, str(tmp_path / "io.pt")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0 and "equal False" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lif", "dense", "recurrent"])
def test_exported_program_equals_eager_on_the_gpu(name):
    """On CUDA the ops are triton_ops running the Triton kernels (a recurrent layer's fused ones): the program
    equals eager, and a neuron layer's or Dense's number of steps stays a symbol."""
    model = make(name, "auto").cuda()
    x = inputs(6).cuda()
    with torch.no_grad():
        program = flexgen.export_model(model, (x,))
        for T in (6,) if name == "recurrent" else (6, 9):
            flexgen.reset(model)
            y = inputs(T, seed=T).cuda()
            close(program.module()(y), model(y))
