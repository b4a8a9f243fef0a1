"""The EventProp reference's functions printed as torch source (`flexgen.printing.torch`): the math of
`flexgen.derive.eventprop_program`, one Python function per `Function`, each returning a tuple of tuples."""
import sympy

from ..printing.torch import TorchPrinter

HEADER = '''"""EventProp functions of {name}, printed by flexgen from its equations."""
import torch

'''


class _Printer(TorchPrinter):
    def _where(self, cond, a, b):  # the derived functions hold no condition; a Piecewise would be a derivation bug
        raise AssertionError(f"no condition expected in an EventProp function, got where({cond}, {a}, {b})")


def print_function(function, printer):
    """The source of one function."""
    args = ", ".join(str(a) for a in function.args)
    lines = [f"def {function.name}({args}):"]
    for symbol, expr in function.assignments:
        lines.append(f"    {symbol} = {printer.doprint(sympy.sympify(expr))}")
    groups = []
    for group in function.returns:
        items = [printer.doprint(sympy.sympify(e)) for e in group]
        groups.append("(" + "".join(f"{item}, " for item in items) + ")")
    lines.append(f"    return ({''.join(g + ', ' for g in groups)})")
    return "\n".join(lines) + "\n"


def module_source(program, name):
    """The whole module: a header, then every function of the program."""
    printer = _Printer()
    return HEADER.format(name=name) + "\n\n".join(print_function(f, printer) for f in program.functions)


def load(source, name):
    """The functions of a printed module, by name."""
    namespace = {}
    exec(compile(source, f"<flexgen eventprop {name}>", "exec", dont_inherit=True), namespace)
    return namespace
