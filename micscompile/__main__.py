"""``python -m micscompile <command>``.

Commands: ``calibrate`` (measure this machine and write a ``local`` cluster JSON).
Run outside torchrun, it relaunches itself under ``torchrun --standalone``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys


def _calibrate(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ:  # not under torchrun yet: relaunch with --nproc ranks
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "micscompile", "calibrate", "--out", args.out, "--repeats", str(args.repeats)]
        return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    import torch
    import torch.distributed as dist

    from micscompile.cost_model.calibrate import calibrate

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = dist.get_rank()
    cluster = calibrate(repeats=args.repeats, log=print if rank == 0 else None)
    if rank == 0:
        cluster.save(args.out)
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m micscompile", description="micscompile commands")
    sub = ap.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure compute and collectives on this machine; write a cluster JSON")
    cal.add_argument("--nproc", type=int, default=4, help="ranks to measure with (when not under torchrun)")
    cal.add_argument("--out", default="local_cluster.json", help="where to write the calibrated cluster")
    cal.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement (median)")
    args = ap.parse_args(argv)
    return {"calibrate": _calibrate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
