"""Keep the fast tier fast: add the tests measured over a threshold to ``tests/slow_measured.txt``.

    python -m pytest -q -n 2 --dist loadfile -m "not slow" --junitxml=/tmp/fast.xml
    python tests/tiers.py /tmp/fast.xml            # threshold 1.0 s; --threshold S to change it

Every test of that run (the fast tier: none marked ``slow``) that took longer than the threshold
(setup, call and teardown, as the JUnit file reports them) is added to the list, except each
file's cheapest test, so every module keeps a fast one. tests/conftest.py marks the listed tests
``slow`` when it collects them. Entries are only added, never removed by this script: a test made
cheaper goes back to the fast tier by deleting its line. Measure on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path

LIST = Path(__file__).with_name("slow_measured.txt")
HEADER = (
    "# Tests of the slow tier by measurement (tests/tiers.py; docs/DEVELOPMENT.md, 'Two tiers'): each\n"
    "# took longer than the threshold on a quiet 2-core machine. tests/conftest.py marks them slow.\n"
)


def node_id(classname: str, name: str) -> str:
    """``tests.test_x`` / ``tests.test_x.TestK`` and ``test_y[p]`` -> pytest's node id."""
    parts = classname.split(".")
    return "::".join([f"{parts[0]}/{parts[1]}.py", *parts[2:], name])


def read_list(path: Path = LIST) -> set[str]:
    if not path.is_file():
        return set()
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def measured(junit: Path) -> dict[str, dict[str, float]]:
    """Seconds per test, by file, of the tests that ran (skipped ones are left out)."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        nid = node_id(case.get("classname", ""), case.get("name", ""))
        out[nid.split("::")[0]][nid] = float(case.get("time", "0"))
    return out


def slow_ones(times: dict[str, dict[str, float]], threshold: float) -> set[str]:
    slow: set[str] = set()
    for cases in times.values():
        cheapest = min(cases, key=cases.__getitem__)
        slow |= {nid for nid, s in cases.items() if s > threshold and nid != cheapest}
    return slow


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("junit", type=Path, help="the JUnit XML of a fast-tier run (-m 'not slow')")
    p.add_argument("--threshold", type=float, default=1.0, help="seconds (default 1.0)")
    args = p.parse_args()
    before = read_list()
    after = before | slow_ones(measured(args.junit), args.threshold)
    LIST.write_text(HEADER + "".join(f"{nid}\n" for nid in sorted(after)))
    print(f"{len(after) - len(before)} test(s) added, {len(after)} listed in {LIST}")


if __name__ == "__main__":
    main()
