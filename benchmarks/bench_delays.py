"""A layer of synapses with learnable delays at SHD's shapes: flexgen.DelayedLinear's backends against each other
and against the `dcls` package's Dcls1d, forward + backward, on a GPU.

    python benchmarks/bench_delays.py [--out DIR] [--steps 100 250] [--delays 25 100 250] [--batch 32 256]
                                      [--dtypes fp32 bf16]
    python benchmarks/bench_delays.py --variants      # probe: the fused kernels' tile sizes, each kernel alone
    python benchmarks/bench_delays.py --dry-run       # the script on the CPU at tiny sizes (Triton's interpreter)

The layer: 700 -> 256 synapses, no bias (DCLS's SHD model has none), each with a weight and a delay in
[0, max_delay], drawn uniformly. Candidates: `flexgen.DelayedLinear` with linear taps on its default backend
("flexgen auto", what a user gets), on the two-tap kernels ("flexgen fused"), on one tensor-core product per tap
("flexgen taps") and on its convolution with a dense [out, in, max_delay + 1] kernel ("flexgen conv", the
construction of dcls); with Gaussian taps on its default backend ("flexgen gauss", the products per tap);
dcls's `Dcls1d` with version "v0" (linear taps: the same synapses, its positions set from the delays) and
"gauss" (Gaussian taps), both run as that model runs them: [T, B, in] permuted to [B, in, T], padded by max_delay
on the left, the output permuted back. The Gaussian candidates' sigma is fixed at max_delay // 2, as DCLS's SHD
model starts. The input is a spike train [T, B, 700] (rate 0.1) that requires a gradient (a hidden layer's case), the
output's gradient a fixed random tensor. bf16 runs the candidates under torch.autocast(bfloat16) on bf16 spikes,
with fp32 parameters.

Time: `triton.testing.do_bench`'s median of forward + backward over two cycling inputs, ms; cuDNN runs the
convolutions and flexgen's products per tap with torch's defaults (`torch.backends.cudnn.allow_tf32`: TF32 allowed
for fp32), or with `--no-tf32` without TF32 (cuDNN in full fp32, the products per tap at 3xTF32; the two-tap
kernels are exact fp32 either way). Memory: the peak of forward + backward above what was
allocated before (parameters, inputs, the output's gradient), MiB. Before timing, with TF32 off, the output and
gradients of "flexgen fused" and "flexgen taps" are compared with the convolution's and with dcls v0's on the GPU
(the largest difference relative to the reference's largest value, recorded), and their output and grad x with
the convolution in float64 on the CPU for the first two batch rows, which must agree within CHECK_TOLERANCE (a
failure is recorded and makes the exit status 1). Writes bench_delays.json and .md to DIR (default docs/perf)
after every shape; `--replot JSON` redraws the table of a recorded run.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
N_IN, N_OUT, RATE = 700, 256, 0.1
CHECK_TOLERANCE = {"fp32": 1e-3, "bf16": 1e-1}  # fp32 with TF32 off; bf16: gross errors only


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (default docs/perf; a temporary folder with --dry-run)")
    p.add_argument("--steps", type=int, nargs="+", default=[100, 250])
    p.add_argument("--delays", type=int, nargs="+", default=[25, 100, 250], help="max_delay values")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    p.add_argument("--dtypes", choices=("fp32", "bf16"), nargs="+", default=["fp32", "bf16"])
    p.add_argument("--no-tf32", action="store_true",
                   help="run cuDNN's convolutions in full fp32 (torch.backends.cudnn.allow_tf32 = False) when timing")
    p.add_argument("--variants", action="store_true", help="probe the fused kernels' tile sizes (prints only)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU (Triton's interpreter)")
    p.add_argument("--replot", metavar="JSON", help="redraw the table of a recorded run (no GPU needed)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.steps, args.delays, args.batch, args.dtypes = [6], [3], [2], ["fp32"]
    return args


if __name__ == "__main__":
    ARGS = parse_args()
    if ARGS.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, ROOT)
import flexgen  # noqa: E402


def dcls_layer(version, max_delay, device, n_in, n_out):
    from DCLS.construct.modules import Dcls1d

    layer = Dcls1d(n_in, n_out, kernel_count=1, dilated_kernel_size=max_delay + 1, bias=False, version=version)
    if version == "gauss":
        with torch.no_grad():
            layer.SIG.fill_(max_delay // 2)
        layer.SIG.requires_grad_(False)
    return layer.to(device)


def same_synapses(dcls, layer):
    """dcls's weights and positions set to `layer`'s synapses (its tap k weighs the padded input t + k, and it
    adds dilated_kernel_size // 2 to a position: delay d sits at max_delay - d - (max_delay + 1) // 2)."""
    with torch.no_grad():
        dcls.weight.copy_(layer.weight.unsqueeze(-1))
        dcls.P.copy_((layer.max_delay - layer.delay - (layer.max_delay + 1) // 2)[None, :, :, None])


class ShdStyle(torch.nn.Module):
    """A Dcls1d as DCLS's SHD model runs it: [T, B, in] -> [B, in, T], padded on the left, and back."""

    def __init__(self, dcls, max_delay):
        super().__init__()
        self.dcls, self.max_delay = dcls, max_delay

    def forward(self, x):
        return self.dcls(F.pad(x.permute(1, 2, 0), (self.max_delay, 0))).permute(2, 0, 1)


CANDIDATES = ("flexgen auto", "flexgen fused", "flexgen taps", "flexgen conv", "flexgen gauss", "dcls v0", "dcls gauss")
CHECKED = ("flexgen fused", "flexgen taps")


def candidates(max_delay, device, n_in, n_out):
    """name -> module, all holding the same synapses (the Gaussian ones: their weights and centres)."""
    auto = flexgen.DelayedLinear(n_in, n_out, max_delay, bias=False).to(device)
    made = {"flexgen auto": auto}
    for name, options in (("flexgen fused", dict(backend="fused")), ("flexgen taps", dict(backend="taps")),
                          ("flexgen conv", dict(backend="conv")),
                          ("flexgen gauss", dict(interpolation="gaussian", sigma=max(max_delay // 2, 1)))):
        made[name] = flexgen.DelayedLinear(n_in, n_out, max_delay, bias=False, **options).to(device)
        made[name].load_state_dict(auto.state_dict())
    try:
        for version in ("v0", "gauss"):
            dcls = dcls_layer(version, max_delay, device, n_in, n_out)
            same_synapses(dcls, auto)
            made[f"dcls {version}"] = ShdStyle(dcls, max_delay)
    except ImportError:
        print("dcls is not installed: left out", file=sys.stderr)
    return made


def fwd_bwd(model, x, grad, autocast):
    model.zero_grad(set_to_none=True)  # no accumulation into earlier gradients in the timed step
    x.grad = None
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    y.backward(grad)


def outputs_and_grads(model, x, grad, autocast):
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = model(x)
    y.backward(grad)
    if isinstance(model, ShdStyle):  # dcls's position is max_delay - delay - const: the delay's gradient is -P's
        weight, delay = model.dcls.weight.grad[:, :, 0], -model.dcls.P.grad[0, :, :, 0]
    else:
        weight, delay = model.weight.grad, model.delay.grad
    result = {"output": y.detach().float(), "grad x": x.grad.float(), "grad weight": weight.float(),
              "grad delay": delay.float()}
    model.zero_grad(set_to_none=True)
    return result


def relative_errors(got, want):
    return {k: float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-30)) for k in want}


def float64_reference(layer, x, grad, rows=2):
    """Output and grad x of the first `rows` batch rows through the convolution in float64 on the CPU (batch rows
    are independent, so a slice of the batch checks every synapse at a fraction of the cost)."""
    conv = flexgen.DelayedLinear(layer.in_features, layer.out_features, layer.max_delay, bias=False, backend="conv",
                                 dtype=torch.float64)
    conv.load_state_dict({k: v.detach().double().cpu() for k, v in layer.state_dict().items()})
    conv.requires_grad_(False)
    x = x[:, :rows].detach().double().cpu().requires_grad_()
    y = conv(x)
    y.backward(grad[:, :rows].double().cpu())
    return {"output": y.detach(), "grad x": x.grad}


def check(made, name, x, grad, autocast, dtype_name):
    """Candidate `name` against float64 on the CPU (first batch rows: output, grad x), and against conv and dcls
    v0 on the device (TF32 off; every value); the relative errors, and whether it passed (the float64 check
    within CHECK_TOLERANCE; a difference from conv past it is printed)."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        fused = outputs_and_grads(made[name], x, grad, autocast)
        want = float64_reference(made[name], x, grad)
        rows = {k: fused[k][:, :2].double().cpu() for k in want}
        errors = {"float64 (CPU, 2 batch rows)": relative_errors(rows, want)}
        for other in ("flexgen conv", "dcls v0"):
            if other in made:
                errors[other] = relative_errors(fused, outputs_and_grads(made[other], x, grad, autocast))
        tolerance = CHECK_TOLERANCE[dtype_name]
        passed = max(errors["float64 (CPU, 2 batch rows)"].values()) <= tolerance
        if max(errors["flexgen conv"].values()) > tolerance:
            print(f"{name} and conv differ: {errors}", file=sys.stderr)
        errors = {ref: {k: float(f"{v:.3g}") for k, v in err.items()} for ref, err in errors.items()}
        return errors, passed
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def memory_mb(model, x, grad, autocast):
    fwd_bwd(model, x, grad, autocast)
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(model, x, grad, autocast)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    model.zero_grad(set_to_none=True)
    x.grad = None
    return peak / 2**20


def median_ms(model, inputs, grad, autocast, dry_run):
    calls = iter(range(1 << 62))

    def step():
        x = inputs[next(calls) % len(inputs)]
        fwd_bwd(model, x, grad, autocast)

    if dry_run:
        import time

        start = time.perf_counter()
        step()
        return (time.perf_counter() - start) * 1e3
    import triton

    ms = triton.testing.do_bench(step, return_mode="median")
    model.zero_grad(set_to_none=True)
    for x in inputs:
        x.grad = None
    return ms


def measure(steps, max_delay, batch, dtype_name, device, dry_run, n_in=N_IN, n_out=N_OUT):
    torch.manual_seed(steps * 1000 + max_delay + batch)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    autocast = dtype_name == "bf16"
    inputs = [(torch.rand(steps, batch, n_in, device=device) < RATE).to(dtype).requires_grad_() for _ in range(2)]
    grad = torch.randn(steps, batch, n_out, device=device, dtype=dtype)
    made = candidates(max_delay, device, n_in, n_out)
    checks = {name: check(made, name, inputs[0], grad, autocast, dtype_name) for name in CHECKED}
    rows = []
    for name, model in made.items():
        peak = None if dry_run else memory_mb(model, inputs[0], grad, autocast)
        ms = median_ms(model, inputs, grad, autocast, dry_run)
        row = {"steps": steps, "max_delay": max_delay, "batch": batch, "dtype": dtype_name, "candidate": name,
               "fwd_bwd_ms": round(ms, 4), "peak_mb": None if peak is None else round(peak, 1)}
        if name in checks:
            row["check"], row["check_passed"] = checks[name]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del made
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def variants(device):
    """Probe: each fused kernel alone under a few tile sizes, at the smallest and the largest recorded shape."""
    import triton

    from flexgen.launch.delay import fused as dl
    from flexgen.launch.delay.ops import TapOptions

    shapes = [(100, 32, 25, (torch.float32,)), (250, 256, 25, (torch.float32, torch.bfloat16)),
              (100, 256, 100, (torch.float32, torch.bfloat16))]
    tiles = [dict(window=w, block_batch=bb, block_features=bf, unroll=u, grad_input_unroll=u)
             for w, bb, bf, u in [(16, 32, 8, 1), (16, 32, 8, 2), (16, 32, 8, 4), (32, 16, 16, 2), (16, 32, 16, 2),
                                  (32, 32, 8, 2), (32, 8, 16, 4)]]
    corr = [dict(corr_time=t, corr_batch=b, corr_out=o, corr_in=i, corr_unroll=u)
            for t, b, o, i, u in [(4, 32, 8, 4, 1), (4, 32, 8, 4, 2), (8, 16, 8, 4, 2), (8, 16, 8, 4, 4),
                                  (4, 16, 16, 4, 2), (8, 16, 16, 4, 2)]]
    for steps, batch, max_delay, dtypes in shapes:
        for dtype in dtypes:
            x = (torch.rand(steps, batch, N_IN, device=device) < RATE).to(dtype)
            g = torch.randn(steps, batch, N_OUT, device=device, dtype=dtype)
            w = torch.randn(N_OUT, N_IN, device=device) * 0.05
            d = torch.rand(N_OUT, N_IN, device=device) * max_delay
            taps = TapOptions(max_delay)
            for tile in tiles:
                cfg = dl.DEFAULT._replace(**tile)
                f = triton.testing.do_bench(lambda: dl._forward(x, w, d, None, taps, cfg, None), return_mode="median")
                gi = triton.testing.do_bench(lambda: dl._grad_input(g, x, w, d, taps, cfg, None),
                                             return_mode="median")
                print(f"T {steps} B {batch} K {max_delay} {str(dtype)[6:]} {tile}: forward {f:.3f} ms, "
                      f"grad input {gi:.3f} ms", flush=True)
            for tile in corr:
                cfg = dl.DEFAULT._replace(**tile)
                c = triton.testing.do_bench(lambda: dl._grad_weight_delay(g, x, w, d, taps, cfg, None),
                                            return_mode="median")
                print(f"T {steps} B {batch} K {max_delay} {str(dtype)[6:]} {tile}: correlations {c:.3f} ms", flush=True)


def _baseline(results):
    """The candidate the table divides by: "flexgen auto" (records before it: "flexgen fused")."""
    return "flexgen auto" if any(r["candidate"] == "flexgen auto" for r in results) else "flexgen fused"


def table(results):
    base = _baseline(results)
    if base == "flexgen fused":
        head = "| T | max_delay | B | dtype | candidate | fwd+bwd ms | x fused's time | peak MiB | fused vs float64 |"
    else:
        head = "| T | max_delay | B | dtype | candidate | fwd+bwd ms | x auto's time | peak MiB | vs float64 |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    fused = {(r["steps"], r["max_delay"], r["batch"], r["dtype"]): r["fwd_bwd_ms"] for r in results
             if r["candidate"] == base}
    for r in results:
        ratio = r["fwd_bwd_ms"] / fused[(r["steps"], r["max_delay"], r["batch"], r["dtype"])]
        peak = "-" if r["peak_mb"] is None else f"{r['peak_mb']:.1f}"
        checked = "-"
        if "check" in r:
            checked = f"{max(r['check']['float64 (CPU, 2 batch rows)'].values()):.1e}"
        lines.append(f"| {r['steps']} | {r['max_delay']} | {r['batch']} | {r['dtype']} | {r['candidate']} | "
                     f"{r['fwd_bwd_ms']:.3f} | {ratio:.2f} | {peak} | {checked} |")
    return "\n".join(lines)


def write_outputs(meta, results, out):
    base = _baseline(results)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_delays.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(os.path.join(out, "bench_delays.md"), "w") as f:
        f.write(f"# Synapses with learnable delays: forward + backward\n\n{meta['gpu']}, {meta['date']}, torch "
                f"{meta['torch']}, Triton {meta['triton']}, dcls {meta['dcls']}. `{meta['command']}`.\n"
                f"{meta['layer']}. {_conv_precision(meta)}\"x {base.removeprefix('flexgen ')}'s time\": the "
                f"candidate's time over {base}'s.\n\n"
                + table(results) + "\n")


def _conv_precision(meta):
    if "candidates" not in meta:  # a record from before the products per tap
        if meta.get("conv_tf32", True):
            return "cuDNN's fp32 convolutions (flexgen conv, dcls) use TF32, torch's default. "
        return ("cuDNN's fp32 convolutions (flexgen conv, dcls) in full fp32 (TF32 off), as the fused kernels "
                "compute. ")
    if meta.get("conv_tf32", True):
        return ("TF32 allowed (torch's default for convolutions): cuDNN's fp32 convolutions (flexgen conv, dcls) and "
                "flexgen's products per tap (taps, gauss, and auto where it takes them) use it; the two-tap kernels "
                "(fused) are exact fp32. ")
    return ("TF32 off: cuDNN's fp32 convolutions (flexgen conv, dcls) in full fp32, flexgen's products per tap in "
            "3xTF32; the two-tap kernels (fused) are exact fp32. ")


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(args):
    if args.replot:
        with open(args.replot) as f:
            recorded = json.load(f)
        write_outputs(recorded["meta"], recorded["results"], args.out or os.path.join(ROOT, "docs", "perf"))
        print(table(recorded["results"]))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_delays needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    if args.variants:
        variants(device)
        return 0
    sizes = (5, 4) if args.dry_run else (N_IN, N_OUT)
    import triton

    meta = {"gpu": "CPU dry run (Triton interpreter)" if args.dry_run else torch.cuda.get_device_name(),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "dcls": _version("dcls"),
            "command": "python benchmarks/bench_delays.py " + " ".join(sys.argv[1:]),
            "layer": f"{sizes[0]} -> {sizes[1]} synapses, no bias, input spikes at rate {RATE} requiring a gradient",
            "conv_tf32": not args.no_tf32, "candidates": list(CANDIDATES)}
    torch.backends.cudnn.allow_tf32 = not args.no_tf32
    out = args.out or (tempfile.mkdtemp(prefix="bench-delays-") if args.dry_run else os.path.join(ROOT, "docs", "perf"))
    results = []
    for dtype in args.dtypes:
        for steps in args.steps:
            for max_delay in args.delays:
                for batch in args.batch:
                    results += measure(steps, max_delay, batch, dtype, device, args.dry_run, *sizes)
                    write_outputs(meta, results, out)  # after each shape: a run cut short keeps what it measured
    print(table(results))
    failed = [r for r in results if r.get("check_passed") is False]
    for r in failed:
        print(f"check failed: {r}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
