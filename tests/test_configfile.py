"""``--set KEY=VALUE`` on a plain mapping (:func:`hf_kernel_attn.configfile.apply_overrides`), against dicts
written by hand."""

from __future__ import annotations

import pytest

from hf_kernel_attn.configfile import ConfigError, apply_overrides

FILE = {"model": "m", "kernel_params": {"feature_dim": 8}, "data": {"train": ["a.txt"], "seq_len": 512},
        "stages": {"lora": {"steps": 4, "lr": 1e-3}}, "layers": [0, 1], "seed": 0}
MERGE = {"kernel_params", "data", "stages", "stages.lora"}


def test_dotted_keys_replace_and_create_nested_values():
    out = apply_overrides(FILE, ["data.seq_len=128", "stages.lora.lr=3e-4", "stages.full.steps=2", "seed=7",
                                 "layers=[3]", "new.deep.key=x"])
    assert out == {"model": "m", "kernel_params": {"feature_dim": 8}, "data": {"train": ["a.txt"], "seq_len": 128},
                   "stages": {"lora": {"steps": 4, "lr": 3e-4}, "full": {"steps": 2}}, "layers": [3], "seed": 7,
                   "new": {"deep": {"key": "x"}}}
    assert FILE["data"]["seq_len"] == 512 and "new" not in FILE  # the base is left as it is


def test_values_are_yaml():
    out = apply_overrides({}, ["a=1e-4", "b=", "c=null", "d={x: 1}", "e=[1, two]", "f=true", "g='1'", "h=no"])
    assert out == {"a": 1e-4, "b": None, "c": None, "d": {"x": 1}, "e": [1, "two"], "f": True, "g": "1", "h": False}


def test_a_mapping_value_replaces_unless_the_key_merges():
    assert apply_overrides(FILE, ["kernel_params={eps: 1e-9}"])["kernel_params"] == {"eps": 1e-9}
    merged = apply_overrides(FILE, ["kernel_params={eps: 1e-9}", "kernel_params.window=8"], merge=MERGE)
    assert merged["kernel_params"] == {"feature_dim": 8, "eps": 1e-9, "window": 8}
    assert apply_overrides(FILE, ["data={seq_len: 8}"], merge=MERGE)["data"] == {"train": ["a.txt"], "seq_len": 8}
    # recursively, for the keys below that merge names too; a key it does not name is replaced
    out = apply_overrides(FILE, ["stages={lora: {lr: 1}, full: {steps: 1}}"], merge=MERGE)
    assert out["stages"] == {"lora": {"steps": 4, "lr": 1}, "full": {"steps": 1}}
    out = apply_overrides(FILE, ["stages={lora: {lr: 1}}"], merge={"stages"})
    assert out["stages"] == {"lora": {"lr": 1}}
    # merge only into a mapping: a scalar value, or a key the base lacks, is set as given
    assert apply_overrides(FILE, ["kernel_params=3"], merge=MERGE)["kernel_params"] == 3
    assert apply_overrides({}, ["kernel_params={eps: 1}"], merge=MERGE) == {"kernel_params": {"eps": 1}}


def test_a_value_in_the_way_of_a_dotted_key_is_replaced_by_a_mapping():
    out = apply_overrides(FILE, ["layers.5=softmax", "seed.x=1", "model.name=a"])
    assert (out["layers"], out["seed"], out["model"]) == ({"5": "softmax"}, {"x": 1}, {"name": "a"})


def test_overrides_apply_in_turn():
    assert apply_overrides({"a": 1}, ["a=2", "a=3"]) == {"a": 3}
    assert apply_overrides({"a": {"b": 1}}, ["a=4", "a.c=5"]) == {"a": {"c": 5}}
    assert apply_overrides({"a": {"b": 1}}, ["a.c=5", "a=4"]) == {"a": 4}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("novalue", "--set expects KEY=VALUE \\(dotted key, YAML value\\), got 'novalue'"),
        ("=3", "--set expects KEY=VALUE, got '=3'"),
        ("data.seq_len=[1, 2", "--set data.seq_len: cannot parse '\\[1, 2' as YAML"),
    ],
)
def test_errors_name_the_key(item, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(FILE, [item])


BOARD = {"models": [{"name": "a", "kernels": ["softmax"]}, {"name": "b"}], "speed": None, "limit": 5}


def test_lists_are_indexed_when_asked():
    """The leaderboard's form: an integer part indexes the list it meets (negative from the end); a mapping is made
    where the config has none; a list in the way is never replaced."""
    out = apply_overrides(BOARD, ["models.0.kernels=[elu]", "models.-1.name=c", "speed.repeats=1",
                                  "models.1.set.x=2"], lists=True)
    assert out == {"models": [{"name": "a", "kernels": ["elu"]}, {"name": "c", "set": {"x": 2}}],
                   "speed": {"repeats": 1}, "limit": 5}
    assert apply_overrides(BOARD, ["models.1={name: d}"], lists=True)["models"][1] == {"name": "d"}
    assert BOARD["models"][0]["kernels"] == ["softmax"]  # the base is left as it is
    assert apply_overrides(BOARD, ["limit.x=1"], lists=True)["limit"] == {"x": 1}  # a mapping's value: replaced


@pytest.mark.parametrize(("item", "message"), [
    ("models.2.name=x", r"--set models.2.name=x: models is a list of 2; index it with 0..1, got '2'"),
    ("models.x.name=y", r"models is a list of 2; index it with 0..1, got 'x'"),
    ("models.-3=x", r"models is a list of 2; index it with 0..1, got '-3'"),
    ("models.0.kernels.0.x=1", r"models.0.kernels.0 is 'softmax', not a mapping or list"),
])
def test_list_index_errors_name_the_list(item, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(BOARD, [item], lists=True)
