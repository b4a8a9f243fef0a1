"""Learned synaptic delays (DCLS's recipe) on data whose classes differ only in timing, with and without delays.

    python examples/train_shd_delays.py                        # synthetic timing data: seconds on a CPU
    python examples/train_shd_delays.py --data ~/shd --steps 100 --hidden 128 --max-delay 25 --epochs 20

The synthetic data: in every sample two marker channels fire once each, the second `lag` steps after the first,
at a random start, among background events in the other channels; the class is the lag (one of --classes lags
up to --max-lag steps). A neuron with a short membrane time constant sees both markers together only if their
synapses delay the first marker by the lag: without delays a network cannot tell the lags apart (beyond "both at
once"), with learned delays it can. With --data DIR holding SHD's shd_train.h5 and shd_test.h5 (see
train_shd_recurrent.py, whose reader this uses) it trains on SHD instead.

The network: inputs -> `flexgen.DelayedLinear` (a weight and a delay per synapse) -> LIF -> `flexgen.DelayedLinear`
-> LIF -> Linear readout of the spike counts. DCLS's recipe: the delays have their own learning rate, start spread
over [0, max_delay] with Gaussian taps of width --sigma, which anneals to --sigma-end over training; afterwards the
delays are rounded to whole steps and the taps switched to linear (exact shifts) for the test. The same network with
fixed zero delays (plain dense synapses) is trained alongside. Exits with status 1 if the delayed network's test
accuracy is not above --min-accuracy and the undelayed one's by --min-gain.
"""
import argparse
import pathlib
import sys
import time

import torch

import flexgen


def timing_data(n, steps, channels, classes, max_lag, seed):
    """[T, N, channels] events and labels: marker channels 0 and 1 fire once, `lags[label]` steps apart."""
    g = torch.Generator().manual_seed(seed)
    lags = torch.linspace(0, max_lag, classes).round().long()
    labels = torch.randint(classes, (n,), generator=g)
    events = torch.rand(steps, n, channels, generator=g) < 0.02  # background
    events[:, :, :2] = False
    start = torch.randint(0, steps - max_lag - 1, (n,), generator=g)
    rows = torch.arange(n)
    events[start, rows, 0] = True
    events[start + lags[labels], rows, 1] = True
    return events.float(), labels


class DelayedSNN(torch.nn.Module):
    def __init__(self, inputs, hidden, classes, max_delay, sigma, learn_delays):
        super().__init__()
        options = dict(max_delay=max_delay, interpolation="gaussian", sigma=sigma) if learn_delays else dict(
            max_delay=0, delay=0.0, learnable=False)
        self.synapses = torch.nn.ModuleList([flexgen.DelayedLinear(inputs, hidden, **options),
                                             flexgen.DelayedLinear(hidden, hidden, **options)])
        with torch.no_grad():  # sparse events: larger weights than nn.Linear's make neurons fire from the start
            for layer in self.synapses:
                layer.weight.mul_(2.0)
        self.neurons = torch.nn.ModuleList([flexgen.LIF(tau=2.0, step_mode="m"), flexgen.LIF(tau=2.0, step_mode="m")])
        self.readout = torch.nn.Linear(hidden, classes)

    def delays(self):
        return [layer for layer in self.synapses if layer.learnable]

    def forward(self, x):
        for synapses, neurons in zip(self.synapses, self.neurons):
            neurons.reset()
            x = neurons(synapses(x))
        return self.readout(x.sum(dim=0))


def train(model, data, args, name):
    train_x, train_y, test_x, test_y = data
    delays = [layer.delay for layer in model.delays()]
    others = [p for p in model.parameters() if all(p is not d for d in delays)]
    groups = [{"params": others}] + ([{"params": delays, "lr": args.delay_lr}] if delays else [])
    optimizer = torch.optim.Adam(groups, lr=args.lr)
    for epoch in range(args.epochs):
        progress = epoch / max(args.epochs - 1, 1)
        for layer in model.delays():  # anneal the Gaussian's width towards --sigma-end
            layer.sigma = args.sigma + (args.sigma_end - args.sigma) * progress
        for idx in torch.randperm(len(train_y)).split(args.batch_size):
            loss = torch.nn.functional.cross_entropy(model(train_x[:, idx]), train_y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            for layer in model.delays():
                layer.clamp_()
    for layer in model.delays():  # inference: whole steps, exact shifts
        layer.round_()
        layer.interpolation = "linear"
    with torch.no_grad():
        accuracy = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
    print(f"{name}: loss {loss.item():.3f}, test accuracy {accuracy:.3f}")
    return accuracy


def datasets(args):
    if args.data:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from train_shd_recurrent import load_shd

        folder = pathlib.Path(args.data).expanduser()
        train, test = (load_shd(folder / f"shd_{split}.h5", args.steps, args.duration) for split in ("train", "test"))
        print(f"SHD from {folder}")
        return (train.batch(torch.arange(len(train)), "cpu"), train.labels,
                test.batch(torch.arange(len(test)), "cpu"), test.labels), 700, 20
    print(f"synthetic timing data: {args.classes} lags up to {args.max_lag} steps between two marker channels")
    train = timing_data(args.samples, args.steps, args.channels, args.classes, args.max_lag, args.seed)
    test = timing_data(args.samples // 4, args.steps, args.channels, args.classes, args.max_lag, args.seed + 1)
    return (*train, *test), args.channels, args.classes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", help="a folder with SHD's shd_train.h5 and shd_test.h5 (default: synthetic data)")
    parser.add_argument("--steps", type=int, default=40, help="time steps per sample (T)")
    parser.add_argument("--duration", type=float, default=1.0, help="seconds of each SHD sample binned into T steps")
    parser.add_argument("--samples", type=int, default=384, help="synthetic training samples")
    parser.add_argument("--channels", type=int, default=12, help="synthetic input channels")
    parser.add_argument("--classes", type=int, default=4, help="synthetic classes (lags)")
    parser.add_argument("--max-lag", type=int, default=12, help="the largest synthetic lag, in steps")
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--max-delay", type=int, default=16)
    parser.add_argument("--sigma", type=float, default=2.0, help="the Gaussian taps' initial width, in steps")
    parser.add_argument("--sigma-end", type=float, default=0.3, help="its width in the last epoch")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--delay-lr", type=float, default=0.3, help="the delays' learning rate, in steps")
    parser.add_argument("--min-accuracy", type=float, default=0.8)
    parser.add_argument("--min-gain", type=float, default=0.2, help="how much better than without delays")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.data is None and args.max_lag >= min(args.steps - 1, args.max_delay + 1):
        parser.error("--max-lag must be below --steps - 1 and at most --max-delay")

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    data, inputs, classes = datasets(args)
    start = time.perf_counter()
    results = {}
    for name, learn in (("without delays", False), ("with learned delays", True)):
        torch.manual_seed(args.seed)
        model = DelayedSNN(inputs, args.hidden, classes, args.max_delay, args.sigma, learn)
        results[name] = train(model, data, args, name)
    gain = results["with learned delays"] - results["without delays"]
    print(f"gain from delays: {gain:+.3f} ({time.perf_counter() - start:.1f} s)")
    if results["with learned delays"] <= args.min_accuracy or gain <= args.min_gain:
        print(f"below --min-accuracy {args.min_accuracy} or --min-gain {args.min_gain}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
