"""Architecture coverage: tiny random models of many transformers architectures × five kernels.

Each architecture either runs every kernel (finite output, every attached kernel called, softmax equal to the
unpatched SDPA model on unpadded inputs) or is refused with a ValueError / NotImplementedError raised by
hf_kernel_attn that names the reason (EXPECTED_ERRORS). KNOWN_BUGS are architectures that currently fail in
another way; they xfail while the failure is exactly the known one and fail loudly once fixed, so that the entry
is removed and docs/architectures.md regenerated (``python scripts/architecture_table.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_kernel_attn.testing import architectures as A

DOCS = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"

SLIDING = "uses sliding-window attention"
NO_INTERFACE = "does not route its attention through transformers' AttentionInterface"
# architecture (row name) -> substring of the refusal every non-ok cell must raise
EXPECTED_ERRORS: dict[str, str] = {
    "mistral (sliding_window=4)": SLIDING,
    "ministral": SLIDING,
    "qwen2 (use_sliding_window)": SLIDING,
    "gemma2": SLIDING,
    "gemma3_text": SLIDING,
    "cohere2": SLIDING,
    "olmo3": SLIDING,
    "exaone4": SLIDING,
    "modernbert": SLIDING,
    "falcon": NO_INTERFACE,
    "gpt_neo": NO_INTERFACE,
    "bloom": NO_INTERFACE,
    "xglm": NO_INTERFACE,
    "mpnet": NO_INTERFACE,
    "deberta-v2": NO_INTERFACE,
}
# architecture -> (cell status, substring of its error) of a failure that is not a clear refusal
KNOWN_BUGS: dict[str, tuple[str, str]] = {
    # T5's encoder and decoder stacks hold deep copies of the config; patch() switches only model.config, so
    # the attention modules keep running SDPA and the attached kernels are never called
    "t5": ("not run", "of 6 attached kernels were called"),
    "mt5": ("not run", "of 6 attached kernels were called"),
}
MIN_ALL_OK = 45  # architectures that run all five kernels today (a floor: raise it when more run)

_ROWS: dict[str, dict] = {}


def _row(arch: A.Architecture) -> dict:
    if arch.name not in _ROWS:
        _ROWS[arch.name] = A.run_architecture(arch)
    return _ROWS[arch.name]


def _describe(row: dict) -> str:
    return "; ".join(A.row_errors(row)) or "all ok"


def test_registry_sizes():
    names = [a.name for a in A.ARCHITECTURES]
    assert len(names) == len(set(names))
    assert len({a.model_type for a in A.ARCHITECTURES}) >= 35
    assert set(EXPECTED_ERRORS) | set(KNOWN_BUGS) <= set(names)


@pytest.mark.parametrize("arch", A.ARCHITECTURES, ids=lambda a: a.name)
def test_architecture(arch):
    row = _row(arch)
    assert "build_error" not in row, f"the tiny {arch.name} model itself failed: {_describe(row)}"
    cells = row["cells"]
    assert set(cells) == set(A.KERNELS)
    if arch.name in KNOWN_BUGS:
        status, text = KNOWN_BUGS[arch.name]
        if all(c["status"] == status and text in c.get("error", "") for c in cells.values()):
            pytest.xfail(f"known bug: {cells['softmax']['error']}")
        assert not A.all_ok(row), f"{arch.name} now runs every kernel: remove it from KNOWN_BUGS, regenerate docs"
    for kernel, cell in cells.items():
        if cell["status"] == "ok":
            continue
        assert cell["status"] == "refused", (
            f"{arch.name} / {kernel}: {cell['status']}: {cell.get('error')} at {cell.get('where')} — neither ok nor "
            "a ValueError/NotImplementedError raised by hf_kernel_attn"
        )
        expected = EXPECTED_ERRORS.get(arch.name)
        assert expected is not None, f"{arch.name} / {kernel} is refused unexpectedly: {cell['error']}"
        assert expected in cell["error"], f"{arch.name} / {kernel}: {cell['error']!r} lacks {expected!r}"
    if arch.name in EXPECTED_ERRORS:
        assert not A.all_ok(row), f"{arch.name} now runs every kernel: remove it from EXPECTED_ERRORS, regenerate docs"
    else:
        assert row["attention_layers"] > 0
        assert cells["softmax"]["max_abs_diff"] <= A.SOFTMAX_ATOL  # softmax == SDPA on unpadded rows


def _docs_statuses() -> dict[str, list[str]]:
    out = {}
    for line in DOCS.read_text().splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split(" | ")]
        if len(parts) >= 3 + len(A.KERNELS) and parts[0] not in ("architecture", "") and not parts[0].startswith("-"):
            out[parts[0]] = parts[3:3 + len(A.KERNELS)]
    return out


def test_coverage_and_docs():
    rows = [_row(a) for a in A.ARCHITECTURES]
    ok = [r["architecture"] for r in rows if A.all_ok(r)]
    clear = [r["architecture"] for r in rows
             if "build_error" not in r and all(c["status"] in ("ok", "refused") for c in r["cells"].values())]
    assert len(ok) >= MIN_ALL_OK, f"only {len(ok)} architectures run all kernels: {ok}"
    assert len(clear) >= 30
    assert len(clear) == len(rows) - len(KNOWN_BUGS), A.summary(rows)
    documented = _docs_statuses()
    current = {r["architecture"]: [r["cells"][k]["status"] for k in A.KERNELS] for r in rows}
    assert documented == current, "docs/architectures.md is stale: run python scripts/architecture_table.py"
