"""Multi-turn rollouts in which the model calls tools (issue 55): GRPO's episodes.

    episodes = run(model, tokenizer, prompts, environments, group_size=4, max_turn_tokens=48, max_turns=3, style="hermes")
    episodes.rollouts      # `Rollouts` whose completions are whole episodes; `loss_mask`: the model's own tokens
    episodes.transcripts   # per episode: each turn's text, its tool calls and what each call gave back

An episode starts from a chat prompt that carries its tools (`chat_template.TOOLS_KEY` on its first
message, so the template renders their schemas). The model writes a turn until its end-of-turn
token (or `max_turn_tokens`); the turn is read for tool calls in the template's format
(`tools.parse_tool_calls`); each call is run by the episode's environment (`tools.Environment`);
the results are rendered by the chat template as tool messages, with the next generation prompt,
in at most `max_turn_tokens` tokens (`fit_answers`: answers past it are cut and say so); and the
model writes again, until it answers without a call or has written `max_turns` turns. So an episode
adds at most `added_tokens` to its prompt, what the context check and the memory estimate count.

The episode is one token sequence: the model's turns as sampled (never re-tokenised), and between
them the template's tokens for the tool messages (`bridge_ids`). `Rollouts.completion_mask` covers
all of them (the model reads them all); `Rollouts.loss_mask` only the model's, so the tool's and
the template's tokens reach neither the loss nor the KL, and training computes each token's
log-probability over exactly the sequence it was sampled in. Each turn after the first goes on
from the last one's KV cache: only the tool's answer and the generation prompt go through the model
(`rollouts.sample_after`), each token at the position it has in the whole sequence.

An episode is `truncated` when a turn runs out of tokens, when the model still calls tools at
its last turn, or when its tool answers find no room at all (`no_room`: the template's own tokens
and the cut notes alone pass `max_turn_tokens`). Where a chat template renders the earlier turns differently once a tool message
follows (so the sequence the model wrote is not a prefix of the next prompt), `bridge_ids` cannot
append and the episode stops there, counted as `rerender_needed`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipelines.core.data.chat_template import chat_template_of, left_padding, render_chat, render_prompt
from pipelines.core.errors import QllmError
from pipelines.core.models.models import stop_token_ids
from pipelines.core.rl import rollouts, tools


def bridge_ids(tokenizer, messages: list[dict], turn_text: str, tool_messages: list[dict]) -> list[int] | None:
    """The template's tokens after the model's end-of-turn token up to the next turn's first token:
    the tool messages and the generation prompt. None when the template would render the
    conversation so far differently once the tool messages follow (then the episode cannot go on
    by appending)."""
    stops = {tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids(tokenizer)}
    turn = {"role": "assistant", "content": turn_text}
    before = render_chat(tokenizer, [*messages, turn])
    after = render_chat(tokenizer, [*messages, turn, *tool_messages], add_generation_prompt=True)
    ends = [before.rfind(s) + len(s) for s in stops if s and before.rfind(s) >= len(render_prompt(tokenizer, messages))]
    if not ends:
        return None
    cut = min(ends)  # just after the turn's own end-of-turn token
    if not after.startswith(before[:cut]):
        return None
    return tokenizer(after[cut:], add_special_tokens=False)["input_ids"]


def fit_answers(tokenizer, messages: list[dict], turn_text: str, tool_messages: list[dict], budget: int) -> tuple[list[int] | None, list[dict], list[int]]:
    """The bridge after a turn (`bridge_ids`) with its tool answers cut so that it takes at most
    `budget` tokens, what `added_tokens` (and so the context check and the memory estimate) counts
    for it: (bridge, the tool messages as the model reads them, per message the answer's tokens where
    it was cut, else 0). A cut answer keeps its first tokens, all cut answers to the same count (the
    most that fits, by bisection), and says so at its end (`tools.truncated`). The bridge is None
    where `bridge_ids` cannot append; one still longer than `budget` (the template's own tokens and
    the cut notes leave no room) is returned as it is, for the caller to stop the episode."""
    bridge = bridge_ids(tokenizer, messages, turn_text, tool_messages)
    if bridge is None or len(bridge) <= budget:
        return bridge, tool_messages, [0] * len(tool_messages)
    answers = [tokenizer(m["content"], add_special_tokens=False)["input_ids"] for m in tool_messages]

    def cut(keep: int) -> list[dict]:
        return [{**m, "content": tools.truncated(tokenizer.decode(ids[:keep]), keep, len(ids), "tokens")} if len(ids) > keep else m
                for m, ids in zip(tool_messages, answers, strict=True)]  # fmt: skip

    low, high = 0, max(len(ids) for ids in answers) - 1
    fitted = (cut(0), bridge_ids(tokenizer, messages, turn_text, cut(0)))  # the least there is: only the notes
    while low <= high:  # the most tokens of each answer that fit
        keep = (low + high) // 2
        sent = cut(keep)
        attempt = bridge_ids(tokenizer, messages, turn_text, sent)
        if attempt is not None and len(attempt) <= budget:
            fitted, low = (sent, attempt), keep + 1
        else:
            high = keep - 1
    sent, bridge = fitted
    return bridge, sent, [len(ids) if m is not c else 0 for m, c, ids in zip(tool_messages, sent, answers, strict=True)]


@dataclass
class Transcript:
    """One episode as it went: the model's turns, each call and what it gave back."""

    turns: list[dict[str, Any]] = field(default_factory=list)  # {"text", "calls": [{"name", "arguments", "observation", "error"}], "parse_failure"}
    truncated: bool = False
    rerender_needed: bool = False
    no_room: bool = False  # a turn's tool answers did not fit in `max_turn_tokens` even cut to nothing

    @property
    def answer(self) -> str:
        return self.turns[-1]["text"] if self.turns else ""

    def messages(self) -> list[dict[str, Any]]:
        """The episode as chat messages (the completion reward functions get, as TRL gives one)."""
        out: list[dict[str, Any]] = []
        for turn in self.turns:
            calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in turn["calls"]]
            out.append({"role": "assistant", "content": turn["text"], **({"tool_calls": calls} if calls else {})})
            out.extend({"role": "tool", "name": c["name"], "content": c["observation"]} for c in turn["calls"] if c["error"] != "max_turns")
        return out


@dataclass(frozen=True)
class Episodes:
    rollouts: rollouts.Rollouts
    transcripts: list[Transcript]

    def metrics(self) -> dict[str, float]:
        """Per generation: turns per episode, calls, parse failures, tool errors, truncated episodes."""
        n = max(len(self.transcripts), 1)
        calls = [c for t in self.transcripts for turn in t.turns for c in turn["calls"]]
        return {
            "episodes/mean_turns": sum(len(t.turns) for t in self.transcripts) / n,
            "episodes/tool_calls_per_episode": len(calls) / n,
            "episodes/parse_failures": float(sum(1 for t in self.transcripts for turn in t.turns if turn["parse_failure"])),
            "episodes/tool_errors": float(sum(1 for c in calls if c["error"] not in (None, "max_turns"))),  # max_turns: not run (truncated)
            "episodes/truncated_ratio": sum(t.truncated for t in self.transcripts) / n,
            "episodes/rerender_needed": float(sum(t.rerender_needed for t in self.transcripts)),
            "episodes/answers_truncated": float(sum(1 for c in calls if c.get("truncated_tokens"))),
            "episodes/no_room_for_answers": float(sum(t.no_room for t in self.transcripts)),
        }


def _raw_text(tokenizer, ids: list[int]) -> str:
    """A turn's text as the model wrote it, without its end-of-turn token."""
    stops = set(stop_token_ids(tokenizer))
    return tokenizer.decode([i for i in ids if i not in stops], skip_special_tokens=False).strip()


def added_tokens(max_turn_tokens: int, max_turns: int) -> int:
    """The most tokens an episode adds to its prompt: `max_turns` turns of the model and the tools'
    answers between them, each counted at `max_turn_tokens`."""
    return max_turn_tokens * (2 * max_turns - 1)


def longest_prompt(tokenizer, prompts: Sequence[list[dict]]) -> int:
    """Tokens of the longest chat prompt as the model sees it (the chat template, its tools, the
    generation prompt)."""
    return max(len(tokenizer(render_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]) for p in prompts)


def check_context(model, longest: int, max_turn_tokens: int, max_turns: int, *, keys: tuple[str, str], model_name: str) -> None:
    """A QllmError when the longest prompt (`longest` tokens, the tools' schemas included) and what
    an episode may add (`added_tokens`) pass the model's context (`max_position_embeddings`):
    positions it never trained on. `keys`: the params keys of the turn's tokens and of the turns."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    added = added_tokens(max_turn_tokens, max_turns)
    if context and longest + added > context:
        turn_key, turns_key = keys
        raise QllmError(f"{turns_key.rsplit('.', 1)[0]}: the longest question with the tools' schemas is {longest} tokens and an episode may add {added} "
                        f"({turn_key} x (2 x {turns_key} - 1)), past {model_name}'s context of {context} tokens; shorten the tools' descriptions, "
                        f"lower {turns_key} or {turn_key}, or use a model with a longer context")  # fmt: skip


@torch.no_grad()
def run(model, tokenizer, prompts: list[list[dict]], environments: Sequence[tools.Environment], *, group_size: int, max_turn_tokens: int, max_turns: int,
        style: str, temperature: float = 1.0, top_p: float = 1.0, records: Sequence[dict] | None = None, reuse_cache: bool = True) -> Episodes:  # fmt: skip
    """`group_size` episodes of each chat prompt, `environments[i]` serving episode i (prompts x
    group, consecutive per prompt); `records[p]` is what each of prompt p's environments is reset
    with (default: {}). `reuse_cache`: each turn after the first goes on from the last one's KV
    cache (`rollouts.sample_after`); off, each goes through the model anew from the prompt."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    rows = len(prompts) * group_size
    if len(environments) != rows:
        raise ValueError(f"{rows} episodes need {rows} environments, got {len(environments)}")
    device = next(model.parameters()).device
    with left_padding(tokenizer):
        encoded = tokenizer([render_prompt(tokenizer, p) for p in prompts], return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_ids, prompt_mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    real_prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]
    for row, env in enumerate(environments):
        env.reset(dict(records[row // group_size]) if records is not None else {})
    messages = [list(prompts[row // group_size]) for row in range(rows)]
    tokens: list[list[int]] = [[] for _ in range(rows)]
    scored: list[list[int]] = [[] for _ in range(rows)]
    transcripts = [Transcript() for _ in range(rows)]
    active = list(range(rows))
    cached, batch_rows, bridges = None, list(active), {}
    for turn in range(max_turns):
        if turn == 0:
            ids, mask, truncated, cached = rollouts.sample_from_prompts(model, tokenizer, prompt_ids, prompt_mask, group_size=group_size,
                                                                        max_new_tokens=max_turn_tokens, temperature=temperature, top_p=top_p)  # fmt: skip
        elif reuse_cache:  # the rows going on, from where the last turn left them
            place = {row: k for k, row in enumerate(batch_rows)}
            ids, mask, truncated, cached = rollouts.sample_after(model, tokenizer, cached, [place[row] for row in active], ids, mask,
                                                                 [bridges[row] for row in active], max_new_tokens=max_turn_tokens,
                                                                 temperature=temperature, top_p=top_p)  # fmt: skip
        else:
            sequences = [real_prompts[row // group_size] + tokens[row] for row in active]
            width = max(len(s) for s in sequences)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            batch_ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences], device=device)
            batch_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
            ids, mask, truncated = rollouts.sample_ids(model, tokenizer, batch_ids, batch_mask, group_size=1, max_new_tokens=max_turn_tokens,
                                                       temperature=temperature, top_p=top_p)  # fmt: skip
        going = []
        for k, row in enumerate(active):
            written = ids[k, : int(mask[k].sum())].tolist()
            tokens[row] += written
            scored[row] += [1] * len(written)
            text = _raw_text(tokenizer, written)
            parsed = tools.parse_tool_calls(text, style)
            record = {"text": parsed.text if parsed.calls else text, "calls": [], "parse_failure": parsed.failure}
            transcripts[row].turns.append(record)
            if bool(truncated[k]):
                transcripts[row].truncated = True
                continue
            if not parsed.calls:
                continue
            if turn + 1 == max_turns:  # still calling tools at its last turn: no answer
                transcripts[row].truncated = True
                record["calls"] = [{"name": c.name, "arguments": c.arguments, "observation": "", "error": "max_turns"} for c in parsed.calls]
                continue
            results = [(c, environments[row].step(c)) for c in parsed.calls]
            tool_messages = [{"role": "tool", "name": c.name, "content": o.content} for c, o in results]
            # the answers as the model reads them: what they add is bounded as the context check and the memory estimate count it
            bridge, tool_messages, cut = fit_answers(tokenizer, messages[row], text, tool_messages, max_turn_tokens)
            record["calls"] = [{"name": c.name, "arguments": c.arguments, "observation": m["content"], "error": o.error, **({"truncated_tokens": n} if n else {})}
                               for (c, o), m, n in zip(results, tool_messages, cut, strict=True)]  # fmt: skip
            if bridge is None:
                transcripts[row].rerender_needed = transcripts[row].truncated = True
                continue
            if len(bridge) > max_turn_tokens:
                transcripts[row].no_room = transcripts[row].truncated = True
                continue
            messages[row] += [{"role": "assistant", "content": text}, *tool_messages]
            tokens[row] += bridge
            scored[row] += [0] * len(bridge)
            bridges[row] = bridge
            going.append(row)
        batch_rows, active = active, going
        if not active:
            break
    width = max(max(len(t) for t in tokens), 1)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    completion_ids = torch.tensor([t + [pad] * (width - len(t)) for t in tokens], device=device)
    completion_mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in tokens], device=device)
    loss_mask = torch.tensor([s + [0] * (width - len(s)) for s in scored], device=device)
    truncated_rows = torch.tensor([t.truncated for t in transcripts], device=device)
    out = rollouts.Rollouts(prompt_ids, prompt_mask, completion_ids, completion_mask, truncated_rows, [t.answer for t in transcripts], group_size,
                            loss_mask=loss_mask)  # fmt: skip
    return Episodes(out, transcripts)


def sampler(make_environment: Callable[[], tools.Environment], *, max_turns: int, style: str) -> rollouts.Sampler:
    """`RolloutBatches`' sampler for episodes, each with a new environment (`tools.environments`),
    reset with the question's record; a turn may have up to `max_completion_length` tokens. The
    reward functions get each completion's environment as `environments` (TRL's argument)."""

    def generate(model, tokenizer, chosen: list[rollouts.Question], s: rollouts.Settings) -> rollouts.Sampled:
        environments = [make_environment() for _ in range(len(chosen) * s.group_size)]
        records = [{"id": q.id, "answer": q.answer, **q.columns} for q in chosen]
        got = run(model, tokenizer, [q.prompt for q in chosen], environments, group_size=s.group_size, max_turn_tokens=s.max_completion_length,
                  max_turns=max_turns, style=style, temperature=s.temperature, top_p=s.top_p, records=records)  # fmt: skip
        details = [{"turns": len(t.turns), "episode": json.dumps(t.turns, ensure_ascii=False)} for t in got.transcripts]
        return rollouts.Sampled(got.rollouts, [t.messages() for t in got.transcripts], got.metrics(), details, {"environments": environments})

    return generate


def tool_style(tokenizer, style: str, key: str = "grpo.tools.style") -> str:
    """`style`, or with `auto` the one the chat template writes calls in (`<tool_call>`: hermes;
    Llama 3.1's `ipython` role: llama3); a `QllmError` naming `key` if it cannot tell."""
    if style != "auto":
        return style
    template = chat_template_of(tokenizer)
    if "<tool_call>" in template:
        return "hermes"
    if "ipython" in template or "<|python_tag|>" in template:
        return "llama3"
    name = getattr(tokenizer, "name_or_path", "") or "the model"
    raise QllmError(f"{key}: auto cannot tell how {name}'s chat template writes tool calls (no `<tool_call>`, no Llama 3.1 "
                    "`ipython` role); set it to hermes or llama3")  # fmt: skip
