"""Built-in tasks with verifiable rewards, generated offline: a battery of nine.

Arithmetic with carries and borrows (``add``, ``sub``, ``mul``), string transforms (``reverse``,
``sort``), counting (``count``), comparison (``max``), a two-step format (``radd``: add, then write
the sum backwards) and a yes/no judgement (``parity``). ``BUILTIN_TASKS`` lists them with an
example each; ``--task NAME`` picks one from the CLI.

A task makes ``(prompt, answer)`` pairs from a seeded ``random.Random`` and scores completions
against the answer. Every task gives:

- ``task_dataset(name, n, seed=, split=)``: a ``datasets.Dataset`` with columns ``prompt``,
  ``completion`` (the answer, for SFT) and ``answer`` (for the reward), train and held-out
  ``eval`` splits disjoint by construction (a prompt's split is a hash of its text);
- ``task_reward(name)``: a reward function ``(prompts, completions, *, answer, **kwargs) -> list[float]``:
  1 for an exact answer; for a task with partial credit (``Task.partial_credit``) otherwise
  ``0.5 ×`` the fraction of answer positions that match, so a tiny model gets a signal before it
  is ever exactly right; for the others (``count``, ``max``, ``parity``: a short answer is right
  or wrong) 0;
- ``preference_dataset(name, n, seed=)``: ``prompt``/``chosen``/``rejected`` pairs, the rejected
  answer a near miss (one digit or letter changed, dropped or swapped), for DPO-style recipes.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from datasets import Dataset

from rlcore.checks import lookup

__all__ = ["Task", "BUILTIN_TASKS", "get_task", "task_dataset", "task_reward", "preference_dataset", "exact_match",
           "answer_reward", "completion_text"]

LETTERS = "abcdefghij"


@dataclass(frozen=True)
class Task:
    """A generator of ``(prompt, answer)`` pairs. ``make(rng) -> (prompt, answer)``."""

    name: str
    make: Callable[[random.Random], tuple[str, str]]
    alphabet: str  # characters answers are made of (used to corrupt answers)
    description: str
    partial_credit: bool = True  # False: the reward is 1 for the exact answer, else 0


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}=", str(a + b)


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))
    return f"sort {digits}:", "".join(sorted(digits))


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
    return f"rev {word}:", word[::-1]


def _sub(rng: random.Random) -> tuple[str, str]:
    a, b = sorted((rng.randint(0, 99), rng.randint(0, 99)), reverse=True)
    return f"{a}-{b}=", str(a - b)


def _mul(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 9), rng.randint(10, 99)
    return f"{a}*{b}=", str(a * b)


def _count(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abc") for _ in range(rng.randint(4, 8)))
    letter = rng.choice("abc")
    return f"count {letter} {word}:", str(word.count(letter))


def _max(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randint(10, 99) for _ in range(3)]
    return f"max {' '.join(map(str, numbers))}:", str(max(numbers))


def _parity(rng: random.Random) -> tuple[str, str]:
    bits = "".join(rng.choice("01") for _ in range(rng.randint(4, 8)))
    return f"parity {bits}:", "odd" if bits.count("1") % 2 else "even"


def _radd(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"radd {a}+{b}=", str(a + b)[::-1]


BUILTIN_TASKS: dict[str, Task] = {
    "add": Task("add", _add, "0123456789", "two-digit addition: '12+7=' -> '19'"),
    "sub": Task("sub", _sub, "0123456789", "two-digit subtraction, borrows, never negative: '52-17=' -> '35'"),
    "mul": Task("mul", _mul, "0123456789", "one digit times two: '7*36=' -> '252'"),
    "sort": Task("sort", _sort, "0123456789", "sort 3-5 digits: 'sort 312:' -> '123'"),
    "reverse": Task("reverse", _reverse, LETTERS, "reverse a word: 'rev abc:' -> 'cba'"),
    "count": Task("count", _count, "0123456789", "count a letter: 'count a abca:' -> '2'", partial_credit=False),
    "max": Task("max", _max, "0123456789", "the largest of three: 'max 37 52 19:' -> '52'", partial_credit=False),
    "parity": Task("parity", _parity, "evnod", "odd or even number of ones: 'parity 1101:' -> 'odd'",
                   partial_credit=False),
    "radd": Task("radd", _radd, "0123456789", "add, then write the sum backwards: 'radd 12+35=' -> '74'"),
}


def get_task(name: str) -> Task:
    """The task called ``name``; unknown names raise ``ValueError`` listing the valid ones."""
    return lookup(BUILTIN_TASKS, name, what="task")


def _split_of(prompt: str, eval_fraction: float) -> str:
    return "eval" if zlib.crc32(prompt.encode()) % 1000 < eval_fraction * 1000 else "train"


def _pairs(name: str, n: int, seed: int, split: str, eval_fraction: float) -> list[tuple[str, str]]:
    if split not in ("train", "eval"):
        raise ValueError(f"split: expected 'train' or 'eval', got {split!r}")
    task, rng, out = get_task(name), random.Random(seed), []
    for _ in range(200 * n):
        prompt, answer = task.make(rng)
        if _split_of(prompt, eval_fraction) == split:
            out.append((prompt, answer))
            if len(out) == n:
                return out
    raise ValueError(f"task {name!r}: could not draw {n} distinct {split} examples")


def task_dataset(name: str, n: int, *, seed: int = 0, split: str = "train",
                 eval_fraction: float = 0.2) -> Dataset:
    """``n`` examples of task ``name`` from ``split`` ("train" or "eval"; disjoint prompts).

    Columns: ``prompt``, ``completion`` (= the answer) and ``answer``.
    """
    pairs = _pairs(name, n, seed, split, eval_fraction)
    return Dataset.from_dict({"prompt": [p for p, _ in pairs], "completion": [a for _, a in pairs],
                              "answer": [a for _, a in pairs]})


def exact_match(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 where the stripped completion equals the answer, else 0.0."""
    return [float(c.strip() == a) for c, a in zip(completions, answers)]


def answer_reward(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1 for an exact answer, else ``0.5 · (matching positions) / max(len(completion), len(answer))``."""
    scores = []
    for c, a in zip(completions, answers):
        c = c.strip()
        if c == a:
            scores.append(1.0)
        else:
            same = sum(x == y for x, y in zip(c, a))
            scores.append(0.5 * same / max(len(c), len(a), 1))
    return scores


def completion_text(completion: str | Sequence[dict]) -> str:
    """A completion's text: itself, or the content of its last message (a conversational completion,
    ``[{"role": "assistant", "content": text}]``)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def task_reward(name: str) -> Callable[..., list[float]]:
    """The reward function of task ``name``: ``(prompts, completions, *, answer, **kwargs) -> scores``,
    each completion a string or a conversational completion (its message's content is scored)."""
    score = answer_reward if get_task(name).partial_credit else exact_match

    def reward(prompts: Sequence, completions: Sequence, *, answer: Sequence[str], **kwargs) -> list[float]:
        return score([completion_text(c) for c in completions], answer)

    reward.__name__ = f"{name}_reward"
    return reward


def _near_miss(answer: str, alphabet: str, rng: random.Random) -> str:
    for _ in range(100):
        chars, i = list(answer), rng.randrange(len(answer))
        kind = rng.choice(["change", "drop", "swap"] if len(answer) > 1 else ["change"])
        if kind == "change":
            chars[i] = rng.choice(alphabet)
        elif kind == "drop":
            del chars[i]
        else:
            j = (i + 1) % len(chars)
            chars[i], chars[j] = chars[j], chars[i]
        wrong = "".join(chars)
        if wrong != answer:
            return wrong
    return answer + alphabet[0]


def preference_dataset(name: str, n: int, *, seed: int = 0, split: str = "train",
                       eval_fraction: float = 0.2) -> Dataset:
    """Preference pairs: ``prompt``, ``chosen`` (the answer), ``rejected`` (a near miss)."""
    task, rng = get_task(name), random.Random(seed + 1)
    pairs = _pairs(name, n, seed, split, eval_fraction)
    return Dataset.from_dict({
        "prompt": [p for p, _ in pairs],
        "chosen": [a for _, a in pairs],
        "rejected": [_near_miss(a, task.alphabet, rng) for _, a in pairs],
        "answer": [a for _, a in pairs],
    })
