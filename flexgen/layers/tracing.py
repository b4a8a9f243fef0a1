"""How a layer's call meets the tools that trace it: torch.jit.trace is refused (`refuse_jit_trace`), and under
torch.compile the C target is made ready outside the trace (`c_prepared`), which then reads its ops as plain
attributes."""
import torch

from ..launch import c_path


def refuse_jit_trace(owner):
    """A clear error under torch.jit.trace, which records a flexgen layer's call wrongly: not the C kernels' work
    (ctypes calls it cannot see, so the traced module returns uninitialised memory), and the time loops of the
    torch path and of a recurrent layer for the traced number of steps only."""
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{owner}: torch.jit.trace cannot record a flexgen layer (it would miss the C kernels' work and fix the "
            "number of steps to the traced input's, giving wrong values silently); export the model with "
            "torch.export instead: flexgen.export_model(model, args) keeps the kernels as custom ops and the "
            "number of steps symbolic (docs: Deploying)")


def c_prepared(compiled):
    """What `NeuronCall.c_builds` says, for a call torch.compile traces: the C library and both designs' C ops are
    loaded here, run outside the trace (its result a constant of the graph), so the trace reads them as plain
    attributes. None, or why the C kernels cannot run (a string)."""
    try:
        compiled.c_library
    except c_path.CompilerError as exc:
        return str(exc)
    for recompute in (False, True):
        compiled.c_ops_for(recompute)
    return None


# torch.compiler.assume_constant_result(c_prepared), which is this mark, without importing torch._dynamo (and with
# it sympy and Triton) into every process that builds a layer; tests/test_compile_cpu.py fails without it.
c_prepared._dynamo_marked_constant = True
