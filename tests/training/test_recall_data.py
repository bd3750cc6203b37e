"""Recall-aware training text (``data.recall_fraction``): parsed back with regular expressions on the real
tokenizer's decoded text, independently of the generator."""

from __future__ import annotations

import re

import pytest
import torch

from hf_kernel_attn.training import ConfigError, load_config
from hf_kernel_attn.training.data import text_blocks
from tests.training.helpers import SHAKESPEARE, lm_config, write_config

FACT = re.compile(r"\n(\w+)'s (\w+) number is (\d+)\.\n")
QA = re.compile(r"\nQuestion: what is (\w+)'s (\w+) number\?\nAnswer: (\w+)'s (\w+) number is (\d+)\.")


def _blocks(tiny_llama, tmp_path, **data):
    cfg = load_config(write_config(tmp_path / "c.yaml", lm_config(
        tiny_llama, tmp_path / "o", **{"data.seq_len": 256, "data.max_train_chars": 40000, **data})))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    return text_blocks(cfg, tok), tok


def test_recall_blocks_state_each_fact_once_and_ask_for_it(tiny_llama, tmp_path):
    (plain, plain_valid), tok = _blocks(tiny_llama, tmp_path)
    (mixed, mixed_valid), _ = _blocks(tiny_llama, tmp_path, **{"data.recall_fraction": 0.25,
                                                               "data.recall_max_facts": 3})
    assert mixed.items.shape == plain.items.shape
    assert torch.equal(mixed_valid.items, plain_valid.items)  # validation text stays as it is
    changed = [i for i in range(len(plain)) if not torch.equal(mixed.items[i], plain.items[i])]
    assert len(changed) == round(0.25 * len(plain))
    source = SHAKESPEARE.read_text()
    counts = set()
    for i in changed:
        text = tok.decode(mixed.items[i])
        first_q = text.index("\nQuestion:")
        facts = FACT.findall(text[:first_q])
        asked = QA.findall(text[first_q:])
        assert 1 <= len(facts) <= 3 and len(asked) == len(facts)
        stated = {(n, t): v for n, t, v in facts}
        assert len(stated) == len(facts)  # no key stated twice
        for n, t, n2, t2, v in asked:
            assert (n, t) == (n2, t2) and stated[(n, t)] == v
        counts.add(len(facts))
        # the filler is the block's own training text, in order
        filler = FACT.sub("", text[:first_q])
        assert tok.decode(plain.items[i])[:200].strip()[:50] in filler
        assert filler.strip()[:50] in source
    assert counts == {1, 2, 3}


def test_recall_fraction_errors(tiny_llama, tmp_path):
    for extra, message in [({"data.recall_fraction": 1.5}, "data.recall_fraction must be in"),
                           ({"data.recall_max_facts": 0}, "data.recall_max_facts must be an integer >= 1"),
                           ({"data.recall_fraction": 0.2, "task": "sentence_embedding"}, "needs task causal_lm")]:
        with pytest.raises(ConfigError, match=message):
            load_config(write_config(tmp_path / "c.yaml", lm_config(tiny_llama, tmp_path / "o", **extra)))


VALUE = re.compile(r"([A-Z]{2}\d{3,4}|\d{2,3}-\d{4}|[a-z]+-\d{1,3}|\d{4,7})\.?$")
TASK_WORDING = re.compile(r"magic number|pass ?key|special|mentioned in the provided text", re.IGNORECASE)


def test_varied_recall_facts_state_once_what_is_asked_in_other_words(tiny_llama, tmp_path):
    """``data.recall_style: varied``: each answer's value (parsed from the answer text) is stated once in the
    filler, in a sentence that names the asked key; several wordings and value formats occur; none is the wording
    of the passkey/niah/RULER tasks."""
    import random

    from transformers import AutoTokenizer

    from hf_kernel_attn.training.recall_data import recall_block_spans

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    filler = encode(SHAKESPEARE.read_text()[:20000])[:600]
    questions, formats = set(), set()
    for seed in range(40):
        ids, spans = recall_block_spans(filler, encode, random.Random(seed), 3, "varied")
        assert len(ids) == len(filler) and spans
        text = tok.decode(ids)
        for fact_start, fact_end, answer_start, answer_end in spans:
            stated, answer = tok.decode(ids[fact_start:fact_end]), tok.decode(ids[answer_start:answer_end])
            question = tok.decode(ids[fact_end:answer_start]).rsplit("\n", 2)[-2:]
            assert not TASK_WORDING.search(stated + question[0] + answer)
            value = VALUE.search(answer.strip()).group(1)
            assert value in stated and text.count(value) == 2, (stated, answer)
            questions.add(re.sub(r"[A-Z][a-z]+'s \w+|the [a-z ]+|(Project|Operation) \w+", "K", question[0]))
            formats.add(re.sub(r"[a-z]+", "a", re.sub(r"[A-Z]", "A", re.sub(r"\d+", "9", value))))
    assert len(questions) >= 5 and formats >= {"9", "9-9", "AA9", "a-9"}, (questions, formats)


def test_recall_style_is_checked(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match=r"data.recall_style must be one of \['plain', 'varied'\], got 'fancy'"):
        load_config(write_config(tmp_path / "c.yaml", lm_config(tiny_llama, tmp_path / "o",
                                                                **{"data.recall_style": "fancy"})))
