"""Shard layout round trips, as properties over random shapes and partition sizes."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from micscompile.core.sharding import build_layouts, local_piece, pack_grads, shard_of, unpack_param

shapes = st.lists(st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5)


def layout_for(shapes, p):
    names = [f"w{i}" for i in range(len(shapes))]
    (lay,) = build_layouts([("b", names)], {n: torch.Size(s) for n, s in zip(names, shapes)}, p)
    return names, lay


def shards_of(params: dict, lay, p: int) -> list[torch.Tensor]:
    """What materialisation gives each rank: its pieces at their shard offsets, zeros elsewhere."""
    shards = [torch.zeros(lay.row_numel) for _ in range(p)]
    for r in range(p):
        for s in lay.slots:
            local_piece(lay, s, shards[r], r).copy_(shard_of(params[s.name], lay, s, r))
    return shards


@settings(max_examples=80, deadline=None)
@given(shapes=shapes, p=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_gather_of_shards_unpacks_to_the_parameters(shapes, p, seed):
    g = torch.Generator().manual_seed(seed)
    names, lay = layout_for(shapes, p)
    params = {n: torch.randn(s, generator=g) for n, s in zip(names, shapes)}
    gathered = torch.cat(shards_of(params, lay, p))  # what all_gather_into_tensor produces
    assert gathered.numel() == lay.padded_numel and lay.padded_numel - lay.numel < p
    assert torch.count_nonzero(gathered[lay.numel :]) == 0  # padding is zero
    for s in lay.slots:
        out = unpack_param(gathered, s.offset, s.numel, s.shape)
        assert torch.equal(out, params[s.name])
        assert out.data_ptr() == gathered[s.offset :].data_ptr()  # a view, no copy


@settings(max_examples=80, deadline=None)
@given(shapes=shapes, p=st.integers(1, 6))
def test_local_ranges_partition_every_parameter(shapes, p):
    _, lay = layout_for(shapes, p)
    for s in lay.slots:
        ranges = [lay.local_range(s, r) for r in range(p)]
        assert ranges[0][0] == 0 and ranges[-1][1] == s.numel
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in rank order


@settings(max_examples=80, deadline=None)
@given(shapes=shapes, p=st.integers(1, 6), seed=st.integers(0, 2**16), drop=st.integers(0, 4))
def test_packed_gradients_scatter_to_each_ranks_pieces(shapes, p, seed, drop):
    g = torch.Generator().manual_seed(seed)
    names, lay = layout_for(shapes, p)
    grads = [torch.randn(s, generator=g) for s in shapes]
    if drop < len(grads):
        grads[drop] = None  # unused parameter: zero gradient
    flat = pack_grads(lay, tuple(grads), torch.full((lay.padded_numel,), float("nan")))  # stale bytes: all overwritten
    full = {n: (gr if gr is not None else torch.zeros(s)) for n, gr, s in zip(names, grads, shapes)}
    for r, want in enumerate(shards_of(full, lay, p)):  # what reduce_scatter hands rank r (one contributor)
        assert torch.equal(flat.view(p, lay.row_numel)[r], want)
