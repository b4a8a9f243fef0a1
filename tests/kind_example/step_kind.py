"""A layer kind that lives outside the package (docs/extending.md): "one step", the neuron's forward step as a
plain torch function, `step(inputs..., states..., parameters...) -> (outputs..., new states...)`, for code that
calls a neuron one step at a time without a layer (a controller loop, a test). It goes through every stage as the
bundled kinds do: the trace and the derivation it is given, the layout of the plain kind, the torch printer, a
frame of its own (`step.py.j2`, beside this file), the cache, and a loader (its "launch": calling the function)."""
import pathlib
from typing import NamedTuple

import jinja2
from sympy.codegen.ast import Assignment

import flexgen.kinds
from flexgen.derive.programs import forward_code
from flexgen.printing import TorchPrinter
from flexgen.render.layout import plain_layout
from flexgen.version import __version__

FRAMES = jinja2.Environment(loader=jinja2.FileSystemLoader(str(pathlib.Path(__file__).parent)),
                            keep_trailing_newline=True, undefined=jinja2.StrictUndefined)


class StepOptions(NamedTuple):
    detach_states: bool = False  # the new states without their gradient (truncated backpropagation, one step)


class OneStep(flexgen.kinds.Kind):
    name = "one-step"
    Options = StepOptions

    def options(self, detach_states=False):
        return StepOptions(bool(detach_states))

    def generate(self, derivation, options):
        layout = plain_layout(derivation)  # what the kernels read and write, in order
        code, printer = forward_code(derivation), TorchPrinter()
        source = FRAMES.get_template("step.py.j2").render(
            version=__version__, layout=layout, detach_states=options.detach_states,
            prelude=[printer.doprint(Assignment(a.target, a.expr)) for a in code.prelude],
            step=[printer.doprint(Assignment(a.target, a.expr)) for a in code.step])
        return source, {"layout": layout.to_json(), "sources": {"step": source}, "version": __version__}

    def load(self, module, meta, key):
        return LoadedStep(module, meta, key)


class LoadedStep:
    """The generated step, called with tensors (and numbers for the hyper-parameters)."""

    def __init__(self, module, meta, key):
        self.module, self.meta, self.key = module, meta, key

    def __call__(self, *args):
        return self.module.step(*args)

    def module_source(self):
        return self.module.__flexgen_source__


ONE_STEP = flexgen.kinds.register(OneStep())
