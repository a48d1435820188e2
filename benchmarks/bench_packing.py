"""Padding-free updates: a GRPO and a DPO optimiser step on rows of very different lengths.

    python benchmarks/run.py --topics packing [--tiny]

A Llama of width 256 with 4 blocks (``build_model``, vocabulary 1,024, nothing downloaded) and rows
whose lengths are drawn uniformly in [64, 1024] tokens, as real data spreads them (``--tiny``: width
32, one block, [8, 64]). Each timed thunk is one ``update`` (forward, loss, backward, clip, AdamW)
over the whole batch:

- ``grpo update``: 16 rollout rows (prompts of 16 to 64 tokens, the rest response), the GRPO loss
  on the policy's log-probs (``loops.recipes.grpo.update_policy``), one minibatch;
- ``dpo update``: 8 preference pairs, each side of 64 to 1,024 tokens after a 32-token prompt,
  reference log-probs given (``loops.recipes.dpo.dpo_step``).

Implementations, the same rows and loss:

- ``rlcore``: ``padding_free`` with ``max_tokens_per_micro_batch`` = 2,048 (about two of the longest rows):
  the micro-batches cut by tokens, each packed into rows as long as its longest sequence
  (``loops.models.pack_rows``);
- ``padded``: micro-batches of 4 rows (DPO: 2 pairs), padded to the batch's width (the layout
  without ``padding_free``);
- ``padded_micro_1``: one row (one pair) per micro-batch, padded.

Tokens per second are the batch's real tokens over the median time, so the ratio of times is the
ratio of throughputs. Goal (issue: the fast path at every length): ``rlcore`` ≥ 1.5× the ``padded``
tokens per second at ≤ 0.7× its peak memory, for both updates.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from tensordict import TensorDict

from rlcore import keys as K
from rlcore.loops.models import build_model
from rlcore.loops.recipes import dpo as dpo_recipe
from rlcore.loops.recipes import grpo as grpo_recipe
from rlcore.loops.state import init_state
from rlcore.loops.update import make_optimizer


@dataclasses.dataclass(frozen=True)
class Sizes:
    width: int
    blocks: int
    shortest: int
    longest: int
    rows: int
    pairs: int
    grpo_budget: int
    dpo_budget: int


def _sizes(tiny: bool) -> Sizes:
    if tiny:
        return Sizes(width=32, blocks=1, shortest=8, longest=64, rows=8, pairs=4, grpo_budget=128, dpo_budget=256)
    return Sizes(width=256, blocks=4, shortest=64, longest=1024, rows=16, pairs=8, grpo_budget=2048, dpo_budget=2048)


VOCAB = 1024


def _model(s: Sizes):
    return build_model("llama", vocab_size=VOCAB, hidden_size=s.width, num_layers=s.blocks, num_heads=4,
                       max_position_embeddings=2 * s.longest + 64, seed=0)


def _lengths(n: int, s: Sizes, seed: int) -> torch.Tensor:
    return torch.randint(s.shortest, s.longest + 1, (n,), generator=torch.Generator().manual_seed(seed))


def _state(model):
    return init_state({"policy": model}, optimizer=make_optimizer(model, lr=1e-5), seed=0)


# --- GRPO ----------------------------------------------------------------------------------------
def _rollout(s: Sizes) -> TensorDict:
    g = torch.Generator().manual_seed(1)
    total = _lengths(s.rows, s, seed=0)
    prompt = torch.randint(s.shortest // 4, s.shortest + 1, (s.rows,), generator=g)
    response = total - prompt
    P, R = int(prompt.max()), int(response.max())
    prompt_mask = torch.arange(P) >= P - prompt[:, None]
    response_mask = torch.arange(R) < response[:, None]
    adv = torch.randn(s.rows, 1, generator=g).expand(s.rows, R).clone()
    return TensorDict({
        K.PROMPT_IDS: torch.randint(3, VOCAB, (s.rows, P), generator=g) * prompt_mask, K.PROMPT_MASK: prompt_mask,
        K.RESPONSE_IDS: torch.randint(3, VOCAB, (s.rows, R), generator=g) * response_mask,
        K.RESPONSE_MASK: response_mask, K.ADVANTAGES: adv,
        K.OLD_LOGPROBS: torch.full((s.rows, R), -7.0),
    }, batch_size=[s.rows])


def _grpo(s: Sizes, **packing):
    config = grpo_recipe.Config(num_samples=2, batch_size=s.rows // 2, kl_coef=0.0, log_entropy=False, run_dir=None,
                                **packing)
    state, batch, loss = _state(_model(s)), _rollout(s), grpo_recipe.grpo_loss_fn(config)
    step = functools.partial(grpo_recipe.update_policy, state, batch, loss, config=config)
    step()  # optimiser state and lazy initialisations exist before the timing

    def thunk():
        return step()[1]["loss"]
    return thunk


# --- DPO -----------------------------------------------------------------------------------------
def _pairs(s: Sizes) -> TensorDict:
    g = torch.Generator().manual_seed(2)
    prompt = 32

    def side(seed: int):
        lengths = _lengths(s.pairs, s, seed) + prompt
        T = int(lengths.max())
        mask = torch.arange(T) < lengths[:, None]
        ids = torch.randint(3, VOCAB, (s.pairs, T), generator=g) * mask
        return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: mask, K.LOSS_MASK: mask & (torch.arange(T) >= prompt),
                           K.REF_LOGPS: -7.0 * lengths.float()}, batch_size=[s.pairs])

    return TensorDict({K.CHOSEN: side(3), K.REJECTED: side(4)}, batch_size=[s.pairs])


def _dpo(s: Sizes, micro: int, **packing):
    config = dpo_recipe.Config(beta=0.1, run_dir=None, **packing)
    state, batch, loss = _state(_model(s)), _pairs(s), dpo_recipe.bind_loss(config)
    step = functools.partial(dpo_recipe.dpo_step, state, batch, loss=loss, micro_batch_size=micro, config=config)
    step()

    def thunk():
        return step()[1]["loss"]
    return thunk


def cases(tiny: bool) -> dict:
    s = _sizes(tiny)
    grpo_micro = max(1, s.rows // 4)
    return {
        "grpo update": {
            "rlcore": functools.partial(_grpo, s, padding_free=True, max_tokens_per_micro_batch=s.grpo_budget),
            "padded": functools.partial(_grpo, s, micro_batch_size=grpo_micro),
            "padded_micro_1": functools.partial(_grpo, s, micro_batch_size=1),
        },
        "dpo update": {
            "rlcore": functools.partial(_dpo, s, s.pairs, padding_free=True, max_tokens_per_micro_batch=s.dpo_budget),
            "padded": functools.partial(_dpo, s, 2),
            "padded_micro_1": functools.partial(_dpo, s, 1),
        },
    }


def goals(tiny: bool) -> dict:
    return {case: [("speedup", "padded", 1.5), ("memory", "padded", 0.7)] for case in ("grpo update", "dpo update")}
