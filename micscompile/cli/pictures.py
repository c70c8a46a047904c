"""Pictures of a plan: the step's timeline and its memory over time (PNG, matplotlib).

* ``timeline_png``: one lane per stream of the simulated step (compute, and each
  communication stream: "comm:shard", "comm:replicate", ...; for a pipeline, one lane per
  stage with its forward and backward spans), coloured by what runs (compute, all-gather,
  reduce-scatter, all-reduce, ...), time in ms.
* ``memory_png``: the bytes live on one rank at each Program step (``lifetimes``), with the
  static plan's arena and its lower bound L (``plan_memory``) and what PyTorch's caching
  allocator would reserve replaying the same allocations (``caching_allocator``).

The Chrome / Perfetto trace is ``Prediction.to_chrome_trace``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from micscompile.core.errors import InputError
from micscompile.cost_model.caching_allocator import replay_buffers
from micscompile.cost_model.simulator import Prediction
from micscompile.memory.lifetimes import on_device
from micscompile.memory.planner import Buffer, plan_memory

GIB = 1 << 30
COLOURS = {
    "compute": "#4c72b0", "forward": "#4c72b0", "backward": "#8172b2", "weight gradients": "#64b5cd",
    "all-gather": "#dd8452",
    "reduce-scatter": "#55a868", "all-reduce": "#c44e52", "second hop": "#c44e52", "intra-node stage": "#937860",
    "other": "#8c8c8c",
}
_PREFIXES = (("AR", "all-reduce"), ("AG", "all-gather"), ("RS", "reduce-scatter"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def category(track: str, name: str) -> str:
    """What an event of the simulator is, for its colour and the legend."""
    if track.startswith("stage"):  # a pipeline: each stage's F, B and W, and its second hops over the replicas
        if track.endswith("replicate"):
            return "second hop"
        return {"F": "forward", "W": "weight gradients"}.get(name[:1], "backward")
    if name.startswith("intra-node"):
        return "intra-node stage"
    if track == "compute":
        return "compute"
    return next((label for prefix, label in _PREFIXES if name.startswith(prefix)), "other")


def timeline_png(pred: Prediction, path: str | Path, title: str = "") -> Path:
    """Draw ``pred``'s events (``mc.simulate``) as lanes over time into ``path``."""
    return save(timeline_figure(pred, title), path)


def memory_png(buffers: list[Buffer], path: str | Path, title: str = "") -> Path:
    """Draw one rank's step buffers over time (``memory_figure``) into ``path``."""
    return save(memory_figure(buffers, title), path)


def save(fig, path: str | Path) -> Path:
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return Path(path)


def timeline_figure(pred: Prediction, title: str = ""):
    """A matplotlib figure of ``pred``'s events (``mc.simulate``) as lanes over time."""
    if not pred.events:
        raise InputError("the prediction has no events: simulate with record=True")
    plt = _pyplot()
    tracks = sorted(dict.fromkeys(e.track for e in pred.events), key=lambda t: t != "compute")  # compute on top
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len(tracks)))
    bars: dict[str, list[tuple[int, float, float]]] = {}
    for e in pred.events:
        bars.setdefault(category(e.track, e.name), []).append((tracks.index(e.track), e.start_s, e.end_s))
    for label, spans in bars.items():
        for lane in range(len(tracks)):
            xs = [(s * 1e3, (t - s) * 1e3) for i, s, t in spans if i == lane]
            if xs:
                ax.broken_barh(xs, (lane - 0.4, 0.8), facecolors=COLOURS.get(label, COLOURS["other"]),
                               edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("stream" if not tracks[0].startswith("stage") else "pipeline stage")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS.get(k, COLOURS["other"])) for k in bars]
    ax.legend(handles, list(bars), loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small")
    ax.set_title(textwrap.fill(title or f"one step: {pred.step_time_s * 1e3:.1f} ms, exposed comm "
                               f"{pred.exposed_comm_s * 1e3:.1f} ms", 110), fontsize="medium")
    fig.tight_layout()
    return fig


def live_bytes(buffers: list[Buffer]) -> tuple[list[int], list[int]]:
    """(steps, bytes live after each step's allocations) of ``buffers`` over ``[start, end)``."""
    delta: dict[int, int] = {}
    for b in buffers:
        delta[b.start] = delta.get(b.start, 0) + b.size
        delta[b.end] = delta.get(b.end, 0) - b.size
    steps, live, total = [], [], 0
    for t in sorted(delta):
        total += delta[t]
        steps.append(t)
        live.append(total)
    return steps, live


def memory_figure(buffers: list[Buffer], title: str = ""):
    """A matplotlib figure of the live bytes of one rank's step buffers over Program steps, the
    planned arena, its lower bound L and PyTorch's caching allocator on the same allocations."""
    device = on_device(buffers)
    if not device:
        raise InputError("no device buffers to draw")
    plan = plan_memory(device)
    timeline: list[tuple[int, int, int]] = []
    cached = replay_buffers(device, timeline=timeline)
    steps, live = live_bytes(device)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.5))
    ax.step(steps, [b / GIB for b in live], where="post", color="#4c72b0", label="live bytes (planned lifetimes)")
    ax.step([t for t, _, _ in timeline], [r / GIB for _, r, _ in timeline], where="post", color="#c44e52",
            label=f"caching allocator reserved (peak {cached.peak_reserved_bytes / GIB:.3g} GiB)")
    ax.axhline(plan.arena_bytes / GIB, color="#55a868", linestyle="--",
               label=f"static plan arena {plan.arena_bytes / GIB:.3g} GiB")
    ax.axhline(plan.lower_bound_bytes / GIB, color="#8c8c8c", linestyle=":",
               label=f"lower bound L {plan.lower_bound_bytes / GIB:.3g} GiB")
    ax.set_xlabel("Program step (one rank's allocations in order)")
    ax.set_ylabel("device memory (GiB)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(textwrap.fill(title or "device memory of one step", 110), fontsize="medium")
    fig.tight_layout()
    return fig


def compare_figure(rows, title: str = ""):
    """TFLOP/s per GPU against cluster size, one line per system (``tune.compare.PeerRow``s); a hollow
    marker where the system does not fit the device memory."""
    from micscompile.tune.compare import LABELS, SYSTEM_ROWS

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for system in SYSTEM_ROWS:
        mine = [r for r in rows if r.system == system]
        if not mine:
            continue
        line, = ax.plot([r.gpus for r in mine], [r.tflops_per_gpu for r in mine], label=LABELS[system])
        for r in mine:
            ax.plot(r.gpus, r.tflops_per_gpu, "o", color=line.get_color(),
                    markerfacecolor=line.get_color() if r.fits else "none")
    err = rows[0].prediction.uncertainty if rows else 0
    ax.set(xscale="log", xlabel="GPUs", ylabel="TFLOP/s per GPU" + (f" (+-{err:.0%})" if err else ""))
    ax.set_xticks(sorted({r.gpus for r in rows}), [str(g) for g in sorted({r.gpus for r in rows})])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(textwrap.fill((title + ": " if title else "") + "hollow: does not fit the device memory", 90),
                 fontsize="medium")
    fig.tight_layout()
    return fig
