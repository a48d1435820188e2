"""Every public function of rlcore and rlcore.algorithms, fuzzed with hypothesis.

For each entry of the fuzz table (``table.py``): shapes with size-0 and size-1 dims, float64 /
float32 / bfloat16, masks that are all False, all True, random, padded or gapped, extreme but
finite values (±1e4 log-prob gaps, 1e-20 and 1e4 magnitudes, log-probs at and near 0) and
singleton groups. Each example checks finite outputs and gradients, purity, and that NaN at
masked positions changes nothing (``fuzz.check_case``); a smaller number of examples per entry
checks that broken inputs are rejected with errors naming the argument (``fuzz.check_bad_inputs``).
"""

import pytest

from tests.robustness.fuzz import BAD_EXAMPLES, CASES, EXAMPLES, Alias, Draw, check_bad_inputs, check_case, run_examples
from tests.robustness.table import FUZZ

ENTRIES = sorted(k for k, v in FUZZ.items() if not isinstance(v, Alias))


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0]


@pytest.mark.parametrize("name", ENTRIES)
def test_finite_pure_and_padding_blind(name):
    entry = FUZZ[name]

    def example(data):
        d = Draw(data)
        check_case(entry.make(d, d.choice(entry.dtypes, "dtype")), name)
        CASES[_module(name)] += 1

    run_examples(example, max(1, round(EXAMPLES * entry.weight)))


@pytest.mark.parametrize("name", [n for n in ENTRIES if FUZZ[n].bad_inputs])
def test_bad_inputs_are_rejected_by_name(name):
    entry = FUZZ[name]

    def example(data):
        d = Draw(data)
        check_bad_inputs(entry.make(d, d.choice(entry.dtypes, "dtype")), name)
        CASES[_module(name)] += 1

    run_examples(example, BAD_EXAMPLES)


def test_the_strategy_cache_keeps_equal_values_of_other_types_apart():
    """``(0.0, 1.0) == (False, True)`` with equal hashes: a cache keyed by value alone handed a float
    hyper-parameter a bool, depending on which test drew first."""
    import hypothesis.strategies as st

    from tests.robustness.fuzz import _strategy

    assert _strategy(st.sampled_from, (False, True)) is not _strategy(st.sampled_from, (0.0, 1.0))
    assert _strategy(st.sampled_from, (0.0, 1.0)) is _strategy(st.sampled_from, (0.0, 1.0))
