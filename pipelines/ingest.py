"""Read every data source of `ingest.sources` into one Parquet file per record kind.

    python -m pipelines.ingest      # what dvc.yaml runs

Writes `data/ingested/text.parquet`, `chat.parquet`, `preference.parquet`, `image_chat.parquet`
and `feedback.parquet` (always all five; a kind without sources is an empty file with the kind's
columns), in source order. The record kinds and accepted input layouts are described in
`pipelines/core/data/readers.py`; an image chat's images are read (and checked to decode) here, and
stored in the file as their bytes, so later stages need neither the image files nor their paths.

Sources stream through in bounded memory (`readers.iter_source`): records are written as they
are read, in row groups of at most `readers.BATCH_ROWS` records (fewer when their text reaches
`readers.BATCH_BYTES` characters; a source's last row group holds the rest), so a later stage can
read them batch by batch (`pq.ParquetFile(path).iter_batches()`). Every column is a Parquet
string but `images` (a list of binary values, `readers.IMAGES_TYPE`); the row groups depend only
on the input, and the same input gives the same bytes. A
failure leaves the previous output as it was (`atomic_dir`).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipelines.core.data.readers import COLUMNS, MEMORY_POOL, SCHEMAS, iter_source, source_name
from pipelines.core.outputs import atomic_dir
from pipelines.core.params.data import IngestParams, SourceParams
from pipelines.core.run import stage

NAME = "ingest"
IMPORTS_TRANSFORMERS = False  # the runner does not import torch, transformers and PEFT for it (repro.run_in_process)


def untracked_sources(sources: list[SourceParams], root: Path, tracked_dirs: list[Path]) -> list[SourceParams]:
    """The sources whose path lies outside every one of `tracked_dirs`, the stage's data deps in
    dvc.yaml (`data/sources/`, `data/sample/`): DVC does not see a change anywhere else. Hub names
    are outside too."""
    tracked = [Path(folder).resolve() for folder in tracked_dirs]
    out = []
    for source in sources:
        path = Path(source.path)
        resolved = (path if path.is_absolute() else Path(root) / path).resolve()
        if not any(resolved.is_relative_to(folder) for folder in tracked):
            out.append(source)
    return out


def run(root: Path, out_dir: Path, params: IngestParams, *, progress: bool = True) -> dict[str, Any]:
    """Stream every source into one Parquet file per kind.

    Args:
        root: project root; relative source paths are resolved against it.
        out_dir: directory to (atomically) replace with `text.parquet`, `chat.parquet`,
            `preference.parquet`, `image_chat.parquet`, `feedback.parquet`.
        params: the `ingest` params section.
        progress: a progress bar per source (shown only on a terminal).

    Returns:
        Metrics: `{"records": {kind: n}, "sources": {name: {"kind": kind, "records": n}}}`.
    """
    records = dict.fromkeys(COLUMNS, 0)
    per_source = {}
    with atomic_dir(out_dir) as tmp, ExitStack() as files:
        # (closed before atomic_dir moves the directory into place, or removes it on an error)
        writers = {
            kind: files.enter_context(pq.ParquetWriter(tmp / f"{kind}.parquet", SCHEMAS[kind], memory_pool=MEMORY_POOL()))
            for kind in COLUMNS
        }
        for source in params.sources:
            count = 0
            for batch in iter_source(source, root, progress=progress):
                writers[source.kind].write_batch(batch)  # one row group
                count += batch.num_rows
            records[source.kind] += count
            per_source[source_name(source)] = {"kind": source.kind, "records": count}
    return {"records": records, "sources": per_source}


def body(ctx: stage.StageContext) -> dict[str, Any]:
    for source in untracked_sources(ctx.params.sources, ctx.root, ctx.inputs()):
        ctx.log.warning(
            "source %s: %s is not a dependency in dvc.yaml: DVC will not notice when it changes; "
            "move it under data/sources/",
            source_name(source),
            source.path,
        )
    metrics = run(ctx.root, ctx.output(), ctx.params)
    for source in ctx.params.sources:
        info = metrics["sources"][source_name(source)]
        ctx.log.info(
            "source %s: %d %s records from %s", source_name(source), info["records"], info["kind"], source.path
        )
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
