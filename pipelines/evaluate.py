"""Evaluate every trained model on the same held-out sets and compare them.

    python -m pipelines.evaluate       # what dvc.yaml runs; writes data/evaluate/ and
                                       # data/metrics/evaluate.json (DVC metrics, one entry per model)

For each model in `evaluate.models` (stage outputs `data/models/<stage>`), `evaluate.workers` at once:

- `val_loss`, `val_perplexity`: on the held-out pretraining text; with `evaluate.general_text_tokens`,
  `general_loss`, `general_perplexity` on real text the sample never shows (CPython's documentation):
  what fine-tuning costs the model outside the task;
- `exact_match` (+ `exact_match_by_group`), `flexible_match` (+ `_by_group`: the reference found in
  a free-form answer, lm-eval's "flexible extract": the last number for a numeric reference, the
  reference's words in the first line otherwise; `chat_template.flexible_match`), `bleu` (sacrebleu, mean sentence BLEU, 0-100) and `rougeL`
  (rouge-score F-measure, mean over questions, 0-1) of greedy answers against the references:
  each held-out conversation (`data/prepared/chat/test.parquet`, else validation) is cut before
  its last assistant turn, rendered with the chat template and answered by greedy decoding;
  exact match compares after `chat.normalize_answer` (first line, trimmed, case-folded, no
  trailing punctuation). Every prediction goes to `data/evaluate/<model>/predictions.jsonl`;
- with `evaluate.tools.functions` set, a question whose chat offers tools is answered by a greedy
  episode instead (`episodes.run`: the model's calls run, their results read, each turn up to
  `max_new_tokens`) and its last turn is the answer scored; `tool_questions` counts them and
  `tool_calls_correct` is the share whose episode called a tool, every call parsed, named an offered
  tool and returned without error; each episode's turns go to predictions.jsonl (`episode`);
- `bertscore_f1` (+ `_precision`, `_recall`), with `evaluate.bertscore_model` set: BERTScore of the
  same answers against the references with that local encoder (`BertScore`), mean over questions;
- `preference_accuracy`: how often the model gives the chosen answer of a held-out preference pair
  (`data/ref_logprobs/test.parquet`) a higher summed log-probability than the rejected one;
- for a policy trained with a reference (its directory holds `preference_config.json`; dpo.method
  dpo or kto): the implicit-reward metrics of TRL, `rewards/accuracies`, `rewards/margins`, ...,
  β·(policy − reference) on the same pairs (orpo and simpo have no reference: no such metrics).

When the multimodal stage ran (`data/models/multimodal` holds a model), an entry `multimodal` too,
on the held-out image questions (`data/prepared/image_chat/test.parquet`; `pipelines.core.models.vision.evaluate`):
`exact_match` of the greedy answers, `image_answer_loss` with each question's own image and
`shuffled_image_answer_loss` with another question's image (a seeded derangement), their difference
`image_loss_gap` (how much the image matters) and `image_loss_right_lower_fraction`; its predictions go to
`data/evaluate/multimodal/predictions.jsonl`. It is not a row of the text comparison.

Also written: `data/evaluate/comparison.csv` (one row per model; logged to MLflow as a table) and
`data/evaluate/plots/` (`loss_curves.png` from each model's `training_log.csv`/`eval_log.csv`,
`metrics.png` bars), which dvc.yaml declares as plots (`dvc plots show`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pipelines.core import paths
from pipelines.core.data import packed, real_text
from pipelines.core.data.chat_template import (
    check_tool_support,
    flexible_match,
    left_padding,
    normalize_answer,
    parse_messages,
    render_prompt,
    split_last_answer,
    tools_of,
)
from pipelines.core.errors import QllmError
from pipelines.core.models.models import CONSTRUCTION, device, load_for_inference, stop_token_ids
from pipelines.core.outputs import atomic_dir, read_json
from pipelines.core.params.release import EvaluateParams
from pipelines.core.run import plots, stage
from pipelines.core.training import chunked_loss, diffusion, episodes, loop, losses, objectives, preference_data, tools
from pipelines.core.workspace import project_root

NAME = "evaluate"
HELDOUT_PAIRS = "test.parquet"
"""The held-out preference pairs, in ref_logprobs' output directory."""
COMPARISON = "comparison.csv"
MULTIMODAL = "multimodal"
"""The multimodal stage's model directory, next to the others."""
PLOTS = "plots"
COMPARED = ("exact_match", "flexible_match", "bleu", "rougeL", "bertscore_f1", "tool_calls_correct", "preference_accuracy", "val_loss", "val_perplexity", "general_perplexity", "rewards/accuracies", "rewards/margins")
"""The columns of the comparison table (those a model has)."""


VAL_CHUNK_TOKENS = 1024
"""Tokens whose logits the validation loss holds at once (`pipelines.core.training.chunked_loss`)."""

def heldout_questions(chat_dir: Path, limit: int = 0) -> pd.DataFrame:
    """Held-out conversations (test split, else validation) as id / prompt messages / reference.

    A conversation is scored against its last turn, so one that does not end with an assistant
    turn has no reference answer: it is skipped with a warning that counts and names them
    (`ingest` already rejects such a chat in a `split: test` source), and a `QllmError` says so
    when no conversation is left.
    """
    for split in ("test", "validation"):
        path = chat_dir / f"{split}.parquet"
        frame = pd.read_parquet(path)
        if len(frame):
            break
    else:
        raise QllmError(f"{chat_dir}: no held-out chat records (test and validation splits are empty)")
    rows, skipped = [], []
    for record in frame.itertuples(index=False):
        messages = parse_messages(record.messages)
        if messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:  # a text answer to score
            prompt, reference = split_last_answer(messages)
            rows.append({"id": record.id, "prompt": prompt, "reference": reference, "split": split})
        else:
            skipped.append(str(record.id))
    if skipped:
        shown = ", ".join(skipped[:10]) + (f", ... ({len(skipped) - 10} more)" if len(skipped) > 10 else "")
        logging.getLogger(f"qllm.{NAME}").warning(
            "%s: skipped %d of %d held-out chats that do not end with an assistant's text answer (no reference to score): %s",
            path, len(skipped), len(frame), shown,
        )  # fmt: skip
    if not rows:
        raise QllmError(
            f"{path}: none of the {len(frame)} held-out chats ends with an assistant turn, so there is no "
            "reference answer to score (each chat must end with the assistant's answer)"
        )
    questions = pd.DataFrame(rows)
    return questions.head(limit) if limit else questions


@torch.no_grad()
def generate_answers(model, tokenizer, prompts: list[list[dict]], max_new_tokens: int, batch_size: int) -> list[str]:
    """Greedy answers to chat prompts, batched with left padding (the tokenizer's side as it was
    after), cut at `<|im_end|>`/EOS."""
    texts = [render_prompt(tokenizer, p) for p in prompts]  # with the chat's tools, if any
    # Similar lengths together: less padding per batch. Answers are put back in input order.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    answers: list[str] = [""] * len(texts)
    stop = stop_token_ids(tokenizer)  # renders the template: once, not per batch
    model.eval()
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        with left_padding(tokenizer):
            encoded = tokenizer([texts[i] for i in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        encoded = {k: v.to(model.device) for k, v in encoded.items()}
        output = model.generate(
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tokenizer.pad_token_id,
        )
        new_tokens = output[:, encoded["input_ids"].shape[1] :]
        for index, text in zip(chunk, tokenizer.batch_decode(new_tokens, skip_special_tokens=True), strict=True):
            answers[index] = text.strip()
    return answers


def answers_with_tools(model, tokenizer, prompts: list[list[dict]], params: EvaluateParams, model_name: str = "the model",
                       ids: list[str] | None = None) -> tuple[list[str], list[dict | None]]:  # fmt: skip
    """Greedy answers (`generate_answers`), those to prompts that offer tools from a greedy episode
    with `params.tools` (one-turn when it lists none): (answers, each one's episode or None). An
    environment is reset with the question's `ids` entry as `{"id": ...}` (not its answer)."""
    make_environment, offered = tools.environments(params.tools, "evaluate.tools")
    with_tools = [i for i, prompt in enumerate(prompts) if offered and tools_of(prompt)[1]]
    plain = sorted(set(range(len(prompts))) - set(with_tools))
    answers: list[str] = [""] * len(prompts)
    transcripts: list[dict | None] = [None] * len(prompts)
    for index, answer in zip(plain, generate_answers(model, tokenizer, [prompts[i] for i in plain], params.max_new_tokens, params.batch_size), strict=True):
        answers[index] = answer
    if not with_tools:
        return answers, transcripts
    check_tool_support(tokenizer, prompts[with_tools[0]])  # as grpo: a template that drops the tools is an error, not a silent prompt
    longest = episodes.longest_prompt(tokenizer, [prompts[i] for i in with_tools])
    episodes.check_context(model, longest, params.max_new_tokens, params.tools.max_turns, model_name=model_name,
                           keys=("evaluate.max_new_tokens", "evaluate.tools.max_turns"))  # fmt: skip
    style = episodes.tool_style(tokenizer, params.tools.style, "evaluate.tools.style")
    for start in range(0, len(with_tools), params.batch_size):
        chunk = with_tools[start : start + params.batch_size]
        environments = [make_environment() for _ in chunk]
        records = [{"id": ids[i]} if ids is not None else {} for i in chunk]
        got = episodes.run(model, tokenizer, [prompts[i] for i in chunk], environments, group_size=1, max_turn_tokens=params.max_new_tokens,
                           max_turns=params.tools.max_turns, style=style, temperature=0.0, records=records)  # fmt: skip
        for index, transcript in zip(chunk, got.transcripts, strict=True):
            answers[index] = transcript.answer.strip()
            transcripts[index] = {"turns": transcript.turns, "truncated": transcript.truncated}
    return answers, transcripts


def called_correctly(episode: dict) -> bool:
    """An episode called a tool, and every call parsed, named an offered tool and returned."""
    calls = [c for turn in episode["turns"] for c in turn["calls"]]
    return bool(calls) and not any(turn["parse_failure"] for turn in episode["turns"]) and all(c["error"] is None for c in calls)


def group_of(example_id: str) -> str:
    """Ids like `heldout-fact-city-7` are grouped as `heldout-fact-city` in the breakdown."""
    return re.sub(r"-\d+$", "", example_id)


def by_group(questions: pd.DataFrame, correct: list[bool]) -> dict[str, float]:
    """The share of `correct` answers in each question group (`group_of`)."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for example_id, ok in zip(questions["id"], correct, strict=True):
        groups[group_of(example_id)].append(ok)
    return {g: round(sum(v) / len(v), 4) for g, v in sorted(groups.items())}


def exact_match_report(questions: pd.DataFrame, predictions: list[str]) -> tuple[list[bool], dict[str, float]]:
    correct = [normalize_answer(p) == normalize_answer(r) for p, r in zip(predictions, questions["reference"], strict=True)]
    return correct, by_group(questions, correct)


def flexible_match_report(questions: pd.DataFrame, predictions: list[str]) -> tuple[list[bool], dict[str, float]]:
    """`chat_template.flexible_match` of every answer (the reference found in a free-form answer)."""
    correct = [flexible_match(p, r) for p, r in zip(predictions, questions["reference"], strict=True)]
    return correct, by_group(questions, correct)


def text_similarity(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean sentence BLEU (sacrebleu, 0-100, effective n-gram order) and mean ROUGE-L F-measure
    (rouge-score, 0-1) over the answers.

    Held-out answers are one to three words: corpus BLEU-4 has no 4-grams to count and is 0 for
    every model, so each answer is scored with the n-gram orders it has (sacrebleu's
    `effective_order`, its recommended sentence-level setting) and the scores are averaged."""
    import sacrebleu

    if not predictions:
        return {"bleu": 0.0, "rougeL": 0.0}
    metric = sacrebleu.metrics.BLEU(effective_order=True)
    bleu = sum(metric.sentence_score(p, [r]).score for p, r in zip(predictions, references, strict=True)) / len(predictions)
    rouge = sum(rouge_l(r, p) for p, r in zip(predictions, references, strict=True)) / len(predictions)
    return {"bleu": round(bleu, 4), "rougeL": round(rouge, 4)}


def rouge_l(reference: str, prediction: str) -> float:
    """rouge-score's ROUGE-L F-measure (`RougeScorer(["rougeL"]).score(reference, prediction)`),
    from its own tokenizer and F-measure, without its `rouge_scorer` module: that module imports
    NLTK (for a stemmer this metric does not use), 1.4 s of every evaluating process on a 2-core
    AVX2-only EPYC. The longest common subsequence is the same dynamic programme, one row kept."""
    from rouge_score import scoring, tokenize

    ref, pred = tokenize.tokenize(reference, None), tokenize.tokenize(prediction, None)
    if not ref or not pred:
        return 0.0
    row = [0] * (len(pred) + 1)
    for word in ref:
        diagonal = 0
        for j, other in enumerate(pred, start=1):
            diagonal, row[j] = row[j], diagonal + 1 if word == other else max(row[j], row[j - 1])
    return scoring.fmeasure(row[-1] / len(pred), row[-1] / len(ref))


class BertScore:
    """BERTScore (Zhang et al., 2020) of answers against references, with a local encoder.

    Each text is embedded by the encoder's hidden state `layer` (0: the embeddings; None: the last)
    and each of its tokens matched to the most cosine-similar token of the other text: precision
    averages the answer's best matches, recall the reference's, F1 is their harmonic mean. As in
    bert-score by default: no idf weighting, special tokens ([CLS]/[SEP], <s>/</s>) matched against
    but not counted, byte-level BPE text (RoBERTa, GPT-2) encoded with a leading space, an empty
    text scoring 0, no baseline rescaling. Relative paths are relative to the project of `root`;
    nothing is downloaded."""

    def __init__(self, name: str, root: Path, layer: int | None = None):
        from transformers import AutoConfig, AutoModel, AutoTokenizer, GPT2Tokenizer, RobertaTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES


        path = Path(name).expanduser()
        path = path if path.is_absolute() else project_root(root) / path
        where = f"evaluate.bertscore_model={name!r}"
        if not path.is_dir():
            raise QllmError(f"{where}: {path} is not a directory (a local save_pretrained encoder is needed; nothing is downloaded)")
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_encoder_decoder
            if encoder:
                self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                with CONSTRUCTION:
                    self.model = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device()).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise QllmError(f"{where}: cannot load an encoder and its tokenizer from {path} ({exc})") from None
        if not encoder:
            raise QllmError(f"{where}: {path} holds a {config.model_type!r} model, not a BERT-like text encoder (bert, roberta, deberta, ...)")
        self.layer = config.num_hidden_layers if layer is None else layer
        if not 0 <= self.layer <= config.num_hidden_layers:
            raise QllmError(f"evaluate.bertscore_layer={layer}: {path} has {config.num_hidden_layers} layers (0: the embeddings)")
        self.max_length = min(self.tokenizer.model_max_length, getattr(config, "max_position_embeddings", 512))
        self.prefix_space = isinstance(self.tokenizer, (GPT2Tokenizer, RobertaTokenizer))
        self.lock = threading.Lock()  # one model, several evaluate workers: a fast tokenizer is not thread-safe

    @torch.no_grad()
    def embed(self, texts: list[str], batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per text: its tokens' unit-length embeddings and weights (0 for special tokens)."""
        texts = [" " + t.strip() if self.prefix_space and t.strip() else t.strip() for t in texts]
        out = []
        for start in range(0, len(texts), batch_size):
            encoded = self.tokenizer(texts[start : start + batch_size], padding=True, truncation=True, max_length=self.max_length,
                                     return_special_tokens_mask=True, return_tensors="pt")  # fmt: skip
            special = encoded.pop("special_tokens_mask")
            keep = encoded["attention_mask"].bool()
            hidden = self.model(**encoded.to(self.model.device), output_hidden_states=True).hidden_states[self.layer].float().cpu()
            out += [(torch.nn.functional.normalize(h[k], dim=-1), 1.0 - s[k].float()) for h, k, s in zip(hidden, keep, special, strict=True)]
        return out

    def scores(self, predictions: list[str], references: list[str], batch_size: int = 32) -> torch.Tensor:
        """(precision, recall, F1) of each answer against its reference: an (n, 3) tensor."""
        with self.lock:
            answers, refs = self.embed(predictions, batch_size), self.embed(references, batch_size)
        rows = []
        for (answer, a_weight), (ref, r_weight) in zip(answers, refs, strict=True):
            if not a_weight.sum() or not r_weight.sum():
                rows.append((0.0, 0.0, 0.0))
                continue
            similarity = answer @ ref.T
            precision = float(similarity.max(dim=1).values @ a_weight / a_weight.sum())
            recall = float(similarity.max(dim=0).values @ r_weight / r_weight.sum())
            rows.append((precision, recall, 2 * precision * recall / (precision + recall) if precision + recall else 0.0))
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)

    def metrics(self, predictions: list[str], references: list[str], batch_size: int = 32) -> dict[str, float]:
        """Mean `bertscore_precision`, `bertscore_recall`, `bertscore_f1` over the answers."""
        means = self.scores(predictions, references, batch_size).mean(dim=0).nan_to_num().tolist()
        return {f"bertscore_{k}": round(v, 4) for k, v in zip(("precision", "recall", "f1"), means, strict=True)}


@torch.no_grad()
def preference_metrics(model, pairs: list[preference_data.Pair], pad_id: int, batch_size: int, beta: float | None) -> dict[str, float]:
    """`preference_accuracy` (log p(chosen) > log p(rejected)) over `pairs`; with `beta` (a DPO
    policy) also its implicit rewards against the pairs' cached reference log-probabilities."""
    if not pairs:
        return {}
    model.eval()
    make = preference_data.collate(pairs, pad_id)
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        batch = loop.to_device(make(np.arange(start, min(start + batch_size, len(pairs)))), model.device)
        c, r = preference_data.sequence_logps(model, batch, preference_data.SCORE_CHUNK_TOKENS)
        chosen.append(c.float().cpu())
        rejected.append(r.float().cpu())
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    metrics = {"preference_accuracy": round(float((chosen > rejected).float().mean()), 4), "preference_pairs": len(pairs)}
    if beta is not None:
        ref_chosen = torch.tensor([p.ref_chosen for p in pairs])
        ref_rejected = torch.tensor([p.ref_rejected for p in pairs])
        _, chosen_rewards, rejected_rewards = losses.preference_loss(chosen, rejected, ref_chosen, ref_rejected, beta=beta)
        rewards = losses.reward_metrics(chosen_rewards, rejected_rewards, chosen, rejected, ref_chosen)
        metrics |= {k: round(v, 6) for k, v in rewards.items()}
    return metrics


def general_text_rows(tokenizer, tokens: int, seq_len: int) -> np.ndarray:
    """The first `tokens` tokens (whole rows of `seq_len`) of CPython's documentation
    (`real_text.documentation`: the same documents in the same order for an interpreter), each
    document followed by EOS as `tokenize` separates them."""
    ids: list[int] = []
    for document in real_text.documentation():
        ids += tokenizer(document, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= tokens:
            break
    rows = max(1, min(len(ids), tokens) // seq_len)
    return np.asarray(ids[: rows * seq_len], dtype=np.int64).reshape(rows, seq_len)


def causal_loss(model, rows: np.ndarray, params: EvaluateParams) -> float:
    """Mean next-token loss of `model` over packed `rows` (the first `eval_batches` batches)."""
    batches = packed.fixed_batches(rows, params.batch_size, params.eval_batches)
    if diffusion.objective_of(model) == "masked_diffusion":  # the NELBO bound per token (its perplexity: a bound)
        return objectives.nelbo_fn(objectives.chat_objective(model), batches, "fp32")(model)["val/loss"]
    # the head a chunk of tokens at a time: whole, a 150k vocabulary's fp32 logits of one batch of
    # 256-token rows took 15 GB at the Qwen2.5-0.5B shape (the same mean, up to float rounding)
    return loop.mean_loss(model, chunked_loss.causal(VAL_CHUNK_TOKENS), batches, model.device, "fp32")


def evaluate_model(
    model_dir: Path, root: Path, tokenized: Path, questions: pd.DataFrame, out: Path, params: EvaluateParams, pairs: list[preference_data.Pair] = (),
    bertscore: BertScore | None = None,
) -> dict:
    """Metrics of one model; its predictions go to `out/predictions.jsonl`."""
    model, tokenizer = load_for_inference(model_dir, root)
    started = time.perf_counter()
    val_rows = packed.load(tokenized, "validation")
    val_loss = causal_loss(model, val_rows, params)
    general = {}
    if params.general_text_tokens:
        general_loss = causal_loss(model, general_text_rows(tokenizer, params.general_text_tokens, val_rows.shape[1]), params)
        general = {"general_loss": round(general_loss, 6), "general_perplexity": round(math.exp(min(general_loss, 50.0)), 4)}

    generating = time.perf_counter()
    predictions, transcripts = answers_with_tools(model, tokenizer, questions["prompt"].tolist(), params, model_name=paths.named(model_dir, root),
                                                  ids=questions["id"].tolist())  # fmt: skip
    generate_seconds = time.perf_counter() - generating
    episodes_run = [t for t in transcripts if t is not None]
    tool_metrics = {"tool_questions": len(episodes_run), "tool_calls_correct": round(sum(map(called_correctly, episodes_run)) / len(episodes_run), 4)} if episodes_run else {}
    correct, exact_by_group = exact_match_report(questions, predictions)
    flexible, flexible_by_group = flexible_match_report(questions, predictions)
    similarity = text_similarity(predictions, questions["reference"].tolist())
    if bertscore is not None:
        similarity |= bertscore.metrics(predictions, questions["reference"].tolist(), params.batch_size)
    config_path = model_dir / preference_data.PREFERENCE_CONFIG
    trained = read_json(config_path) if config_path.exists() else {}
    beta = trained["beta"] if trained.get("reference") else None  # the reference-free methods have no implicit reward β·(π − ref)
    preference = preference_metrics(model, list(pairs), tokenizer.pad_token_id, params.batch_size, beta)
    seconds = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as handle:
        for row, prediction, ok, loose, episode in zip(questions.itertuples(index=False), predictions, correct, flexible, transcripts, strict=True):
            record = {"id": row.id, "prompt": row.prompt[-1]["content"], "reference": row.reference, "prediction": prediction, "correct": ok,
                      "flexible": loose, **({"episode": episode} if episode is not None else {})}  # fmt: skip
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return {
        "val_loss": round(val_loss, 6),
        "val_perplexity": round(math.exp(min(val_loss, 50.0)), 4),
        **general,
        "exact_match": round(sum(correct) / max(1, len(correct)), 4),
        "questions": len(correct),
        "exact_match_by_group": exact_by_group,
        "flexible_match": round(sum(flexible) / max(1, len(flexible)), 4),
        "flexible_match_by_group": flexible_by_group,
        **similarity,
        **tool_metrics,
        **preference,
        "eval_seconds": round(seconds, 3),
        "seconds_per_question": round(generate_seconds / max(1, len(predictions)), 4),  # batched greedy generation
    }


def evaluate_multimodal(model_dir: Path, image_dir: Path, out: Path, params: EvaluateParams) -> dict:
    """The multimodal model's metrics on the held-out image questions (see the module docstring)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from pipelines.core.models import vision

    chats = vision.read_chats(image_dir, "test")
    if params.max_questions:
        chats = chats[: params.max_questions]
    with CONSTRUCTION:
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
        processor = AutoProcessor.from_pretrained(model_dir)
    started = time.perf_counter()
    metrics = vision.evaluate(model.to(device()), processor, chats, max_new_tokens=params.max_new_tokens, batch_size=params.batch_size, device=device())
    rows = metrics.pop("rows", [])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    renamed = {"image_questions": "questions", "image_exact_match": "exact_match"}
    return {renamed.get(k, k): v for k, v in metrics.items()} | {"eval_seconds": round(time.perf_counter() - started, 3)}


def switched_off(model_dir: Path) -> bool:
    """Whether a stage's model directory holds only the README of a stage its params switch off
    (`grpo.enabled: false`: `stage.placeholder`), no model."""
    return {p.name for p in model_dir.iterdir()} == {"README.md"}


def run(root: Path, models_dir: Path, tokenized: Path, chat_dir: Path, out: Path, params: EvaluateParams, preferences: Path | None = None,
        image_dir: Path | None = None) -> dict[str, dict]:  # fmt: skip
    """`{model: metrics}` for every model in `params.models` (and `multimodal` when `models_dir/multimodal`
    holds a model and `image_dir` is given); predictions under `out/<model>/`, the comparison table and
    plots under `out/`."""
    from pipelines.core.models import vision
    questions = heldout_questions(chat_dir, params.max_questions)
    bertscore = BertScore(params.bertscore_model, root, params.bertscore_layer) if params.bertscore_model else None
    pairs = preference_data.from_frame(pd.read_parquet(preferences)) if preferences is not None and preferences.exists() else []
    for name in params.models:
        if not (models_dir / name).exists():
            raise QllmError(f"{models_dir / name}: model of stage {name!r} not found (evaluate.models lists it)")
    models = [name for name in params.models if not switched_off(models_dir / name)]
    if skipped := sorted(set(params.models) - set(models)):
        logging.getLogger(f"qllm.{NAME}").info("not evaluated: %s (switched off: the stage wrote only its README)", ", ".join(skipped))
    if not models:
        raise QllmError(f"{models_dir}: none of evaluate.models ({', '.join(params.models)}) holds a trained model")
    with atomic_dir(out) as tmp:

        def one(name: str) -> dict:
            return evaluate_model(models_dir / name, root, tokenized, questions, tmp / name, params, pairs, bertscore)

        with ThreadPoolExecutor(max_workers=params.workers) as pool:
            results = dict(zip(models, pool.map(one, models), strict=True))
        comparison(results).to_csv(tmp / COMPARISON, index=False)
        plots.loss_curves({name: models_dir / name for name in models}, tmp / PLOTS / "loss_curves.png")
        plots.metric_bars(results, [m for m in ("exact_match", "rougeL", "preference_accuracy") if any(m in r for r in results.values())],
                          tmp / PLOTS / "metrics.png")  # fmt: skip
        if image_dir is not None and vision.trained(models_dir / MULTIMODAL):
            results[MULTIMODAL] = evaluate_multimodal(models_dir / MULTIMODAL, image_dir, tmp / MULTIMODAL, params)
    return results


def comparison(results: dict[str, dict]) -> pd.DataFrame:
    """One row per model, the metrics of `COMPARED` it has as columns."""
    columns = [c for c in COMPARED if any(c in r for r in results.values())]
    return pd.DataFrame([{"model": name, **{c: r.get(c) for c in columns}} for name, r in results.items()])


def body(ctx: stage.StageContext) -> dict:
    out = ctx.output()
    models_dir = {ctx.input(f"models/{name}").parent for name in ctx.params.models}  # each model a dvc.yaml dep
    if len(models_dir) != 1:
        raise QllmError(f"dvc.yaml: the models evaluate reads must share one directory, not {sorted(map(str, models_dir))}")
    if ctx.params.bertscore_model:
        ctx.log.info("BERTScore with %s, layer %s: its files are not a dvc.yaml dependency (DVC reruns evaluate when the param changes, "
                     "not when the files do)", ctx.params.bertscore_model, "last" if ctx.params.bertscore_layer is None else ctx.params.bertscore_layer)  # fmt: skip
    models_dir = models_dir.pop()
    if ctx.input("models/multimodal").parent != models_dir:
        raise QllmError(f"dvc.yaml: evaluate reads the multimodal model from {ctx.input('models/multimodal')}, outside {models_dir}")
    results = run(ctx.root, models_dir, ctx.input("tokenized"), ctx.input("chat"), out, ctx.params, ctx.input("ref_logprobs") / HELDOUT_PAIRS,
                  ctx.input("image_chat"))  # fmt: skip
    image = results.pop("multimodal", None)
    if image is not None:
        ctx.tracker.log_artifact(out / "multimodal" / "predictions.jsonl", "predictions/multimodal")
        ctx.log.info("multimodal: exact match %.1f%% on %d held-out image questions; answer loss %.4f with the right image, %.4f with a "
                     "shuffled one (gap %.4f)", 100 * image["exact_match"], image["questions"], image["image_answer_loss"],
                     image["shuffled_image_answer_loss"], image["image_loss_gap"])  # fmt: skip
    for name, metrics in results.items():
        ctx.tracker.log_artifact(out / name / "predictions.jsonl", f"predictions/{name}")
        ctx.log.info(
            "%s: val/loss %.4f (perplexity %.2f); exact match %.1f%% (flexible %.1f%%), BLEU %.1f, ROUGE-L %.3f%s on %d held-out questions%s",
            name, metrics["val_loss"], metrics["val_perplexity"], 100 * metrics["exact_match"], 100 * metrics["flexible_match"], metrics["bleu"],
            metrics["rougeL"],
            f", BERTScore F1 {metrics['bertscore_f1']:.3f}" if "bertscore_f1" in metrics else "",
            metrics["questions"], f"; prefers chosen {100 * metrics['preference_accuracy']:.1f}%" if "preference_accuracy" in metrics else "",
        )  # fmt: skip
    ctx.tracker.log_table(pd.read_csv(out / COMPARISON), "comparison.json")
    ctx.tracker.log_artifacts(out / PLOTS, "plots")
    return results | ({"multimodal": image} if image is not None else {})


def main(argv: list[str] | None = None) -> int:
    return stage.main(NAME, body, argv)


if __name__ == "__main__":
    raise SystemExit(main())
