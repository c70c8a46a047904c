"""A long pipeline chunk priced from three shorter ones: its price is a line in the number of repeated blocks.

A transformer's chunk of k identical blocks costs what a chunk of the same shape with fewer of them costs, plus
k times what one more block adds: each phase's time (one block's compute and collectives after another, the
gathers running a fixed distance ahead), its bytes (each block's states, its saved activations) and its FLOPs.
The event simulation of a chunk settles into that period after a few blocks. ``mc.autotune`` therefore lowers
and prices a chunk of more than ``DEPTH[-1]`` repeated blocks at ``DEPTH`` blocks alone (the same neighbours,
cut at another place along the run): the line through the first two, checked at the third, gives the price at
k. Where the third is off the line (the simulation has not settled, a bucket spans blocks) the chunk is lowered
and priced whole, as before. Tested against pricing each chunk whole (``tests/test_autotune.py``).

What it saves: a GPT-3 chunk of 48 blocks is lowered as 4 + 5 + 6, and a zero-bubble chunk's phases are
simulated on those.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from micscompile.core.errors import Error
from micscompile.cost_model.pipeline import ChunkPrice
from micscompile.cost_model.simulator import Prediction

DEPTH = (4, 5, 6)
"""The run lengths a long chunk is priced at: the line through the first two, checked at the third."""

REL = 1e-9
"""How far (relative) the third point's times may sit off the line: summation order, nothing more."""


class OffLine(Error, ValueError):
    """The third price is not on the line through the first two (caught in ``tune.repricing``, which then prices
    the plan in full)."""


def shortened(starts: Sequence[int], c: int, signatures: Sequence[int]) -> tuple[int, list[tuple[int, ...]]] | None:
    """(k, the cut points putting chunk ``c`` at each run length of ``DEPTH``), where chunk ``c`` of the cut at
    ``starts`` holds a run of k > ``DEPTH[-1]`` blocks of one signature (``chunk_keys``) that can be cut shorter
    with its neighbours unchanged: the run ends the chunk and the next unit repeats it (the chunk's end moves in),
    or the run starts the chunk and the previous unit repeats it (its start moves out). None otherwise."""
    n = len(signatures)
    a = starts[c]
    b = starts[c + 1] if c + 1 < len(starts) else n
    best = (0, a, a)
    i = a
    while i < b:  # the longest run of one signature in [a, b)
        j = i
        while j < b and signatures[j] == signatures[i]:
            j += 1
        best = max(best, (j - i, i, j), key=lambda r: r[0])
        i = j
    k, ra, rb = best
    if k <= DEPTH[-1]:
        return None
    sig = signatures[ra]
    if rb == b and b < n and signatures[b] == sig:  # (the run continues into the next chunk: its end moves in)
        edge, at = c + 1, lambda d: b - (k - d)
    elif ra == a and a > 0 and signatures[a - 1] == sig:  # (it continues from the previous one: its start moves out)
        edge, at = c, lambda d: a + (k - d)
    else:
        return None
    return k, [tuple(at(d) if e == edge else s for e, s in enumerate(starts)) for d in DEPTH]


def exact_line(a: int, b: int, ka: int, kb: int, at):
    """The integer line through (``ka``, ``a``) and (``kb``, ``b``) at ``at`` (an int or a numpy array of them);
    raises ``OffLine`` where its step is not an integer (bytes, FLOPs and shapes step by whole units)."""
    step, rest = divmod(b - a, kb - ka)
    if rest:
        raise OffLine(f"{a} and {b} are not on an integer line")
    return a + step * (at - ka)


def on_line(points: Sequence[ChunkPrice], k: int) -> ChunkPrice:
    """The price at run length ``k`` on the line through ``points[0]`` and ``points[1]`` (at ``DEPTH[0]`` and
    ``DEPTH[1]``), checked at ``points[2]`` (``DEPTH[2]``); raises ``OffLine``."""
    return _line(*points, k)


def _line(a, b, c, k: int):
    ka, kb, kc = DEPTH
    if a is None or b is None or c is None:
        if a is b is c is None:
            return None
        raise OffLine("a phase present at one length and not another")
    if isinstance(a, ChunkPrice):
        return ChunkPrice(*(_line(x, y, z, k) for x, y, z in zip(a, b, c)))
    if isinstance(a, Prediction):
        out = {}
        for f in dataclasses.fields(a):
            x, y, z = getattr(a, f.name), getattr(b, f.name), getattr(c, f.name)
            if isinstance(x, list):
                if x or y or z:
                    raise OffLine(f"a recorded prediction ({f.name})")
                out[f.name] = []
            else:
                out[f.name] = _line(x, y, z, k)
        return Prediction(**out)
    if isinstance(a, dict):
        if a.keys() != b.keys() or a.keys() != c.keys():
            raise OffLine("streams differ")
        return {s: _line(a[s], b[s], c[s], k) for s in a}
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        if a == b == c:
            return a
        raise OffLine(f"{a!r}, {b!r}, {c!r} differ")
    if isinstance(a, int) and isinstance(b, int) and isinstance(c, int):  # (bytes, FLOPs: exact)
        if c != exact_line(a, b, ka, kb, kc):
            raise OffLine(f"{a}, {b}, {c} are not on a line")
        return exact_line(a, b, ka, kb, k)
    slope = (b - a) / (kb - ka)
    if not math.isclose(c, a + slope * (kc - ka), rel_tol=REL, abs_tol=1e-15):
        raise OffLine(f"{a}, {b}, {c} are not on a line")
    return a + slope * (k - ka)
