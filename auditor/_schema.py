"""The log format (docs/SCHEMA.md): one row per backward pass of one rank, shared by hooks and auditor."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa

SCHEMA_VERSION = 1

Kind = Literal["int", "float", "bool", "string", "timestamp"]

INT32_MAX = (1 << 31) - 1
"""The most valid tokens or positions one record may hold, and the largest W, rank or microbatch index: the
step table holds them in 32 bits (a step's N, Σ n over at most 2³² records, then stays exact in int64 and in
a float64)."""


@dataclass(frozen=True, slots=True)
class Column:
    """One column of the log format."""

    name: str
    """Column name, exactly as written in Parquet."""
    kind: Kind
    """Family of Arrow types accepted on read (any width of it)."""
    arrow_type: pa.DataType
    """Type the recorder writes."""
    required: bool
    """A shard without this column is rejected."""
    meaning: str
    """One line for docs and error messages."""
    low: tuple[int, str] | None = None
    """The least value a record may hold, and what a value below it is (in a line that names the file)."""
    high: tuple[int, str] | None = None
    """The greatest value a record may hold, and what a value above it is."""


_BEYOND_INT32 = "a value beyond int32, its type in the log format"

COLUMNS: tuple[Column, ...] = (
    Column("step", "int", pa.int64(), True, "optimizer-update index"),
    Column(
        "micro",
        "int",
        pa.int32(),
        True,
        "microbatch index inside the step, 0-based",
        (0, "a negative microbatch index"),
        (INT32_MAX, _BEYOND_INT32),
    ),
    Column(
        "rank",
        "int",
        pa.int32(),
        True,
        "rank inside the gradient-averaging group",
        (0, "a negative rank"),
        (INT32_MAX, _BEYOND_INT32),
    ),
    Column(
        "world_size",
        "int",
        pa.int32(),
        True,
        "W: size of the averaging group",
        (1, "a world size below 1"),
        (INT32_MAX, _BEYOND_INT32),
    ),
    Column("loss_sum", "float", pa.float64(), True, "S: sum of per-token losses over valid tokens"),
    Column(
        "valid_tokens",
        "int",
        pa.int64(),
        True,
        "n: valid tokens of the microbatch",
        (0, "a negative count"),
        (INT32_MAX, "more tokens than a microbatch can hold (above 2³¹ − 1)"),
    ),
    Column("backward_scalar", "float", pa.float64(), True, "b: the scalar backward() ran on"),
    Column("run_id", "string", pa.string(), False, "groups rows into runs"),
    Column("group", "string", pa.string(), False, "id of the averaging group"),
    Column("term", "string", pa.string(), False, "id of the loss term inside a microbatch"),
    Column("grad_divisor", "float", pa.float64(), False, "D: divisor of the gradient reduction"),
    Column("divisor_known", "bool", pa.bool_(), False, "false when D could not be seen"),
    Column("grad_scale", "float", pa.float64(), False, "g: rescale after backward, 1/loss scale included"),
    Column(
        "term_weight",
        "float",
        pa.float64(),
        False,
        "λ: the weight the objective gives this loss term on purpose (`loss_term(name, weight=λ)`); 1 where null",
    ),
    Column(
        "positions",
        "int",
        pa.int64(),
        False,
        "T: positions in the per-token loss tensor",
        (0, "a negative count"),
        (INT32_MAX, "more positions than a microbatch can hold (above 2³¹ − 1)"),
    ),
    Column("token_weight_sum", "float", pa.float64(), False, "probe: sum of db/dl over valid tokens"),
    Column("token_weight_min", "float", pa.float64(), False, "probe: min of db/dl over valid tokens"),
    Column("token_weight_max", "float", pa.float64(), False, "probe: max of db/dl over valid tokens"),
    Column(
        "masked_weight_abs_sum",
        "float",
        pa.float64(),
        False,
        "probe: sum of |db/dl| over positions not valid whose loss is not 0",
        (0, "a negative sum of absolute values"),
    ),
    Column("reported_loss", "float", pa.float64(), False, "loss the trainer reports for the step"),
    Column("sync", "bool", pa.bool_(), False, "this backward synchronized gradients"),
    Column("skipped", "bool", pa.bool_(), False, "the trainer skipped this update by policy"),
    Column("time", "timestamp", pa.timestamp("us", tz="UTC"), False, "when the record was written"),
    Column(
        "precision_bits",
        "int",
        pa.int8(),
        False,
        "fewest significant bits among S, b and the probe's gradient as computed (8 bfloat16, 24 float32)",
        (1, "a precision below one significant bit"),
        (113, "more significant bits than any float type holds (113, a float128)"),
    ),
    Column("schema_version", "int", pa.int32(), False, "log format version"),
)

HALF_PRECISION_BITS = {"bfloat16": 8, "float16": 11}
"""Significant bits of the half precisions, which `precision_bits` says and which values logged as wider floats may
hold alone (a logged loss, `checks.reported`; the backward scalars, `engine.columns.ROUNDED_BITS`)."""

COLUMNS_BY_NAME = {column.name: column for column in COLUMNS}
UNNAMED = "0"
"""The group and the term of a record whose column is absent or null (the run's is its file's folder)."""
REQUIRED_COLUMNS = tuple(column.name for column in COLUMNS if column.required)

# Columns the recorder always writes; the auditor accepts any superset of the required ones.
WRITER_SCHEMA = pa.schema([pa.field(column.name, column.arrow_type) for column in COLUMNS])


def kind_accepts(kind: Kind, arrow_type: pa.DataType) -> bool:
    """Whether a file's Arrow type fits a column family (narrower widths and dictionaries included)."""
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    if pa.types.is_null(arrow_type):
        return True  # a column of nulls alone (pandas' all-None column): what its family's nulls mean
    if kind == "int":
        return bool(pa.types.is_integer(arrow_type))
    if kind == "float":
        return bool(pa.types.is_floating(arrow_type) or pa.types.is_integer(arrow_type))
    if kind == "bool":
        return bool(pa.types.is_boolean(arrow_type))
    if kind == "string":
        return bool(
            pa.types.is_string(arrow_type)
            or pa.types.is_large_string(arrow_type)
            or pa.types.is_string_view(arrow_type)
        )
    return bool(pa.types.is_timestamp(arrow_type))


DROPPED_KEY = b"tokaudit.dropped_steps"
"""Shard footer metadata the recorder writes when it had to drop records: JSON
{"run", "group", "rank", "steps": [[first step, last step, records], ...]}."""


def dropped_metadata(run: str, group: str, rank: int, steps: list[tuple[int, int, int]]) -> dict[bytes, bytes]:
    return {
        DROPPED_KEY: json.dumps({"run": run, "group": group, "rank": rank, "steps": [list(s) for s in steps]}).encode()
    }


PROVENANCE_KEY = b"tokaudit.provenance"
"""Shard footer metadata the recorder writes on every shard: JSON {"tokaudit", "torch", "world_size",
"launch_world_size", "launch", "pipeline" with a schedule, "trainer" with "trainer_version" when an integration
attached it, and "unfinished", the update it closed inside}; the fix text uses the trainer to name that trainer's own
settings."""


def provenance_metadata(provenance: dict[str, Any]) -> dict[bytes, bytes]:
    return {PROVENANCE_KEY: json.dumps(provenance, sort_keys=True).encode()}


@dataclass(frozen=True)
class Provenance:
    """What a shard's provenance says that the audit reads; of a run, what its shards say (`summary.setups_of`)."""

    trainer: str | None = None
    """The trainer whose integration recorded it ("transformers", "lightning", "accelerate")."""
    pipelined: bool = False
    """Recorded under a `torch.distributed.pipelining` schedule (`Recorder(schedule=)`): the loss on its last stage."""
    steps_inferred: bool = False
    """The recorder was told no update's end (no optimizer, no `begin_step`, no `step=`): it took a backward that
    synchronized gradients, or each one where that is not known, for the end of an update."""
    schedule_divisor: int | None = None
    """M, where a `torch.distributed.pipelining` schedule with `scale_grads=True` divided every gradient by its M
    microbatches after the backwards of each `step()` (recorded in g as 1/M)."""
    launch_world_size: int | None = None
    """Every process of the launch: more than W where the averaging group is a data-parallel subgroup."""
    launch: int | None = None
    """The number the first shard of the launch that wrote this one took in its folder: of two launches, the one
    with the higher number started after the other had written (no clock involved). A shard's only."""
    unfinished: int | None = None
    """The update its recorder closed inside, its optimizer never stepped (a stopped job): a shard's only."""
    closed: bool = False
    """Written as its recorder was closed by the training code (`Recorder.close`, no error in flight): the rank's
    deliberate end, never a kill's (`tokaudit._ends`). A shard's only."""
    class_weights: bool = False
    """A captured cross-entropy weighed its classes (`cross_entropy(weight=…)`): ℓᵢ = w_{yᵢ}·(−log pᵢ), and the mean
    it means divides by Σw over the update's tokens, which no record holds, not by their count N."""
    joined: tuple[tuple[str, int, int], ...] = ()
    """(group, rank, step): each rank the training code closed at that step while the others of its group went on
    (out of data under DDP's join(): `_ends.uneven_ends`). A run's only, read from its shards' footers."""


def read_provenance(metadata: dict[bytes, bytes] | None) -> Provenance:
    """A shard's provenance, read once (empty where there is none or it cannot be read; never raises)."""
    try:
        facts = json.loads(metadata[PROVENANCE_KEY]) if metadata and PROVENANCE_KEY in metadata else {}
    except (ValueError, RecursionError):  # what no recorder writes: nested past Python's limit
        facts = {}
    if not isinstance(facts, dict):
        return Provenance()

    def whole(value: Any, least: int) -> int | None:
        return value if _int64(value) and value >= least else None

    pipeline, launch, trainer = facts.get("pipeline"), facts.get("launch"), facts.get("trainer")
    pipeline = pipeline if isinstance(pipeline, dict) else {}
    return Provenance(
        trainer=trainer if isinstance(trainer, str) else None,
        pipelined=bool(pipeline),
        steps_inferred=facts.get("steps_inferred") is True,
        schedule_divisor=whole(pipeline.get("microbatches"), 2) if pipeline.get("scale_grads") is True else None,
        launch_world_size=whole(facts.get("launch_world_size"), 1),
        launch=whole(launch.get("first_shard"), 0) if isinstance(launch, dict) else None,
        unfinished=whole(facts.get("unfinished"), 0),
        closed=facts.get("closed") is True,
        class_weights=facts.get("class_weights") is True,
    )


DESTINATION_KEY = b"tokaudit.destination"
"""A spooled shard's footer: the folder or URL it was to be written to (`tokaudit sync` writes it there)."""


def spool_folder() -> Path:
    """Where a recorder keeps what it could not write by close(): TOKAUDIT_SPOOL, else the user's cache."""
    chosen = os.environ.get("TOKAUDIT_SPOOL")
    if chosen:
        return Path(chosen)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tokaudit" / "spool"


def read_dropped(metadata: dict[bytes, bytes] | None) -> dict[str, Any] | None:
    """The dropped-steps note of a shard's footer, if any. A note that is not one the recorder writes raises
    ValueError: it says records were lost, and where they were cannot be read, so no audit of its run is sound."""
    if not metadata or DROPPED_KEY not in metadata:
        return None
    problem = f"its footer's {DROPPED_KEY.decode()} (records the recorder could not write) cannot be read"
    try:
        note = json.loads(metadata[DROPPED_KEY])
        steps = [(a, b, c) for a, b, c in note["steps"]]
        numbers = [note["rank"], *(n for span in steps for n in span)]
        names = (note["run"], note["group"])
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ValueError(problem) from None
    if not _int64(note["rank"]):
        raise ValueError(f"{problem}: its rank is not a whole number ({note['rank']!r})"[:300])
    # spans the recorder writes: at least one, first ≤ last, some records lost
    if not steps or not all(_int64(n) for n in numbers) or not all(0 <= b - a < 2**62 and c > 0 for a, b, c in steps):
        raise ValueError(f"{problem}: no list of step spans [first, last, records lost] ({note['steps']!r})"[:300])
    if not all(isinstance(name, str) for name in names):
        raise ValueError(f"{problem}: its run or group is not a string")
    return {"run": names[0], "group": names[1], "rank": note["rank"], "steps": steps}


def _int64(value: Any) -> bool:
    """A whole number as a footer's JSON holds one, in the range of the step and rank columns (not a bool, not 1e400)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
