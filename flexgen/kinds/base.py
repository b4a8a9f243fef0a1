"""What a layer kind is: the part of the pipeline that differs between the kernels of a plain neuron layer, a
neuron layer with a delay line, a recurrent layer, and those to come. The stages are the same for every kind; a
kind says what its options are, what of them keys its cache entry, how its kernels are generated from a
`Derivation` (its layout, its render context, its frames) and how the generated module is loaded (its launch ops).
`flexgen.compile.compile_kernels` runs any kind; a `NeuronSpec` asks for one by name (`spec.compiled(kind=...)`)."""
from typing import NamedTuple

__all__ = ["Kind"]


class Kind:
    """A layer kind. Subclasses set `name` and `Options` (a NamedTuple of what selects the kernels beside the
    neuron's own static options) and define `generate` and `load`."""

    name = None
    Options = NamedTuple("NoOptions", [])

    def options(self, **given):
        """The kind's options as its `Options`, checked and normalised (booleans as bool, counts as int)."""
        return self.Options(**given)

    def key(self, options):
        """The strings that tell this kind's cache entries apart (beside the traced step and the static options)."""
        return (self.name, *(str(value) for value in options))

    def generate(self, derivation, options):
        """(module source, metadata) of the kernels: at least "layout" and "sources" in the metadata."""
        raise NotImplementedError

    def load(self, module, meta, key):
        """The loaded kernels of a generated `module` (`flexgen.compile.DeferredImport`) with its metadata."""
        raise NotImplementedError
