"""How many steps the gaussian delay line's Triton kernels sum at once (`flexgen.render.contexts.TAP_CHUNK`): a neuron layer
of 700 LIF neurons with gaussian taps (sigma 2), fp32, input spikes at rate 0.05, forward alone (no autograd) and
forward + backward, `triton.testing.do_bench` medians on a GPU.

    python benchmarks/sweep_tap_chunk.py CHUNK      # one process per chunk: the kernels are generated for it

Each run generates its kernels into a fresh cache folder, since the chunk is a constant of the generated source.
Recorded: docs/perf/h100/tap_chunk_*.log (see docs/perf/NOTES.md).
"""
import atexit
import os
import shutil
import sys
import tempfile

os.environ["FLEXGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="flexgen-tap-chunk-")
atexit.register(shutil.rmtree, os.environ["FLEXGEN_CACHE_DIR"], ignore_errors=True)
import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flexgen  # noqa: E402
import flexgen.render.contexts  # noqa: E402

SHAPES = ((250, 32, 250), (1000, 32, 250), (1000, 256, 250), (1000, 32, 25), (250, 256, 25))  # T, B, max_delay


def measure(steps, batch, max_delay):
    delay = flexgen.Delay(700, max_delay, delay=torch.rand(700) * max_delay, interpolation="gaussian", sigma=2.0)
    layer = flexgen.LIF(step_mode="m", delay=delay).cuda()
    x = (torch.rand(steps, batch, 700, device="cuda") < 0.05).float().requires_grad_()
    grad = torch.randn(steps, batch, 700, device="cuda")

    def forward():
        flexgen.reset(layer)
        with torch.no_grad():
            layer(x)

    def forward_backward():
        flexgen.reset(layer)
        layer(x).backward(grad)

    return (triton.testing.do_bench(forward, return_mode="median"),
            triton.testing.do_bench(forward_backward, grad_to_none=[x], return_mode="median"))


def main():
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    flexgen.render.contexts.TAP_CHUNK = int(sys.argv[1])
    for steps, batch, max_delay in SHAPES:
        fwd, both = measure(steps, batch, max_delay)
        print(f"chunk {sys.argv[1]:>2s} T {steps:4d} B {batch:3d} K {max_delay:3d}: fwd {fwd:8.3f} ms  "
              f"fwd+bwd {both:8.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
