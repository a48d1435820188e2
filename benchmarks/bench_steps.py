"""Whole training steps side by side with TRL: a DPO step, and RLOO / GRPO steps with generation.

Every implementation trains the same tiny Llama (``build_model``: hidden 256, 4 layers, 4 heads,
vocabulary 32,000, built from a config, nothing downloaded) on the same data, through a
word-level tokenizer of the whole vocabulary (``w<i>`` ↔ id ``i``), so TRL's text datasets and
rlcore's id batches are the same tokens (checked when the rows are built).

Cases (full size; ``--tiny`` shrinks every dimension):

- ``dpo fp32`` / ``dpo bf16-autocast``: 8 pairs × 256 tokens (prompt 128, completions 128 ending
  in EOS: 4,096 tokens a step), β = 0.1, sigmoid loss, reference model forward every step.
  ``rlcore``: ``loops.recipes.dpo.dpo_step`` (reference log-probs, then ``update``: ``concatenated_forward``
  on the chunked hidden-state log-prob path, the DPO loss, backward, clip, AdamW); under bf16 the
  same pieces with the reference forward in ``torch.autocast`` and ``update(autocast_dtype=bf16)``.
  ``plain``: full-logits forwards (``log_softmax → gather``), loss, backward, clip, AdamW.
  ``trl``: ``DPOTrainer.training_step`` (TRL's defaults, gradient checkpointing on, its fused LM
  head; ``bf16=False``, and ``bf16=True``, its own autocast, in the bf16 case; forward + backward
  only, no optimiser step) on the batch its collator makes of the same rows; ``trl_no_ckpt`` with
  ``gradient_checkpointing=False``. Tokens/s = 4,096 / median; the bf16 goal compares the bf16
  ``rlcore`` row with the float32 ``trl`` row.
- ``rloo step`` / ``grpo step``: one prompt of 64 tokens × 8 samples × 64 new tokens (EOS is
  ~1/32,000 per token: responses run to the budget), a Python reward function, one optimiser
  epoch. ``rlcore``: the recipe's ``step`` with its default generation, the KV-cached sampling loop
  (``engine="loop"``), then reference log-probs and the reward (``score_rollout``),
  advantages, ``update`` (RLOO: k1 KL β = 0.05 in the reward; GRPO: β = 0, as
  TRL's defaults; the GRPO recipe still computes reference log-probs, for its ``kl_ref`` metric).
  ``rlcore_generate``: the same step with ``engine="hf"`` (HF ``generate``).
  ``plain_generate``: HF ``generate``, full-logits forward + backward, AdamW. ``trl``:
  ``RLOOTrainer`` / ``GRPOTrainer.training_step`` (``use_vllm=False``, defaults but ``bf16``;
  generation, scoring, loss, backward). Samples/s = 8 / median.
- ``collect``: the generation of those steps alone: ``rlcore`` (sampling loop, its default
  inverse-CDF sampler, behaviour log-probs), ``rlcore_gumbel`` / ``rlcore_multinomial`` (the loop
  with Gumbel-max / ``torch.multinomial``), ``rlcore_generate`` (``generate_rollout`` through HF
  ``generate``), ``hf_generate`` (bare ``model.generate``, sampling at τ = 1 without top-k, as the
  loop). Tokens/s = 8 × 64 / median (EOS is rare: every row runs to the budget); the share of a
  step spent generating is ``collect / step``. ``collect qwen2.5-0.5b``: the same at the
  Qwen2.5-0.5B geometry (24 layers of width 896, GQA 14/2, vocabulary 151,936) in bfloat16, the
  realistic benchmark's model, ``rlcore`` against ``hf_generate``.
- ``rlcore_vllm`` rows (collect, RLOO, GRPO), where vLLM is installed (``.venv-vllm``, from
  ``make test-vllm``): the same with ``engine="vllm"``, the engine given the same cores
  (``VLLM_CPU_OMP_THREADS_BIND``, none reserved). Its processes' memory is not in the peak column.

Every builder runs one untimed step (optimiser state and lazy initialisations exist before the
timing and the peak-memory measurement); each thunk ends with the gradients freed, as a training
loop does (TRL's rows: ``model.zero_grad(set_to_none=True)`` after ``training_step``).

Project goals (aimed at, not asserted): DPO ≥ 3.5× TRL's tokens/s in float32 and ≥ 7× (TRL float32)
with bf16 autocast, at ≤ 0.5× TRL's peak memory; RLOO ≥ 1.5× and GRPO ≥ 2× TRL's samples/s, both
≥ 1.3× the plain ``generate``-based step; generation ≥ 2× HF ``generate``'s tokens/s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import tempfile
import warnings

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
    os.environ.setdefault(_var, "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import datasets  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from rlcore import keys as K  # noqa: E402
from rlcore.loops.recipes import dpo as dpo_recipe, grpo as grpo_recipe, rloo as rloo_recipe  # noqa: E402
from rlcore.loops.collect import generate_rollout  # noqa: E402
from rlcore.loops.collate import collate_preference  # noqa: E402
from rlcore.loops.models import build_model, make_reference  # noqa: E402
from rlcore.loops.state import TrainState, init_state  # noqa: E402
from rlcore.loops.update import chain, clip_by_global_norm, make_optimizer, skip_nonfinite, update  # noqa: E402

try:  # imported once here, so that the memory server's forked children inherit it
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
except ImportError:
    DPOConfig = DPOTrainer = GRPOConfig = GRPOTrainer = RLOOConfig = RLOOTrainer = None

PAD, BOS, EOS = 0, 1, 2
QWEN_VOCAB = 151_936  # loops.shapes.FAMILIES["qwen2.5"].vocab_size
LR, BETA_DPO = 1e-6, 0.1


@dataclasses.dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    layers: int
    heads: int
    pairs: int          # DPO pairs per step
    prompt: int         # DPO prompt tokens
    completion: int     # DPO completion tokens (EOS included)
    prompts: int        # online: prompts per step
    samples: int        # online: G samples per prompt
    gen_prompt: int     # online: prompt tokens
    new_tokens: int     # online: response budget


FULL = Sizes(32000, 256, 4, 4, pairs=8, prompt=128, completion=128, prompts=1, samples=8, gen_prompt=64,
             new_tokens=64)
TINY = Sizes(256, 16, 1, 2, pairs=2, prompt=4, completion=4, prompts=1, samples=2, gen_prompt=4, new_tokens=4)


def _sizes(tiny: bool) -> Sizes:
    return TINY if tiny else FULL


def _require(peer, name: str):
    if peer is None:
        raise ImportError(name=name)
    return peer


@contextlib.contextmanager
def _quiet():
    """Silence the peers' construction (warnings, progress bars), restoring the settings after."""
    hf_bars, ds_bars = hf_logging.is_progress_bar_enabled(), datasets.utils.logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if hf_bars:
            hf_logging.enable_progress_bar()
        if ds_bars:
            datasets.enable_progress_bars()


# --- tokenizer, model, data -------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """Whitespace-separated words ``w<i>`` ↔ ids ``i`` (``4 ≤ i < vocab``) plus ``<pad> <s> </s> <unk>``."""
    words = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": 3, **{f"w{i}": i for i in range(4, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def to_text(ids: list[int]) -> str:
    return " ".join("</s>" if i == EOS else f"w{i}" for i in ids)


def _model(s: Sizes):
    return build_model("llama", vocab_size=s.vocab, tokenizer=word_tokenizer(s.vocab), hidden_size=s.hidden,
                       num_layers=s.layers, num_heads=s.heads, max_position_embeddings=256, seed=0)


def _words(n: int, g: torch.Generator, vocab: int) -> list[int]:
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def preference_rows(s: Sizes) -> list[dict]:
    """``pairs`` rows of ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``; completions end in EOS."""
    g = torch.Generator().manual_seed(0)
    return [{"prompt_ids": _words(s.prompt, g, s.vocab),
             "chosen_ids": _words(s.completion - 1, g, s.vocab) + [EOS],
             "rejected_ids": _words(s.completion - 1, g, s.vocab) + [EOS]} for _ in range(s.pairs)]


def online_prompts(s: Sizes) -> list[str]:
    g = torch.Generator().manual_seed(1)
    return [to_text(_words(s.gen_prompt, g, s.vocab)) for _ in range(s.prompts)]


def reward(prompts, completions, **_) -> list[float]:
    """A Python reward: the fraction of completion words with an even id."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1) for c in completions]


def _stateful(step, state):
    """A thunk running ``state, out = step(state)`` and keeping the new state for the next call."""
    holder = [state]

    def thunk():
        holder[0], out = step(holder[0])
        return out
    thunk()  # warm-up: optimiser state, lazy initialisations
    return thunk


# --- DPO ----------------------------------------------------------------------------------------
def _dpo_rlcore(s: Sizes, autocast: bool):
    model = _model(s)
    state = init_state({"policy": model, "ref": make_reference(model)}, optimizer=make_optimizer(model, lr=LR))
    batch = collate_preference(preference_rows(s), pad_id=PAD)
    loss = dpo_recipe.bind_loss(dpo_recipe.Config(loss_type="sigmoid", beta=BETA_DPO))
    if not autocast:
        return _stateful(lambda st: dpo_recipe.dpo_step(st, batch, loss=loss), state)
    bf16 = torch.bfloat16
    loss_fn = functools.partial(dpo_recipe.preference_loss_fn, loss=loss)

    def step(st: TrainState):  # dpo_step's pieces, the reference forward under autocast as well
        with torch.autocast("cpu", dtype=bf16):
            scored = dpo_recipe.with_reference(st, batch)
        return update(st, scored, loss_fn, autocast_dtype=bf16,
                      transform=chain(skip_nonfinite(), clip_by_global_norm(1.0)))
    return _stateful(step, state)


def _plain_update(model, opt, loss: torch.Tensor) -> torch.Tensor:
    """The plain rows' optimiser step: backward, clip at 1, AdamW, gradients freed."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _full_logprobs(model, ids, attention, scored):
    """Per-sequence log-probs through the full ``[B, T, V]`` logits: ``Σ_t m_t log_softmax(z_{t-1})[x_t]``."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.where(scored, lp, 0.0).sum(-1)


def _dpo_plain(s: Sizes, autocast: bool):
    model = _model(s)
    ref, opt = make_reference(model), make_optimizer(model, lr=LR)
    batch = collate_preference(preference_rows(s), pad_id=PAD)
    ids, attention, loss_mask = (torch.cat([batch[side, k] for side in (K.CHOSEN, K.REJECTED)])
                                 for k in (K.INPUT_IDS, K.ATTENTION_MASK, K.LOSS_MASK))
    scored, attention, n = (loss_mask & attention)[:, 1:], attention.long(), s.pairs

    def step(_):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                r = _full_logprobs(ref, ids, attention, scored)
            p = _full_logprobs(model, ids, attention, scored)
            margin = (p[:n] - r[:n]) - (p[n:] - r[n:])
            loss = -F.logsigmoid(BETA_DPO * margin).mean()
        return None, _plain_update(model, opt, loss)
    return _stateful(step, None)


def _dpo_trl(s: Sizes, bf16: bool, checkpointing: bool = True):
    _require(DPOTrainer, "trl")
    rows = preference_rows(s)
    data = Dataset.from_list([{"prompt": to_text(r["prompt_ids"]) + " ", "chosen": to_text(r["chosen_ids"]),
                               "rejected": to_text(r["rejected_ids"])} for r in rows])
    model = _model(s)
    with tempfile.TemporaryDirectory() as out, _quiet():
        args = DPOConfig(output_dir=out, report_to=[], bf16=bf16, use_cpu=True, per_device_train_batch_size=s.pairs,
                         gradient_checkpointing=checkpointing, beta=BETA_DPO, learning_rate=LR, save_strategy="no",
                         logging_steps=10**9, disable_tqdm=True, dataloader_num_workers=0)
        trainer = DPOTrainer(model=model, ref_model=make_reference(model), args=args, train_dataset=data,
                             processing_class=word_tokenizer(s.vocab))
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's own loop before training_step
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    ours = collate_preference(rows, pad_id=PAD)
    expected = torch.cat([ours[side, K.INPUT_IDS] for side in (K.CHOSEN, K.REJECTED)])
    if not torch.equal(inputs["input_ids"], expected):
        raise AssertionError("bench_steps: TRL's DPO batch is not the rows rlcore trains on")

    def step(_):
        loss = trainer.training_step(trainer.model, inputs, None)
        trainer.model.zero_grad(set_to_none=True)
        return None, loss
    with _quiet():
        return _stateful(step, None)


# --- online steps (RLOO / GRPO) --------------------------------------------------------------------
def _online_config(s: Sizes, kind: str):
    recipe = rloo_recipe if kind == "rloo" else grpo_recipe
    return recipe.Config(num_samples=s.samples, max_new_tokens=s.new_tokens, batch_size=s.prompts, lr=LR,
                         steps=10**6, run_dir=None)


def _online_state(s: Sizes, config) -> TrainState:
    model = _model(s)
    return init_state({"policy": model, "ref": make_reference(model)}, optimizer=make_optimizer(model, lr=config.lr),
                      seed=config.seed)


def _online_rlcore(s: Sizes, kind: str, engine: str):
    """The recipe's own ``step`` with the ``engine``: ``"loop"`` (the recipes' default), ``"hf"`` (HF
    generate) or ``"vllm"``."""
    _engine_cores(engine)
    config, tok, prompts = _online_config(s, kind), word_tokenizer(s.vocab), online_prompts(s)
    recipe = rloo_recipe if kind == "rloo" else grpo_recipe
    step = functools.partial(recipe.step, rows={"prompt": prompts}, config=dataclasses.replace(config, engine=engine),
                             tokenizer=tok, reward_fn=reward)
    return _stateful(step, _online_state(s, config))


def _online_plain(s: Sizes, kind: str):
    """HF ``generate``, the reward, group advantages, a full-logits forward + backward, AdamW."""
    model, tok, G = _model(s), word_tokenizer(s.vocab), s.samples
    ref, opt = make_reference(model), make_optimizer(model, lr=LR)
    enc = tok(online_prompts(s), return_tensors="pt")
    P = enc["input_ids"].shape[1]

    def step(_):
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=True, top_k=0, max_new_tokens=s.new_tokens, num_return_sequences=G,
                                 pad_token_id=PAD, eos_token_id=EOS)
        is_eos = (ids[:, P:] == EOS).long()
        mask = torch.cat([torch.ones_like(ids[:, :P], dtype=torch.bool), (is_eos.cumsum(-1) - is_eos) == 0], -1)
        scores = torch.tensor(reward(None, tok.batch_decode(ids[:, P:], skip_special_tokens=True)))
        lp = _token_logprobs(model, ids, mask)[:, P - 1:]
        m = mask[:, P:]
        if kind == "rloo":  # k1 KL (β = 0.05) in the score, leave-one-out baseline, sequence log-prob
            with torch.no_grad():
                kl = torch.where(m, lp.detach() - _token_logprobs(ref, ids, mask)[:, P - 1:], 0.0).sum(-1)
            r = (scores - 0.05 * kl).view(-1, G)
            adv = (r - (r.sum(-1, keepdim=True) - r) / (G - 1)).reshape(-1)
            loss = -(adv * torch.where(m, lp, 0.0).sum(-1)).mean()
        else:  # group-normalised advantages, token mean
            r = scores.view(-1, G)
            adv = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)).reshape(-1)
            loss = -torch.where(m, adv[:, None] * lp, 0.0).sum() / m.sum()
        return None, _plain_update(model, opt, loss)
    return _stateful(step, None)


def _token_logprobs(model, ids, mask):
    """``log_softmax(z_t)[x_{t+1}]`` ``[B, T-1]`` through the full logits."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits[:, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def _online_trl(s: Sizes, kind: str):
    Config, Trainer = (RLOOConfig, RLOOTrainer) if kind == "rloo" else (GRPOConfig, GRPOTrainer)
    _require(Trainer, "trl")
    prompts = online_prompts(s)
    with tempfile.TemporaryDirectory() as out, _quiet():
        _model(s).save_pretrained(f"{out}/policy")  # RLOO builds its reference from the policy's path
        model = AutoModelForCausalLM.from_pretrained(f"{out}/policy")
        args = Config(output_dir=f"{out}/run", report_to=[], bf16=False, use_cpu=True, use_vllm=False,
                      per_device_train_batch_size=s.prompts * s.samples, num_generations=s.samples,
                      max_completion_length=s.new_tokens, learning_rate=LR, save_strategy="no", logging_steps=10**9,
                      disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
                          processing_class=word_tokenizer(s.vocab))
    trainer.current_gradient_accumulation_steps = 1
    inputs = [{"prompt": p} for p in prompts for _ in range(s.samples)]  # what its repeat sampler yields

    def step(_):
        loss = trainer.training_step(trainer.model, inputs, None)
        trainer.model.zero_grad(set_to_none=True)
        return None, loss
    with _quiet():
        return _stateful(step, None)


def _engine_cores(engine: str) -> None:
    """For ``engine="vllm"``: vLLM installed, its CPU workers bound to this process's thread count."""
    if engine == "vllm":
        _require(importlib.util.find_spec("vllm"), "vllm")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{torch.get_num_threads() - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def _qwen(size: str, s: Sizes):
    """A Qwen2.5 geometry of ``loops.shapes`` (``0.5b``; ``tiny`` with ``--tiny``) in bfloat16, random."""
    from rlcore.loops.shapes import build_family_model

    return build_family_model("qwen2.5", size, tokenizer=word_tokenizer(s.vocab), dtype=torch.bfloat16).eval()


def _collect(s: Sizes, engine: str, sampler: str = "inverse_cdf", build=_model):
    _engine_cores(engine)
    model, tok, prompts = build(s), word_tokenizer(s.vocab), online_prompts(s)
    g = torch.Generator().manual_seed(0)
    kw = dict(max_new_tokens=s.new_tokens, num_samples=s.samples, generator=g, engine=engine, sampler=sampler)
    generate_rollout(model, tok, prompts, **kw)
    return lambda: generate_rollout(model, tok, prompts, **kw)


def _collect_hf(s: Sizes, build=_model):
    model, tok = build(s), word_tokenizer(s.vocab)
    enc = tok(online_prompts(s), return_tensors="pt")

    def thunk():
        with torch.no_grad():
            return model.generate(**enc, do_sample=True, top_k=0, max_new_tokens=s.new_tokens,
                                  num_return_sequences=s.samples, pad_token_id=PAD, eos_token_id=EOS)
    thunk()
    return thunk


# --- protocol ---------------------------------------------------------------------------------------
def _names(tiny: bool) -> dict[str, str]:
    s = _sizes(tiny)
    dpo = f"{s.pairs}x{s.prompt + s.completion} tok"
    gen = f"{s.prompts}x{s.samples} samples x{s.new_tokens} new"
    return {"dpo": f"dpo fp32 {dpo}", "dpo_bf16": f"dpo bf16-autocast {dpo}", "rloo": f"rloo step {gen}",
            "grpo": f"grpo step {gen}", "collect": f"collect {gen}",
            "collect_qwen": f"collect qwen2.5-{'tiny' if tiny else '0.5b'} bf16 {gen}"}


def cases(tiny: bool) -> dict[str, dict]:
    s, n = _sizes(tiny), _names(tiny)
    b = functools.partial
    out = {
        n["dpo"]: {"rlcore": b(_dpo_rlcore, s, False), "plain": b(_dpo_plain, s, False),
                   "trl": b(_dpo_trl, s, False), "trl_no_ckpt": b(_dpo_trl, s, False, False)},
        n["dpo_bf16"]: {"rlcore": b(_dpo_rlcore, s, True), "plain": b(_dpo_plain, s, True),
                        "trl": b(_dpo_trl, s, True)},
    }
    for kind in ("rloo", "grpo"):
        out[n[kind]] = {"rlcore": b(_online_rlcore, s, kind, "loop"),
                        "rlcore_generate": b(_online_rlcore, s, kind, "hf"),
                        "rlcore_vllm": b(_online_rlcore, s, kind, "vllm"),
                        "plain_generate": b(_online_plain, s, kind), "trl": b(_online_trl, s, kind)}
    out[n["collect"]] = {"rlcore": b(_collect, s, "loop"), "rlcore_gumbel": b(_collect, s, "loop", "gumbel"),
                         "rlcore_multinomial": b(_collect, s, "loop", "multinomial"),
                         "rlcore_generate": b(_collect, s, "hf"), "hf_generate": b(_collect_hf, s),
                         "rlcore_vllm": b(_collect, s, "vllm")}
    q = dataclasses.replace(s, vocab=QWEN_VOCAB)
    qwen = b(_qwen, "tiny" if tiny else "0.5b")
    out[n["collect_qwen"]] = {"rlcore": b(_collect, q, "loop", build=qwen), "hf_generate": b(_collect_hf, q, qwen)}
    return out


def goals(tiny: bool) -> dict[str, list[tuple[str, str, float]]]:
    """DPO ≥ 3.5× TRL's tokens/s in float32 and ≥ 7× TRL's float32 with bf16 autocast, at ≤ 0.5×
    TRL's peak; RLOO ≥ 1.5× and GRPO ≥ 2× TRL's samples/s, both ≥ 1.3× the plain ``generate`` step;
    generation ≥ 2× HF ``generate``'s tokens/s (the same tokens: time ratio = tokens/s ratio)."""
    n = _names(tiny)
    plain = ("speedup", "plain_generate", 1.3)
    return {n["dpo"]: [("speedup", "trl", 3.5), ("memory", "trl", 0.5)],
            n["dpo_bf16"]: [("speedup", f"{n['dpo']}/trl", 7.0), ("memory", "trl", 0.5)],
            n["rloo"]: [("speedup", "trl", 1.5), plain], n["grpo"]: [("speedup", "trl", 2.0), plain],
            n["collect"]: [("speedup", "hf_generate", 2.0)], n["collect_qwen"]: [("speedup", "hf_generate", 2.0)]}


def floors(tiny: bool) -> dict[str, dict]:
    """DPO: the matmul flops of the policy's forward + backward (3×) and the reference's forward
    (1×): per token ``2·L·16H²`` (attention + SwiGLU projections) and ``2·L·T·H`` (causal scores),
    plus ``2·V·H`` of the LM head on the completion tokens only (the rest is never scored).
    The online steps are decode-latency bound: no floor."""
    s, n = _sizes(tiny), _names(tiny)
    T, tokens = s.prompt + s.completion, 2 * s.pairs * (s.prompt + s.completion)
    trunk = 2 * s.layers * 16 * s.hidden**2 + 2 * s.layers * T * s.hidden
    head = 2 * s.vocab * s.hidden * 2 * s.pairs * s.completion
    flops = 4 * (tokens * trunk + head)
    return {n["dpo"]: {"flops": flops}, n["dpo_bf16"]: {"flops": flops}}
