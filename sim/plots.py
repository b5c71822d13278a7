"""PNG figures for ``pagedserve simulate --plot DIR`` (matplotlib, Agg backend).

Figures:
* ``running_requests.png``: running requests per step, one line per allocator.
* ``kv_memory.png``: slots held and slots holding written KV per step, per allocator.
* ``slot_map.png``: the KV pool at one step, one panel per allocator; each pixel is a slot
  (rows of ``width`` slots; for paged a row is a whole number of blocks), coloured by owning
  request, grey for held-but-unwritten, white for free.
* ``block_size_sweep.png``: utilisation and mean block-table length against block size, and
  the measured unwritten tail per sequence against ``block_size / 2``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from pagedserve.sim.backends import FREE, RESERVED
from pagedserve.sim.simulator import SimReport, SimResult

_FREE_RGB = (1.0, 1.0, 1.0)
_RESERVED_RGB = (0.80, 0.80, 0.80)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def map_width(num_slots: int, block_size: int) -> int:
    """Slots per image row: about ``sqrt(num_slots)``, rounded up to a multiple of
    ``block_size`` so that paged blocks never straddle rows."""
    side = math.isqrt(max(1, num_slots - 1)) + 1
    return max(block_size, -(-side // block_size) * block_size)


def slot_map_rgb(snapshot: Sequence[int], width: int):
    """``[rows, width, 3]`` float array of the slot map (padding after the pool is white)."""
    import numpy as np
    from matplotlib import colormaps

    owners = np.asarray(snapshot, dtype=np.int64)
    rows = -(-len(owners) // width)
    padded = np.full(rows * width, FREE, dtype=np.int64)
    padded[: len(owners)] = owners
    tab20 = colormaps["tab20"]
    palette = np.asarray([tab20(i)[:3] for i in range(20) if i not in (14, 15)])  # no greys
    rgb = palette[np.maximum(padded, 0) % len(palette)]
    rgb[padded == FREE] = _FREE_RGB
    rgb[padded == RESERVED] = _RESERVED_RGB
    return rgb.reshape(rows, width, 3)


def plot_all(
    results: Mapping[str, SimResult],
    sweep: Sequence[SimReport],
    out_dir: str | Path,
    snapshot_step: int | None = None,
    block_size: int = 16,
    prefix: str = "",
) -> list[Path]:
    """Write every figure that the given results allow; return the paths written.

    Args:
        results: allocator label -> result (series and optional snapshot).
        sweep: paged reports of a block-size sweep (may be empty).
        out_dir: folder to write into (created).
        snapshot_step: the step of the snapshots (for titles).
        block_size: paged block size (row width of the slot maps).
        prefix: prepended to every file name (e.g. ``"simulate_"``).
    """
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    if results:
        fig, ax = plt.subplots(figsize=(8, 4))
        for label, res in results.items():
            ax.plot(res.running, label=f"{label} (mean {res.report.mean_running:.1f})", lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("running requests")
        ax.set_title("Requests in flight with the same KV memory")
        ax.legend()
        fig.tight_layout()
        written.append(out / f"{prefix}running_requests.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

        fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), squeeze=False)
        for ax, (label, res) in zip(axes[:, 0], results.items()):
            n = res.report.num_slots
            ax.fill_between(
                range(len(res.held)),
                [h / n for h in res.held],
                color="#f4a6a6",
                label="held, unwritten",
                step="post",
            )
            ax.fill_between(
                range(len(res.live)),
                [v / n for v in res.live],
                color="#3b75af",
                label="written KV",
                step="post",
            )
            ax.set_ylim(0, 1.02)
            ax.set_ylabel("fraction of slots")
            ax.set_title(f"{label}: utilisation {res.report.utilisation:.1%}")
            ax.legend(loc="upper right", fontsize=8)
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        written.append(out / f"{prefix}kv_memory.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    snaps = {k: r for k, r in results.items() if r.snapshot is not None}
    if snaps:
        fig, axes = plt.subplots(1, len(snaps), figsize=(5.5 * len(snaps), 5.8), squeeze=False)
        for ax, (label, res) in zip(axes[0], snaps.items()):
            snap = res.snapshot or ()
            width = map_width(len(snap), block_size)
            ax.imshow(slot_map_rgb(snap, width), interpolation="nearest", aspect="auto")
            written_n = sum(1 for s in snap if s >= 0)
            held_n = written_n + sum(1 for s in snap if s == RESERVED)
            owners = len({s for s in snap if s >= 0})
            ax.set_title(
                f"{label}: {owners} requests, {held_n / len(snap):.0%} held,\n"
                f"{written_n / max(1, held_n):.0%} of held written",
                fontsize=10,
            )
            ax.set_xlabel(f"slot (row = {width} slots)")
            ax.set_yticks([])
        step = "" if snapshot_step is None else f" at step {snapshot_step}"
        fig.suptitle(f"KV pool{step}: colour = request, grey = reserved unwritten, white = free")
        fig.tight_layout()
        written.append(out / f"{prefix}slot_map.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    if sweep:
        sizes = [r.block_size for r in sweep]
        fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.plot(sizes, [r.utilisation for r in sweep], "o-", color="C0")
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("block size (tokens)")
        ax1.set_ylabel("utilisation (written / held)", color="C0")
        ax2 = ax1.twinx()
        ax2.plot(sizes, [r.mean_block_table_len for r in sweep], "s--", color="C1")
        ax2.set_yscale("log")
        ax2.set_ylabel("mean block-table length (entries)", color="C1")
        ax1.set_title("Paged: utilisation vs block-table length")
        ax3.plot(sizes, [r.mean_tail_waste for r in sweep], "o-", label="measured tail / seq")
        ax3.plot(sizes, [b / 2 for b in sizes], "k:", label="block_size / 2")
        ax3.plot(sizes, [(b - 1) / 2 for b in sizes], "k--", lw=0.8, label="(block_size - 1) / 2")
        ax3.set_xscale("log", base=2)
        ax3.set_xlabel("block size (tokens)")
        ax3.set_ylabel("unwritten slots per sequence")
        ax3.set_title("Internal waste per sequence")
        ax3.legend()
        fig.tight_layout()
        written.append(out / f"{prefix}block_size_sweep.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
