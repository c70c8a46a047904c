"""Mixed precision in the trace, the Plan, the Program and the simulator (no process group).

The multi-process parity of mixed-precision plans (and their wire bytes) is in
test_multiproc.py and test_pipeline_multiproc.py.
"""

from __future__ import annotations

import pytest
import torch

import micscompile as mc
from micscompile.lowering.lowered import lower
from micscompile.zoo.models import GPT, GPTConfig, lm_loss

CFG = GPTConfig(vocab_size=512, seq_len=128, layers=4, hidden=128, heads=4)
BF16 = torch.bfloat16


def _trace(param_dtype=None, batch: int = 4, cfg: GPTConfig = CFG):
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros(batch, cfg.seq_len, dtype=torch.long)
    return mc.trace(model, (x, x), lm_loss, param_dtype=param_dtype)


@pytest.fixture(scope="module")
def fp32():
    return _trace()


@pytest.fixture(scope="module")
def bf16():
    return _trace(BF16)


def test_a_bf16_trace_computes_in_bf16_and_keeps_fp32_masters(bf16, fp32):
    placeholders = [n for n in bf16.gm.graph.nodes if n.op == "placeholder"]
    assert all(n.meta["val"].dtype == BF16 for n in placeholders[: bf16.num_params])
    grads = next(n for n in bf16.gm.graph.nodes if n.op == "output").args[0][1:]
    assert all(g.meta["val"].dtype == BF16 for g in grads if g is not None)
    assert bf16.compute_dtype == BF16 and fp32.compute_dtype is None
    # the masters the layouts shard stay fp32; the batch is given as the user gives it
    assert set(bf16.param_dtypes.values()) == {torch.float32}
    assert bf16.input_specs == fp32.input_specs
    # every linear layer's matmul in bf16 (LayerNorm statistics and the math attention upcast
    # inside, as eager's do on this device)
    matmuls = [n for n in bf16.gm.graph.nodes if getattr(n.target, "__name__", "").split(".")[0] in ("mm", "addmm")]
    assert matmuls and all(n.meta["val"].dtype == BF16 for n in matmuls)
    acts = lambda tg: sum(n.meta.get("mc_bytes", 0) for n in tg.gm.graph.nodes if n.op == "call_function")  # noqa: E731
    assert 0.5 < acts(bf16) / acts(fp32) < 0.8


def test_a_plan_and_a_trace_of_different_precision_are_refused(fp32):
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=1)
    with pytest.raises(mc.PlanError, match=r"trace with mc.trace\(..., param_dtype=torch.bfloat16\)"):
        mc.simulate(fp32, mc.Plan(partition_size=8, param_dtype=BF16), cluster)


def test_bf16_halves_gather_bytes_and_the_simulator_prices_it():
    big = GPTConfig(vocab_size=8192, seq_len=512, layers=4, hidden=1024, heads=16)  # matmul-bound on an A100
    fp32, bf16 = (_trace(dt, batch=8, cfg=big) for dt in (None, BF16))
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=2)
    plans = {dt: mc.Plan(partition_size=8, param_dtype=dt, reduce_dtype=dt, optimizer_sharding="partition")
             for dt in (torch.float32, BF16)}
    rp = {dt: p.resolve(cluster.world_size, cluster.gpus_per_node) for dt, p in plans.items()}
    wire = {dt: lower(tg, rp[dt], cluster, need_graph=False).wire_bytes() for dt, tg in ((torch.float32, fp32), (BF16, bf16))}
    assert wire[torch.float32].keys() == wire[BF16].keys()
    for key, nbytes in wire[torch.float32].items():
        if key != ("all_reduce", "world"):  # the loss stays fp32
            assert wire[BF16][key] * 2 == nbytes, key
    pred = {dt: mc.simulate(tg, plans[dt], cluster) for dt, tg in ((torch.float32, fp32), (BF16, bf16))}
    # bf16 matmuls run at the tensor-core peak; fewer activation and gathered bytes
    assert pred[BF16].step_time_s < pred[torch.float32].step_time_s / 2
    assert pred[BF16].peak_memory_bytes < pred[torch.float32].peak_memory_bytes
    # the masters, gradient shards and optimizer state are fp32 in both: 16 bytes per shard element
    assert pred[BF16].static_memory_bytes == pred[torch.float32].static_memory_bytes


def test_p1_mixed_precision_casts_without_a_collective(bf16):
    program = lower(bf16, mc.Plan(partition_size=1, param_dtype=BF16).resolve(4), need_graph=False).program
    assert program.wire_bytes().keys() == {("all_reduce", "replicate"), ("all_reduce", "world")}
    assert any(a.kind is mc.ir.Kind.ALL_GATHER for a in program.micro_step)  # the casts, priced as gathers of one rank
