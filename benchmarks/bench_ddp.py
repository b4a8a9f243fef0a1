"""Data-parallel training of an SHD-shaped recurrent network on 1 and N GPUs: DistributedDataParallel and FSDP2
(`fully_shard`), weak and strong scaling, in one invocation.

The network: 700 inputs -> 3 recurrent layers of 1024 LIF neurons (`flexgen.Chain` of `flexgen.Dense(...,
flexgen.Recurrent(flexgen.LIF, 1024))`, the fused recurrent kernels on a GPU) -> a linear readout of 20 classes,
mean over time, cross-entropy; sparse binary input events [T 1000, B, 700]. A training step is forward, backward
and an Adam step; fp32, or bf16 under `torch.autocast` (fp32 weights, as mixed-precision training keeps them).

Each world size runs in processes of its own (`torch.multiprocessing`, NCCL on GPUs, gloo on the CPU): first the
plain model on one GPU (the baseline), then N ranks under DDP and under FSDP2 (each Dense layer a unit, then the
root). Per configuration: warm-up steps (the kernels' first builds), then each step timed with CUDA events (a
barrier before each), the median over the ranks' slowest; peak memory (max_memory_allocated and
max_memory_reserved over the timed steps, the largest rank's).

* weak scaling: the same batch per GPU on 1 and N GPUs; efficiency = t(1 GPU) / t(N GPUs) (1.0: perfect).
* strong scaling: the same global batch G, G on 1 GPU against G / N per GPU; efficiency = t(1) / (N t(N)).

Run on a machine of 2 GPUs (one command, a few minutes; writes bench_ddp_<date>.md and .json to --out):

    python benchmarks/bench_ddp.py --out docs/perf/h200            # B 64, 128, 256 per GPU, fp32 and bf16
    python benchmarks/bench_ddp.py --quick                         # B 64 and 128, bf16, fewer steps

Check the script on the CPU (gloo, 2 processes, tiny shapes, timings meaningless):

    python benchmarks/bench_ddp.py --cpu
"""
import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

INPUTS, CLASSES, EVENT_RATE = 700, 20, 0.02
try:
    from torch.distributed.fsdp import fully_shard  # torch >= 2.6
except ImportError:  # older torch: DDP only
    fully_shard = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="B 64 and 128 per GPU, bf16, fewer timed steps")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, tiny shapes: checks the script")
    p.add_argument("--gpus", type=int, default=2, help="the larger world size (default 2)")
    p.add_argument("--batch", type=int, nargs="+", help="batches per GPU (default 64 128 256)")
    p.add_argument("--steps", type=int, help="time steps T (default 1000)")
    p.add_argument("--hidden", type=int, help="neurons per recurrent layer (default 1024)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--dtype", choices=("fp32", "bf16"), nargs="+", help="default fp32 bf16")
    p.add_argument("--wrappers", choices=("ddp", "fsdp2"), nargs="+", default=["ddp", "fsdp2"])
    p.add_argument("--warmup", type=int, help="untimed steps per configuration (default 3)")
    p.add_argument("--repeats", type=int, help="timed steps per configuration (default 10)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a world size may run before it is stopped")
    p.add_argument("--out", help="folder for bench_ddp_<date>.md/.json (default: print only)")
    args = p.parse_args(argv)
    small = args.cpu
    args.batch = args.batch or ([2, 4] if small else [64, 128] if args.quick else [64, 128, 256])
    args.steps = args.steps or (20 if small else 1000)
    args.hidden = args.hidden or (16 if small else 1024)
    args.dtype = args.dtype or (["fp32"] if small else ["bf16"] if args.quick else ["fp32", "bf16"])
    args.warmup = args.warmup or (1 if small else 2 if args.quick else 3)
    args.repeats = args.repeats or (3 if small else 5 if args.quick else 10)
    if "fsdp2" in args.wrappers and fully_shard is None:
        print("FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6: DDP only", file=sys.stderr)
        args.wrappers = [w for w in args.wrappers if w != "fsdp2"]
    return args


def build(args, device):
    import flexgen

    backend = "c" if device.type == "cpu" else "auto"
    layers, width = [], INPUTS
    for _ in range(args.layers):
        layers.append(flexgen.Dense(width, args.hidden, flexgen.Recurrent(flexgen.LIF, args.hidden, backend=backend),
                                    backend=backend))
        width = args.hidden
    return torch.nn.Sequential(flexgen.Chain(*layers), torch.nn.Linear(width, CLASSES)).to(device)


def wrapped(model, wrapper, device):
    if wrapper == "none":
        return model
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.index is not None
                                                         else None)
    fully_shard(model[0])  # the Chain as one unit: it runs its Dense layers' weights itself (docs/multi-gpu.md)
    fully_shard(model[1])
    return fully_shard(model)


def measure(args, wrapper, batch, dtype, device):
    """(median ms per step over the ranks' slowest, peak allocated MiB, peak reserved MiB) of one configuration."""
    torch.manual_seed(0)
    model = wrapped(build(args, device), wrapper, device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator(device=device).manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    x = (torch.rand(args.steps, batch, INPUTS, generator=g, device=device) < EVENT_RATE).float()
    y = torch.randint(0, CLASSES, (batch,), generator=g, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")
    cuda = device.type == "cuda"

    def step():
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(x).float().mean(0), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.repeats):
        if dist.is_initialized():
            dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    mib = 2.0 ** 20
    peak = [torch.cuda.max_memory_allocated(device) / mib, torch.cuda.max_memory_reserved(device) / mib] if cuda \
        else [float("nan"), float("nan")]
    per_step = torch.tensor(times, dtype=torch.float64)
    numbers = torch.tensor(peak, dtype=torch.float64)
    if dist.is_initialized():
        gathered = per_step.to(device)
        dist.all_reduce(gathered, op=dist.ReduceOp.MAX)  # each step as long as its slowest rank
        per_step = gathered.cpu()
        memory = numbers.to(device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        numbers = memory.cpu()
    return {"ms": statistics.median(per_step.tolist()), "ms_all": per_step.tolist(),
            "peak_allocated_mib": numbers[0].item(), "peak_reserved_mib": numbers[1].item()}


def rank_main(rank, world, args, rendezvous, result_path):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if args.cpu:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    if world > 1:
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    rows = []
    try:
        wrappers = ["none"] if world == 1 else args.wrappers
        for dtype in args.dtype:
            for wrapper in wrappers:
                for batch in args.batch:
                    row = {"world": world, "wrapper": wrapper, "dtype": dtype, "batch_per_gpu": batch}
                    try:
                        row.update(measure(args, wrapper, batch, dtype, device))
                    except Exception as exc:  # out of memory, or a wrapper that fails: the same on every rank
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        if rank == 0:
                            traceback.print_exc()
                    if not args.cpu:
                        torch.cuda.empty_cache()  # the configuration's model and optimiser are gone
                    rows.append(row)
                    if rank == 0:
                        torch.save(rows, result_path)  # after each row: a run stopped at --timeout keeps them
                        print(f"  world {world} {wrapper:5s} {dtype} B {batch:4d}: "
                              f"{row.get('ms', float('nan')):9.2f} ms {row.get('error', '')}", flush=True)
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()


def run_world(args, world):
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "rows.pt")
        context = mp.spawn(rank_main, args=(world, args, os.path.join(tmp, "rendezvous"), result), nprocs=world,
                           join=False)
        deadline = time.monotonic() + args.timeout
        try:
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    for process in context.processes:
                        process.kill()
                    print(f"world size {world} ran past --timeout {args.timeout} s: stopped, its rows so far kept",
                          file=sys.stderr)
                    break
        except Exception:  # a rank failed outside the measured steps: what rank 0 recorded before stays
            traceback.print_exc()
        return torch.load(result) if os.path.exists(result) else []


def scaling(rows, world):
    """Weak and strong scaling rows from the measured ones."""
    base = {(r["dtype"], r["batch_per_gpu"]): r for r in rows if r["world"] == 1 and "ms" in r}
    out = []
    for r in rows:
        if r["world"] != world or "ms" not in r:
            continue
        one = base.get((r["dtype"], r["batch_per_gpu"]))
        if one is not None:
            out.append({"kind": "weak", "wrapper": r["wrapper"], "dtype": r["dtype"], "batch_per_gpu": r["batch_per_gpu"],
                        "global_batch_1": r["batch_per_gpu"], "global_batch_n": world * r["batch_per_gpu"],
                        "ms_1": one["ms"], "ms_n": r["ms"], "efficiency": one["ms"] / r["ms"]})
        whole = base.get((r["dtype"], world * r["batch_per_gpu"]))
        if whole is not None:
            out.append({"kind": "strong", "wrapper": r["wrapper"], "dtype": r["dtype"], "batch_per_gpu": r["batch_per_gpu"],
                        "global_batch_1": whole["batch_per_gpu"], "global_batch_n": world * r["batch_per_gpu"],
                        "ms_1": whole["ms"], "ms_n": r["ms"], "efficiency": whole["ms"] / (world * r["ms"])})
    return out


def machine(args):
    import triton

    gpu = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    return {"gpu": gpu, "gpus": 1 if args.cpu else torch.cuda.device_count(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv])}


def markdown(record):
    m, a = record["machine"], record["args"]
    lines = [f"# Data-parallel training on {m['gpu']} (x{record['world']}), {m['date']}", "",
             f"torch {m['torch']}, Triton {m['triton']}, CUDA {m['cuda']}; `{m['command']}`", "",
             f"700 -> {a['layers']} x {a['hidden']} recurrent LIF (`flexgen.Chain` of `Dense(..., Recurrent(LIF))`) "
             f"-> 20, T {a['steps']}, Adam; median of {a['repeats']} steps after {a['warmup']} warm-up steps, "
             "each step as long as its slowest rank; peak memory of the largest rank.", "",
             "| world | wrapper | dtype | batch per GPU | ms per step | peak allocated MiB | peak reserved MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        if "error" in r:
            lines.append(f"| {r['world']} | {r['wrapper']} | {r['dtype']} | {r['batch_per_gpu']} | {r['error']} | | |")
            continue
        lines.append(f"| {r['world']} | {r['wrapper']} | {r['dtype']} | {r['batch_per_gpu']} | {r['ms']:.2f} | "
                     f"{r['peak_allocated_mib']:.0f} | {r['peak_reserved_mib']:.0f} |")
    lines += ["", "| scaling | wrapper | dtype | global batch (1 GPU -> N) | ms, 1 GPU | ms, N GPUs | efficiency |",
              "|---|---|---|---|---|---|---|"]
    for s in record["scaling"]:
        lines.append(f"| {s['kind']} | {s['wrapper']} | {s['dtype']} | {s['global_batch_1']} -> {s['global_batch_n']} "
                     f"| {s['ms_1']:.2f} | {s['ms_n']:.2f} | {s['efficiency']:.1%} |")
    weak = [s["efficiency"] for s in record["scaling"] if s["kind"] == "weak"]
    if weak:
        lines += ["", f"Weak-scaling efficiency {min(weak):.1%}-{max(weak):.1%} (target: 90 % or more)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs (found {torch.cuda.device_count()}); --cpu checks the script "
                         "with gloo on the CPU")
    world = args.gpus
    started = time.monotonic()
    rows = []
    for size in (1, world):
        print(f"world size {size}:", flush=True)
        rows += run_world(args, size)
    record = {"machine": machine(args), "world": world, "args": {k: v for k, v in vars(args).items()},
              "rows": rows, "scaling": scaling(rows, world), "seconds": time.monotonic() - started}
    text = markdown(record)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"bench_ddp_{record['machine']['date']}"
        (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / f"{stem}.md").write_text(text)
        print(f"wrote {out / stem}.md and .json")
    return record


if __name__ == "__main__":
    main()
