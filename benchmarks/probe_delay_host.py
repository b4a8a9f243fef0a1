"""Host time of a LIF layer with `delay=` (T 250, B 32, C 700, max_delay 25), one training call: back-to-back
calls, calls after a synchronize, and a cProfile of 100 calls written as JSON (function, calls, own time in us, per
call). For an A/B of two checkouts, run it alternately with PYTHONPATH on each:

    PYTHONPATH=A python benchmarks/probe_delay_host.py A a.json
    PYTHONPATH=B python benchmarks/probe_delay_host.py B b.json

Needs a GPU (a run: docs/perf/h200/delay_host_ab_2026-11-28.log)."""
import cProfile
import json
import pstats
import sys
import time

import torch

import flexgen


def main(label, profile_path):
    torch.manual_seed(0)
    channels = 700
    delay = flexgen.Delay(channels, max_delay=25, delay=torch.rand(channels) * 25)
    layer = flexgen.LIF(step_mode="m", delay=delay).cuda()
    x = torch.rand(250, 32, channels, device="cuda", requires_grad=True)

    def run():
        layer.reset()
        layer(x).sum().backward()

    for _ in range(30):
        run()
    torch.cuda.synchronize()
    back_to_back = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            run()
        torch.cuda.synchronize()
        back_to_back.append((time.perf_counter() - start) / 200 * 1e3)
    host = []  # each call after a synchronize: the time until it returns, the GPU idle before it
    for _ in range(3):
        total = 0.0
        for _ in range(100):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            total += time.perf_counter() - start
        host.append(total / 100 * 1e3)
    print(label, "ms/call", [round(v, 3) for v in back_to_back], "host ms (call returns)", [round(v, 3) for v in host])
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        run()
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile).stats
    rows = [(f"{path.split('/flexgen/')[-1]}:{name}", calls / 100, own / 100 * 1e6)
            for (path, _, name), (_, calls, own, _, _) in stats.items()]
    with open(profile_path, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
