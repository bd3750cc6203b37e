"""Architecture coverage: tiny random models of many transformers architectures × five kernels.

Each architecture either runs every kernel (finite output, every attached kernel called, softmax equal to the
unpatched SDPA model on unpadded inputs) or is refused with a ValueError / NotImplementedError raised by
hf_kernel_attn that names the reason (EXPECTED_ERRORS). KNOWN_BUGS are architectures that currently fail in
another way; they xfail while the failure is exactly the known one and fail loudly once fixed, so that the entry
is removed and docs/architectures.md regenerated (``python scripts/architecture_table.py``).
"""

from __future__ import annotations

import re

import pytest
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_kernel_attn.testing import architectures as A
from tests.paths import REPO

DOCS = REPO / "docs" / "architectures.md"

NO_INTERFACE = "does not dispatch its attention through transformers' AttentionInterface"
POSITION_BIAS = "cannot take the additive position bias"
# architecture (row name) -> substring of the refusal every non-ok cell must raise, whatever the transformers release
EXPECTED_ERRORS: dict[str, str] = {
    "gemma2": "do not implement 'softcap'",
    "t5": POSITION_BIAS,  # elu and hedgehog: T5's relative position bias needs logits (softmax/gaussian/cosine run)
    "mt5": POSITION_BIAS,
}
# Which architectures dispatch attention through AttentionInterface depends on the installed transformers (Falcon
# moved to it in 5.25): it is measured per release by dispatches_through_interface() below, not listed here.
# architecture -> (cell status, substring of its error) of a failure that is not a clear refusal
KNOWN_BUGS: dict[str, tuple[str, str]] = {}
MIN_ALL_OK = 56  # architectures that run all five kernels today (a floor: raise it when more run)
PROBE = "hf_kernel_attn_test_probe"

_ROWS: dict[str, dict] = {}


def _row(arch: A.Architecture) -> dict:
    if arch.name not in _ROWS:
        _ROWS[arch.name] = A.run_architecture(arch)
    return _ROWS[arch.name]


def dispatches_through_interface(arch: A.Architecture) -> bool:
    """Whether the installed transformers runs this architecture's attention through AttentionInterface, measured
    with stock transformers only: a probe function registered under a name of its own (SDPA inside, SDPA's mask)
    is selected with ``set_attn_implementation`` and must be called by a forward. No hf_kernel_attn code decides."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    calls = []

    def probe(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(PROBE, probe)
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    try:
        config, model, _ = A.build_reference(arch)  # the stock tiny model (SDPA, else eager)
        model.set_attn_implementation(PROBE)
        with torch.no_grad():
            model(**arch.inputs(config))
    except Exception:  # noqa: BLE001 - the model's own attention table does not know the name: it does not dispatch
        return False
    return bool(calls)


def expected_error(arch: A.Architecture) -> str | None:
    if arch.name in EXPECTED_ERRORS:
        return EXPECTED_ERRORS[arch.name]
    return None if dispatches_through_interface(arch) else NO_INTERFACE


def accepted_errors(arch: A.Architecture) -> tuple[str, ...]:
    """The refusals a non-ok cell may raise: the expected one, and on any release the plugin's refusal of a model
    whose modeling code does not call AttentionInterface (which models do differs between releases: in
    transformers 5.2 T5, Falcon, GPT-J and others do not; on the measured release the docs table pins each one)."""
    expected = expected_error(arch)
    return (expected, NO_INTERFACE) if expected is not None else (NO_INTERFACE,)


def _measured_release() -> str | None:
    found = re.search(r"Measured with transformers (\S+),", DOCS.read_text())
    return found.group(1) if found else None


# the release docs/architectures.md was measured with: there the table's entries are checked for staleness too
# (on another release an architecture may run that is refused here, or be missing from transformers)
IS_MEASURED_RELEASE = _measured_release() == transformers.__version__


def _describe(row: dict) -> str:
    return "; ".join(A.row_errors(row)) or "all ok"


def test_registry_sizes():
    names = [a.name for a in A.ARCHITECTURES]
    assert len(names) == len(set(names))
    assert len({a.model_type for a in A.ARCHITECTURES}) >= 35
    assert set(EXPECTED_ERRORS) | set(KNOWN_BUGS) <= set(names)


@pytest.mark.parametrize("arch", A.ARCHITECTURES, ids=lambda a: a.name)
def test_architecture(arch):
    if arch.model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {arch.model_type!r} model")
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
        accepted = accepted_errors(arch)
        assert any(a in cell["error"] for a in accepted), (
            f"{arch.name} / {kernel}: {cell['error']!r} lacks {accepted[0]!r}")
    if expected_error(arch) is not None:
        if IS_MEASURED_RELEASE:
            assert not A.all_ok(row), (
                f"{arch.name} now runs every kernel: remove it from EXPECTED_ERRORS, regenerate docs")
    elif any(NO_INTERFACE in c.get("error", "") for c in cells.values()):
        assert not IS_MEASURED_RELEASE, f"{arch.name} is refused as not calling AttentionInterface: {_describe(row)}"
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
    assert _measured_release(), "docs/architectures.md does not say which transformers release it was measured with"
    if not IS_MEASURED_RELEASE:  # e.g. scripts/check_latest.sh or check_lowest.sh on another release
        pytest.skip(f"docs/architectures.md was measured with transformers {_measured_release()}, this is "
                    f"{transformers.__version__}: regenerate it with python scripts/architecture_table.py to compare")
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


# ----------------------------------------------------------------------- what the table cannot show


def test_an_architecture_without_the_interface_refuses_a_kernel_at_load_clearly():
    """Falcon, GPT-Neo and BLOOM picked their attention class from their own table: a kernel name at construction
    used to raise KeyError: 'elu' from inside transformers. The first of them that still does so in the installed
    transformers must be refused with a clear ValueError; one that now dispatches through the interface must load."""
    import torch
    import transformers

    for model_type, cls_name in (("falcon", "FalconForCausalLM"), ("gpt_neo", "GPTNeoForCausalLM"),
                                 ("bloom", "BloomForCausalLM")):
        arch = next(a for a in A.ARCHITECTURES if a.name == model_type)
        cls = getattr(transformers, cls_name)
        cfg = arch.config()
        torch.manual_seed(0)
        if dispatches_through_interface(arch):
            cls._from_config(cfg, attn_implementation="elu")
            continue
        with pytest.raises(ValueError, match=f"{cls_name} does not dispatch its attention"):
            cls._from_config(cfg, attn_implementation="elu")
        cls._from_config(cfg, attn_implementation="eager")  # a stock choice still loads
        return
    pytest.skip(f"falcon, gpt_neo and bloom all dispatch through AttentionInterface in transformers "
                f"{transformers.__version__}")


def _gemma3(**extra):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gemma3_text", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=100,
                               max_position_embeddings=128, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"], **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def test_sliding_layers_stay_native_unless_a_window_is_asked_for(tmp_path):
    """Gemma-3-style models: the sliding layer keeps its own window (exact softmax over its 4 keys), only the
    global layer is converted; window=W converts both (the hybrid); the choice is saved and reloaded."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_kernel_attn
    from hf_kernel_attn.kernels import SoftmaxKernel

    ids = torch.randint(0, 100, (2, 14), generator=torch.Generator().manual_seed(1))
    model = _gemma3()
    hf_kernel_attn.patch(model, kernel="hedgehog")
    sliding, full = (layer.self_attn.kernel_attn for layer in model.model.layers)
    assert isinstance(sliding, SoftmaxKernel) and sliding.options.window == 4
    assert full.name == "hedgehog" and full.options.window == 0
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
        recomputed = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(generated, recomputed)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert again.model.layers[0].self_attn.kernel_attn.options.window == 4
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, logits)
    both = _gemma3()
    hf_kernel_attn.patch(both, kernel="hedgehog", window=3)
    assert all(layer.self_attn.kernel_attn.name == "hedgehog" and layer.self_attn.kernel_attn.options.window == 3
               for layer in both.model.layers)


def test_caching_forward_on_a_model_without_cache_kwargs_keeps_its_own_cache():
    """GPT-NeoX does not pass its kwargs to cache.update: a caching forward keeps transformers' own cache (correct,
    growing) instead of failing in the recurrent one; generate() equals recomputation."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    import hf_kernel_attn

    cfg = AutoConfig.for_model("gpt_neox", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, vocab_size=100, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    hf_kernel_attn.patch(model, kernel="elu")
    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        assert isinstance(cache, DynamicCache)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False))
