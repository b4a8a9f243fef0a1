"""Launching a neuron layer's generated kernels: the custom ops of one variant (`ops`), the arguments of a call
(`calls`) and the per-signature host plans of eager Triton calls (`plans`)."""
