"""Padded token sequences as dicts (input_ids, attention_mask, labels), shared by the distributed tests and the trainer matrix."""

from __future__ import annotations

from typing import Any


def padded_sequences() -> Any:
    """Sequences of uneven length, right-padded; labels -100 on padding."""
    import torch
    from torch.utils.data import Dataset

    class Padded(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 48

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            generator = torch.Generator().manual_seed(index)
            length = int(torch.randint(2, 16, (), generator=generator))
            ids = torch.randint(1, 64, (16,), generator=generator)
            keep = torch.arange(16) < length
            return {
                "input_ids": ids.masked_fill(~keep, 0),
                "attention_mask": keep.long(),
                "labels": ids.masked_fill(~keep, -100),
            }

    return Padded()
