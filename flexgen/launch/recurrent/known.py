"""A fused call a `Recurrent` layer has run, kept so that its later calls skip the layer's checks: the call's
kernels and autograd as `flexgen.launch.recurrent.fused` runs them, with every setting fixed once."""
from typing import NamedTuple, Optional

import torch

from ..scalars import cached_zero
from .fused import FusedRecurrentFunction, FusedRun, RecurrentCall, fused_forward


class KnownRecurrentCall(NamedTuple):
    """A fused call a `Recurrent` layer has run, kept under the layer's call key (the layer's `_call_key`): later
    calls with that key skip the layer's checks, which would pass again, and the launches' signatures
    (`run.plan_key` fixes their arguments but the tensors). `states`: the initial states (kept 0-d tensors), or
    None for calls that pass their own; `zero_bias`: what the kernels read as the bias of a layer without one;
    `reads_previous`: whether the kernels take the product of the output before the call (calls without `save`
    that continue from the layer's kept output, see `flexgen.layers.recurrent_feedback.previous_for_kernels`)."""

    run: FusedRun
    states: Optional[list]
    save: bool
    zero_bias: torch.Tensor
    reads_previous: bool = False

    def __call__(self, inputs, states, learnable, weight, bias, previous=None):
        """(outputs, final states), as `run_fused` gives them; `states` None for the initial ones; `weight` already in
        the inputs' dtype without `save` (the layer casts it once); `previous` the output the kernels take the first
        step's product of, where `reads_previous`."""
        run, bias = self.run, self.zero_bias if bias is None else bias
        states = self.states if states is None else states
        if not self.save:
            call = RecurrentCall(inputs, states, learnable, run.hyper, weight, bias, False, previous=previous)
            outputs, finals, _ = fused_forward(run.compiled, call, run.config, plan_key=run.plan_key)
            return outputs, finals
        result = FusedRecurrentFunction.apply(run, *inputs, *states, *learnable, weight, bias)
        n_out = len(result) - run.n_states
        return list(result[:n_out]), list(result[n_out:])


def known_call(compiled, key, inputs, states, learnable, hyper, save, config, reads_previous=False):
    """The `KnownRecurrentCall` of a fused call under the layer's `key`; `states`: the initial states (kept 0-d
    tensors), or None where the calls pass their own."""
    n_states = len(compiled.layout.layout.states)
    run = FusedRun(compiled, hyper, len(inputs), n_states, len(learnable), config, plan_key=key)
    return KnownRecurrentCall(run, None if states is None else list(states), save,
                              cached_zero(inputs[0].dtype, inputs[0].device), reads_previous)
