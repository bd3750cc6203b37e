"""The model card of a converted checkpoint (final/README.md), read back with huggingface_hub.ModelCard."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard

from hf_kernel_attn.training import load_config
from hf_kernel_attn.training.trainer import Trainer
from tests.test_training import lm_config, write_config


def test_converted_checkpoint_has_a_hub_model_card(tiny_llama, tmp_path):
    cfg = lm_config(tiny_llama, tmp_path / "o", kernel_params={"window": 8}, validate=True,
                    base_model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                    **{"stages.transfer.steps": 2, "stages.lora.steps": 2, "save_every": 0})
    final = Trainer(load_config(write_config(tmp_path / "c.yaml", cfg))).run()
    card = ModelCard.load(final / "README.md")
    data = card.data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert data.library_name == "transformers"
    assert data.tags[:2] == ["hf-kernel-attn", "hedgehog"] and "sliding-window-hybrid" in data.tags
    last = json.loads((tmp_path / "o" / "validation.jsonl").read_text().splitlines()[-1])
    results = {r.metric_type: r.metric_value for r in data.eval_results}
    assert results["perplexity"] == round(last["val_perplexity"], 4)
    assert results["loss"] == round(last["val_loss"], 4)
    saved = json.loads((final / "config.json").read_text())["kernel_attention"]
    block = card.text.split("```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(block) == saved  # the card describes the kernel that runs
    assert "`transfer`: 2 steps" in card.text and "`lora`: 2 steps" in card.text


def test_eval_update_card_adds_model_index_results(tiny_llama, tmp_path, capsys):
    """``hf-kernel-attn eval --update-card`` adds its records to the card's model-index (a re-run replaces them);
    a folder without a card is a clear error before anything runs."""
    from hf_kernel_attn.cli import main
    from tests.test_training import DATA

    cfg = lm_config(tiny_llama, tmp_path / "o", **{"stages.transfer.steps": 1, "stages.lora.steps": 0,
                                                    "save_every": 0})
    final = Trainer(load_config(write_config(tmp_path / "c.yaml", cfg))).run()
    args = ["eval", "--model", str(final), "--tasks", "wikitext2", "--data-dir", str(DATA), "--limit", "2",
            "--context", "32", "--output", str(tmp_path / "r.jsonl"), "--update-card"]
    assert main(args) == 0
    assert main(args) == 0
    records = [json.loads(ln) for ln in (tmp_path / "r.jsonl").read_text().splitlines()]
    record = [r for r in records if r["metric"] == "perplexity"][-1]
    results = [r for r in ModelCard.load(final / "README.md").data.eval_results
               if (r.dataset_type, r.metric_type) == ("wikitext2", "perplexity")]
    assert len(results) == 1  # the second run replaced the first
    assert results[0].metric_value == round(record["value"], 6) and results[0].dataset_name == "wikitext2 (first 2)"
    assert main(["eval", "--model", str(tiny_llama), "--tasks", "wikitext2", "--update-card"]) == 2
    assert "no model card" in capsys.readouterr().err
