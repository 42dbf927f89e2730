"""compare.py A.xml B.xml [B2.xml ...]: the tests that pass in run A (unpatched) but not in B (patched; later files
override earlier ones, for reruns), and the reverse. Exit status 1 when some test passes only in A."""

import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, str]:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        out.setdefault(f"{case.get('classname')}::{case.get('name')}", outcome)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    a, b = outcomes(argv[0]), {}
    for path in argv[1:]:
        b.update(outcomes(path))
    for name, runs in ((argv[0], a), (" + ".join(argv[1:]), b)):
        counts = {k: sum(v == k for v in runs.values()) for k in ("passed", "failed", "skipped")}
        print(f"{name}: {len(runs)} tests, {counts}")
    worse = sorted(t for t, o in a.items() if o == "passed" and b.get(t) != "passed")
    better = sorted(t for t, o in b.items() if o == "passed" and a.get(t) != "passed")
    print(f"pass unpatched, not patched: {len(worse)}")
    for t in worse:
        print("  ", t, b.get(t, "absent"))
    print(f"pass patched, not unpatched: {len(better)}")
    for t in better:
        print("  ", t, a.get(t, "absent"))
    return 1 if worse else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
