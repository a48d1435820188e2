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
    baseline_score  [B]    float     score of the greedy response to the same prompt (ReMax)
    group_id        [B]    long      which prompt a sample belongs to (RLOO/GRPO groups)
    policy_version  [B]    long      learner version that generated the sample (async RLHF)

Preference pair, batch size ``[B]``: nested sub-TensorDicts ``chosen`` and ``rejected``, each::

    input_ids       [B, T] long      prompt + completion
    attention_mask  [B, T] bool
    loss_mask       [B, T] bool      True on completion tokens scored by the loss
    logps           [B]    float     summed completion log-prob under the policy
    ref_logps       [B]    float     the same under the reference

Unpaired (KTO) batch, batch size ``[B]``: ``input_ids``, ``attention_mask``, ``loss_mask``
``[B, T]``, ``logps`` / ``ref_logps`` ``[B]``, ``labels [B] bool`` (True = desirable), and
``kl_logps`` / ``ref_kl_logps`` ``[B]``: log-probs of mismatched (prompt, completion) pairs.

Diffusion trajectories (DDPO), batch size ``[B]``, ``S`` denoising steps, pixel or latent
images ``[C, H, W]``::

    latents         [B, S+1, C, H, W] float  the chain x_T ... x_0 (latents[:, -1] is the sample)
    timesteps       [B, S] long      the training-schedule timestep of each step
    old_logprobs    [B, S] float     log-density of each step taken, under the sampling model
    class_labels    [B]    long      class id conditioning the model (a prompt mapped to an id), or
    prompt_embeds   [B, L, D] float  a text encoder's embeddings of the prompt, and
    negative_prompt_embeds [B, L, D] float  those of the negative prompt (classifier-free guidance)
    score           [B]    float     reward of the final image;  advantages [B] float

and the rows a DDPO update trains on, one per (sample, step) pair: ``latents`` /
``next_latents [N, C, H, W]``, ``timesteps``, ``old_logprobs``, ``advantages``,
``sample_index`` (the trajectory of the row), ``class_labels`` ``[N]`` (the prompt embeddings
stay in the trajectories: ``loops.diffusion.row_condition`` gathers a micro-batch's).

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
BASELINE_SCORE = "baseline_score"  # [B] score of the greedy rollout (ReMax baseline)
GROUP_ID = "group_id"
POLICY_VERSION = "policy_version"
TRUNCATED = "truncated"  # [B] bool, the response reached the token budget with no stop token
ENTROPY = "entropy"
KL = "kl"  # [B, R] float, per-token KL estimate behind the reward penalty (rlcore.rewards)
FULL_KL = "full_kl"  # [B, R] float, exact KL(π‖π_ref) over the vocabulary at each response token (PPO kl="full")
TRAJECTORY_MASK = "trajectory_mask"  # [B, R] bool, every real token of a multi-turn trajectory: the model's and the environment's
TURN_IDS = "turn_ids"  # [B, R] long, the turn each trajectory token belongs to (loops.episodes)
TURNS = "turns"  # [B] long, assistant turns of an episode
ENV_REWARD = "env_reward"  # [B] float, the environment's rewards of an episode, summed
REWARD_TERMS = "reward_terms"  # {name: [B] float}, each reward function's (or model's) unweighted score, NaN: no opinion

# --- sequences (SFT, preference pairs, reward modelling) ------------------------------------
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LOSS_MASK = "loss_mask"
POSITION_IDS = "position_ids"
SEGMENT_IDS = "segment_ids"
LABELS = "labels"  # KTO: True for desirable completions
KL_LOGPS = "kl_logps"  # KTO: policy log-prob of a mismatched (prompt, completion) pair [B]
REF_KL_LOGPS = "ref_kl_logps"  # KTO: the same under the reference [B]

CHOSEN = "chosen"
REJECTED = "rejected"
LOGPS = "logps"
REF_LOGPS = "ref_logps"
REWARD = "reward"  # reward-model output, one scalar per sequence

# --- diffusion (DDPO) -----------------------------------------------------------------------
LATENTS = "latents"
NEXT_LATENTS = "next_latents"
TIMESTEPS = "timesteps"
PROMPT_EMBEDS = "prompt_embeds"  # [B, L, D] float, a text encoder's embeddings of the prompt
NEGATIVE_PROMPT_EMBEDS = "negative_prompt_embeds"  # [B, L, D] float, those of the negative (or empty) prompt
IMAGES = "images"  # [B, C, H, W] float in [0, 1], the decoded samples a reward function scores
PROMPT = "prompt"  # [B] text (a NonTensorStack of str), the prompt of each sample
PROMPT_METADATA = "prompt_metadata"  # [B] (a NonTensorStack), what a prompt function returned with it
SAMPLE_INDEX = "sample_index"  # [N] long, the trajectory a DDPO training row comes from
CLASS_LABELS = "class_labels"  # [B] long, the class id (prompt) conditioning a diffusion model

# --- representation fine-tuning -------------------------------------------------------------
INTERVENTION_LOCATIONS = "intervention_locations"

__all__ = [name for name in dir() if name.isupper()]
