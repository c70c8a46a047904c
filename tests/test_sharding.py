"""Shard layout round trips, as properties over random shapes and partition sizes."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from micscompile.sharding import build_layouts, pack_grads, shard_of, unpack_param

shapes = st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, p=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_gather_of_shards_unpacks_to_the_parameters(shapes, p, seed):
    g = torch.Generator().manual_seed(seed)
    params = {f"w{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    (lay,) = build_layouts([("b", list(params))], {k: v.shape for k, v in params.items()}, p)
    # what all_gather_into_tensor produces: rank r's shard is row r
    rows = [torch.cat([shard_of(params[s.name], s, p, r) for s in lay.slots]) for r in range(p)]
    gathered = torch.cat(rows)
    assert gathered.numel() == lay.padded_numel and rows[0].numel() == lay.row_numel
    for s in lay.slots:
        out = unpack_param(gathered, p, lay.row_numel, s.offset, s.chunk, s.numel, s.shape)
        assert torch.equal(out, params[s.name])


@settings(max_examples=60, deadline=None)
@given(shapes=shapes, p=st.integers(1, 6), seed=st.integers(0, 2**16), drop=st.integers(0, 4))
def test_packed_gradients_scatter_to_each_ranks_shard(shapes, p, seed, drop):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=g) for s in shapes]
    if drop < len(grads):
        grads[drop] = None  # unused parameter: zero gradient
    names = [f"w{i}" for i in range(len(shapes))]
    (lay,) = build_layouts([("b", names)], {n: torch.Size(s) for n, s in zip(names, shapes)}, p)
    flat = pack_grads(lay, tuple(grads), torch.empty(0))
    for r in range(p):  # what reduce_scatter hands rank r (from one contributor)
        row = flat.view(p, lay.row_numel)[r]
        for s, grad in zip(lay.slots, grads):
            want = shard_of(grad if grad is not None else torch.zeros(s.shape), s, p, r)
            assert torch.equal(row[s.offset : s.offset + s.chunk], want)
