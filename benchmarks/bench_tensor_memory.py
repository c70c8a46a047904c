"""Activation memory per layer with tensor and sequence parallelism, planned and measured, against
Korthikanti et al.'s per-layer formulas (docs/tensor-parallel.md's table).

    .venv/bin/python benchmarks/bench_tensor_memory.py

The zoo GPT in bf16 (b=4 sequences of s=64 tokens, h=64, a=4 heads), 2 gloo ranks, at tp=1 (two
data-parallel ranks), tp=2 and tp=2 with sequence parallelism. One layer's activations are the
difference between a 3-layer and a 2-layer model of:

* saved activations, planned: the peak of the saved activations in the step's memory plan
  (``memory.lifetimes``), and per sbh 16-bit bytes;
* step peak, planned and measured: the peak bytes the step's ops allocate, as the plan has it and
  as one step on real ranks counts them (``step.track_memory``, no arena: every value allocated by
  its op; saved activations and the temporaries live beside them at the peak);
* formula: ``mc.activation_bytes_per_layer`` (dropout-free, fused attention: 32 sbh at tp=1,
  sbh(8 + 24/t) with tensor parallelism, 32 sbh/t with sequence parallelism, plus the fp32
  log-sum-exp and the norms' statistics).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import launch  # noqa: E402

import micscompile as mc  # noqa: E402
from micscompile.lowering.predict import step_buffers_of  # noqa: E402
from micscompile.zoo.models import GPT, GPTConfig, lm_loss  # noqa: E402

B, S, H, A = 4, 64, 64, 4
CASES = [(1, False), (2, False), (2, True)]
WORLD = 2


def _model(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=128, seq_len=S, layers=layers, hidden=H, heads=A))


def _plan(tp: int, sp: bool) -> mc.Plan:
    return mc.Plan(partition_size=1, tensor_parallel_size=tp, sequence_parallel=sp, param_dtype=torch.bfloat16)


def measure(rank: int, world: int) -> dict:
    """Per (tp, sp, layers): the planned saved activations and the measured peak of one step."""
    out = {}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(128, (B, S), generator=g), torch.randint(128, (B, S), generator=g))
    for tp, sp in CASES:
        for layers in (2, 3):
            model = _model(layers)
            tg = mc.trace(model, batch, lm_loss, param_dtype=torch.bfloat16)
            planned = step_buffers_of(tg, _plan(tp, sp), world)
            saved = mc.ir.plan_memory([x for x in planned if x.kind == "activation"]).lower_bound_bytes
            step = mc.compile(model, _plan(tp, sp), loss_fn=lm_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              example_inputs=batch, arena=False)
            step.track_memory = True
            step(*batch)
            stats = step.memory_stats()
            out[(tp, sp, layers)] = (saved, stats.outside_planned_peak_bytes, stats.outside_measured_peak_bytes)
    return out


def main() -> int:
    result = launch(measure, WORLD, timeout_s=900)[0]
    print(f"GPT bf16, b={B} s={S} h={H} a={A}, {WORLD} gloo ranks; bytes of one layer's activations (sbh = {B * S * H})")
    print(f"{'':<18}{'saved activations':>30}{'step peak':>24}")
    print(f"{'plan':<18}{'formula':>10}{'planned':>10}{'per sbh':>10}{'planned':>12}{'measured':>12}")
    for tp, sp in CASES:
        saved, peak, measured = (result[(tp, sp, 3)][i] - result[(tp, sp, 2)][i] for i in range(3))
        formula = mc.activation_bytes_per_layer(B, S, H, A, tensor_parallel=tp, sequence_parallel=sp)
        name = f"tp={tp}" + (" + sequence" if sp else "")
        print(f"{name:<18}{formula:>10.0f}{saved:>10}{saved / (B * S * H):>10.3f}{peak:>12}{measured:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
