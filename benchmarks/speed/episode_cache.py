"""Multi-turn episodes with the KV cache kept across turns, against each turn sent through the model
whole again (issue 55): wall time of `episodes.run` at SmolLM2-135M's shape.

    python -m benchmarks.speed.episode_cache [--prompts 8] [--group 4] [--turn-tokens 64] [--repeats 3]

The model is a randomly initialised Llama at SmolLM2-135M's shape (30 layers, hidden 576, 9 heads,
3 KV heads, a 49,152-token vocabulary), fp32, whose next tokens are scripted (the test suite's
`ScriptedLM`): every episode calls the calculator in its first turn and answers in its second, as
a tool-trained model does on the arithmetic questions. The compute is the real shape's; only what
is drawn is fixed, so both modes draw the same tokens, and the command checks that they wrote the
same episodes. Prints each repeat, then the median of each mode and the ratio, in the same command.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import machine_line
from pipelines.core.rl import episodes
from pipelines.core.rl.tools import ToolEnvironment

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}
"""SmolLM2-135M's shape (its config.json)."""


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.core.rl.test_episodes import QLLM, setup

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tokenizer, model, offered, prompts = setup(QLLM, "hermes")
    torch.manual_seed(0)
    model.inner = LlamaForCausalLM(LlamaConfig(**SMOLLM2, max_position_embeddings=2048)).eval()
    chosen = [prompts[0]] * args.prompts  # the product question: a call, then the answer
    length = len(tokenizer(episodes.render_prompt(tokenizer, chosen[0]), add_special_tokens=False)["input_ids"])
    rows = args.prompts * args.group
    print(f"{machine_line()}; {rows} episodes a generation "
          f"({args.prompts} prompts x {args.group}) of a {length}-token prompt, turns up to {args.turn_tokens} tokens", flush=True)  # fmt: skip
    times: dict[bool, list[float]] = {True: [], False: []}
    written: dict[bool, list] = {}
    with torch.no_grad():
        for repeat in range(args.repeats):
            for reuse in (False, True):
                environments = [ToolEnvironment(offered, timeout=5.0) for _ in range(rows)]
                started = time.perf_counter()
                got = episodes.run(model, tokenizer, chosen, environments, group_size=args.group, max_turn_tokens=args.turn_tokens, max_turns=3,
                                   style="hermes", reuse_cache=reuse)  # fmt: skip
                times[reuse].append(time.perf_counter() - started)
                written[reuse] = [t.turns for t in got.transcripts]
                print(f"repeat {repeat}: {'cache kept' if reuse else 'sent whole'} {times[reuse][-1]:.2f} s, "
                      f"{sum(len(t) for t in written[reuse]) / rows:.1f} turns an episode", flush=True)  # fmt: skip
    if written[True] != written[False]:
        raise SystemExit("the two modes wrote different episodes")
    whole, kept = (statistics.median(times[m]) for m in (False, True))
    print(f"| mode | median s | min | max |\n|---|---:|---:|---:|\n| each turn sent whole | {whole:.2f} | {min(times[False]):.2f} | {max(times[False]):.2f} |\n"
          f"| KV cache kept | {kept:.2f} | {min(times[True]):.2f} | {max(times[True]):.2f} |\nratio (kept / whole): {kept / whole:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
