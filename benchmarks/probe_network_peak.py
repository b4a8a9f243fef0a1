"""Where the Open Neuromorphic shape's peak memory comes from, flexgen against SpikingJelly: one forward +
backward of `bench_memory.py`'s Linear(n, n) + LIF network, measured as that benchmark measures it (warmed, cache
emptied, peak above what was allocated before), with three peaks side by side:

  allocated   torch.cuda.max_memory_allocated(): the blocks handed out, which the caching allocator may round up
              (a request that leaves less than 1 MiB of a cached segment gets the whole rest of it);
  requested   the bytes the tensors asked for (`requested_bytes.all.peak`): what the library itself keeps;
  reserved    the segments taken from the driver (what nvidia-smi and out-of-memory errors see).

With `--trace`, then every allocation and free of the measured call in order, with its size and where Python
asked for it (SpikingJelly's AMP path allocates about 11,500 times a call). Needs a CUDA GPU and SpikingJelly;
standard output only.

    python benchmarks/probe_network_peak.py [--sizes 512 4096] [--amp] [--trace]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_memory  # noqa: E402

CANDIDATES = ("flexgen Linear + LIF", "SpikingJelly Linear + LIFNode")


def peaks(model, x, amp):
    """(allocated, requested, reserved) peaks in MiB above the call's start, and the allocator's trace of it."""
    bench_memory.network_step(model, x, amp)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    bench_memory.network_step(model, x, amp)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    mib = [(after[f"{k}.all.peak"] - before[f"{k}.all.current"]) / 2**20
           for k in ("allocated_bytes", "requested_bytes", "reserved_bytes")]
    return mib, trace


def where(event):
    frames = [f for f in event.get("frames", []) if f["filename"].endswith(".py") and "/torch/" not in f["filename"]]
    return "; ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames[:2]) or "(autograd)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512])
    parser.add_argument("--amp", action="store_true", help="autocast to fp16, as the benchmark's AMP rows")
    parser.add_argument("--trace", action="store_true", help="print every allocation and free of each call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; [500, 16, n], "
          f"{'AMP fp16' if args.amp else 'fp32'}")
    for n in args.sizes:
        x = torch.rand(bench_memory.ON_STEPS, bench_memory.ON_BATCH, n, device="cuda")
        models = bench_memory.network_candidates(n, 1)
        for name in CANDIDATES:
            if name not in models:
                print(f"{name}: not installed", file=sys.stderr)
                return 2
            (allocated, requested, reserved), trace = peaks(models[name][0], x, args.amp)
            print(f"\n== n {n}, {name}: peak above the call's start: allocated {allocated:.4f} MiB, "
                  f"requested {requested:.4f} MiB, reserved {reserved:.1f} MiB")
            for event in trace if args.trace else ():
                if event["action"] in ("alloc", "free_requested", "segment_alloc"):
                    print(f"  {event['action']:15s} {event['size']:>11d} B  {where(event)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
