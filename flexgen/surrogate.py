"""The surrogate gradients for `flexgen.spike`, by their public name: `flexgen.surrogate.Sigmoid`, ... (they are
defined in the front end, `flexgen.frontend.surrogate` and `flexgen.frontend.custom_surrogate`)."""
from .frontend.custom_surrogate import Custom  # noqa: F401
from .frontend.surrogate import *  # noqa: F401,F403 (the public names, as the front end's __all__ lists them)
from .frontend.surrogate import __all__ as _bundled

__all__ = [*_bundled, "Custom"]
