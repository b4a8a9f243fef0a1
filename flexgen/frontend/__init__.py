"""The front end: what a user writes, turned into a spec the generator can trace.

`@flexgen.neuron` (`spec`) and `@flexgen.ode` (`ode_spec`, with `discretize` and `ode_step` deriving the step
from the equations), the math namespace a step is written in (`functions`, `symbolic`), the surrogate gradients
(`surrogate`), and what a spec may name and read (`names`, `hyper`, `captured`). `trace` runs the step on
symbols: the first stage of the pipeline, handing a `Trace` to `flexgen.derive`.
"""
