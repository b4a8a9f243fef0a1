"""The surrogate gradients for `flexgen.spike`, by their public name: `flexgen.surrogate.Sigmoid`, ... (they are
defined in the front end, `flexgen.frontend.surrogate`)."""
from .frontend.surrogate import *  # noqa: F401,F403 (the public names, as the front end's __all__ lists them)
from .frontend.surrogate import __all__  # noqa: F401
