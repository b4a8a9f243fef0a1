"""What every backend module defines: a `Backend` (what it runs, why it cannot run a call), and the `Run` a layer
records of its last call."""
import os
from typing import Callable, NamedTuple, Optional, Tuple


def interpreter_on():
    """Whether Triton's interpreter runs kernels on CPU tensors (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class Backend(NamedTuple):
    """One backend. `kinds`: the layer kinds it runs ("neuron", "delayed", "recurrent", "eventprop"); `devices`: the device
    types of the tensors it runs; `dtypes`: the I/O dtypes, by name; `orders`: how many times its gradients can be
    differentiated (None: any); `generated`: whether it runs generated code. `why_not` (device, dtype) -> None, or
    the reason a call cannot run here, phrased to follow "backend='<name>'" in a message; `hint` (device) -> what
    to use instead."""

    name: str
    summary: str
    kinds: Tuple[str, ...]
    devices: Tuple[str, ...]
    dtypes: Tuple[str, ...]
    orders: Optional[int]
    generated: bool
    why_not: Callable
    hint: Callable

    def unavailable(self, device, dtype=None):
        """None where a call on `device` (of I/O `dtype`) can run here, else the reason."""
        return self.why_not(device, dtype)

    def refusal(self, device, reason):
        """The error text for a call this backend was asked for and cannot run."""
        return f"backend={self.name!r} {reason}; {self.hint(device)}"


class Run(NamedTuple):
    """What a layer's last call took: `backend` ("triton", "c", "torch" or "eager"; a `DelayedLinear`'s calls
    also "triton" or "torch") and `path`, the layer's own way of running it: a neuron layer's kernel design
    ("plain" or "recompute"), a recurrent layer's "fused" or "stepwise" (or "eager"), `Dense`/`Chain`'s
    "default" or "checkpointed", `DelayedLinear`'s "fused", "taps" or "conv", `EventPropDense`'s "exact" (a neuron linear between
    events) or "substeps"."""

    backend: str
    path: str
