"""Run a function in N spawned processes of one torch.distributed group, bounded in time.

`run_ranks(fn, tmp_path)` starts `world` processes (`torch.multiprocessing`, spawn), each joins one process
group by a file rendezvous (no port to pick, so nothing else on the machine can take it first), sets one shared
fresh `FLEXGEN_CACHE_DIR`, and calls `fn(rank, world, *args)`; each rank's return value comes back through a file.
A rank that raises fails the test with its traceback; ranks that are still running after `timeout` seconds (a hung
collective) are killed and fail the test, rather than hanging the suite.
"""
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GLOO = dist.is_available() and dist.is_gloo_available()


def _rank_main(rank, fn, world, rendezvous, cache_dir, out_dir, backend, args, env):
    os.environ.update(env)
    os.environ["FLEXGEN_CACHE_DIR"] = cache_dir
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        try:
            result = ("ok", fn(rank, world, *args))
        except BaseException:
            result = ("error", traceback.format_exc())
        torch.save(result, result_path)
        dist.barrier()  # no rank tears the group down while another still uses it (gloo can abort at exit)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, tmp_path, *args, world=2, timeout=240, backend="gloo", env=None):
    """[fn(0, world, *args), fn(1, world, *args), ...], each run in a process of its own (see the module)."""
    out_dir, cache_dir = tmp_path / "ranks", tmp_path / "cache"
    out_dir.mkdir(exist_ok=True)
    env = {"TRITON_INTERPRET": "0", **(env or {})}  # the tests pick CPU backends; no rank runs Triton's interpreter
    context = mp.spawn(_rank_main, args=(fn, world, str(tmp_path / "rendezvous"), str(cache_dir), str(out_dir),
                                         backend, args, env), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            for process in context.processes:
                process.join(5)
            raise AssertionError(f"{world} ranks of {fn.__name__} did not finish within {timeout} s (a hung rank?)")
    results = []
    for rank in range(world):
        status, value = torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
        assert status == "ok", f"rank {rank} of {fn.__name__} failed:\n{value}"
        results.append(value)
    return results
