"""Multi-turn episodes: does a slow tool stall the batch? One step of 16 episodes x 3 turns.

    python benchmarks/run.py --only agents [--tiny]

``loops.episodes.sample_episodes`` against an environment that answers every assistant turn with
a tool result for three turns (the third ends the episode); each turn is at most 16 tokens. Two
policies: the demo's tiny Llama (64 wide, 2 blocks: case ``episodes_16x3_turns``) and a Llama 256
wide with 4 blocks (``episodes_16x3_turns_256w``), whose turns take longer than the tool. The
implementations:

- ``rlcore``: a tool that sleeps 50 ms a call, the episodes in two lanes taking turns (one lane's
  tools answer while the other generates) and a thread pool stepping environments (the library's way);
- ``instant-tool``: the same tool answering at once;
- ``sequential-tool-steps``: the 50 ms tool stepped one episode after another (``workers=1``), the
  latency a naive loop pays: 16 x 3 x 50 ms = 2.4 s a step.

A third case measures what the kept KV cache saves on a long history (the ``"loop"`` engine keeps
each episode's cache across turns: a turn reads only the environment's answer): 6 turns, each tool
answer 64 characters longer, the 256-wide policy, instant tool; ``rlcore`` against
``whole-context-each-turn`` (``reuse_context=False``: each turn's whole context prefilled again).

Goal (issue: latency overlapped, not summed): the 50 ms tool's step takes at most 1.3x the instant
tool's, i.e. ``instant-tool`` time / ``rlcore`` time >= 1 / 1.3.

What bounds it: each episode waits 3 x 50 = 150 ms on its own tool, in sequence with its own
three turns of decoding, whatever the schedule. On the tiny model the instant tool's whole step
takes 140-250 ms (by the machine), so no schedule comes much within 1.3x of it (150 ms alone is
1.07x of the slowest, before one token is decoded); the goal is reachable only where a turn of
generation takes longer than a tool call, which the 256-wide case has and which real models have
by a wide margin.
"""

from __future__ import annotations

import functools
import time


class _Tool:
    """Answers each assistant turn with a tool message (``filler`` characters more than its count)
    after ``delay_s``, for ``turns`` turns."""

    def __init__(self, delay_s: float, turns: int, filler: int = 0):
        self.delay_s, self.left, self.filler = delay_s, turns, filler

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        from rlcore.loops.envs import EnvStep

        if self.delay_s:
            time.sleep(self.delay_s)
        self.left -= 1
        if self.left <= 0:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(messages=({"role": "tool", "content": f"{self.left} left" + " ." * (self.filler // 2)},))


def _sizes(tiny: bool) -> tuple[int, int]:
    return (4, 2) if tiny else (16, 3)


MODELS = {"": (64, 2), "_256w": (256, 4)}  # case suffix: (hidden size, blocks)


def _builder(delay_s: float, tiny: bool, workers: int | None = None, model: tuple[int, int] = MODELS[""],
             turns: int | None = None, filler: int = 0, reuse_context: bool = True):
    def build():
        from rlcore.loops.episodes import MAX_ENV_WORKERS, sample_episodes
        from rlcore.loops.models import build_model, build_tokenizer

        episodes, default_turns = _sizes(tiny)
        tokenizer = build_tokenizer()
        width, blocks = model
        policy = build_model("llama", tokenizer=tokenizer, hidden_size=width, num_layers=blocks, num_heads=4,
                             max_position_embeddings=1024, seed=0).eval()
        rows = {"prompt": [f"{i}+{i}=" for i in range(episodes)]}
        n = turns or default_turns
        return functools.partial(sample_episodes, policy, tokenizer, rows, lambda: _Tool(delay_s, n, filler),
                                 max_new_tokens=16, max_turns=n, seed=0, workers=workers or MAX_ENV_WORKERS,
                                 stop_token_ids=tokenizer.convert_tokens_to_ids(list("0123456789")),
                                 reuse_context=reuse_context)
    return build


LONG = {"turns": 6, "filler": 64, "model": MODELS["_256w"]}  # the history case: long answers, more turns


def cases(tiny: bool) -> dict:
    episodes, turns = _sizes(tiny)
    delay = 0.005 if tiny else 0.05
    return {f"episodes_{episodes}x{turns}_turns{suffix}": {
        "rlcore": _builder(delay, tiny, model=model),
        "instant-tool": _builder(0.0, tiny, model=model),
        "sequential-tool-steps": _builder(delay, tiny, workers=1, model=model),
    } for suffix, model in MODELS.items()} | {f"episodes_{episodes}x{LONG['turns']}_long_answers_256w": {
        "rlcore": _builder(0.0, tiny, **LONG),
        "whole-context-each-turn": _builder(0.0, tiny, reuse_context=False, **LONG),
    }}


def goals(tiny: bool) -> dict:
    episodes, turns = _sizes(tiny)
    return {f"episodes_{episodes}x{turns}_turns{suffix}": [("speedup", "instant-tool", 1 / 1.3)] for suffix in MODELS}
