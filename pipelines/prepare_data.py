"""Normalise, filter, deduplicate and split the ingested records of every kind.

    python -m pipelines.prepare_data      # what dvc.yaml runs

Reads `data/ingested/{text,chat,preference}.parquet` and writes
`data/prepared/<kind>/<split>.parquet` for every kind and split (train, validation, test: always
all nine files, empty ones with the kind's columns). Per kind, in order:

1. normalise every string (`cleaning.normalize_text`): the text; each message content; the
   prompt's contents, chosen and rejected. An empty system message is removed (it says nothing).
2. drop records, each counted under the first reason that applies: `empty` (an empty text,
   message content, chosen or rejected), `too_short` / `too_long` (characters outside
   `[min_chars, max_chars]`: the text; the sum of the contents; prompt contents + chosen +
   rejected), `chosen_equals_rejected`, `duplicate` (same content as an earlier record, when
   `dedup`; id, source and split ignored) and `near_duplicate` (text only, when `near_dedup`).
3. send `split: auto` records to train or validation by a hash of their content
   (`cleaning.assign_split`); explicit splits are kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipelines.core import cleaning, stage
from pipelines.core.config import PrepareDataParams
from pipelines.core.errors import QllmError
from pipelines.core.outputs import atomic_dir

NAME = "prepare_data"
SPLITS = ("train", "validation", "test")
REASONS = ("empty", "too_short", "too_long", "chosen_equals_rejected", "duplicate", "near_duplicate")
# What each drop reason means, for the warning a non-zero count logs.
REASON_HELP = {
    "empty": "an empty text, message, chosen or rejected",
    "too_short": "fewer characters than prepare_data.min_chars",
    "too_long": "more characters than prepare_data.max_chars",
    "chosen_equals_rejected": "chosen and rejected are the same answer",
    "duplicate": "the same content as an earlier record",
    "near_duplicate": "MinHash similarity >= prepare_data.near_dedup_threshold to an earlier text",
}


class PrepareDataError(QllmError, ValueError):
    """The ingested data is missing or not what `ingest` writes."""


# --------------------------------------------------------------------------- per-kind rules


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _normalize_messages(raw: str, form: str) -> str:
    messages = [{**m, "content": cleaning.normalize_text(m["content"], form)} for m in json.loads(raw)]
    return _dumps([m for m in messages if m["role"] != "system" or m["content"]])


def _contents(raw: str) -> list[str]:
    return [m["content"] for m in json.loads(raw)]


def _normalize_text_kind(frame: pd.DataFrame, form: str) -> pd.DataFrame:
    return frame.assign(text=[cleaning.normalize_text(t, form) for t in frame["text"]])


def _normalize_chat(frame: pd.DataFrame, form: str) -> pd.DataFrame:
    return frame.assign(messages=[_normalize_messages(m, form) for m in frame["messages"]])


def _normalize_preference(frame: pd.DataFrame, form: str) -> pd.DataFrame:
    return frame.assign(
        prompt=[_normalize_messages(p, form) for p in frame["prompt"]],
        chosen=[cleaning.normalize_text(c, form) for c in frame["chosen"]],
        rejected=[cleaning.normalize_text(r, form) for r in frame["rejected"]],
    )


@dataclass(frozen=True)
class KindRules:
    """How one record kind is normalised and what its content is."""

    columns: tuple[str, ...]
    """The kind's columns, as `ingest` writes them (`readers.COLUMNS`, repeated here so that this
    stage depends on cleaning.py only, as dvc.yaml says)."""
    normalize: Callable[[pd.DataFrame, str], pd.DataFrame]
    parts: Callable[[pd.DataFrame], list[list[str]]]
    """Every string of each record: emptiness and length are judged over these."""
    key: Callable[[pd.DataFrame], list[str]]
    """The record's content (id, source and split left out): dedup and split key."""
    same_answers: Callable[[pd.DataFrame], np.ndarray] | None = None
    near_dedup_text: Callable[[pd.DataFrame], list[str]] | None = None


KINDS: dict[str, KindRules] = {
    "text": KindRules(
        columns=("id", "source", "split", "text"),
        normalize=_normalize_text_kind,
        parts=lambda f: [[t] for t in f["text"]],
        key=lambda f: list(f["text"]),
        near_dedup_text=lambda f: list(f["text"]),
    ),
    "chat": KindRules(
        columns=("id", "source", "split", "messages"),
        normalize=_normalize_chat,
        parts=lambda f: [_contents(m) for m in f["messages"]],
        key=lambda f: list(f["messages"]),
    ),
    "preference": KindRules(
        columns=("id", "source", "split", "prompt", "chosen", "rejected"),
        normalize=_normalize_preference,
        parts=lambda f: [
            [*_contents(p), c, r] for p, c, r in zip(f["prompt"], f["chosen"], f["rejected"], strict=True)
        ],
        key=lambda f: [_dumps([p, c, r]) for p, c, r in zip(f["prompt"], f["chosen"], f["rejected"], strict=True)],
        same_answers=lambda f: (f["chosen"] == f["rejected"]).to_numpy(dtype=bool),
    ),
}


# ------------------------------------------------------------------------------- the steps


def read_ingested(path: Path, kind: str) -> pd.DataFrame:
    """Read one `data/ingested/<kind>.parquet`, checking its columns and split values."""
    if not path.exists():
        raise PrepareDataError(f"{path}: not found; run the ingest stage first")
    frame = pd.read_parquet(path)
    columns = KINDS[kind].columns
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise PrepareDataError(f"{path}: missing columns {', '.join(missing)} (was it written by ingest?)")
    unknown = sorted(set(frame["split"]) - {"auto", *SPLITS})
    if unknown:
        raise PrepareDataError(f"{path}: unknown split values {', '.join(map(repr, unknown))}")
    return frame[list(columns)].astype("str").reset_index(drop=True)


def drop_reasons(frame: pd.DataFrame, rules: KindRules, params: PrepareDataParams) -> np.ndarray:
    """The drop reason of every (normalised) record, "" for those kept; first reason wins."""
    reasons = np.full(len(frame), "", dtype=object)

    def mark(flags: np.ndarray, reason: str, among: np.ndarray | None = None) -> None:
        # `among`: indices the flags refer to (the records still kept when they were computed).
        target = np.flatnonzero(flags) if among is None else among[flags]
        target = target[reasons[target] == ""]
        reasons[target] = reason

    parts = rules.parts(frame)
    lengths = np.array([sum(map(len, p)) for p in parts], dtype=np.int64)
    mark(np.array([any(s == "" for s in p) for p in parts], dtype=bool), "empty")
    mark(lengths < params.min_chars, "too_short")
    mark(lengths > params.max_chars, "too_long")
    if rules.same_answers is not None:
        mark(rules.same_answers(frame), "chosen_equals_rejected")
    keys = rules.key(frame)
    if params.dedup:
        kept = np.flatnonzero(reasons == "")
        mark(cleaning.exact_duplicates([keys[i] for i in kept]), "duplicate", kept)
    if params.near_dedup and rules.near_dedup_text is not None:
        kept = np.flatnonzero(reasons == "")
        texts = rules.near_dedup_text(frame)
        mark(cleaning.near_duplicates([texts[i] for i in kept], params.near_dedup_threshold), "near_duplicate", kept)
    return reasons


def prepare(frame: pd.DataFrame, kind: str, params: PrepareDataParams) -> tuple[pd.DataFrame, dict[str, int]]:
    """Normalise, filter and split one kind's records.

    Returns:
        The kept records (with `split` resolved to train/validation/test) and the drop counts
        of every reason in `REASONS`.
    """
    rules = KINDS[kind]
    frame = rules.normalize(frame, params.normalize)
    reasons = drop_reasons(frame, rules, params)
    dropped = {reason: int((reasons == reason).sum()) for reason in REASONS}
    kept = frame[reasons == ""].reset_index(drop=True)
    auto = np.flatnonzero(kept["split"].to_numpy() == "auto")
    keys = rules.key(kept)
    splits = kept["split"].to_numpy(dtype=object).copy()
    splits[auto] = cleaning.assign_split([keys[i] for i in auto], params.validation_fraction, params.seed)
    return kept.assign(split=pd.Series(splits, dtype="str")), dropped


def run(in_dir: Path, out_dir: Path, params: PrepareDataParams) -> dict[str, Any]:
    """Prepare every kind and write `<out_dir>/<kind>/<split>.parquet` (all nine files).

    Args:
        in_dir: `data/ingested` (one `<kind>.parquet` per kind).
        out_dir: directory to (atomically) replace.
        params: the `prepare_data` params section.

    Returns:
        Metrics: `{kind: {"in": n, "dropped": {reason: n}, "out": {split: n}}}`.
    """
    metrics: dict[str, Any] = {}
    prepared = {}
    for kind in KINDS:
        frame = read_ingested(Path(in_dir) / f"{kind}.parquet", kind)
        prepared[kind], dropped = prepare(frame, kind, params)
        counts = prepared[kind]["split"].value_counts()
        metrics[kind] = {"in": len(frame), "dropped": dropped, "out": {s: int(counts.get(s, 0)) for s in SPLITS}}
    with atomic_dir(out_dir) as tmp:
        for kind, frame in prepared.items():
            (tmp / kind).mkdir()
            for split in SPLITS:
                frame[frame["split"] == split].to_parquet(tmp / kind / f"{split}.parquet", index=False)
    return metrics


def body(ctx: stage.StageContext) -> dict[str, Any]:
    metrics = run(ctx.input("ingested"), ctx.output(), ctx.params)
    for kind, counts in metrics.items():
        out = counts["out"]
        ctx.log.info(
            "%s: %d in, %d out (train %d, validation %d, test %d), %d dropped",
            kind,
            counts["in"],
            sum(out.values()),
            out["train"],
            out["validation"],
            out["test"],
            sum(counts["dropped"].values()),
        )
        for reason, n in counts["dropped"].items():
            if n:
                ctx.log.warning("%s: dropped %d records as %s (%s)", kind, n, reason, REASON_HELP[reason])
    return metrics


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
