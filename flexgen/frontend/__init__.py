"""The front end: what a user writes, turned into a spec the generator can trace.

The equations of `@flexgen.ode` (`ode_system` traces them, `discretize` and `ode_step` derive the step from
them; the decorators themselves are in `flexgen.layers`), the math namespace a step is written in (`functions`,
`symbolic`), the surrogate gradients (`surrogate`), and what a spec may name and read (`names`, `hyper`,
`captured`). `trace` runs the step on symbols (`step_source` finds the step's line for its messages): the first
stage of the pipeline, handing a `Trace` to `flexgen.derive`.
"""
