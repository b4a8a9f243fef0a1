"""The plain kind: a neuron layer's kernels, forward and backward over all T in one launch each, in two designs
(plain, and recompute: the backward runs the forward's steps again instead of reading saved values), on Triton,
the C target and the torch path."""
import functools

import torch

from ..launch import NeuronOps
from ..launch import c_path
from ..launch.config import compute_dtype
from ..render.layout import Layout, recompute_layout
from ..version import __version__
from .base import Kind

__all__ = ["PLAIN", "CompiledNeuron"]


class PlainKind(Kind):
    name = "plain"

    def key(self, options):
        return ()  # the neuron's own kernels: keyed by the step and its static options alone

    def generate(self, derivation, options):
        """The module of the neuron's kernels: the Triton kernels of both designs, the torch path's loops and the C
        target's source (`flexgen.render.contexts.kernel_sources`) in the module frame `kernels.py.j2`."""
        from ..derive.derivation import equations  # (a cache miss: sympy and jinja2 only here)
        from ..render.contexts import kernel_sources, module_source
        from ..render.layout import plain_layout

        layout = plain_layout(derivation)
        sources = kernel_sources(derivation, layout)
        module = module_source("kernels.py.j2", derivation, layout, sources,
                               libdevice_in=("forward", "backward", "backward_recompute"))
        meta = {"layout": layout.to_json(), "sources": sources, "equations": equations(derivation),
                "version": __version__, "kind": self.name}
        return module, meta

    def load(self, module, meta, key):
        return CompiledNeuron(module, meta, key)


class CompiledNeuron:
    """A generated module loaded from the cache, with the custom ops of its plain and recompute variants."""

    def __init__(self, module, meta, key):
        self.module, self.meta, self.key = module, meta, key
        self.layout = Layout.from_json(meta["layout"])
        # Both variants' ops are registered now, never inside a compiled graph's trace.
        self.ops = NeuronOps(module, self.layout, key)
        self.recompute_ops = NeuronOps(module, recompute_layout(self.layout), key)

    def ops_for(self, recompute):
        """The custom ops of the plain kernels, or of the recompute variant."""
        return self.recompute_ops if recompute else self.ops

    def ops_for_call(self, recompute, use_triton, like):
        """The ops a call runs through. `recompute`: True, False or "auto", which recomputes where the recompute
        kernels move fewer bytes than the plain ones: for Triton kernels on CUDA, where they are bound by memory
        (the interpreter and the torch path keep the plain design; the C target: `c_ops_for`)."""
        if recompute == "auto":
            recompute = use_triton and like.device.type == "cuda" and self.recompute_pays(like.dtype)
        return self.ops_for(recompute)

    @functools.cached_property
    def c_library(self):
        """The C target's library (compiled at the first use on this machine and kept in the disk cache;
        `flexgen.launch.c_path.CompilerError` if it cannot be)."""
        return c_path.load(self.meta["sources"]["c"])

    def c_ops_for(self, recompute):
        """The custom ops of the plain or the recompute design on the C target; "auto" runs the plain one (on the
        development CPU the recompute pair was faster only from T 128-256 on, and up to 1.9x slower at T 8:
        docs/perf/bench_cpu.md, bench_cpu_lif_small_t.md)."""
        return self._c_recompute_ops if recompute is True else self._c_plain_ops

    @functools.cached_property
    def _c_plain_ops(self):
        return self._c_ops(self.layout)

    @functools.cached_property
    def _c_recompute_ops(self):
        return self._c_ops(recompute_layout(self.layout))

    def _c_ops(self, layout):
        library = self.c_library
        cpu = (functools.partial(c_path.c_forward, library), functools.partial(c_path.c_backward, library))
        return NeuronOps(self.module, layout, self.key, cpu=cpu, target="_c", c_library=library)

    def recompute_pays(self, dtype):
        """Whether the recompute kernels move fewer bytes per step than the plain ones for this I/O dtype."""
        sizes = torch.finfo(dtype).bits // 8, torch.finfo(compute_dtype(dtype)).bits // 8
        return self.recompute_ops.layout.saved_bytes_per_step(*sizes) < self.ops.layout.saved_bytes_per_step(*sizes)

    def module_source(self):
        """The text the module was compiled from (verified by the cache; not re-read from disk)."""
        return self.module.__flexgen_source__


PLAIN = PlainKind()
