"""Per-backend pass/fail counts and largest relative error of a conformance run on the GPU machine.

TURNOUT_CONFORMANCE_ERRORS=errs.tsv pytest tests/test_attention_conformance.py --junitxml=a.xml ...
python benchmarks/summarize_conformance.py --errors errs.tsv --junit a.xml b.xml --json conformance.json
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402

from turnout.bench import table  # noqa: E402

BACKENDS = ("flash_attn", "flashinfer", "triton", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--errors", required=True)
    ap.add_argument("--junit", nargs="+", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for path in args.junit:
        if not Path(path).exists():
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("name", "")
            words = re.sub(r"[-_\[\]]", " ", name)  # test_triton_decode[...] names triton too
            be = next((b for b in BACKENDS if re.search(rf"\b{b.replace('_', ' ')}\b", words)), "?")
            kind = "skipped" if case.find("skipped") is not None else "passed"
            if case.find("failure") is not None or case.find("error") is not None:
                kind = "failed"
            counts[be][kind] += 1
    worst: dict[str, tuple[float, str]] = {}
    if Path(args.errors).exists():
        for line in Path(args.errors).read_text().splitlines():
            be, dtype, head, gqa, batch, err = line.split("\t")
            if float(err) > worst.get(be, (-1.0, ""))[0]:
                worst[be] = (float(err), f"{batch} gqa{gqa} d{head} {dtype}")
    rows = []
    for be, c in sorted(counts.items()):
        err, case = worst.get(be, (float("nan"), ""))
        got = {k: c[k] for k in ("passed", "failed", "skipped")}
        rows.append({"backend": be, **got, "max_rel_err": f"{err:.2e}", "worst_case": case})
    print(table(rows))
    write_json(args.json, rows, args)


if __name__ == "__main__":
    main()
