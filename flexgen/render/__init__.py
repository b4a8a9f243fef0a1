"""Render: the kernel ABI (`layout`: what the generated kernels read and write, in which order; `c_abi`: the C
target's parameter lists; `recurrent_abi`: a recurrent layer's), the contexts that print the derived programs with
`flexgen.printing` and fill the jinja2 frames of `templates/` (`contexts`; `flexgen.frames` finds the frames and
holds the environment that fills them).

Takes a `Derivation` from `flexgen.derive`; hands sources to `flexgen.cache` and `Layout`s to `flexgen.launch`.
"""
