"""DistributedDataParallel (gloo, 2 CPU processes) trains flexgen layers like one process with the global batch.

Both ranks share one fresh FLEXGEN_CACHE_DIR and build the same kernels at
the same time, which exercises the cache's concurrent-writer path.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, T, BATCH, WORLD = 3, 4, 8, 2


def build_model(backend="torch"):
    import flexgen

    @flexgen.neuron(states=("v",), learnable=("w",))
    def ddp_plif(x, v, w=-0.2, v_th=0.9):
        h = v + (x - v) * flexgen.sigmoid(w)
        s = flexgen.spike(h - v_th)
        return s, h * (1.0 - s)

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), ddp_plif(backend=backend), torch.nn.Linear(7, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(T, BATCH, 5, generator=g) * 2, torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]


def train(model, data, rank=0, world=1, device="cpu"):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    share = BATCH // world
    for x, y in data:
        x, y = x.to(device), y.to(device)
        for m in model.modules():
            if hasattr(m, "reset"):
                m.reset()
        x, y = x[:, rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        out = model(x).mean(0)
        loss = torch.nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def worker(rank, rendezvous, cache_dir, result_path, pg_backend="gloo"):
    os.environ["FLEXGEN_CACHE_DIR"] = cache_dir
    torch.set_num_threads(1)
    # A file rendezvous: no port to pick, so nothing else on the machine can take it first.
    dist.init_process_group(pg_backend, init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        if pg_backend == "nccl":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
            model = torch.nn.parallel.DistributedDataParallel(build_model("triton").to(device), device_ids=[rank])
        else:
            device = "cpu"
            model = torch.nn.parallel.DistributedDataParallel(build_model())
        train(model, batches(), rank, WORLD, device)
        if rank == 0:
            torch.save({k: v.detach().cpu() for k, v in model.module.state_dict().items()}, result_path)
        dist.barrier()  # no rank tears gloo down while the other still uses it (seen once: SIGABRT at exit)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_two_processes_match_single_process(tmp_path):
    cache_dir, result_path = str(tmp_path / "cache"), str(tmp_path / "ddp.pt")
    mp.spawn(worker, args=(str(tmp_path / "rendezvous"), cache_dir, result_path), nprocs=WORLD, join=True)
    ddp = torch.load(result_path)
    single = train(build_model(), batches()).state_dict()
    assert set(ddp) == set(single) and "1.w" in ddp
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], rtol=0, atol=1e-6)
    assert not torch.equal(single["1.w"], torch.tensor(-0.2))  # the learnable parameter trained
    from flexgen import cache

    summary = cache.info(cache_dir)  # both ranks built the one kernel entry, and nothing else is there
    assert summary["count"] == 1 and summary["marked"] and summary["not_flexgen"] == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not dist.is_nccl_available(), reason="needs 2 GPUs and NCCL")
def test_ddp_nccl_two_gpus_match_single_gpu(tmp_path):
    cache_dir, result_path = str(tmp_path / "cache"), str(tmp_path / "ddp.pt")
    mp.spawn(worker, args=(str(tmp_path / "rendezvous"), cache_dir, result_path, "nccl"), nprocs=WORLD, join=True)
    ddp = torch.load(result_path)
    single = train(build_model("triton").cuda(), batches(), device="cuda").state_dict()
    for k in single:
        torch.testing.assert_close(ddp[k], single[k].cpu(), rtol=0, atol=1e-5)
    assert not torch.equal(single["1.w"].cpu(), torch.tensor(-0.2))
