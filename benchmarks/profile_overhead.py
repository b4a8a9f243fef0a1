"""Host-side cost of one LIF forward+backward: wall time per call vs GPU kernel time (torch.profiler)."""
import time

import torch

import flexgen


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s)


def main():
    layer = lif()
    for shape, grad in [((4, 64, 1024), "sum"), ((4, 64, 65536), "sum"), ((4, 64, 65536), "dense")]:
        x = torch.rand(*shape, device="cuda", dtype=torch.float16, requires_grad=True)
        g = torch.randn_like(x)
        print(f"=== {shape}, upstream gradient: {grad}")

        def step():
            layer.reset()
            y = layer(x)
            y.sum().backward() if grad == "sum" else y.backward(g)
            x.grad = None

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n = 200
        t = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        print(f"{shape}: {(time.perf_counter() - t) / n * 1e6:.1f} us per fwd+bwd (wall, synchronized at the end)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
