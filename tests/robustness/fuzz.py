"""The fuzzing harness of the robustness suite: input generators, the case runner, input mutations.

A fuzz *entry* turns hypothesis draws into a :class:`Case`: one call of a public function with
every tensor passed by keyword, plus what the checks need to know about it (which leaves are
differentiated, which masks guard which values, which shape changes are legitimate). Three
checks run on cases:

- :func:`check_case`: outputs (and gradients of the differentiable outputs) are finite, the
  function is pure, and NaN written at masked-out positions changes neither outputs nor gradients;
- :func:`check_bad_inputs`: a tensor whose shape no longer fits the others (last dim grown,
  last dim dropped, a trailing dim added) raises ``ValueError`` / ``TypeError`` naming the
  argument (or key) and quoting a shape, or is provably unused (output unchanged); a float or
  integer mask raises ``TypeError`` naming it; a missing TensorDict key raises ``KeyError``
  naming it (or is optional: the call succeeds); a hyper-parameter out of its range (``Case.bad_hyper``:
  NaN, a negative clip range or weight, a wrongly shaped tensor coefficient) raises ``ValueError``
  (``TypeError`` for a wrong dtype) whose message starts with its name;
- counting: every example run is counted per module (:data:`CASES`), reported at the end of the
  session by ``conftest.py``.

Scale with ``ROBUSTNESS_EXAMPLES`` (examples per entry, default 15); ``ROBUSTNESS_RANDOM=1``
draws fresh random examples instead of the reproducible default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDictBase

from rlcore.testing import tensor_leaves, assert_pure, assert_same

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
ALL_DTYPES = (F64, F32, BF16)
EXAMPLES = int(os.environ.get("ROBUSTNESS_EXAMPLES", "15"))
BAD_EXAMPLES = max(3, EXAMPLES // 5)
RANDOM = os.environ.get("ROBUSTNESS_RANDOM") == "1"
CASES: Counter = Counter()  # module -> examples run (fuzz and bad-input examples alike)

Path = str | tuple  # a keyword argument, or (keyword, nested TensorDict key ...)


def run_examples(test: Callable[..., None], n: int) -> None:
    """Run ``test(data, dtype_index)`` on ``n`` hypothesis examples."""
    wrapped = settings(max_examples=n, deadline=None, database=None, derandomize=not RANDOM,
                       suppress_health_check=list(HealthCheck), print_blob=True)(given(data=st.data())(test))
    wrapped()


# --- drawing inputs ---------------------------------------------------------------------------
# "extreme": magnitudes up to the edge of float32 / bfloat16's range (and the smallest normals):
# every pure function is total there (finite outputs and gradients, saturating where a result
# passes the dtype's largest value)
REAL_REGIMES = ("unit", "zero", "tiny", "huge", "mixed", "const", "ties", "extreme")
LOGP_REGIMES = ("typical", "near_zero", "zero", "very_negative", "mixed", "extreme")
EDGE = 3.0e38  # below float32's (3.40e38) and bfloat16's (3.39e38) largest finite values
MASK_KINDS = ("random", "all_true", "all_false", "right", "left", "gapped", "some_empty")
SIZES = (0, 1, 1, 2, 3, 4, 5)


_STRATEGIES: dict = {}


def _typed(a: Any) -> Any:
    """A cache key part that tells equal values of other types apart: ``(0.0, 1.0)`` and ``(False,
    True)`` are equal tuples with equal hashes, and must not share a strategy."""
    if isinstance(a, torch.Tensor):
        return type(a), id(a)
    if isinstance(a, (tuple, list)):
        return type(a), tuple(_typed(x) for x in a)
    return type(a), a


def _strategy(factory: Callable, *args: Any) -> st.SearchStrategy:
    """Strategies are built once and reused: building one per draw dominates small examples."""
    key = (factory, tuple(_typed(a) for a in args))
    if key not in _STRATEGIES:
        _STRATEGIES[key] = factory(*args)
    return _STRATEGIES[key]


class Draw:
    """Hypothesis draws (sizes, regimes, flags) and tensors filled from a seeded generator."""

    def __init__(self, data: Any):
        self.data = data
        self.g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))

    def choice(self, options: Sequence, label: str | None = None) -> Any:
        return self.data.draw(_strategy(st.sampled_from, tuple(options)), label=label)

    def int(self, lo: int, hi: int, label: str | None = None) -> int:
        return self.data.draw(_strategy(st.integers, lo, hi), label=label)

    def flag(self, label: str | None = None) -> bool:
        return self.data.draw(st.booleans(), label=label)

    def size(self, lo: int = 0, label: str | None = None) -> int:
        return self.choice([s for s in SIZES if s >= lo], label)

    def time(self, lo: int = 0, long: bool = False) -> int:
        """A time length; with ``long`` sometimes past one block of the chunked scans (64)."""
        return self.choice([s for s in SIZES + ((65, 130) if long else ()) if s >= lo], "T")

    def _randn(self, shape) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self.g, dtype=F64)

    def reals(self, shape, dtype, regimes: Sequence[str] = REAL_REGIMES, label: str = "reals") -> torch.Tensor:
        """Finite reals of one regime: N(0,1), zeros, ~1e-20, ~1e4, mixed magnitudes, a constant, ties."""
        r = self.choice(regimes, label)
        x = self._randn(shape)
        if r == "zero":
            x = torch.zeros_like(x)
        elif r == "tiny":
            x = x * 1e-20
        elif r == "huge":
            x = x * 1e4
        elif r == "mixed":
            x = x * 10.0 ** torch.randint(-20, 5, tuple(shape), generator=self.g).to(F64)
        elif r == "const":
            x = torch.full_like(x, self.choice((-1e4, -1.0, 0.0, 1.0, 1e4), "const"))
        elif r == "ties":
            x = torch.randint(0, 2, tuple(shape), generator=self.g).to(F64)
        elif r == "extreme":  # magnitudes up to the edge of the range, both signs, and the smallest normals
            edge = torch.rand(tuple(shape), generator=self.g, dtype=F64) * EDGE
            x = torch.where(torch.rand(tuple(shape), generator=self.g) < 0.2, x.sign() * 1.2e-38, x.sign() * edge)
        return x.to(dtype)

    def logprobs(self, shape, dtype, regimes: Sequence[str] = LOGP_REGIMES, label: str = "logp") -> torch.Tensor:
        """Finite log-probabilities (≤ 0): typical, near 0, exactly 0, down to −1e4, or mixed."""
        r = self.choice(regimes, label)
        u = torch.rand(tuple(shape), generator=self.g, dtype=F64)
        typical = -self._randn(shape).abs() * 3
        near = -u * 1e-6
        very = -(1e3 + u * 9e3)
        if r == "typical":
            x = typical
        elif r == "near_zero":
            x = near
        elif r == "zero":
            x = torch.zeros_like(u)
        elif r == "very_negative":
            x = very
        elif r == "extreme":
            x = -u * EDGE
        else:
            pick = torch.randint(0, 4, tuple(shape), generator=self.g)
            x = torch.stack([typical, near, very, torch.zeros_like(u)], -1).gather(-1, pick[..., None])[..., 0]
        return x.to(dtype)

    def mask(self, shape, kind: str | None = None) -> torch.Tensor:
        """A ``[..., T]`` bool mask: random, all True, all False, right/left padded, gapped, empty rows."""
        kind = kind or self.choice(MASK_KINDS, "mask")
        shape = tuple(shape)
        T = shape[-1] if shape else 1
        u = torch.rand(shape, generator=self.g)
        lengths = torch.randint(0, T + 1, shape[:-1], generator=self.g)[..., None] if shape else None
        t = torch.arange(T)
        if kind == "all_true":
            return torch.ones(shape, dtype=torch.bool)
        if kind == "all_false":
            return torch.zeros(shape, dtype=torch.bool)
        if kind == "right":
            return (t < lengths).expand(shape) if shape else torch.tensor(True)
        if kind == "left":
            return (t >= T - lengths).expand(shape) if shape else torch.tensor(True)
        if kind == "gapped":
            right = (t < lengths).expand(shape) if shape else torch.tensor(True)
            return right & (u < 0.7)
        if kind == "some_empty" and len(shape) >= 2:
            rows = torch.rand(shape[:-1], generator=self.g) < 0.5
            return (u < 0.6) & rows[..., None]
        return u < 0.6

    def ints(self, shape, lo: int, hi: int) -> torch.Tensor:
        return torch.randint(lo, hi, tuple(shape), generator=self.g)

    def group_ids(self, B: int) -> torch.Tensor:
        """``[B]`` labels: arbitrary (negative, large) ids, with singletons and unequal groups."""
        kind = self.choice(("consecutive", "random", "singletons", "one_group", "sparse"), "groups")
        if kind == "consecutive":
            G = self.choice([g for g in (1, 2, 3) if B % g == 0] or [1], "G")
            return torch.arange(B) // G
        if kind == "singletons":
            return torch.randperm(B, generator=self.g) * 7 - 3
        if kind == "one_group":
            return torch.full((B,), 5, dtype=torch.long)
        if kind == "sparse":
            return torch.randint(0, 3, (B,), generator=self.g) * 1000 - 1000
        return torch.randint(0, max(B, 1), (B,), generator=self.g)


# --- the case ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """One call ``fn(**kwargs)`` and what the checks need to know about it.

    Attributes:
        fn: the public function.
        kwargs: every argument by keyword (tensors, TensorDicts, hyper-parameters).
        grad: float leaves (paths) that the differentiable outputs are differentiated against.
        masks: mask path -> the paths it guards (values there may hold NaN without effect).
        finite: outputs must be finite (False: a documented exception for these inputs).
        ok: path -> mutations that are legitimate for it ("grow", "drop", "add", "float_mask"):
            a free dimension (the vocabulary of logits), a broadcastable argument.
        known: path -> mutations skipped because of a reported bug in a module still being
            written (each pinned by a strict xfail in ``test_known_issues.py``).
        overflow: output leaves (substrings of their paths) that may overflow to ±inf, never NaN:
            documented exceptions (a perplexity, an exp-based diagnostic).
        grad_overflow: gradients may overflow to ±inf too, never NaN (an overflowing loss).
        pure: run ``assert_pure``.
        bad_hyper: keyword -> values out of its range, each to be refused naming the keyword.
    """

    fn: Callable
    kwargs: dict
    grad: tuple = ()
    masks: dict = dataclasses.field(default_factory=dict)
    finite: bool = True
    ok: dict = dataclasses.field(default_factory=dict)
    known: dict = dataclasses.field(default_factory=dict)
    overflow: tuple = ()
    grad_overflow: bool = False
    pure: bool = True
    bad_hyper: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A fuzz-table row: ``make(draw, dtype) -> Case``, the dtypes to try, an example weight."""

    make: Callable[[Draw, torch.dtype], Case]
    dtypes: tuple = ALL_DTYPES
    weight: float = 1.0
    bad_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class Alias:
    """A public name bound to an object fuzzed under another name (a re-exported registry)."""

    target: str


def _as_path(path: Path) -> tuple:
    return path if isinstance(path, tuple) else (path,)


def get(kwargs: dict, path: Path) -> Any:
    head, *rest = _as_path(path)
    value = kwargs[head]
    return value.get(tuple(rest) if len(rest) > 1 else rest[0]) if rest else value


def replaced(kwargs: dict, path: Path, value: Any = None, *, delete: bool = False) -> dict:
    """A copy of ``kwargs`` with ``path`` replaced (or deleted); inputs are never written."""
    head, *rest = _as_path(path)
    out = dict(kwargs)
    if not rest:
        out[head] = value
        return out
    td = kwargs[head].clone()
    key = tuple(rest) if len(rest) > 1 else rest[0]
    if delete:
        del td[key]
    else:
        td.set(key, value)
    out[head] = td
    return out


def tensor_paths(kwargs: dict) -> Iterator[tuple[Path, torch.Tensor]]:
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, TensorDictBase):
            for key, leaf in value.items(include_nested=True, leaves_only=True):
                yield (name, *_as_path(key)), leaf


def leaves(obj: Any, path: str = "out") -> Iterator[tuple[str, torch.Tensor]]:
    return tensor_leaves(obj, path)


def _name(path: Path) -> str:
    return str(_as_path(path)[-1])


# --- check 1: finite outputs and gradients, purity, masked garbage ------------------------------
def _evaluate(case: Case, kwargs: dict) -> tuple[Any, list]:
    """Outputs, and gradients of Σ(differentiable float outputs) w.r.t. ``case.grad``."""
    grads_of = []
    for path in case.grad:
        leaf = get(kwargs, path).detach().clone().requires_grad_(True)
        kwargs = replaced(kwargs, path, leaf)
        grads_of.append(leaf)
    out = case.fn(**kwargs)
    diff = [t for _, t in leaves(out) if t.is_floating_point() and t.requires_grad]
    grads = []
    if grads_of and diff:
        total = sum(t.double().sum() for t in diff)
        grads = [torch.zeros_like(x) if g is None else g
                 for x, g in zip(grads_of, torch.autograd.grad(total, grads_of, allow_unused=True))]
    return _detached(out), grads


def _detached(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, TensorDictBase):
        return out.detach()
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(_detached(v) for v in out))
    if isinstance(out, (list, tuple)):
        return type(out)(_detached(v) for v in out)
    if isinstance(out, dict):
        return {k: _detached(v) for k, v in out.items()}
    return out


def check_case(case: Case, what: str) -> None:
    out, grads = _evaluate(case, case.kwargs)
    if case.finite:
        for path, t in leaves(out):
            if not t.is_floating_point():
                continue
            if any(name in path for name in case.overflow):
                assert not torch.isnan(t).any(), f"{what}: {path} is NaN for finite inputs:\n{t}"
            else:
                assert torch.isfinite(t).all(), f"{what}: {path} is not finite for finite inputs:\n{t}"
        for path, g in zip(case.grad, grads):
            ok = ~torch.isnan(g) if case.grad_overflow else torch.isfinite(g)
            assert ok.all(), f"{what}: gradient w.r.t. {path} is not finite:\n{g}"
    if case.pure:
        assert_pure(case.fn, **case.kwargs)
    for mask_path, guarded in case.masks.items():
        mask = get(case.kwargs, mask_path)
        kwargs = case.kwargs
        for path in guarded:
            x = get(kwargs, path)
            kwargs = replaced(kwargs, path, torch.where(mask, x, torch.full((), float("nan"), dtype=x.dtype)))
        out2, grads2 = _evaluate(case, kwargs)
        passed_through = [_as_path(p)[1:] for p in guarded if isinstance(p, tuple)]  # inputs in the output
        a, b = out, out2
        for key in passed_through:
            a, b = _without(a, key), _without(b, key)
        assert_same(a, b, what=f"{what}: NaN under {mask_path} = False changed the output")
        assert_same(grads, grads2, what=f"{what}: NaN under {mask_path} = False changed the gradient")


# --- check 2: invalid inputs ---------------------------------------------------------------------
_SHAPES = re.compile(r"\[[\w ,]*\]")
_NAMED = re.compile(r"^[\w.\[\]'\"()]+: ")  # "name: expected ..." as rlcore.checks words it


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _mutations(t: torch.Tensor, batch_dims: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Shape changes that break the fit with the other arguments (leaves of a TensorDict keep
    their batch dims)."""
    if t.ndim > batch_dims:
        last = t.shape[-1]
        yield "grow", torch.cat([t, t[..., -1:]], -1) if last else t.new_zeros(*t.shape[:-1], 1)
        yield "drop", t[..., 0] if last else t.new_zeros(t.shape[:-1])
    yield "add", t[..., None]


def _without(out: Any, key: tuple) -> Any:
    """``out`` with ``key`` removed from every TensorDict in it (an input passed through)."""
    if isinstance(out, TensorDictBase):
        return out.exclude(key)
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(_without(v, key) for v in out))
    if isinstance(out, (list, tuple)):
        return type(out)(_without(v, key) for v in out)
    return out


def _expect_rejected(case: Case, what: str, path: Path, kwargs: dict, old: torch.Tensor, new: torch.Tensor,
                     clean: Any, kinds: tuple[type, ...], mutation: str) -> None:
    """``fn(**kwargs)`` must raise one of ``kinds`` naming the argument broken (``path``; for a
    TensorDict leaf, its key) and quoting a shape, or leave the result unchanged (it is unused)."""
    name = _name(path)
    try:
        out = case.fn(**kwargs)
    except kinds as e:
        msg = str(e)
        assert _NAMED.match(msg), f"{what}: {mutation} of {path} raised {type(e).__name__} naming no argument: {msg}"
        # the argument (or batch key) broken, not the kernel argument it feeds
        assert name in msg, f"{what}: {mutation} of {path} raised {type(e).__name__} naming another argument: {msg}"
        if kinds != (TypeError,):  # the broken shape, or an expected and a seen one ("[B, T]", "[3]")
            assert _fmt(new.shape) in msg or _fmt(old.shape) in msg or len(_SHAPES.findall(msg)) >= 2, \
                f"{what}: {mutation} of {path} {_fmt(old.shape)} -> {_fmt(new.shape)} raised {type(e).__name__} " \
                f"quoting neither shape: {msg}"
        return
    except Exception as e:  # noqa: BLE001 - the point: anything but the documented error types
        raise AssertionError(f"{what}: {mutation} of {path} {_fmt(old.shape)} -> {_fmt(new.shape)} raised "
                             f"{type(e).__name__} instead of {' / '.join(k.__name__ for k in kinds)} "
                             f"naming {name!r}: {e}") from e
    key = _as_path(path)[1:]
    try:
        assert_same(_without(clean, key) if key else clean, _without(out, key) if key else out)
    except AssertionError as e:
        raise AssertionError(f"{what}: {mutation} of {path} {_fmt(old.shape)} -> {_fmt(new.shape)} was "
                             f"accepted silently and changed the result") from e


def _rewinding(case: Case) -> Case:
    """``case`` whose function rewinds the generators among its arguments before every call."""
    gens = [(g, g.get_state()) for g in case.kwargs.values() if isinstance(g, torch.Generator)]
    if not gens:
        return case

    def fn(**kwargs):
        for g, state in gens:
            g.set_state(state)
        return case.fn(**kwargs)

    return dataclasses.replace(case, fn=fn)


def _expect_refused(case: Case, what: str, name: str, value: Any) -> None:
    """``fn`` with the keyword ``name`` set to ``value`` raises ``ValueError`` (or ``TypeError``) whose
    message starts with ``name``."""
    try:
        case.fn(**replaced(case.kwargs, name, value))
    except (ValueError, TypeError) as e:
        assert str(e).startswith(f"{name}: "), f"{what}: {name}={value!r} raised {type(e).__name__} not naming it: {e}"
        return
    except Exception as e:  # noqa: BLE001 - the point: anything but the documented error types
        raise AssertionError(f"{what}: {name}={value!r} raised {type(e).__name__} instead of a ValueError "
                             f"naming {name!r}: {e}") from e
    raise AssertionError(f"{what}: {name}={value!r} was accepted (out of its range)")


def check_bad_inputs(case: Case, what: str) -> int:
    """Mutate every tensor argument / TensorDict leaf, and set each ``case.bad_hyper`` keyword to its
    values out of range; return how many mutations were tried."""
    case = _rewinding(case)
    clean = _detached(case.fn(**case.kwargs))
    kernel_tensors = [p for p, v in case.kwargs.items() if isinstance(v, torch.Tensor)]
    tried = 0
    for path, t in list(tensor_paths(case.kwargs)):
        ok = case.ok.get(path, ()) + case.known.get(path, ())
        in_td = isinstance(path, tuple)
        batch_dims = case.kwargs[path[0]].batch_dims if in_td else 0
        lone = not in_td and len(kernel_tensors) == 1  # a lone tensor argument fits any shape
        if not lone:
            for mutation, new in _mutations(t, batch_dims):
                if mutation in ok:
                    continue
                tried += 1
                _expect_rejected(case, what, path, replaced(case.kwargs, path, new), t, new, clean,
                                 (ValueError, TypeError), mutation)
        if t.dtype == torch.bool and "float_mask" not in ok:
            for bad in (t.float(), t.long()):
                tried += 1
                _expect_rejected(case, what, path, replaced(case.kwargs, path, bad), t, bad, clean,
                                 (TypeError,), f"{bad.dtype} mask")
        if in_td:
            tried += 1
            try:
                case.fn(**replaced(case.kwargs, path, delete=True))
            except KeyError as e:
                assert _name(path) in str(e), f"{what}: deleting {path} raised KeyError not naming it: {e}"
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"{what}: deleting {path} raised {type(e).__name__} instead of a "
                                     f"KeyError naming it: {e}") from e
    for name, values in case.bad_hyper.items():
        for value in values:
            tried += 1
            _expect_refused(case, what, name, value)
    return tried
