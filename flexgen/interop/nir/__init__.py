"""NIR import and export: `flexgen.from_nir(graph)` and `flexgen.to_nir(model, sample)`.

NIR (the Neuromorphic Intermediate Representation, the `nir` package) states
neurons as continuous-time equations. Here NIR's neuron nodes become
`flexgen.ode` layers (the equations below, integrated by `method`) and its
other nodes torch modules, run in the graph's order (`reading`); export traces
a torch model into a graph with `nirtorch` (`writing`).

    LIF         tau dv/dt = (v_leak - v) + r x;  fires where v >= v_threshold, v <- v_reset
    CubaLIF     tau_syn di/dt = -i + w_in x;  tau_mem dv/dt = (v_leak - v) + r i;  fires as LIF
    IF          dv/dt = r x;  fires as LIF
    LI          tau dv/dt = (v_leak - v) + r x;  outputs v
    I           dv/dt = r x;  outputs v                (NIR's Integrator)
    CubaLI      CubaLIF's equations without firing;  outputs v

Conventions (a NIR graph carries neither a step size nor a method):

* `dt` is the step in the graph's time unit. The exporters of snnTorch and
  SpikingJelly write time constants in seconds for dt = 1e-4 s (the default),
  mapping a discrete decay beta onto tau = dt / (1 - beta): that is forward
  Euler, so `method="euler"` (the default) with their dt reproduces those
  libraries' neurons; `method="exact"` integrates NIR's equations exactly
  (decay exp(-dt / tau) instead of 1 - dt / tau).
* States start at 0. NIR fires where v > v_threshold, flexgen where
  v >= v_threshold (they differ only where v equals the threshold).
* Shapes: NIR shapes leave out the batch; the imported model takes and returns
  [T, B, ...] sequences, running each neuron layer over all T steps at once
  (a recurrent loop, a neuron node whose output feeds an Affine or Linear node,
  through a Delay node or not, back into it, becomes one `flexgen.Recurrent`;
  other cycles are not supported).
  NIR's Flatten dimensions count from the first dimension after the batch.
* A neuron parameter that differs between neurons must differ only along the
  first (channel) dimension: it becomes a per-channel parameter of the layer.
"""
from .equations import NEURONS, node_spec
from .modules import Scale, SequenceWise
from .reading import NIRModel, from_nir
from .writing import to_nir

__all__ = ["from_nir", "to_nir", "NIRModel", "SequenceWise", "Scale", "node_spec", "NEURONS"]
