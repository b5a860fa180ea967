"""SIGTERM and SIGINT: flush every live Recorder, then hand the signal on to whoever had it."""

from __future__ import annotations

import os
import signal
import threading
import weakref
from typing import Any

_LIVE: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
"""Each live Recorder, and the process that made it: a child forked from it (a DataLoader's worker) inherits the
handler and a copy of its records, which are the parent's to write."""
_PREVIOUS: dict[int, Any] = {}


def on_termination(recorder: Any) -> None:
    """Flush every live Recorder on SIGTERM (what torchrun, Slurm and Kubernetes send first) and
    SIGINT, then hand the signal to whatever handled it before: the trainer's own handler still runs,
    and a default action still ends the process."""
    _LIVE[recorder] = os.getpid()
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signum in _PREVIOUS:
            continue
        try:
            _PREVIOUS[signum] = signal.getsignal(signum)
            signal.signal(signum, _flush_then_chain)
        except (ValueError, OSError):
            _PREVIOUS.pop(signum, None)


_DEFERRED: list[tuple[int, Any]] = []


def made_here(recorder: Any) -> bool:
    """The recorder was made in this process, not inherited by a child forked from the one that made it."""
    return _LIVE.get(recorder, os.getpid()) == os.getpid()


def _flush_then_chain(signum: int, frame: Any) -> None:
    recorders = [recorder for recorder in list(_LIVE) if made_here(recorder)]
    if any(getattr(r, "flushing", False) for r in recorders):
        # The signal came in the middle of a flush: let it finish, then act (see run_deferred).
        _DEFERRED.append((signum, frame))
        return
    # What is closed is written at once, before whatever the signal does next (a checkpoint's save, a kill); the
    # update under way waits to see whether the process ends with it.
    _flush(recorders, ending=False)
    previous = _PREVIOUS.get(signum)
    if previous == signal.SIG_IGN:
        return
    if callable(previous):
        try:
            previous(signum, frame)
        except BaseException:  # the handler ends the run (SystemExit, KeyboardInterrupt): the update ends unstepped
            _flush(recorders, ending=True)
            raise
        return  # handled, and the training goes on (a preemption flag): the update under way is no unfinished one
    _flush(recorders, ending=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _flush(recorders: list[Any], ending: bool) -> None:
    """Write the recorders' records: `ending`, every one, the update under way said never stepped; else those of
    closed updates (the automatic flush's)."""
    for recorder in recorders:
        try:
            if ending:
                recorder.note_unfinished()
            recorder.flush(wait_for_backward=not ending)
        except Exception:  # the signal's own action matters more than one last shard
            pass


def run_deferred() -> None:
    """Act on a signal that arrived during a flush, now that the flush is complete."""
    while _DEFERRED:
        signum, frame = _DEFERRED.pop(0)
        _flush_then_chain(signum, frame)
