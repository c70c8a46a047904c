"""Does micscompile's step capture as one CUDA graph, and what does replaying it buy? A probe outside
``Plan.cuda_graph``: it captures the step by hand.

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu/capture_probe.py [--models small gpt-350m]

Per model (``bench_gpu.py``'s, fp32 with TF32 matmuls) and micro-batch count: ``mc.compile``'s default step is warmed
up on a side stream, then captured whole (``torch.cuda.graph``) over static input buffers. Printed: whether the
capture succeeded (else the error's first line: what a capture-safe step must remove), the step's time called
eagerly and replayed (median of 20, CUDA-synchronized), the host's time to queue each, and the losses of five
replays against five eager steps of a twin step from the same weights and batches (the graph must update the
weights as the eager step does), and of a second eager twin: the floor two eager runs drift apart by
(nondeterministic kernels, amplified by AdamW).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import time

import torch
import torch.distributed as dist
from bench_gpu import MODELS

import micscompile as mc
from micscompile.core.launch import init_distributed
from micscompile.zoo.models import lm_batch, lm_loss


def adamw(params):
    """bench_gpu's AdamW, its step count on the device (``capturable``: a captured step reads no host counter)."""
    return torch.optim.AdamW(params, lr=1e-3, capturable=True)


def timed(fn, n: int = 20) -> tuple[float, float]:
    """(median seconds of ``fn`` from an idle device to its end, median seconds until it returns)."""
    ends, queued = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        queued.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        ends.append(time.perf_counter() - t0)
    return statistics.median(ends), statistics.median(queued)


def probe(name: str, s: int, device: torch.device) -> None:
    cfg, samples = MODELS[name].cfg, MODELS[name].samples
    torch.manual_seed(0)
    model = MODELS[name].build()
    twin_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in lm_batch(cfg, samples, gen)) for _ in range(8)]
    plan = mc.Plan(partition_size=1, micro_batches=s)
    step = mc.compile(model, plan, loss_fn=lm_loss, optimizer=adamw, example_inputs=batches[0])
    twin = mc.compile(twin_model, plan, loss_fn=lm_loss, optimizer=adamw, example_inputs=batches[0])
    static = tuple(t.clone() for t in batches[0])
    eager_s, eager_host = timed(lambda: twin(*static))
    # the twin has now stepped 20 times more: rebuild it for the parity check below
    twin_model = copy.deepcopy(model)
    twin = mc.compile(twin_model, plan, loss_fn=lm_loss, optimizer=adamw, example_inputs=batches[0])
    floor = copy.deepcopy(model)  # a second eager twin: how far two eager runs drift apart (nondeterministic kernels)
    floor = mc.compile(floor, plan, loss_fn=lm_loss, optimizer=adamw, example_inputs=batches[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph, why = torch.cuda.CUDAGraph(), ""
    try:
        with torch.cuda.stream(side):
            for _ in range(3):  # (warm-up: the twin takes the same three steps)
                step(*static)
        torch.cuda.current_stream().wait_stream(side)
        for _ in range(3):
            twin(*static)
            floor(*static)
        with torch.cuda.graph(graph):
            loss = step(*static)
    except Exception as exc:  # noqa: BLE001 (what stops the capture is the finding)
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    print(f"{name} s={s}: step {eager_s * 1e3:.2f} ms eagerly, {eager_host * 1e3:.2f} ms of host to queue it", flush=True)
    if why:
        print(f"  capture FAILED: {why}", flush=True)
        return
    got, want, again = [], [], []
    for batch in batches[1:6]:
        for dst, src in zip(static, batch):
            dst.copy_(src)
        graph.replay()
        got.append(float(loss))
        want.append(float(twin(*batch)))
        again.append(float(floor(*batch)))
    diff = max(abs(a - b) for a, b in zip(got, want))
    noise = max(abs(a - b) for a, b in zip(again, want))
    replay_s, replay_host = timed(graph.replay)
    print(f"  captured: replay {replay_s * 1e3:.2f} ms ({eager_s / replay_s:.2f}x the eager step), "
          f"{replay_host * 1e3:.3f} ms of host; losses of 5 replays vs 5 eager steps: max |diff| {diff:.3g} "
          f"({got[0]:.5f} .. {got[-1]:.5f}); two eager twins: {noise:.3g}", flush=True)
    if diff:
        print(f"  replays {[round(x, 5) for x in got]}\n  eager   {[round(x, 5) for x in want]}\n"
              f"  eager 2 {[round(x, 5) for x in again]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--deterministic", action="store_true",
                    help="deterministic kernels (torch.use_deterministic_algorithms; CUBLAS_WORKSPACE_CONFIG=:4096:8)")
    args = ap.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    device = init_distributed(timeout=datetime.timedelta(seconds=300))
    if device.type != "cuda" or dist.get_world_size() != 1:
        raise SystemExit("capture_probe.py runs one rank on one GPU: torchrun --nproc-per-node 1 on a CUDA machine")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for name in args.models:
        for s in args.micro_batches:
            probe(name, s, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
