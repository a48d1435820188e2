"""Multi-turn rollouts: the model and an environment take turns until the episode ends.

:func:`sample_episodes` runs ``P·G`` episodes at once, one environment each (``loops.envs``):

1. ``env.reset(row)`` gives the opening conversation, rendered by the chat template (with the
   environment's tool schemas) into the prompt;
2. each turn, every running episode's context (prompt and trajectory so far) is extended by one
   assistant turn from the policy (``loops.collect.generate_rollout``: the chosen engine, each call
   seeded by a draw from the episode seed); the assistant text goes to ``env.step`` in a thread
   pool, and the environment's messages, rendered as the chat template continues the conversation,
   join the context. Episodes play in ``lanes`` fixed groups taking turns: while one group's
   environments answer, the next group generates, so tool latency overlaps generation (and the
   tools of a group overlap each other);
3. an episode ends when its environment says so, at ``max_turns`` assistant turns, or when its
   trajectory would pass ``max_episode_tokens`` (or the model's context): then it is ``truncated``.

The rollout has the single-turn layout plus what locates the turns. ``response_ids`` is the whole
trajectory after the prompt; ``response_mask`` marks the model's own tokens, the only ones the
policy loss, the KL and the entropy see (and ``old_logprobs`` are 0 elsewhere);
``trajectory_mask`` marks every real token, the model's and the environment's, which is what the
model attends to when log-probs are recomputed over the whole trajectory in one forward
(``loops.score.sequences``, ``loops.score.response_attention``). ``turn_ids`` numbers each trajectory token's turn, ``turns`` counts
the assistant turns and ``env_reward`` sums the environment's rewards (per turn, and
``final_reward()`` when the environment has it), which scoring adds to the score.

With the ``"loop"`` engine each episode keeps its KV cache from one turn to the next
(``loops.engines.ContextCache``): a turn's prefill reads only the environment's answer and the last
token the model drew, not the whole history again. ``"vllm"`` finds the history in its prefix cache;
``"hf"`` (and a model whose cache has sliding-window layers) encodes each turn's context again.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict
from torch import nn

from rlcore import keys as K
from rlcore.loops.collate import pad_sequences
from rlcore.loops.collect import draw_seed, generate_rollout
from rlcore.loops.engines import ContextCache, carries_context
from rlcore.loops.envs import EnvFactory, EnvStep
from rlcore.loops.models import pad_token_id
from rlcore.loops.tokenization import model_context

__all__ = ["sample_episodes", "render_opening", "render_continuation", "MAX_ENV_WORKERS"]

MAX_ENV_WORKERS = 16
"""Threads stepping environments at once."""


def _template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_opening(tokenizer, messages: Sequence[Mapping[str, Any]], tools: list[dict] | None = None) -> str:
    """The prompt text of an opening conversation: the chat template's rendering with the generation
    prompt (and the tool schemas), or, for a tokenizer without one, the messages' contents, one per line."""
    if _template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False, add_generation_prompt=True)
    return "\n".join(str(m.get("content", "")) for m in messages)


_BASE = ({"role": "user", "content": "1"}, {"role": "assistant", "content": "2"})


def render_continuation(tokenizer, new: Sequence[Mapping[str, Any]], tools: list[dict] | None = None,
                        stopped_with: str = "") -> str:
    """The text after the model's turn up to the next assistant turn's start: the rest of the
    template's closing of an assistant turn (what it writes after the content, less ``stopped_with``,
    the text of the stop token the model ended on: ChatML's ``<|im_end|>`` then leaves ``\\n``), then
    the environment's ``new`` messages and the generation prompt, as the chat template renders them
    after a conversation (a fixed one, so the rendering never depends on the episode's text).

    Raises ``ValueError`` for a template that does not render a conversation as a prefix of its
    continuation (one that renders the last assistant turn differently, such as a reasoning block):
    such a template cannot be extended turn by turn. A tokenizer without a template gives the
    messages one per line in a plain ``role: content`` form."""
    if not _template(tokenizer):
        return "".join(f"\n{m.get('role', 'tool')}: {m.get('content', '')}" for m in new) + "\n"
    before = tokenizer.apply_chat_template(list(_BASE), tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template([*_BASE, *new], tools=tools, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template renders a conversation differently once it continues (the last "
                         "assistant turn changes), so an episode cannot be extended turn by turn; use a template "
                         "that renders every turn as it will stay")
    closing = before[before.rindex(_BASE[-1]["content"]) + len(_BASE[-1]["content"]):]
    rest = closing[len(stopped_with):] if stopped_with and closing.startswith(stopped_with) else closing
    return rest + after[len(before):]


def _call(env: Any, method: str, episode: int, *args: Any) -> Any:
    """``env.method(*args)``; an exception stops the run naming the environment, the method and the episode."""
    try:
        return getattr(env, method)(*args)
    except Exception as e:
        raise RuntimeError(f"env: {type(env).__name__}.{method} raised {type(e).__name__}: {e} (episode {episode}); "
                           "an environment answers any text, a tool's failure being a message the model reads") from e


def sample_episodes(model: nn.Module, tokenizer, rows: Mapping[str, Sequence], make_env: EnvFactory, *,
                    num_samples: int = 1, max_new_tokens: int = 64, max_turns: int = 4,
                    max_episode_tokens: int | None = None, max_prompt_length: int | None = None,
                    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    stop_token_ids: Sequence[int] = (), engine: str = "loop", sampler: str = "inverse_cdf",
                    engine_options: Mapping[str, Any] | None = None, seed: int | None = None,
                    policy_version: int | None = None, do_sample: bool = True,
                    workers: int = MAX_ENV_WORKERS, lanes: int = 2, reuse_context: bool = True) -> TensorDict:
    """``G = num_samples`` episodes per row of ``rows`` (dict of columns with ``prompt``) against
    environments from ``make_env``, as one rollout ``[B = P·G]`` (the layout is the module's docstring's).

    Args:
        max_new_tokens: tokens of one assistant turn.
        max_turns: assistant turns of an episode.
        max_episode_tokens: tokens of a whole trajectory, the model's and the environment's (``None``:
            the model's context less the prompt).
        max_prompt_length: keep the last tokens of a longer opening.
        seed: the episode seed; each generation call samples with a seed drawn from it (the same seed,
            the same episodes).
        workers: threads stepping environments at once (1: one after another, in this thread).
        lanes: fixed groups of episodes that take turns generating, so that one group's environments
            answer while the next group generates (1: every episode in one batch, environments then
            waited for).
        reuse_context: with ``engine="loop"``, keep each episode's KV cache across turns (False: one
            prefill of the whole context per turn; the same episodes up to float rounding, less memory
            held between turns).
    Returns:
        The rollout on the model's device: ``prompt_ids`` / ``prompt_mask`` ``[B, P]``, ``response_ids``,
        ``response_mask``, ``trajectory_mask``, ``old_logprobs``, ``turn_ids`` ``[B, R]``, ``group_id``,
        ``truncated``, ``turns``, ``env_reward`` ``[B]`` (and ``policy_version``).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns: expected >= 1, got {max_turns}")
    prompts = list(rows["prompt"])
    columns = {k: list(v) for k, v in rows.items()}
    B = len(prompts) * num_samples
    envs = [make_env() for _ in range(B)]
    pad = pad_token_id(tokenizer)
    device = next(model.parameters()).device
    tools, prompt_ids = [], []
    for b, env in enumerate(envs):
        row = {k: v[b // num_samples] for k, v in columns.items()}
        messages = [dict(m) for m in _call(env, "reset", b, row)]
        tools.append(_call(env, "schemas", b) if callable(getattr(env, "schemas", None)) else None)
        ids = tokenizer(render_opening(tokenizer, messages, tools[-1]), add_special_tokens=not _template(tokenizer))[
            "input_ids"]
        prompt_ids.append(ids[-max_prompt_length:] if max_prompt_length else ids)
    if B:  # a template that cannot be continued turn by turn is refused before anything is generated
        render_continuation(tokenizer, [{"role": "tool", "content": "0"}], tools[0])
    context = model_context(model)
    caps = [min(max_episode_tokens or 2 ** 62, (context - len(p)) if context else 2 ** 62) for p in prompt_ids]
    short = [b for b, cap in enumerate(caps) if cap < 1]
    if short:
        b = short[0]
        raise ValueError(f"episode {b} (row {b // num_samples}): its opening has {len(prompt_ids[b])} tokens (the "
                         f"environment's messages and tools rendered by the chat template), which leaves no room in "
                         f"the model's context of {context}; set max_prompt_length <= {context - 1} or shorten the "
                         "opening")
    traj: list[list[int]] = [[] for _ in range(B)]
    own: list[list[bool]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    turn_of: list[list[int]] = [[] for _ in range(B)]
    rewards = [0.0] * B
    turns = [0] * B
    done = [False] * B
    truncated = [False] * B
    turn_seeds = None if seed is None else torch.Generator().manual_seed(seed)
    kept = [ContextCache() for _ in range(B)] if reuse_context and engine == "loop" and carries_context(model) else None

    def generate(group: list[int], turn: int) -> dict[int, str]:
        """One assistant turn of the group's running episodes; their texts for the environments."""
        running = [b for b in group if not done[b]]
        if kept is not None:
            for b in group:
                if done[b]:
                    kept[b] = ContextCache()  # a finished episode's cache is let go
        budgets = {b: min(max_new_tokens, caps[b] - len(traj[b])) for b in running}
        for b in [b for b in running if budgets[b] < 1]:
            done[b], truncated[b] = True, True
        texts = {}
        # one call per turn budget: an episode near its cap gets its own, so no row's context and budget
        # pass the model's context (each call draws its own seed, in the order of the budgets)
        for budget in sorted({budgets[b] for b in running if not done[b]}, reverse=True):
            members = [b for b in running if budgets[b] == budget and not done[b]]
            ids, mask = pad_sequences([prompt_ids[b] + traj[b] for b in members], side="left", pad_value=pad)
            contexts = TensorDict({K.PROMPT_IDS: ids, K.PROMPT_MASK: mask}, batch_size=[len(members)]).to(device)
            out = generate_rollout(model, tokenizer, contexts, max_new_tokens=budget, temperature=temperature,
                                   top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids,
                                   seed=None if turn_seeds is None else draw_seed(turn_seeds), engine=engine,
                                   sampler=sampler, engine_options=engine_options, do_sample=do_sample,
                                   context_caches=None if kept is None else [kept[b] for b in members])
            for j, b in enumerate(members):
                m = out[K.RESPONSE_MASK][j]
                new = out[K.RESPONSE_IDS][j][m].tolist()
                traj[b] += new
                own[b] += [True] * len(new)
                logprobs[b] += out[K.OLD_LOGPROBS][j][m].tolist()
                turn_of[b] += [turn] * len(new)
                turns[b] += 1
                if bool(out[K.TRUNCATED][j]):  # the turn ran out of tokens: no complete answer to give the environment
                    done[b], truncated[b] = True, True
                else:
                    texts[b] = tokenizer.decode(new, skip_special_tokens=True)
        return texts

    def answer(b: int, step: Any, turn: int) -> None:
        """The environment's answer to episode ``b``'s turn ``turn`` joins its trajectory (or ends it)."""
        if not isinstance(step, EnvStep):
            raise TypeError(f"env: {type(envs[b]).__name__}.step returned {type(step).__name__}, expected EnvStep "
                            f"(episode {b})")
        rewards[b] += float(step.reward or 0.0)
        if step.done or turn == max_turns - 1 or not step.messages:
            done[b] = True
            return
        stopped_with = tokenizer.decode(traj[b][-1:]) if traj[b] else ""
        added = tokenizer(render_continuation(tokenizer, step.messages, tools[b], stopped_with),
                          add_special_tokens=False)["input_ids"]
        if len(traj[b]) + len(added) + 1 > caps[b]:  # no room left for the model to answer
            done[b], truncated[b] = True, True
            return
        traj[b] += added
        own[b] += [False] * len(added)
        logprobs[b] += [0.0] * len(added)
        turn_of[b] += [turn] * len(added)

    # Episodes play in `lanes` fixed groups, one after the other: while one group's environments answer
    # (in the thread pool), the next group generates, so tool latency overlaps generation. The groups
    # and the seed draws follow the same order every time: the same seed, the same episodes.
    lanes = max(1, min(lanes, B)) if workers > 1 else 1
    groups = [list(range(i * B // lanes, (i + 1) * B // lanes)) for i in range(lanes)]
    pending: dict[int, concurrent.futures.Future] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(workers, B))) as pool:
        for turn in range(max_turns):
            for group in groups:
                for b in group:
                    if b in pending:
                        answer(b, pending.pop(b).result(), turn - 1)
                for b, text in generate(group, turn).items():
                    pending[b] = pool.submit(_call, envs[b], "step", b, text)
        for b in sorted(pending):
            answer(b, pending[b].result(), max_turns - 1)
    for b, env in enumerate(envs):
        if callable(getattr(env, "final_reward", None)):
            rewards[b] += float(_call(env, "final_reward", b) or 0.0)
    prompt_t, prompt_m = pad_sequences(prompt_ids, side="left", pad_value=pad)
    response, real = pad_sequences([t or [pad] for t in traj], side="right", pad_value=pad)
    real &= torch.tensor([bool(t) for t in traj])[:, None]
    width = response.shape[1]

    def padded(rows_: list[list], dtype: torch.dtype, fill: Any) -> torch.Tensor:
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows_], dtype=dtype)

    rollout = TensorDict({
        K.PROMPT_IDS: prompt_t, K.PROMPT_MASK: prompt_m, K.RESPONSE_IDS: response,
        K.RESPONSE_MASK: padded(own, torch.bool, False), K.TRAJECTORY_MASK: real,
        K.OLD_LOGPROBS: padded(logprobs, torch.float32, 0.0), K.TURN_IDS: padded(turn_of, torch.long, 0),
        K.GROUP_ID: torch.arange(len(prompts)).repeat_interleave(num_samples),
        K.TRUNCATED: torch.tensor(truncated), K.TURNS: torch.tensor(turns),
        K.ENV_REWARD: torch.tensor(rewards, dtype=torch.float32),
    }, batch_size=[B]).to(device)
    if policy_version is not None:
        rollout[K.POLICY_VERSION] = torch.full((B,), policy_version, dtype=torch.long, device=device)
    return rollout

