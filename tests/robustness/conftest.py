"""Reports how many fuzz examples ran, per module, and the errors that blame another argument."""

import os

from tests.robustness.fuzz import CASES, EXAMPLES, WEAK

SHOWN = int(os.environ.get("ROBUSTNESS_SHOW", "10"))


def pytest_terminal_summary(terminalreporter):
    if not CASES:  # nothing fuzzed in this process (another selection, or xdist workers hold the counts)
        return
    terminalreporter.section("robustness: fuzz examples run (hypothesis examples x functions)")
    for module, n in sorted(CASES.items()):
        terminalreporter.write_line(f"{module:40s} {n:7d}")
    terminalreporter.write_line(f"{'total':40s} {sum(CASES.values()):7d}   (ROBUSTNESS_EXAMPLES={EXAMPLES})")
    if WEAK:
        terminalreporter.section(f"robustness: {len(WEAK)} rejections naming another argument than the one "
                                 f"broken (not failures; ROBUSTNESS_SHOW={SHOWN} of them)")
        for (entry, path, mutation), msg in sorted(WEAK.items())[:SHOWN]:
            terminalreporter.write_line(f"{entry} {mutation} {path}: {msg[:150]}")
