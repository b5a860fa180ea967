"""What a Hive-partitioned path says (Spark's `partitionBy`, pyarrow's `partitioning="hive"`): a `column=value` folder
holds that column's value for every record of the files under it, which leave the column out."""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Any
from urllib.parse import unquote

from tokaudit.errors import LogFormatError
from tokaudit._schema import COLUMNS, COLUMNS_BY_NAME


PARTITION_COLUMNS = frozenset(column.name for column in COLUMNS if column.kind != "timestamp")
"""The columns a folder may give: any of the log's but the time (what names a record, a rank or a step, as Spark's
partitionBy("rank") leaves it, and a measured value too, as pandas' partition_cols=["grad_divisor"] does)."""

_KINDS = {"int": "an int64", "float": "a float64", "bool": "a bool"}

_FOLDER = re.compile(r"^([^=/]+)=(.*)$")

NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
"""What Spark and pyarrow name the folder of records whose value is null."""


def partition_folders(path: PurePath) -> tuple[tuple[str, str], ...]:
    """The `column=value` folders just above a file, outermost first, as (column, value unquoted): the chain of such
    folders its writer made, whatever the column (`date=…` as well), up to the first folder of another name."""
    found: list[tuple[str, str]] = []
    if "=" not in str(path):
        return ()
    for folder in reversed(path.parent.parts):
        matched = _FOLDER.match(folder)
        if matched is None or folder.endswith(".parquet"):
            break
        found.append((unquote(matched.group(1)), unquote(matched.group(2))))
    return tuple(reversed(found))


def run_folder(path: PurePath) -> PurePath:
    """The folder a file's run is named by (`Shard.default_run`): its parent, above the `column=value` folders of the
    log's columns (a `rank=0/` folder is a part of its run, whether its files leave the rank out or hold it too; a
    sweep's `lr=0.001/` folder is the run's), and the folder around a Spark-style dataset folder named *.parquet."""
    folder = path.parent
    for column, _ in reversed(partition_folders(path)):
        if column not in PARTITION_COLUMNS:
            break
        folder = folder.parent
    return folder.parent if folder.name.endswith(".parquet") else folder


def partition_values(folders: tuple[tuple[str, str], ...], present: frozenset[str]) -> dict[str, Any]:
    """The values a file's folders (`partition_folders`) give columns of PARTITION_COLUMNS the file lacks, each of its
    column's kind (null where the folder is NULL_PARTITION; the innermost folder where two name one column). A value
    that is not of the column's kind, or a null where the column is required, raises its problem, naming the folder."""
    values: dict[str, Any] = {}
    for column, text in folders:
        if column not in PARTITION_COLUMNS or column in present:
            continue
        if text == NULL_PARTITION:
            if COLUMNS_BY_NAME[column].required:
                raise LogFormatError("", f"the folder '{column}={text}' gives '{column}' a null, and it may hold none")
            values[column] = None
        elif (kind := COLUMNS_BY_NAME[column].kind) == "string":
            values[column] = text
        elif (value := _parsed(kind, text.strip())) is not None:
            values[column] = value
        else:
            raise LogFormatError(
                "", f"the folder '{column}={text}' gives '{column}' a value that is not {_KINDS[kind]}"
            )
    return values


def _parsed(kind: str, text: str) -> int | float | bool | None:
    """A folder's text as a value of its column's kind, None where it is none (the values are then checked as a
    file's own: a NaN divisor, a negative count)."""
    if kind == "bool":  # Spark writes true/false, pandas True/False
        return {"true": True, "false": False}.get(text.lower())
    if kind == "int":
        value = int(text) if re.fullmatch(r"[+-]?\d{1,19}", text) else None
        return value if value is not None and -(2**63) <= value < 2**63 else None
    try:
        return float(text)
    except ValueError:
        return None
