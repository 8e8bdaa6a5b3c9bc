"""benchmarks/scale/data_scale.py: its text generator and its process-tree memory sampler."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from benchmarks.scale.data_scale import TreePeak, add_text_source, generate
from pipelines.core.data.readers import read_source
from pipelines.core.params.data import SourceParams

SIZE = 3_000_000


def _documents(data: bytes) -> list[bytes]:
    return [doc for doc in data.split(b"\n\n") if doc.strip()]


def test_generator_is_deterministic_exact_size_with_duplicates(tmp_path):
    first, again, other = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "c.txt"
    stats = generate(first, SIZE, seed=3)
    generate(again, SIZE, seed=3)
    generate(other, SIZE, seed=4)
    data = first.read_bytes()
    assert len(data) == SIZE and stats.bytes == SIZE
    assert data == again.read_bytes()
    assert data != other.read_bytes()
    data.decode("utf-8")  # the shortened last document is not cut inside a character

    docs = _documents(data)
    assert len(docs) == stats.documents > 1000
    assert all(b"\n" not in doc for doc in docs[:-1])  # one line per document, a blank line between
    assert b"\n\n\n" not in data[:-3]
    exact = len(docs) - len(set(docs))
    assert exact == stats.exact_duplicates
    assert 0.005 < exact / len(docs) < 0.02
    assert 0.005 < stats.near_duplicates / len(docs) < 0.02
    lasts = {doc.rsplit(b" ", 1)[0] for doc in docs}  # a near duplicate differs in its last word only
    assert len(docs) - len(lasts) >= exact + stats.near_duplicates * 0.9

    # the text reader sees the same documents
    frame = read_source(SourceParams(path=str(first), kind="text"), tmp_path)
    assert len(frame) == len(docs)
    assert frame["text"].iloc[0].encode() == docs[0]


def test_sizes_at_the_edges(tmp_path):
    for size in (0, 1, 2, 17, 5000):
        path = tmp_path / f"{size}.txt"
        generate(path, size, seed=0)
        assert path.stat().st_size == size


def test_tree_peak_sees_a_grandchild_allocating(tmp_path):
    # the child starts a grandchild that holds 200 MB of written (resident) memory for a moment
    grandchild = "import time; block = b'x' * 200_000_000; time.sleep(0.6)"
    child = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.run([sys.executable, "-c", {grandchild!r}], check=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child])
    with TreePeak(proc.pid, interval=0.05) as peak:
        assert proc.wait() == 0
    assert peak.samples > 5
    assert peak.peak_mb >= 150 * 1e6 / 2**20


def test_add_text_source_keeps_comments(tmp_path):
    import yaml

    params = tmp_path / "params.yaml"
    params.write_text(textwrap.dedent("""\
        sample_data:                 # a comment
          enabled: true
        ingest:                      # one entry per data set
          sources:
            - {path: data/sample/pretrain.txt, kind: text}
            - {path: data/sample/chat_train.jsonl, kind: chat}

        prepare_data:
          dedup: true
    """))
    add_text_source(params, "data/sources/bench.txt")
    text = params.read_text()
    assert "# one entry per data set" in text
    loaded = yaml.safe_load(text)
    assert loaded["ingest"]["sources"][-1] == {"path": "data/sources/bench.txt", "kind": "text"}
    assert len(loaded["ingest"]["sources"]) == 3 and loaded["prepare_data"] == {"dedup": True}
