"""The generated Triton kernels: on CUDA tensors, or on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1,
set before Triton is imported). Runs `flexgen.launch.triton_path` (neuron kernels), `flexgen.launch.recurrent`
(the fused recurrent layer) and `flexgen.launch.delay` (DelayedLinear's kernels)."""
from .base import Backend, interpreter_on


def _why_not(device, dtype):
    if device.type == "cuda" or (device.type == "cpu" and interpreter_on()):
        return None
    return f"needs CUDA tensors (got {device.type})"


def _hint(device):
    if device.type == "cpu":
        from .. import c_path

        other = "backend='c' (the generated C kernels)" if c_path.available() else "backend='torch'"
        return f"on the CPU set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter, or use {other}"
    return "use backend='auto'"


BACKEND = Backend(
    name="triton", summary="generated Triton kernels (CUDA; CPU tensors in Triton's interpreter)",
    kinds=("neuron", "delayed", "recurrent"), devices=("cuda", "cpu"),
    dtypes=("float16", "bfloat16", "float32", "float64"), orders=1, generated=True, why_not=_why_not, hint=_hint)
