"""training/metrics.py against references written here in numpy / plain Python."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mirrored.distribute.variables import Variable, VariableAggregation, VariableSynchronization
from mirrored.training import metrics
from mirrored.training.metrics import (
    AUC,
    Accuracy,
    BinaryAccuracy,
    CategoricalAccuracy,
    Mean,
    MeanMetricWrapper,
    Precision,
    Recall,
    SparseCategoricalAccuracy,
    SparseTopKCategoricalAccuracy,
    Sum,
)


def approx(got: torch.Tensor, want: float, tol: float = 1e-6) -> None:
    assert got.dtype == torch.float32 and got.ndim == 0
    assert abs(got.item() - want) <= tol, (got.item(), want)


@pytest.fixture
def classification():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 6)).astype(np.float32)
    labels = rng.integers(0, 6, size=40)
    weights = rng.random(40)
    return logits, labels, weights


def weighted_mean(values, weights=None) -> float:
    values = np.asarray(values, dtype=np.float64)
    weights = np.ones_like(values) if weights is None else np.asarray(weights, dtype=np.float64)
    return float((values * weights).sum() / weights.sum()) if weights.sum() else 0.0


# --- state ----------------------------------------------------------------------------------------

def test_state_is_sync_on_read_sum_float64_variables():
    for metric in (Mean(), SparseCategoricalAccuracy(), Precision(), AUC(num_thresholds=7)):
        assert metric.variables
        for var in metric.variables:
            assert isinstance(var, Variable)
            assert var.synchronization is VariableSynchronization.ON_READ
            assert var.aggregation is VariableAggregation.SUM
            assert var.dtype == torch.float64 and not var.trainable
    assert AUC(num_thresholds=7).true_positives.shape == (7,)


# --- Mean, Sum, wrappers --------------------------------------------------------------------------

def test_mean_accumulates_weights_and_resets():
    m = Mean()
    approx(m.result(), 0.0)  # nothing seen: 0, not nan
    m.update_state(torch.tensor([1.0, 2.0, 3.0]))
    m.update_state(torch.tensor([[4.0], [10.0]]), sample_weight=torch.tensor([0.5, 0.0]))
    approx(m.result(), weighted_mean([1, 2, 3, 4, 10], [1, 1, 1, 0.5, 0]))
    approx(m(5.0), weighted_mean([1, 2, 3, 4, 10, 5], [1, 1, 1, 0.5, 0, 1]))  # __call__: update + result
    m.reset_state()
    approx(m.result(), 0.0)
    m.update_state([2.0, 4.0])
    approx(m.result(), 3.0)


def test_mean_count_is_exact_past_float32():
    m = Mean()
    for _ in range(3):
        m.update_state(torch.zeros(1), sample_weight=torch.tensor([2.0 ** 25]))
    m.update_state(torch.ones(1))
    assert m.count.read_value().item() == 3 * 2 ** 25 + 1  # float32 would have dropped the +1


def test_sum():
    s = Sum()
    s.update_state(torch.tensor([1.0, 2.0]))
    s.update_state(torch.tensor([3.0, 4.0]), sample_weight=torch.tensor([2.0, 0.5]))
    approx(s.result(), 1 + 2 + 6 + 2)
    s.reset_state()
    approx(s.result(), 0.0)


def test_mean_metric_wrapper():
    def abs_error(y_true, y_pred, scale=1.0):
        return (y_true - y_pred).abs() * scale

    m = MeanMetricWrapper(abs_error, scale=2.0)
    assert m.name == "abs_error"
    m.update_state(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), sample_weight=torch.tensor([1.0, 3.0]))
    approx(m.result(), weighted_mean([2, 4], [1, 3]))


# --- accuracies -----------------------------------------------------------------------------------

def test_sparse_categorical_accuracy_accumulates_with_weights(classification):
    logits, labels, weights = classification
    hits = (logits.argmax(1) == labels).astype(np.float64)
    m = SparseCategoricalAccuracy()
    m.update_state(torch.tensor(labels[:25]), torch.tensor(logits[:25]), sample_weight=torch.tensor(weights[:25]))
    m.update_state(torch.tensor(labels[25:, None]), torch.tensor(logits[25:]), sample_weight=torch.tensor(weights[25:]))
    approx(m.result(), weighted_mean(hits, weights))
    m.reset_state()
    m.update_state(torch.tensor(labels).float(), torch.tensor(logits))  # float labels compare as floats
    approx(m.result(), hits.mean())


def test_sparse_categorical_accuracy_takes_the_first_of_tied_maxima():
    m = SparseCategoricalAccuracy()
    m.update_state(torch.tensor([0, 1]), torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]]))
    approx(m.result(), 0.5)


def test_categorical_accuracy(classification):
    logits, labels, weights = classification
    onehot = np.eye(6)[labels]
    m = CategoricalAccuracy()
    m.update_state(torch.tensor(onehot), torch.tensor(logits), sample_weight=torch.tensor(weights))
    approx(m.result(), weighted_mean(logits.argmax(1) == labels, weights))
    with pytest.raises(ValueError, match="integer labels need sparse_categorical_accuracy"):
        m.update_state(torch.tensor(labels), torch.tensor(logits))


def test_accuracy_compares_values():
    m = Accuracy()
    m.update_state(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 0, 3, 0]))
    m.update_state(torch.tensor([[1], [2]]), torch.tensor([1, 2]))
    approx(m.result(), 4 / 6)
    with pytest.raises(ValueError, match=r"y_true has shape \(3,\) but y_pred has shape \(3, 2\)"):
        m.update_state(torch.zeros(3), torch.zeros(3, 2))


def test_binary_accuracy_threshold_and_logits():
    y_true = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    probs = torch.tensor([0.9, 0.6, 0.3, 0.1, 0.7])
    m = BinaryAccuracy()
    m.update_state(y_true, probs[:, None])  # (B,) labels against (B, 1) predictions
    approx(m.result(), 3 / 5)
    m = BinaryAccuracy(threshold=0.2)
    m.update_state(y_true, probs, sample_weight=torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]))
    approx(m.result(), weighted_mean([1, 0, 1, 1, 1], [1, 1, 1, 1, 0]))
    m = BinaryAccuracy(from_logits=True)
    m.update_state(y_true, torch.logit(probs))
    approx(m.result(), 3 / 5)
    with pytest.raises(ValueError, match=r"threshold=2"):
        BinaryAccuracy(threshold=2)


def reference_top_k(logits: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return np.array([label in row for label, row in zip(labels, order)], dtype=np.float64)


@pytest.mark.parametrize("k", [1, 2, 5, 6, 10])
def test_sparse_top_k_categorical_accuracy(classification, k):
    logits, labels, weights = classification
    m = SparseTopKCategoricalAccuracy(k=k)
    m.update_state(torch.tensor(labels), torch.tensor(logits), sample_weight=torch.tensor(weights))
    approx(m.result(), weighted_mean(reference_top_k(logits, labels, k), weights))
    if k == 1:
        acc = SparseCategoricalAccuracy()
        acc.update_state(torch.tensor(labels), torch.tensor(logits), sample_weight=torch.tensor(weights))
        approx(m.result(), acc.result().item())


def test_sparse_top_k_counts_ties_like_in_top_k_and_misses_bad_labels():
    m = SparseTopKCategoricalAccuracy(k=2)
    scores = torch.tensor([[3.0, 2.0, 2.0, 0.0]] * 3 + [[1.0, float("nan"), 0.0, 0.0]])
    m.update_state(torch.tensor([2, 3, 7, 1]), scores)  # tie at the boundary: hit; 3: miss; 7: out of range
    approx(m.result(), 1 / 4)
    with pytest.raises(ValueError, match="k=0"):
        SparseTopKCategoricalAccuracy(k=0)


# --- precision, recall ------------------------------------------------------------------------------

@pytest.fixture
def binary():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, size=300)
    p = np.clip(rng.normal(0.35 + 0.3 * y, 0.25), 0, 1)
    w = rng.random(300)
    return y, p, w


def confusion(y, p, w, t):
    pred = p > t
    return {"tp": float(w[pred & (y == 1)].sum()), "fp": float(w[pred & (y == 0)].sum()),
            "fn": float(w[~pred & (y == 1)].sum()), "tn": float(w[~pred & (y == 0)].sum())}


@pytest.mark.parametrize("threshold", [0.5, 0.3, 0.0])
def test_precision_and_recall_match_counts(binary, threshold):
    y, p, w = binary
    c = confusion(y, p, w, threshold)
    prec, rec = Precision(thresholds=threshold), Recall(thresholds=threshold)
    for m in (prec, rec):
        m.update_state(torch.tensor(y[:100]), torch.tensor(p[:100]), sample_weight=torch.tensor(w[:100]))
        m.update_state(torch.tensor(y[100:, None]), torch.tensor(p[100:, None]), sample_weight=torch.tensor(w[100:]))
    assert prec.true_positives.read_value().item() == pytest.approx(c["tp"], rel=1e-12)
    assert prec.false_positives.read_value().item() == pytest.approx(c["fp"], rel=1e-12)
    assert rec.false_negatives.read_value().item() == pytest.approx(c["fn"], rel=1e-12)
    approx(prec.result(), c["tp"] / (c["tp"] + c["fp"]))
    approx(rec.result(), c["tp"] / (c["tp"] + c["fn"]))


def test_precision_recall_from_logits_and_empty(binary):
    y, p, _ = binary
    p = np.clip(p, 1e-6, 1 - 1e-6)
    logits = torch.logit(torch.tensor(p))
    for cls in (Precision, Recall):
        a, b = cls(), cls(from_logits=True)
        a.update_state(torch.tensor(y), torch.tensor(p))
        b.update_state(torch.tensor(y), logits)
        approx(b.result(), a.result().item())
    empty = Precision()
    empty.update_state(torch.zeros(4), torch.zeros(4))  # no predicted positives: 0, not nan
    approx(empty.result(), 0.0)


def test_thresholded_metrics_refuse_logits_without_from_logits():
    for m in (Precision(), Recall(), AUC()):
        with pytest.raises(ValueError, match=r"outside \[0, 1\].*from_logits=True"):
            m.update_state(torch.tensor([0, 1, 1]), torch.tensor([-2.0, 0.5, 3.0]))


# --- AUC ----------------------------------------------------------------------------------------------

def keras_thresholds(n: int) -> list[float]:
    return [-1e-7] + [i / (n - 1) for i in range(1, n - 1)] + [1 + 1e-7]


def reference_roc_auc(y, p, w, n):
    """Trapezoid over (FPR, TPR) at the thresholds, from brute-force confusion counts."""
    pts = [confusion(y, p, w, t) for t in keras_thresholds(n)]
    tpr = [c["tp"] / (c["tp"] + c["fn"]) for c in pts]
    fpr = [c["fp"] / (c["fp"] + c["tn"]) for c in pts]
    return sum((fpr[i] - fpr[i + 1]) * (tpr[i] + tpr[i + 1]) / 2 for i in range(n - 1))


def reference_pr_auc(y, p, w, n, samples=2001):
    """Area under precision(recall) when TP and FP move linearly between the operating points at the
    thresholds, by numerical quadrature (not the closed form metrics.py uses)."""
    pts = [confusion(y, p, w, t) for t in keras_thresholds(n)]
    positives = pts[0]["tp"] + pts[0]["fn"]
    area = 0.0
    s = np.linspace(1e-12, 1, samples)
    for a, b in zip(pts[:-1], pts[1:]):
        if a["tp"] == b["tp"]:
            continue  # recall does not move
        tp = b["tp"] + s * (a["tp"] - b["tp"])
        fp = b["fp"] + s * (a["fp"] - b["fp"])
        area += np.trapezoid(tp / (tp + fp), tp / positives)
    return area


def exact_roc_auc(y, p):
    """P(score of a positive > score of a negative) over all pairs (Mann-Whitney), distinct scores."""
    pos, neg = p[y == 1], p[y == 0]
    return float((pos[:, None] > neg[None, :]).mean())


def exact_pr_auc(y, p):
    """Trapezoid over the PR curve with one point per example (every distinct score a threshold)."""
    order = np.argsort(-p)
    tp = np.cumsum(y[order] == 1)
    fp = np.cumsum(y[order] == 0)
    recall, precision = tp / tp[-1], tp / (tp + fp)
    recall, precision = np.concatenate([[0.0], recall]), np.concatenate([[precision[0]], precision])
    return float(np.trapezoid(precision, recall))


@pytest.fixture
def scores():
    rng = np.random.default_rng(2)
    y = rng.integers(0, 2, size=2000)
    p = 1 / (1 + np.exp(-rng.normal(1.2 * y - 0.6, 1.0)))
    assert len(np.unique(p)) == len(p)
    return y, p, rng.random(2000)


def test_roc_auc_against_the_exact_area(scores):
    y, p, _ = scores
    m = AUC()
    m.update_state(torch.tensor(y), torch.tensor(p))
    approx(m.result(), exact_roc_auc(y, p), tol=1e-2)
    approx(m.result(), reference_roc_auc(y, p, np.ones_like(p), 200), tol=1e-6)


def test_pr_auc_against_the_exact_area(scores):
    y, p, _ = scores
    m = AUC(curve="PR")
    m.update_state(torch.tensor(y), torch.tensor(p))
    approx(m.result(), exact_pr_auc(y, p), tol=1e-2)
    approx(m.result(), reference_pr_auc(y, p, np.ones_like(p), 200), tol=1e-5)


@pytest.mark.parametrize("curve", ["ROC", "PR"])
def test_auc_with_weights_and_few_thresholds_matches_reference(scores, curve):
    y, p, w = scores
    m = AUC(num_thresholds=13, curve=curve)
    for part in np.array_split(np.arange(2000), 3):  # several updates accumulate
        m.update_state(torch.tensor(y[part]), torch.tensor(p[part]), sample_weight=torch.tensor(w[part]))
    ref = reference_roc_auc if curve == "ROC" else reference_pr_auc
    approx(m.result(), ref(y, p, w, 13), tol=1e-5)


def test_auc_summation_methods_bracket_the_interpolation(scores):
    y, p, _ = scores
    results = {}
    for method in ("minoring", "interpolation", "majoring"):
        for curve in ("ROC", "PR"):
            m = AUC(num_thresholds=20, curve=curve, summation_method=method)
            m.update_state(torch.tensor(y), torch.tensor(p))
            results[method, curve] = m.result().item()
    for curve in ("ROC", "PR"):
        assert results["minoring", curve] <= results["interpolation", curve] <= results["majoring", curve]
    assert results["minoring", "ROC"] < results["majoring", "ROC"]


def test_auc_corner_cases():
    separable = AUC()
    separable.update_state(torch.tensor([0, 0, 1, 1]), torch.tensor([0.1, 0.2, 0.8, 0.9]))
    approx(separable.result(), 1.0)
    reversed_ = AUC()
    reversed_.update_state(torch.tensor([1, 1, 0, 0]), torch.tensor([0.1, 0.2, 0.8, 0.9]))
    approx(reversed_.result(), 0.0)
    constant = AUC()
    constant.update_state(torch.tensor([1, 0, 1, 0]), torch.tensor([0.5, 0.5, 0.5, 0.5]))
    approx(constant.result(), 0.5)
    edges = AUC(num_thresholds=3)  # 0 and 1 themselves lie inside the outer thresholds
    edges.update_state(torch.tensor([0, 1]), torch.tensor([0.0, 1.0]))
    approx(edges.result(), 1.0)
    approx(AUC().result(), 0.0)  # nothing seen


def test_auc_from_logits_reset_and_weights_as_duplicates(scores):
    y, p, _ = scores
    y, p = y[:200], p[:200]
    a, b = AUC(), AUC(from_logits=True)
    a.update_state(torch.tensor(y), torch.tensor(p))
    b.update_state(torch.tensor(y), torch.logit(torch.tensor(p)))
    approx(b.result(), a.result().item(), tol=1e-6)
    weighted, duplicated = AUC(), AUC()
    weighted.update_state(torch.tensor(y), torch.tensor(p), sample_weight=torch.tensor(np.where(y == 1, 2.0, 1.0)))
    keep = np.concatenate([np.arange(200), np.flatnonzero(y == 1)])
    duplicated.update_state(torch.tensor(y[keep]), torch.tensor(p[keep]))
    approx(weighted.result(), duplicated.result().item())
    a.reset_state()
    assert all(v.read_value().abs().sum() == 0 for v in a.variables)


def test_auc_validates_arguments():
    with pytest.raises(ValueError, match="num_thresholds=1"):
        AUC(num_thresholds=1)
    with pytest.raises(ValueError, match="curve='DET'"):
        AUC(curve="DET")
    with pytest.raises(ValueError, match="summation_method='riemann'"):
        AUC(summation_method="riemann")


# --- registry -----------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_name, cls", [
    ("sparse_categorical_crossentropy", SparseCategoricalAccuracy),
    ("categorical_crossentropy", CategoricalAccuracy),
    ("binary_crossentropy", BinaryAccuracy),
    ("cross_entropy_loss", SparseCategoricalAccuracy),
])
def test_accuracy_follows_the_loss(loss_name, cls):
    m = metrics.get("accuracy", loss_name=loss_name)
    assert type(m) is cls and m.name == "accuracy"
    assert metrics.get("acc", loss_name=loss_name).name == "acc"


def test_binary_accuracy_from_the_loss_reads_logits():
    m = metrics.get("accuracy", loss_name="binary_crossentropy")
    m.update_state(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([[2.0], [-1.0], [-0.5]]))  # logits
    approx(m.result(), 2 / 3)
    m = metrics.get("accuracy", loss_name="binary_crossentropy", from_logits=False)
    m.update_state(torch.tensor([1.0, 0.0]), torch.tensor([0.7, 0.4]))
    approx(m.result(), 1.0)


def test_accuracy_without_a_known_loss_follows_the_shapes(classification):
    logits, labels, _ = classification
    m = metrics.get("accuracy", loss_name="mean_squared_error")
    m.update_state(torch.tensor(labels), torch.tensor(logits))  # sparse
    approx(m.result(), (logits.argmax(1) == labels).mean())
    m = metrics.get("accuracy")
    m.update_state(torch.tensor(np.eye(6)[labels]), torch.tensor(logits))  # one-hot
    approx(m.result(), (logits.argmax(1) == labels).mean())
    m = metrics.get("accuracy")
    m.update_state(torch.tensor([1.0, 0.0]), torch.tensor([[0.3], [-0.2]]))  # one logit per example
    approx(m.result(), 1.0)


def test_get_names_objects_and_functions():
    assert type(metrics.get("sparse_top_k_categorical_accuracy")) is SparseTopKCategoricalAccuracy
    auc = metrics.get("AUC")
    assert type(auc) is AUC and auc.name == "AUC" and auc.from_logits  # names mean logits
    assert metrics.get("precision", from_logits=False).from_logits is False
    m = Recall()
    assert metrics.get(m) is m
    assert type(metrics.get(Mean)) is Mean

    def hits(y_true, y_pred):
        return (y_true == y_pred.argmax(-1)).float()

    wrapped = metrics.get(hits)
    assert isinstance(wrapped, MeanMetricWrapper) and wrapped.name == "hits"


def test_get_unknown_name_lists_the_keys():
    with pytest.raises(ValueError, match="unknown metric 'f1'. Known names: accuracy, acc, sparse_categorical_acc"):
        metrics.get("f1")
    with pytest.raises(TypeError, match="cannot make a metric from 3"):
        metrics.get(3)


# --- under a strategy -----------------------------------------------------------------------------

def test_replicas_accumulate_their_own_copies_and_results_sum(classification):
    strategy_mod = pytest.importorskip("mirrored.distribute.strategy")
    values_mod = pytest.importorskip("mirrored.distribute.values")
    logits, labels, weights = classification
    y, x, w = torch.tensor(labels[:6]), torch.tensor(logits[:6]), torch.tensor(weights[:6])
    yb = (y % 2).float()
    pb = torch.sigmoid(x[:, 0])
    strategy = strategy_mod.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        acc, auc, mean = SparseCategoricalAccuracy(), AUC(num_thresholds=11), Mean()

    def step(yr, xr, wr, ybr, pbr):
        acc.update_state(yr, xr, sample_weight=wr)
        auc.update_state(ybr, pbr)
        mean.update_state(xr[:, 0])

    def split(t):  # 6 over 2 replicas, unevenly: 4 and 2
        return values_mod.PerReplica([t[:4], t[4:]])

    strategy.run(step, args=tuple(split(t) for t in (y, x, w, yb, pb)))
    assert [v.item() for v in acc.count.values] == pytest.approx([w[:4].sum().item(), w[4:].sum().item()])
    approx(acc.result(), weighted_mean(logits[:6].argmax(1) == labels[:6], weights[:6]))
    single = AUC(num_thresholds=11)
    single.update_state(yb, pb)
    approx(auc.result(), single.result().item())
    approx(mean.result(), float(logits[:6, 0].astype(np.float64).mean()))
    acc.reset_state()
    assert all(v.item() == 0 for var in acc.variables for v in var.values)
    del strategy, acc, auc, mean



def test_thresholds_compare_in_float32_as_keras_does():
    """Measured on Keras 3.15: a float32 prediction equal to the threshold (0.3f is 0.30000001...) is
    not above it, because Keras compares in float32; in float64 it would be."""
    p, t = torch.tensor([0.3, 0.3, 0.7, 0.2]), torch.tensor([1.0, 0.0, 1.0, 0.0])
    for metric, want in ((Precision(thresholds=0.3), 1.0), (Recall(thresholds=0.3), 0.5),
                         (BinaryAccuracy(threshold=0.3), 0.75)):
        metric.update_state(t, p)
        approx(metric.result(), want)
    auc, precision = AUC(num_thresholds=11), Precision(thresholds=0.3)
    for m in (auc, precision):
        m.update_state(torch.tensor([1.0, 0.0]), torch.tensor([0.3, 0.35]))
    approx(auc.result(), 0.0)  # Keras: 0.0 (0.3 falls in the bucket below 0.3, with the negative above it)
    approx(precision.result(), 0.0)


def test_mean_counts_samples_not_values():
    """Keras 3's Mean averages each sample's values first: [[1, 2, 3], [4, 5, 6]] then [[10]] is
    (2 + 5 + 10) / 3 = 5.667, not 31 / 7; and sequence accuracy weighs batches by samples."""
    m = Mean()
    m.update_state(torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    m.update_state(torch.tensor([[10.0]]))
    approx(m.result(), 17 / 3)
    m = Mean()
    m.update_state(torch.tensor([[1.0, 2, 3], [4, 5, 6]]), sample_weight=torch.tensor([1.0, 0.0]))
    approx(m.result(), 2.0)  # Keras: 2.0
    acc = BinaryAccuracy()
    acc.update_state(torch.tensor([[1.0, 0, 1, 0]]), torch.tensor([[0.9, 0.9, 0.9, 0.9]]))
    acc.update_state(torch.tensor([[1.0]]), torch.tensor([[0.9]]))
    approx(acc.result(), 0.75)  # Keras: 0.75 (one sample at 0.5, one at 1.0), not 3 of 5 values


def test_accuracy_skips_nan_scores_as_tf_argmax_does():
    """Measured on Keras 3.15: SparseCategoricalAccuracy of [[0.1, nan, 0.5]] with label 2 is 1.0."""
    m = SparseCategoricalAccuracy()
    m.update_state(torch.tensor([2, 1]), torch.tensor([[0.1, float("nan"), 0.5], [0.9, 0.2, 0.1]]))
    approx(m.result(), 0.5)


# --- configs (issue 13) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("metric", [
    metrics.Accuracy(name="acc"), metrics.SparseCategoricalAccuracy(), metrics.CategoricalAccuracy(name="cat"),
    metrics.BinaryAccuracy(threshold=0.3, from_logits=True), metrics.SparseTopKCategoricalAccuracy(k=2),
    metrics.Precision(thresholds=0.4, from_logits=True), metrics.Recall(thresholds=0.6),
    metrics.AUC(num_thresholds=50, curve="PR", summation_method="majoring"), metrics.Mean(name="m"),
    metrics.Sum(), metrics.get("accuracy"), metrics.MeanMetricWrapper(metrics.sparse_categorical_accuracy),
], ids=lambda m: type(m).__name__)
def test_configs_round_trip_through_json_and_measure_the_same(metric, classification):
    """get_config holds the settings, not the state: the rebuilt metric starts empty and, fed the same
    batches, reports what the original reports."""
    import json

    logits, labels = torch.as_tensor(classification[0]), torch.as_tensor(classification[1])
    config = json.loads(json.dumps(metrics.serialize(metric)))
    again = metrics.deserialize(config)
    assert type(again) is type(metric) and again.get_config() == metric.get_config()
    assert metrics.get(config).get_config() == metric.get_config()
    binary_labels, scores = (labels % 2).float(), logits[:, 0]
    args = {metrics.Accuracy: (labels, logits.argmax(dim=1)),
            metrics.CategoricalAccuracy: (torch.nn.functional.one_hot(labels, logits.shape[1]).float(), logits),
            metrics.BinaryAccuracy: (binary_labels, scores), metrics.Precision: (binary_labels, scores),
            metrics.Recall: (binary_labels, torch.sigmoid(scores)), metrics.AUC: (binary_labels, torch.sigmoid(scores)),
            metrics.Mean: (scores,), metrics.Sum: (scores,)}.get(type(metric), (labels, logits))
    metric.reset_state()
    for m in (metric, again):
        m.update_state(*args)
    assert float(again.result()) == float(metric.result())


def test_metrics_without_a_config_say_so_and_unknown_functions_are_refused():
    assert metrics.serialize(metrics.MeanMetricWrapper(lambda y_true, y_pred: y_pred)) is None

    class Mine(metrics.Mean):
        pass

    assert metrics.serialize(Mine()) is None
    with pytest.raises(ValueError, match="fn='eval' is not one of"):
        metrics.deserialize({"class_name": "MeanMetricWrapper", "config": {"fn": "eval", "name": "x"}})
