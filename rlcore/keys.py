"""Every batch key rlcore reads or writes, named once.

Shapes use one alphabet (see the README): ``B`` sequences, ``T`` tokens, ``P`` prompt tokens,
``R`` response tokens, ``V`` vocabulary, ``G`` samples per prompt.

Layouts
-------
Rollout, batch size ``[B]`` (prompt **left** padded, response **right** padded)::

    prompt_ids      [B, P] long      prompt tokens, left padded
    prompt_mask     [B, P] bool      True on real prompt tokens
    response_ids    [B, R] long      sampled tokens, right padded
    response_mask   [B, R] bool      True on real response tokens (EOS included)
    old_logprobs    [B, R] float     log-probs of the behaviour policy (the one that sampled)
    logprobs        [B, R] float     log-probs of the policy being trained (differentiable)
    ref_logprobs    [B, R] float     log-probs of the frozen reference policy
    values          [B, R] float     value estimates recorded with the rollout
    value_preds     [B, R] float     value predictions of the critic being trained
    rewards         [B, R] float     per-token rewards (KL penalty + score on the last token)
    advantages      [B, R] float
    returns         [B, R] float     value targets
    score           [B]    float     sequence-level reward (reward model or function)
    group_id        [B]    long      which prompt a sample belongs to (RLOO/GRPO groups)
    policy_version  [B]    long      learner version that generated the sample (async RLHF)

Preference pair, batch size ``[B]``: nested sub-TensorDicts ``chosen`` and ``rejected``, each::

    input_ids       [B, T] long      prompt + completion
    attention_mask  [B, T] bool
    loss_mask       [B, T] bool      True on completion tokens scored by the loss
    logps           [B]    float     summed completion log-prob under the policy
    ref_logps       [B]    float     the same under the reference

Supervised batch, batch size ``[B]``: ``input_ids``, ``attention_mask``, ``loss_mask`` and,
when packed, ``position_ids`` / ``segment_ids``.
"""

# --- rollout --------------------------------------------------------------------------------
PROMPT_IDS = "prompt_ids"
PROMPT_MASK = "prompt_mask"
RESPONSE_IDS = "response_ids"
RESPONSE_MASK = "response_mask"
OLD_LOGPROBS = "old_logprobs"
LOGPROBS = "logprobs"
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
VALUE_PREDS = "value_preds"
REWARDS = "rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"
SCORE = "score"
GROUP_ID = "group_id"
POLICY_VERSION = "policy_version"
ENTROPY = "entropy"

# --- sequences (SFT, preference pairs, reward modelling) ------------------------------------
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LOSS_MASK = "loss_mask"
POSITION_IDS = "position_ids"
SEGMENT_IDS = "segment_ids"
LABELS = "labels"  # KTO: True for desirable completions

CHOSEN = "chosen"
REJECTED = "rejected"
LOGPS = "logps"
REF_LOGPS = "ref_logps"
REWARD = "reward"  # reward-model output, one scalar per sequence

# --- diffusion (DDPO) -----------------------------------------------------------------------
LATENTS = "latents"
NEXT_LATENTS = "next_latents"
TIMESTEPS = "timesteps"
PROMPT_EMBEDS = "prompt_embeds"

# --- representation fine-tuning -------------------------------------------------------------
INTERVENTION_LOCATIONS = "intervention_locations"

__all__ = [name for name in dir() if name.isupper()]
