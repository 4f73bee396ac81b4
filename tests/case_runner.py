"""Many cases in one set of spawned ranks: a launch costs seconds, a case milliseconds.

A worker runs every case on its rank and reports each one's traceback (None = passed); the tests
then assert case by case, so one failing case names itself and the others still report.
"""
from __future__ import annotations

import traceback
from typing import Callable, Dict, Iterable, List, Optional


def run_each(cases: Dict[str, Callable[[], object]], names: Iterable[str]) -> Dict[str, Optional[str]]:
    """Run `cases[name]()` for each name in order; name -> None (passed) or the failure's traceback."""
    results = {}
    for name in names:
        try:
            cases[name]()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = traceback.format_exc()
    return results


def assert_case_passed(results: List[Dict[str, Optional[str]]], case: str, context: str) -> None:
    """Fail with every rank's traceback for `case` (results: one dict per rank, from run_each)."""
    failures = [f"--- rank {rank} ---\n{result[case]}" for rank, result in enumerate(results) if result[case]]
    assert not failures, f"{context}:\n" + "\n".join(failures)
