"""The loss curves as a PNG (matplotlib, an optional extra: the `plot` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokaudit.errors import UsageError
from tokaudit._render.text import printable


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib: pip install matplotlib (or the plot extra: pip install '.[plot]' in a "
            "checkout of tokaudit)"
        ) from None
    return plt


def check_format(path: Path) -> None:
    """The file extension names an image format matplotlib writes (png, svg, pdf, ...)."""
    plt = _pyplot()
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    extension = path.suffix.lower().lstrip(".")
    if extension not in formats:
        raise UsageError(
            f"{path}: --plot writes {', '.join(sorted(formats))}; the name ends in "
            f"{'.' + extension if extension else 'no extension'}"
        )


def write_png(run: str, points: dict[str, tuple[Any, Any]], labels: list[tuple[str, str]], path: Path) -> None:
    """The curves as an image: per series that has a value, by key, its (steps, values) points
    (`render.curve.curve_views`: every step, or a long curve's envelope); `labels`: each series' key and label."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(9, 4.8), dpi=110)
    styles = {"token_mean": "-", "mean_of_local_means": "--", "reported": ":", "optimized": "-."}
    for key, label in labels:
        if key in points:
            axis.plot(*points[key], styles.get(key, "-"), marker="o", markersize=3, label=label)
    axis.set_xlabel("step")
    axis.set_ylabel("loss per token")
    axis.set_title(f"tokaudit · {printable(run)}")
    axis.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as error:
        raise UsageError(f"{path}: cannot write the plot ({error.strerror or error})") from None
    finally:
        plt.close(figure)
