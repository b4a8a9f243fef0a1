"""Where the first forward+backward's time goes in a fresh process (run twice: cold, then warm cache)."""
import cProfile
import pstats
import time

import torch


torch.zeros(1, device="cuda")  # CUDA context first: not flexgen's start-up
profiler = cProfile.Profile()
t0 = time.perf_counter()
profiler.enable()
import flexgen  # noqa: E402

t1 = time.perf_counter()


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s)


layer = lif()
t2 = time.perf_counter()
x = torch.rand(8, 64, 4096, device="cuda", requires_grad=True)
layer(x).sum().backward()
torch.cuda.synchronize()
profiler.disable()
t3 = time.perf_counter()
print(f"import {t1 - t0:.2f} s, layer construction {t2 - t1:.2f} s, first fwd+bwd {t3 - t2:.2f} s, total {t3 - t0:.2f} s")
pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)
