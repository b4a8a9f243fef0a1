"""Data-parallel training of a recurrent spiking network on several GPUs (or CPU processes), with DDP or FSDP2.

    torchrun --nproc_per_node=2 examples/train_multi_gpu.py            # DistributedDataParallel
    torchrun --nproc_per_node=2 examples/train_multi_gpu.py --fsdp2    # FSDP2 (fully_shard, torch >= 2.6)

Each process (rank) drives one GPU with NCCL; without GPUs every rank runs on the CPU with gloo, so the same command
runs anywhere. `python examples/train_multi_gpu.py` alone is a world of one.

The task is synthetic: each of 4 classes fires its own group of input channels in its own window of time, in noise.
The network: 40 inputs -> `flexgen.Dense` into a `flexgen.Recurrent` layer of 64 LIF neurons -> a linear readout,
mean over time. Each rank trains on its share of every global batch; DDP (or FSDP2) averages the gradients, so the
ranks keep equal weights. Each rank prints its own loss; rank 0 prints the accuracy on held-out samples, counted
over all ranks.
"""
import argparse
import os

import torch
import torch.distributed as dist

import flexgen

CHANNELS, CLASSES, STEPS = 40, 4, 30


def synthetic(n, seed):
    """n samples [STEPS, n, CHANNELS] of input spikes and their labels: class c fires channels 10c..10c+9 in
    steps 6c..6c+11 at a high rate, every channel fires at a low rate anywhere."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    rate = torch.full((STEPS, n, CHANNELS), 0.03)
    for c in range(CLASSES):
        rate[6 * c:6 * c + 12, labels == c, 10 * c:10 * c + 10] = 0.5
    return (torch.rand(rate.shape, generator=g) < rate).float(), labels


class Net(torch.nn.Module):
    def __init__(self, hidden=64):
        super().__init__()
        self.recurrent = flexgen.Dense(CHANNELS, hidden, flexgen.Recurrent(flexgen.LIF, hidden, tau=4.0))
        self.readout = torch.nn.Linear(hidden, CLASSES)

    def forward(self, x):
        return self.readout(self.recurrent(x)).mean(0)


def setup():
    """(rank, world size, device): from torchrun's variables, or a world of one."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available() and torch.cuda.device_count() > local:
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(backend)
    return rank, world, device


def wrap(model, fsdp2, world, device):
    if world == 1:
        return model
    if fsdp2:
        from torch.distributed.fsdp import fully_shard  # torch >= 2.6

        fully_shard(model.recurrent)  # the Dense layer and its recurrent cell: one unit
        fully_shard(model.readout)
        return fully_shard(model)
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                     else None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fsdp2", action="store_true", help="FSDP2 (fully_shard) instead of DistributedDataParallel")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch", type=int, default=64, help="global batch, split over the ranks")
    p.add_argument("--train", type=int, default=512, help="training samples")
    args = p.parse_args(argv)
    rank, world, device = setup()
    try:
        torch.manual_seed(0)  # every rank starts from the same weights (DDP also broadcasts rank 0's)
        model = wrap(Net().to(device), args.fsdp2, world, device)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x_train, y_train = synthetic(args.train, seed=1)
        x_test, y_test = synthetic(256, seed=2)
        share = args.batch // world
        for epoch in range(args.epochs):
            order = torch.randperm(args.train, generator=torch.Generator().manual_seed(epoch))  # the same on all
            total, batches = 0.0, 0
            for start in range(0, args.train - args.batch + 1, args.batch):
                mine = order[start + rank * share:start + (rank + 1) * share]  # this rank's share of the batch
                x, y = x_train[:, mine].to(device), y_train[mine].to(device)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total, batches = total + loss.item(), batches + 1
            print(f"rank {rank}: epoch {epoch} loss {total / batches:.4f}", flush=True)
        with torch.no_grad():
            mine = torch.arange(rank, len(y_test), world)  # each rank counts its part of the held-out set
            correct = (model(x_test[:, mine].to(device)).argmax(1) == y_test[mine].to(device)).sum().float()
        if world > 1:
            dist.all_reduce(correct)
        if rank == 0:
            print(f"final accuracy: {correct.item() / len(y_test):.1%} ({world} rank{'s' if world > 1 else ''}, "
                  f"{'FSDP2' if args.fsdp2 and world > 1 else 'DDP' if world > 1 else 'one process'} on "
                  f"{device.type})", flush=True)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return correct.item() / len(y_test)


if __name__ == "__main__":
    main()
