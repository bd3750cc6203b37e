"""The model card of a converted checkpoint (final/README.md), read back with huggingface_hub.ModelCard."""

from __future__ import annotations

import json

from huggingface_hub import ModelCard

from hf_kernel_attn.training import load_config
from hf_kernel_attn.training.trainer import Trainer
from tests.training.helpers import lm_config, write_config


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
    from tests.training.helpers import DATA

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


def test_push_to_hub_uploads_the_final_folder_and_fails_clearly_offline(tiny_llama, tmp_path, monkeypatch):
    """push_to_hub: the Hub client (a local stand-in for HfApi) gets one repo and one upload of final/, which
    holds the weights and the model card; offline, the CLI names the repo and the saved folder (exit 1)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import huggingface_hub

    calls = []

    class StandIn:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls.append(("create", repo_id, private, exist_ok))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, repo_id, folder_path, commit_message=None):
            calls.append(("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", StandIn)
    hub = {"kernel": "elu", "stages.transfer.steps": 0, "stages.lora.steps": 1, "validate": False,
           "push_to_hub": True, "hub_model_id": "me/tiny-elu", "hub_private_repo": True}
    Trainer(load_config(write_config(tmp_path / "c.yaml", lm_config(tiny_llama, tmp_path / "o", **hub)))).run()
    assert calls[0] == ("create", "me/tiny-elu", True, True)
    assert calls[1][:2] == ("upload", "me/tiny-elu")
    assert {"README.md", "config.json", "model.safetensors"} <= set(calls[1][2])
    path = write_config(tmp_path / "off.yaml", lm_config(tiny_llama, tmp_path / "offline", **hub))
    proc = subprocess.run([sys.executable, "-m", "hf_kernel_attn.cli", "finetune", str(path)], capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "me/tiny-elu" in proc.stderr and "huggingface-cli upload" in proc.stderr
    assert (tmp_path / "offline" / "final" / "model.safetensors").is_file()
