"""The naive audit to beat: read every shard with pandas, group by step, one per-row ratio check."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pandas as pd


def naive_check(folder: Path, rtol: float = 1e-4) -> int:
    """Records whose q = (b/S)·g/D·N is not 1 (the single check, no diagnosis)."""
    frame = pd.read_parquet(
        folder,
        columns=["step", "rank", "micro", "loss_sum", "valid_tokens", "backward_scalar", "grad_divisor", "grad_scale"],
    )
    tokens = frame.groupby("step")["valid_tokens"].transform("sum")
    valid = frame.valid_tokens > 0
    q = frame.backward_scalar / frame.loss_sum * frame.grad_scale / frame.grad_divisor * tokens
    return int(((q - 1).abs() > rtol)[valid].sum())


if __name__ == "__main__":
    start = time.perf_counter()
    bad = naive_check(Path(sys.argv[1]))
    print(f"naive: {bad} off-weight records in {time.perf_counter() - start:.2f}s")
