"""Export a spiking network for deployment: torch.export (the number of steps symbolic), saved and loaded again in
a fresh process that never builds the layers, compared with the eager model.

    python examples/export_model.py [--steps 20]
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch

import flexgen

LOAD = """
import sys, torch, flexgen
program = flexgen.load_exported(sys.argv[1])  # registers the flexgen ops the program names, from the kernel cache
x, expected = torch.load(sys.argv[2])
print("fresh process: equal to eager:", torch.equal(program.module()(x), expected))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    steps = parser.parse_args().steps
    torch.manual_seed(0)
    model = flexgen.Chain(flexgen.Dense(16, 32, flexgen.LIF), flexgen.Dense(32, 4, flexgen.LIF)).eval()
    x = (torch.rand(steps, 2, 16) < 0.4).float()

    with torch.no_grad():
        program = flexgen.export_model(model, (x,))  # layers reset: the program starts from the initial states
    print("flexgen ops in the program:", ", ".join(flexgen.interop.export.flexgen_ops(program)))

    longer = (torch.rand(2 * steps, 2, 16) < 0.4).float()  # another T: the program's T is a symbol
    flexgen.reset(model)
    expected = model(longer)
    same = torch.equal(program.module()(longer), expected)
    print(f"T {2 * steps}: equal to eager: {same}; spikes out: {int(expected.sum())}")

    with tempfile.TemporaryDirectory() as tmp:
        path, io = os.path.join(tmp, "model.pt2"), os.path.join(tmp, "io.pt")
        flexgen.save_exported(program, path)
        torch.save((longer, expected), io)
        done = subprocess.run([sys.executable, "-c", LOAD, path, io], capture_output=True, text=True)
        print(done.stdout.strip() or done.stderr[-2000:])
    ok = same and "equal to eager: True" in done.stdout
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
