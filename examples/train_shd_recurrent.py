"""Train a recurrent adaptive-LIF network on the Spiking Heidelberg Digits (SHD), or on synthetic data of its shape.

    python examples/train_shd_recurrent.py                                # synthetic data: seconds on a CPU
    python examples/train_shd_recurrent.py --data ~/shd --download        # fetch SHD into ~/shd, then train on it
    python examples/train_shd_recurrent.py --data ~/shd --steps 100 --hidden 256 --epochs 30 --batch-size 256

SHD (Cramer et al., IEEE TNNLS 2022; CC BY 4.0): spoken digits 0-9 in English and German, 20 classes, as spike
events in 700 channels of a cochlea model. The files shd_train.h5 and shd_test.h5 come gzipped from
https://zenkelab.org/datasets/ (mirror: https://compneuro.net/datasets/); --download fetches and unpacks them into
--data, and reading them needs h5py (pip install h5py). Each sample's events are binned into --steps time steps
over its first --duration seconds. Without the files the example makes synthetic data of the same shape: each class
is a band of channels sweeping across the 700 inputs at its own start and end, with background events.

The network: 700 inputs -> dense synapses -> a recurrent layer of adaptive LIF neurons (`flexgen.Dense` feeding
`flexgen.Recurrent` with `flexgen.neurons.alif`: the spikes of the step before, times a learned weight, are added
to the input) -> Linear readout, averaged over time, trained with cross-entropy through time. For long samples
(--steps in the thousands), --checkpoint-every K trains in the long-sequence mode: the layer keeps its input
spikes as bits and its states every K steps, and the backward recomputes the steps in between. --recurrent-delay K
sends each neuron's spikes through a learned delay line of up to K steps before the recurrent product (delays
start spread over [0, K], learn at their own rate and are clamped back into range after each step). With
--delay-sigma S they follow DCLS's recipe: gaussian taps of width S steps, annealed linearly to 0.5 over the
epochs, then for the final test the delays rounded to whole steps and read through linear taps (an exact shift).
--per-synapse gives each recurrent synapse its own delay instead (`flexgen.SynapseDelay`, hidden x hidden delays).
On a GPU the recurrent layer runs as two fused kernels; on the CPU step by step (the path is printed). Exits with status 1 if the final test accuracy is
not above --min-accuracy.
"""
import argparse
import gzip
import pathlib
import shutil
import sys
import time
import urllib.request

import torch

import flexgen

try:
    from tqdm import tqdm
except ImportError as exc:  # an optional dependency of this example
    sys.exit(f"train_shd_recurrent.py needs tqdm ({exc}); pip install tqdm")

CHANNELS, CLASSES = 700, 20
SHD_URL = "https://zenkelab.org/datasets"


class SpikeData:
    """Spike events of labelled samples; `batch(indices)` gives them binned, as [T, B, 700] floats."""

    def __init__(self, events, labels):
        self.events, self.labels = events, labels  # events: [N, T, 700] bool

    def __len__(self):
        return len(self.labels)

    def batch(self, indices, device):
        return self.events[indices].transpose(0, 1).to(device=device, dtype=torch.float32)


def synthetic_shd(n, steps, seed):
    """SHD-shaped data: class c is a band of channels whose centre sweeps from start[c] to end[c] over the sample
    (jittered per sample), events in it with probability up to 0.3, plus background events everywhere. Classes
    with the same start part only later in the sample: telling them apart takes memory."""
    g = torch.Generator().manual_seed(seed)
    starts, ends = torch.meshgrid(torch.linspace(70, 630, 5), torch.linspace(100, 600, 4), indexing="ij")
    labels = torch.randint(CLASSES, (n,), generator=g)
    progress = torch.linspace(0.0, 1.0, steps)
    start, end = starts.reshape(-1)[labels, None], ends.reshape(-1)[labels, None]  # classes that share a start
    centre = start + (end - start) * progress + torch.randn(n, 1, generator=g) * 15.0  # [n, T]
    distance = (torch.arange(CHANNELS) - centre[..., None]) / 25.0  # [n, T, 700]
    probability = 0.3 * torch.exp(-distance * distance) + 0.005
    return SpikeData(torch.rand(n, steps, CHANNELS, generator=g) < probability, labels)


def download_shd(folder):
    """shd_train.h5 and shd_test.h5 in `folder`, fetched from zenkelab.org where missing."""
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        target = folder / f"shd_{split}.h5"
        if target.exists():
            continue
        packed = folder / f"shd_{split}.h5.gz"
        print(f"downloading {SHD_URL}/{packed.name} ...")
        urllib.request.urlretrieve(f"{SHD_URL}/{packed.name}", packed)
        with gzip.open(packed, "rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
        packed.unlink()


def load_shd(path, steps, duration):
    """One SHD file as `SpikeData`: each sample's events binned into `steps` bins over `duration` seconds."""
    try:
        import h5py
    except ImportError:
        sys.exit("reading SHD needs h5py: pip install h5py")
    with h5py.File(path, "r") as f:
        times, units, labels = f["spikes"]["times"][:], f["spikes"]["units"][:], f["labels"][:]
    events = torch.zeros(len(labels), steps, CHANNELS, dtype=torch.bool)
    for k, (t, u) in enumerate(zip(times, units)):
        t, u = torch.as_tensor(t, dtype=torch.float64), torch.as_tensor(u, dtype=torch.long)
        keep = t < duration
        events[k, (t[keep] / duration * steps).long().clamp_max(steps - 1), u[keep]] = True
    return SpikeData(events, torch.as_tensor(labels, dtype=torch.long))


class RecurrentSNN(torch.nn.Module):
    def __init__(self, hidden, tau, tau_a, checkpoint_every=None, recurrent_delay=None, delay_sigma=None,
                 per_synapse=False):
        super().__init__()
        delay = None
        if recurrent_delay:  # learned delays on the spikes fed back: one per neuron, or one per synapse
            taps = dict(interpolation="gaussian", sigma=delay_sigma) if delay_sigma else {}
            line, shape = (flexgen.SynapseDelay, (hidden, hidden)) if per_synapse else (flexgen.Delay, (hidden,))
            delay = line(hidden, recurrent_delay, delay=torch.rand(shape) * recurrent_delay, **taps)
        self.recurrent = flexgen.Recurrent(flexgen.neurons.alif, hidden=hidden, tau=tau, tau_a=tau_a, delay=delay)
        # the input projection (with its bias) feeding the recurrent layer; it acts on all T steps at once
        self.layer = flexgen.Dense(CHANNELS, hidden, self.recurrent, checkpoint_every=checkpoint_every)
        with torch.no_grad():  # sparse binary inputs: 10x nn.Linear's initial weights make neurons fire from the start
            self.layer.weight.mul_(10.0)
        self.readout = torch.nn.Linear(hidden, CLASSES)

    def forward(self, x):
        """x: [T, B, 700] events; returns class scores [B, 20], the readout averaged over time."""
        return self.readout(self.layer(x)).mean(dim=0)


def accuracy(model, data, device, batch_size):
    correct = 0
    with torch.no_grad():
        for idx in torch.arange(len(data)).split(batch_size):
            correct += (model(data.batch(idx, device)).argmax(dim=1).cpu() == data.labels[idx]).sum().item()
    return correct / len(data)


def datasets(args):
    if args.data and (args.download or (pathlib.Path(args.data) / "shd_train.h5").exists()):
        folder = pathlib.Path(args.data).expanduser()
        if args.download:
            download_shd(folder)
        print(f"SHD from {folder}")
        return (load_shd(folder / "shd_train.h5", args.steps, args.duration),
                load_shd(folder / "shd_test.h5", args.steps, args.duration))
    print(f"synthetic SHD-shaped data ({args.samples} training samples; --data DIR for the real dataset)")
    return synthetic_shd(args.samples, args.steps, args.seed), synthetic_shd(args.samples // 4, args.steps, args.seed + 1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="a folder with shd_train.h5 and shd_test.h5 (default: synthetic data)")
    parser.add_argument("--download", action="store_true", help="fetch SHD into --data first")
    parser.add_argument("--steps", type=int, default=40, help="time steps per sample (T)")
    parser.add_argument("--duration", type=float, default=1.0, help="seconds of each SHD sample binned into T steps")
    parser.add_argument("--samples", type=int, default=480, help="synthetic training samples")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tau", type=float, default=5.0, help="membrane time constant, in steps")
    parser.add_argument("--tau-a", type=float, default=40.0, help="adaptation time constant, in steps")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--min-accuracy", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, metavar="K",
                        help="long sequences: keep the states every K steps and recompute the rest in the backward")
    parser.add_argument("--recurrent-delay", type=int, metavar="K",
                        help="learned per-neuron delays of up to K steps on the recurrent spikes")
    parser.add_argument("--delay-lr", type=float, default=0.5, help="the delays' learning rate (they move in steps)")
    parser.add_argument("--delay-sigma", type=float, metavar="S",
                        help="DCLS's recipe: gaussian taps of width S steps annealed to 0.5, then rounded delays")
    parser.add_argument("--per-synapse", action="store_true",
                        help="with --recurrent-delay: a delay per recurrent synapse instead of per neuron")
    args = parser.parse_args(argv)
    if args.download and not args.data:
        parser.error("--download needs --data DIR")
    if args.delay_sigma is not None and (not args.recurrent_delay or not args.delay_sigma > 0):
        parser.error("--delay-sigma needs --recurrent-delay K and a width > 0")
    if args.per_synapse and not args.recurrent_delay:
        parser.error("--per-synapse needs --recurrent-delay K")

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # step by step the work per op is small: a thread pool costs more than it gives
    train, test = datasets(args)
    model = RecurrentSNN(args.hidden, args.tau, args.tau_a, args.checkpoint_every, args.recurrent_delay,
                         args.delay_sigma, args.per_synapse).to(device)
    if args.checkpoint_every:
        print(f"long-sequence mode: the recurrent layer keeps its input as bits and its states every "
              f"{args.checkpoint_every} steps")
    delays = [model.recurrent.delay.delay] if args.recurrent_delay else []
    if delays:
        per = "synapse" if args.per_synapse else "neuron"
        print(f"recurrent delays: up to {args.recurrent_delay} steps per {per}, learning rate {args.delay_lr}")
        initial_delays = delays[0].detach().clone()
    others = [p for p in model.parameters() if all(p is not d for d in delays)]
    optimizer = torch.optim.Adam([{"params": others}, {"params": delays, "lr": args.delay_lr}], lr=args.lr)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        if args.delay_sigma:  # linearly from S at the first epoch to 0.5 at the last
            progress = (epoch - 1) / max(1, args.epochs - 1)
            model.recurrent.delay.sigma = args.delay_sigma + (min(0.5, args.delay_sigma) - args.delay_sigma) * progress
        batches = tqdm(torch.randperm(len(train)).split(args.batch_size), desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for idx in batches:
            loss = torch.nn.functional.cross_entropy(model(train.batch(idx, device)), train.labels[idx].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if delays:
                model.recurrent.delay.clamp_()
            batches.set_postfix(loss=f"{loss.item():.3f}")
        print(f"epoch {epoch}: loss {loss.item():.3f}, test accuracy {accuracy(model, test, device, args.batch_size):.3f} "
              f"(recurrent layer: {model.recurrent.path})")

    if args.delay_sigma:
        print(f"gaussian taps (sigma {model.recurrent.delay.sigma:.2f}): test accuracy "
              f"{accuracy(model, test, device, args.batch_size):.3f}; now rounded delays, linear taps")
        model.recurrent.delay.round_()
        model.recurrent.delay.interpolation = "linear"
    final = accuracy(model, test, device, args.batch_size)
    print(f"final test accuracy: {final:.3f} ({time.perf_counter() - start:.1f} s)")
    if delays:
        moved = (delays[0].detach() - initial_delays).abs().mean().item()
        print(f"the recurrent delays moved {moved:.2f} steps on average")
    if final <= args.min_accuracy:
        print(f"FAILED: accuracy {final:.3f} is not above {args.min_accuracy}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
