"""The step function itself, run on tensors step by step (`flexgen.launch.eager`): no generated code, torch's
autograd through every operation, so its gradients can be differentiated again (a gradient penalty); the tests'
oracle."""
from .base import Backend


def _why_not(device, dtype):
    return None


def _hint(device):
    return "use backend='auto'"


BACKEND = Backend(
    name="eager", summary="the step function on tensors, step by step (any device; higher-order gradients)",
    kinds=("neuron", "delayed", "recurrent"), devices=("cpu", "cuda"),
    dtypes=("float16", "bfloat16", "float32", "float64"), orders=None, generated=False, why_not=_why_not,
    hint=_hint)
