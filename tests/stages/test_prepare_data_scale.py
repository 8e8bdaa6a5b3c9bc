"""prepare_data at scale: batches, the dedup shuffle, worker processes and a Dask cluster all
give what the in-memory definition of each step gives, in the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipelines import prepare_data
from pipelines.core.data import cleaning
from tests.stages.test_prepare_data import FIFTY, params, write_ingested

SPLITS = prepare_data.SPLITS


def corpus(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Texts and chats with exact duplicates (some differing only in spacing), near duplicates
    (one word changed at the end), too-short and empty records, far apart in the order."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(400)]
    texts = [" ".join(rng.choice(words, size=rng.integers(8, 60))) for _ in range(240)]
    for i in rng.choice(len(texts), size=25, replace=False):
        texts.append(texts[i].replace(" ", "  ", 1))  # the same after normalisation
    for i in rng.choice(240, size=25, replace=False):
        texts.append(f"{FIFTY} {texts[i]}" if rng.random() < 0.5 else texts[i])
        texts.append(f"{FIFTY} {texts[i]} changed")  # near: one word added at the end of 50+
    texts += ["x", "", "  \t "]
    order = rng.permutation(len(texts))
    text_rows = [{"text": texts[i], "split": "test" if i % 41 == 0 else "auto"} for i in order]
    chats = [[{"role": "user", "content": f"q{i % 90}"}, {"role": "assistant", "content": f"a{i % 90}"}] for i in range(130)]
    return text_rows, [{"messages": chat} for chat in chats]


def reference(frame: pd.DataFrame, kind: str, p) -> tuple[pd.DataFrame, dict[str, int]]:
    """Today's definition, in memory: per-record filters, exact dedup over the kept records,
    near dedup over those still kept, split by content hash."""
    rules = prepare_data.KINDS[kind]
    frame = rules.normalize(frame, p.normalize)
    codes = prepare_data.record_reasons(frame, rules, p)
    reasons = np.array([prepare_data.REASONS[c - 1] if c else "" for c in codes], dtype=object)
    keys = rules.key(frame)
    kept = np.flatnonzero(reasons == "")
    reasons[kept[cleaning.exact_duplicates([keys[i] for i in kept])]] = "duplicate"
    if rules.near_dedup_text is not None:
        kept = np.flatnonzero(reasons == "")
        texts = rules.near_dedup_text(frame)
        reasons[kept[cleaning.near_duplicates([texts[i] for i in kept], p.near_dedup_threshold)]] = "near_duplicate"
    out = frame[reasons == ""].reset_index(drop=True)
    splits = out["split"].to_numpy(dtype=object).copy()
    auto = np.flatnonzero(splits == "auto")
    splits[auto] = cleaning.assign_split([rules.key(out)[i] for i in auto], p.validation_fraction, p.seed)
    return out.assign(split=splits), {r: int((reasons == r).sum()) for r in prepare_data.REASONS}


@pytest.fixture
def small_batches(monkeypatch):
    """Batches, buckets and row groups far smaller than the data, so every path is taken."""
    monkeypatch.setattr(prepare_data, "BATCH_ROWS", 16)
    monkeypatch.setattr(prepare_data, "BUCKETS", 4)
    monkeypatch.setattr(prepare_data, "ROW_GROUP_ROWS", 50)


def run(tmp_path: Path, monkeypatch, name: str, workers: int, engine: str = "local") -> tuple[Path, dict]:
    text, chat = corpus()
    in_dir = write_ingested(tmp_path / "in", text=text, chat=chat)
    monkeypatch.setenv("QLLM_DATA_WORKERS", str(workers))
    monkeypatch.setenv("QLLM_DATA_ENGINE", engine)
    out = tmp_path / name
    return out, prepare_data.run(in_dir, out, params(min_chars=2, validation_fraction=0.2))


def test_batches_and_the_shuffle_match_the_in_memory_definition(tmp_path, monkeypatch, small_batches):
    out, metrics = run(tmp_path, monkeypatch, "out", workers=1)
    for kind in ("text", "chat"):
        frame = pd.read_parquet(tmp_path / f"in/data/ingested/{kind}.parquet").astype("str")
        expected, dropped = reference(frame, kind, params(min_chars=2, validation_fraction=0.2))
        assert metrics[kind]["dropped"] == dropped
        for split in SPLITS:
            got = pd.read_parquet(out / kind / f"{split}.parquet")
            want = expected[expected["split"] == split].reset_index(drop=True)
            pd.testing.assert_frame_equal(got.astype(str), want.astype(str))
    assert metrics["text"]["dropped"]["duplicate"] >= 25 and metrics["text"]["dropped"]["near_duplicate"] >= 10
    assert metrics["text"]["dropped"]["empty"] == 2 and metrics["text"]["dropped"]["too_short"] == 1
    assert metrics["chat"]["dropped"]["duplicate"] == 40
    train = pq.ParquetFile(out / "text/train.parquet")
    assert train.metadata.num_row_groups == -(-train.metadata.num_rows // 50) > 2  # fixed-size row groups
    assert not (out / ".spool").exists()


def test_one_two_workers_and_a_dask_cluster_write_the_same_bytes(tmp_path, monkeypatch, small_batches):
    outputs = [run(tmp_path, monkeypatch, f"out-{workers}-{engine}", workers, engine)
               for workers, engine in ((1, "local"), (2, "local"), (2, "dask"))]  # fmt: skip
    (first, metrics), *others = outputs
    files = sorted(p.relative_to(first).as_posix() for p in first.rglob("*") if p.is_file())
    assert len(files) == 15  # five kinds, three splits
    for out, other_metrics in others:
        assert other_metrics == metrics
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == files
        for name in files:
            assert (out / name).read_bytes() == (first / name).read_bytes(), name
    assert json.dumps(metrics, sort_keys=True) == json.dumps(outputs[1][1], sort_keys=True)


def test_a_dask_scheduler_given_by_address_writes_the_same_bytes(tmp_path, monkeypatch, small_batches):
    """As on a real cluster: a scheduler with its own worker processes, reached at its address."""
    from distributed import LocalCluster

    first, metrics = run(tmp_path, monkeypatch, "local", workers=1)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None) as cluster:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        monkeypatch.setenv("QLLM_DASK_ADDRESS", cluster.scheduler_address)
        out, dask_metrics = run(tmp_path, monkeypatch, "dask", workers=1, engine="dask")
    assert dask_metrics == metrics
    for path in sorted(first.rglob("*.parquet")):
        assert (out / path.relative_to(first)).read_bytes() == path.read_bytes()


def test_bad_settings_are_clear_errors(tmp_path, monkeypatch):
    in_dir = write_ingested(tmp_path, text=[{"text": "some text"}])
    for name, value, message in (("QLLM_DATA_WORKERS", "two", r"\$QLLM_DATA_WORKERS='two': expected a whole number"),
                                 ("QLLM_DATA_ENGINE", "spark", r"\$QLLM_DATA_ENGINE='spark': expected one of local, dask")):  # fmt: skip
        monkeypatch.setenv(name, value)
        with pytest.raises(prepare_data.QllmError, match=message):
            prepare_data.run(in_dir, tmp_path / "out", params())
        monkeypatch.delenv(name)
        assert not (tmp_path / "out").exists()
