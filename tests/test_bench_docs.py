"""The repository as a document: results carry their provenance, the index and docs/performance.md are
generated from them and current, the suites' commands are valid, and no file narrates how it was made."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from turnout.bench import records
from turnout.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import index  # noqa: E402
import report  # noqa: E402
from suites import SUITES  # noqa: E402

RESULT_FILES = sorted((ROOT / "benchmarks" / "results").glob("*/*.json"))


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_result_carries_its_provenance(path):
    doc = json.loads(path.read_text())
    if isinstance(doc, list):  # turnout bench records
        for rec in doc:
            records.check(rec)
    else:
        assert {"date", "device", "commit", "command", "results"} <= set(doc), path.name
        if doc.get("log"):
            assert (path.parent / doc["log"]).is_file()


def test_results_index_and_performance_doc_are_generated_and_current():
    assert (ROOT / "benchmarks/results/README.md").read_text() == index.render(), "run benchmarks/index.py"
    assert (ROOT / "docs/performance.md").read_text() == report.render(), "run benchmarks/report.py"
    readme = (ROOT / "README.md").read_text()
    assert report.HEADLINE[0] in readme and report.with_headline(readme) == readme, "run benchmarks/report.py"


def test_performance_doc_cites_every_number_source():
    text = (ROOT / "docs/performance.md").read_text()
    cited = set(re.findall(r"\(\.\./(benchmarks/results/[^)]+\.json)\)", text))
    assert cited and all((ROOT / c).is_file() for c in cited)
    for section in text.split("\n## ")[1:]:  # each holds tables with their files, or says none is recorded
        has_table = "\n| " in section
        assert ("benchmarks/results/" in section) == has_table, section[:60]
        assert has_table or "No record yet: `python benchmarks/run.py" in section, section[:60]


def test_suite_commands_are_valid():
    fill = {"out": "benchmarks/results/x", "stamp": "s", "tmp": "/tmp/x"}
    for name, suite in SUITES.items():
        for command in suite.commands:
            words = shlex.split(command.format(**fill))
            if words[0] == "turnout":
                build_parser().parse_args(words[1:])
            elif words[0] == "python":
                assert (ROOT / words[1]).is_file(), (name, words[1])
            else:
                assert words[0] == "pytest" and all(
                    (ROOT / w).is_file() for w in words if w.startswith("tests/")
                )


NARRATION = re.compile(
    r"\bsessions?\b|stash|not yet re-?run|last GPU call|device machine|\.device-wheels|before the fix"
    r"|\bsession ?\d|\bs\d[a-e]?\b|run_h200",
    re.IGNORECASE,
)


def test_no_narration_of_how_the_project_was_made():
    paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").iterdir()]
    paths += [p for p in (ROOT / "benchmarks").rglob("*") if p.is_file()]
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in paths for m in NARRATION.finditer(p.read_text())]
    assert not hits, hits


def _records(workload: str, rows: dict[tuple[str, str], dict]) -> list[dict]:
    base = dict(workload=workload, model="random-qwen3-8b", device="NVIDIA H200", commit="c", command="x",
                date="2026-12-02T00:00:00+00:00")  # fmt: skip
    out = []
    for (engine, run), metrics in rows.items():
        cfg = {"version": "0.26.0"} if engine == "vllm" else {"attention": "triton", "graph_mode": "FULL"}
        out.append({**base, "engine": engine, "run": run, "config": cfg, **metrics})
    return out


def test_vllm_ratios_reach_the_tables_and_the_headline(tmp_path, monkeypatch):
    runs = ("first", "repeat")
    tp = _records("throughput", {
        ("turnout", "first"): dict(output_tokens_per_s=900.0, ratio_vs_vllm=0.9, num_prompts=256),
        ("turnout", "repeat"): dict(output_tokens_per_s=2200.0, ratio_vs_vllm=1.1, num_prompts=256),
        ("vllm", "first"): dict(output_tokens_per_s=1000.0, num_prompts=256),
        ("vllm", "repeat"): dict(output_tokens_per_s=2000.0, num_prompts=256),
    })  # fmt: skip
    ours = dict(tpot_ms=5.0, ttft_ms={"4096": 100.0, "32768": 900.0}, tpot_ratio_vs_vllm=0.98,
                ttft_ratio_vs_vllm={"4096": 1.25, "32768": 0.75})  # fmt: skip
    theirs = dict(tpot_ms=5.1, ttft_ms={"4096": 80.0, "32768": 1200.0})
    lat = _records("latency", {**{("turnout", r): ours for r in runs}, **{("vllm", r): theirs for r in runs}})
    results = tmp_path / "benchmarks/results"
    for workload, recs in (("throughput", tp), ("latency", lat)):
        for r in recs:
            records.check(r)
        (results / workload).mkdir(parents=True)
        (results / workload / f"2026-12-02-0000-h200-{workload}-triton.json").write_text(json.dumps(recs))
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", results)
    throughput = "\n".join(report.bench_section("throughput"))
    assert "| x vLLM |" in throughput and "| turnout | first | 256 | 900 | 0.9 |" in throughput
    latency = "\n".join(report.bench_section("latency"))
    assert "TTFT / vLLM's by prompt" in latency and "4096: 1.25x, 32768: 0.75x" in latency
    lines = report.headline()
    assert "(0.90x and 1.10x vLLM in the same run)" in lines[0]
    (vs,) = [line for line in lines if line.startswith("- Against vLLM")]
    assert vs.startswith("- Against vLLM 0.26.0 in the same run, random-qwen3-8b on NVIDIA H200: ")
    assert "output tok/s 0.90x and 1.10x vLLM's on the first run and a repeat" in vs
    assert "on the first run (below 1 is faster): TPOT 0.98x, TTFT 1.25x at 4096, 0.75x at 32768" in vs


def test_structured_records_reach_their_table(tmp_path, monkeypatch):
    common = dict(num_prompts=256, num_completed=0, mean_output_len=560.0, startup_s=9.0)
    (one,) = _records("structured", {("turnout", "first"): common})
    recs = [
        {**one, "structured_output_ratio": r, "num_constrained": round(256 * r), "output_tokens_per_s": c,
         "unconstrained_output_tokens_per_s": 1000.0, "structured_cost": 1 - c / 1000}
        for r, c in ((1.0, 920.0), (0.25, 985.0))
    ]  # fmt: skip
    for r in recs:
        records.check(r)
    folder = tmp_path / "benchmarks/results/structured"
    folder.mkdir(parents=True)
    (folder / "2026-12-02-0000-h200-structured-triton.json").write_text(json.dumps(recs))
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path / "benchmarks/results")
    text = "\n".join(report.bench_section("structured"))
    assert "| share constrained | requests | grammars completed |" in text
    assert "| 1 | 256 | 0 | 560 | 920 | 1,000 | 8.0% | 9 |" in text and "| 0.25 | 256 |" in text
    assert "1.5%" in text


def test_attention_cells_are_each_backend_s_own_newest(tmp_path, monkeypatch):
    """A file of two backends gives each its own row; a newer file of one backend and case replaces only that
    cell; a file at other heads, or of an FP8 cache, stays out of the 32 / 8 bf16-cache table."""

    def row(backend: str, ms: float, batch: int = 256) -> dict:
        return dict(backend=backend, kind="decode", batch=batch, context=1024, block_size=16, eager_ms=ms,
                    graph_ms=ms, meta_ms=0.0, gbps=1.0, pct_peak=ms * 100)  # fmt: skip

    folder = tmp_path / "benchmarks/results/attention"
    folder.mkdir(parents=True)
    head = dict(device="NVIDIA H200", date="2026-12-02T00:00:00+00:00", command="bench_attention.py")
    docs = {
        "2026-12-01-h200-both.json": dict(
            commit="aaaaaaa",
            results=[row("flashinfer", 0.5), row("triton", 0.3), row("triton", 0.04, batch=1)],
        ),
        "2026-12-02-h200-triton.json": dict(commit="bbbbbbb", results=[row("triton", 0.2)]),
        "2026-12-03-h200-other-heads.json": dict(commit="ccccccc", config=dict(num_heads=16, num_kv_heads=8),
                                                  results=[row("triton", 0.1), row("flashinfer", 0.1)]),
        "2026-12-04-h200-fp8-kv.json": dict(commit="ddddddd", config=dict(kv_cache_dtype="fp8"),
                                            results=[row("triton", 0.1), row("flashinfer", 0.1)]),
    }  # fmt: skip
    for name, doc in docs.items():
        (folder / name).write_text(json.dumps(head | doc))
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "RESULTS", tmp_path / "benchmarks/results")
    text = "\n".join(report.attention_section())
    assert "| decode b256 x 1024 | 0.5 ms, 50% of peak | 0.2 ms, 20% of peak |" in text
    assert "| decode b1 x 1024 | - | 0.04 ms, 4% of peak |" in text
    assert "other-heads" not in text and "fp8-kv" not in text


def test_benchmarks_readme_indexes_every_script_and_suite():
    text = (ROOT / "benchmarks/README.md").read_text()
    scripts = [p.name for p in sorted((ROOT / "benchmarks").glob("*.py"))]
    missing = [s for s in (*scripts, *SUITES) if f"`{s}`" not in text]
    assert not missing, f"benchmarks/README.md does not name {missing}"


def test_conformance_summary_names_the_backend_of_every_case(tmp_path):
    """Every case of the conformance suite, as pytest names it in a JUnit report, counts under its backend."""
    import subprocess
    import xml.etree.ElementTree as ET

    suite = "tests/test_attention_conformance.py"
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", suite],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    names = [line.split("::", 1)[1] for line in listed if line.startswith(suite + "::")]
    root = ET.Element("testsuite")
    for name in names:
        ET.SubElement(root, "testcase", classname="tests.test_attention_conformance", name=name)
    ET.ElementTree(root).write(tmp_path / "conf.xml")
    out = tmp_path / "summary.json"
    script = ROOT / "benchmarks" / "summarize_conformance.py"
    args = ["--errors", str(tmp_path / "none.tsv"), "--junit", str(tmp_path / "conf.xml"), "--json", str(out)]
    subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, check=True)
    rows = {r["backend"]: r["passed"] for r in json.loads(out.read_text())["results"]}
    assert "?" not in rows and sum(rows.values()) == len(names) > 100, rows
