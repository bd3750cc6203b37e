"""GLUE readers: real files in ../shared/data (counts from their READMEs) and synthetic eval-file fixtures."""

from __future__ import annotations

import functools
import json
import sys
import types
from pathlib import Path

import pytest

from hf_kernel_attn.data import GLUE_TASKS, GlueExample, GlueTask, load_glue, read_glue_file
from tests.paths import DATA

needs_data = pytest.mark.skipif(not (DATA / "EVAL_SPLITS.md").is_file(), reason=f"no shared data at {DATA}")

# data rows per train file, as stated in each task folder's README.md
README_ROWS = {"sst2": 67_349, "mrpc": 3_668, "rte": 2_490, "cola": 8_551, "stsb": 5_749}

load_real = functools.cache(load_glue)  # the real files are read once per (task, split) across tests


def raw_rows(path: Path) -> list[list[str]]:
    """Independent TSV reading: strip a BOM, split on newlines and tabs (header included)."""
    text = path.read_bytes().decode("utf-8").removeprefix("\ufeff")
    return [line.split("\t") for line in text.split("\n") if line]


def write(path: Path, text: str, bom: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8"))
    return path


# ---------------------------------------------------------------- task table


def test_task_table() -> None:
    assert set(GLUE_TASKS) == {"sst2", "mrpc", "rte", "cola", "stsb", "qnli"}
    assert all(isinstance(t, GlueTask) and t.name == k for k, t in GLUE_TASKS.items())
    assert {k: t.metrics for k, t in GLUE_TASKS.items()} == {
        "sst2": ("accuracy",),
        "rte": ("accuracy",),
        "qnli": ("accuracy",),
        "mrpc": ("f1", "accuracy"),
        "cola": ("matthews_correlation",),
        "stsb": ("pearson", "spearman"),
    }
    assert {k: t.eval_file for k, t in GLUE_TASKS.items()} == {
        "sst2": "dev.tsv",
        "mrpc": "dev.tsv",
        "rte": "validation.jsonl",
        "cola": "in_domain_dev.tsv",
        "stsb": "dev.tsv",
        "qnli": "dev.tsv",
    }
    assert GLUE_TASKS["rte"].train_file == "train.jsonl" and GLUE_TASKS["qnli"].train_file is None
    assert GLUE_TASKS["stsb"].num_labels == 1 and GLUE_TASKS["stsb"].is_regression
    assert all(t.num_labels == 2 and not t.is_regression for k, t in GLUE_TASKS.items() if k != "stsb")
    assert GLUE_TASKS["sst2"].hub == ("nyu-mll/glue", "sst2")
    with pytest.raises(AttributeError):
        GLUE_TASKS["sst2"].num_labels = 3  # type: ignore[misc]


# ---------------------------------------------------------------- real train files


@needs_data
@pytest.mark.parametrize("task", sorted(README_ROWS))
def test_train_validation_partition_counts(task: str) -> None:
    n = README_ROWS[task]
    train = load_real(task, "train", DATA)
    val = load_real(task, "validation", DATA)
    assert len(train) + len(val) == n
    assert len(val) == n // 10  # rows 9, 19, 29, ...
    assert len(load_glue(task, "validation", DATA, holdout_every=5)) == n // 5


@needs_data
def test_sst2_rows_and_labels() -> None:
    rows = raw_rows(DATA / "sst2" / "train.tsv")
    assert rows[0] == ["sentence", "label"]
    train, val = load_real("sst2", "train", DATA), load_real("sst2", "validation", DATA)
    assert train[0] == GlueExample(rows[1][0], None, int(rows[1][1]))
    assert train[0].text_a == "hide new secretions from the parental units " and train[0].label == 0
    assert val[0] == GlueExample(rows[10][0], None, int(rows[10][1]))  # data row 9 is the first held out
    assert train[9] == GlueExample(rows[11][0], None, int(rows[11][1]))  # and is skipped in train
    labels = [e.label for e in train + val]
    assert all(type(v) is int for v in labels)
    assert (labels.count(1), labels.count(0)) == (37_569, 29_780)  # README label counts


@needs_data
def test_mrpc_bom_and_quotes() -> None:
    path = DATA / "mrpc" / "train.tsv"
    assert path.read_bytes().startswith(b"\xef\xbb\xbfQuality\t")
    rows = raw_rows(path)
    assert rows[0] == ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    examples = read_glue_file("mrpc", path)
    assert len(examples) == README_ROWS["mrpc"]
    assert examples[0] == GlueExample(rows[1][3], rows[1][4], int(rows[1][0]))
    assert examples[0].label == 1 and '"the witness"' in examples[0].text_a  # quotes kept verbatim
    assert examples[-1] == GlueExample(rows[-1][3], rows[-1][4], int(rows[-1][0]))
    assert {e.label for e in examples} == {0, 1}


@needs_data
def test_rte_jsonl() -> None:
    lines = (DATA / "rte" / "train.jsonl").read_text(encoding="utf-8").splitlines()
    first, tenth = json.loads(lines[0]), json.loads(lines[9])
    train, val = load_real("rte", "train", DATA), load_real("rte", "validation", DATA)
    assert train[0] == GlueExample(first["sentence1"], first["sentence2"], first["label"])
    assert train[0].text_b == "Weapons of Mass Destruction Found in Iraq." and train[0].label == 1
    assert val[0] == GlueExample(tenth["sentence1"], tenth["sentence2"], tenth["label"])
    assert {e.label for e in train + val} == {0, 1}


@needs_data
def test_cola_rows_and_labels() -> None:
    rows = raw_rows(DATA / "cola" / "train.tsv")
    assert rows[0] == ["x", "y"]
    train, val = load_real("cola", "train", DATA), load_real("cola", "validation", DATA)
    assert train[0] == GlueExample(rows[1][0], None, int(rows[1][1]))
    assert val[-1] == GlueExample(rows[8550][0], None, int(rows[8550][1]))  # data row 8549 = 855th held out
    labels = [e.label for e in train + val]
    assert (labels.count(1), labels.count(0)) == (6_023, 2_528)  # README label counts


@needs_data
def test_stsb_scores() -> None:
    rows = raw_rows(DATA / "stsb" / "train.tsv")
    header = rows[0]
    assert len(header) == 10 and header[7:] == ["sentence1", "sentence2", "score"]
    train, val = load_real("stsb", "train", DATA), load_real("stsb", "validation", DATA)
    assert train[0] == GlueExample("A plane is taking off.", "An air plane is taking off.", 5.0)
    assert train[1] == GlueExample(rows[2][7], rows[2][8], float(rows[2][9])) and train[1].label == 3.8
    scores = [e.label for e in train + val]
    assert all(type(s) is float and 0.0 <= s <= 5.0 for s in scores)
    assert min(scores) == 0.0 and max(scores) == 5.0


@needs_data
def test_unlabeled_and_missing_local_files() -> None:
    with pytest.raises(ValueError, match="no labels"):
        read_glue_file("qnli", DATA / "qnli" / "test.unlabeled.tsv")
    with pytest.raises(FileNotFoundError, match="hub"):
        load_glue("qnli", "train", DATA)
    for task in README_ROWS:  # the evaluation files are held out of ../shared/data
        with pytest.raises(FileNotFoundError) as err:
            load_glue(task, "test", DATA)
        assert str(DATA / task / GLUE_TASKS[task].eval_file) in str(err.value) and "'test'" in str(err.value)


# ---------------------------------------------------------------- test split from synthetic eval files


@pytest.fixture
def eval_dir(tmp_path: Path) -> Path:
    write(tmp_path / "sst2" / "dev.tsv", "sentence\tlabel\nit 's a charming journey . \t1\nunfunny \t0\n")
    write(
        tmp_path / "mrpc" / "dev.tsv",
        'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\r\n1\t1\t2\t"He said so.\tHe "said" so.\r\n'
        "0\t3\t4\tA cat.\tA dog.\r\n",
        bom=True,
    )
    write(
        tmp_path / "rte" / "validation.jsonl",
        json.dumps({"sentence1": "Dana ran.", "sentence2": "Someone ran.", "label": 0, "idx": 0})
        + "\n"
        + json.dumps({"sentence1": "Dana ran.", "sentence2": "Dana swam.", "label": 1, "idx": 1})
        + "\n",
    )
    cola = "x\ty\nthe sailors rode the breeze clear of the rocks\t1\nhim left\t0\n"
    write(tmp_path / "cola" / "in_domain_dev.tsv", cola)
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    write(
        tmp_path / "stsb" / "dev.tsv",
        header
        + "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man with a hard hat.\tA man wearing a hard hat."
        + "\t5.000\n"
        + "1\tmain-news\theadlines\t2015\t0001\tnone\tnone\tStocks fall.\tRain today.\t0.250\n",
    )
    write(
        tmp_path / "qnli" / "dev.tsv",
        "index\tquestion\tsentence\tlabel\n0\tWho won?\tThe home team won.\tentailment\n"
        "1\tWho won?\tIt rained.\tnot_entailment\n",
    )
    return tmp_path


EXPECTED_TEST = {
    "sst2": [GlueExample("it 's a charming journey . ", None, 1), GlueExample("unfunny ", None, 0)],
    "mrpc": [GlueExample('"He said so.', 'He "said" so.', 1), GlueExample("A cat.", "A dog.", 0)],
    "rte": [GlueExample("Dana ran.", "Someone ran.", 0), GlueExample("Dana ran.", "Dana swam.", 1)],
    "cola": [GlueExample("the sailors rode the breeze clear of the rocks", None, 1), GlueExample("him left", None, 0)],
    "stsb": [
        GlueExample("A man with a hard hat.", "A man wearing a hard hat.", 5.0),
        GlueExample("Stocks fall.", "Rain today.", 0.25),
    ],
    "qnli": [GlueExample("Who won?", "The home team won.", 0), GlueExample("Who won?", "It rained.", 1)],
}


@pytest.mark.parametrize("task", sorted(EXPECTED_TEST))
def test_test_split_reads_eval_file(eval_dir: Path, task: str) -> None:
    assert load_glue(task, "test", eval_dir) == EXPECTED_TEST[task]
    assert load_glue(task, "test", str(eval_dir)) == EXPECTED_TEST[task]


def test_qnli_validation_is_eval_file(eval_dir: Path) -> None:
    assert load_glue("qnli", "validation", eval_dir) == EXPECTED_TEST["qnli"]


def test_stsb_columns_found_by_name(tmp_path: Path) -> None:
    path = write(tmp_path / "dev.tsv", "score\tsentence2\tgenre\tsentence1\n1.5\tB.\tnews\tA.\n")
    assert read_glue_file("stsb", path) == [GlueExample("A.", "B.", 1.5)]


def test_holdout_pattern(tmp_path: Path) -> None:
    write(tmp_path / "cola" / "train.tsv", "x\ty\n" + "".join(f"s{i}\t{i % 2}\n" for i in range(7)))
    assert [e.text_a for e in load_glue("cola", "validation", tmp_path, holdout_every=3)] == ["s2", "s5"]
    assert [e.text_a for e in load_glue("cola", "train", tmp_path, holdout_every=3)] == ["s0", "s1", "s3", "s4", "s6"]


# ---------------------------------------------------------------- errors


def test_unknown_task_and_split(eval_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown GLUE task 'mnli'.*sst2"):
        load_glue("mnli", "train", eval_dir)
    with pytest.raises(ValueError, match="unknown GLUE task"):
        read_glue_file("wnli", eval_dir / "sst2" / "dev.tsv")
    with pytest.raises(ValueError, match="unknown split 'dev'.*'train', 'validation', 'test'"):
        load_glue("sst2", "dev", eval_dir)
    with pytest.raises(ValueError, match="holdout_every"):
        load_glue("sst2", "train", eval_dir, holdout_every=1)


def test_missing_file_names_path_and_split(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_glue("rte", "validation", tmp_path)
    assert str(tmp_path / "rte" / "train.jsonl") in str(err.value) and "'validation'" in str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        load_glue("cola", "test", tmp_path)
    assert str(tmp_path / "cola" / "in_domain_dev.tsv") in str(err.value)


@pytest.mark.parametrize(
    ("task", "text", "message"),
    [
        ("sst2", "sentence\tlabel\ngood\t1\nbad\t0\textra\n", r"dev\.tsv:3: expected 2 tab-separated fields, got 3"),
        ("sst2", "sentence\tlabel\ngood\t1\n\nbad\t0\n", r"dev\.tsv:3: expected 2"),
        ("sst2", "sentence\tlabel\ngood\tpositive\n", r"dev\.tsv:2: unparsable label 'positive'"),
        ("cola", "x\ty\nok\t1\nok\t2\n", r"dev\.tsv:3: unparsable label '2'"),
        ("qnli", "index\tquestion\tsentence\tlabel\n0\tq\ts\tentails\n", r"dev\.tsv:2: unparsable label"),
        ("stsb", "sentence1\tsentence2\tscore\na\tb\tfive\n", r"dev\.tsv:2: unparsable score 'five'"),
        ("stsb", "sentence1\tsentence2\tscore\na\tb\t1\na\tb\t5.5\n", r"dev\.tsv:3: score '5\.5' is outside"),
        ("mrpc", "Quality\t#1 ID\t#2 ID\t#1 String\n1\t1\t2\tA\n", r"lacks column"),
        ("qnli", "index\tquestion\tsentence\n0\tq\ts\n", r"file has no labels"),
    ],
)
def test_malformed_tsv(tmp_path: Path, task: str, text: str, message: str) -> None:
    path = write(tmp_path / "dev.tsv", text)
    with pytest.raises(ValueError, match=message) as err:
        read_glue_file(task, path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("line2", "message"),
    [
        ('{"sentence1": "a", "sentence2": "b", "label": 1', r"validation\.jsonl:2: invalid JSON"),
        ('{"sentence1": "a", "sentence2": "b", "label": "yes"}', r"validation\.jsonl:2: unparsable label 'yes'"),
        ('{"sentence1": "a", "sentence2": "b", "label": -1}', r"validation\.jsonl:2: unparsable label -1"),
        ('{"sentence1": "a", "sentence2": "b", "idx": 1}', r"validation\.jsonl:2: file has no labels"),
        ('["a", "b", 1]', r"validation\.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_jsonl(tmp_path: Path, line2: str, message: str) -> None:
    good = json.dumps({"sentence1": "a", "sentence2": "b", "label": 0})
    write(tmp_path / "rte" / "validation.jsonl", f"{good}\n{line2}\n")
    with pytest.raises(ValueError, match=message):
        load_glue("rte", "test", tmp_path)


# ---------------------------------------------------------------- hub path (fake `datasets` module, no network)


def fake_datasets(monkeypatch: pytest.MonkeyPatch, splits: dict[str, list[dict]], calls: list) -> None:
    def load_dataset(*args: str, split: str) -> list[dict]:
        calls.append((args, split))
        return splits[split]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_hub_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    train = [{"sentence1": f"a{i}", "sentence2": f"b{i}", "label": i % 6 / 2, "idx": i} for i in range(12)]
    dev = [{"sentence1": "x", "sentence2": "y", "label": 4.2, "idx": 0}]
    calls: list = []
    fake_datasets(monkeypatch, {"train": train, "validation": dev}, calls)
    tr = load_glue("stsb", "train")
    assert len(tr) == 11 and "a9" not in [e.text_a for e in tr] and tr[1] == GlueExample("a1", "b1", 0.5)
    assert load_glue("stsb", "validation") == [GlueExample("a9", "b9", 1.5)]
    assert load_glue("stsb", "test") == [GlueExample("x", "y", 4.2)]
    assert calls == [
        (("nyu-mll/glue", "stsb"), "train"),
        (("nyu-mll/glue", "stsb"), "train"),
        (("nyu-mll/glue", "stsb"), "validation"),
    ]


def test_hub_single_sentence_and_qnli(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"sentence": f"s{i}", "label": i % 2, "idx": i} for i in range(3)]
    qnli = [{"question": "q", "sentence": "s", "label": 1, "idx": 0}]
    fake_datasets(monkeypatch, {"train": rows, "validation": qnli}, [])
    assert load_glue("cola", "train", holdout_every=3) == [GlueExample("s0", None, 0), GlueExample("s1", None, 1)]
    assert load_glue("qnli", "validation") == load_glue("qnli", "test") == [GlueExample("q", "s", 1)]


def test_hub_offline_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_dataset(*args: str, split: str) -> None:
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(RuntimeError, match=r"nyu-mll/glue.*offline.*data_dir") as err:
        load_glue("mrpc", "test")
    assert isinstance(err.value.__cause__, ConnectionError)
