"""PNG figures: the agent's search path over a grid of images, and training curves."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from torch import Tensor  # noqa: E402


def search_paths(images01: Tensor, trajectory: Tensor, gt: Tensor | None, path: str | Path,
                 cols: int = 6, title: str = "") -> Path:
    """Draw ``trajectory [T+1, N, 4]`` over ``images01 [N, C, S, S]`` (early steps light, the final box
    red, the ground truth ``gt [N, 4]`` green dashed) -> the PNG's path."""
    n = images01.shape[0]
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2 * cols, 2 * rows + (0.4 if title else 0)), squeeze=False)
    steps = trajectory.shape[0]
    cmap = plt.get_cmap("Blues")
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i >= n:
            continue
        img = images01[i].permute(1, 2, 0).clamp(0, 1).cpu().numpy()
        ax.imshow(img[..., 0] if img.shape[-1] == 1 else img, cmap="gray", vmin=0, vmax=1)
        for t in range(steps):
            x1, y1, x2, y2 = trajectory[t, i].tolist()
            last = t == steps - 1
            ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, lw=2 if last else 0.8,
                                   ec="red" if last else cmap(0.3 + 0.7 * t / max(1, steps - 1))))
        if gt is not None:
            x1, y1, x2, y2 = gt[i].tolist()
            ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, lw=1.2, ec="lime", ls="--"))
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def training_curves(history: dict[str, list[dict]], path: str | Path) -> Path:
    """One panel per metric of each stage's history (``{"embedding": [{epoch, ...}], "agent": [...]}``)."""
    panels = [(stage, key) for stage, recs in history.items() if recs
              for key in recs[0] if key not in ("epoch", "iteration")]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(3.2 * max(1, len(panels)), 2.8), squeeze=False)
    for ax, (stage, key) in zip(axes.flat, panels, strict=False):
        recs = history[stage]
        xkey = "epoch" if "epoch" in recs[0] else "iteration"
        ax.plot([r[xkey] for r in recs], [r[key] for r in recs], marker=".")
        ax.set_title(f"{stage}: {key}", fontsize=8)
        ax.set_xlabel(xkey, fontsize=8)
        ax.tick_params(labelsize=7)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:  # noqa: ANN001 (a matplotlib Figure)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
