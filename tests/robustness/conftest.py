"""Reports how many fuzz examples ran, per module."""

from tests.robustness.fuzz import CASES, EXAMPLES


def pytest_terminal_summary(terminalreporter):
    if not CASES:  # nothing fuzzed in this process (another selection, or xdist workers hold the counts)
        return
    terminalreporter.section("robustness: fuzz examples run (hypothesis examples x functions)")
    for module, n in sorted(CASES.items()):
        terminalreporter.write_line(f"{module:40s} {n:7d}")
    terminalreporter.write_line(f"{'total':40s} {sum(CASES.values()):7d}   (ROBUSTNESS_EXAMPLES={EXAMPLES})")
