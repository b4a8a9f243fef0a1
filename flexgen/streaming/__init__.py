"""Streaming inference: a whole model of flexgen layers run one step a call (`flexgen.Stream`).

Takes a model (`torch.nn.Module`) whose flexgen layers (neuron layers, `Recurrent`, `Dense`, with torch modules
between them) the `flexgen.layers` stage made, and one step's example input; hands on a `Stream`, whose calls run
one step each with the layers' states in buffers of their own, updated in place: on CUDA the step is captured once
as a CUDA graph and replayed (`flexgen.streaming.stream`); on the CPU a model of Linear, Recurrent and neuron
layers runs as a plan over buffers made once (`flexgen.streaming.cpu_plan`), other models eagerly.
`flexgen.streaming.held` says, per layer kind, what a layer keeps between steps, how a stream binds it to its
buffers and what the buffers hold after a reset.
"""
