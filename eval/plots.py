"""Plots for reports: size against quality with the Pareto front, and per-layer error."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402

from slimlm.eval.size import comparable_bytes  # noqa: E402
from slimlm.rundir import as_created  # noqa: E402


def save_figure(figure, path: Path) -> Path:
    """Lay `figure` out, write it to `path` through a temporary file (a reader never sees half a
    PNG) and free it."""
    figure.tight_layout()
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}-", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    as_created(temp)
    try:
        figure.savefig(temp, dpi=120)
        os.replace(temp, path)
    finally:
        plt.close(figure)
        Path(temp).unlink(missing_ok=True)
    return path


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats in both coordinates (lower is better in both)."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (ox <= x and oy <= y) and (ox < x or oy < y) for j, (ox, oy) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plot_size_quality(rows: Sequence[dict], path: Path) -> Optional[Path]:
    """Bytes against perplexity and against KL, one panel each; None if under two rows qualify."""
    metrics = [
        (key, label)
        for key, label in (("ppl", "perplexity"), ("kl_mean", "mean KL to the original (nats)"))
        if sum(key in r and "bytes" in r for r in rows) >= 2
    ]
    if not metrics:
        return None
    figure, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.5), squeeze=False)
    for axis, (key, label) in zip(axes[0], metrics):
        chosen = [r for r in rows if key in r and "bytes" in r]
        points = [(comparable_bytes(r) / 2**20, r[key]) for r in chosen]
        axis.scatter([p[0] for p in points], [p[1] for p in points], color="tab:blue", zorder=3)
        for (x, y), row in zip(points, chosen):
            axis.annotate(row["name"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        front = pareto_front(points)
        axis.plot(
            [points[i][0] for i in front],
            [points[i][1] for i in front],
            color="tab:orange",
            linestyle="--",
            label="Pareto front",
            zorder=2,
        )
        axis.set_xlabel("size as stored (MiB)")
        axis.set_ylabel(label)
        if key == "kl_mean" and all(p[1] > 0 for p in points):
            axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend(loc="upper right")
    return save_figure(figure, path)


def plot_layer_errors(errors: dict[str, float], title: str, path: Path) -> Optional[Path]:
    """Relative weight error of each quantized layer, in model order."""
    if not errors:
        return None
    figure, axis = plt.subplots(figsize=(max(8, len(errors) * 0.05), 4))
    axis.bar(range(len(errors)), list(errors.values()), color="tab:blue", width=1.0)
    axis.set_xlabel("layer (model order)")
    axis.set_ylabel("‖W − Q(W)‖ / ‖W‖")
    axis.set_title(title)
    axis.grid(axis="y", alpha=0.3)
    return save_figure(figure, path)


def plot_bit_map(bits: dict[str, int], title: str, path: Path) -> Optional[Path]:
    """The bit width chosen for each Linear layer: decoder layers down, module kinds across."""
    if not bits:
        return None
    rows: dict[str, dict[str, int]] = {}
    for name, width in bits.items():
        block, _, kind = name.rpartition(".")
        rows.setdefault(block.rsplit(".", 1)[0], {})[kind] = width  # 'model.layers.3.mlp' -> 'model.layers.3'
    kinds = list(dict.fromkeys(kind for per_kind in rows.values() for kind in per_kind))
    widths = sorted(set(bits.values()))
    # One colour per width (categorical): the map shows which width each layer got, not a scale.
    grid = [
        [widths.index(per_kind[kind]) if kind in per_kind else float("nan") for kind in kinds]
        for per_kind in rows.values()
    ]
    figure, axis = plt.subplots(figsize=(1.2 * len(kinds) + 2, 0.25 * len(rows) + 1.5))
    cmap = plt.get_cmap("viridis", len(widths))
    image = axis.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(widths) - 0.5)
    axis.set_xticks(range(len(kinds)), kinds, rotation=30, ha="right")
    axis.set_yticks(range(len(rows)), [block.rsplit(".", 1)[-1] for block in rows], fontsize=7)
    axis.set_ylabel("decoder layer")
    axis.set_title(title)
    colorbar = figure.colorbar(image, ticks=range(len(widths)))
    colorbar.set_ticklabels([str(width) for width in widths])
    colorbar.set_label("bits")
    return save_figure(figure, path)


def plot_training(history: list[dict], title: str, path: Path) -> Optional[Path]:
    """Training loss per optimizer step (each term of it) and held-out perplexity where measured."""
    if not history:
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    steps = [record["step"] for record in history]
    for key, label in (
        ("loss", "loss"),
        ("kd", "distillation term"),
        ("ce", "cross-entropy term"),
        ("hidden", "hidden-state term"),
    ):
        if key in history[0] and not (
            key == "loss" and len([k for k in ("kd", "ce", "hidden") if k in history[0]]) == 1
        ):
            left.plot(steps, [record[key] for record in history], label=label)
    left.set_xlabel("optimizer step")
    left.set_yscale("log")
    left.grid(alpha=0.3)
    left.legend()
    evaluated = [record for record in history if "held_out_ppl" in record]
    right.plot(
        [r["step"] for r in evaluated], [r["held_out_ppl"] for r in evaluated], marker="o", color="tab:green"
    )
    right.set_xlabel("optimizer step")
    right.set_ylabel("held-out perplexity")
    right.set_yscale("log")
    right.grid(alpha=0.3)
    figure.suptitle(title)
    return save_figure(figure, path)
