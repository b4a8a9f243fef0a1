"""Derive: per-step vector-Jacobian products by symbolic differentiation (`derivation`), which forward values the
backward reads (`partition`, a minimum vertex cut, priced by `cost`), the rewrites of the derived programs
(`optimise`) and the programs each kernel prints (`programs`).

Takes a `Trace` from `flexgen.frontend.trace`; hands a `Derivation` to `flexgen.render`.
"""
