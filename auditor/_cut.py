"""A run whose last update was cut short: a job killed inside it after a flush (SIGKILL, which no recorder can answer,
leaves no note that it stopped) leaves that update's first microbatches, none synchronized, never applied. Its weights
(part of an update's tokens) are no claim about the run: it is left out, and said with a warning (`unfinished_update`):
a loop that flushed and then stepped a short last update unsynchronized leaves the same records."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from tokaudit._checks import Ending, Held, grouped, main_term_first, over_groups


def unsynced_end(parts: Iterable[pd.DataFrame]) -> int | None:
    """The run's last step, where the run may have ended inside that update: every record of it, of every group and
    term, unsynchronized on every rank and said neither applied nor skipped; and on each group's main term every rank
    of it holds fewer microbatches than the most a rank held before (`Ending.short`), where those synchronized (none
    lacks a synchronization but an update said skipped, some had one). None otherwise: an update of its whole
    microbatches, one said applied, or a term that synchronized there, is judged (`missing_sync` reads it)."""
    endings: dict[tuple[str, str], Ending] = {}
    for part in parts:
        for group, rows in grouped(part.grp):
            block = part.iloc[rows] if isinstance(rows, np.ndarray) else part
            for term, held in grouped(block.term):
                endings.setdefault((group, term), Ending()).add(block, held)
    if not endings:
        return None
    last = max(ending.last for ending in endings.values())
    at_last = {key: ending for key, ending in endings.items() if ending.last == last}
    main = main_term_first(
        over_groups({key: Held(e.synced, e.records, accumulating=e.accumulated) for key, e in endings.items()})
    )[0]
    mains = [ending for (_, term), ending in at_last.items() if term == main]
    cut = (
        bool(mains)
        and all(ending.at.cut for ending in at_last.values())
        and all(e.before.synced and not e.before.unsynced and e.short for e in mains)
    )
    return int(last) if cut else None
