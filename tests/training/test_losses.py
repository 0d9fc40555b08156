"""training/losses.py against plain torch references (F.cross_entropy & co.) and closed forms."""
from __future__ import annotations

import contextlib
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mirrored.training import losses
from mirrored.training.losses import (
    BinaryCrossentropy,
    CategoricalCrossentropy,
    Loss,
    MeanAbsoluteError,
    MeanSquaredError,
    SparseCategoricalCrossentropy,
    compute_average_loss,
    scale_regularization_loss,
    sparse_categorical_crossentropy,
)
from _replicas import strategy_of  # tests/_replicas.py


def close(got, want, rtol=1e-6, atol=1e-6):
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 5, generator=g) * 3
    labels = torch.randint(0, 5, (16,), generator=g)
    weights = torch.rand(16, generator=g)
    return logits, labels, weights


@contextlib.contextmanager
def in_replica(replica_id: int, num_replicas: int):
    """Runs the block as replica `replica_id` of `num_replicas`, through the real context module."""
    context = pytest.importorskip("mirrored.distribute.context")
    strategy = strategy_of(num_replicas)
    with context.push(strategy, context.ReplicaContext(strategy, replica_id)):
        yield


@contextlib.contextmanager
def in_cross_replica():
    context = pytest.importorskip("mirrored.distribute.context")
    with context.push(strategy_of(2), None):
        yield


# --- sparse categorical crossentropy ------------------------------------------------------------

def test_sparse_ce_per_example_matches_torch(batch):
    logits, labels, _ = batch
    close(sparse_categorical_crossentropy(labels, logits), F.cross_entropy(logits, labels, reduction="none"))
    close(SparseCategoricalCrossentropy().per_example(labels, logits),
          F.cross_entropy(logits, labels, reduction="none"))


def test_sparse_ce_reductions_and_sample_weight(batch):
    logits, labels, w = batch
    ref = F.cross_entropy(logits, labels, reduction="none")
    close(SparseCategoricalCrossentropy()(labels, logits), F.cross_entropy(logits, labels))
    close(SparseCategoricalCrossentropy(reduction="sum")(labels, logits), ref.sum())
    close(SparseCategoricalCrossentropy(reduction="none")(labels, logits), ref)
    # Keras: sum_over_batch_size divides the weighted sum by the batch size, not by sum(w).
    close(SparseCategoricalCrossentropy()(labels, logits, sample_weight=w), (ref * w).sum() / 16)
    close(SparseCategoricalCrossentropy()(labels, logits, sample_weight=w[:, None]), (ref * w).sum() / 16)
    close(SparseCategoricalCrossentropy()(labels, logits, sample_weight=2.0), 2 * ref.mean())


def test_sparse_ce_from_probabilities(batch):
    logits, labels, _ = batch
    probs = logits.softmax(-1)
    want = -probs[torch.arange(16), labels].clamp(1e-7, 1 - 1e-7).log()
    close(sparse_categorical_crossentropy(labels, probs, from_logits=False), want)


def test_sparse_ce_accepts_column_labels_and_small_int_dtypes(batch):
    logits, labels, _ = batch
    want = F.cross_entropy(logits, labels, reduction="none")
    close(sparse_categorical_crossentropy(labels[:, None], logits), want)
    close(sparse_categorical_crossentropy(labels.to(torch.uint8), logits), want)
    close(sparse_categorical_crossentropy(labels.to(torch.int32), logits), want)
    close(sparse_categorical_crossentropy(labels.tolist(), logits), want)


def test_sparse_ce_sequence_logits_on_last_axis():
    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(4, 7, 3, generator=g), torch.randint(0, 3, (4, 7), generator=g)
    want = F.cross_entropy(logits.permute(0, 2, 1), labels, reduction="none")  # torch: classes on dim 1
    close(sparse_categorical_crossentropy(labels, logits), want)
    close(sparse_categorical_crossentropy(labels, logits.permute(0, 2, 1), axis=1), want)
    close(SparseCategoricalCrossentropy()(labels, logits), want.mean())


def test_sparse_ce_ignore_class_matches_torch_ignore_index(batch):
    logits, labels, _ = batch
    labels = labels.clone()
    labels[[1, 4, 9]] = -1
    loss = SparseCategoricalCrossentropy(ignore_class=-1)
    close(loss(labels, logits), F.cross_entropy(logits, labels, ignore_index=-1))
    per_example = loss.per_example(labels, logits)
    close(per_example, F.cross_entropy(logits, labels, ignore_index=-1, reduction="none"))
    assert torch.equal(per_example[[1, 4, 9]], torch.zeros(3))
    labels[:] = -1
    assert loss(labels, logits).item() == 0.0  # all ignored: 0, not nan


def test_sparse_ce_gradient_matches_torch(batch):
    logits, labels, _ = batch
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    SparseCategoricalCrossentropy()(labels, a).backward()
    F.cross_entropy(b, labels).backward()
    close(a.grad, b.grad)


def test_label_out_of_range_message():
    logits = torch.zeros(16, 5)
    labels = torch.zeros(16, dtype=torch.long)
    labels[9] = 5
    with pytest.raises(ValueError) as err:
        sparse_categorical_crossentropy(labels, logits)
    assert str(err.value) == (
        "sparse_categorical_crossentropy: label 5 (example 9) is outside [0, 5) for logits of shape (16, 5). "
        "Labels are class ids 0..4: check the dataset's num_classes and the model's num_classes=."
    )


def test_label_out_of_range_names_the_replica():
    logits = torch.zeros(16, 5)
    labels = torch.zeros(16, dtype=torch.long)
    labels[15] = 5
    with in_replica(1, 2), pytest.raises(ValueError) as err:
        SparseCategoricalCrossentropy(reduction="sum")(labels, logits)
    assert str(err.value) == (
        "sparse_categorical_crossentropy: label 5 (example 15 of replica 1's batch) is outside [0, 5) for logits "
        "of shape (16, 5). Labels are class ids 0..4: check the dataset's num_classes and the model's num_classes=."
    )


def test_negative_label_and_first_bad_example_reported():
    labels = torch.tensor([0, 1, -2, 7])
    with pytest.raises(ValueError, match=r"label -2 \(example 2\) is outside \[0, 3\)"):
        sparse_categorical_crossentropy(labels, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"label 3 \(example 1, position \(2,\)\) is outside \[0, 3\)"):
        sparse_categorical_crossentropy(torch.tensor([[0, 0, 0], [0, 0, 3]]), torch.zeros(2, 3, 3))
    # an ignored label may lie outside the range
    sparse_categorical_crossentropy(torch.tensor([0, 255]), torch.zeros(2, 3), ignore_class=255)


def test_float_labels_and_bad_shapes_are_clear_errors():
    with pytest.raises(TypeError, match=r"dtype torch.float32; they must be integer class ids.*labels.long\(\)"):
        sparse_categorical_crossentropy(torch.tensor([0.0, 1.0]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) do not fit logits of shape \(2, 3\): "
                                         r"expected labels of shape \(2,\)"):
        sparse_categorical_crossentropy(torch.tensor([0, 1, 2]), torch.zeros(2, 3))
    with pytest.raises(TypeError, match="y_pred has dtype torch.int64"):
        sparse_categorical_crossentropy(torch.tensor([0, 1]), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="Integer class ids need sparse_categorical_crossentropy"):
        CategoricalCrossentropy()(torch.tensor([0, 1]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"y_true has shape \(4,\) but y_pred has shape \(4, 2\)"):
        MeanSquaredError()(torch.zeros(4), torch.zeros(4, 2))


# --- the probability warning ---------------------------------------------------------------------

def test_probabilities_under_from_logits_warn_once_per_loss_object(batch):
    logits, labels, _ = batch
    probs = logits.softmax(-1)
    loss = SparseCategoricalCrossentropy()
    with pytest.warns(UserWarning, match="looks like probabilities.*from_logits=True") as record:
        loss(labels, probs)
        loss(labels, probs)
        loss.per_example(labels, probs)
    assert len([w for w in record if "probabilities" in str(w.message)]) == 1
    assert record[0].filename == __file__  # stacklevel points at the caller
    with pytest.warns(UserWarning, match="looks like probabilities"):
        SparseCategoricalCrossentropy()(labels, probs)  # a new object warns again


def test_no_warning_for_logits_or_from_logits_false(batch):
    logits, labels, _ = batch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SparseCategoricalCrossentropy()(labels, logits)
        SparseCategoricalCrossentropy(from_logits=False)(labels, logits.softmax(-1))
        CategoricalCrossentropy()(F.one_hot(labels, 5), logits)
        # in [0, 1] but rows do not sum to 1: still logits
        SparseCategoricalCrossentropy()(labels, torch.rand(16, 5, generator=torch.Generator().manual_seed(3)))


def test_categorical_and_binary_warn_on_probabilities(batch):
    logits, labels, _ = batch
    with pytest.warns(UserWarning, match="rows summing to 1"):
        CategoricalCrossentropy()(F.one_hot(labels, 5), logits.softmax(-1))
    with pytest.warns(UserWarning, match=r"all values inside \(0, 1\)\) but from_logits=True"):
        BinaryCrossentropy()(torch.ones(8), torch.sigmoid(torch.randn(8)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BinaryCrossentropy()(torch.ones(8), torch.zeros(8))  # a zero-initialised head's logits
        SparseCategoricalCrossentropy()(labels, torch.zeros(16, 5))


# --- other losses ---------------------------------------------------------------------------------

def test_categorical_ce_matches_torch_with_label_smoothing(batch):
    logits, labels, w = batch
    onehot = F.one_hot(labels, 5)
    close(CategoricalCrossentropy().per_example(onehot, logits), F.cross_entropy(logits, labels, reduction="none"))
    close(CategoricalCrossentropy(label_smoothing=0.1)(onehot, logits),
          F.cross_entropy(logits, labels, label_smoothing=0.1))
    soft = torch.softmax(torch.randn(16, 5), -1)
    close(CategoricalCrossentropy()(soft, logits, sample_weight=w),
          (F.cross_entropy(logits, soft, reduction="none") * w).sum() / 16)
    probs = logits.softmax(-1)
    close(CategoricalCrossentropy(from_logits=False).per_example(onehot, probs),
          -(onehot * probs.clamp(1e-7, 1 - 1e-7).log()).sum(-1))


def test_binary_ce_matches_torch():
    g = torch.Generator().manual_seed(2)
    logits, targets = torch.randn(8, 1, generator=g) * 4, torch.randint(0, 2, (8,), generator=g)
    want = F.binary_cross_entropy_with_logits(logits[:, 0], targets.float(), reduction="none")
    close(BinaryCrossentropy().per_example(targets, logits), want)          # (8,) labels vs (8, 1) logits
    close(BinaryCrossentropy().per_example(targets[:, None], logits), want)
    close(BinaryCrossentropy()(targets, logits[:, 0]), want.mean())
    close(BinaryCrossentropy(from_logits=False)(targets, torch.sigmoid(logits)),
          F.binary_cross_entropy(torch.sigmoid(logits[:, 0]), targets.float()), rtol=1e-5, atol=1e-5)
    smoothed = targets.float() * 0.8 + 0.1
    close(BinaryCrossentropy(label_smoothing=0.2)(targets, logits),
          F.binary_cross_entropy_with_logits(logits[:, 0], smoothed))
    multi_logits, multi_targets = torch.randn(8, 3, generator=g), torch.randint(0, 2, (8, 3), generator=g).float()
    close(BinaryCrossentropy().per_example(multi_targets, multi_logits),  # Keras: mean over the last axis
          F.binary_cross_entropy_with_logits(multi_logits, multi_targets, reduction="none").mean(-1))


def test_mse_and_mae_match_torch():
    g = torch.Generator().manual_seed(4)
    pred, true, w = torch.randn(6, 3, generator=g), torch.randn(6, 3, generator=g), torch.rand(6, generator=g)
    close(MeanSquaredError()(true, pred), F.mse_loss(pred, true))
    close(MeanAbsoluteError()(true, pred), F.l1_loss(pred, true))
    close(MeanSquaredError().per_example(true, pred), ((pred - true) ** 2).mean(-1))
    close(MeanAbsoluteError()(true, pred, sample_weight=w), ((pred - true).abs().mean(-1) * w).sum() / 6)
    close(MeanSquaredError()(true[:, 0], pred[:, :1]), F.mse_loss(pred[:, 0], true[:, 0]))  # (6,) vs (6, 1)


def test_sample_weight_shape_mismatch_is_an_error(batch):
    logits, labels, _ = batch
    with pytest.raises(ValueError, match=r"sample_weight of shape \(3,\) does not fit values of shape \(16,\)"):
        SparseCategoricalCrossentropy()(labels, logits, sample_weight=torch.ones(3))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"reduction='mean'.*sum_over_batch_size"):
        SparseCategoricalCrossentropy(reduction="mean")
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        CategoricalCrossentropy(label_smoothing=1.5)


# --- distributed averaging -----------------------------------------------------------------------

def test_compute_average_loss_divides_by_the_global_batch(batch):
    logits, labels, w = batch
    per_example = F.cross_entropy(logits, labels, reduction="none")
    close(compute_average_loss(per_example, global_batch_size=64), per_example.sum() / 64)
    close(compute_average_loss(per_example, sample_weight=w, global_batch_size=64), (per_example * w).sum() / 64)
    close(compute_average_loss(per_example), per_example.mean())  # no strategy: the local batch
    seq = torch.rand(4, 3)
    close(compute_average_loss(seq, sample_weight=torch.tensor([1.0, 0.0, 2.0, 1.0]), global_batch_size=8),
          (seq.sum(1) * torch.tensor([1.0, 0.0, 2.0, 1.0])).sum() / 8)
    assert compute_average_loss(torch.zeros(0), global_batch_size=4).item() == 0.0


def test_compute_average_loss_gradients_summed_over_replicas_equal_one_device(batch):
    logits, labels, _ = batch
    whole = logits.clone().requires_grad_()
    F.cross_entropy(whole, labels).backward()
    parts = [logits[:10].clone().requires_grad_(), logits[10:].clone().requires_grad_()]  # uneven split
    for part, lab in zip(parts, (labels[:10], labels[10:])):
        compute_average_loss(F.cross_entropy(part, lab, reduction="none"), global_batch_size=16).backward()
    close(torch.cat([p.grad for p in parts]), whole.grad)


def test_compute_average_loss_infers_global_batch_in_replica_context(batch):
    logits, labels, _ = batch
    per_example = F.cross_entropy(logits, labels, reduction="none")
    with in_replica(0, 4):
        close(compute_average_loss(per_example), per_example.sum() / 64)
        close(scale_regularization_loss(torch.tensor(2.0)), torch.tensor(0.5))
        close(scale_regularization_loss([torch.tensor(2.0), torch.tensor([1.0, 1.0])]), torch.tensor(1.0))
        assert compute_average_loss(torch.zeros(0)).item() == 0.0  # this replica's part is empty
    close(scale_regularization_loss(torch.tensor(2.0)), torch.tensor(2.0))


def test_compute_average_loss_in_cross_replica_context_needs_a_batch_size():
    with in_cross_replica():
        with pytest.raises(RuntimeError, match="cross-replica context.*pass global_batch_size="):
            compute_average_loss(torch.ones(4))
        close(compute_average_loss(torch.ones(4), global_batch_size=8), torch.tensor(0.5))
        with pytest.raises(RuntimeError, match="scale_regularization_loss was called in cross-replica context"):
            scale_regularization_loss(torch.tensor(1.0))


@pytest.mark.parametrize("size, error, match", [
    (0, ValueError, "global_batch_size=0 must be positive"),
    (-8, ValueError, "global_batch_size=-8 must be positive"),
    (8.0, TypeError, "global_batch_size must be an int, got 8.0"),
    (True, TypeError, "must be an int"),
    ("8", TypeError, "must be an int"),
])
def test_compute_average_loss_validates_global_batch_size(size, error, match):
    with pytest.raises(error, match=match):
        compute_average_loss(torch.ones(4), global_batch_size=size)


def test_compute_average_loss_rejects_reduced_losses():
    with pytest.raises(ValueError, match="per_example_loss is a scalar.*reduction='none'"):
        compute_average_loss(torch.tensor(1.0), global_batch_size=4)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        compute_average_loss([1.0, 2.0], global_batch_size=4)
    close(compute_average_loss(torch.ones(4), global_batch_size=torch.tensor(8)), torch.tensor(0.5))


# --- registry -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, cls", [
    ("sparse_categorical_crossentropy", SparseCategoricalCrossentropy),
    ("categorical_crossentropy", CategoricalCrossentropy),
    ("binary_crossentropy", BinaryCrossentropy), ("mse", MeanSquaredError), ("mean_squared_error", MeanSquaredError),
    ("mae", MeanAbsoluteError), ("MSE", MeanSquaredError)])
def test_get_by_name(name, cls):
    loss = losses.get(name)
    assert type(loss) is cls
    if hasattr(loss, "from_logits") and cls not in (MeanSquaredError, MeanAbsoluteError):
        assert loss.from_logits is True


def test_get_unknown_name_lists_the_keys():
    with pytest.raises(ValueError, match="unknown loss 'hinges'. Known names: sparse_categorical_crossentropy, "
                                         "categorical_crossentropy, binary_crossentropy, mean_squared_error, "
                                         "mean_absolute_error, mean_absolute_percentage_error"):
        losses.get("hinges")
    with pytest.raises(TypeError, match="cannot make a loss from 3"):
        losses.get(3)


def test_get_passes_loss_objects_through():
    loss = SparseCategoricalCrossentropy(ignore_class=0)
    assert losses.get(loss) is loss


def test_get_wraps_torch_loss_modules(batch):
    logits, labels, w = batch
    module = nn.CrossEntropyLoss()
    loss = losses.get(module)
    assert module.reduction == "mean"  # the caller's module is left alone
    assert loss.name == "cross_entropy_loss"
    close(loss.per_example(labels, logits), F.cross_entropy(logits, labels, reduction="none"))
    close(loss(labels, logits), F.cross_entropy(logits, labels))
    close(loss(labels, logits, sample_weight=w), (F.cross_entropy(logits, labels, reduction="none") * w).sum() / 16)
    with pytest.raises(ValueError, match=r"cross_entropy_loss: label 9 \(example 0\) is outside \[0, 5\)"):
        loss(torch.full((16,), 9), logits)
    pred, true = torch.randn(4, 3), torch.randn(4, 3)
    close(losses.get(nn.MSELoss())(true, pred), F.mse_loss(pred, true))
    assert losses.get(nn.BCEWithLogitsLoss()).name == "bce_with_logits_loss"


def test_get_wraps_functions_and_rejects_modules_without_reduction(batch):
    logits, labels, _ = batch

    def my_loss(y_true, y_pred):
        return F.cross_entropy(y_pred, y_true, reduction="none")

    loss = losses.get(my_loss)
    assert loss.name == "my_loss"
    close(loss(labels, logits), F.cross_entropy(logits, labels))
    with pytest.raises(ValueError, match="returned a scalar.*one loss per example"):
        losses.get(lambda t, p: F.cross_entropy(p, t))(labels, logits)
    with pytest.raises(TypeError, match="without a `reduction` attribute"):
        losses.get(nn.Linear(2, 2))


def test_losses_module_does_not_import_distribute():
    """Loads losses.py and the loss families beside it on their own: empty stand-ins for the `mirrored`
    and `mirrored.training` packages (whose __init__ loads distribute/ and Model) let only them run."""
    folder = str(pathlib.Path(losses.__file__).parent)
    code = ("import sys, types, torch\n"
            "for name, path in (('mirrored', " + repr(str(pathlib.Path(folder).parent)) + "), "
            "('mirrored.training', " + repr(folder) + ")):\n"
            "    package = types.ModuleType(name); package.__path__ = [path]; sys.modules[name] = package\n"
            "import mirrored.training.losses as l\n"
            "l.compute_average_loss(torch.ones(2)); l.scale_regularization_loss(torch.ones(2))\n"
            "l.sparse_categorical_crossentropy(torch.tensor([0]), torch.zeros(1, 2))\n"
            "l.get('mse')(torch.zeros(2), torch.zeros(2)); l.get('huber')(torch.zeros(2), torch.ones(2))\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('mirrored.'))\n"
            "assert loaded == ['mirrored.training', 'mirrored.training._batch_losses', "
            "'mirrored.training._classification_losses', 'mirrored.training._regression_losses', "
            "'mirrored.training.losses'], loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_under_a_real_strategy(batch):
    """compute_average_loss infers the global batch, and a bad label names its replica, inside strategy.run."""
    strategy_mod = pytest.importorskip("mirrored.distribute.strategy")
    values_mod = pytest.importorskip("mirrored.distribute.values")
    logits, labels, _ = batch
    strategy = strategy_mod.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    loss = SparseCategoricalCrossentropy()

    def step(y, x):
        return compute_average_loss(loss.per_example(y, x))

    parts = values_mod.PerReplica([labels[:8], labels[8:]]), values_mod.PerReplica([logits[:8], logits[8:]])
    total = sum(strategy.experimental_local_results(strategy.run(step, args=parts)))
    close(total, F.cross_entropy(logits, labels))
    bad = labels.clone()
    bad[8 + 3] = 7
    parts = values_mod.PerReplica([bad[:8], bad[8:]]), parts[1]
    with pytest.raises(ValueError, match=r"label 7 \(example 3 of replica 1's batch\) is outside \[0, 5\)"):
        strategy.run(step, args=parts)
    del strategy


# --- the custom-loop footgun (issue 13) -----------------------------------------------------------------

def test_a_mean_loss_in_strategy_run_on_several_replicas_warns_once_naming_the_fix(batch):
    """TF 2.21 (Keras 3) gives an N-times update silently here: each replica averages over its own part
    and the optimizer sums the replicas' gradients. The warning comes once per loss object."""
    logits, labels, _ = batch
    logits.requires_grad_()  # a training step's output
    loss = SparseCategoricalCrossentropy()
    with in_replica(0, 2), pytest.warns(UserWarning) as record:
        loss(labels, logits)
        loss(labels, logits)
    assert len(record) == 1
    message = str(record[0].message)
    assert "2 replicas" in message and "2 times too large" in message
    assert 'reduction="none" and mr.losses.compute_average_loss' in message and 'reduction="sum"' in message
    assert record[0].filename == __file__  # points at the caller's line


@pytest.mark.parametrize("case", ["reduction none", "reduction sum", "one replica", "outside run", "per_example"])
def test_no_replica_mean_warning_where_the_sum_is_right(batch, case):
    logits, labels, _ = batch
    logits.requires_grad_()
    reduction = {"reduction none": "none", "reduction sum": "sum"}.get(case, "sum_over_batch_size")
    loss = MeanSquaredError(reduction=reduction) if case != "per_example" else MeanSquaredError()
    target = torch.zeros_like(logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*CPU replicas share")  # 3 replicas on a 2-core box
        if case == "outside run":
            with in_cross_replica():
                loss(target, logits)
            loss(target, logits)
        elif case == "per_example":
            with in_replica(1, 2):
                loss.per_example(target, logits)
        else:
            with in_replica(0, 1 if case == "one replica" else 3):
                loss(target, logits)


@pytest.mark.parametrize("case", ["no_grad", "output without grad", "mean optimizers only"])
def test_no_replica_mean_warning_where_no_summed_update_follows(batch, case):
    """The N-times update needs gradients that a "sum" optimizer adds up: an evaluation step (no
    gradients) or a strategy whose mirrored optimizers all average (gradient_reduction="mean", where
    the per-replica mean is DDP's right input) gives no warning; a "sum" optimizer beside them does."""
    context = pytest.importorskip("mirrored.distribute.context")
    logits, labels, _ = batch
    strategy = strategy_of(2)
    net = strategy.mirror(nn.Linear(2, 2))
    if case == "mean optimizers only":
        strategy.mirror_optimizer(torch.optim.SGD, net, gradient_reduction="mean", lr=0.1)
    loss = SparseCategoricalCrossentropy()
    with warnings.catch_warnings(), context.push(strategy, context.ReplicaContext(strategy, 0)):
        warnings.simplefilter("error")
        if case == "no_grad":
            with torch.no_grad():
                loss(labels, logits.clone().requires_grad_())
        else:
            loss(labels, logits if case == "output without grad" else logits.clone().requires_grad_())
    if case == "mean optimizers only":
        strategy.mirror_optimizer(torch.optim.SGD, net, lr=0.1)  # a "sum" one too: the warning is back
        assert strategy.gradient_reductions == {"mean", "sum"}
        with context.push(strategy, context.ReplicaContext(strategy, 0)), pytest.warns(UserWarning, match="2 times"):
            loss(labels, logits.clone().requires_grad_())


def test_fit_never_triggers_the_replica_mean_warning():
    """fit takes per-example losses and divides by the global batch itself (issue 13)."""
    import mirrored as mr

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=g), torch.randint(0, 3, (12,), generator=g)
    with mr.MirroredStrategy(devices=["cpu:0", "cpu:1"]).scope():
        model = mr.Model(nn.Linear(4, 3))
        model.compile(optimizer="sgd", loss=SparseCategoricalCrossentropy(), metrics=["accuracy"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=6, epochs=1, verbose=0, validation_data=(x, y))
        model.evaluate(x, y, batch_size=6, verbose=0)


# --- configs (issue 13) ---------------------------------------------------------------------------------

@pytest.mark.parametrize("loss", [
    SparseCategoricalCrossentropy(from_logits=False, ignore_class=2, axis=1, reduction="sum", name="sce"),
    CategoricalCrossentropy(label_smoothing=0.1), BinaryCrossentropy(from_logits=False, label_smoothing=0.2),
    MeanSquaredError(reduction="none"), MeanAbsoluteError(name="l1"), losses.get(losses.mean_absolute_error),
], ids=lambda loss: type(loss).__name__)
def test_configs_round_trip_through_json_and_compute_the_same(loss, batch):
    import json

    logits, labels, weights = batch
    config = json.loads(json.dumps(losses.serialize(loss)))
    again = losses.deserialize(config)
    assert type(again) is type(loss) and again.get_config() == loss.get_config()
    assert losses.get(config).get_config() == loss.get_config()
    y_true, y_pred = torch.zeros_like(logits), logits
    if isinstance(loss, SparseCategoricalCrossentropy):
        y_true, y_pred = labels, torch.softmax(logits, dim=1)
    elif isinstance(loss, CategoricalCrossentropy):
        y_true = F.one_hot(labels, 5).float()
    elif isinstance(loss, BinaryCrossentropy):
        y_true, y_pred = F.one_hot(labels, 5).float(), torch.sigmoid(logits)
    close(again(y_true, y_pred, weights), loss(y_true, y_pred, weights), rtol=0, atol=0)


def test_losses_without_a_config_say_so_and_unknown_classes_are_refused():
    assert losses.serialize(losses.get(lambda y_true, y_pred: (y_pred - y_true).abs())) is None
    assert losses.serialize(losses.get(nn.CrossEntropyLoss())) is None

    class Mine(MeanSquaredError):
        pass

    assert losses.serialize(Mine()) is None  # a subclass is not ours: it might compute something else
    with pytest.raises(ValueError, match=r"unknown class 'Mine'.*Only mirrored's own classes"):
        losses.deserialize({"class_name": "Mine", "config": {}})
    with pytest.raises(ValueError, match="fn='print' is not one of"):
        losses.deserialize({"class_name": "LossFunctionWrapper", "config": {"fn": "print"}})


# --- a loss of your own, written as for Keras --------------------------------------------------------

class _MeanAbsoluteHuber(Loss):
    """A Keras-style subclass: only call(), the default name."""

    def call(self, y_true, y_pred):
        return F.huber_loss(y_pred, y_true, reduction="none", delta=0.5).mean(dim=-1)


def test_a_subclass_implements_call_as_in_keras(batch):
    """keras.losses.Loss subclasses implement call(y_true, y_pred) (one loss per example) and get a
    snake_case name; ours do the same, through __call__'s weights and reductions and through fit."""
    import mirrored as mr

    logits, _, weights = batch
    target = torch.zeros_like(logits)
    loss = _MeanAbsoluteHuber()
    assert loss.name == "_mean_absolute_huber" and Loss(name=None).name == "loss"
    per_example = F.huber_loss(logits, target, reduction="none", delta=0.5).mean(dim=-1)
    close(loss(target, logits), per_example.mean())
    close(loss(target, logits, sample_weight=weights), (per_example * weights).sum() / len(weights))
    close(_MeanAbsoluteHuber(reduction="sum")(target, logits), per_example.sum())
    with pytest.raises(NotImplementedError, match="implements call"):
        Loss()(target, logits)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 4, generator=g), torch.randn(12, 3, generator=g)
    weights_after = []
    for devices in (["cpu:0"], ["cpu:0", "cpu:1"]):
        torch.manual_seed(0)
        with mr.MirroredStrategy(devices=devices).scope():
            model = mr.Model(nn.Linear(4, 3))
            model.compile(optimizer="sgd", loss=_MeanAbsoluteHuber())
        model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
        weights_after.append(model.get_weights())
    for one, two in zip(*weights_after):  # 2 replicas give one device's update (float32 sums: 1e-6)
        np.testing.assert_allclose(two, one, rtol=1e-6, atol=1e-6)
