"""What today's software gets out of one GPU, per component the cost model prices (the current-software
presets): bf16 matrix products at the shapes GPT-3 175B's layers run (t = 1 and t = 8 tensor groups, 2 x 2048
tokens) and Llama-3-8B's (8 x 1024 tokens), fused attention (``scaled_dot_product_attention``'s flash kernel)
forward and backward, device memory bandwidth and the host's time per dispatched op.

    python3 benchmarks/gpu/compute_probe.py [--json out.json]

Each figure is the median of 20 timed runs after 5 warm-ups, timed by CUDA events, inputs random (zeros run
faster on Hopper). Printed as achieved TFLOP/s and as a fraction of the device's dense bf16 peak
(``--peak``, default the H100/H200 SXM figure, 989 TFLOP/s): what ``GpuSpec.matmul_efficiency`` stands for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def timed_s(fn, warmup: int = 5, repeats: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


GEMMS = {  # name: (tokens, in, out) of y = x @ w
    "gpt3 qkv t=1": (4096, 12288, 36864), "gpt3 proj t=1": (4096, 12288, 12288),
    "gpt3 fc1 t=1": (4096, 12288, 49152), "gpt3 fc2 t=1": (4096, 49152, 12288),
    "gpt3 qkv t=8": (4096, 12288, 4608), "gpt3 proj t=8": (4096, 1536, 12288),
    "gpt3 fc1 t=8": (4096, 12288, 6144), "gpt3 fc2 t=8": (4096, 6144, 12288),
    "llama3-8b qkv": (8192, 4096, 6144), "llama3-8b o": (8192, 4096, 4096),
    "llama3-8b gate+up": (8192, 4096, 28672), "llama3-8b down": (8192, 14336, 4096),
}
ATTENTION = {  # name: (batch, heads, seq, head dim, causal)
    "gpt3 t=8 (12 heads)": (2, 12, 2048, 128, True), "llama3-8b (32 heads)": (8, 32, 1024, 128, True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--peak", type=float, default=989e12)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "peak_flops": args.peak}
    print(f"{out['device']}, torch {out['torch']}, CUDA {out['cuda']}, cuDNN {out['cudnn']}")
    rows = {}
    for name, (m, k, n) in GEMMS.items():
        x, w = torch.randn(m, k, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
        s = timed_s(lambda x=x, w=w: x @ w)
        rows[name] = 2 * m * k * n / s
        print(f"  matmul {name:<18} {m}x{k}x{n}: {rows[name] / 1e12:6.0f} TFLOP/s, {rows[name] / args.peak:.1%} of peak")
        del x, w
    out["matmul_flops"] = rows
    out["matmul_efficiency_median"] = statistics.median(rows.values()) / args.peak
    att = {}
    for name, (b, h, s, d, causal) in ATTENTION.items():
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)  # QK^T and PV, the pairs computed
        fwd = timed_s(lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c))
        grad = torch.randn(b, h, s, d, device=dev, dtype=dt)

        def both(q=q, k=k, v=v, grad=grad, c=causal):
            F.scaled_dot_product_attention(q, k, v, is_causal=c).backward(grad)
        fb = timed_s(both)
        att[name] = {"forward_flops": flops / fwd, "forward_backward_flops": 3.5 * flops / fb}
        print(f"  attention {name:<20} forward {flops / fwd / 1e12:5.0f} TFLOP/s ({flops / fwd / args.peak:.1%}), "
              f"forward+backward {3.5 * flops / fb / 1e12:5.0f} TFLOP/s ({3.5 * flops / fb / args.peak:.1%})")
        del q, k, v, grad
    out["attention"] = att
    a = torch.empty(1 << 30, device=dev, dtype=torch.uint8)
    b = torch.empty_like(a)
    s = timed_s(lambda: b.copy_(a))
    out["memory_bps"] = 2 * a.numel() / s
    print(f"  memory: copy of 1 GiB {out['memory_bps'] / 1e12:.2f} TB/s (read + write)")
    tiny = torch.ones(8, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(2000):
        tiny.add_(1)
    host = (time.perf_counter() - t0) / 2000
    torch.cuda.synchronize()
    out["host_per_op_s"] = host
    print(f"  host per dispatched op (add_, queued): {host * 1e6:.1f} us")
    print(f"  median matmul efficiency over the {len(rows)} shapes: {out['matmul_efficiency_median']:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
