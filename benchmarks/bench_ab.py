"""A/B of two checkouts of flexgen on one machine: the same workloads, run back to back in alternating processes
(A, B, A, B, ...), each with a kernel cache of its own, so that a change meant to leave speed alone can show it did.

    python benchmarks/bench_ab.py --a PATH_A --b PATH_B [--rounds 2] [--out DIR] [--quick] [--only NAME ...]

PATH_A and PATH_B are folders that hold `flexgen/` and `templates/` (a checkout, or `git archive REV flexgen
templates | tar -x -C DIR`). Every workload uses the public API only, so any two versions run it. On a GPU: LIF
forward + backward (fp32 and fp16), a LIF layer with a delay line, `DelayedLinear` ("auto"), the fused recurrent
layer's training step (fp32 and bf16, H 256 and 1024, B 32 and 256, T 100) and a recurrent `Chain` of three
`Dense` layers at SHD's shapes with `checkpoint_every=128` (T 1,000); on the CPU (no GPU): LIF, a recurrent layer and
`DelayedLinear` at small sizes. Time: the median of `triton.testing.do_bench` (CUDA events) on the GPU, of 7
timed calls on the CPU; peak memory: a warm call after `gc.collect()` and `empty_cache`, allocated and reserved.
Stateful layers are reset before every call. Writes `ab.json` and `ab.md` to --out (default: standard output only).
"""
import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = "--worker"


def workloads(quick):
    import torch

    import flexgen

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    items = []

    def lif(dtype, steps, batch, neurons):
        layer = flexgen.LIF(step_mode="m").to(device)
        x = torch.rand(steps, batch, neurons, device=device, dtype=dtype, requires_grad=True)

        def run():
            layer.reset()
            layer(x).sum().backward()
        return run

    def lif_delay(steps, batch, channels, max_delay):
        delay = flexgen.Delay(channels, max_delay=max_delay, delay=torch.rand(channels) * max_delay)
        layer = flexgen.LIF(step_mode="m", delay=delay).to(device)
        x = torch.rand(steps, batch, channels, device=device, requires_grad=True)

        def run():
            layer.reset()
            layer(x).sum().backward()
        return run

    def delayed_linear(steps, batch, n_in, n_out, max_delay):
        layer = flexgen.DelayedLinear(n_in, n_out, max_delay=max_delay).to(device)
        x = (torch.rand(steps, batch, n_in, device=device) < 0.1).float().requires_grad_()

        def run():
            layer(x).sum().backward()
        return run

    def recurrent(dtype, hidden, batch, steps):
        layer = flexgen.Recurrent(flexgen.LIF, hidden=hidden).to(device)
        x = torch.rand(steps, batch, hidden, device=device, dtype=dtype, requires_grad=True)

        def run():
            layer.reset()
            layer(x).float().sum().backward()
        return run

    def chain(steps, batch, every):
        chain = flexgen.Chain(flexgen.Dense(700, 512, flexgen.Recurrent(flexgen.LIF, hidden=512)),
                              flexgen.Dense(512, 512, flexgen.Recurrent(flexgen.LIF, hidden=512)),
                              flexgen.Dense(512, 512, flexgen.Recurrent(flexgen.LIF, hidden=512)),
                              checkpoint_every=every).to(device)
        x = (torch.rand(steps, batch, 700, device=device) < 0.05).float()

        def run():
            flexgen.reset(chain)
            chain(x).sum().backward()
        return run

    if cuda:
        items += [("LIF fp32 T 32 B 32 N 65536", lif, (torch.float32, 32, 32, 65536)),
                  ("LIF fp16 T 32 B 32 N 65536", lif, (torch.float16, 32, 32, 65536))]
        if not quick:
            items += [("LIF delay= T 250 B 32 C 700 max_delay 25", lif_delay, (250, 32, 700, 25)),
                      ("DelayedLinear auto T 100 B 32 700->256 max_delay 25", delayed_linear, (100, 32, 700, 256, 25))]
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            for hidden, batch in ((256, 32), (1024, 256)) if not quick else ((256, 32),):
                items.append((f"Recurrent {name} H {hidden} B {batch} T 100", recurrent, (dtype, hidden, batch, 100)))
        if not quick:
            items.append(("Chain 700->3x512 recurrent T 1000 B 32 K 128", chain, (1000, 32, 128)))
    else:
        items += [("LIF fp32 T 32 B 8 N 4096 (CPU)", lif, (torch.float32, 32, 8, 4096)),
                  ("Recurrent fp32 H 128 B 8 T 50 (CPU)", recurrent, (torch.float32, 128, 8, 50)),
                  ("DelayedLinear T 50 B 8 64->32 max_delay 5 (CPU)", delayed_linear, (50, 8, 64, 32, 5))]
    return items


def measure(run):
    """(median ms, peak allocated MiB, peak reserved MiB) of `run`."""
    import torch

    run()  # compiles, and warms the allocator
    if torch.cuda.is_available():
        import triton

        torch.cuda.synchronize()
        ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        gc.collect()  # what earlier calls left in reference cycles is not this call's peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        mib = 2.0 ** 20
        return ms, torch.cuda.max_memory_allocated() / mib, torch.cuda.max_memory_reserved() / mib
    times = []
    for _ in range(7):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), None, None


def worker(quick, only):
    import torch

    torch.manual_seed(0)
    results = {}
    for name, make, args in workloads(quick):
        if only and not any(part in name for part in only):
            continue
        torch.manual_seed(0)
        results[name] = measure(make(*args))
        gc.collect()
    print(json.dumps(results))


def run_tree(path, cache, quick, only):
    env = dict(os.environ, PYTHONPATH=path, FLEXGEN_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    flags = (["--quick"] if quick else []) + (["--only", *only] if only else [])
    done = subprocess.run([sys.executable, os.path.abspath(__file__), WORKER] + flags,
                          env=env, capture_output=True, text=True, cwd=path)
    if done.returncode != 0:
        raise RuntimeError(f"the worker failed on {path}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    if WORKER in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else []
        return worker("--quick" in sys.argv, only)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", required=True, help="folder holding flexgen/ and templates/ of version A")
    p.add_argument("--b", required=True, help="folder holding flexgen/ and templates/ of version B")
    p.add_argument("--name-a", default="A")
    p.add_argument("--name-b", default="B")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="+", help="the workloads whose names hold one of these strings")
    p.add_argument("--out")
    args = p.parse_args()
    caches = {tree: tempfile.mkdtemp(prefix="flexgen-ab-") for tree in (args.a, args.b)}
    runs = {args.a: [], args.b: []}
    for _ in range(args.rounds):
        for tree in (args.a, args.b):
            runs[tree].append(run_tree(os.path.abspath(tree), caches[tree], args.quick, args.only))
    import torch

    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    rows = []
    for name in runs[args.a][0]:
        a = [r[name] for r in runs[args.a]]
        b = [r[name] for r in runs[args.b]]
        a_ms, b_ms = statistics.median(x[0] for x in a), statistics.median(x[0] for x in b)
        rows.append({"workload": name, "a_ms": [x[0] for x in a], "b_ms": [x[0] for x in b], "ratio": b_ms / a_ms,
                     "a_peak_mib": a[0][1], "b_peak_mib": b[0][1], "a_reserved_mib": a[0][2],
                     "b_reserved_mib": b[0][2]})
    record = {"machine": machine, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "a": args.name_a, "b": args.name_b, "rounds": args.rounds, "command": " ".join(sys.argv), "rows": rows}
    lines = [f"# A/B: {args.name_a} against {args.name_b}", "",
             f"{machine}, {record['date']}, torch {torch.__version__}; {args.rounds} rounds, A and B alternating; "
             "time: median of each round's median (ms); B/A < 1 means B is faster.", "",
             "| workload | A ms (rounds) | B ms (rounds) | B/A | A peak MiB (reserved) | B peak MiB (reserved) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        peak = (lambda m, res: "-" if m is None else f"{m:.1f} ({res:.1f})")
        lines.append(f"| {r['workload']} | {', '.join(f'{x:.3f}' for x in r['a_ms'])} | "
                     f"{', '.join(f'{x:.3f}' for x in r['b_ms'])} | {r['ratio']:.3f} | "
                     f"{peak(r['a_peak_mib'], r['a_reserved_mib'])} | {peak(r['b_peak_mib'], r['b_reserved_mib'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ab.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "ab.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
