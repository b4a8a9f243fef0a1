"""What a user holds: the `torch.nn.Module`s, one concern per module.

Neuron layers: `neuron` (`NeuronModule`, the functional `run`, `NeuronCall`), the checks a call and a layer's
options go through (`checks`), known calls that skip them (`known_calls`), and a layer's delay line on its input
(`delay_line`: the delayed call and what the line holds between calls). Recurrent layers: `recurrent` (the layer,
its options and kept state), the path a call takes (`recurrent_paths`), known calls (`recurrent_known_calls`) and
what earlier outputs feed back (`recurrent_feedback`). Dense synapses and stacks: `dense`, their long-sequence mode
(`long_sequence`) and its memory budget (`budget`). Delays: `delay`, their values and taps in `delay_taps`.
Spec classes: `spec`, `ode_spec`.

They run the kernels through `flexgen.launch`, built by `flexgen.compile`.
"""
