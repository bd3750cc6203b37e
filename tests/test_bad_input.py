"""Bad input everywhere: each case asserts the error type, that the message names the bad value
(and the valid choices where there are some), and that it is raised before any work starts (no model is
loaded, nothing is patched, no file is written).

Every model here is a tiny random one built from a config, so the file runs in a few seconds."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_kernel_attn
from hf_kernel_attn import KernelAttentionConfig
from hf_kernel_attn.kernels import KERNELS

VALID_KERNELS = sorted(KERNELS)


@contextlib.contextmanager
def raises(exc_type: type[BaseException], *fragments: str):
    """pytest.raises that also requires every fragment (verbatim) in the message."""
    with pytest.raises(exc_type) as info:
        yield info
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in the message: {message}"


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()


def untouched(model) -> bool:
    return (model.config._attn_implementation == "sdpa" and not hasattr(model.config, "kernel_attention")
            and not any(hasattr(m, "kernel_attn") for m in model.modules()))


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory) -> Path:
    """A tiny Llama saved with hedgehog kernels (off their identity init) and one softmax layer-0 override."""
    model = tiny_llama()
    hf_kernel_attn.patch(model, kernel="hedgehog", layers={0: "elu"})
    with torch.no_grad():
        model.model.layers[1].self_attn.kernel_attn.weight_q.add_(0.25)
    path = tmp_path_factory.mktemp("saved")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def softmax_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("softmax")
    tiny_llama().save_pretrained(path)
    return path


def copy_saved(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------- kernels and options


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(kernel="softmaxx"), ["'softmaxx'", str(VALID_KERNELS)]),
        (dict(kernel=3), ["got 3", str(VALID_KERNELS)]),
        (dict(kernel="elu", feature_dimm=8), ["'feature_dimm'", "valid options", "'chunk_size'"]),
        (dict(kernel="hedgehog", feature_dim="8"), ["feature_dim", "'8'"]),
        (dict(kernel="gaussian", learnable="yes"), ["learnable", "'yes'", "[True, False]"]),
        (dict(kernel="gaussian", projection="ful"), ["'ful'", "'full'", "'diagonal'"]),
        (dict(kernel="performer", num_features=2.5), ["num_features", "2.5"]),
        (dict(kernel="hedgehog", layers={0: "nope"}), ["'nope'", str(VALID_KERNELS)]),
        (dict(kernel="hedgehog", layers={0: {"kernel": "elu", "params": [1]}}), ["params", "[1]"]),
    ],
)
def test_unknown_kernel_or_option(kwargs, fragments):
    model = tiny_llama()
    with raises(ValueError, *fragments):
        hf_kernel_attn.patch(model, **kwargs)
    assert untouched(model)


def test_misspelled_option_in_from_pretrained_is_not_passed_to_transformers(softmax_dir):
    """Keyword arguments that are not kernel options go to transformers; one spelled like an option raises
    here (naming the option), instead of a TypeError from the model's __init__."""
    with raises(ValueError, "'num_featurs'", "did you mean 'num_features'", "valid options"):
        hf_kernel_attn.from_pretrained(softmax_dir, kernel="performer", num_featurs=8)
    with raises(ValueError, "'hedgehgo'", str(VALID_KERNELS)):
        hf_kernel_attn.from_pretrained(softmax_dir, kernel="hedgehgo")


# ---------------------------------------------------------------------------------------- layers


@pytest.mark.parametrize(
    ("layers", "exc", "fragments"),
    [
        ([7], ValueError, ["[7]", "out of range", "2 attention layers"]),  # was accepted silently
        ([0, 2], ValueError, ["[2]", "out of range", "2 attention layers"]),
        ([-3], ValueError, ["-3", "out of range", "2 attention layers"]),
        ({7: "softmax"}, ValueError, ["[7]", "out of range", "2 attention layers"]),
        ([1.5], ValueError, ["1.5", "must be an integer"]),  # was rounded to layer 1
        ([True], ValueError, ["True", "must be an integer"]),
        ({"x": "softmax"}, ValueError, ["'x'", "must be an integer"]),
        ("all", ValueError, ["'all'", "a list of layer indices"]),
    ],
)
def test_layers_that_do_not_exist(layers, exc, fragments):
    model = tiny_llama(layers=2)
    with raises(exc, *fragments):
        hf_kernel_attn.patch(model, kernel="hedgehog", layers=layers)
    assert untouched(model)


def test_layers_out_of_range_in_from_pretrained(softmax_dir):
    with raises(ValueError, "[7]", "out of range", "2 attention layers"):
        hf_kernel_attn.from_pretrained(softmax_dir, kernel="elu", layers=[7])


def test_valid_layer_list_still_works():
    model = tiny_llama(layers=2)
    hf_kernel_attn.patch(model, kernel="hedgehog", layers=[-1])
    kinds = [m.kernel_attn.name for m in (layer.self_attn for layer in model.model.layers)]
    assert kinds == ["softmax", "hedgehog"]


# ------------------------------------------------------------------------ config.kernel_attention


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        ("hedgehog", ["must be a dict", "'hedgehog'"]),
        ({"params": {}}, ["must be a dict with a 'kernel' key"]),
        ({"kernel": 3}, ["unknown kernel 3", str(VALID_KERNELS)]),
        ({"kernel": "hedgehgo"}, ["'hedgehgo'", str(VALID_KERNELS)]),
        ({"kernel": "elu", "params": [1, 2]}, ["['params']", "[1, 2]"]),
        ({"kernel": "elu", "params": {"eps": "tiny"}}, ["eps", "'tiny'"]),
        ({"kernel": "elu", "params": {"epss": 1.0}}, ["'epss'", "valid options", "'eps'"]),
        ({"kernel": "elu", "layers": [0, 1]}, ["['layers']", "[0, 1]"]),
        ({"kernel": "elu", "layers": {"one": "softmax"}}, ["'one'", "must be an integer"]),
        ({"kernel": "elu", "layers": {"0": 5}}, ["got 5", "kernel name"]),
        ({"kernel": "elu", "layers": {"0": {"kernel": "relu", "params": "x"}}}, ["params", "'x'"]),
        ({"kernel": "elu", "version": 99}, ["version 99", "up to 1"]),
        ({"kernel": "elu", "version": "1"}, ["['version']", "'1'"]),
        ({"kernel": "elu", "extra": 1}, ["'extra'", "valid keys", "'layers'"]),
    ],
)
def test_wrong_types_in_config_kernel_attention(data, fragments):
    with raises(ValueError, "config.kernel_attention", *fragments):
        KernelAttentionConfig.from_dict(data)


def _edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda c: c["kernel_attention"].update(kernel="hedgehgo"), ["'hedgehgo'", str(VALID_KERNELS)]),
        (lambda c: c["kernel_attention"].update(params={"feature_dimm": 4}), ["'feature_dimm'", "valid options"]),
        (lambda c: c["kernel_attention"].update(layers={"5": "softmax"}), ["[5]", "out of range", "2 attention"]),
        (lambda c: c["kernel_attention"].update(layers=["softmax"]), ["['layers']", "['softmax']"]),
        (lambda c: c.update(kernel_attention="hedgehog"), ["must be a dict", "'hedgehog'"]),
        (lambda c: c["kernel_attention"].update(version=7), ["version 7"]),
    ],
)
def test_hand_edited_saved_config(saved_dir, tmp_path, edit, fragments):
    path = copy_saved(saved_dir, tmp_path / "m")
    _edit_config(path, edit)
    with raises(ValueError, *fragments):
        AutoModelForCausalLM.from_pretrained(path)


def test_corrupted_config_json_is_reported_by_transformers(saved_dir, tmp_path):
    path = copy_saved(saved_dir, tmp_path / "m")
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])  # truncated
    with raises(OSError, "config.json", "not a valid JSON file"):
        AutoModelForCausalLM.from_pretrained(path)


def test_edited_config_to_another_kernel_is_caught_by_the_weights(saved_dir, tmp_path):
    """config.json edited from hedgehog to performer: the checkpoint's hedgehog tensors are unexpected for
    performer (whose ω is rebuilt from its seed) -> the saved-kernel check names them."""
    path = copy_saved(saved_dir, tmp_path / "m")
    _edit_config(path, lambda c: c["kernel_attention"].update(kernel="performer"))
    with raises(ValueError, "unexpected", "'model.layers.1.self_attn.kernel_attn.weight_q'", "edited"):
        AutoModelForCausalLM.from_pretrained(path)


# -------------------------------------------------------------------- checkpoints of kernel models


def _rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_checkpoint_missing_kernel_parameters(saved_dir, tmp_path):
    path = copy_saved(saved_dir, tmp_path / "m")
    _rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.kernel_attn.weight_q"))
    with raises(ValueError, "missing", "'model.layers.1.self_attn.kernel_attn.weight_q'", "hedgehog"):
        AutoModelForCausalLM.from_pretrained(path)


def test_checkpoint_mis_shaped_kernel_parameters(saved_dir, tmp_path):
    path = copy_saved(saved_dir, tmp_path / "m")
    key = "model.layers.1.self_attn.kernel_attn.bias_k"

    def edit(tensors):
        tensors[key] = torch.zeros(3, 3)

    _rewrite_weights(path, edit)
    with raises(ValueError, "mis-shaped", key, "checkpoint [3, 3]", "kernel expects [2, 8]"):
        AutoModelForCausalLM.from_pretrained(path)


def test_complete_checkpoint_and_softmax_checkpoint_still_load(saved_dir, softmax_dir):
    """Controls: the intact saved model loads with its trained kernel; a softmax checkpoint loaded with a kernel
    (whose parameters it cannot hold) gets the kernel's own init, no error."""
    model = AutoModelForCausalLM.from_pretrained(saved_dir)
    w = model.model.layers[1].self_attn.kernel_attn.weight_q
    assert torch.allclose(w, torch.eye(8).expand_as(w) + 0.25)
    model = hf_kernel_attn.from_pretrained(softmax_dir, kernel="hedgehog")
    w = model.model.layers[1].self_attn.kernel_attn.weight_q
    assert torch.equal(w, torch.eye(8).expand_as(w))


# ----------------------------------------------------------------------------------- patching twice


def test_patching_twice_repatches_cleanly():
    """Defined behaviour: a second patch() replaces the first (never stacks): the model equals one patched
    once with the second choice, in modules, parameters, hooks, config and logits; unpatch restores softmax."""
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding: exercises the position hook
    plain = tiny_llama()
    with torch.no_grad():
        ref_plain = plain(ids, attention_mask=mask).logits
    once = hf_kernel_attn.patch(tiny_llama(), kernel="hedgehog", feature_dim=4)
    twice = tiny_llama()
    hf_kernel_attn.patch(twice, kernel="performer", layers=[0], num_features=6)
    hf_kernel_attn.patch(twice, kernel="elu")
    hf_kernel_attn.patch(twice, kernel="hedgehog", feature_dim=4)
    assert twice.config.kernel_attention == once.config.kernel_attention
    assert sorted(twice.state_dict()) == sorted(once.state_dict())
    assert [type(m.kernel_attn).__name__ for m in (x.self_attn for x in twice.model.layers)] == ["HedgehogKernel"] * 2
    hooks = [h for h in twice.model._forward_pre_hooks.values() if "positions" in getattr(h, "__module__", "")]
    assert len(hooks) == 1
    with torch.no_grad():
        torch.testing.assert_close(twice(ids, attention_mask=mask).logits, once(ids, attention_mask=mask).logits,
                                   rtol=0, atol=0)
    # the same choice again keeps the (trained) kernel parameters instead of re-initialising them
    kern = twice.model.layers[0].self_attn.kernel_attn
    with torch.no_grad():
        kern.weight_q.add_(1.0)
    hf_kernel_attn.patch(twice, kernel="hedgehog", feature_dim=4)
    assert twice.model.layers[0].self_attn.kernel_attn is kern
    hf_kernel_attn.unpatch(twice)
    assert untouched(twice) and not twice.model._forward_pre_hooks
    with torch.no_grad():
        torch.testing.assert_close(twice(ids, attention_mask=mask).logits, ref_plain, rtol=0, atol=0)


def test_failed_repatch_keeps_the_first_patch():
    model = hf_kernel_attn.patch(tiny_llama(), kernel="elu")
    before = dict(model.config.kernel_attention)
    with raises(ValueError, "[9]", "out of range"):
        hf_kernel_attn.patch(model, kernel="hedgehog", layers=[9])
    assert model.config.kernel_attention == before
    assert all(type(x.self_attn.kernel_attn).__name__ == "EluKernel" for x in model.model.layers)


# ------------------------------------------------------------------------------ evaluation inputs


MISSING_MODEL = "/nonexistent/model-folder"  # the model would fail to load: data errors must come first


def test_eval_unknown_task_lists_the_tasks(tmp_path):
    from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, run_eval
    from hf_kernel_attn.evaluation.tasks import ALL_TASKS

    with raises(ValueError, "['wikitext3']", str(list(ALL_TASKS))):
        run_eval(ModelSpec(MISSING_MODEL), ["wikitext3"], EvalSettings(data_dir=tmp_path))


def test_eval_missing_data_files_are_listed_before_the_model_loads(tmp_path):
    from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, run_eval

    with raises(FileNotFoundError, str(tmp_path),
                "wikitext2 --split validation expects ['wikitext-2-raw/wiki.valid.raw']",
                "arc_easy --split validation expects ['arc/ARC-Easy-Dev.jsonl']",
                "piqa --split validation expects ['piqa/valid.jsonl', 'piqa/valid-labels.lst']",
                "sst2 --split validation expects ['sst2/train.tsv']",
                "stsb_embedding --split validation expects ['stsb/train.tsv']"):
        run_eval(ModelSpec(MISSING_MODEL), ["wikitext2", "arc_easy", "piqa", "sst2", "stsb_embedding"],
                 EvalSettings(data_dir=tmp_path))
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text("{}\n")
    with raises(FileNotFoundError, "missing ['piqa/valid-labels.lst']"):
        run_eval(ModelSpec(MISSING_MODEL), ["piqa"], EvalSettings(data_dir=tmp_path))
    with raises(FileNotFoundError, "'/nonexistent/data'", "not a folder"):
        run_eval(ModelSpec(MISSING_MODEL), ["wikitext2"], EvalSettings(data_dir="/nonexistent/data"))


def _wikitext(tmp_path: Path, content: bytes) -> Path:
    (tmp_path / "wikitext-2-raw").mkdir(exist_ok=True)
    (tmp_path / "wikitext-2-raw" / "wiki.valid.raw").write_bytes(content)
    return tmp_path


@pytest.mark.parametrize(
    ("content", "exc", "fragments"),
    [
        (b"", ValueError, ["wiki.valid.raw", "is empty"]),
        (b" \n\n  \n", ValueError, ["wiki.valid.raw", "is empty"]),
        (b"caf\xe9 au lait\n", ValueError, ["wiki.valid.raw", "not UTF-8", "0xe9 at offset 3 (line 1)"]),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ValueError, ["wiki.valid.raw", "binary", "offset 8"]),
    ],
)
def test_eval_empty_binary_or_non_utf8_text(tmp_path, content, exc, fragments):
    from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, run_eval

    with raises(exc, *fragments):
        run_eval(ModelSpec(MISSING_MODEL), ["wikitext2"], EvalSettings(data_dir=_wikitext(tmp_path, content)))


def test_perplexity_of_too_short_text(minilm_tok):
    from hf_kernel_attn.evaluation.perplexity import perplexity, strided_perplexity

    model = None  # the checks come before the model is used
    for text in ("", "a"):
        n = len(minilm_tok(text, add_special_tokens=False).input_ids)
        with raises(ValueError, f"has {n} token(s)", "at least 2", repr(text)):
            strided_perplexity(model, minilm_tok, text, context=16)
    with raises(ValueError, "fewer than one block of 256", "'a b c'"):
        perplexity(model, minilm_tok, "a b c", block_size=256)


def test_cli_perplexity_empty_or_binary_file(tmp_path):
    from hf_kernel_attn.evaluation.perplexity import read_text

    (tmp_path / "empty.txt").write_text("\n")
    with raises(ValueError, "empty.txt", "is empty"):
        read_text(tmp_path / "empty.txt")
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)))
    with raises(ValueError, "blob.bin", "binary", "offset 0"):
        read_text(tmp_path / "blob.bin")
    with raises(ValueError, "nope.txt", "does not exist"):
        read_text(tmp_path / "nope.txt")


@pytest.mark.parametrize(
    ("task", "files", "fragments"),
    [
        ("arc_easy", {"arc/ARC-Easy-Dev.jsonl": '{"id": "a", "question": {"stem": "q", "choices": []}}\n'},
         ["ARC-Easy-Dev.jsonl:1", "missing field(s) ['answerKey']", "expected ['id', 'question', 'answerKey']"]),
        ("arc_easy", {"arc/ARC-Easy-Dev.jsonl": '{"id": "a", "question": "q?", "answerKey": "A"}\n'},
         ["ARC-Easy-Dev.jsonl", "'stem'", "'q?'"]),
        ("arc_easy", {"arc/ARC-Easy-Dev.jsonl": '{"id": "a",\n'}, ["ARC-Easy-Dev.jsonl:1", "invalid JSON"]),
        ("copa", {"copa/val.jsonl": '{"premise": "p", "choice1": "a", "choice2": "b", "label": 0, "idx": 0}\n'},
         ["val.jsonl:1", "missing field(s) ['question']"]),
        ("openbookqa", {"openbookqa/dev.tsv": "ID\tQuestion Stem\tAnswer Key\n1\tq\tA\n"},
         ["dev.tsv", "lacks column(s) ['Choices']"]),
        ("sst2", {"sst2/train.tsv": "text\tlabel\nnice\t1\n"}, ["train.tsv", "lacks column(s) ['sentence']"]),
        ("stsb_embedding", {"stsb/train.tsv": "sentence1\tscore\na\t1.0\n"}, ["train.tsv", "['sentence2']"]),
        ("sst2", {"sst2/train.tsv": "sentence\tlabel\nnice\tpositive\n"}, ["train.tsv:2", "'positive'", "['0', '1']"]),
        ("boolq", {"boolq/val.jsonl": b"\xff\xfe{}"}, ["val.jsonl", "not UTF-8", "0xff at offset 0"]),
    ],
)
def test_eval_data_file_with_missing_columns(tmp_path, task, files, fragments):
    from hf_kernel_attn.evaluation.runner import EvalSettings, ModelSpec, run_eval

    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        else:
            (tmp_path / name).write_text(content)
    with raises(ValueError, *fragments):
        run_eval(ModelSpec(MISSING_MODEL), [task], EvalSettings(data_dir=tmp_path))


# --------------------------------------------------------------------------------- training inputs


def _train_yaml(tmp_path: Path, **extra) -> dict:
    text = tmp_path / "train.txt"
    if not text.exists():
        text.write_text("some training text\n" * 20)
    cfg = {"model": MISSING_MODEL, "kernel": "hedgehog", "output_dir": str(tmp_path / "out"), "log_with": "none",
           "data": {"train": [str(text)], "seq_len": 8}, "stages": {"transfer": {"steps": 1}}}
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda c: c.update(kernal="elu"), ["'kernal'", "did you mean 'kernel'"]),
        (lambda c: c["data"].update(seqlen=8), ["'data.seqlen'", "did you mean 'data.seq_len'"]),
        (lambda c: c["stages"]["transfer"].update(lr_rate=1), ["'stages.transfer.lr_rate'", "'stages.transfer.lr'"]),
        (lambda c: c.update(layers="all"), ["layers must be", "'all'"]),
        (lambda c: c.update(layers=[0, "1"]), ["['1']", "must be integers"]),
        (lambda c: c.update(layers={0: "nope"}), ["'nope'", str(VALID_KERNELS)]),
        (lambda c: c.update(kernel_params=[1]), ["kernel_params must be a mapping", "[1]"]),
        (lambda c: c.update(kernel=["elu"]), ["unknown kernel ['elu']", str(VALID_KERNELS)]),
    ],
)
def test_training_yaml_errors(tmp_path, edit, fragments):
    from hf_kernel_attn.training import ConfigError, load_config

    cfg = _train_yaml(tmp_path)
    edit(cfg)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with raises(ConfigError, *fragments):
        load_config(path)


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("model: x\ndata: {train: [a.txt\n", ["c.yaml", "not valid YAML", "line 3"]),
        ("- model\n- kernel\n", ["c.yaml", "must hold a YAML mapping", "list"]),
        (b"model: caf\xe9\n", ["c.yaml", "not UTF-8", "0xe9"]),
    ],
)
def test_training_yaml_unreadable(tmp_path, content, fragments):
    from hf_kernel_attn.training import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with raises(ConfigError, *fragments):
        load_config(path)


@pytest.mark.parametrize(
    ("task", "content", "fragments"),
    [
        ("causal_lm", b"", ["train.txt", "is empty"]),
        ("causal_lm", b"\x00\x01\x02binary", ["train.txt", "binary", "offset 0"]),
        ("causal_lm", b"ok\nna\xefve\n", ["train.txt", "not UTF-8", "line 2"]),
        ("sequence_classification", b"text\tlabel\nnice\t1\n", ["train.txt", "lacks column(s) ['sentence']"]),
        ("sentence_embedding", b"sentence1\tsentence2\tscore\na\tb\t9\n", ["train.txt:2", "score '9'", "[0, 5]"]),
    ],
)
def test_training_data_errors_before_the_model_loads(tmp_path, task, content, fragments):
    """The model path does not exist: the data error must come first."""
    from hf_kernel_attn.training import Trainer, load_config

    (tmp_path / "train.txt").write_bytes(content)
    extra = {"task": task}
    if task != "causal_lm":
        extra["data"] = {"train": [str(tmp_path / "train.txt")], "seq_len": 8,
                         "glue_task": "sst2" if task == "sequence_classification" else "stsb"}
        extra["kernel"] = "elu"
        extra["stages"] = {"full": {"steps": 1}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_train_yaml(tmp_path, **extra)))
    cfg = load_config(path)
    with raises(ValueError, *fragments):
        Trainer(cfg).run()
    assert not list((tmp_path / "out").glob("checkpoint-*"))


# ------------------------------------------------------------------------------ leaderboard inputs


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (lambda c: c.update(modles=c.pop("models")), ["'modles'", "did you mean 'models'", "valid:"]),
        (lambda c: c.update(contxt=64), ["'contxt'", "did you mean 'context'"]),
        (lambda c: c["models"][0].update(kernal=["elu"]), ["'kernal'", "did you mean 'kernels'"]),
        (lambda c: c["models"][0].update(tasks="wikitext2"), ["tasks must be a list", "'wikitext2'"]),
        (lambda c: c["models"][0].update(kernels=["gauss"]), ["['gauss']", str(VALID_KERNELS)]),
        (lambda c: c.update(limit={"wikitext": 2}), ["['wikitext']", "available tasks"]),
        (lambda c: c.update(limit=0), ["limit must be", "0"]),
        (lambda c: c.update(context="long"), ["context must be an integer", "'long'"]),
        (lambda c: c.update(split="dev"), ["'dev'", "['validation', 'test']"]),
    ],
)
def test_leaderboard_yaml_errors(tmp_path, edit, fragments):
    from hf_kernel_attn.leaderboard.config import load_leaderboard_config

    cfg = {"output_dir": str(tmp_path / "lb"),
           "models": [{"name": "m", "model": "x", "kernels": ["softmax"], "tasks": ["wikitext2"]}]}
    edit(cfg)
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with raises(ValueError, *fragments):
        load_leaderboard_config(path)
    assert not (tmp_path / "lb").exists()


def test_leaderboard_yaml_syntax_error(tmp_path):
    from hf_kernel_attn.leaderboard.config import load_leaderboard_config

    path = tmp_path / "lb.yaml"
    path.write_text("output_dir: x\nmodels:\n  - name: m\n   model: y\n")
    with raises(ValueError, "lb.yaml", "not valid YAML", "line 4"):
        load_leaderboard_config(path)

