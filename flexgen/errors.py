"""Errors raised for neuron specifications the generator cannot accept."""


class SpecError(ValueError):
    """A neuron specification that flexgen cannot turn into kernels.

    The message names the construct and, where known, the file and line of the
    step function that used it. No code is generated for a spec that raises it.

    >>> import flexgen
    >>> try:
    ...     @flexgen.neuron(states=("v",))
    ...     def bad(x, v):
    ...         if x > v:
    ...             return x, v
    ...         return v, x
    ...     bad.trace()
    ... except flexgen.SpecError as e:
    ...     print("flexgen.where" in str(e))
    True
    """
