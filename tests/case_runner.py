"""Many cases in one set of spawned ranks: a launch costs seconds, a case milliseconds.

A worker runs every case on its rank and reports each one's traceback (None = passed); the tests
then assert case by case, so one failing case names itself and the others still report.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, Dict, Iterable, List, Optional


def run_each(cases: Dict[str, Callable[[], object]], names: Iterable[str]) -> Dict[str, Optional[str]]:
    """Run `cases[name]()` for each name in order; name -> None (passed) or the failure's traceback.
    With EP_TEST_TRACE_CASES=1 each case's name goes to stderr as it starts and ends, so that a rank whose
    process dies (a device fault aborts it) still shows which case it was in."""
    trace = os.environ.get("EP_TEST_TRACE_CASES", "0") == "1"
    results = {}
    for name in names:
        if trace:
            print(f"case_runner: pid {os.getpid()} starting {name}", file=sys.stderr, flush=True)
        try:
            cases[name]()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = traceback.format_exc()
        if trace:
            outcome = "passed" if results[name] is None else results[name].strip().splitlines()[-1][:300]
            print(f"case_runner: pid {os.getpid()} {name}: {outcome}", file=sys.stderr, flush=True)
    return results


def assert_case_passed(results: List[Dict[str, Optional[str]]], case: str, context: str) -> None:
    """Fail with every rank's traceback for `case` (results: one dict per rank, from run_each)."""
    failures = [f"--- rank {rank} ---\n{result[case]}" for rank, result in enumerate(results) if result[case]]
    assert not failures, f"{context}:\n" + "\n".join(failures)
