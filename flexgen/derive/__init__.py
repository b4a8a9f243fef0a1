"""Derive: per-step vector-Jacobian products by symbolic differentiation (`derivation`), which forward values the
backward reads (`partition`, a minimum vertex cut) and the rule behind every inlined value (`inlining`).

Takes a `Trace` from `flexgen.frontend.trace`; hands a `Derivation` to `flexgen.render`.
"""
