"""Hyper-parameter values as the kernels take them: one finite float per parameter and layer."""
import math
import numbers

import torch

from ..errors import SpecError


def describe_number(value):
    """`repr(value)`, short for an integer too long to print (10**400, 3**531441).

    >>> describe_number(2.5), describe_number(10**400)
    ('2.5', 'an integer of 1329 bits')
    """
    if isinstance(value, numbers.Integral) and int(value).bit_length() > 64:
        return f"an integer of {int(value).bit_length()} bits"
    return repr(value)


def hyper_value(name, value, owner=None):
    """`value`, given for the hyper-parameter `name`, as the float the kernels take; SpecError for a value a
    hyper-parameter cannot hold (a tensor that needs a gradient or holds several values, a string, a bool,
    a number beyond the float range). `owner`, the layer or neuron it was given to, starts the message.

    >>> hyper_value("tau", 2)
    2.0
    >>> hyper_value("tau", torch.tensor([2.0, 3.0]))
    Traceback (most recent call last):
    ...
    flexgen.errors.SpecError: hyper-parameter 'tau' was given a tensor of shape (2,); a hyper-parameter is one
    number for the whole layer. For one value per channel, declare it learnable
    (@flexgen.neuron(..., learnable=('tau',))) and build the layer with per_channel=C
    """
    prefix = f"{owner}: " if owner else ""
    if isinstance(value, torch.Tensor):
        value = _tensor_value(name, value, owner)
    if isinstance(value, (bool, str)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise SpecError(f"{prefix}hyper-parameter {name!r} must be a number, got {type(value).__name__} {value!r}")
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise SpecError(f"{prefix}hyper-parameter {name!r} is {describe_number(value)}; it must be a finite number "
                        "a float can hold")
    return result


def _tensor_value(name, value, owner):
    prefix = f"{owner}: " if owner else ""
    learnable = f"@flexgen.neuron(..., learnable=({name!r},))"
    # A layer class given the input where its first hyper-parameter goes: say how to call it.
    run_hint = f". To run a layer on a tensor, build the layer first: {owner}(...)(x)" if owner else ""
    if value.requires_grad:
        raise SpecError(
            f"{prefix}hyper-parameter {name!r} was given a tensor that requires grad; a hyper-parameter is a plain "
            f"number baked into each call, so it would get no gradient. To train it, declare it learnable "
            f"({learnable}): the layer then holds it as an nn.Parameter (one per channel with per_channel=C)"
        )
    if value.numel() != 1:
        raise SpecError(
            f"{prefix}hyper-parameter {name!r} was given a tensor of shape {tuple(value.shape)}; "
            f"a hyper-parameter is one number for the whole layer. For one value per channel, declare it "
            f"learnable ({learnable}) and build the layer with per_channel=C{run_hint}"
        )
    return value.item()
