"""Where the records go: buffered records turned into Parquet tables and written as shards (through a bounded
backlog, `tokaudit.hooks._uploads`), the steps whose records could not be kept noted in the next shard."""

from __future__ import annotations

import os
import shlex
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from tokaudit import __version__
from tokaudit.hooks._columns import Packed, PackedHost, ranges, to_host, writable_rows
from tokaudit.hooks._probe import ProbeResult
from tokaudit.hooks._record import Record
from tokaudit.hooks._shards import ShardWriter, StoreShardWriter
from tokaudit.hooks._uploads import Backlog, Uploader
from tokaudit._schema import DESTINATION_KEY, SCHEMA_VERSION, WRITER_SCHEMA, dropped_metadata, provenance_metadata
from tokaudit._schema import spool_folder
from tokaudit._storage import is_url, local_path

PACKED_VALUES = (
    "loss_sum",
    "valid_tokens",
    "backward_scalar",
    "positions",
    "reported_loss",
    "grad_scale",
    "loss_scale",
    "skipped",
)
"""A record's values that may be one-number tensors, packed once its update closes (`Recorder._pack`)."""

Warn = Callable[[str, str], None]


@dataclass(frozen=True, slots=True)
class Stamp:
    """What every record of one recorder carries besides its own values."""

    rank: int
    world_size: int
    group: str
    run_id: str
    grad_divisor: float | None
    divisor_known: bool


def holders(record: Record) -> Iterator[tuple[Any, str]]:
    """Where the values of `record` that may be one-number tensors are held: the record, and its probe's result
    (`columns.pack`)."""
    for name in PACKED_VALUES:
        yield record, name
    if record.probe is not None:
        for name in ProbeResult.VALUES:
            yield record.probe, name


def _packed_values(record: Record) -> Iterator[Packed]:
    """The values of `record` and of its probe that were packed (`Recorder._pack`)."""
    for holder, name in holders(record):
        if isinstance(value := getattr(holder, name), Packed):
            yield value


def shown(path: Path | str) -> str:
    """A path in a line of ours, its control characters escaped (a run id from a job name may hold any): as it is
    where every character prints, else as Python writes it (`'a\\x1b[31m'`)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def shell_word(path: Path | str) -> str:
    """A path as a word of a command to copy into a shell: quoted where it needs it (`shown` where it cannot be)."""
    text = str(path)
    return shlex.quote(text) if text.isprintable() else repr(text)


def run_folder(run_id: str, warn: Warn) -> str:
    """The run id as the folder its shards go to inside log_dir, locally and on object storage alike. Run ids
    often come from job names: one that would leave log_dir (an absolute path, a `..` part, nothing but
    separators and dots) becomes one name inside it, its parts joined by "_", with one warning; relative parts
    that stay inside (sweep/trial-3) are kept."""
    parts = re.split(r"[/\\]+", run_id.replace("\0", "_"))
    named = [part for part in parts if part not in ("", ".", "..")]
    if named and ".." not in parts and not run_id.startswith(("/", "\\")) and "\0" not in run_id:
        return run_id
    cleaned = "_".join(named) or "run"
    warn(
        "run_id",
        f"tokaudit: run_id {run_id!r} would leave log_dir; its shards go to {cleaned!r} inside it, "
        "the run id they record",
    )
    return cleaned


class ShardOutput:
    """One recorder's shards: a local folder or a URL on object storage, opened at the first write."""

    def __init__(self, log_dir: str | os.PathLike[str], run_id: str | None, flush_every: int, warn: Warn) -> None:
        self.flush_every = flush_every
        self.warn = warn
        self.usable = True
        """False when `log_dir` is no path at all: nothing is recorded."""
        self.writer: ShardWriter | StoreShardWriter | None = None
        self.prefix = "rank-00000"
        """The shards' names before their sequence number (set at each write, from the stamp)."""
        self.uploader: Uploader | None = None
        self.launch_id = uuid.uuid4().hex
        """This recorder's launch, in every shard's provenance."""
        self.last_metadata: Callable[[dict[int, int]], dict[bytes, bytes]] = lambda dropped: {}
        """The footer of the last shard asked for (a spooled shard carries it too)."""
        self.first_step: int | None = None
        """The step of this recorder's first record written: a folder that already holds shards of its rank
        while it starts at step 0 again is a resumed run without begin_step (`_writer`)."""
        self.provenance: dict[str, Any] = {"tokaudit": __version__, "torch": torch.__version__}
        """What every shard's footer says of where it came from (`schema.PROVENANCE_KEY`); an integration
        adds its trainer and version."""
        self.log_dir: Path | str
        """Where the shards go: a local folder, or a URL on object storage (s3://bucket/runs/exp1)."""
        run_id = None if run_id is None else run_folder(str(run_id), warn)
        if is_url(log_dir):
            # Opened at the first flush (a store that cannot be reached then warns and retries).
            # the run id joins the URL's path, before a query string (gs://b/runs?endpoint_override=host:port)
            address, mark, query = str(log_dir).partition("?")
            url = address.rstrip("/")
            self.log_dir = f"{url}/{run_id}{mark}{query}" if run_id else f"{url}{mark}{query}"
            self.run_id = run_id or url.rsplit("/", 1)[-1]
            self.backlog = Backlog(warn, self.log_dir)
            self.uploader = Uploader(self.backlog, self._writer)
            return
        try:
            base = Path(local_path(log_dir))
            self.log_dir = base / run_id if run_id else base
        except TypeError as error:
            warn("log_dir", f"tokaudit: log_dir {log_dir!r} is not a path ({error}); nothing is recorded")
            self.log_dir, self.usable = Path(os.devnull), False
        try:
            if self.usable:
                self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            # the key of a failed write: the writes that then fail say nothing more (`Backlog.write`)
            warn(
                "write",
                f"tokaudit: cannot create {self.log_dir} ({error}); records are kept in memory and "
                "written when it can be created",
            )
        self.run_id = run_id or self.log_dir.absolute().name
        self.backlog = Backlog(warn, str(self.log_dir))

    def note_dropped(self, step: int, count: int) -> None:
        self.backlog.note_dropped(step, count)

    def note_dropped_records(self, records: Iterable[Record]) -> None:
        for record in records:
            self.note_dropped(int(record.step), 1)

    def add(self, records: list[Record], stamp: Stamp) -> None:
        """Turn `records` into a table waiting to be written; records that cannot be read back are dropped."""
        try:
            table = self._table(records, stamp)
            if self.first_step is None and table.num_rows:
                self.first_step = int(pc.min(table.column("step")).as_py())
            self.backlog.add(table)
        except Exception as error:
            self.note_dropped_records(records)
            self.warn(
                "table",
                f"tokaudit: {len(records)} record(s) could not be read back ({error!r}); they are "
                "noted in the log as dropped",
            )

    def write(self, stamp: Stamp) -> None:
        """Write everything waiting, as one shard: here for a local folder, by the uploader thread for object
        storage; what cannot be written waits (bounded) for the next flush."""
        if not self.backlog:
            return
        prefix = f"rank-{stamp.rank:05d}"
        self.prefix = prefix if stamp.group == "0" else f"group-{re.sub(r'[^0-9A-Za-z]+', '_', stamp.group)}-{prefix}"
        facts = {**self.provenance, "world_size": stamp.world_size, "launch_world_size": launch_world_size()}

        def metadata(dropped: dict[int, int]) -> dict[bytes, bytes]:
            # the launch: this recorder's id, and the number its rank's first shard took in the folder (a launch
            # that resumes there numbers after every shard before it): which of two launches is the later, with
            # no clock (`schema.read_launch`)
            launch = {"id": self.launch_id, "first_shard": getattr(self.writer, "first_sequence", None)}
            provenance = provenance_metadata({**facts, "launch": launch})
            if not dropped:
                return provenance
            return {**provenance, **dropped_metadata(stamp.run_id, stamp.group, stamp.rank, ranges(dropped))}

        self.last_metadata = metadata
        if self.uploader is not None:
            self.uploader.kick(metadata)
        else:
            self.backlog.write(self._writer, metadata)

    def close(self) -> None:
        """The last write: the uploader's last attempt (bounded); then one warning for what is still unwritten."""
        if self.uploader is not None:
            self.uploader.close()
        self.backlog.say_unwritten(self._spool)

    def _spool(self, tables: list[pa.Table]) -> str:
        """What close() could not write, as one shard in the local spool, its destination in its footer; its path."""
        folder = spool_folder() / re.sub(r"[^0-9A-Za-z._-]+", "_", str(self.log_dir)).strip("_")
        folder.mkdir(parents=True, exist_ok=True)
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        metadata = {
            **(table.schema.metadata or {}),
            **self.last_metadata({}),
            # a folder as an absolute path (sync may run from anywhere), in the bytes the OS names it by
            DESTINATION_KEY: self.log_dir.encode()
            if isinstance(self.log_dir, str)
            else os.fsencode(self.log_dir.absolute()),
        }
        name = f"{self.prefix}-spooled-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.parquet"
        temporary = folder / f".{name}.tmp"
        pq.write_table(table.replace_schema_metadata(metadata), temporary)
        os.replace(temporary, folder / name)
        return str(folder / name)

    def _writer(self) -> ShardWriter | StoreShardWriter:
        if self.writer is None:
            self.writer = (
                StoreShardWriter(self.log_dir, self.prefix)
                if isinstance(self.log_dir, str)
                else ShardWriter(self.log_dir, self.prefix)
            )
            if self.writer.sequence > 0 and self.first_step == 0:
                self.warn(
                    "resumed",
                    f"tokaudit: {self.log_dir} already holds shards of {self.prefix} and this "
                    "recorder starts at step 0 again: a resumed run without rec.begin_step(step) "
                    "(the trainer's global step), an earlier launch of the same run id, or a second Recorder of "
                    "this run in one process repeats step numbers, which the audit reports as duplicate_records",
                )
        return self.writer

    def _table(self, records: list[Record], stamp: Stamp) -> pa.Table:
        probes = [r.probe for r in records]
        packed = PackedHost()  # the places these records hold in their slabs, copied to the host at once
        packed.copy([value for record in records for value in _packed_values(record)])
        columns = _columns(records, stamp, packed)
        for name in ("weight_sum", "weight_min", "weight_max", "masked_abs_sum"):
            values = [getattr(p, name) if isinstance(p, ProbeResult) and p.filled else None for p in probes]
            host = to_host(values, torch.float64, packed)
            if name in ("weight_min", "weight_max"):
                # min/max over an empty set of valid tokens is ±inf on the device: null in the log.
                host = [None if v is not None and abs(v) == float("inf") else v for v in host]
            columns["masked_weight_abs_sum" if name == "masked_abs_sum" else f"token_{name}"] = host
        keep, cleared = writable_rows(columns, [isinstance(p, ProbeResult) and p.filled for p in probes])
        if cleared:
            self.warn(
                "positions",
                f"tokaudit: {cleared} record(s) with a number of positions no audit can use "
                "(negative, not whole, past 2³¹ − 1, or below the valid tokens) were written "
                "without it",
            )
        if not all(keep):
            bad = [r for r, ok in zip(records, keep) if not ok]
            self.note_dropped_records(bad)
            self.warn(
                "invalid",
                f"tokaudit: {len(bad)} record(s) with a value no audit can use (a null, negative "
                "or impossibly large count, a missing loss sum, a NaN scale) were left out and "
                "noted in the log as dropped",
            )
            columns = {name: [v for v, ok in zip(values, keep) if ok] for name, values in columns.items()}
        listed = {name: list(values) for name, values in columns.items()}
        try:
            return _arrow(listed)
        except (pa.ArrowException, TypeError, ValueError) as error:
            # one value Arrow cannot hold (a bool count) costs its own record, not the others': each row tried alone
            kept = [r for r, ok in zip(records, keep) if ok]
            fits = [_fits({name: values[i] for name, values in listed.items()}) for i in range(len(kept))]
            self.note_dropped_records([r for r, ok in zip(kept, fits) if not ok])
            self.warn(
                "table",
                f"tokaudit: {fits.count(False)} record(s) could not be read back ({error!r}); they are noted in the "
                "log as dropped",
            )
            return _arrow({name: [v for v, ok in zip(values, fits) if ok] for name, values in listed.items()})


def _arrow(columns: dict[str, list[Any]]) -> pa.Table:
    """The shard's table of these columns, in the writer's schema."""
    arrays = {name: pa.array(values, type=WRITER_SCHEMA.field(name).type) for name, values in columns.items()}
    return pa.table([arrays[field.name] for field in WRITER_SCHEMA], schema=WRITER_SCHEMA)


def _fits(row: dict[str, Any]) -> bool:
    """One record's values each fit their column's type."""
    try:
        _arrow({name: [value] for name, value in row.items()})
    except (pa.ArrowException, TypeError, ValueError):
        return False
    return True


def _bits(record: Record) -> int | None:
    """precision_bits: the fewest significant bits of S, b and the probe's gradients."""
    probe = record.probe
    found = [bits for bits in (record.bits, None if probe is None else probe.bits) if bits is not None]
    return min(found) if found else None


def _columns(records: list[Record], stamp: Stamp, packed: PackedHost) -> dict[str, Iterable[Any]]:
    """The records' columns but the probe's, on the host."""
    count = len(records)
    backward = to_host([r.backward_scalar for r in records], torch.float64, packed)
    grad_scale = to_host([r.grad_scale for r in records], torch.float64, packed)
    loss_scale = to_host([r.loss_scale for r in records], torch.float64, packed)
    skipped = to_host([r.skipped for r in records], torch.bool, packed)
    for i, (record, scale) in enumerate(zip(records, loss_scale)):
        if backward[i] is not None and record.divide != 1:
            backward[i] = backward[i] / record.divide  # what accelerator.backward backpropagated
        if scale is not None:
            # The probe saw ∂(scale·loss)/∂ℓ: b is the scaled scalar, g = g_user/scale divides it out.
            grad_scale[i] = (1.0 if grad_scale[i] is None else grad_scale[i]) / scale
            if backward[i] is not None and not record.prescaled:
                backward[i] = backward[i] * scale
    return {
        "step": [r.step for r in records],
        "micro": [r.micro for r in records],
        "rank": [stamp.rank] * count,
        "world_size": [stamp.world_size] * count,
        "loss_sum": to_host([r.loss_sum for r in records], torch.float64, packed),
        "valid_tokens": to_host([r.valid_tokens for r in records], torch.int64, packed),
        "backward_scalar": backward,
        "run_id": [stamp.run_id] * count,
        "group": [stamp.group] * count,
        "term": [r.term for r in records],
        "term_weight": [r.term_weight for r in records],
        "grad_divisor": [stamp.grad_divisor] * count,
        "divisor_known": [stamp.divisor_known] * count,
        "grad_scale": grad_scale,
        "positions": to_host([r.positions for r in records], torch.int64, packed),
        "reported_loss": to_host([r.reported_loss for r in records], torch.float64, packed),
        "sync": [r.sync for r in records],
        "skipped": [None if v is None else bool(v) for v in skipped],
        "time": [r.time for r in records],
        "precision_bits": [_bits(r) for r in records],
        "schema_version": [SCHEMA_VERSION] * count,
    }


def launch_world_size() -> int:
    """Every process of the launch (torch.distributed's world), which a group under DP×TP or CP is part of."""
    import torch.distributed as dist

    return int(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1
