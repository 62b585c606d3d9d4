"""Run benchmark suites (benchmarks/suites.py) and file their results under benchmarks/results/<suite>/.

  python benchmarks/run.py --list
  python benchmarks/run.py throughput latency prefix [--copy-to DIR] [--dry-run]

Commands run one after another from the repository root; a failing command is reported and the rest still
run. Afterwards the results index (benchmarks/results/README.md) is regenerated. Where the tree is a copy
without git metadata, set BENCH_COMMIT=<commit> so that the records name it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from suites import NO_MULTICAST, SUITES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROGRAMS = {"turnout": [sys.executable, "-m", "turnout.cli"], "python": [sys.executable],
            "pytest": [sys.executable, "-m", "pytest"]}  # fmt: skip


def argv(command: str, fill: dict[str, str]) -> list[str]:
    words = shlex.split(command.format(**fill))
    return PROGRAMS.get(words[0], words[:1]) + words[1:]


def run_suite(name: str, dry_run: bool) -> tuple[list[Path], int]:
    """Run one suite's commands; return the files it added and how many commands failed."""
    suite, out = SUITES[name], RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.iterdir())
    tmp = tempfile.mkdtemp(prefix=f"bench-{name}-")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d-%H%M")
    fill = {"out": str(out.relative_to(ROOT)), "tmp": tmp, "stamp": stamp}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **NO_MULTICAST}
    env.update({k: v.format(**fill) for k, v in suite.env.items()})
    failed = 0
    print(f"== {name}: {suite.about}", flush=True)
    for command in suite.commands:
        print(f"$ {command.format(**fill)}", flush=True)
        if dry_run:
            continue
        try:
            rc = subprocess.run(argv(command, fill), cwd=ROOT, env=env, timeout=suite.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc != 0:
            failed += 1
            print(f"FAILED ({rc}): {command.format(**fill)}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return sorted(set(out.iterdir()) - before), failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="*", help="suite names (see --list)")
    ap.add_argument("--list", action="store_true", help="print every suite and its commands")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--copy-to", help="also copy the new result files here, one folder per suite")
    args = ap.parse_args()
    if args.list or not args.suites:
        for name, s in SUITES.items():
            print(f"{name} ({'any machine' if not s.gpus else f'{s.gpus} GPU'}): {s.about}")
            print("".join(f"  {c}\n" for c in s.commands), end="")
        return 0
    if unknown := [s for s in args.suites if s not in SUITES]:
        sys.exit(f"run.py: unknown suite {unknown[0]!r}; --list shows them")
    failed = 0
    for name in args.suites:
        added, n = run_suite(name, args.dry_run)
        failed += n
        for f in added:
            print(f"  new: {f.relative_to(ROOT)}")
            if args.copy_to:
                (Path(args.copy_to) / name).mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, Path(args.copy_to) / name / f.name)
    if not args.dry_run:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "index.py")], cwd=ROOT)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
