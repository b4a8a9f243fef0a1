"""Stream a recurrent spiking network one step at a time, as a real-time system feeds it, with `flexgen.Stream`.

    python examples/stream_model.py [--steps 50] [--batch 1] [--hidden 64]

The network: Linear -> recurrent LIF -> Linear -> LIF reading its input through per-channel delays -> Linear
readout. The stream runs it one step a call with every layer's states on the device (a captured CUDA graph on a
GPU; on the CPU the C kernels where a C compiler is, else the generated torch code), and the script checks that
the streamed outputs equal one call over the whole sequence, reads the states out, and resets the stream for a new
sequence.
"""
import argparse
import time

import torch

import flexgen


def network(inputs, hidden, outputs):
    delays = flexgen.Delay(hidden, max_delay=4, delay=torch.linspace(0.0, 4.0, hidden), learnable=False)
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden),
        flexgen.Recurrent(flexgen.LIF, hidden=hidden, bias=True),
        torch.nn.Linear(hidden, hidden),
        flexgen.LIF(tau=2.0, step_mode="m", delay=delays),
        torch.nn.Linear(hidden, outputs),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    torch.manual_seed(0)
    model = network(20, args.hidden, 5).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        model[0].weight.mul_(4.0)
        model[2].weight.mul_(4.0)
    x = (torch.rand(args.steps, args.batch, 20, device=device) < 0.3).to(dtype)  # input spikes

    with torch.no_grad():  # the reference: one call over the whole sequence
        whole = model(x)
    flexgen.reset(model)

    stream = flexgen.Stream(model, x[0])
    print(stream)
    outputs, times = [], []
    for t in range(args.steps):  # a real-time loop: one step's input in, its output out
        start = time.perf_counter()
        y = stream(x[t])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6)
        outputs.append(y.clone())  # (the stream reuses its output buffer on a GPU)
    streamed = torch.stack(outputs)
    error = (streamed - whole).abs().max().item()
    print(f"{args.steps} steps, one a call: median {sorted(times)[len(times) // 2]:.0f} us a step; "
          f"largest difference from the whole-sequence call {error:.1e}")
    for layer, kept in stream.states().items():
        print(f"layer {layer}: " + ", ".join(f"{name} {list(v.shape)}" for name, v in kept.items()))
    stream.reset()  # a new sequence starts from the initial states
    again = torch.stack([stream(x[t]).clone() for t in range(args.steps)])
    stream.close()
    tolerance = 1e-12 if dtype == torch.float64 else 1e-4
    if error > tolerance or not torch.allclose(again, streamed, rtol=0, atol=tolerance):
        raise SystemExit(f"FAILED: the streamed outputs differ from the whole-sequence call by {error:.1e}")
    print(f"OK: {args.steps} streamed steps equal the whole-sequence call, and again after reset()")


if __name__ == "__main__":
    main()
