"""The step function's own source, for the messages of a failed trace: the frame running the step, the line it is
on (`user_location`, which every `fail` names), and which Python construct or library call on that line asked for
something a traced value cannot give (`branch_construct`, `called_function`)."""
import linecache
import re
import sys

from ..errors import SpecError


def step_frame(recorder):
    """The innermost frame running the step function, if any."""
    if recorder is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is recorder.fn.__code__:
            return frame
        frame = frame.f_back
    return None


def source_line(frame):
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


def user_location(recorder):
    """'file:line: source' of the innermost frame of the step function, if any."""
    frame = step_frame(recorder)
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno}: {source_line(frame)}"


# flexgen's math functions (flexgen.<name>), and the numpy and torch names of the same functions
FLEXGEN_FUNCTIONS = ("exp", "log", "sqrt", "tanh", "atan", "sigmoid", "abs", "minimum", "maximum", "clamp", "where",
                     "lt", "le", "gt", "ge", "eq", "ne", "detach")
SAME_AS = {"arctan": "atan", "absolute": "abs", "clip": "clamp", "less": "lt", "less_equal": "le",
           "greater": "gt", "greater_equal": "ge", "equal": "eq", "not_equal": "ne"}


def flexgen_instead(name):
    """What to write instead of numpy's or torch's function `name` in a step."""
    same = name if name in FLEXGEN_FUNCTIONS else SAME_AS.get(name)
    if same:
        return f"use flexgen.{same} instead"
    return (f"flexgen has no {name}; write it with flexgen's math functions "
            f"({', '.join('flexgen.' + f for f in FLEXGEN_FUNCTIONS)}) and arithmetic")


def fail(recorder, message):
    where = user_location(recorder)
    raise SpecError(f"{message}\n  at {where}" if where else message)


BRANCHES = {
    "if": "a Python `if`", "elif": "a Python `elif`", "while": "a `while` loop", "assert": "an `assert`",
}


def branch_construct(recorder):
    """Which Python construct asked for the truth of a traced value, judged from the step's source line."""
    frame = step_frame(recorder)
    line = source_line(frame) if frame is not None else ""
    first = re.match(r"\w+", line)
    if first and first.group() in BRANCHES:
        return BRANCHES[first.group()]
    if re.search(r"\b(and|or|not)\b", line):
        return "`and`/`or`/`not`"
    if re.search(r"\bif\b.*\belse\b", line):
        return "a conditional expression (`a if c else b`)"
    if re.search(r"(min|max)\(", line):
        return "Python's min()/max()"
    return "a Python truth test (`if`, `while`, `and`, `or`, `not`, min/max)"


def called_function(recorder):
    """'math.exp'-style name of a library function called on the step's line, if any."""
    frame = step_frame(recorder)
    found = re.search(r"\b(math|numpy|np|torch|scipy[\w.]*)\.(\w+)\s*\(", source_line(frame) if frame else "")
    return f"{found.group(1)}.{found.group(2)}" if found else None

