"""The offline evaluate metric modules in hf_kernel_attn/evaluation/metrics against scikit-learn / scipy / math."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import evaluate
import numpy as np
import pytest
from scipy import special
from sklearn import metrics as skm

from hf_kernel_attn.evaluation.metrics import METRIC_NAMES, METRICS_DIR, load_metric, metric_path

SEEDS = range(5)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("metric_cache"))


@pytest.fixture(scope="module")
def metric(cache_dir):
    """Each metric loaded once per module (by absolute script path), keyed by name."""
    loaded: dict[str, evaluate.EvaluationModule] = {}

    def get(name: str) -> evaluate.EvaluationModule:
        if name not in loaded:
            loaded[name] = load_metric(name, cache_dir=cache_dir)
        return loaded[name]

    return get


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to resolve a host or open a connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def fresh(name: str) -> evaluate.EvaluationModule:
    """A new in-memory instance, for calls expected to raise (a compute that raises leaves evaluate's cache-file lock
    held, and the instance's next compute waits 1 s for it)."""
    return load_metric(name, keep_in_memory=True)


def _labels(rng: np.random.Generator, n: int, k: int, agree: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """Random references in [0, k) and predictions that copy them with probability ``agree``."""
    ref = rng.integers(0, k, size=n)
    pred = np.where(rng.random(n) < agree, ref, rng.integers(0, k, size=n))
    return pred, ref


# ---------------------------------------------------------------- paths and loading


def test_metric_path_and_names():
    on_disk = sorted(p.parent.name for p in METRICS_DIR.glob("*/*.py") if p.stem == p.parent.name)
    assert sorted(METRIC_NAMES) == on_disk
    for name in METRIC_NAMES:
        path = Path(metric_path(name))
        assert path.is_absolute() and path.is_file() and path.name == f"{name}.py"


def test_metric_path_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown metric 'bleu'") as err:
        metric_path("bleu")
    for name in METRIC_NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", METRIC_NAMES)
def test_load_by_path_without_network(name, no_network, cache_dir):
    for path in (metric_path(name), str(Path(metric_path(name)).parent)):  # the script and its folder
        module = evaluate.load(path, cache_dir=cache_dir)
        assert isinstance(module, evaluate.Metric)
        assert module.name == name
        assert module.description.strip() and module.citation.strip() and module.features


# ---------------------------------------------------------------- accuracy


@pytest.mark.parametrize("seed", SEEDS)
def test_accuracy_matches_sklearn(metric, seed):
    rng = np.random.default_rng(seed)
    pred, ref = _labels(rng, int(rng.integers(20, 200)), int(rng.integers(2, 6)))
    weight = rng.random(pred.shape[0])
    acc = metric("accuracy")
    for normalize in (True, False):
        got = acc.compute(predictions=pred, references=ref, normalize=normalize)["accuracy"]
        assert got == pytest.approx(skm.accuracy_score(ref, pred, normalize=normalize))
        got = acc.compute(predictions=pred, references=ref, normalize=normalize, sample_weight=weight)["accuracy"]
        assert got == pytest.approx(skm.accuracy_score(ref, pred, normalize=normalize, sample_weight=weight))


# ---------------------------------------------------------------- f1


@pytest.mark.parametrize("seed", SEEDS)
def test_f1_binary_matches_sklearn(metric, seed):
    rng = np.random.default_rng(seed)
    pred, ref = _labels(rng, int(rng.integers(20, 200)), 2)
    weight = rng.random(pred.shape[0])
    f1 = metric("f1")
    assert f1.compute(predictions=pred, references=ref)["f1"] == pytest.approx(skm.f1_score(ref, pred))
    for pos_label in (0, 1):
        got = f1.compute(predictions=pred, references=ref, pos_label=pos_label, sample_weight=weight)["f1"]
        assert got == pytest.approx(skm.f1_score(ref, pred, pos_label=pos_label, sample_weight=weight))
    # labels other than {0, 1}
    got = f1.compute(predictions=pred * 4 + 3, references=ref * 4 + 3, pos_label=7)["f1"]
    assert got == pytest.approx(skm.f1_score(ref * 4 + 3, pred * 4 + 3, pos_label=7))


@pytest.mark.parametrize("seed", SEEDS)
def test_f1_averages_match_sklearn(metric, seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(3, 7))
    pred, ref = _labels(rng, int(rng.integers(30, 200)), k, agree=0.4)
    weight = rng.random(pred.shape[0])
    f1 = metric("f1")
    for average in ("micro", "macro", "weighted", None):
        for sw in (None, weight):
            got = f1.compute(predictions=pred, references=ref, average=average, sample_weight=sw)["f1"]
            want = skm.f1_score(ref, pred, average=average, sample_weight=sw, zero_division=0.0)
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        labels = [0, 2, k + 1]  # a subset plus an absent class
        got = f1.compute(predictions=pred, references=ref, average=average, labels=labels)["f1"]
        np.testing.assert_allclose(
            got, skm.f1_score(ref, pred, average=average, labels=labels, zero_division=0.0), rtol=1e-12, atol=1e-12
        )


def test_f1_edge_cases(metric):
    f1 = metric("f1")
    # a single class, pos_label absent: F1 is 0/0 -> zero_division
    assert f1.compute(predictions=[0, 0, 0], references=[0, 0, 0])["f1"] == 0.0
    assert f1.compute(predictions=[0, 0, 0], references=[0, 0, 0], zero_division=1.0)["f1"] == 1.0
    assert f1.compute(predictions=[1, 1], references=[1, 1])["f1"] == 1.0
    with pytest.raises(ValueError, match="at most two distinct labels"):
        fresh("f1").compute(predictions=[0, 1, 2], references=[0, 1, 2])
    with pytest.raises(ValueError, match="pos_label"):
        fresh("f1").compute(predictions=[0, 2], references=[2, 0])
    with pytest.raises(ValueError, match="average"):
        fresh("f1").compute(predictions=[0, 1], references=[0, 1], average="samples")


# ---------------------------------------------------------------- matthews


@pytest.mark.parametrize("seed", SEEDS)
def test_matthews_matches_sklearn(metric, seed):
    rng = np.random.default_rng(seed)
    mcc = metric("matthews_correlation")
    for k in (2, int(rng.integers(3, 7))):
        pred, ref = _labels(rng, int(rng.integers(20, 200)), k)
        weight = rng.random(pred.shape[0])
        got = mcc.compute(predictions=pred, references=ref)["matthews_correlation"]
        assert got == pytest.approx(skm.matthews_corrcoef(ref, pred), abs=1e-12)
        got = mcc.compute(predictions=pred, references=ref, sample_weight=weight)["matthews_correlation"]
        assert got == pytest.approx(skm.matthews_corrcoef(ref, pred, sample_weight=weight), abs=1e-12)


@pytest.mark.filterwarnings("ignore:A single label was found")
def test_matthews_degenerate_is_zero(metric):
    mcc = metric("matthews_correlation")
    pred = [0, 1, 1, 0, 1]
    for ref, p in (([1] * 5, pred), (pred, [1] * 5), ([1] * 5, [1] * 5)):  # one class in references / predictions
        assert skm.matthews_corrcoef(ref, p) == 0.0
        assert mcc.compute(predictions=p, references=ref)["matthews_correlation"] == 0.0
    assert mcc.compute(predictions=[0, 1, 2], references=[0, 1, 2])["matthews_correlation"] == pytest.approx(1.0)


# ---------------------------------------------------------------- pearson / spearman


def _average_ranks(x: np.ndarray) -> list[float]:
    """1-based ranks, tied values sharing the mean of the positions they occupy (by counting, no sorting)."""
    x = [float(a) for a in x]
    return [sum(b < a for b in x) + (sum(b == a for b in x) + 1) / 2 for a in x]


def _pearson_by_hand(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """r = Σ(x - x̄)(y - ȳ) / sqrt(Σ(x - x̄)² Σ(y - ȳ)²) in plain Python sums, and its two-sided p-value from
    Student's t with n - 2 degrees of freedom, t = r sqrt((n - 2) / (1 - r²)), through the regularised
    incomplete beta function: p = I_{ν/(ν + t²)}(ν/2, 1/2) (a different computation from scipy.stats.pearsonr, which
    the metric module calls)."""
    x, y = [float(a) for a in x], [float(b) for b in y]
    mx, my = math.fsum(x) / len(x), math.fsum(y) / len(y)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = math.fsum((a - mx) ** 2 for a in x), math.fsum((b - my) ** 2 for b in y)
    r = sxy / math.sqrt(sxx * syy)
    nu = len(x) - 2
    t2 = r * r * nu / (1 - r * r)
    return r, float(special.betainc(nu / 2, 0.5, nu / (nu + t2)))


@pytest.mark.parametrize("seed", SEEDS)
def test_pearsonr_matches_the_formula(metric, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 100))
    ref = rng.normal(size=n)
    pred = 0.5 * ref + rng.normal(size=n)
    out = metric("pearsonr").compute(predictions=pred, references=ref, return_pvalue=True)
    r, p = _pearson_by_hand(ref, pred)
    assert out["pearsonr"] == pytest.approx(r, abs=1e-12)
    assert out["p-value"] == pytest.approx(p, rel=1e-8)
    assert set(metric("pearsonr").compute(predictions=pred, references=ref)) == {"pearsonr"}


@pytest.mark.parametrize("seed", SEEDS)
def test_spearmanr_matches_scipy_with_ties(metric, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(10, 100))
    ref = rng.integers(0, 5, size=n).astype(float)  # many ties
    pred = np.round(ref + rng.normal(scale=1.5, size=n))
    out = metric("spearmanr").compute(predictions=pred, references=ref, return_pvalue=True)
    # the definition: Pearson correlation of the average ranks (ties share the mean of their positions), and
    # the t-approximation p-value of that correlation
    rho, p = _pearson_by_hand(_average_ranks(ref), _average_ranks(pred))
    assert out["spearmanr"] == pytest.approx(rho, abs=1e-12)
    assert out["spearmanr_pvalue"] == pytest.approx(p, rel=1e-8)
    assert set(metric("spearmanr").compute(predictions=pred, references=ref)) == {"spearmanr"}


# ---------------------------------------------------------------- perplexity


@pytest.mark.parametrize("seed", SEEDS)
def test_perplexity_matches_direct_computation(metric, seed):
    rng = np.random.default_rng(seed)
    n_tokens, vocab = int(rng.integers(50, 400)), 37
    logits = rng.normal(scale=3.0, size=(n_tokens, vocab))
    targets = rng.integers(0, vocab, size=n_tokens)
    token_nll = -special.log_softmax(logits, axis=-1)[np.arange(n_tokens), targets]
    token_bytes = rng.integers(1, 6, size=n_tokens)
    want_ppl = math.exp(sum(token_nll.tolist()) / n_tokens)
    want_bpb = sum(token_nll.tolist()) / (math.log(2) * int(token_bytes.sum()))

    # windows of random lengths: summed NLL per window
    cuts = np.sort(rng.choice(np.arange(1, n_tokens), size=int(rng.integers(1, 10)), replace=False))
    windows = np.split(np.arange(n_tokens), cuts)
    nll = [float(token_nll[w].sum()) for w in windows]
    num_tokens = [len(w) for w in windows]
    num_bytes = [int(token_bytes[w].sum()) for w in windows]

    ppl = metric("perplexity")
    out = ppl.compute(nll=nll, num_tokens=num_tokens)
    assert out["perplexity"] == pytest.approx(want_ppl, rel=1e-12)
    assert out["nll"] == pytest.approx(math.log(want_ppl), rel=1e-12)
    assert out["num_tokens"] == n_tokens
    assert "bits_per_byte" not in out

    out = ppl.compute(nll=nll, num_tokens=num_tokens, num_bytes=num_bytes)
    assert out["perplexity"] == pytest.approx(want_ppl, rel=1e-12)
    assert out["bits_per_byte"] == pytest.approx(want_bpb, rel=1e-12)
    assert out["num_bytes"] == int(token_bytes.sum())

    # one row per token, streamed in batches, then one more row with add()
    for chunk in np.array_split(np.arange(n_tokens - 1), 3):
        ppl.add_batch(nll=token_nll[chunk], num_tokens=np.ones(len(chunk), dtype=int), num_bytes=token_bytes[chunk])
    ppl.add(nll=float(token_nll[-1]), num_tokens=1, num_bytes=int(token_bytes[-1]))
    out = ppl.compute()
    assert out["perplexity"] == pytest.approx(want_ppl, rel=1e-12)
    assert out["bits_per_byte"] == pytest.approx(want_bpb, rel=1e-12)


def test_perplexity_errors():
    with pytest.raises(ValueError, match="nll and num_tokens"):
        fresh("perplexity").compute(nll=[1.0, 2.0])
    with pytest.raises(ValueError, match="no scored tokens"):
        fresh("perplexity").compute(nll=[0.0], num_tokens=[0])
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        fresh("perplexity").compute(nll=[1.0, 1.0], num_tokens=[2, -1])
    ppl = fresh("perplexity")
    ppl.add_batch(nll=[1.0], num_tokens=[1], num_bytes=[3])
    ppl.add_batch(nll=[1.0], num_tokens=[1])
    with pytest.raises(ValueError, match="every row or for none"):
        ppl.compute()


# ---------------------------------------------------------------- mismatched lengths


@pytest.mark.parametrize("name", ["accuracy", "f1", "matthews_correlation", "pearsonr", "spearmanr"])
def test_mismatched_lengths_raise(name):
    with pytest.raises(ValueError, match="Mismatch in the number of predictions"):
        fresh(name).compute(predictions=[0, 1, 1], references=[0, 1])


def test_mismatched_lengths_raise_perplexity_and_weights():
    with pytest.raises(ValueError, match="Mismatch in the number of nll"):
        fresh("perplexity").compute(nll=[1.0, 2.0], num_tokens=[1])
    with pytest.raises(ValueError, match="Mismatch in the number of nll"):
        fresh("perplexity").compute(nll=[1.0, 2.0], num_tokens=[1, 1], num_bytes=[4])
    for name in ("accuracy", "f1", "matthews_correlation"):
        with pytest.raises(ValueError, match="sample_weight has 1 entries"):
            fresh(name).compute(predictions=[0, 1], references=[0, 1], sample_weight=[1.0])
