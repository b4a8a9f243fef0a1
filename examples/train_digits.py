"""Train a small spiking MLP on scikit-learn's bundled 8x8 digits (no download).

    python examples/train_digits.py [--epochs 8] [--steps 8] [--min-accuracy 0.85]

64 pixels -> Linear -> LIF (128) -> Linear -> LIF (10). Each image is presented
for T steps (the pixel intensities are the input current at every step); the
predicted class is the output neuron that fires most. The loss is the mean
squared error between the output firing rates and the one-hot label, and the
gradients flow back through time through flexgen's generated backward (the
spike's surrogate gradient). Exits with status 1 if the final test accuracy is
below --min-accuracy.
"""
import argparse
import sys
import time

import torch

import flexgen

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tqdm import tqdm
except ImportError as exc:  # optional dependencies of this example
    sys.exit(f"train_digits.py needs scikit-learn and tqdm ({exc}); pip install scikit-learn tqdm")


@flexgen.neuron(states=("v",))
def lif(x, v, tau=2.0, v_th=1.0):
    h = v + (x - v) / tau
    s = flexgen.spike(h - v_th)
    return s, h * (1.0 - s)


class SpikingMLP(torch.nn.Module):
    def __init__(self, hidden=128, tau=2.0):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.lif1 = lif(tau=tau)
        self.fc2 = torch.nn.Linear(hidden, 10)
        self.lif2 = lif(tau=tau)

    def forward(self, images, n_steps):
        """images: [batch, 64] in [0, 1]; returns output firing rates [batch, 10]."""
        self.lif1.reset()  # every batch starts from v = 0
        self.lif2.reset()
        x_seq = images.unsqueeze(0).expand(n_steps, -1, -1)    # [T, batch, 64], the same current each step
        s1 = self.lif1(self.fc1(x_seq))                        # Linear acts on the last dim: all T steps at once
        s2 = self.lif2(self.fc2(s1))
        return s2.mean(dim=0)


def accuracy(model, images, labels, n_steps):
    with torch.no_grad():
        return (model(images, n_steps).argmax(dim=1) == labels).float().mean().item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="time steps per image (T)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--min-accuracy", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0             # pixels 0..16 -> [0, 1]
    y = torch.tensor(digits.target)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=args.seed, stratify=y)

    model = SpikingMLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train))
        batches = tqdm(order.split(args.batch_size), desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for idx in batches:
            rates = model(x_train[idx], args.steps)
            loss = torch.nn.functional.mse_loss(rates, torch.nn.functional.one_hot(y_train[idx], 10).float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            batches.set_postfix(loss=f"{loss.item():.4f}")
        print(f"epoch {epoch}: loss {loss.item():.4f}, test accuracy {accuracy(model, x_test, y_test, args.steps):.3f}")

    final = accuracy(model, x_test, y_test, args.steps)
    print(f"final test accuracy: {final:.3f} ({time.perf_counter() - start:.1f} s)")
    if final <= args.min_accuracy:
        print(f"FAILED: accuracy {final:.3f} is not above {args.min_accuracy}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
