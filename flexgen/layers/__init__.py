"""What a user holds: the `torch.nn.Module`s. Neuron layers (`neuron`: `NeuronModule` and the functional call),
recurrent layers (`recurrent`), dense synapses and stacks with the long-sequence mode (`dense`, `budget`), and
delays (`delay`, their values and taps in `delay_taps`, a neuron layer's held line in `held_line`).

They run the kernels through `flexgen.launch`, built by `flexgen.compile`.
"""
