"""The layouts of LLaMA-Factory, TRL and OpenAI as their users have them (tests/fixtures, origins in
its README): ShareGPT preferences, content parts, per-message loss weights, tool-calling chats
rendered through the templates that support tools, KTO's unpaired feedback refused clearly, and
plain-text files cut into documents by line."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipelines.core.data import chat_template, readers
from pipelines.core.data.chat_template import ChatTemplateError
from pipelines.core.data.readers import ReaderError
from pipelines.core.params.data import SourceParams
from tests.chat_families import CHATML, HERMES, LLAMA31_TOOLS, QWEN25, TOOL_FAMILIES, tokenizer_for

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
LF = FIXTURES / "llamafactory"


def read(path: str, kind: str, root: Path = LF, **options):
    return readers.read_source(SourceParams(path=path, kind=kind, **options), root)


def refused(path: str, kind: str, root: Path = LF, **options) -> str:
    with pytest.raises(ReaderError) as caught:
        read(path, kind, root, **options)
    return str(caught.value)


def records(tmp_path: Path, rows: list[dict], name: str = "x.jsonl") -> Path:
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                                                          "required": ["city"]}}}]  # fmt: skip
OPENAI_TOOL_CHAT = {  # OpenAI's chat fine-tuning layout with function calling (written for these tests)
    "messages": [
        {"role": "system", "content": "You answer with the tools you have."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Pelora?"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Pelora\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"clear\", \"celsius\": 21}"},
        {"role": "assistant", "content": "Clear skies and 21 degrees in Pelora."},
    ],
    "tools": TOOLS,
}  # fmt: skip


# ---------------------------------------------------------------- layouts


def test_llamafactory_dpo_pairs_are_sharegpt_prompts_with_answer_turns():
    frame = read("dpo_en_demo.json", "preference")
    source = json.loads((LF / "dpo_en_demo.json").read_text())
    assert len(frame) == len(source) == 4
    for row, record in zip(frame.itertuples(), source, strict=True):
        prompt = json.loads(row.prompt)
        assert prompt[-1] == {"role": "user", "content": record["conversations"][-1]["value"]}
        assert row.chosen == record["chosen"]["value"] and row.rejected == record["rejected"]["value"]


def test_glaive_tool_chats_keep_their_calls_results_and_tools():
    frame = read("glaive_toolcall_en_demo.json", "chat")
    source = json.loads((LF / "glaive_toolcall_en_demo.json").read_text())
    assert len(frame) == len(source) == 6
    for raw, record in zip(frame["messages"], source, strict=True):
        messages = json.loads(raw)
        turns = record["conversations"]
        assert len(messages) == len(turns)
        tools = json.loads(record["tools"])
        assert ("tools" in messages[0]) == bool(tools)
        if tools:
            assert messages[0]["tools"] == [{"type": "function", "function": t} for t in tools]
        for message, turn in zip(messages, turns, strict=True):
            if turn["from"] == "function_call":
                call = json.loads(turn["value"])
                assert message["role"] == "assistant" and message["content"] == ""
                assert message["tool_calls"] == [{"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]
            elif turn["from"] == "observation":  # the result, named after the call it answers
                assert message["role"] == "tool" and message["content"] == turn["value"] and message["name"] == call["name"]
            else:
                assert message["content"] == turn["value"]


def test_openai_tool_calls_read_as_the_sharegpt_ones(tmp_path):
    (messages,) = [json.loads(m) for m in read("x.jsonl", "chat", records(tmp_path, [OPENAI_TOOL_CHAT]))["messages"]]
    assert messages[0] == {"role": "system", "content": "You answer with the tools you have.", "tools": TOOLS}
    assert messages[1] == {"role": "user", "content": "Weather in Pelora?"}  # text parts joined
    assert messages[2] == {"role": "assistant", "content": "",
                           "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Pelora"}}, "id": "call_1"}]}
    assert messages[3] == {"role": "tool", "content": "{\"sky\": \"clear\", \"celsius\": 21}", "tool_call_id": "call_1", "name": "get_weather"}


def test_llamafactory_v1_content_parts_and_loss_weights():
    frame = read("v1_sft_demo.jsonl", "chat")
    lines = [json.loads(line) for line in (LF / "v1_sft_demo.jsonl").read_text().splitlines()]
    assert len(frame) == len(lines) == 8
    for raw, line in zip(frame["messages"], lines, strict=True):
        messages = json.loads(raw)
        assert [m["content"] for m in messages] == ["".join(p["value"] for p in m["content"]) for m in line["messages"]]
        assert all("weight" not in m for m in messages)  # loss_weight 0 on users (never trained), 1 on answers


def test_a_zero_loss_weight_answer_is_context(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q", "loss_weight": 0.0}, {"role": "assistant", "content": "a", "loss_weight": 0.0},
                          {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "loss_weight": 1.0}]}]  # fmt: skip
    (messages,) = [json.loads(m) for m in read("x.jsonl", "chat", records(tmp_path, rows))["messages"]]
    assert messages[1] == {"role": "assistant", "content": "a", "weight": 0} and "weight" not in messages[3]


def test_image_parts_carry_their_images_into_an_image_chat():
    frame = read("v1_multimodal_demo.jsonl", "image_chat")
    (messages,), (images,) = [json.loads(m) for m in frame["messages"]], list(frame["images"])
    jpeg = (LF / "mllm_demo_data" / "1.jpg").read_bytes()
    assert [bytes(b) for b in images] == [jpeg, jpeg]  # the two image_url parts, in order
    assert messages[0]["content"] == "<image>Who are they?" and messages[2]["content"] == "What are they doing?<image>"


def test_trl_bare_image_parts_take_the_images_column(tmp_path):
    from tests.core.data.test_image_records import png

    (tmp_path / "a.png").write_bytes(png())
    rows = [{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}], "images": ["a.png"]}]  # fmt: skip
    frame = read("x.jsonl", "image_chat", records(tmp_path, rows))
    assert json.loads(frame["messages"][0])[0]["content"] == "<image>What is it?" and len(frame["images"][0]) == 1


def test_text_files_by_line_and_a_warning_for_a_huge_document(caplog, tmp_path):
    lines = (LF / "wiki_demo.txt").read_text().splitlines()
    by_line = read("wiki_demo.txt", "text", documents="line")
    assert list(by_line["text"]) == lines and len(lines) == 6
    assert len(read("wiki_demo.txt", "text")) == 1  # the default, blank lines, as before: one document
    assert list(read("wiki_demo.txt", "text", documents="file")["text"]) == ["\n".join(lines)]
    (tmp_path / "big.txt").write_text(("word " * 30_000 + "\n") * 2)
    with caplog.at_level(logging.WARNING, logger="qllm.ingest"):
        assert len(read("big.txt", "text", tmp_path)) == 1
    assert "big.txt:1: a document of 300001 characters (more than 100000); if it holds one document a line, give the source `documents: line`" in caplog.text
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    assert "documents: line says how a plain text file is cut into documents; this source is jsonl" in refused("x.jsonl", "text", tmp_path, documents="line")


# ---------------------------------------------------------------- refusals


def test_kto_feedback_as_a_chat_or_preference_source_says_to_use_kind_feedback(tmp_path):
    assert "'label': unpaired feedback (a completion labelled desirable or not) is KTO's layout: give the source `kind: feedback`" in refused("kto_en_demo.json", "chat")
    unpaired = records(tmp_path, [{"prompt": "q", "completion": "a", "label": True}])
    assert "record" not in refused("x.jsonl", "preference", unpaired) and "KTO's layout" in refused("x.jsonl", "preference", unpaired)
    assert "'kto_tag': unpaired feedback" in refused("x.jsonl", "chat", records(tmp_path, [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "kto_tag": False}]))


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"role": "user", "content": [{"type": "reasoning", "value": "hm"}]}, "unsupported content part type 'reasoning' in messages[0], content part 0 (expected text)"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
         "an 'image_url' part in messages[0], content part 0: a chat source holds text; a source of chats with images is `kind: image_chat`"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "a text part needs its text as a string under 'text' (or 'value'), got int in messages[0], content part 0"),
        ({"role": "user", "content": "q", "loss_weight": 1.0}, "'loss_weight' 1 on a user message in messages[0]: only assistant turns are trained (0 or none there)"),
        ({"role": "tool", "content": "42"}, "a tool result must follow an assistant message with tool calls (or another tool result) in messages[0]"),
    ],
)
def test_bad_parts_and_turns_name_what_they_are(tmp_path, message, expected):
    rows = [{"messages": [message, {"role": "assistant", "content": "a"}]}]
    assert refused("x.jsonl", "chat", records(tmp_path, rows)) == f"x.jsonl:1: {expected}"


def test_bad_tool_calls_and_tools_are_named(tmp_path):
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}
    rows = [{"messages": [{"role": "user", "content": "q"}, call]}]
    assert "a tool call's arguments are not valid JSON (Expecting property name enclosed in double quotes) in messages[1], tool call 0" in refused("x.jsonl", "chat", records(tmp_path, rows))
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": "[{\"description\": \"no name\"}]"}]
    assert "'tools'[0] must be a function schema with a 'name'" in refused("x.jsonl", "chat", records(tmp_path, rows))
    heldout = refused("x.jsonl", "chat", records(tmp_path, [{"messages": [{"role": "user", "content": "q"}, {**call, "tool_calls": [{"name": "f", "arguments": {}}]}]}]), split="test")
    assert "must end with the assistant's text answer, which evaluate scores (this one ends with a tool call)" in heldout


# ---------------------------------------------------------------- rendering and the loss


def trained_pieces(tokenizer, messages) -> list[str]:
    out = chat_template.render_with_assistant_mask(tokenizer, messages)
    ids, mask = np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], dtype=bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return [tokenizer.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


@pytest.mark.parametrize("family", TOOL_FAMILIES, ids=lambda f: f.name)
def test_tool_chats_train_exactly_the_calls_and_answers(family):
    """Rendered with the template's own `tools` argument; the trained tokens are each assistant
    turn, a tool call or an answer, with its end-of-turn token, and nothing of the tool results."""
    chats = [json.loads(m) for m in read("glaive_toolcall_en_demo.json", "chat")["messages"]]
    texts = [json.dumps(c) for c in chats]
    tokenizer = tokenizer_for(family, texts * 3, vocab_size=600)
    for messages in chats:
        pieces = trained_pieces(tokenizer, messages)
        answers = [m for m in messages if m["role"] == "assistant"]
        assert len(pieces) == len(answers)
        for piece, answer in zip(pieces, answers, strict=True):
            assert piece.endswith(family.end_of_turn)
            if "tool_calls" in answer:
                function = answer["tool_calls"][0]["function"]
                assert function["name"] in piece and json.dumps(function["arguments"]) in piece
            else:
                assert answer["content"].strip() in piece
        for result in (m for m in messages if m["role"] == "tool"):
            assert all(result["content"] not in piece for piece in pieces)
        prompt = chat_template.render_prompt(tokenizer, messages[:-1])
        if "tools" in messages[0]:
            assert messages[0]["tools"][0]["function"]["name"] in prompt  # the schemas are in what the model reads


def test_the_llama_template_renders_the_same_day_every_day():
    tokenizer = tokenizer_for(LLAMA31_TOOLS, ["hello there"] * 3)
    messages = [{"role": "user", "content": "hi", "tools": TOOLS}, {"role": "assistant", "content": "ok"}]
    assert f"Today Date: {chat_template.DATE_STRING}" in chat_template.render_prompt(tokenizer, messages[:1])


def test_a_template_without_tools_says_so_with_its_name():
    tokenizer = tokenizer_for(CHATML, ["hello there"] * 3)
    tokenizer.name_or_path = "models/base"
    chat = [json.loads(m) for m in read("glaive_toolcall_en_demo.json", "chat")["messages"]][1]
    with pytest.raises(ChatTemplateError, match=r"models/base: its chat template does not render tool calls \(it never reads tools or tool_calls\)"):
        chat_template.render_with_assistant_mask(tokenizer, chat)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    assert chat_template.render_with_assistant_mask(tokenizer, plain)["input_ids"]  # chats without tools render as before


def test_hermes_and_qwen_render_openai_tool_chats(tmp_path):
    (messages,) = [json.loads(m) for m in read("x.jsonl", "chat", records(tmp_path, [OPENAI_TOOL_CHAT]))["messages"]]
    for family in (QWEN25, HERMES):
        tokenizer = tokenizer_for(family, [json.dumps(messages)] * 3, vocab_size=600)
        pieces = trained_pieces(tokenizer, messages)
        assert len(pieces) == 2 and "get_weather" in pieces[0] and pieces[1].startswith("Clear skies")


# ---------------------------------------------------------------- end to end, fine-tuning mode


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template_db, prefect_server):
    """The pipeline on a Qwen2.5-template base with the sample's data plus the peers' files."""
    from tests.chat_families import save_base_model
    from tests.conftest import make_project

    sample = [{"path": f"data/sample/{name}", "kind": kind, **extra} for name, kind, extra in (
        ("pretrain.txt", "text", {}), ("chat_train.jsonl", "chat", {}), ("chat_heldout.jsonl", "chat", {"split": "test"}),
        ("preference_train.jsonl", "preference", {}), ("preference_heldout.jsonl", "preference", {"split": "test"}))]  # fmt: skip
    peers = [
        {"path": "data/sources/peers/glaive_toolcall_en_demo.json", "kind": "chat"},
        {"path": "data/sources/peers/openai_tools.jsonl", "kind": "chat", "split": "train"},
        {"path": "data/sources/peers/v1_sft_demo.jsonl", "kind": "chat"},
        {"path": "data/sources/peers/dpo_en_demo.json", "kind": "preference", "split": "train"},
        {"path": "data/sources/peers/wiki_demo.txt", "kind": "text", "documents": "line"},
    ]
    overlay = {"base_model": {"name": "models/base"}, "ingest": {"sources": sample + peers},
               "prepare_data": {"max_chars": 40_000}, "sft": {"max_seq_len": 1024}, "lora": {"max_seq_len": 1024}}  # fmt: skip
    root = make_project(tmp_path_factory.mktemp("layouts") / "project", mlflow_template_db, overlay)
    shutil.copytree(LF, root / "data/sources/peers")
    (root / "data/sources/peers/openai_tools.jsonl").write_text(json.dumps(OPENAI_TOOL_CHAT) + "\n")
    texts = [json.dumps(json.loads((LF / "glaive_toolcall_en_demo.json").read_text()))] * 3 + ["Tovik lives in Pelora."] * 20
    save_base_model(QWEN25, texts, root / "models/base", max_positions=1024)
    from flows.pipeline import pipeline

    summary = pipeline(project_dir=str(root), until="evaluate")
    assert {s["status"] for s in summary["stages"]} == {"ran"}
    return root


def test_every_layout_ingests_and_fine_tunes_end_to_end(project):
    import pandas as pd

    ingest = json.loads((project / "data/metrics/ingest.json").read_text())
    counts = {name: info["records"] for name, info in ingest["sources"].items()}
    assert counts["glaive_toolcall_en_demo.json"] == 6 and counts["openai_tools.jsonl"] == 1 and counts["v1_sft_demo.jsonl"] == 8
    assert counts["dpo_en_demo.json"] == 4 and counts["wiki_demo.txt"] == 6
    chats = pd.concat(pd.read_parquet(project / f"data/prepared/chat/{s}.parquet") for s in ("train", "validation", "test"))
    tool_chats = [json.loads(m) for m in chats["messages"] if '"tool_calls"' in m]
    assert len(tool_chats) == 6 and all("tools" in c[0] for c in tool_chats)  # 5 from Glaive, 1 from OpenAI's layout
    sft = json.loads((project / "data/metrics/sft.json").read_text())
    assert sft["steps"] > 0 and sft["data/train_dropped_no_target"] == 0
    assert json.loads((project / "data/metrics/evaluate.json").read_text())["sft"]["questions"] > 0


@pytest.mark.parametrize("family", [LLAMA31_TOOLS, HERMES], ids=lambda f: f.name)
def test_sft_trains_tool_chats_on_each_tool_template(tmp_path, family):
    """The other tested templates (the pipeline above uses Qwen2.5's) through the sft stage itself."""
    import pandas as pd

    from pipelines import sft
    from pipelines.core.params.finetuning import SftParams
    from pipelines.core.params.training import TrainParams
    from tests.chat_families import save_base_model

    chats = list(read("glaive_toolcall_en_demo.json", "chat")["messages"])
    chat_dir = tmp_path / "chat"
    chat_dir.mkdir()
    for split, rows in (("train", chats), ("validation", chats[:2])):
        pd.DataFrame({"id": [f"{split}-{i}" for i in range(len(rows))], "source": "t", "split": split, "messages": rows}).to_parquet(chat_dir / f"{split}.parquet")
    save_base_model(family, [json.dumps(json.loads(c)) for c in chats] * 3, tmp_path / "base", max_positions=1024)
    train = TrainParams(max_steps=2, micro_batch_size=2, warmup_steps=1, lr=0.01, eval_every=0, log_every=1, checkpoint_every=0, precision="fp32")
    metrics = sft.run(chat_dir, tmp_path / "out", SftParams(base_model=str(tmp_path / "base"), train=train))
    assert metrics["steps"] == 2 and metrics["data/train_examples"] == 6 and metrics["data/train_dropped_no_target"] == 0
    assert metrics["data/train_target_tokens"] > 0 and np.isfinite(metrics["train_loss"])


def test_an_openai_data_url_image_part_is_decoded(tmp_path):
    import base64

    from tests.core.data.test_image_records import png

    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    rows = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Shape?"}]},
                          {"role": "assistant", "content": "A square."}]}]  # fmt: skip
    frame = read("x.jsonl", "image_chat", records(tmp_path, rows))
    assert [bytes(b) for b in frame["images"][0]] == [png()]
    web = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]},
                         {"role": "assistant", "content": "?"}]}]  # fmt: skip
    assert "is a web address: images are not downloaded; save it and give its path" in refused("x.jsonl", "image_chat", records(tmp_path, web))
