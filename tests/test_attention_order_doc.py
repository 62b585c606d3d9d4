"""The attention-backend order in docs/writing-a-plugin.md is `turnout plugins --order` as it prints it for
the installed plugins on the CPU (scripts/attention_order.py writes it; `make docs` runs that)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import attention_order  # noqa: E402


def test_the_documented_order_is_the_one_turnout_prints():
    if libraries := [m for m in ("flashinfer", "flash_attn") if importlib.util.find_spec(m)]:
        pytest.skip(
            f"the doc holds the order without FlashInfer and FlashAttention; {libraries} installed here"
        )
    rows = attention_order.live()
    assert {(r["platform"], r["phase"]) for r in rows} == {
        (p, phase) for p in ("cpu", "cuda sm80", "cuda sm90") for phase in ("decode", "mixed")
    }
    documented = attention_order.in_doc(attention_order.DOC.read_text())
    assert documented == attention_order.render(rows), "run make docs (python scripts/attention_order.py)"
    assert all(f" {name} " in documented for name in ("cpu", "triton", "flashinfer", "flash_attn"))
