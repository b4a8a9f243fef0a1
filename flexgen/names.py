"""Which identifiers may reach generated code.

Spec names (inputs, states, parameters) are checked here; every other name in
a kernel is made by flexgen, from `NameAllocator`, so nothing a user writes can
collide with or break out of the code around it.
"""
import builtins
import keyword
import re

from .errors import SpecError

# Names the templates use around the step code.
FRAME_NAMES = frozenset(
    {
        "tl", "triton", "torch", "math", "libdevice",
        "pid", "offs", "mask", "step", "row", "n_steps", "n_elem", "BLOCK", "COMPUTE",
        "STATE_SEQS", "NEED", "out", "grads",
    }
)
_GENERATED = re.compile(r"^(grad_|acc_|partial_)|_(ptr|st|sn|seq|prev|next|buf)$")


def check_spec_name(name, role):
    """Raise SpecError unless `name` may be used as an input, state or parameter name."""
    if not isinstance(name, str) or not name.isidentifier():
        raise SpecError(f"{role} name {name!r} is not a valid Python identifier")
    if keyword.iskeyword(name) or name in dir(builtins):
        raise SpecError(f"{role} name {name!r} is a Python keyword or builtin; rename it")
    if name.startswith("_"):
        raise SpecError(f"{role} name {name!r} starts with an underscore, which flexgen keeps for itself")
    if name in FRAME_NAMES or _GENERATED.search(name):
        raise SpecError(
            f"{role} name {name!r} clashes with a name the generated kernels use "
            f"(reserved: {sorted(FRAME_NAMES)}, and names starting with grad_/acc_/partial_ "
            f"or ending in _ptr/_st/_sn/_seq/_prev/_next/_buf); rename it"
        )


def is_free_name(name):
    """True if a cosmetic name (a local variable of the step) can be used as is."""
    try:
        check_spec_name(name, "local")
    except SpecError:
        return False
    return True


class NameAllocator:
    """Hands out unique identifiers, never one already taken."""

    def __init__(self, taken=()):
        self.taken = set(taken)

    def take(self, name):
        if name in self.taken:
            raise SpecError(f"name {name!r} is used twice in the spec")
        self.taken.add(name)
        return name

    def fresh(self, stem):
        name, k = stem, 1
        while name in self.taken or keyword.iskeyword(name):
            name, k = f"{stem}{k}", k + 1
        self.taken.add(name)
        return name
