"""A run's ``report.png``: loss (and eval loss), learning rate, throughput and MFU by step, drawn
from the run :mod:`acc_train.outputs.report` reads. matplotlib is imported only when a PNG is drawn.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from acc_train.errors import UserError
from acc_train.files.output_paths import readable
from acc_train.outputs.metrics import METRICS_FILE
from acc_train.outputs.report import RunRecord, read_run, summary_rows

__all__ = ["REPORT_PNG", "draw_report", "write_report"]

REPORT_PNG = "report.png"


def _smoothed(values: list[float], window: int) -> list[float]:
    """A trailing mean: step-to-step noise hides the trend of a short run's loss."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def draw_report(record: RunRecord, path: str | Path | None = None) -> Path:
    """Draw loss (and eval loss), learning rate and tokens/s against step into a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg draws the file

    target = Path(path) if path is not None else record.output_dir / REPORT_PNG
    steps = [r.step for r in record.steps]
    fig = Figure(figsize=(10, 9), dpi=110, layout="constrained")
    ax_loss, ax_lr, ax_tps = fig.subplots(3, 1, sharex=True, height_ratios=[2.2, 1, 1])
    rows = dict(summary_rows(record))
    fig.suptitle(
        f"{record.output_dir.name}: {rows['strategy']}, world size {rows['world size']}, {rows['steps']} steps\n"
        f"final loss {rows['final loss']}, eval loss {rows.get('eval loss', '-')}, {rows['tokens/s']} tokens/s, MFU {rows['MFU'].split(' ')[0]}",
        fontsize=13,
    )

    losses = [r.loss for r in record.steps]
    if losses:
        window = max(1, len(losses) // 25)
        ax_loss.plot(steps, losses, color="tab:blue", alpha=0.35 if window > 1 else 1.0, lw=1, label="train loss")
        if window > 1:
            ax_loss.plot(steps, _smoothed(losses, window), color="tab:blue", lw=2, label=f"train loss, mean of {window} steps")
        best = min(record.steps, key=lambda r: r.loss)
        ax_loss.plot([best.step], [best.loss], "*", color="tab:red", ms=12, zorder=5, label=f"best {best.loss:.4f} (step {best.step})")
    if record.loss_evals:
        ax_loss.plot(
            [r.step for r in record.loss_evals], [r.eval_loss for r in record.loss_evals],
            "o-", color="tab:orange", lw=1.5, ms=6, label="eval loss",
        )  # fmt: skip
    for name, step, _ in record.checkpoints:
        if step is not None:
            ax_loss.axvline(step, color="gray", lw=0.8, ls=":", zorder=0)
    if record.checkpoints:
        ax_loss.plot([], [], color="gray", lw=0.8, ls=":", label="checkpoint")
    ax_loss.set_ylabel("loss (cross-entropy)")
    ax_loss.set_title("Loss", loc="left", fontsize=11)
    ax_loss.legend(loc="upper right", fontsize=9)

    lrs = [(r.step, r.lr) for r in record.steps if isinstance(r.lr, (int, float))]
    if lrs:
        ax_lr.plot(*zip(*lrs), color="tab:green", lw=1.8)
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_lr.set_title("Learning rate", loc="left", fontsize=11)

    tps = [(r.step, r.tokens_per_s) for r in record.steps if isinstance(r.tokens_per_s, (int, float))]
    if tps:
        ax_tps.plot(*zip(*tps), color="tab:purple", lw=1.8)
        ax_tps.set_ylim(bottom=0)
    mfus = [(r.step, 100 * r.mfu) for r in record.steps if isinstance(r.mfu, (int, float)) and not isinstance(r.mfu, bool)]
    if mfus:  # the same mean, as a share of the devices' peak
        ax_mfu = ax_tps.twinx()
        ax_mfu.plot(*zip(*mfus), color="tab:olive", lw=1.4, ls="--")
        ax_mfu.set_ylim(bottom=0)
        ax_mfu.set_ylabel("MFU (%)", color="tab:olive")
        ax_mfu.spines[["top"]].set_visible(False)
    ax_tps.set_ylabel("tokens/s (real tokens)")
    ax_tps.set_xlabel("optimizer step")
    ax_tps.set_title("Throughput (mean since the run started)" + ("; dashed: MFU" if mfus else ""), loc="left", fontsize=11)

    for ax in (ax_loss, ax_lr, ax_tps):
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
    if steps:
        ax_tps.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)  # never a name the user may own
    os.close(fd)
    tmp = Path(name)
    try:
        fig.savefig(tmp, format="png")
    except (ValueError, OverflowError) as exc:  # matplotlib cannot place ticks for values near 1e308
        tmp.unlink(missing_ok=True)
        raise UserError(
            f"cannot draw {target.name}: a value in {METRICS_FILE} is beyond what a plot can show ({exc})",
            where=str(record.output_dir / METRICS_FILE),
            hint="`acc-train report --no-png` prints the summary without the plot",
        ) from None
    readable(tmp)  # mkstemp's 0600: the report is as readable as the run's other files
    tmp.replace(target)
    return target


def write_report(output_dir: str | Path) -> Path:
    """Read the run in ``output_dir`` and draw its ``report.png``."""
    return draw_report(read_run(output_dir))
