"""The loss curves as a PNG (matplotlib, an optional extra: pip install 'tokaudit[plot]')."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tokaudit.errors import UsageError
from tokaudit.render.console import CURVE_COLUMNS


def write_png(run: str, curve: pd.DataFrame, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'tokaudit[plot]'") from None
    figure, axis = plt.subplots(figsize=(9, 4.8), dpi=110)
    styles = {"token_mean": "-", "mean_of_local_means": "--", "reported": ":", "optimized": "-."}
    for key, label in CURVE_COLUMNS:
        if curve[key].notna().any():
            axis.plot(curve.step, curve[key], styles[key], marker="o", markersize=3, label=label)
    axis.set_xlabel("step")
    axis.set_ylabel("loss per token")
    axis.set_title(f"tokaudit · {run}")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
