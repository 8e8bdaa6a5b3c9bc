"""Read every data source of `ingest.sources` into one Parquet file per record kind.

    python -m pipelines.ingest      # what dvc.yaml runs

Writes `data/ingested/text.parquet`, `chat.parquet` and `preference.parquet` (always all three;
a kind without sources is an empty file with the kind's columns), in source order. The record
kinds and accepted input layouts are described in `pipelines/core/readers.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from pipelines.core import stage
from pipelines.core.config import IngestParams, SourceParams
from pipelines.core.outputs import atomic_dir
from pipelines.core.readers import COLUMNS, empty_frame, read_source, source_name

NAME = "ingest"


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


def run(root: Path, out_dir: Path, params: IngestParams) -> dict[str, Any]:
    """Read every source and write one Parquet file per kind.

    Args:
        root: project root; relative source paths are resolved against it.
        out_dir: directory to (atomically) replace with `text.parquet`, `chat.parquet`,
            `preference.parquet`.
        params: the `ingest` params section.

    Returns:
        Metrics: `{"records": {kind: n}, "sources": {name: {"kind": kind, "records": n}}}`.
    """
    frames: dict[str, list[pd.DataFrame]] = {kind: [] for kind in COLUMNS}
    per_source = {}
    for source in params.sources:
        frame = read_source(source, root)
        frames[source.kind].append(frame)
        per_source[source_name(source)] = {"kind": source.kind, "records": len(frame)}
    with atomic_dir(out_dir) as tmp:
        for kind, parts in frames.items():
            merged = pd.concat(parts, ignore_index=True) if parts else empty_frame(kind)
            merged.to_parquet(tmp / f"{kind}.parquet", index=False)
    return {
        "records": {kind: sum(len(part) for part in parts) for kind, parts in frames.items()},
        "sources": per_source,
    }


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
