"""Fuzz entries for the public functions of ``rlcore.algorithms``."""

from __future__ import annotations

import importlib
import inspect

import torch
from tensordict import TensorDict

from rlcore import keys as K

# by module path: rlcore.algorithms re-exports functions named like some modules (dpo, ddpo, reward)
ddpo, dpo, dpo_variants, online, policy_gradient, ppo, preference, ratios, reft, reward, sft = (
    importlib.import_module(f"rlcore.algorithms.{m}")
    for m in ("ddpo", "dpo", "dpo_variants", "online", "policy_gradient", "ppo", "preference", "ratios", "reft",
              "reward", "sft"))
from tests.robustness.entries_rlcore import lead, rows
from tests.robustness.fuzz import F32, F64, Case, Draw, Entry

_ANY = ("grow", "drop", "add")
SAFE_REALS = ("unit", "zero", "tiny", "ties")  # |x| < ~10: exp(x) stays finite in every dtype
NAN = float("nan")
# hyper-parameters out of range, each refused with a ValueError naming it (fuzz.check_bad_inputs)
BAD_BETA = {"beta": (0.0, -0.1, NAN)}
DENORMAL = 1e-310  # positive and finite, but 1/x overflows: refused where a formula divides by it (MIN_DIVISOR)
BAD_CLIP = {"clip_eps_low": (-0.1, NAN), "clip_eps_high": (-0.2, NAN)}


# --- sft ---------------------------------------------------------------------------------------
def sft_token_nll(d: Draw, dtype):
    shape = rows(d)
    kw = dict(logprobs=d.logprobs(shape, dtype), loss_mask=d.mask(shape))
    return Case(sft.sft_token_nll, kw, grad=("logprobs",), masks={"loss_mask": ("logprobs",)})


def sft_loss(d: Draw, dtype):
    B, T = d.size(), d.time()
    batch = TensorDict({K.LOGPROBS: d.logprobs((B, T), dtype), K.LOSS_MASK: d.mask((B, T))}, [B])
    kw = dict(batch=batch, agg=d.choice(["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_sum_norm"],
                                        "agg"),
              num_tokens=d.choice([None, 5], "num_tokens"), num_seqs=d.choice([None, 2], "num_seqs"))
    return Case(sft.sft_loss, kw, grad=(("batch", K.LOGPROBS),),
                masks={("batch", K.LOSS_MASK): (("batch", K.LOGPROBS),)}, overflow=("perplexity",))


def _segments(d: Draw, shape) -> torch.Tensor:
    """Packed segment ids ``[..., T]``: runs of equal ids, ``-1`` on padding."""
    ids = d.ints(shape, -1, 3)
    return ids.sort(-1).values if d.flag("sorted") else ids


def shift(d: Draw, dtype):
    shape = rows(d)
    kw = dict(input_ids=d.ints(shape, 0, 50), mask=d.mask(shape),
              attention_mask=d.mask(shape) if d.flag("attention") else None,
              segment_ids=_segments(d, shape) if d.flag("segments") else None)
    return Case(sft.shift_for_causal_lm, kw)


def packed_positions(d: Draw, dtype):
    shape = rows(d)
    kw = dict(segment_ids=_segments(d, shape), attention_mask=d.mask(shape) if d.flag("attention") else None)
    return Case(sft.packed_position_ids, kw)


def segment_mask(d: Draw, dtype):
    shape = (d.size(), d.time())
    kw = dict(segment_ids=_segments(d, shape), attention_mask=d.mask(shape) if d.flag("attention") else None)
    return Case(sft.segment_causal_mask, kw)


# --- reward ------------------------------------------------------------------------------------
def bradley_terry(d: Draw, dtype):
    B = d.size()
    margin = d.choice([None, 0.5, "tensor"], "margin")
    kw = dict(chosen_rewards=d.reals((B,), dtype), rejected_rewards=d.reals((B,), dtype),
              margin=d.reals((B,), dtype) if margin == "tensor" else margin)
    return Case(reward.bradley_terry_loss, kw, grad=("chosen_rewards", "rejected_rewards"))


def reward_loss(d: Draw, dtype):
    B = d.size(lo=1)
    batch = TensorDict({K.CHOSEN: {K.REWARD: d.reals((B,), dtype)}, K.REJECTED: {K.REWARD: d.reals((B,), dtype)},
                        "margin": d.reals((B,), dtype)}, [B])
    kw = dict(batch=batch, margin_key=d.choice([None, "margin"], "margin_key"),
              center_rewards_coefficient=d.choice([None, 0.01], "center"))
    return Case(reward.reward_loss, kw, grad=(("batch", K.CHOSEN, K.REWARD), ("batch", K.REJECTED, K.REWARD)))


# --- online ------------------------------------------------------------------------------------
def best_worst(d: Draw, dtype):
    if d.flag("grouped"):
        return Case(online.best_worst_pairs, dict(scores=d.reals((d.size(), d.size(lo=1)), dtype)))
    B = d.size()
    num_groups = d.choice([None, 1, 3], "num_groups")
    kw = dict(scores=d.reals((B,), dtype), group_id=d.ints((B,), 0, num_groups or max(B, 1)), num_groups=num_groups)
    return Case(online.best_worst_pairs, kw)


def scored_rollout(d: Draw, dtype, B: int) -> TensorDict:
    P, R = d.size(lo=1), d.time()
    fields = {K.PROMPT_IDS: d.ints((B, P), 0, 50), K.PROMPT_MASK: d.mask((B, P), "left"),
              K.RESPONSE_IDS: d.ints((B, R), 0, 50), K.RESPONSE_MASK: d.mask((B, R)),
              K.SCORE: d.reals((B,), dtype), K.GROUP_ID: d.ints((B,), 0, max(B, 1))}
    if d.flag("logprobs"):
        fields[K.LOGPROBS] = d.logprobs((B, R), dtype)
        fields[K.REF_LOGPROBS] = d.logprobs((B, R), dtype)
    return TensorDict(fields, [B])


def online_batch(d: Draw, dtype):
    batch = scored_rollout(d, dtype, d.size())
    has_lp = K.LOGPROBS in batch.keys()
    guarded = (("rollout", K.LOGPROBS), ("rollout", K.REF_LOGPROBS)) if has_lp else ()
    return Case(online.online_preference_batch, dict(rollout=batch, num_groups=None),
                grad=(("rollout", K.LOGPROBS),) if has_lp else (),
                masks={("rollout", K.RESPONSE_MASK): guarded} if has_lp else {},
                ok={("rollout", K.PROMPT_IDS): ("grow",), ("rollout", K.RESPONSE_IDS): ("grow",)})


# --- dpo ---------------------------------------------------------------------------------------
_REVERSE_KL_ONLY = {"nca_pair", "bco_pair", "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down"}
_SMOOTHING = {"robust": (0.0, 0.1, 0.49), "exo_pair": (1e-3, 0.5, 0.999)}


def _dpo_hyper(d: Draw, loss_type: str) -> dict:
    divergences = ["reverse_kl"] if loss_type in _REVERSE_KL_ONLY else sorted(dpo_variants.F_DIVERGENCES)
    return dict(beta=d.choice([0.1, 0.5, 1.0, 5.0], "beta"),
                label_smoothing=d.choice(_SMOOTHING.get(loss_type, (0.0, 0.1, 0.5)), "eps"),
                divergence=d.choice(divergences, "divergence"), alpha=d.choice([0.5, 1.0, 1.5], "alpha"),
                discopop_tau=0.05)


def _squared(kw: dict, loss_type: str) -> dict:
    """ipo / ipo_sum square the score: a large f-divergence score overflows to +inf, loss and gradient
    (documented in rlcore.algorithms.dpo)."""
    squared = loss_type in ("ipo", "ipo_sum") and kw["divergence"] != "reverse_kl"
    return dict(overflow=("out",), grad_overflow=True) if squared else {}


def _bad_dpo_hyper(loss_type: str) -> dict:
    bad = {"beta": (*BAD_BETA["beta"], DENORMAL)}  # the DPO family divides by β (IPO, SPPO): β >= 1e-12
    if loss_type in ("sigmoid", "aot", "aot_unpaired"):  # cDPO's smoothing: past 0.5 the labels flip
        bad["label_smoothing"] = (0.6, -0.1, NAN)
    if loss_type == "discopop":
        bad["discopop_tau"] = (0.0, NAN, DENORMAL)
    return bad


def _four_logps(d: Draw, dtype, B: int) -> dict:
    return dict(chosen_logps=d.logprobs((B,), dtype), rejected_logps=d.logprobs((B,), dtype),
                ref_chosen_logps=d.logprobs((B,), dtype), ref_rejected_logps=d.logprobs((B,), dtype))


def dpo_kernel(loss_type: str | None):
    def make(d: Draw, dtype):
        name = loss_type or d.choice(sorted(dpo_variants.DPO_LOSSES), "loss_type")
        B = d.size()
        kw = _four_logps(d, dtype, B) | _dpo_hyper(d, name) | dict(
            chosen_lengths=d.ints((B,), 0, 20), rejected_lengths=d.ints((B,), 0, 20))
        return Case(dpo_variants.DPO_LOSSES[name], kw, grad=("chosen_logps", "rejected_logps"),
                    bad_hyper=_bad_dpo_hyper(name), **_squared(kw, name))
    return Entry(make)


def dpo_loss(d: Draw, dtype):
    name = d.choice(sorted(dpo_variants.DPO_LOSSES), "loss_type")
    B = d.size()
    kw = _four_logps(d, dtype, B) | _dpo_hyper(d, name) | dict(
        loss_type=name, reference_free=d.flag("reference_free"),
        chosen_lengths=d.ints((B,), 0, 20), rejected_lengths=d.ints((B,), 0, 20))
    if kw["reference_free"] and d.flag("none_refs"):
        kw["ref_chosen_logps"] = kw["ref_rejected_logps"] = None
    return Case(dpo.dpo_loss, kw, grad=("chosen_logps", "rejected_logps"), bad_hyper=_bad_dpo_hyper(name),
                **_squared(kw, name))


def f_divergence(d: Draw, dtype):
    f = dpo_variants.F_DIVERGENCES[d.choice(sorted(dpo_variants.F_DIVERGENCES), "divergence")]
    kw = dict(logratio=d.logprobs((d.size(),), dtype) - d.logprobs((1,), dtype), alpha=d.choice([0.5, 1.0, 1.5], "a"))
    return Case(f, kw, grad=("logratio",))


def smoothed_sigmoid(d: Draw, dtype):
    kw = dict(logits=d.reals(rows(d), dtype), label_smoothing=d.choice([0.0, 0.1, 0.5], "eps"))
    return Case(dpo_variants.smoothed_sigmoid_loss, kw, grad=("logits",),
                bad_hyper={"label_smoothing": (0.6, -0.1, NAN)})


def chosen_nll(d: Draw, dtype):
    B = d.size()
    kw = dict(chosen_logps=d.logprobs((B,), dtype), chosen_lengths=d.ints((B,), 0, 20))
    return Case(dpo.chosen_nll, kw, grad=("chosen_logps",))


def preference_metrics(d: Draw, dtype):
    B = d.size(lo=1)
    kw = dict(chosen_rewards=d.reals((B,), dtype), rejected_rewards=d.reals((B,), dtype),
              chosen_logps=d.logprobs((B,), dtype), rejected_logps=d.logprobs((B,), dtype))
    return Case(dpo.preference_metrics, kw)


def preference_batch(d: Draw, dtype, B: int | None = None) -> TensorDict:
    B = d.size(lo=1) if B is None else B
    T = d.time()

    def side():
        attn = d.mask((B, T), "right")
        return {K.INPUT_IDS: d.ints((B, T), 0, 50), K.ATTENTION_MASK: attn, K.LOSS_MASK: attn & d.mask((B, T)),
                K.LOGPS: d.logprobs((B,), dtype), K.REF_LOGPS: d.logprobs((B,), dtype)}

    return TensorDict({K.CHOSEN: side(), K.REJECTED: side()}, [B])


def completion_lengths(d: Draw, dtype):
    return Case(dpo.completion_lengths, dict(batch=preference_batch(d, dtype), side=d.choice([K.CHOSEN, K.REJECTED])),
                ok=_FREE_SEQUENCE_KEYS)


_PREF_GRAD = (("batch", K.CHOSEN, K.LOGPS), ("batch", K.REJECTED, K.LOGPS))


def dpo_batch(d: Draw, dtype):
    name = d.choice(sorted(dpo_variants.DPO_LOSSES), "loss_type")
    kw = dict(batch=preference_batch(d, dtype), loss_type=name, reference_free=d.flag("reference_free"),
              rpo_alpha=d.choice([None, 1.0], "rpo_alpha")) | _dpo_hyper(d, name)
    return Case(dpo.dpo, kw, grad=_PREF_GRAD, ok=_FREE_SEQUENCE_KEYS, **_squared(kw, name),
                bad_hyper=_bad_dpo_hyper(name) | {"rpo_alpha": (-1.0, NAN)})


# Input ids and attention masks are carried, not read, by the losses on summed log-probs; the width
# T of the loss mask is free (only its row sums, the completion lengths, are read).
_FREE_SEQUENCE_KEYS = {("batch", side, k): _ANY + ("float_mask",) for side in (K.CHOSEN, K.REJECTED)
                       for k in (K.INPUT_IDS, K.ATTENTION_MASK)} | {
                       ("batch", side, K.LOSS_MASK): ("grow",) for side in (K.CHOSEN, K.REJECTED)}


# --- preference --------------------------------------------------------------------------------
_NO_ZERO = ("typical", "near_zero", "very_negative")


def log1mexp(d: Draw, dtype):
    return Case(preference.log1mexp, dict(x=d.logprobs(rows(d), dtype, _NO_ZERO)), grad=("x",))


def odds_ratio(d: Draw, dtype):
    B = d.size()
    kw = dict(chosen_logps_avg=d.logprobs((B,), dtype), rejected_logps_avg=d.logprobs((B,), dtype),
              beta=d.choice([0.1, 1.0], "beta"))
    return Case(preference.odds_ratio_loss, kw, grad=("chosen_logps_avg", "rejected_logps_avg"),
                bad_hyper={"beta": (-0.1, NAN)})


def orpo(d: Draw, dtype):
    return Case(preference.orpo, dict(batch=preference_batch(d, dtype), beta=d.choice([0.1, 1.0], "beta")),
                grad=_PREF_GRAD, ok=_FREE_SEQUENCE_KEYS, bad_hyper={"beta": (-0.1, NAN)})


_ALPHAS = (0.0, 0.25, 1.0)


def alphapo(d: Draw, dtype):
    return Case(preference.alphapo_reward, dict(logps=d.logprobs(rows(d), dtype), alpha=d.choice(_ALPHAS, "alpha")),
                grad=("logps",))


def simpo_loss(d: Draw, dtype):
    B = d.size()
    kw = dict(chosen_logps_avg=d.logprobs((B,), dtype), rejected_logps_avg=d.logprobs((B,), dtype),
              beta=d.choice([2.0, 0.1], "beta"), gamma=d.choice([1.0, 0.0], "gamma"),
              label_smoothing=d.choice([0.0, 0.1], "eps"), alpha=d.choice(_ALPHAS, "alpha"))
    return Case(preference.simpo_loss, kw, grad=("chosen_logps_avg", "rejected_logps_avg"),
                bad_hyper=BAD_BETA | {"gamma": (NAN,), "label_smoothing": (0.6, NAN), "alpha": (NAN,)})


def cpo_loss(d: Draw, dtype):
    B = d.size()
    kw = dict(chosen_logps=d.logprobs((B,), dtype), rejected_logps=d.logprobs((B,), dtype),
              beta=d.choice([0.1, 1.0], "beta"), label_smoothing=d.choice([0.0, 0.1], "eps"),
              alpha=d.choice(_ALPHAS, "alpha"))
    return Case(preference.cpo_loss, kw, grad=("chosen_logps", "rejected_logps"),
                bad_hyper=BAD_BETA | {"label_smoothing": (0.6, NAN)})


def simpo(d: Draw, dtype):
    kw = dict(batch=preference_batch(d, dtype), beta=d.choice([2.0, 0.1], "beta"), gamma=d.choice([1.0, 0.0], "g"),
              label_smoothing=d.choice([0.0, 0.1], "eps"), alpha=d.choice(_ALPHAS, "alpha"),
              cpo_alpha=d.choice([0.0, 1.0], "cpo_alpha"))
    return Case(preference.simpo, kw, grad=_PREF_GRAD, ok=_FREE_SEQUENCE_KEYS,
                bad_hyper=BAD_BETA | {"cpo_alpha": (-1.0, NAN)})


def cpo(d: Draw, dtype):
    kw = dict(batch=preference_batch(d, dtype), beta=d.choice([0.1, 1.0], "beta"),
              label_smoothing=d.choice([0.0, 0.1], "eps"), alpha=d.choice(_ALPHAS, "alpha"),
              cpo_alpha=d.choice([0.0, 1.0], "cpo_alpha"))
    return Case(preference.cpo, kw, grad=_PREF_GRAD, ok=_FREE_SEQUENCE_KEYS,
                bad_hyper=BAD_BETA | {"cpo_alpha": (-1.0, NAN)})


def _kto_inputs(d: Draw, dtype, B: int) -> dict:
    Bk = d.choice([B, 1, 3], "B_kl") if B else 1
    return dict(logps=d.logprobs((B,), dtype), ref_logps=d.logprobs((B,), dtype),
                kl_logps=d.logprobs((Bk,), dtype), ref_kl_logps=d.logprobs((Bk,), dtype), labels=d.mask((B,)))


def kto_loss(d: Draw, dtype):
    kw = _kto_inputs(d, dtype, d.size()) | dict(beta=d.choice([0.1, 1.0], "beta"),
                                                desirable_weight=d.choice([1.0, 1.33], "wd"),
                                                undesirable_weight=d.choice([1.0, 0.5], "wu"))
    return Case(preference.kto_loss, kw, grad=("logps",), ok={"kl_logps": ("grow", "drop"), "ref_kl_logps": ("grow",)},
                bad_hyper=BAD_BETA | {"desirable_weight": (0.0, NAN), "undesirable_weight": (-1.0,)})


def unpaired_batch(d: Draw, dtype) -> TensorDict:
    B = d.size(lo=1)
    fields = _kto_inputs(d, dtype, B)
    fields["kl_logps"], fields["ref_kl_logps"] = d.logprobs((B,), dtype), d.logprobs((B,), dtype)
    return TensorDict({K.LOGPS: fields["logps"], K.REF_LOGPS: fields["ref_logps"], K.KL_LOGPS: fields["kl_logps"],
                       K.REF_KL_LOGPS: fields["ref_kl_logps"], K.LABELS: fields["labels"]}, [B])


def kto(d: Draw, dtype):
    kw = dict(batch=unpaired_batch(d, dtype), beta=d.choice([0.1, 1.0], "beta"),
              desirable_weight=d.choice([1.0, 1.33], "wd"), undesirable_weight=d.choice([1.0, 0.5], "wu"))
    return Case(preference.kto, kw, grad=(("batch", K.LOGPS),), bad_hyper=BAD_BETA)


def preference_losses(d: Draw, dtype):
    name = d.choice(sorted(preference.PREFERENCE_LOSSES), "loss")
    fn = preference.PREFERENCE_LOSSES[name]
    if name == "kto":
        return Case(fn, dict(batch=unpaired_batch(d, dtype)), grad=(("batch", K.LOGPS),))
    return Case(fn, dict(batch=preference_batch(d, dtype)), grad=_PREF_GRAD, ok=_FREE_SEQUENCE_KEYS)


# --- ppo ---------------------------------------------------------------------------------------
def _lp_old(d: Draw, dtype, shape, extreme: bool, lp: torch.Tensor | None = None):
    """``(logprobs, other)``: ``other`` anywhere in [−1e4, 0] when ``extreme``, else within ~10
    nats of ``logprobs`` (drawn unless given)."""
    lp = d.logprobs(shape, dtype) if lp is None else lp
    if extreme:
        return lp, d.logprobs(shape, dtype)
    return lp, (lp.double() + d.reals(shape, F64, SAFE_REALS, "gap") * 3).clamp(max=0).to(dtype)


def log_ratio(fn):
    def make(d: Draw, dtype):
        shape = rows(d)
        lp, old = _lp_old(d, dtype, shape, extreme=True)
        kw = dict(logprobs=lp, old_logprobs=old, mask=d.mask(shape))
        call = fn
        if fn == "registry":
            call = ratios.RATIO_LEVELS[d.choice(sorted(ratios.RATIO_LEVELS), "level")]
        elif fn is ratios.importance_log_ratio:
            kw |= dict(level=d.choice(sorted(ratios.RATIO_LEVELS), "level"), clamp=d.choice([None, 20.0], "clamp"))
        known = {} if call is ratios.importance_log_ratio else _RATIO_KNOWN  # the levels check no shapes
        bad = {"clamp": (0.0, -20.0, NAN)} if call is ratios.importance_log_ratio else {}
        return Case(call, kw, grad=("logprobs",), masks={"mask": ("logprobs", "old_logprobs")}, known=known,
                    bad_hyper=bad)
    return Entry(make)


def engine_weights(d: Draw, dtype):
    shape = rows(d)
    trainer, engine = _lp_old(d, dtype, shape, extreme=True)
    kw = dict(trainer_logprobs=trainer, engine_logprobs=engine, mask=d.mask(shape),
              mode=d.choice(list(ratios.ENGINE_IS_MODES), "mode"), clip_min=d.choice([None, 0.5], "cmin"),
              clip_max=d.choice([None, 3.0], "cmax"))
    return Case(ratios.engine_importance_weights, kw, masks={"mask": ("trainer_logprobs", "engine_logprobs")},
                bad_hyper={"clip_max": (-1.0, NAN), "clip_min": (-1.0, NAN), "mode": ("sequence", "tis")})


# reported: the ratio levels called directly, ratio_stats and explained_variance check no shapes
_RATIO_KNOWN = {"logprobs": _ANY, "old_logprobs": _ANY, "mask": _ANY + ("float_mask",)}


def _clip_hyper(d: Draw) -> dict:
    return dict(clip_eps_low=d.choice([0.2, 3e-4, 1.0], "eps_lo"), clip_eps_high=d.choice([0.2, 0.28, 4.0], "eps_hi"))


def clipped_surrogate(d: Draw, dtype):
    # log-ratios within ±10: exp overflows past ~88 (see test_known_issues)
    shape = rows(d)
    kw = dict(log_ratio=d.reals(shape, dtype, SAFE_REALS), advantages=d.reals(shape, dtype), **_clip_hyper(d),
              clip_ratio_c=d.choice([None, 3.0], "c"))
    return Case(ppo.clipped_surrogate, kw, grad=("log_ratio",), bad_hyper=BAD_CLIP | {"clip_ratio_c": (1.0, NAN)})


def cispo_surrogate(d: Draw, dtype):
    shape = rows(d)
    lp, old = _lp_old(d, dtype, shape, extreme=True)
    kw = dict(log_ratio=lp - old, logprobs=lp, advantages=d.reals(shape, dtype), **_clip_hyper(d))
    return Case(ppo.cispo_surrogate, kw, grad=("logprobs",), bad_hyper=BAD_CLIP)


def sapo_surrogate(d: Draw, dtype):
    shape = rows(d)
    lp, old = _lp_old(d, dtype, shape, extreme=True)  # the gate is evaluated in float64, ρ capped at e^700
    kw = dict(log_ratio=lp - old, advantages=d.reals(shape, dtype), temperature_pos=d.choice([1.0, 0.1, 10.0], "tau_pos"),
              temperature_neg=d.choice([1.05, 0.1, 10.0], "tau_neg"))
    return Case(ppo.sapo_surrogate, kw, grad=("log_ratio",),
                bad_hyper={"temperature_pos": (0.0, NAN, DENORMAL), "temperature_neg": (-1.05, NAN, DENORMAL)})


def vespo_surrogate(d: Draw, dtype):
    shape = rows(d)
    lp, old = _lp_old(d, dtype, shape, extreme=True)  # log w is clamped to [log 1e-8, 20]
    kw = dict(log_ratio=lp - old, logprobs=lp, advantages=d.reals(shape, dtype),
              k_pos=d.choice([2.0, 0.5], "k_pos"), lambda_pos=d.choice([3.0, 1e-6], "lambda_pos"),
              k_neg=d.choice([3.0, 0.5], "k_neg"), lambda_neg=d.choice([2.0, 1e-6], "lambda_neg"))
    return Case(ppo.vespo_surrogate, kw, grad=("logprobs",),
                bad_hyper={"k_pos": (0.0, NAN), "lambda_pos": (-3.0,), "k_neg": (NAN,), "lambda_neg": (0.0,)})


def surrogates(d: Draw, dtype):
    name = d.choice(sorted(ppo.SURROGATES), "surrogate")
    shape = rows(d)
    lp, old = _lp_old(d, dtype, shape, extreme=name != "clip")
    kw = dict(log_ratio=lp - old, logprobs=lp, advantages=d.reals(shape, dtype), **_clip_hyper(d),
              clip_ratio_c=None if name != "clip" else d.choice([None, 3.0], "c"))
    return Case(ppo.SURROGATES[name], kw, grad=("log_ratio", "logprobs"))


def value_loss(d: Draw, dtype):
    shape = rows(d)
    clip = d.choice([None, 0.2], "cliprange")
    kw = dict(value_preds=d.reals(shape, dtype), values=d.reals(shape, dtype) if clip or d.flag("values") else None,
              returns=d.reals(shape, dtype), cliprange_value=clip)
    return Case(ppo.clipped_value_loss, kw, grad=("value_preds",),
                bad_hyper={"cliprange_value": (-0.2, NAN)} if clip else {})


def diagnostic(fn, safe: bool = False):
    def make(d: Draw, dtype):
        shape = rows(d)
        if fn is ppo.ratio_stats:  # reported: amax of an empty tensor raises (test_known_issues)
            shape = tuple(max(n, 1) for n in shape)
        x = d.reals(shape, dtype, SAFE_REALS) if safe else d.reals(shape, dtype)
        known = {"log_ratio": _ANY, "mask": _ANY + ("float_mask",)} if fn is ppo.ratio_stats else {}
        return Case(fn, dict(log_ratio=x, mask=d.mask(shape)), masks={"mask": ("log_ratio",)}, known=known)
    return Entry(make)


def clip_fraction(d: Draw, dtype):
    shape = rows(d)
    kw = dict(clipped=d.mask(shape), mask=d.mask(shape), dtype=d.choice([F32, F64], "out_dtype"))
    return Case(ppo.clip_fraction, kw, ok={"clipped": ("float_mask",)})


def clip_fraction_extremes(d: Draw, dtype):
    shape = rows(d)
    kw = dict(clipped=d.mask(shape), mask=d.mask(shape), dtype=d.choice([F32, F64], "out_dtype"))
    return Case(ppo.clip_fraction_extremes, kw, ok={"clipped": ("float_mask",)})


def explained_variance(d: Draw, dtype):
    shape = rows(d)
    kw = dict(predictions=d.reals(shape, dtype), targets=d.reals(shape, dtype), mask=d.mask(shape))
    # reported: 1 − Var(R − V)/Var(R) overflows to −inf in float32 when Var(R) is ~1e-40
    return Case(ppo.explained_variance, kw, masks={"mask": ("predictions", "targets")},
                known={"predictions": _ANY}, overflow=("out",))


def early_stop(d: Draw, dtype):
    return Case(ppo.early_stop, dict(approx_kl=d.reals((), dtype), target_kl=d.choice([0.01, 1.0], "target"),
                                     factor=d.choice([1.5, 1.0], "factor")))


def rl_batch(d: Draw, dtype, *, critic: bool, clamp: float | None, kl_kind: str | None = None) -> TensorDict:
    B, R = d.size(lo=1), d.time(lo=1)  # reported: an empty rollout makes ratio_stats raise (test_known_issues)
    lp, old = _lp_old(d, dtype, (B, R), extreme=clamp is not None)
    fields = {K.RESPONSE_MASK: d.mask((B, R)), K.LOGPROBS: lp, K.OLD_LOGPROBS: old,
              K.ADVANTAGES: d.reals((B, R), dtype, label="advantages")}
    if kl_kind is not None:
        fields[K.REF_LOGPROBS] = _lp_old(d, dtype, (B, R), extreme=kl_kind != "k3", lp=lp)[1]  # k3: e^gap
    if d.flag("entropy"):
        fields[K.ENTROPY] = d.reals((B, R), dtype, label="entropy").abs()
    if critic:
        fields |= {K.VALUE_PREDS: d.reals((B, R), dtype, label="value_preds"),
                   K.VALUES: d.reals((B, R), dtype, label="values"), K.RETURNS: d.reals((B, R), dtype, label="returns")}
    return TensorDict(fields, [B])


_RL_GUARDED = (K.LOGPROBS, K.OLD_LOGPROBS, K.ADVANTAGES, K.REF_LOGPROBS, K.ENTROPY, K.VALUE_PREDS, K.VALUES, K.RETURNS)
_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_sum_norm", "local_token_mean")


def _rl_case(fn, d: Draw, dtype, *, critic: bool, hyper: dict) -> Case:
    clamp = d.choice([None, 20.0], "log_ratio_clamp")
    kl_coef = d.choice([0.0, 0.1], "kl_coef")
    kl_kind = d.choice(["k1", "k2", "k3"], "kl") if kl_coef else None
    batch = rl_batch(d, dtype, critic=critic, clamp=clamp, kl_kind=kl_kind)
    kw = dict(batch=batch, log_ratio_clamp=clamp, kl_coef=kl_coef, **({"kl": kl_kind} if kl_kind else {}),
              entropy_coef=d.choice([0.0, 0.01], "entropy_coef") if K.ENTROPY in batch.keys() else 0.0,
              num_tokens=d.choice([None, 9], "num_tokens"), ratio_threshold=d.choice([None, 10.0], "threshold"),
              **hyper)
    grad = tuple(("batch", k) for k in (K.LOGPROBS, K.ENTROPY, K.VALUE_PREDS) if k in batch.keys())
    guarded = tuple(("batch", k) for k in _RL_GUARDED if k in batch.keys())
    # reported: explained_variance overflows when Var(returns) is ~1e-40 in float32: a metric only
    surrogate = hyper.get("surrogate", getattr(fn, "keywords", {}).get("surrogate", "clip"))
    clip = BAD_CLIP if surrogate in ("clip", "cispo") else {}  # the soft surrogates read no clip range
    bad = clip | {"vf_coef": (-0.1, NAN), "entropy_coef": (NAN,), "kl_coef": (-0.1, NAN, torch.zeros(2)),
                  "log_ratio_clamp": (0.0, -20.0), "ratio_threshold": (NAN, -1.0), "cliprange_value": (-0.2, NAN)}
    bad = {k: v for k, v in bad.items() if k in inspect.signature(fn).parameters}  # policy losses: no critic
    return Case(fn, kw, grad=grad, masks={("batch", K.RESPONSE_MASK): guarded}, overflow=("explained_variance",),
                bad_hyper=bad)


def ppo_loss(d: Draw, dtype):
    surrogate = d.choice(sorted(ppo.SURROGATES), "surrogate")
    hyper = dict(surrogate=surrogate, ratio_level=d.choice(sorted(ratios.RATIO_LEVELS), "level"),
                 clip_ratio_c=None if surrogate != "clip" else d.choice([None, 3.0], "c"),
                 cliprange_value=d.choice([None, 0.2], "cliprange"), vf_coef=d.choice([0.1, 1.0], "vf_coef"),
                 agg=d.choice(_AGGS, "agg"), **_clip_hyper(d))
    return _rl_case(ppo.ppo_loss, d, dtype, critic=d.flag("critic"), hyper=hyper)


def pg_loss(fn):
    def make(d: Draw, dtype):
        call = fn
        if fn == "registry":
            call = policy_gradient.POLICY_LOSSES[d.choice(sorted(policy_gradient.POLICY_LOSSES), "loss")]
        return _rl_case(call, d, dtype, critic=d.flag("critic"), hyper=dict(max_length=d.choice([None, 64], "L")))
    return Entry(make)


# --- ddpo --------------------------------------------------------------------------------------
def _latents(d: Draw) -> tuple[int, ...]:
    return (*lead(d), d.int(1, 2, "C"), d.int(1, 3, "H"), d.int(1, 2, "W"))


def step_logprob(d: Draw, dtype):
    shape = _latents(d)
    std = d.choice(["float", "lead", "full"], "std")
    pos = ("unit", "huge", "ties")
    if std == "float":
        s = d.choice([1e-3, 1.0, 10.0], "std_value")
    else:
        s = d.reals(shape[:-3] if std == "lead" else shape, dtype, pos).abs() + 1e-3
    kw = dict(sample_prev=d.reals(shape, dtype, ("unit", "zero", "ties")), mean=d.reals(shape, dtype, ("unit", "zero")),
              std=s, event_dims=3)
    grad = ("sample_prev", "mean") + (("std",) if std != "float" else ())
    return Case(ddpo.ddim_step_logprob, kw, grad=grad, ok={"std": ("drop",)})  # fewer dims broadcast: valid


def _schedule(d: Draw):
    T_train = d.choice([10, 50], "T_train")
    betas = torch.linspace(1e-4, 0.02, T_train, dtype=F64)
    alphas = torch.cumprod(1 - betas, 0).to(d.choice([F32, F64], "alphas_dtype"))
    steps = d.choice([n for n in (1, 2, 5, 10) if n <= T_train], "steps")
    return alphas, T_train, steps


def ddim_step(d: Draw, dtype):
    alphas, T_train, steps = _schedule(d)
    shape = _latents(d)
    t_lead = shape[:-3] if d.flag("per_sample_t") else ()
    # t ≥ 1: from t = 0 with final_alpha_cumprod = ᾱ_0 the step is deterministic (documented NaN)
    timestep = d.ints(t_lead, 1, T_train) if t_lead or d.flag("tensor_t") else d.int(1, T_train - 1, "t")
    kw = dict(model_output=d.reals(shape, dtype), timestep=timestep, sample=d.reals(shape, dtype),
              alphas_cumprod=alphas, final_alpha_cumprod=alphas[0], num_train_timesteps=T_train,
              num_inference_steps=steps, eta=d.choice([0.5, 1.0], "eta"),
              prediction_type=d.choice(sorted(ddpo.DDIM_PREDICTIONS), "prediction"))
    if d.flag("score"):
        kw |= dict(prev_sample=d.reals(shape, dtype), generator=None)
    else:
        kw |= dict(prev_sample=None, generator=torch.Generator().manual_seed(d.int(0, 99, "gen")))
    return Case(ddpo.ddim_step, kw, grad=("model_output",),
                ok={"alphas_cumprod": ("grow", "drop"), "timestep": ("add", "drop")})  # size-1 dims broadcast


def ddim_predictions(d: Draw, dtype):
    shape = _latents(d)
    a = d.choice([1e-4, 0.5, 0.9999], "alpha_t")
    kw = dict(model_output=d.reals(shape, dtype), sample=d.reals(shape, dtype),
              alpha_t=torch.full((*shape[:-3], 1, 1, 1), a, dtype=F64 if dtype == F64 else F32))
    return Case(ddpo.DDIM_PREDICTIONS[d.choice(sorted(ddpo.DDIM_PREDICTIONS), "prediction")], kw,
                grad=("model_output",), ok={"alpha_t": _ANY})


# log-probs anywhere in [−3e38, 0] (their difference past exp's range), advantages of every regime
_DDPO_HYPER = (("clip", (1e-4, 0.2, 1.0, 0.0)), ("adv_clip", (5.0, 1e4, float("inf"))))
_BAD_DDPO = {"clip_range": (-0.1, NAN, float("inf")), "adv_clip_max": (-1.0, NAN)}


def _ddpo_hyper(d: Draw) -> dict:
    (clip, clips), (adv, advs) = _DDPO_HYPER
    return dict(clip_range=d.choice(clips, clip), adv_clip_max=d.choice(advs, adv))


def ddpo_ratio(d: Draw, dtype):
    shape = (*lead(d),)
    lp, old = _lp_old(d, dtype, shape, extreme=True)
    kw = dict(logprobs=lp, old_logprobs=old, advantages=d.reals(shape, dtype), **_ddpo_hyper(d))
    return Case(ddpo.ddpo_ratio_loss, kw, grad=("logprobs",), bad_hyper=_BAD_DDPO)


def ddpo_loss(d: Draw, dtype):
    B = d.size(lo=1)
    lp, old = _lp_old(d, dtype, (B,), extreme=True)
    batch = TensorDict({K.LOGPROBS: lp, K.OLD_LOGPROBS: old, K.ADVANTAGES: d.reals((B,), dtype)}, [B])
    return Case(ddpo.ddpo_loss, dict(batch=batch, **_ddpo_hyper(d)), grad=(("batch", K.LOGPROBS),),
                bad_hyper=_BAD_DDPO)


def batch_advantages(d: Draw, dtype):
    return Case(ddpo.batch_advantages, dict(rewards=d.reals((d.size(),), dtype), eps=d.choice([1e-8, 1e-4], "eps")))


def prompt_stats_init(d: Draw, dtype):
    return Case(ddpo.prompt_stats_init, dict(buffer_size=d.int(1, 4, "S"), min_count=d.int(0, 5, "min"), dtype=dtype))


def prompt_stats(d: Draw, dtype):
    def run(buffer_size, min_count, prompts, rewards):
        init, update = ddpo.prompt_stats(buffer_size, min_count)
        return update(init(), prompts, rewards)
    B = d.size()
    kw = dict(buffer_size=d.int(1, 4, "S"), min_count=d.int(0, 5, "min"),
              prompts=[d.choice("abcd", "prompt") for _ in range(B)], rewards=d.reals((B,), dtype))
    return Case(run, kw)


def prompt_stats_update(d: Draw, dtype):
    state = ddpo.prompt_stats_init(buffer_size=d.int(1, 4, "S"), min_count=d.int(0, 5, "min"))
    for _ in range(d.int(0, 2, "history")):
        B = d.size()
        state, _ = ddpo.prompt_stats_update(state, [d.choice("abc") for _ in range(B)], d.reals((B,), dtype))
    B = d.size()
    kw = dict(state=state, prompts=[d.choice("abcd", "prompt") for _ in range(B)], rewards=d.reals((B,), dtype),
              eps=d.choice([1e-6, 1e-3], "eps"))
    return Case(ddpo.prompt_stats_update, kw)


# --- reft --------------------------------------------------------------------------------------
def reft_kernel(fn):
    def make(d: Draw, dtype):
        call = fn
        if fn == "registry":
            call = reft.REFT_INTERVENTIONS[d.choice(sorted(reft.REFT_INTERVENTIONS), "variant")]
        constant = call in (reft.REFT_INTERVENTIONS[n] for n in reft.CONSTANT_SOURCE)  # (h, rotation, bias)
        H = d.int(1, 5, "H")
        r = d.int(1, H, "r")
        rotation = torch.linalg.qr(torch.randn(H, r, generator=d.g, dtype=F64))[0].T.to(dtype) if d.flag("orth") \
            else d.reals((r, H), dtype)
        dims = lead(d)
        kw = dict(h=d.reals((*dims, H), dtype), rotation=rotation, weight=d.reals((r, H), dtype),
                  bias=d.reals((r,), dtype), act=d.choice([None, torch.tanh, torch.relu], "act"))
        if constant:
            del kw["weight"], kw["act"]
        # h [..., H] takes any leading dims: a mutation that still ends in H is a valid input
        ambiguous = tuple(m for m, still_h in (("add", H == 1), ("drop", bool(dims) and dims[-1] == H)) if still_h)
        return Case(call, kw, grad=tuple(k for k in ("h", "rotation", "weight", "bias") if k in kw), ok={"h": ambiguous})
    return Entry(make)


FUZZ = {
    "rlcore.algorithms.sft.sft_token_nll": Entry(sft_token_nll),
    "rlcore.algorithms.sft.sft_loss": Entry(sft_loss),
    "rlcore.algorithms.sft.shift_for_causal_lm": Entry(shift, dtypes=(F64,)),
    "rlcore.algorithms.sft.packed_position_ids": Entry(packed_positions, dtypes=(F64,)),
    "rlcore.algorithms.sft.segment_causal_mask": Entry(segment_mask, dtypes=(F64,)),
    "rlcore.algorithms.reward.bradley_terry_loss": Entry(bradley_terry),
    "rlcore.algorithms.reward.reward_loss": Entry(reward_loss),
    "rlcore.algorithms.online.best_worst_pairs": Entry(best_worst),
    "rlcore.algorithms.online.online_preference_batch": Entry(online_batch),
    **{f"rlcore.algorithms.dpo_variants.dpo_{name}": dpo_kernel(name) for name in dpo_variants.DPO_LOSSES},
    "rlcore.algorithms.dpo_variants.DPO_LOSSES": dpo_kernel(None),
    "rlcore.algorithms.dpo.dpo_loss": Entry(dpo_loss),
    "rlcore.algorithms.dpo_variants.F_DIVERGENCES": Entry(f_divergence),
    "rlcore.algorithms.dpo_variants.smoothed_sigmoid_loss": Entry(smoothed_sigmoid),
    "rlcore.algorithms.dpo.chosen_nll": Entry(chosen_nll),
    "rlcore.algorithms.dpo.preference_metrics": Entry(preference_metrics),
    "rlcore.algorithms.dpo.completion_lengths": Entry(completion_lengths, dtypes=(F64,)),
    "rlcore.algorithms.dpo.dpo": Entry(dpo_batch),
    "rlcore.algorithms.preference.log1mexp": Entry(log1mexp),
    "rlcore.algorithms.preference.odds_ratio_loss": Entry(odds_ratio),
    "rlcore.algorithms.preference.orpo": Entry(orpo),
    "rlcore.algorithms.preference.alphapo_reward": Entry(alphapo),
    "rlcore.algorithms.preference.simpo_loss": Entry(simpo_loss),
    "rlcore.algorithms.preference.simpo": Entry(simpo),
    "rlcore.algorithms.preference.cpo_loss": Entry(cpo_loss),
    "rlcore.algorithms.preference.cpo": Entry(cpo),
    "rlcore.algorithms.preference.kto_loss": Entry(kto_loss),
    "rlcore.algorithms.preference.kto": Entry(kto),
    "rlcore.algorithms.preference.PREFERENCE_LOSSES": Entry(preference_losses),
    "rlcore.algorithms.ratios.token_log_ratio": log_ratio(ratios.token_log_ratio),
    "rlcore.algorithms.ratios.sequence_log_ratio": log_ratio(ratios.sequence_log_ratio),
    "rlcore.algorithms.ratios.sequence_sum_log_ratio": log_ratio(ratios.sequence_sum_log_ratio),
    "rlcore.algorithms.ratios.RATIO_LEVELS": log_ratio("registry"),
    "rlcore.algorithms.ratios.importance_log_ratio": log_ratio(ratios.importance_log_ratio),
    "rlcore.algorithms.ratios.engine_importance_weights": Entry(engine_weights),
    "rlcore.algorithms.ppo.clipped_surrogate": Entry(clipped_surrogate),
    "rlcore.algorithms.ppo.cispo_surrogate": Entry(cispo_surrogate),
    "rlcore.algorithms.ppo.sapo_surrogate": Entry(sapo_surrogate),
    "rlcore.algorithms.ppo.vespo_surrogate": Entry(vespo_surrogate),
    "rlcore.algorithms.ppo.SURROGATES": Entry(surrogates),
    "rlcore.algorithms.ppo.clipped_value_loss": Entry(value_loss),
    "rlcore.algorithms.ppo.approx_kl_k1": diagnostic(ppo.approx_kl_k1),
    "rlcore.algorithms.ppo.approx_kl_k3": diagnostic(ppo.approx_kl_k3),
    "rlcore.algorithms.ppo.clip_fraction": Entry(clip_fraction),
    "rlcore.algorithms.ppo.ratio_stats": diagnostic(ppo.ratio_stats, safe=True),
    "rlcore.algorithms.ppo.explained_variance": Entry(explained_variance),
    "rlcore.algorithms.ppo.clip_fraction_extremes": Entry(clip_fraction_extremes),
    "rlcore.algorithms.ppo.early_stop": Entry(early_stop),
    "rlcore.algorithms.ppo.ppo_loss": Entry(ppo_loss),
    "rlcore.algorithms.policy_gradient.policy_loss": pg_loss(policy_gradient.policy_loss),
    **{f"rlcore.algorithms.policy_gradient.{name}": pg_loss(getattr(policy_gradient, name))
       for name in ("grpo_loss", "dr_grpo_loss", "dapo_loss", "gspo_loss", "rloo_loss", "reinforce_pp_loss",
                    "remax_loss", "cispo_loss", "bnpo_loss", "luspo_loss", "sapo_loss", "vespo_loss")},
    "rlcore.algorithms.policy_gradient.POLICY_LOSSES": pg_loss("registry"),
    "rlcore.algorithms.ddpo.ddim_step_logprob": Entry(step_logprob),
    "rlcore.algorithms.ddpo.ddim_step": Entry(ddim_step),
    # the entries are ddim_step's building blocks, called on inputs it has validated
    "rlcore.algorithms.ddpo.DDIM_PREDICTIONS": Entry(ddim_predictions, bad_inputs=False),
    "rlcore.algorithms.ddpo.ddpo_ratio_loss": Entry(ddpo_ratio),
    "rlcore.algorithms.ddpo.ddpo_loss": Entry(ddpo_loss),
    "rlcore.algorithms.ddpo.batch_advantages": Entry(batch_advantages),
    "rlcore.algorithms.ddpo.prompt_stats": Entry(prompt_stats),
    "rlcore.algorithms.ddpo.prompt_stats_init": Entry(prompt_stats_init, dtypes=(F64, F32)),
    "rlcore.algorithms.ddpo.prompt_stats_update": Entry(prompt_stats_update),
    "rlcore.algorithms.reft.loreft": reft_kernel(reft.loreft),
    "rlcore.algorithms.reft.noreft": reft_kernel(reft.noreft),
    "rlcore.algorithms.reft.direft": reft_kernel(reft.direft),
    "rlcore.algorithms.reft.nodireft": reft_kernel(reft.nodireft),
    "rlcore.algorithms.reft.consreft": reft_kernel(reft.consreft),
    "rlcore.algorithms.reft.lobireft": reft_kernel(reft.lobireft),
    "rlcore.algorithms.reft.REFT_INTERVENTIONS": reft_kernel("registry"),
}

EXEMPT_MODULES: dict[str, str] = {}
EXEMPT = {
    "rlcore.algorithms.ratios.ENGINE_IS_MODES": "a tuple of mode names, no computation; each mode is fuzzed through "
                                                "engine_importance_weights",
    "rlcore.algorithms.ddpo.PromptStats": "a NamedTuple type; built and read by the fuzzed prompt_stats_*",
    "rlcore.algorithms.reft.ReftIntervention": "an nn.Module holding parameters (not a pure function); its forward "
                                               "calls the fuzzed variants (REFT_INTERVENTIONS)",
    "rlcore.algorithms.reft.CONSTANT_SOURCE": "a tuple of variant names, no computation",
    "rlcore.algorithms.reft.trainable_parameters": "collects nn.Parameters of modules: no tensor computation",
    "rlcore.algorithms.ppo.Surrogate": "a NamedTuple type returned by the fuzzed surrogates",
    "rlcore.algorithms.registry.REGISTRIES": "a table of the registries, no computation; each registry is fuzzed in "
                                             "its home module",
    "rlcore.algorithms.policy_gradient.POLICY_RATIO_LEVELS": "a table of level names per preset, no computation; "
                                                             "each level is fuzzed through RATIO_LEVELS",
}
