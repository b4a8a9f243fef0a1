"""Which identifiers may reach generated code.

Spec names (inputs, states, parameters) are checked here; every other name in
a kernel is made by flexgen, from `NameAllocator`, so nothing a user writes can
collide with or break out of the code around it.
"""
import builtins
import functools
import keyword
import re
import unicodedata

from ..errors import SpecError
from ..frames import template_sources

# The C target's reserved words that are not Python keywords, and the math functions its printer calls: a value
# of the step under one of these names would not compile as C.
C_NAMES = frozenset(
    {
        "auto", "case", "char", "const", "default", "do", "double", "enum", "extern", "float", "goto", "inline", "int",
        "long", "register", "restrict", "short", "signed", "sizeof", "static", "struct", "switch", "typedef", "union",
        "unsigned", "void", "volatile", "exp", "expf", "log", "logf", "sqrt", "fabs", "tanh", "atan",
        "flexgen_sigmoid", "int64_t", "scalar_t",
    }
)
# Names the templates use around the step code.
FRAME_NAMES = frozenset(
    {
        "tl", "triton", "torch", "math", "libdevice",
        "pid", "offs", "mask", "step", "row", "n_steps", "n_elem", "BLOCK", "COMPUTE",
        "STATE_SEQS", "NEED", "out", "grads",
    }
) | C_NAMES
_GENERATED = re.compile(r"^(grad_|acc_|partial_)|_(ptr|st|sn|seq|prev|next|buf|bcast|io|seen)$")

# The identifiers the kernel frames make from a name by its role (`render.forward_args`/`backward_args`,
# `render.recompute_layout` and the templates): `{}` is the name. Most end in a suffix that spec names may not
# end in (`_GENERATED`); the others (`_inner`, `_size`, `_chan`, `_ckpt`) are ordinary name endings, so a
# spec name that meets one of them is checked against the spec's own names (`check_derived_collisions`).
DERIVED_FORMS = {
    "input": {"{}_ptr": "pointer", "{}_st": "time stride", "{}_sn": "neuron stride", "{}_bcast": "broadcast flag",
              "{}_seq": "sequence"},
    "state": {"{}_ptr": "pointer", "{}_sn": "neuron stride", "{}_seq_ptr": "sequence pointer", "{}_seq": "sequence",
              "{}_ckpt": "recompute checkpoints", "{}_ckpt_ptr": "recompute checkpoints' pointer"},
    "learnable parameter": {"{}_ptr": "pointer", "{}_inner": "channel stride", "{}_size": "channel count",
                            "{}_chan": "per-channel flag", "acc_{}": "gradient accumulator",
                            "partial_{}_ptr": "partial gradients' pointer"},
    "value": {"{}_ptr": "pointer", "{}_seq": "sequence", "{}_buf": "saved copy", "{}_buf_ptr": "saved copy's pointer",
              "{}_io": "rounded copy", "{}_seen": "copy as stored"},
    "gradient": {"{}_ptr": "pointer", "{}_st": "time stride", "{}_sn": "neuron stride", "{}_bcast": "broadcast flag",
                 "{}_prev_ptr": "initial state's gradient pointer"},
}
_ALL_FORMS = sorted({form for forms in DERIVED_FORMS.values() for form in forms})


_JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", re.S)
# strings and comments of the Python frames, and the C frame's /* */ comments
_STRING_OR_COMMENT = re.compile(r'/\*.*?\*/|""".*?"""|\'\'\'.*?\'\'\'|"[^"\n]*"|\'[^\'\n]*\'|#[^\n]*', re.S)
# a variable, not an attribute (`.load`) or keyword argument (`mask=`)
_IDENTIFIER = re.compile(r"(?<![.\w])[A-Za-z_][A-Za-z0-9_]*\b(?!=[^=])")
MAX_NAME_LENGTH = 64


@functools.lru_cache(maxsize=None)
def template_names():
    """Every identifier the kernel templates write themselves (outside `{{ }}`/`{% %}`).

    A spec name equal to one of them could shadow the frame's own variables,
    so these are reserved along with FRAME_NAMES.
    """
    names = set()
    for text in template_sources().values():
        frame = _STRING_OR_COMMENT.sub(" ", _JINJA.sub(" 0 ", text))
        names.update(n for n in _IDENTIFIER.findall(frame) if not keyword.iskeyword(n))
    return frozenset(names)


def reserved_names():
    """Names a spec may not use: the templates' own identifiers and FRAME_NAMES."""
    return FRAME_NAMES | template_names()


def check_spec_name(name, role):
    """Raise SpecError unless `name` may be used as an input, state or parameter name.

    >>> check_spec_name("tau", "parameter")
    >>> check_spec_name("v; import os", "state")
    Traceback (most recent call last):
    ...
    flexgen.errors.SpecError: state name 'v; import os' is not a valid Python identifier
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise SpecError(f"{role} name {name!r} is not a valid Python identifier")
    if unicodedata.normalize("NFKC", name) != name:
        raise SpecError(f"{role} name {name!r} is not in Unicode normal form NFKC (Python would read it as "
                        f"{unicodedata.normalize('NFKC', name)!r}); write it in that form")
    if len(name) > MAX_NAME_LENGTH:
        raise SpecError(f"{role} name {name[:20]!r}... is longer than {MAX_NAME_LENGTH} characters")
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in dir(builtins):
        raise SpecError(f"{role} name {name!r} is a Python keyword or builtin; rename it")
    if name.startswith("_"):
        raise SpecError(f"{role} name {name!r} starts with an underscore, which flexgen keeps for itself")
    if name in reserved_names() or _GENERATED.search(name):
        raise SpecError(
            f"{role} name {name!r} clashes with a name the generated kernels use "
            f"(reserved: {sorted(reserved_names())}, and names starting with grad_/acc_/partial_ "
            f"or ending in _ptr/_st/_sn/_seq/_prev/_next/_buf/_bcast/_io/_seen); rename it"
        )


def derived_forms(names):
    """Every identifier a frame could make from any of `names` in any role: what flexgen's own names (node,
    gradient and helper names) must avoid, besides the names themselves.

    >>> sorted(derived_forms(["v"]))[:3]
    ['acc_v', 'partial_v_ptr', 'v_bcast']
    """
    return {form.format(name) for name in names for form in _ALL_FORMS}


def check_derived_collisions(roles, names):
    """SpecError if one of `names` (the spec's parameter names) is an identifier the frames make from another
    spec name; `roles` maps "input"/"state"/"learnable parameter" to the names in that role.

    >>> check_derived_collisions({"learnable parameter": ["a"]}, ["x", "a", "a_size"])
    Traceback (most recent call last):
    ...
    flexgen.errors.SpecError: parameter name 'a_size' is what the generated kernels call the channel count of the
    learnable parameter 'a'; rename one of them
    """
    derived = {}
    for role, role_names in roles.items():
        for owner in role_names:
            for form, meaning in DERIVED_FORMS[role].items():
                derived.setdefault(form.format(owner), (meaning, role, owner))
    for name in names:
        if name in derived:
            meaning, role, owner = derived[name]
            raise SpecError(f"parameter name {name!r} is what the generated kernels call the {meaning} of the {role} "
                            f"{owner!r}; rename one of them")


def sanitize_identifier(name, fallback="neuron"):
    """A plain ASCII identifier made from `name` (for kernel and op names), never a keyword.

    >>> sanitize_identifier("<lambda>")
    'lambda_'
    >>> sanitize_identifier("x'); import os #")
    'x_import_os'
    >>> sanitize_identifier("2nd")
    'n_2nd'
    """
    text = re.sub(r"[^0-9A-Za-z_]+", "_", str(name)).strip("_")[:MAX_NAME_LENGTH] or fallback
    if text[0].isdigit():
        text = "n_" + text
    if keyword.iskeyword(text) or keyword.issoftkeyword(text) or text in dir(builtins):
        text += "_"
    return text


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
