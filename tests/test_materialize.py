"""A meta model's shards equal the same model's built for real, whatever chunks a rank holds.

``mc.compile`` of a meta model initialises it one module at a time in ``named_modules()`` order
(``runtime.materialize``). A pipeline rank holds several chunks under an interleaved schedule,
chunks that are not contiguous in the model: each module must still be initialised once, from
the random stream it would have drawn from in the whole model. Checked here without ranks, for
every rank of every schedule and chunk count, against slicing the real model (an
interleaved meta model trained other weights than the same model built for real)."""

from __future__ import annotations

import pytest
import torch
from models import MODELS, Normalize, TiedLM
from torch import nn

import micscompile as mc
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.lowered import lower
from micscompile.runtime.materialize import initialize, local_states

CPU = torch.device("cpu")
# (stages, partition size t, schedule, chunks per rank v): every schedule, 1-4 chunks per rank
PIPELINES = [
    (2, 1, "1f1b", 1), (2, 2, "1f1b", 1), (4, 1, "1f1b", 1), (2, 1, "gpipe", 1), (2, 2, "gpipe", 1),
    (2, 1, "interleaved", 2), (2, 2, "interleaved", 2), (2, 1, "interleaved", 3), (2, 1, "interleaved", 4),
    (4, 1, "interleaved", 2),
]


class NormalizedLM(nn.Module):
    """A tied LM behind an input normalisation whose buffers reset_parameters sets (buffers in chunk 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = Normalize(1)
        self.lm = TiedLM(layers=6)

    def forward(self, idx):
        return self.lm(idx)


@pytest.fixture(scope="module")
def tied_lm():
    torch.manual_seed(0)
    real = TiedLM(layers=6)
    x, y = MODELS["tied_lm"][2](1, 8)[0]
    return real, mc.trace(real, (x, y), MODELS["tied_lm"][1](real))


@pytest.mark.parametrize("pipeline", PIPELINES, ids=lambda c: f"S{c[0]}-t{c[1]}-{c[2]}-v{c[3]}")
def test_meta_shards_equal_the_real_models_for_every_rank_of_every_schedule(tied_lm, pipeline):
    stages, t, schedule, v = pipeline
    real, tg = tied_lm
    torch.manual_seed(1)
    initialize(real)  # the real twin: built, then init_fn under the meta model's seed
    with torch.device("meta"):
        meta = TiedLM(layers=6)
    world = stages * t
    rp = mc.Plan(partition_size=t, pipeline_stages=stages, pipeline_schedule=schedule, pipeline_chunks=v,
                 micro_batches=2 * stages).resolve(world, world)
    held = set()
    for rank in range(world):
        lowered = lower(tg, rp, None, planned_groups(rp, rank), rank)
        chunks = lowered.my_chunks()
        assert len(chunks) == v
        held.update(chunks)
        layouts = [lowered.chunks[c].ctx.layouts for c in chunks]
        shard_rank = planned_groups(rp, rank)["shard"].rank
        torch.manual_seed(1)
        got = local_states(meta, layouts, shard_rank, CPU)
        want = local_states(real, layouts, shard_rank, CPU)
        for c, (g, w) in zip(chunks, zip(got, want)):
            assert any(a.any() for a in g[0]), (rank, c)  # something was placed
            for b, (a, e) in enumerate(zip(g[0], w[0])):
                assert torch.equal(a, e), f"rank {rank} chunk {c} bucket {b}: {(a - e).abs().max():.3g}"
    assert held == set(range(stages * v))


def test_every_part_gets_its_own_buffers_equal_to_the_real_models():
    """Buffers set by ``reset_parameters`` come out as the real model's, one copy per part."""
    real = NormalizedLM()
    torch.manual_seed(1)
    initialize(real)
    with torch.device("meta"):
        meta = NormalizedLM()
    torch.manual_seed(1)
    (_, b0), (_, b1) = local_states(meta, [(), ()], 0, CPU)
    for name, want in real.named_buffers():
        assert torch.equal(b0[name], want) and torch.equal(b1[name], want), name
        assert b0[name].data_ptr() != b1[name].data_ptr(), name
