"""A real-language sample that needs no network: `sample_data.corpus: real_text` (params/real_text.yaml).

- Pretraining text: the Python documentation that ships with CPython (`pydoc_data.topics`, about
  65k words in 79 topics), cut at blank lines into documents of at most `DOC_CHARS` characters.
- Chats: the English part of the ChatterBot corpus (`chatterbot-corpus` on PyPI, BSD licence;
  about 2,000 short human-written conversations on 21 subjects, many repeated). Each conversation
  alternates user and assistant from its first line; a trailing unanswered line is dropped. A
  conversation is held out for evaluation when a hash of its text falls in the first
  `HELDOUT_PERCENT` of the range, so repeats land on the same side and the split does not depend
  on file order (about 90 chats).
- Preferences: every user/assistant exchange of a training conversation, with the answer another
  conversation of another subject gave as the rejected one (a fluent answer to the wrong question).

The files are the ones `sample_world` writes (`pretrain.txt`, `chat_{train,heldout}.jsonl`,
`preference_{train,heldout}.jsonl`) plus `corpus.json` naming the sources and their versions, so
`ingest` reads them unchanged. The same interpreter and package versions give the same bytes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import random
from pathlib import Path
from typing import Any

import yaml

from pipelines.core.errors import QllmError

DOC_CHARS = 2000
HELDOUT_PERCENT = 10
COUNT_KEYS = ("pretrain_documents", "pretrain_chars", "chat_train", "chat_heldout", "preference_train", "preference_heldout")


def documentation() -> list[str]:
    """The CPython documentation topics as documents of at most `DOC_CHARS` characters."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        current = ""
        for paragraph in (p.strip() for p in topics[name].split("\n\n")):
            if not paragraph:
                continue
            if current and len(current) + len(paragraph) + 2 > DOC_CHARS:
                documents.append(current)
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph[:DOC_CHARS]
        if current:
            documents.append(current)
    return documents


def conversations() -> list[tuple[str, list[str]]]:
    """(subject, lines) of every English ChatterBot conversation, in file order."""
    try:
        from importlib.resources import files

        folder = files("chatterbot_corpus") / "data" / "english"
    except ModuleNotFoundError:
        raise QllmError("sample_data.corpus=real_text needs the chatterbot-corpus package (pip install chatterbot-corpus)") from None
    found = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yml"):
            continue
        data = yaml.safe_load(entry.read_text(encoding="utf-8")) or {}
        for lines in data.get("conversations") or []:
            lines = [str(line).strip() for line in lines if str(line).strip()]
            if len(lines) >= 2:
                found.append((entry.name.removesuffix(".yml"), lines))
    return found


def _chat(lines: list[str]) -> list[dict[str, str]]:
    turns = lines[: len(lines) // 2 * 2]  # end on an answer
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": line} for i, line in enumerate(turns)]


def _held_out(lines: list[str]) -> bool:
    digest = hashlib.sha256("\n".join(lines).encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def _preferences(rng: random.Random, chats: list[tuple[str, list[dict[str, str]]]], split: str) -> list[dict[str, Any]]:
    answers = [(subject, m["content"]) for subject, messages in chats for m in messages if m["role"] == "assistant"]
    pairs = []
    for subject, messages in chats:
        for i in range(0, len(messages), 2):
            question, answer = messages[i]["content"], messages[i + 1]["content"]
            others = [a for s, a in answers if s != subject and a != answer]
            pairs.append({"id": f"{split}-pref-{len(pairs)}", "prompt": question, "chosen": answer, "rejected": rng.choice(others)})
    return pairs


def write_sample(out: Path, seed: int) -> dict[str, int]:
    """Write the real-text sample files into `out`; returns their counts."""
    documents = documentation()
    rng = random.Random(f"qllm-real-text:{seed}")
    rng.shuffle(documents)
    chats = {"train": [], "heldout": []}
    for subject, lines in conversations():
        chats["heldout" if _held_out(lines) else "train"].append((subject, _chat(lines)))
    (out / "pretrain.txt").write_text("\n\n".join(d.replace("\n\n", "\n") for d in documents) + "\n", encoding="utf-8", newline="\n")
    counts = {"pretrain_documents": len(documents), "pretrain_chars": sum(map(len, documents))}
    for split, items in chats.items():
        records = [{"id": f"{split}-{subject}-{i}", "messages": messages} for i, (subject, messages) in enumerate(items)]
        prefs = _preferences(rng, items, split)
        for name, rows in ((f"chat_{split}", records), (f"preference_{split}", prefs)):
            with open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as handle:
                handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            counts[name] = len(rows)
    corpus = {
        "pretrain": f"pydoc_data.topics of Python {platform.python_version()}",
        "chats": f"chatterbot-corpus {importlib.metadata.version('chatterbot-corpus')} (english)",
        "heldout_percent": HELDOUT_PERCENT,
    }
    (out / "corpus.json").write_text(json.dumps(corpus, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return counts
