"""The generated torch code (`torch_forward`/`torch_backward` of the generated module, `flexgen.launch.torch_path`):
runs anywhere torch does, and is what torch.func traces on the CPU (torch.compile keeps the C kernels where they
run); for an EventProp layer, the torch reference (`flexgen.launch.eventprop`)."""
from .base import Backend


def _why_not(device, dtype):
    return None


def _hint(device):
    return "use backend='auto'"


BACKEND = Backend(
    name="torch", summary="generated torch code (any device)", kinds=("neuron", "delayed", "recurrent", "eventprop"),
    devices=("cpu", "cuda"), dtypes=("float16", "bfloat16", "float32", "float64"), orders=1, generated=True,
    why_not=_why_not, hint=_hint)
