"""The examples in examples/ run as users run them (a subprocess each, small step counts) and do their job: a stock
transformers.Trainer conversion of MiniLM moves the embeddings toward the original model's; TRL's SFTTrainer packs
documents into rows with restarting positions and trains a linear-kernel model; a plain accelerate loop converts
a causal LM and saves a model that loads with its kernel."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_kernel_attn

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True,
                          env=ENV, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _held_out_sentences(n: int) -> list[str]:
    with open(DATA / "stsb" / "train.tsv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence1"] for i, r in enumerate(rows) if i % 10 == 9][:n]  # the rows the example holds out


@torch.no_grad()
def _embeddings(model, tok, texts: list[str]) -> torch.Tensor:
    enc = tok(texts, padding=True, return_tensors="pt")
    out = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return (out * mask).sum(1) / mask.sum(1)


def test_stock_trainer_example_moves_minilm_toward_the_original(minilm_dir, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    out = tmp_path / "minilm-trainer"
    _run("trainer_attention_transfer.py", "--data-dir", str(DATA), "--output", str(out), "--transfer-steps", "4",
         "--full-steps", "6", "--batch-size", "8", "--max-sentences", "200")
    tok = AutoTokenizer.from_pretrained(minilm_dir)
    texts = _held_out_sentences(24)
    original = _embeddings(AutoModel.from_pretrained(minilm_dir, attn_implementation="eager").eval(), tok, texts)
    untrained = hf_kernel_attn.from_pretrained(minilm_dir, kernel="gaussian", projection="full",
                                               model_class=AutoModel).eval()
    converted = AutoModel.from_pretrained(out).eval()
    assert converted.config.kernel_attention["kernel"] == "gaussian"
    before = torch.nn.functional.cosine_similarity(_embeddings(untrained, tok, texts), original).mean()
    after = torch.nn.functional.cosine_similarity(_embeddings(converted, tok, texts), original).mean()
    assert after > before + 0.01, (float(before), float(after))


def test_trl_sft_example_packs_documents(tiny_llama, tmp_path):
    pytest.importorskip("trl")
    proc = _run("trl_sft_packed.py", "--model", str(tiny_llama), "--data-file",
                str(DATA / "tinyshakespeare" / "train.txt"), "--steps", "3", "--max-length", "64", "--window", "8",
                "--output", str(tmp_path / "sft"))
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("packed batch"))
    assert int(line.split(", ")[-1].split()[0]) > 0  # document boundaries inside the packed rows
    loss = float(proc.stdout.strip().splitlines()[-1].rsplit("loss ", 1)[1])
    assert 0 < loss < 20


def test_accelerate_loop_example_saves_a_converted_model(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "loop"
    proc = _run("accelerate_loop.py", "--model", str(tiny_llama), "--data-file",
                str(DATA / "tinyshakespeare" / "train.txt"), "--seq-len", "32", "--batch-size", "2",
                "--transfer-steps", "3", "--distill-steps", "3", "--window", "8", "--output", str(out))
    assert "transfer step 0" in proc.stdout and "distill step 0" in proc.stdout
    model = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    assert model.config.kernel_attention["kernel"] == "hedgehog"
    assert model.config.kernel_attention["params"]["window"] == 8
    ids = torch.arange(1, 40)[None]
    assert torch.isfinite(model(ids).logits).all()
