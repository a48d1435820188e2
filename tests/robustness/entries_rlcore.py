"""Fuzz entries for the public functions of ``rlcore`` (one builder per function or registry)."""

from __future__ import annotations

import importlib

import torch
from tensordict import TensorDict

from rlcore import keys as K
from tests.robustness.fuzz import F32, F64, Case, Draw, Entry

baselines, kl, lm_head, logprobs, masked, returns, rewards, transforms = (
    importlib.import_module(f"rlcore.{m}") for m in ("baselines", "kl", "lm_head", "logprobs", "masked", "returns",
                                                       "rewards", "transforms"))

SAFE_LOGP = ("typical", "near_zero", "zero")  # log-ratio gaps below ~20: e^gap stays finite
_ANY = ("grow", "drop", "add")


def lead(d: Draw) -> tuple[int, ...]:
    """Leading dims of a ``[..., T]`` tensor: none, ``[B]`` or ``[B1, B2]``."""
    return d.choice([(), (d.size(),), (d.size(), d.size())], "lead")


def rows(d: Draw, long: bool = False) -> tuple[int, ...]:
    return (*lead(d), d.time(long=long))


# --- masked ------------------------------------------------------------------------------------
def _dim(d: Draw, shape) -> object:
    return d.choice([None] + ([-1, 0] if len(shape) else []) + ([(0, -1)] if len(shape) >= 2 else []), "dim")


def masked_reduction(fn):
    def make(d: Draw, dtype):
        shape = rows(d)
        kw = dict(x=d.reals(shape, dtype), mask=d.mask(shape), dim=_dim(d, shape), keepdim=d.flag("keepdim"))
        if fn is masked.masked_var:
            kw["unbiased"] = d.flag("unbiased")
        return Case(fn, kw, grad=("x",), masks={"mask": ("x",)})
    return Entry(make)


def whiten(d: Draw, dtype):
    shape = rows(d)
    kw = dict(x=d.reals(shape, dtype), mask=d.mask(shape), dim=_dim(d, shape), shift_mean=d.flag("shift"),
              unbiased=d.flag("unbiased"), eps=d.choice([1e-8, 1e-5], "eps"))
    return Case(masked.masked_whiten, kw, grad=("x",), masks={"mask": ("x",)})


def zero_outside(d: Draw, dtype):
    shape = rows(d)
    return Case(masked.zero_outside, dict(x=d.reals(shape, dtype), mask=d.mask(shape)), grad=("x",),
                masks={"mask": ("x",)})


def wide_fn(fn, lo: int = 0):
    def make(d: Draw, dtype):  # wide_mean of no values is NaN, as Tensor.mean: at least one value
        shape = (d.time(lo=lo),) if lo else rows(d)
        return Case(fn, dict(x=d.reals(shape, dtype)), grad=("x",))
    return Entry(make)


def saturate(d: Draw, dtype):
    x = d.reals(rows(d), F64, regimes=("unit", "huge", "extreme", "mixed"))
    return Case(masked.saturate, dict(x=x * d.choice([1.0, 1e10], "scale"), dtype=dtype), grad=("x",))


def _two_terms(a, b):
    return masked.wide_sum({"a": a, "b": b})


def wide_sum(d: Draw, dtype):
    shape = rows(d)
    return Case(_two_terms, dict(a=d.reals(shape, dtype), b=d.reals(shape, dtype)), grad=("a", "b"))


def _aggregation_kwargs(d: Draw, shape):
    n_tok = d.choice([None, 1, 7, "tensor"], "num_tokens")
    n_seq = d.choice([None, 1, 4, "tensor"], "num_seqs")
    n_tok, n_seq = (torch.tensor(3) if n == "tensor" else n for n in (n_tok, n_seq))
    return dict(num_tokens=n_tok, num_seqs=n_seq, max_length=d.choice([None, 1, 64], "max_length"))


def aggregation(fn=None):
    def make(d: Draw, dtype):
        shape = (*lead(d), d.time(lo=0))
        if not shape[:-1]:
            shape = (d.size(),) + shape
        kw = dict(values=d.reals(shape, dtype), mask=d.mask(shape), **_aggregation_kwargs(d, shape))
        scalars = {"num_tokens": _ANY, "num_seqs": _ANY}  # denominators: scalars, any shape broadcasts
        if fn is None:
            kw["mode"] = d.choice(sorted(masked.AGGREGATIONS), "mode")
            return Case(masked.aggregate, kw, grad=("values",), masks={"mask": ("values",)}, ok=scalars)
        call = masked.AGGREGATIONS[d.choice(sorted(masked.AGGREGATIONS), "mode")] if fn == "registry" else fn
        return Case(call, kw, grad=("values",), masks={"mask": ("values",)}, ok=scalars)
    return Entry(make)


# --- kl ----------------------------------------------------------------------------------------
def _kl_inputs(d: Draw, dtype, unclamped_k3: bool):
    shape = rows(d)
    clamp = d.choice([None, 20.0, 1.0], "clamp")
    regimes = SAFE_LOGP if (clamp is None and unclamped_k3) else None
    lp = d.logprobs(shape, dtype, **({"regimes": regimes} if regimes else {}))
    ref = d.logprobs(shape, dtype, **({"regimes": regimes} if regimes else {}))
    return dict(logprobs=lp, ref_logprobs=ref, clamp=clamp)


def kl_estimator(fn):
    # k3 grows like e^(ref − lp): unclamped, it is only fuzzed where that stays finite (documented;
    # test_documented_exceptions pins the overflow)
    def make(d: Draw, dtype):
        return Case(fn, _kl_inputs(d, dtype, fn is kl.kl_k3), grad=("logprobs", "ref_logprobs"))
    return Entry(make)


def kl_estimate(d: Draw, dtype):
    kind = d.choice(sorted(kl.KL_ESTIMATORS) + sorted(kl.KL_ALIASES), "kind")
    k3 = kl.KL_ALIASES.get(kind, kind) == "k3"
    kw = _kl_inputs(d, dtype, k3) | dict(kind=kind, straight_through=d.flag("st"))
    return Case(kl.kl_estimate, kw, grad=("logprobs", "ref_logprobs"), bad_hyper={"clamp": (0.0, -1.0, float("nan"))})


def kl_registry(d: Draw, dtype):
    name = d.choice(sorted(kl.KL_ESTIMATORS), "kind")
    return Case(kl.KL_ESTIMATORS[name], _kl_inputs(d, dtype, name == "k3"), grad=("logprobs", "ref_logprobs"))


def kl_full(d: Draw, dtype):
    shape = (*lead(d), d.int(1, 6, "V"))
    kw = dict(logits=d.reals(shape, dtype), ref_logits=d.reals(shape, dtype),
              temperature=d.choice([1.0, 0.7, 2.0], "tau"), chunk_size=d.choice([None, 1, 2], "chunk"))
    return Case(kl.kl_full, kw, grad=("logits",))


# --- logprobs ----------------------------------------------------------------------------------
def token_logprobs(d: Draw, dtype):
    V = d.int(1, 7, "V")
    shape = rows(d)
    kw = dict(logits=d.reals((*shape, V), dtype), labels=d.ints(shape, 0, V),
              temperature=d.choice([1.0, 0.5, 3.0], "tau"), chunk_size=d.choice([None, 1, 3], "chunk"))
    # reported: dropping the vocabulary dim can leave V = 0, which raises IndexError
    return Case(logprobs.token_logprobs, kw, grad=("logits",), ok={"logits": ("grow",)}, known={"logits": ("drop",)})


def entropy(d: Draw, dtype):
    kw = dict(logits=d.reals((*rows(d), d.int(1, 7, "V")), dtype), temperature=d.choice([1.0, 0.5, 3.0], "tau"),
              chunk_size=d.choice([None, 1, 3], "chunk"))
    return Case(logprobs.entropy_from_logits, kw, grad=("logits",))


def hidden_logprobs(d: Draw, dtype):
    N, H, V = lead(d), d.int(1, 5, "H"), d.int(1, 9, "V")
    N = tuple(max(n, 1) for n in N)  # reported: zero rows raise ValueError (test_known_issues)
    regimes = ("unit", "zero", "tiny", "huge", "ties")
    kw = dict(hidden=d.reals((*N, H), dtype, regimes), weight=d.reals((V, H), dtype, regimes),
              labels=d.ints(N, 0, V), bias=d.choice([None, "bias"], "bias"),
              temperature=d.choice([1.0, 0.5, 3.0], "tau"), softcap=d.choice([None, 30.0, 0.5], "softcap"),
              logit_scale=d.choice([1.0, 0.25], "scale"), chunk_size=d.choice([1, 2, 4096], "chunk"),
              with_entropy=d.flag("entropy"))
    if kw["bias"] is not None:
        kw["bias"] = d.reals((V,), dtype, regimes)
    grad = ("hidden", "weight") + (("bias",) if kw["bias"] is not None else ())
    return Case(lm_head.hidden_logprobs, kw, grad=grad)


def sequence_logprobs(d: Draw, dtype):
    shape = rows(d)
    kw = dict(logprobs=d.logprobs(shape, dtype), mask=d.mask(shape), average=d.flag("average"))
    return Case(logprobs.sequence_logprobs, kw, grad=("logprobs",), masks={"mask": ("logprobs",)})


# --- returns -----------------------------------------------------------------------------------
_GAMMAS = (0.0, 0.5, 0.95, 1.0)


def gae(d: Draw, dtype):
    shape = rows(d, long=True)
    kw = dict(rewards=d.reals(shape, dtype), values=d.reals(shape, dtype), mask=d.mask(shape),
              gamma=d.choice(_GAMMAS, "gamma"), lam=d.choice(_GAMMAS, "lam"))
    return Case(returns.gae, kw, masks={"mask": ("rewards", "values")})


def discounted_returns(d: Draw, dtype):
    shape = rows(d, long=True)
    kw = dict(rewards=d.reals(shape, dtype), mask=d.mask(shape), gamma=d.choice(_GAMMAS, "gamma"))
    return Case(returns.discounted_returns, kw, masks={"mask": ("rewards",)})


def discounted_cumsum(d: Draw, dtype):
    kw = dict(x=d.reals(rows(d, long=True), dtype), coef=d.choice(_GAMMAS, "coef"), block=d.choice([2, 3, 64], "block"))
    return Case(returns.discounted_cumsum, kw, grad=("x",))


def rollout(d: Draw, dtype, *, B: int | None = None, keys=(K.REWARDS, K.VALUES, K.SCORE), long=False) -> TensorDict:
    B = d.size() if B is None else B
    R = d.time(long=long)
    mask = d.mask((B, R))
    fields = {K.RESPONSE_MASK: mask}
    for key in keys:
        fields[key] = d.reals((B,) if key in (K.SCORE, K.BASELINE_SCORE) else (B, R), dtype, label=key)
    return TensorDict(fields, batch_size=[B])


def with_gae(d: Draw, dtype):
    batch = rollout(d, dtype, long=True)
    kw = dict(batch=batch, gamma=d.choice(_GAMMAS, "gamma"), lam=d.choice(_GAMMAS, "lam"), whiten=d.flag("whiten"))
    guarded = (("batch", K.REWARDS), ("batch", K.VALUES))
    return Case(returns.with_gae, kw, masks={("batch", K.RESPONSE_MASK): guarded})


# --- baselines ---------------------------------------------------------------------------------
def _scores(d: Draw, dtype):
    """Grouped ``[P, G]`` scores (singleton groups when G = 1), or flat ``[B]`` with group ids."""
    if d.flag("grouped"):
        return dict(scores=d.reals((d.size(), d.size(lo=1)), dtype))
    B = d.size()
    return dict(scores=d.reals((B,), dtype), group_id=d.group_ids(B))


def outcome(fn, **hyper):
    def make(d: Draw, dtype):
        kw = _scores(d, dtype) | {k: d.choice(v, k) for k, v in hyper.items()}
        return Case(fn, kw)
    return Entry(make)


def grpo_scales(d: Draw, dtype):
    kw = _scores(d, dtype) | dict(scale=d.choice(sorted(baselines.GRPO_SCALES), "scale"),
                                  eps=d.choice([1e-6, 1e-4, 0.0], "eps"))
    return Case(baselines.grpo_advantage, kw)


def opo(d: Draw, dtype):
    kw = _scores(d, dtype)
    kw["lengths"] = d.reals(kw["scores"].shape, dtype).abs()  # response lengths are ≥ 0
    return Case(baselines.opo_advantage, kw)


def reinforce_pp(fn):
    def make(d: Draw, dtype):
        baseline = fn is baselines.reinforce_pp_baseline_advantage or d.flag("group_baseline")
        flat = d.flag("flat_groups")
        B, T = d.size(), d.time(long=True)
        shape = (B, T) if flat else (d.size(), B, T)
        kw = dict(rewards=d.reals(shape, dtype), mask=d.mask(shape), gamma=d.choice(_GAMMAS, "gamma"),
                  eps=d.choice([1e-8, 1e-5], "eps"))
        if fn is baselines.reinforce_pp_advantage:
            kw["group_baseline"] = baseline
        if baseline and flat:
            kw["group_id"] = d.group_ids(B)
        return Case(fn, kw, masks={"mask": ("rewards",)})
    return Entry(make)


def remax(d: Draw, dtype):
    shape = rows(d, long=True)
    kw = dict(rewards=d.reals(shape, dtype), baseline_scores=d.reals(shape[:-1], dtype), mask=d.mask(shape))
    return Case(baselines.remax_advantage, kw, masks={"mask": ("rewards",)})


def broadcast(d: Draw, dtype):
    shape = rows(d)
    kw = dict(advantages=d.reals(shape[:-1], dtype), mask=d.mask(shape))
    # T is free; reported: a 0-d mask (no time dim) is accepted
    return Case(baselines.broadcast_to_tokens, kw, grad=("advantages",), ok={"mask": ("grow",)},
                known={"mask": ("drop",)})


def _grouped_rollout(d: Draw, dtype, keys):
    G = d.choice([1, 2, 3], "G")
    batch = rollout(d, dtype, B=G * d.size(), keys=keys, long=True)
    how = d.choice(["group_size", "group_id"], "groups")
    if how == "group_id":
        batch.set(K.GROUP_ID, d.group_ids(batch.batch_size[0]))
    return batch, (dict(group_size=G) if how == "group_size" else {})


def with_outcome(fn, keys_options, **hyper):
    def make(d: Draw, dtype):
        batch, groups = _grouped_rollout(d, dtype, d.choice(keys_options, "keys"))
        kw = dict(batch=batch, **groups) | {k: d.choice(v, k) for k, v in hyper.items()}
        guarded = tuple(("batch", k) for k in (K.REWARDS,) if k in batch.keys())
        free = {} if guarded else {("batch", K.RESPONSE_MASK): ("grow",)}  # scores only: R is free
        return Case(fn, kw, masks={("batch", K.RESPONSE_MASK): guarded} if guarded else {}, ok=free)
    return Entry(make)


def with_remax(d: Draw, dtype):
    batch = rollout(d, dtype, keys=(K.REWARDS, K.BASELINE_SCORE), long=True)
    return Case(baselines.with_remax_advantage, dict(batch=batch),
                masks={("batch", K.RESPONSE_MASK): (("batch", K.REWARDS),)})


# --- rewards -----------------------------------------------------------------------------------
def last_token_mask(d: Draw, dtype):
    return Case(rewards.last_token_mask, dict(mask=d.mask(rows(d))))


def soft_overlong(d: Draw, dtype):
    shape = rows(d)
    limit = d.int(1, 2 * shape[-1] + 1, "max_length")
    return Case(rewards.soft_overlong_penalty, dict(response_mask=d.mask(shape), max_length=limit,
                                                    buffer=d.int(1, limit, "buffer"),
                                                    factor=d.choice([0.0, 1.0, 1e30], "factor")))


# β: a float or a 0-d tensor, >= 0 and finite (a [T] tensor weighed each token differently); clamp > 0
_BAD_REWARD_HYPER = {"kl_coef": (float("nan"), -0.1, torch.tensor(float("nan")), torch.full((3,), 0.1),
                                 torch.tensor(1)),
                     "clamp": (0.0, -1.0, float("nan"))}


def _reward_kwargs(d: Draw, dtype, name: str):
    kind = d.choice(sorted(kl.KL_ESTIMATORS) + sorted(kl.KL_ALIASES), "kl")
    clamp = d.choice([None, 20.0], "clamp")
    safe = clamp is None and kl.KL_ALIASES.get(kind, kind) == "k3"  # e^gap, see kl_estimator
    coef = d.choice([0.0, 0.2, 1e4, "tensor"], "kl_coef")
    coef = torch.tensor(0.05, dtype=F64) if coef == "tensor" else coef
    return dict(kl_coef=coef, **{name: kind}, clamp=clamp), (SAFE_LOGP if safe else None)


def compute_rewards(d: Draw, dtype):
    shape = rows(d)
    hyper, regimes = _reward_kwargs(d, dtype, "kl")
    lp_kw = {"regimes": regimes} if regimes else {}
    kw = dict(score=d.reals(shape[:-1], dtype), logprobs=d.logprobs(shape, dtype, **lp_kw),
              ref_logprobs=d.logprobs(shape, dtype, **lp_kw), mask=d.mask(shape), **hyper)
    return Case(rewards.compute_rewards, kw, masks={"mask": ("logprobs", "ref_logprobs")}, bad_hyper=_BAD_REWARD_HYPER)


def _moments(d: Draw, dtype=F64, n_updates: int | None = None):
    state = transforms.running_moments_init(dtype=d.choice([F64, F32], "moments_dtype"))
    for _ in range(d.int(0, 3, "updates") if n_updates is None else n_updates):
        shape = (d.size(),)
        state = transforms.running_moments_update(state, d.reals(shape, dtype), d.mask(shape))
    return state


def process_scores(d: Draw, dtype):
    kw = dict(scores=d.reals((d.size(),), dtype), moments=_moments(d), scale=d.flag("scale"),
              normalize=d.flag("normalize"), clip=d.choice([None, 5.0], "clip"), eps=d.choice([1e-8, 1e-4], "eps"))
    return Case(rewards.process_scores, kw, grad=("scores",), bad_hyper={"clip": (-1.0, float("nan")), "eps": (-1e-8,)})


def with_rewards(d: Draw, dtype):
    B = d.size()
    R = d.time()
    hyper, regimes = _reward_kwargs(d, dtype, "kl")
    lp_kw = {"regimes": regimes} if regimes else {}
    batch = TensorDict({K.RESPONSE_MASK: d.mask((B, R)), K.SCORE: d.reals((B,), dtype),
                        K.OLD_LOGPROBS: d.logprobs((B, R), dtype, **lp_kw),
                        K.REF_LOGPROBS: d.logprobs((B, R), dtype, **lp_kw)}, [B])
    guarded = (("batch", K.OLD_LOGPROBS), ("batch", K.REF_LOGPROBS))
    return Case(rewards.with_rewards, dict(batch=batch, **hyper), masks={("batch", K.RESPONSE_MASK): guarded},
                bad_hyper=_BAD_REWARD_HYPER)


# --- transforms --------------------------------------------------------------------------------
_COEFS = (0.0, 1e-20, 0.2, 1.0, 1e4)


def kl_init(fn):
    def make(d: Draw, dtype):
        coef = d.choice(_COEFS, "coef")
        return Case(fn, dict(coef=torch.tensor(coef, dtype=dtype) if d.flag("tensor") else coef))
    return Entry(make, dtypes=(F64, F32))


def _controller_steps(init, update, d: Draw, dtype):
    def run(coef, observed, n_steps, target, horizon):
        state = init(coef)
        for kl_value in observed:  # a sequence of controller updates
            state = update(state, kl_value, n_steps, target=target, horizon=horizon)
        return state
    observed = d.reals((d.int(1, 5, "n_updates"),), dtype)
    kw = dict(coef=d.choice(_COEFS, "coef"), observed=observed, n_steps=d.choice([1, 256, 10000], "n_steps"),
              target=d.choice([6.0, 0.1], "target"), horizon=d.choice([10000, 100], "horizon"))
    return Case(run, kw)


def kl_update(fn):
    def make(d: Draw, dtype):
        state = transforms.KLControllerState(torch.tensor(d.choice(_COEFS, "coef"), dtype=F64))
        kw = dict(state=state, observed_kl=d.reals((), dtype), n_steps=d.choice([1, 256, 10000], "n_steps"),
                  target=d.choice([6.0, 0.1], "target"), horizon=d.choice([10000, 100], "horizon"))
        return Case(fn, kw)
    return Entry(make)


def kl_controllers(d: Draw, dtype):
    init, update = transforms.KL_CONTROLLERS[d.choice(sorted(transforms.KL_CONTROLLERS), "name")]
    return _controller_steps(init, update, d, dtype)


def kl_controller(d: Draw, dtype):
    def run(name, coef, observed, n_steps, target, horizon):
        init, update = transforms.kl_controller(name, coef=coef, target=target, horizon=horizon)
        state = init()
        for kl_value in observed:  # a sequence of controller updates
            state = update(state, kl_value, n_steps)
        return state
    kw = dict(name=d.choice(sorted(transforms.KL_CONTROLLERS), "name"), coef=d.choice(_COEFS, "coef"),
              observed=d.reals((d.int(1, 5, "n_updates"),), dtype), n_steps=d.choice([1, 256, 10000], "n_steps"),
              target=d.choice([6.0, 0.1], "target"), horizon=d.choice([10000, 100], "horizon"))
    return Case(run, kw)


def running_moments(d: Draw, dtype):
    def run(dtype_, x, mask):
        init, update = transforms.running_moments(dtype=dtype_)
        return update(init(), x, mask)
    shape = (d.size(),)
    return Case(run, dict(dtype_=d.choice([F64, F32], "moments_dtype"), x=d.reals(shape, dtype), mask=d.mask(shape)),
                masks={"mask": ("x",)})


def observed(fn=None):
    def make(d: Draw, dtype):
        shape = (*lead(d), d.time())
        if not shape[:-1]:
            shape = (d.size(),) + shape
        kw = dict(kl=d.reals(shape, dtype), mask=d.mask(shape))
        if fn is None:
            return Case(transforms.observed_kl, kw | dict(reduce=d.choice(sorted(transforms.KL_REDUCTIONS), "reduce")),
                        masks={"mask": ("kl",)})
        name = d.choice(sorted(transforms.KL_REDUCTIONS), "reduce")
        return Case(transforms.KL_REDUCTIONS[name], dict(values=kw["kl"], mask=kw["mask"]), masks={"mask": ("values",)})
    return Entry(make)


def moments_init(d: Draw, dtype):
    return Case(transforms.running_moments_init, dict(dtype=dtype))


def moments_update(d: Draw, dtype):
    shape = rows(d)
    kw = dict(state=_moments(d), x=d.reals(shape, dtype), mask=d.choice([None, "mask"], "mask?"))
    if kw["mask"] is not None:
        kw["mask"] = d.mask(shape)
    return Case(transforms.running_moments_update, kw, masks={"mask": ("x",)} if kw["mask"] is not None else {})


def moments_merge(d: Draw, dtype):
    return Case(transforms.running_moments_merge, dict(a=_moments(d, dtype), b=_moments(d, dtype)))


def moments_stat(fn):
    def make(d: Draw, dtype):
        return Case(fn, dict(state=_moments(d, dtype), unbiased=d.flag("unbiased")))
    return Entry(make)


# --- registry ----------------------------------------------------------------------------------
def advantage_estimators(d: Draw, dtype):
    registry = importlib.import_module("rlcore.baselines")
    name = d.choice(sorted(registry.ADVANTAGE_ESTIMATORS), "estimator")
    fn = registry.ADVANTAGE_ESTIMATORS[name]
    if name == "gae":
        case = with_gae(d, dtype)
    elif name == "remax":
        case = with_remax(d, dtype)
    else:
        keys = (K.REWARDS,) if name == "reinforce_pp" else d.choice([(K.SCORE,), (K.REWARDS, K.SCORE)], "keys")
        batch, groups = _grouped_rollout(d, dtype, keys)
        free = {} if K.REWARDS in keys else {("batch", K.RESPONSE_MASK): ("grow",)}
        case = Case(fn, dict(batch=batch, **groups), ok=free)
    return Case(fn, case.kwargs, masks=case.masks, ok=case.ok)


FUZZ = {
    "rlcore.masked.masked_sum": masked_reduction(masked.masked_sum),
    "rlcore.masked.masked_mean": masked_reduction(masked.masked_mean),
    "rlcore.masked.masked_var": masked_reduction(masked.masked_var),
    "rlcore.masked.masked_whiten": Entry(whiten),
    "rlcore.masked.zero_outside": Entry(zero_outside),
    "rlcore.masked.wide": wide_fn(masked.wide),
    "rlcore.masked.wide_mean": wide_fn(masked.wide_mean, lo=1),
    "rlcore.masked.saturate": Entry(saturate),
    "rlcore.masked.wide_sum": Entry(wide_sum),
    "rlcore.masked.aggregate": aggregation(),
    "rlcore.masked.AGGREGATIONS": aggregation("registry"),
    "rlcore.masked.token_mean": aggregation(masked.token_mean),
    "rlcore.masked.seq_mean_token_sum": aggregation(masked.seq_mean_token_sum),
    "rlcore.masked.seq_mean_token_mean": aggregation(masked.seq_mean_token_mean),
    "rlcore.masked.seq_sum_norm": aggregation(masked.seq_sum_norm),
    "rlcore.masked.local_token_mean": aggregation(masked.local_token_mean),
    "rlcore.kl.kl_k1": kl_estimator(kl.kl_k1),
    "rlcore.kl.kl_abs": kl_estimator(kl.kl_abs),
    "rlcore.kl.kl_k2": kl_estimator(kl.kl_k2),
    "rlcore.kl.kl_k3": kl_estimator(kl.kl_k3),
    "rlcore.kl.kl_estimate": Entry(kl_estimate),
    "rlcore.kl.KL_ESTIMATORS": Entry(kl_registry),
    "rlcore.kl.kl_full": Entry(kl_full),
    "rlcore.logprobs.token_logprobs": Entry(token_logprobs),
    "rlcore.logprobs.entropy_from_logits": Entry(entropy),
    "rlcore.lm_head.hidden_logprobs": Entry(hidden_logprobs),
    "rlcore.logprobs.sequence_logprobs": Entry(sequence_logprobs),
    "rlcore.returns.gae": Entry(gae),
    "rlcore.returns.discounted_returns": Entry(discounted_returns),
    "rlcore.returns.discounted_cumsum": Entry(discounted_cumsum),
    "rlcore.returns.with_gae": Entry(with_gae),
    "rlcore.baselines.rloo_advantage": outcome(baselines.rloo_advantage),
    "rlcore.baselines.grpo_advantage": outcome(baselines.grpo_advantage, eps=(1e-6, 1e-4, 0.0)),
    "rlcore.baselines.dr_grpo_advantage": outcome(baselines.dr_grpo_advantage),
    "rlcore.baselines.GRPO_SCALES": Entry(grpo_scales),
    "rlcore.baselines.group_mean": outcome(baselines.group_mean),
    "rlcore.baselines.reinforce_pp_advantage": reinforce_pp(baselines.reinforce_pp_advantage),
    "rlcore.baselines.reinforce_pp_baseline_advantage": reinforce_pp(baselines.reinforce_pp_baseline_advantage),
    "rlcore.baselines.remax_advantage": Entry(remax),
    "rlcore.baselines.opo_advantage": Entry(opo),
    "rlcore.baselines.broadcast_to_tokens": Entry(broadcast),
    "rlcore.baselines.with_rloo_advantage": with_outcome(
        baselines.with_rloo_advantage, [(K.SCORE,), (K.REWARDS, K.SCORE)]),
    "rlcore.baselines.with_grpo_advantage": with_outcome(
        baselines.with_grpo_advantage, [(K.SCORE,), (K.REWARDS, K.SCORE)],
        scale=sorted(baselines.GRPO_SCALES), eps=(1e-6, 0.0)),
    "rlcore.baselines.with_dr_grpo_advantage": with_outcome(
        baselines.with_dr_grpo_advantage, [(K.SCORE,), (K.REWARDS, K.SCORE)]),
    "rlcore.baselines.with_reinforce_pp_advantage": with_outcome(
        baselines.with_reinforce_pp_advantage, [(K.REWARDS,)], gamma=_GAMMAS, group_baseline=(False, True)),
    "rlcore.baselines.with_remax_advantage": Entry(with_remax),
    "rlcore.baselines.with_opo_advantage": with_outcome(baselines.with_opo_advantage, [(K.SCORE,), (K.REWARDS, K.SCORE)]),
    "rlcore.rewards.last_token_mask": Entry(last_token_mask, dtypes=(F64,)),
    "rlcore.rewards.compute_rewards": Entry(compute_rewards),
    "rlcore.rewards.process_scores": Entry(process_scores),
    "rlcore.rewards.soft_overlong_penalty": Entry(soft_overlong, dtypes=(F64,)),
    "rlcore.rewards.with_rewards": Entry(with_rewards),
    "rlcore.transforms.fixed_kl_init": kl_init(transforms.fixed_kl_init),
    "rlcore.transforms.adaptive_kl_init": kl_init(transforms.adaptive_kl_init),
    "rlcore.transforms.fixed_kl_update": kl_update(transforms.fixed_kl_update),
    "rlcore.transforms.adaptive_kl_update": kl_update(transforms.adaptive_kl_update),
    "rlcore.transforms.KL_CONTROLLERS": Entry(kl_controllers),
    "rlcore.transforms.kl_controller": Entry(kl_controller),
    "rlcore.transforms.observed_kl": observed(),
    "rlcore.transforms.KL_REDUCTIONS": observed("registry"),
    "rlcore.transforms.running_moments": Entry(running_moments),
    "rlcore.transforms.running_moments_init": Entry(moments_init, dtypes=(F64, F32)),
    "rlcore.transforms.running_moments_update": Entry(moments_update),
    "rlcore.transforms.running_moments_merge": Entry(moments_merge),
    "rlcore.transforms.running_moments_var": moments_stat(transforms.running_moments_var),
    "rlcore.transforms.running_moments_std": moments_stat(transforms.running_moments_std),
    "rlcore.baselines.ADVANTAGE_ESTIMATORS": Entry(advantage_estimators),
}

EXEMPT_MODULES = {
    "rlcore.keys": "string constants naming batch keys",
    "rlcore.checks": "the validators themselves: every fuzzed function's bad-input errors go through them",
    "rlcore.testing": "test helpers (assertions, batch factories, a mock LM), not library kernels",
    "rlcore.seeding": "seeding of global RNGs (impure by design) and generator construction",
    "rlcore._kernels": "the compiled kernels' loader and autograd functions; the token_logprobs and entropy entries "
                       "run them (float32 / bfloat16 logits on CPU)",
    "rlcore._kernel_build": "how the compiled kernels are built (at install, or on first use into a per-user cache); "
                            "tests/test_install.py runs it",
    "rlcore.kernels": "the `python -m rlcore.kernels` report of the active log-probs path; no tensor functions",
}
EXEMPT = {
    "rlcore.masked.in_float64": "a decorator; the DPO variants, ReFT edits and DDIM predictions it wraps are fuzzed",
    "rlcore.kl.KL_ALIASES": "a dict of names (str -> str); every alias is fuzzed through kl_estimate",
    "rlcore.transforms.KLControllerState": "a NamedTuple type; built and read by the fuzzed controllers",
    "rlcore.lm_head.LogprobStats": "a NamedTuple type returned by the fuzzed hidden_logprobs (with_stats=True)",
    "rlcore.transforms.StateTransform": "a NamedTuple type of two functions; kl_controller and running_moments "
                                        "return it and are fuzzed",
    "rlcore.transforms.RunningMoments": "a NamedTuple type; built and read by the fuzzed running-moments functions",
}
