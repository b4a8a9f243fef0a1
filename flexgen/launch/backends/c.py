"""The generated C kernels, compiled with the system's C compiler (`flexgen.launch.c_path`) and run on CPU
tensors: float32 and float64 as they are, float16 and bfloat16 through the float32 kernels; neuron layers (with
delay lines), a recurrent layer's steps and an EventProp layer (`flexgen.EventPropDense`, computed in float64).
Under torch.compile and torch.export too: the C ops are custom ops whose CPU kernel is the C launcher, traced
through fake kernels; not under torch.func's transforms, which trace the torch code."""
import torch

from .base import Backend


def _why_not(device, dtype):
    from .. import c_path

    if device.type != "cpu":
        return f"runs the generated C kernels on CPU tensors (got {device.type})"
    if dtype is not None and not c_path.takes(dtype):
        return f"the C kernels take float32, float64, float16 and bfloat16 (got {dtype})"
    if torch._C._are_functorch_transforms_active():
        return "torch.func's transforms trace the torch path, not the C kernels"
    return None


def _hint(device):
    return "use backend='auto' or 'triton' on the GPU" if device.type != "cpu" else "use backend='torch'"


def compiler_missing(reason):
    """Whether `reason` (from a layer's `c_builds`) says the C target cannot build here at all."""
    from .. import c_path

    return isinstance(reason, c_path.CompilerError)


BACKEND = Backend(
    name="c", summary="generated C kernels, compiled with the system's C compiler (CPU)",
    kinds=("neuron", "delayed", "recurrent", "eventprop"), devices=("cpu",), dtypes=("float16", "bfloat16", "float32", "float64"),
    orders=1, generated=True, why_not=_why_not, hint=_hint)
