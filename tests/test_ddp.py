"""DistributedDataParallel (gloo, 2 CPU processes) trains flexgen layers like one process with the global batch.

Both ranks share one fresh FLEXGEN_CACHE_DIR and build the same kernels at
the same time, which exercises the cache's concurrent-writer path.
"""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, T, BATCH, WORLD = 3, 4, 8, 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model():
    import flexgen

    @flexgen.neuron(states=("v",), learnable=("w",))
    def ddp_plif(x, v, w=-0.2, v_th=0.9):
        h = v + (x - v) * flexgen.sigmoid(w)
        s = flexgen.spike(h - v_th)
        return s, h * (1.0 - s)

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), ddp_plif(backend="torch"), torch.nn.Linear(7, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(T, BATCH, 5, generator=g) * 2, torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]


def train(model, data, rank=0, world=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    share = BATCH // world
    for x, y in data:
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


def worker(rank, port, cache_dir, result_path):
    os.environ["FLEXGEN_CACHE_DIR"] = cache_dir
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = torch.nn.parallel.DistributedDataParallel(build_model())
        train(model, batches(), rank, WORLD)
        if rank == 0:
            torch.save({k: v.detach() for k, v in model.module.state_dict().items()}, result_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_two_processes_match_single_process(tmp_path):
    cache_dir, result_path = str(tmp_path / "cache"), str(tmp_path / "ddp.pt")
    mp.spawn(worker, args=(free_port(), cache_dir, result_path), nprocs=WORLD, join=True)
    ddp = torch.load(result_path)
    single = train(build_model(), batches()).state_dict()
    assert set(ddp) == set(single) and "1.w" in ddp
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], rtol=0, atol=1e-6)
    assert not torch.equal(single["1.w"], torch.tensor(-0.2))  # the learnable parameter trained
    entries = [name for name in os.listdir(cache_dir) if not name.startswith(".")]
    assert len(entries) == 1  # both ranks built the one kernel entry
