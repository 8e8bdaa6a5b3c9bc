"""Bad input sweep: every bad input a user can hand the pipeline, and the one line they see for it.

Each `Case` is one row of docs/troubleshooting.md (`test_doc_lists_every_case` keeps the two in step).
A case writes a user-level input into a throwaway project (a data source, a params.yaml, a
`--set`, a model directory), runs the entry point the user would (`qllm run ...`,
`qllm generate ...`, or a stage's `python -m pipelines.<stage>`, which `qllm run` and `dvc repro`
call), and checks:

- the exit code and the first `error:` line on stderr, which names the file and line or the
  params key and says what was expected (`…` in `message` stands for any text);
- no traceback;
- nothing half-written: the project holds exactly the files it held before (a training stage's
  resume state under .qllm/checkpoints/ aside; the stages' MLflow runs, recorded as FAILED, go to
  a file store outside the project).

Run with: .venv/bin/python -m pytest tests/e2e/test_bad_input_sweep.py
"""

from __future__ import annotations

import gzip
import importlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "troubleshooting.md"
# Left out of the "nothing half-written" check: a training stage's resume state (its checkpoint
# directory's lock and MLflow run id; .qllm/runs/, a run workspace, is still checked).
RESUME_STATE = (".qllm", ".qllm/checkpoints")
STAGE_ENTRIES = ("ingest", "sft", "lora")


# ------------------------------------------------------------------------------------ inputs


def write(project: Path, relative: str, content: str | bytes) -> None:
    path = project / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")


def jsonl(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def chat(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def parquet_bytes(frame: pd.DataFrame, tmp: Path) -> bytes:
    frame.to_parquet(tmp, index=False)
    data = tmp.read_bytes()
    tmp.unlink()
    return data


DOCS = pd.DataFrame({"text": [f"document number {i} about Pelora" for i in range(40)]})


def source(name: str, content: str | bytes | Callable[[Path], bytes], kind: str = "text", extra: str = "") -> Callable:
    """A setup that writes `data/sources/<name>` and a params.yaml reading it."""

    def setup(project: Path, models: dict[str, Path]) -> list[str]:
        data = content(project) if callable(content) else content
        if data is not None:
            write(project, f"data/sources/{name}", data)
        write(project, "params.yaml", f"ingest:\n  sources:\n    - {{path: data/sources/{name}, kind: {kind}{extra}}}\n")
        return []

    return setup


# A short params.yaml of the kind README suggests for own projects (every other key defaults).
BASE = """\
ingest:
  sources:
    - {path: data/sources/docs.txt, kind: text}
pretrain:
  train:
    lr: 0.002
    max_steps: 10
    warmup_steps: 1
quantum_opt:
  solver: sa
lora:
  adapter:
    target_modules: [q_proj, v_proj]
"""


def params_file(text: str | bytes | None, *args: str) -> Callable:
    """A setup that writes params.yaml (None: no params.yaml) and passes `args` to `qllm run`."""

    def setup(project: Path, models: dict[str, Path]) -> list[str]:
        if text is not None:
            write(project, "params.yaml", text)
        return list(args)

    return setup


TINY_TRAIN = (
    "  train: {max_steps: 1, micro_batch_size: 2, warmup_steps: 0, eval_every: 0, eval_batches: 1, "
    "log_every: 1, checkpoint_every: 0, precision: fp32}\n"
)


def finetune(stage: str, base: str, model: str | None = None, extra: str = "") -> Callable:
    """A setup for the `sft`/`lora` stage: prepared chats, `<stage>.base_model: base`, and the
    model directory `models[model]` copied to `models/<model>` in the project."""

    def setup(project: Path, models: dict[str, Path]) -> list[str]:
        if model is not None:
            shutil.copytree(models[model], project / "models" / model)
        for split in ("train", "validation"):
            write(project, f"data/prepared/chat/{split}.parquet", (models["chats"] / f"{split}.parquet").read_bytes())
        base_params = BASE.split("lora:")[0]  # one `lora:` section only: the stage's own
        write(project, "params.yaml", f"{base_params}{stage}:\n  base_model: {base}\n{TINY_TRAIN}{extra}")
        return []

    return setup


def generate(model: str, *, copy: bool = True) -> Callable:
    """A setup for `qllm generate --model models/<model>`."""

    def setup(project: Path, models: dict[str, Path]) -> list[str]:
        if copy:
            shutil.copytree(models[model], project / "models" / model)
        return ["--model", f"models/{model}", "--prompt", "Where does Tovik live?", "--max-new-tokens", "2"]

    return setup


# ------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    id: str
    group: str
    """Doc section: sources, params or models."""
    what: str
    """The bad input, as the doc shows it (markdown)."""
    entry: str
    """`ingest`/`sft`/`lora` (the stage's `python -m pipelines.<stage>`), `qllm run` or `qllm generate`."""
    setup: Callable[[Path, dict[str, Path]], list[str]]
    message: str
    """The first `error:` line ('…': any text; '{project}': the project directory)."""
    exit: int | str


CASES = [
    # --- data sources (ingest) -------------------------------------------------------------
    Case("jsonl-bad-line", "sources", 'JSONL whose line 4 is `{"text": "four" "five"}` (missing comma)', "ingest",
         source("docs.jsonl", jsonl({"text": "one"}, {"text": "two"}, {"text": "three"}) + '{"text": "four" "five"}\n'),
         "error: ingest: data/sources/docs.jsonl:4: invalid JSON (Expecting ',' delimiter at column 17)", 1),
    Case("jsonl-line-not-object", "sources", 'JSONL whose line 2 is a bare string `"just text"`', "ingest",
         source("docs.jsonl", jsonl({"text": "one"}) + '"just text"\n'),
         "error: ingest: data/sources/docs.jsonl:2: expected a JSON object, got str", 1),
    Case("json-truncated", "sources", "JSON array cut off after its second record (no closing `]`)", "ingest",
         source("docs.json", '[\n  {"text": "one"},\n  {"text": "two"},\n'),
         "error: ingest: data/sources/docs.json:4: invalid JSON (Expecting value at column 1)", 1),
    Case("csv-ragged-row", "sources", "CSV `text,lang` whose line 3 has three fields (`bye,en,extra`)", "ingest",
         source("docs.csv", "text,lang\nhello,en\nbye,en,extra\n"),
         "error: ingest: data/sources/docs.csv:3: expected 2 fields like the header, got 3", 1),
    Case("csv-unclosed-quote-first-column", "sources", 'CSV `text,n` whose line 2 opens a quote it never closes (`"hello,1`)', "ingest",
         source("docs.csv", 'text,n\n"hello,1\nbye,2\n'),
         "error: ingest: data/sources/docs.csv:2: invalid CSV (unterminated quote: a quote opened in this row is never closed)", 1),
    Case("csv-unclosed-quote-last-column", "sources",
         'CSV `id,text` whose line 2 opens a quote in the last column it never closes (`1,"hello`), followed by `2,bye` and `3,ciao`',
         "ingest", source("docs.csv", 'id,text\n1,"hello\n2,bye\n3,ciao\n'),
         "error: ingest: data/sources/docs.csv:2: invalid CSV (unterminated quote: a quote opened in this row is never closed)", 1),
    Case("csv-missing-column", "sources", "CSV `question,answer` as `kind: chat`", "ingest",
         source("qa.csv", "question,answer\nWhere does Tovik live?,Pelora\n", kind="chat"),
         "error: ingest: data/sources/qa.csv: missing column 'messages' required for kind 'chat' (found: question, answer; "
         "map yours with columns: {messages: <name>}; kind 'chat' also accepts conversations or prompt + completion or "
         "instruction + output or instruction + response)", 1),
    Case("csv-header-only", "sources", "CSV with a header and no rows", "ingest",
         source("docs.csv", "text,lang\n"),
         "error: ingest: data/sources/docs.csv: no records (empty source)", 1),
    Case("jsonl-empty", "sources", "empty (0-byte) JSONL", "ingest",
         source("docs.jsonl", ""),
         "error: ingest: data/sources/docs.jsonl: no records (empty source)", 1),
    Case("parquet-truncated", "sources", "Parquet file cut to its first half (copy interrupted)", "ingest",
         source("docs.parquet", lambda p: (lambda d: d[: len(d) // 2])(parquet_bytes(DOCS, p / "t.parquet"))),
         "error: ingest: data/sources/docs.parquet: not a readable Parquet file (Could not open Parquet input source '…': "
         "Parquet magic bytes not found in footer. Either the file is corrupted or this is not a parquet file.)", 1),
    Case("parquet-zero-bytes", "sources", "empty (0-byte) `.parquet` file", "ingest",
         source("docs.parquet", b""),
         "error: ingest: data/sources/docs.parquet: not a readable Parquet file (Could not open Parquet input source '…': "
         "Parquet file size is 0 bytes)", 1),
    Case("parquet-zero-rows", "sources", "Parquet file with a `text` column and no rows", "ingest",
         source("docs.parquet", lambda p: parquet_bytes(DOCS.iloc[:0], p / "t.parquet")),
         "error: ingest: data/sources/docs.parquet: no records (empty source)", 1),
    Case("parquet-wrong-type", "sources", "Parquet whose `text` column holds integers", "ingest",
         source("docs.parquet", lambda p: parquet_bytes(pd.DataFrame({"text": [1, 2]}), p / "t.parquet")),
         "error: ingest: data/sources/docs.parquet: record 0: 'text' must be a string, got int", 1),
    Case("jsonl-latin1", "sources", "JSONL whose line 2 is latin-1 encoded (`café` as byte 0xe9)", "ingest",
         source("docs.jsonl", b'{"text": "tea"}\n{"text": "caf\xe9"}\n'),
         "error: ingest: data/sources/docs.jsonl:2: not valid UTF-8 (byte 0xe9 at position 13); re-encode the file as UTF-8", 1),
    Case("text-latin1", "sources", "plain-text source whose line 3 is latin-1 encoded (`Zürich` as byte 0xfc)", "ingest",
         source("notes.txt", b"Tovik lives in Pelora.\n\nMarela lives in Z\xfcrich.\n"),
         "error: ingest: data/sources/notes.txt:3: not valid UTF-8 (byte 0xfc at position 17); re-encode the file as UTF-8", 1),
    Case("jsonl-gzipped", "sources", "gzip-compressed data saved as `docs.jsonl`", "ingest",
         source("docs.jsonl", gzip.compress(jsonl({"text": "one"}).encode(), mtime=0)),
         "error: ingest: data/sources/docs.jsonl:1: not valid UTF-8 (byte 0x8b at position 1); re-encode the file as UTF-8", 1),
    Case("jsonl-missing-field", "sources", 'JSONL `kind: text` whose line 2 is `{"body": ...}`', "ingest",
         source("docs.jsonl", jsonl({"text": "one"}, {"body": "two"})),
         "error: ingest: data/sources/docs.jsonl:2: missing field 'text' required for kind 'text' "
         "(found: body; map yours with columns: {text: <name>})", 1),
    Case("chat-unknown-role", "sources", 'chat JSONL whose line 3 has a turn with `"role": "human"`', "ingest",
         source("chats.jsonl", jsonl(chat("q1", "a1"), chat("q2", "a2"),
                                     {"messages": [{"role": "human", "content": "q3"}, {"role": "assistant", "content": "a3"}]}), kind="chat"),
         "error: ingest: data/sources/chats.jsonl:3: unknown role 'human' (expected system, user, assistant or tool) in messages[0]", 1),
    Case("chat-no-assistant", "sources", "chat JSONL whose line 2 has only a user turn", "ingest",
         source("chats.jsonl", jsonl(chat("q1", "a1"), {"messages": [{"role": "user", "content": "q2"}]}), kind="chat"),
         "error: ingest: data/sources/chats.jsonl:2: no assistant message (a chat needs at least one assistant turn)", 1),
    Case("chat-sharegpt-unknown-speaker", "sources", 'ShareGPT chat JSONL whose line 2 has a turn `"from": "robot"`', "ingest",
         source("chats.jsonl", jsonl({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                                     {"conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]}), kind="chat"),
         "error: ingest: data/sources/chats.jsonl:2: unknown speaker 'from': 'robot' (expected human, gpt, system, function_call or observation) in conversations[1]", 1),
    Case("chat-content-part-type", "sources", 'chat JSONL whose line 2 has a content part `{"type": "reasoning"}` (LLaMA-Factory v1)', "ingest",
         source("chats.jsonl", jsonl(chat("q1", "a1"), {"messages": [{"role": "user", "content": [{"type": "text", "value": "q"}]},
                                                                      {"role": "assistant", "content": [{"type": "reasoning", "value": "hm"}]}]}), kind="chat"),
         "error: ingest: data/sources/chats.jsonl:2: unsupported content part type 'reasoning' in messages[1], content part 0 (expected text)", 1),
    Case("chat-kto-label", "sources", "LLaMA-Factory's KTO layout (`messages` + a boolean `label`) as `kind: chat`", "ingest",
         source("kto.jsonl", jsonl({**chat("q1", "a1"), "label": True}), kind="chat"),
         "error: ingest: data/sources/kto.jsonl:1: 'label': unpaired feedback (a completion labelled desirable or not) is KTO's layout: "
         "give the source `kind: feedback` and train with `dpo.method: kto` (docs/data.md), or leave the label out to train on the chats with sft", 1),
    Case("feedback-label-not-bool", "sources", "TRL's unpaired layout (`kind: feedback`) whose line 2 has `\"label\": \"yes\"`", "ingest",
         source("kto.jsonl", jsonl({"prompt": "q", "completion": "a", "label": True}, {"prompt": "q", "completion": "b", "label": "yes"}), kind="feedback"),
         "error: ingest: data/sources/kto.jsonl:2: 'label' must be a boolean (true: the completion is desirable, false: undesirable), got str", 1),
    Case("chat-tool-result-first", "sources", "OpenAI chat JSONL whose line 1 has a `tool` message that answers no call", "ingest",
         source("tools.jsonl", jsonl({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "a"}]}), kind="chat"),
         "error: ingest: data/sources/tools.jsonl:1: a tool result must follow an assistant message with tool calls (or another tool result) in messages[1]", 1),
    Case("chat-dolly-context-not-text", "sources", 'Dolly chat JSONL whose line 2 has `"context": 3`', "ingest",
         source("dolly.jsonl", jsonl({"instruction": "i", "context": "", "response": "r"}, {"instruction": "i", "context": 3, "response": "r"}), kind="chat"),
         "error: ingest: data/sources/dolly.jsonl:2: 'context' must be a string, got int", 1),
    Case("chat-openai-weight-on-user", "sources", 'OpenAI chat JSONL whose line 2 puts `"weight": 0` on a user message', "ingest",
         source("chats.jsonl", jsonl(chat("q1", "a1"), {"messages": [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}]}), kind="chat"),
         "error: ingest: data/sources/chats.jsonl:2: 'weight' must be 0 or 1 on an assistant message, got 0 on a user message in messages[0]", 1),
    Case("chat-openai-all-weight-zero", "sources", "OpenAI chat JSONL whose line 2 has only assistant turns of weight 0", "ingest",
         source("chats.jsonl", jsonl(chat("q1", "a1"), {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}), kind="chat"),
         "error: ingest: data/sources/chats.jsonl:2: every assistant message has weight 0 (nothing to train on)", 1),
    Case("preference-hh-ends-with-human", "sources", "HH-RLHF preference JSONL whose line 2 has a `chosen` transcript ending with a `Human:` turn", "ingest",
         source("hh.jsonl", jsonl({"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: b"},
                                  {"chosen": "\n\nHuman: q\n\nAssistant: a\n\nHuman: thanks", "rejected": "\n\nHuman: q\n\nAssistant: b"}), kind="preference"),
         "error: ingest: data/sources/hh.jsonl:2: 'chosen' must end with an assistant turn, the answer (it ends with user)", 1),
    Case("preference-hh-not-a-transcript", "sources", "HH-RLHF preference JSONL (no `prompt`) whose line 1 `chosen` is plain text without `Human:`/`Assistant:` turns", "ingest",
         source("hh.jsonl", jsonl({"chosen": "a", "rejected": "b"}), kind="preference"),
         "error: ingest: data/sources/hh.jsonl:1: 'chosen' is not a transcript of '\\n\\nHuman:' / '\\n\\nAssistant:' turns (HH-RLHF layout)", 1),
    Case("preference-implicit-different-prompts", "sources",
         "TRL implicit-prompt preference JSONL whose line 2 has `chosen` and `rejected` conversations with different questions", "ingest",
         source("prefs.jsonl", jsonl({"chosen": chat("q", "a")["messages"], "rejected": chat("q", "b")["messages"]},
                                     {"chosen": chat("q", "a")["messages"], "rejected": chat("other", "b")["messages"]}), kind="preference"),
         "error: ingest: data/sources/prefs.jsonl:2: 'chosen' and 'rejected' have different prompts: they differ at turn 1 "
         "(an implicit-prompt pair shares every turn but the final answer)", 1),
    Case("heldout-chat-ends-with-user", "sources",
         "held-out chat JSONL (`split: test`) whose line 2 ends with a user turn (no reference answer to score; "
         "`evaluate` skips such chats of the validation split it falls back to, with a warning that counts and names "
         "them, and fails with an `error:` when none is left)", "ingest",
         source("heldout.jsonl", jsonl(chat("q1", "a1"), {"messages": [*chat("q2", "a2")["messages"], {"role": "user", "content": "q3"}]}),
                kind="chat", extra=", split: test"),
         "error: ingest: data/sources/heldout.jsonl:2: a held-out chat (split: test) must end with an assistant turn, "
         "the reference answer that evaluate scores (this one ends with a user turn)", 1),
    Case("preference-missing-chosen", "sources", 'preference JSONL whose line 2 has no `chosen`', "ingest",
         source("prefs.jsonl", jsonl({"prompt": "q1", "chosen": "c", "rejected": "r"}, {"prompt": "q2", "rejected": "r"}), kind="preference"),
         "error: ingest: data/sources/prefs.jsonl:2: missing field 'chosen' required for kind 'preference' "
         "(found: prompt, rejected; map yours with columns: {chosen: <name>}; kind 'preference' also accepts chosen_messages + rejected_messages)", 1),
    Case("preference-parquet-missing-chosen", "sources", "preference Parquet with columns `prompt, rejected` only", "ingest",
         source("prefs.parquet", lambda p: parquet_bytes(pd.DataFrame({"prompt": ["q"], "rejected": ["r"]}), p / "t.parquet"), kind="preference"),
         "error: ingest: data/sources/prefs.parquet: missing column 'chosen' required for kind 'preference' "
         "(found: prompt, rejected; map yours with columns: {chosen: <name>}; kind 'preference' also accepts chosen_messages + rejected_messages)", 1),
    Case("source-not-found", "sources", "`ingest.sources` entry whose path does not exist", "ingest",
         source("missing.jsonl", None),
         "error: ingest: data/sources/missing.jsonl: not found", 1),
    Case("source-unknown-extension", "sources", "source `data/sources/docs.xlsx` (no `format:`)", "ingest",
         source("docs.xlsx", b"PK\x03\x04"),
         "error: ingest: data/sources/docs.xlsx: cannot infer the format from the extension '.xlsx'; set format: to one of "
         "jsonl (.jsonl, .ndjson), json, parquet, csv (.csv, .tsv), text (.txt, .md or a directory of them), hf", 1),
    # --- params.yaml, --set, --params (qllm run checks them before anything starts) ------------
    Case("params-wrong-type-number", "params", "`pretrain.train.lr: fast` (line 6)", "qllm run",
         params_file(BASE.replace("lr: 0.002", "lr: fast")),
         "error: params.yaml:6: pretrain.train.lr: Input should be a valid number, unable to parse string as a number (got 'fast')", 2),
    Case("params-wrong-type-int", "params", "`pretrain.train.max_steps: 10.5` (line 7)", "qllm run",
         params_file(BASE.replace("max_steps: 10", "max_steps: 10.5")),
         "error: params.yaml:7: pretrain.train.max_steps: Input should be a valid integer, got a number with a fractional part (got 10.5)", 2),
    Case("params-wrong-type-list", "params", "`lora.adapter.target_modules: q_proj` (a string, not a list; line 13)", "qllm run",
         params_file(BASE.replace("target_modules: [q_proj, v_proj]", "target_modules: q_proj")),
         "error: params.yaml:13: lora.adapter.target_modules: Input should be a valid list (got 'q_proj')", 2),
    Case("params-section-not-mapping", "params", "`quantum_opt: sa` (a value where a section belongs; line 9)", "qllm run",
         params_file(BASE.replace("quantum_opt:\n  solver: sa\n", "quantum_opt: sa\n")),
         "error: params.yaml:9: quantum_opt: Input should be a valid dictionary or instance of QuantumOptParams (got 'sa')", 2),
    Case("params-unknown-key", "params", "`pretrain.train.lrr: 0.1` (typo; line 9)", "qllm run",
         params_file(BASE.replace("    warmup_steps: 1\n", "    warmup_steps: 1\n    lrr: 0.1\n")),
         "error: params.yaml:9: pretrain.train.lrr: unknown key (expected one of: …, lr, …)", 2),
    Case("params-unknown-section", "params", "a section `pretrian:` (typo of `pretrain`; line 14)", "qllm run",
         params_file(BASE + "pretrian:\n  train:\n    lr: 0.1\n"),
         "error: params.yaml:14: pretrian: unknown key (expected one of: …, pretrain, …)", 2),
    Case("params-layers-with-in-loop-allocation", "params", "`lora.adapter.layers_to_transform: [-1]` with the default `allocation: qubo_in_loop`", "qllm run",
         params_file(BASE + "    layers_to_transform: [-1]\n"),
         "error: params.yaml:14: lora.adapter.layers_to_transform: applies only with allocation: uniform (here allocation is qubo_in_loop), so here it "
         "would change nothing: leave it at its default ([])", 2),
    Case("params-qlora-with-in-loop-allocation", "params", "`lora.adapter.quantization: nf4` with the default `allocation: qubo_in_loop`", "qllm run",
         params_file(BASE + "    quantization: nf4\n"),
         "error: params.yaml:14: lora.adapter.quantization: applies only with allocation: uniform or quantum_opt (here allocation is "
         "qubo_in_loop), so here it would change nothing: leave it at its default (none)", 2),
    Case("params-option-that-changes-nothing", "params", "`dpo.simpo_gamma: 1.0` with `method: dpo` (only SimPO reads it)", "qllm run",
         params_file(BASE + "dpo:\n  simpo_gamma: 1.0\n"),
         "error: params.yaml:15: dpo.simpo_gamma: applies only with method: simpo (here method is dpo), so here it would change nothing: "
         "leave it at its default (0.5)", 2),
    Case("params-lora-adapter-key-at-the-old-place", "params", "`lora.r: 8` (the adapter's settings are under `lora.adapter`)", "qllm run",
         params_file(BASE + "  r: 8\n"),
         "error: params.yaml:11: lora: r: the adapter settings are under lora.adapter now (as under dpo.adapter): write lora.adapter.r, not lora.r", 2),
    Case("params-duplicate-key", "params", "`pretrain.train.lr` given twice (`0.002` on line 6, `0.5` on line 9)", "qllm run",
         params_file(BASE.replace("    warmup_steps: 1\n", "    warmup_steps: 1\n    lr: 0.5\n")),
         "error: {project}/params.yaml:9: pretrain.train.lr: duplicate key (first given on line 6)", 2),
    Case("params-bad-yaml", "params", "an unclosed `[` on line 13 (`target_modules: [q_proj, v_proj`)", "qllm run",
         params_file(BASE.replace("[q_proj, v_proj]", "[q_proj, v_proj") + "sft:\n  loss_on: all\n"),
         "error: {project}/params.yaml:14: invalid YAML: expected ',' or ']', but got ':'", 2),
    Case("params-tab-indent", "params", "a tab instead of spaces before `solver: sa` (line 10)", "qllm run",
         params_file(BASE.replace("  solver: sa", "\tsolver: sa")),
         "error: {project}/params.yaml:10: invalid YAML: found character '\\t' that cannot start any token", 2),
    Case("params-empty", "params", "an empty params.yaml", "qllm run",
         params_file(""),
         "error: params.yaml: ingest: required key is missing", 2),
    Case("params-missing", "params", "no params.yaml in the project", "qllm run",
         params_file(None),
         "error: {project}/params.yaml: file not found", 2),
    Case("params-latin1", "params", "params.yaml saved as latin-1 (`system_prompt: Réponds`, byte 0xe9)", "qllm run",
         params_file(BASE.encode() + "sample_data:\n  system_prompt: Réponds\n".encode("latin-1")),
         "error: {project}/params.yaml: not UTF-8 text (invalid continuation byte at byte …)", 2),
    Case("source-entry-without-path", "params", "`ingest.sources` entry `{kind: text}` without `path` (line 3)", "qllm run",
         params_file(BASE.replace("{path: data/sources/docs.txt, kind: text}", "{kind: text}")),
         "error: params.yaml:3: ingest.sources.0.path: required key is missing", 2),
    Case("solver-unknown", "params", "`quantum_opt.solver: annealer` (line 10)", "qllm run",
         params_file(BASE.replace("solver: sa", "solver: annealer")),
         "error: params.yaml:10: quantum_opt.solver: Input should be 'exact', 'sa', …(got 'annealer')", 2),
    Case("solver-fallback-unknown", "params", "`quantum_opt.fallback: tabu` (only `sa` or null)", "qllm run",
         params_file(BASE.replace("solver: sa", "solver: qaoa\n  fallback: tabu")),
         "error: params.yaml:11: quantum_opt.fallback: Input should be 'sa' (got 'tabu')", 2),
    Case("set-unknown-key", "params", "`qllm run --set pretrain.train.lrr=0.1`", "qllm run",
         params_file(BASE, "--set", "pretrain.train.lrr=0.1"),
         "error: --set: pretrain.train.lrr: unknown key (expected one of: …, lr, …)", 2),
    Case("set-unknown-section", "params", "`qllm run --set pretrian.train.lr=0.1`", "qllm run",
         params_file(BASE, "--set", "pretrian.train.lr=0.1"),
         "error: --set: pretrian: unknown key (expected one of: …, pretrain, …)", 2),
    Case("set-bad-value", "params", "`qllm run --set pretrain.train.max_steps=many`", "qllm run",
         params_file(BASE, "--set", "pretrain.train.max_steps=many"),
         "error: --set: pretrain.train.max_steps: Input should be a valid integer, unable to parse string as an integer (got 'many')", 2),
    Case("set-out-of-range", "params", "`qllm run --set dpo.beta=-1`", "qllm run",
         params_file(BASE, "--set", "dpo.beta=-1"),
         "error: --set: dpo.beta: Input should be greater than 0 (got -1)", 2),
    Case("set-no-value", "params", "`qllm run --set dpo.beta` (no `=VALUE`)", "qllm run",
         params_file(BASE, "--set", "dpo.beta"),
         "error: --set 'dpo.beta': expected KEY=VALUE with a dotted key, e.g. dpo.beta=0.2", 2),
    Case("set-unknown-solver", "params", "`qllm run --set quantum_opt.solver=quantum`", "qllm run",
         params_file(BASE, "--set", "quantum_opt.solver=quantum"),
         "error: --set: quantum_opt.solver: Input should be 'exact', 'sa', …(got 'quantum')", 2),
    Case("params-overlay-missing", "params", "`qllm run --params profile.yaml` (no such file)", "qllm run",
         params_file(BASE, "--params", "profile.yaml"),
         "error: profile.yaml: file not found", 2),
    Case("until-unknown-stage", "params", "`qllm run --until pretrian`", "qllm run",
         params_file(BASE, "--until", "pretrian"),
         "error: unknown stage 'pretrian'; stages are: sample_data, ingest, …", 2),
    # --- models and tokenizers ---------------------------------------------------------------
    Case("base-model-not-found", "models", "`sft.base_model: data/models/nope` (no such directory)", "sft",
         finetune("sft", "data/models/nope"),
         "error: sft: data/models/nope: no such model directory (expected a save_pretrained directory or a hub id)", 1),
    Case("generate-model-not-found", "models", "`qllm generate --model models/nope` (no such directory)", "qllm generate",
         generate("nope", copy=False),
         "error: models/nope: no such model directory (expected a `save_pretrained` directory or models:/NAME@ALIAS)", 2),
    Case("base-model-no-config", "models", "`sft.base_model` directory without `config.json`", "sft",
         finetune("sft", "models/no-config", "no-config"),
         "error: sft: {project}/models/no-config: no config.json (not a save_pretrained model directory)", 1),
    Case("generate-model-no-config", "models", "`qllm generate --model` directory without `config.json`", "qllm generate",
         generate("no-config"),
         "error: models/no-config: no config.json (not a save_pretrained model directory)", 2),
    Case("generate-model-empty-config", "models", "`qllm generate --model` directory whose `config.json` is empty (0 bytes)",
         "qllm generate", generate("empty-config"),
         "error: models/empty-config: cannot load a causal language model (It looks like the config file at "
         "'models/empty-config/config.json' is not a valid JSON file.)", 2),
    Case("base-model-no-weights", "models", "`sft.base_model` directory without `model.safetensors`", "sft",
         finetune("sft", "models/no-weights", "no-weights"),
         "error: sft: {project}/models/no-weights: cannot load a causal language model (Error no file named "
         "model.safetensors, or pytorch_model.bin, found in directory {project}/models/no-weights.)", 1),
    Case("generate-model-no-weights", "models", "`qllm generate --model` directory without `model.safetensors`", "qllm generate",
         generate("no-weights"),
         "error: models/no-weights: cannot load a causal language model (Error no file named model.safetensors, "
         "or pytorch_model.bin, found in directory models/no-weights.)", 2),
    Case("generate-model-cut-weights", "models", "`qllm generate --model` directory whose `model.safetensors` is cut to 100 bytes",
         "qllm generate", generate("cut-weights"),
         "error: models/cut-weights/model.safetensors: unreadable weights (Error while deserializing header: …)", 2),
    Case("generate-model-no-tokenizer", "models", "`qllm generate --model` directory without `tokenizer.json`/`tokenizer_config.json`",
         "qllm generate", generate("no-tokenizer"),
         "error: models/no-tokenizer: no tokenizer (tokenizer.json / tokenizer_config.json missing)", 2),
    Case("base-model-tokenizer-bigger-than-embedding", "models",
         "`sft.base_model` whose tokenizer has more tokens than the model's embedding (model resized to 64 rows)", "sft",
         finetune("sft", "models/resized-model", "resized-model"),
         "error: sft: {project}/models/resized-model: tokenizer has 320 tokens but the model's embedding has 64 rows "
         "(tokenizer and model do not match)", 1),
    Case("generate-tokenizer-bigger-than-embedding", "models",
         "`qllm generate --model` directory whose tokenizer has more tokens than the embedding", "qllm generate",
         generate("resized-model"),
         "error: models/resized-model: tokenizer has 320 tokens but the model's embedding has 64 rows "
         "(tokenizer and model do not match)", 2),
    Case("lora-unknown-target-module", "models", "`lora.adapter.target_modules: [q_prj]` (typo)", "lora",
         finetune("lora", "models/good", "good", extra="  adapter: {target_modules: [q_prj]}\n  allocation: uniform\n"),
         "error: lora: lora.adapter.target_modules: 'q_prj' matches no linear module of the model (its linear modules are: …q_proj…)", 1),
    Case("lora-layer-outside-the-model", "models", "`lora.adapter.layers_to_transform: [7]` on a 2-layer model", "lora",
         finetune("lora", "models/good", "good", extra="  adapter: {layers_to_transform: [7]}\n  allocation: uniform\n"),
         "error: lora: lora.adapter.layers_to_transform: 7 is outside the model's 2 layers (0..1, or -2..-1 from the end)", 1),
    Case("lora-fp8-on-cpu", "models", "`lora.adapter.quantization: fp8` on a machine without a CUDA device", "lora",
         finetune("lora", "models/good", "good", extra="  adapter: {quantization: fp8}\n  allocation: uniform\n"),
         "error: lora: lora.adapter.quantization: fp8 needs a CUDA device of compute capability 8.9 or newer (Ada, Hopper); "
         "this machine trains on cpu; use nf4 or int8", 1),
]


# ---------------------------------------------------------------------------------- running


@pytest.fixture(scope="session")
def models(tiny_base, tmp_path_factory) -> dict[str, Path]:
    """Model directories with one defect each, made from the tiny model, plus prepared chats."""
    from pipelines.core.models.models import load_causal_lm, load_tokenizer, save_pretrained

    root = tmp_path_factory.mktemp("bad_models")
    good = tiny_base / "model"
    dirs = {"good": good, "chats": tiny_base / "chat"}

    def variant(name: str, change: Callable[[Path], None]) -> None:
        shutil.copytree(good, root / name)
        change(root / name)
        dirs[name] = root / name

    variant("no-config", lambda d: (d / "config.json").unlink())
    variant("empty-config", lambda d: (d / "config.json").write_text(""))
    variant("no-weights", lambda d: (d / "model.safetensors").unlink())
    variant("cut-weights", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100]))
    variant("no-tokenizer", lambda d: [(d / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json")])
    model, tokenizer = load_causal_lm(good), load_tokenizer(good)
    assert len(tokenizer) > 64
    model.resize_token_embeddings(64)
    save_pretrained(model, tokenizer, root / "resized-model")
    dirs["resized-model"] = root / "resized-model"
    return dirs


def snapshot(project: Path) -> list[str]:
    return sorted(
        p.relative_to(project).as_posix() + ("/" if p.is_dir() else "")
        for p in project.rglob("*")
        if p.relative_to(project).as_posix() not in RESUME_STATE
        and not p.relative_to(project).as_posix().startswith(".qllm/checkpoints/")
    )


def matches(line: str, pattern: str, project: Path) -> bool:
    """`pattern` with '{project}' replaced and '…' matching any text, against the whole line."""
    parts = pattern.replace("{project}", str(project)).split("…")
    return re.fullmatch(".*".join(re.escape(part) for part in parts), line, flags=re.DOTALL) is not None


def invoke(case: Case, args: list[str], capsys) -> tuple[int | str, str]:
    """Run the case's entry point in the current directory: (exit code or 'traceback', first error line)."""
    capsys.readouterr()
    try:
        if case.entry in STAGE_ENTRIES:
            code = importlib.import_module(f"pipelines.{case.entry}").main([])
        else:
            from qllm import cli

            code = cli.main([case.entry.split()[1], *args])
    except Exception as exc:  # what the user would get as a traceback
        capsys.readouterr()
        return "traceback", f"(traceback) {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    return code, lines[0] if lines else "(no error line)"


@pytest.fixture
def no_pipeline_start(monkeypatch):
    """`qllm run` must stop at the params check: starting Prefect here would mean the bad input passed."""
    import qllm.services.local_api

    def refuse(*args, **kwargs):
        raise AssertionError("the params passed validation: `qllm run` would start the pipeline")

    monkeypatch.setattr(qllm.services.local_api, "prefect_api", refuse)


@pytest.fixture
def tracking_store(tmp_path, monkeypatch) -> str:
    """MLflow's file store outside the project: what a stage logs is the same as with the default
    `sqlite:///<project>/mlflow.db`, without the seconds a fresh SQLite store takes to migrate."""
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def new_project(root: Path) -> Path:
    project = root / "project"
    (project / "data" / "sources").mkdir(parents=True)
    shutil.copy2(REPO / "dvc.yaml", project / "dvc.yaml")
    write(project, "data/sources/docs.txt", "Tovik lives in Pelora.\n\nMarela lives in Dunmar.\n")
    return project


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input(case: Case, tmp_path, tracking_store, capsys, monkeypatch, no_pipeline_start, request):
    project = new_project(tmp_path)
    args = case.setup(project, request.getfixturevalue("models") if case.group == "models" else {})
    monkeypatch.chdir(project)
    before = snapshot(project)
    code, line = invoke(case, args, capsys)
    assert code == case.exit, line
    assert matches(line, case.message, project), line
    after = snapshot(project)
    assert after == before, f"left behind: {sorted(set(after) - set(before))}; removed: {sorted(set(before) - set(after))}"


def test_a_failed_stage_is_recorded_as_failed_and_writes_no_metrics(tmp_path, tracking_store, capsys, monkeypatch):
    """What the doc's checklist promises: the stage's MLflow run ends FAILED, no metrics JSON."""
    from mlflow import MlflowClient

    case = next(c for c in CASES if c.id == "jsonl-bad-line")
    project = new_project(tmp_path)
    case.setup(project, {})
    monkeypatch.chdir(project)
    assert invoke(case, [], capsys)[0] == 1
    client = MlflowClient(tracking_uri=tracking_store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in runs] == [("ingest", "FAILED")]
    assert not (project / "data" / "metrics").exists() and not (project / "data" / "ingested").exists()


def test_a_duplicate_key_in_a_params_overlay_names_the_overlay(tmp_path, capsys, monkeypatch, no_pipeline_start):
    """`--params` overlays are read like params.yaml: a key given twice is an error, not the last value."""
    project = new_project(tmp_path)
    write(project, "params.yaml", BASE)
    write(project, "profile.yaml", "dpo:\n  beta: 0.1\n  beta: 0.2\n")
    monkeypatch.chdir(project)
    code, line = invoke(Case("overlay", "params", "", "qllm run", params_file(None), "", 2), ["--params", "profile.yaml"], capsys)
    assert (code, line) == (2, "error: profile.yaml:3: dpo.beta: duplicate key (first given on line 2)")


def test_evaluate_skips_held_out_chats_without_a_final_answer_and_counts_them(tmp_path, caplog):
    """Chats of the split `evaluate` reads that do not end with an assistant turn are skipped with
    a warning naming them; with none left, a clear error instead of a KeyError."""
    from pipelines.core.errors import QllmError
    from pipelines.core.evaluation.heldout import heldout_questions

    def split_file(split: str, chats: dict[str, dict]) -> None:
        frame = pd.DataFrame({"id": list(chats), "source": "s", "split": split,
                              "messages": [json.dumps(c["messages"]) for c in chats.values()]})  # fmt: skip
        frame.astype("str").to_parquet(tmp_path / f"{split}.parquet", index=False)

    open_ended = {"messages": [*chat("q2", "a2")["messages"], {"role": "user", "content": "q3"}]}
    split_file("test", {})
    split_file("validation", {"v-0": chat("q1", "a1"), "v-1": open_ended})
    with caplog.at_level("WARNING", logger="qllm.evaluate"):
        questions = heldout_questions(tmp_path)
    assert list(questions["id"]) == ["v-0"]
    assert "skipped 1 of 2 held-out chats that do not end with an assistant's text answer" in caplog.text and "v-1" in caplog.text
    split_file("validation", {"v-1": open_ended})
    with pytest.raises(QllmError, match=r"validation\.parquet: none of the 1 held-out chats ends with an assistant turn"):
        heldout_questions(tmp_path)


@pytest.mark.parametrize("value", ["gpt2", "HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_a_hub_id_is_not_taken_for_a_missing_directory(value, tmp_path, monkeypatch):
    from pipelines.core.models.models import local_model_dir

    monkeypatch.chdir(tmp_path)
    assert local_model_dir(value) is None


@pytest.mark.parametrize("value", ["data/models/nope", "./nope", "a/b/c", "/no/such/model", "../nope"])
def test_a_missing_local_path_is_a_missing_directory(value, tmp_path, monkeypatch):
    from pipelines.core.errors import QllmError
    from pipelines.core.models.models import local_model_dir

    monkeypatch.chdir(tmp_path)
    with pytest.raises(QllmError, match="no such model directory"):
        local_model_dir(value)


# ------------------------------------------------------------------------------ the doc table

GROUPS = {
    "sources": "Data sources (`ingest.sources`)",
    "params": "Parameters (`params.yaml`, `--set`, `--params`, `qllm run` options)",
    "models": "Models and tokenizers (`base_model`, `qllm generate --model`, LoRA settings)",
}
ENTRY_LABELS = {
    "ingest": "`ingest` stage",
    "sft": "`sft` stage",
    "lora": "`lora` stage",
    "qllm run": "`qllm run`",
    "qllm generate": "`qllm generate`",
}


def _code(text: str) -> str:
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def doc_row(case: Case) -> str:
    message = case.message.replace("{project}", "<project>")
    shown = message if message.startswith("(") else _code(message)
    test = f"`test_bad_input[{case.id}]`"
    return f"| {case.what} | {ENTRY_LABELS[case.entry]} | {shown} | {case.exit} | {test} |"


def render_tables() -> str:
    """The tables of docs/troubleshooting.md (print this to update the doc after changing a case)."""
    out = []
    for group, title in GROUPS.items():
        out += [f"#### {title}", "", "| bad input | where | what you see (first line) | exit | test |", "|---|---|---|---|---|"]
        out += [doc_row(c) for c in CASES if c.group == group]
        out.append("")
    return "\n".join(out)


def test_doc_lists_every_case():
    text = DOC.read_text(encoding="utf-8")
    missing = [c.id for c in CASES if doc_row(c) not in text]
    assert not missing, f"docs/troubleshooting.md is out of date for {missing}; regenerate with render_tables()"
    listed = set(re.findall(r"test_bad_input\[([\w-]+)\]", text))
    assert listed == {c.id for c in CASES}
    assert len({c.id for c in CASES}) == len(CASES)
