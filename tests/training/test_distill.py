"""The ``distill`` stage: the loss against a brute-force KL, the teacher against the stock model, what
each ``train`` setting trains, config errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import log_softmax as np_log_softmax
from transformers import AutoModelForCausalLM

from hf_kernel_attn.training import ConfigError, load_config
from hf_kernel_attn.training.losses import distillation_loss
from hf_kernel_attn.training.trainer import Trainer
from tests.training.helpers import lm_config, read_log, write_config


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_distillation_loss_is_kl_of_the_tempered_distributions(temperature):
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=gen) * 3, torch.randn(2, 5, 11, generator=gen) * 3
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]])
    log_p = np_log_softmax(t.double().numpy() / temperature, axis=-1)
    log_q = np_log_softmax(s.double().numpy() / temperature, axis=-1)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)  # [2, 5], KL(teacher || student) per position
    want_all = kl.mean() * temperature**2
    want_masked = kl[mask.numpy() > 0].mean() * temperature**2
    assert distillation_loss(s, t, temperature=temperature).item() == pytest.approx(want_all, rel=1e-5)
    assert distillation_loss(s, t, temperature=temperature, mask=mask).item() == pytest.approx(want_masked,
                                                                                                rel=1e-5)
    assert distillation_loss(t, t, temperature=temperature).item() == pytest.approx(0, abs=1e-6)


def _distill_config(tiny_llama, out, **extra):
    return lm_config(tiny_llama, out, **{"stages.transfer.steps": 2, "stages.distill.steps": 4,
                                         "stages.distill.lr": 3e-3, "stages.lora.steps": 0, "save_every": 0,
                                         **extra})


def test_softmax_student_starts_at_zero_kl(tiny_llama, tmp_path):
    """Student = teacher (softmax kernel, LoRA B = 0): the first distillation loss is 0, so the teacher is the
    same model with the same weights."""
    cfg = load_config(write_config(tmp_path / "c.yaml", _distill_config(
        tiny_llama, tmp_path / "o", kernel="softmax", **{"stages.distill.steps": 1})))
    Trainer(cfg).run()
    (record,) = read_log(tmp_path / "o")
    assert record["stage"] == "distill" and record["loss"] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("train", ["lora", "full"])
def test_teacher_is_the_original_softmax_model(tiny_llama, tmp_path, train):
    """After training, the teacher's logits are still the stock (unpatched) model's, the student's are not,
    and the student moved towards the teacher; ``train: full`` with target_modules trains only those."""
    extra = {"stages.distill.train": train, "data.max_train_chars": 600, "data.validation_fraction": 0}
    if train == "full":
        extra["stages.distill.target_modules"] = ["o_proj"]
    cfg = load_config(write_config(tmp_path / "c.yaml", _distill_config(tiny_llama, tmp_path / "o", **extra)))
    trainer = Trainer(cfg)
    trainer.run()
    stock = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    ids = trainer.train.items[:2]
    with torch.no_grad():
        want = stock(input_ids=ids).logits
    got = trainer.stages["distill"].teacher_logits({"input_ids": ids})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    log = read_log(tmp_path / "o")
    assert [r["stage"] for r in log].count("distill") == 4
    if train == "full":
        trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert trained and all(".o_proj." in n for n in trained)
        base = dict(stock.named_parameters())
        moved = {n for n, p in trainer.model.named_parameters()
                 if n in base and not torch.equal(p.detach(), base[n].detach())}
        assert moved and all(".o_proj." in n for n in moved)
    else:  # the adapters moved the student towards the teacher on the training text (4 blocks, every batch)
        model = trainer.model.eval()
        ids = trainer.train.items
        with torch.no_grad():
            want = stock(input_ids=ids).logits
            after = distillation_loss(model(input_ids=ids).logits, want)
            with model.disable_adapter():
                before = distillation_loss(model(input_ids=ids).logits, want)
        assert after < before


@pytest.mark.parametrize("override, message", [
    ({"stages.distill.train": "adapters"}, "stages.distill.train must be one of ['lora', 'full']"),
    ({"stages.distill.temperature": 0}, "stages.distill.temperature must be a number > 0"),
    ({"stages.distill.ce_weight": -1}, "stages.distill.ce_weight must be a number >= 0"),
    ({"stages.distill.target_modules": "q_proj"}, "stages.distill.target_modules must be null or a list"),
    ({"task": "sentence_embedding"}, "needs task causal_lm"),
    ({"stages.distill.temprature": 2}, "did you mean 'stages.distill.temperature'"),
])
def test_distill_config_errors(tiny_llama, tmp_path, override, message):
    cfg = _distill_config(tiny_llama, tmp_path / "o", **override)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(write_config(tmp_path / "c.yaml", cfg))
