"""Plain references for returns and advantage estimators: Python loops over rows, groups and time.

Written from the formulas, for readability, not speed: each works on Python floats row by row, so
that it shares no code (and no vectorisation trick) with ``rlcore.returns`` / ``rlcore.baselines``.
Inputs are ``[..., T]`` tensors; leading dims are flattened to rows. Outputs are float64 tensors.
"""

from __future__ import annotations

import math

import torch


def _rows(*tensors: torch.Tensor) -> list[list[list]]:
    """Each tensor ``[..., T]`` as a list of rows (Python lists)."""
    return [t.reshape(-1, t.shape[-1]).tolist() for t in tensors]


def _back(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).reshape(like.shape)


def gae_reference(rewards, values, mask, *, gamma=1.0, lam=0.95):
    """GAE over valid tokens, one row and one step at a time; masked steps carry everything through.

    ``δ_t = r_t + γ·V_next − V_t``, ``Â_t = δ_t + γλ·Â_next``, ``V_next``/``Â_next`` from the next
    valid token (0 after the last one); returns = Â + V; 0 at masked positions.
    """
    adv_rows, ret_rows = [], []
    for r, v, m in zip(*_rows(rewards, values, mask)):
        T = len(r)
        adv, ret = [0.0] * T, [0.0] * T
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(T)):
            if not m[t]:
                continue
            delta = r[t] + gamma * next_value - v[t]
            next_adv = delta + gamma * lam * next_adv
            next_value = v[t]
            adv[t], ret[t] = next_adv, next_adv + v[t]
        adv_rows.append(adv)
        ret_rows.append(ret)
    return _back(adv_rows, rewards), _back(ret_rows, rewards)


def discounted_returns_reference(rewards, mask, *, gamma=1.0):
    """``G_t = r_t + γ·G_next`` over valid tokens (masked steps skipped); 0 at masked positions."""
    out = []
    for r, m in zip(*_rows(rewards, mask)):
        row, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            if m[t]:
                running = r[t] + gamma * running
                row[t] = running
        out.append(row)
    return _back(out, rewards)


def _groups(group_id):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(group_id.tolist()):
        groups.setdefault(g, []).append(i)
    return groups.values()


def rloo_reference(scores, group_id):
    """``A_i = r_i − mean_{j≠i} r_j`` over the samples of ``i``'s group; 0 for a lone sample."""
    s = scores.tolist()
    out = [0.0] * len(s)
    for members in _groups(group_id):
        for i in members:
            others = [s[j] for j in members if j != i]
            out[i] = s[i] - sum(others) / len(others) if others else 0.0
    return torch.tensor(out, dtype=torch.float64)


def _std(xs):
    n = len(xs)
    if n < 2:
        return 0.0
    mu = sum(xs) / n
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1))


def grpo_reference(scores, group_id, *, scale="group", eps=1e-6):
    """``(r_i − μ_g)/(σ + eps)``, σ unbiased over the group / the batch, or no division."""
    s = scores.tolist()
    out = [0.0] * len(s)
    batch_std = _std(s)
    for members in _groups(group_id):
        xs = [s[i] for i in members]
        mu = sum(xs) / len(xs)
        sigma = {"group": _std(xs), "batch": batch_std}.get(scale)
        for i in members:
            out[i] = s[i] - mu if sigma is None else (s[i] - mu) / (sigma + eps)
    return torch.tensor(out, dtype=torch.float64)


def whiten_reference(x, mask, *, eps=1e-8):
    """``(x − μ)/sqrt(σ² + eps)`` over every valid entry (unbiased σ², 0 for fewer than 2)."""
    vals = [xv for xr, mr in zip(*_rows(x, mask)) for xv, mv in zip(xr, mr) if mv]
    n = len(vals)
    mu = sum(vals) / n if n else 0.0
    var = sum((v - mu) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    out = [[(xv - mu) / math.sqrt(var + eps) if mv else 0.0 for xv, mv in zip(xr, mr)]
           for xr, mr in zip(*_rows(x, mask))]
    return _back(out, x)


def reinforce_pp_reference(rewards, mask, *, gamma=1.0, group_id=None, eps=1e-8):
    """REINFORCE++: whiten the discounted returns; with ``group_id`` (rewards ``[B, T]``), first
    subtract from each row the mean over its group of the summed valid rewards."""
    returns = discounted_returns_reference(rewards, mask, gamma=gamma)
    if group_id is not None:
        seq = [sum(x for x, m in zip(r, mr) if m) for r, mr in zip(*_rows(rewards, mask))]
        base = [0.0] * len(seq)
        for members in _groups(group_id):
            mu = sum(seq[i] for i in members) / len(members)
            for i in members:
                base[i] = mu
        returns = torch.stack([returns[i] - base[i] for i in range(len(seq))])
    return whiten_reference(returns, mask, eps=eps)


def remax_reference(rewards, baseline_scores, mask):
    """``A_t = Σ_{s≥t valid} r_s − b`` at valid positions, 0 elsewhere."""
    out = []
    reward_rows, mask_rows = _rows(rewards, mask)
    for r, b, m in zip(reward_rows, baseline_scores.reshape(-1).tolist(), mask_rows):
        out.append([sum(r[s] for s in range(t, len(r)) if m[s]) - b if m[t] else 0.0 for t in range(len(r))])
    return _back(out, rewards)
