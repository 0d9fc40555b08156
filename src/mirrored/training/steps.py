"""The steps of `mr.Model`, as in Keras 3: train_step, test_step and predict_step run on every replica,
inside strategy.run, each on its part of a global batch; compute_loss and compute_metrics are theirs.

The default train_step is plain code: forward, compute_loss, backward, optimizer.step(). compute_loss
gives this replica's loss of its part, as Keras computes one device's, and backpropagates its share of
the global batch's loss (its examples, or the labels ignore_class kept, over the global batch's), so N
replicas give one device's update on the global batch, an uneven last batch included (Keras on TF
averages per-replica means there; we do not, on purpose). Metrics keep sync-on-read state: each replica
accumulates, a read sums across replicas.
"""
from __future__ import annotations


import contextlib
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import mirrored.distribute as md
from mirrored.training import compile_utils, data_adapter
from mirrored.training.data_adapter import unpack_x_y_sample_weight


class _Steps:
    """train_step, test_step, predict_step and what they call; mixed into Model (model.py)."""

    def _autocast(self, net: Any) -> Any:
        if self._precision is None:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self._precision == "bf16" else torch.float16
        return torch.autocast(device_type=data_adapter.device_of(net).type, dtype=dtype)

    def _forward(self, net: Any, x: Any, *args: Any, training: bool = False, **kwargs: Any) -> Any:
        """The module on what the data yields, in fit, evaluate, predict and model(x) alike: only
        floating-point inputs change, to the module's dtype. A Keras model also gets `training`, as
        Keras's trainer passes it (True in fit's train steps only)."""
        dtype = data_adapter.module_dtype(net)
        with self._autocast(net):
            try:
                out = self._adapter.call(net, data_adapter.cast_inputs(x, dtype), training, *args, **kwargs)
            except RuntimeError as e:
                if "view size is not compatible" not in str(e) or self.memory_format == "as given":
                    raise
                raise RuntimeError(
                    f"{e}\nThe module's convolutions run in {self.memory_format} memory (compile(memory_format="
                    "\"auto\")), and a .view() after one needs row-major memory: use .reshape() or "
                    "torch.flatten() there, or compile(..., memory_format=\"preserve\").") from e
        return out.float() if isinstance(out, Tensor) and out.dtype in (torch.bfloat16, torch.float16) else out

    # ---- the steps: run on every replica (inside strategy.run) -------------------------------------
    def train_step(self, data: Any) -> Any:
        """One training step on this replica's part of a global batch, as Keras 3's: the forward pass,
        compute_loss, backward, and the optimizer's step, which all-reduces the gradients with every
        other replica's and applies the same update. fit runs it on every replica; override it to
        change what a step does (the optimizer's step() must be called on every replica, as any
        collective). Returns the logs: compute_metrics's, or a dict of values (replica 0's are
        reported, as tf.keras reports the first replica's)."""
        if self._own_steps is not None:  # a Keras model's own train_step, on this replica's copy
            return self._own_steps.step("train", data)
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        if not data_adapter.rows(x) and not self._sync_bn:
            # An empty part (a short last batch): nothing to learn from, but every replica's update meets.
            self._empty_part(x, y, training=True)
            self.optimizer.step()
            self.optimizer.zero_grad()
            return self.get_metrics_result()
        y_pred = self(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
        self._track_loss(loss, x)
        logs = self.compute_metrics(x, y, y_pred, sample_weight)
        self.optimizer.scale_loss(loss).backward()
        self.optimizer.step()
        # (cleared after the update rather than before the forward, as Keras's does: nothing holds the
        # gradients between steps, and fit clears any a loop of your own left before its first step)
        self.optimizer.zero_grad()
        return logs

    def test_step(self, data: Any) -> Any:
        """One evaluation step on this replica's part: the forward pass in inference mode, the loss and
        the metrics (Keras 3's test_step). evaluate and fit's validation run it on every replica."""
        if self._own_steps is not None:
            return self._own_steps.step("test", data)
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        if not data_adapter.rows(x):
            self._empty_part(x, y, training=False)
            return self.get_metrics_result()
        y_pred = self(x, training=False)
        if (self._outputs is not None and self._outputs.loss is not None) \
                or self._adapter.module_loss(y_pred) is not None:
            self._track_loss(self.compute_loss(x, y, y_pred, sample_weight, training=False), x)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    def predict_step(self, data: Any) -> Any:
        """The outputs on this replica's part (Keras 3's predict_step; a Hugging Face output's logits);
        predict concatenates every replica's in the order of the input rows."""
        if self._own_steps is not None:
            return self._own_steps.step("predict", data)
        x, _, _ = unpack_x_y_sample_weight(data)
        return self._adapter.prediction(self(x, training=False))

    def compute_loss(self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None,
                     training: bool = True) -> Tensor:
        """This replica's loss on its part of the batch, as Keras computes one device's: the compiled loss
        reduced over the part (sample_weight as Keras weighs it), plus the module's regularization; for
        several outputs, each output's loss reduced so, weighted by loss_weights and summed (and each
        output's unweighted loss tracked, as Keras's `<output>_loss`). With training=True it also tells
        the model's optimizer how the part's gradients weigh in the average over the replicas - by the
        loss values it averaged: its examples, or the labels kept with ignore_class - so the update is
        one device's on the global batch."""
        compiled = self._outputs
        if compiled is None or compiled.loss is None:
            own = self._adapter.module_loss(y_pred)
            if own is None:
                raise ValueError("Model.compute_loss: no loss to compute. Provide a `loss` argument in `compile()`, "
                                 "return one from the module (an output mapping with a \"loss\", as a Hugging Face "
                                 "model given labels), or compute the loss yourself in an overridden train_step.")
            # The module's own loss, a mean over its part: its share of the global batch's by its rows.
            ctx = md.get_replica_context()
            rid = 0 if ctx is None else ctx.local_replica_id
            rows = data_adapter.rows(x)
            self._loss_records[rid] = (own.detach().double() * rows, rows)
            return self._as_share(own, rows, rid, training)
        if y is None:
            y = self._adapter.labels(x)
        if y is None:
            raise ValueError(f"Model.compute_loss: the batch has no labels for the loss {_describe(compiled.loss)}: "
                             "the data yields inputs only. Give (x, y) batches (or y= with arrays), labels inside a "
                             "dict of inputs under \"labels\", or compile without a loss for a module that computes "
                             "its own.")
        y_pred = self._built_for(y, y_pred)
        if not compiled.single:
            return self._outputs_loss(x, y, y_pred, sample_weight, training)
        out = compiled.losses[0]
        dtype = data_adapter.module_dtype(self._net)
        # Labels and weights as Keras's data adapters make them: float ones in the module's dtype (floatx).
        y = data_adapter.cast_inputs(data_adapter.as_labels(y), dtype)
        per_example = out.loss.per_example(y, y_pred)
        sw = data_adapter.weights_like(data_adapter.cast_inputs(sample_weight, dtype), per_example)
        if sw is not None:
            per_example = per_example * sw
        if out.weight is not None:
            per_example = per_example * out.weight
        penalty = self._adapter.regularization(self._net)
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else ctx.local_replica_id
        rows = per_example.shape[0] if per_example.dim() else 1
        ignore = getattr(out.loss, "ignore_class", None)
        total = per_example.sum()
        rows_all = self._global_rows.get(rid)
        # Where the replicas' losses are shares of one device's (their gradients summed, not weighed by rows)
        shares = out.loss.reduction == "sum" or ignore is not None or bool(rows_all)
        if out.loss.reduction == "sum" or ignore is not None:
            # Keras reports each step's loss weighted by its batch size, and these losses are no mean over
            # examples: the reported one needs the global batch's rows (and labels kept) - one meeting,
            # which an empty part joins too (_empty_part).
            kept = out.loss.kept(y) if ignore is not None else None
            kept_all, rows_all = self._global_counts(ctx, kept, rows)
            if out.loss.reduction == "sum":
                # The replicas' sums add up to one device's, so they are summed, not averaged; the penalty is
                # shared by rows.
                loss = total + penalty * (rows / rows_all).to(total.dtype)
                record = (loss.detach().double() * rows_all, rows)
            else:  # a mean over the labels kept: the share of one device's mean over all the labels kept
                local = total / kept.clamp(min=1) + penalty
                share = total / kept_all.clamp(min=1).to(total.dtype) + penalty * (rows / rows_all).to(total.dtype)
                loss = share + (local - share).detach()
                record = (share.detach().double() * rows_all, rows)
        else:
            # A mean over every loss value of the part: rows times the values per row (a sequence's steps).
            loss = _plus(total / max(per_example.numel(), 1), penalty)
            record = (loss.detach().double() * rows, rows)
            if rows_all:
                # Its gradient is the replica's share of one device's loss on the global batch - its sums over
                # the global count, and its rows' part of the penalty - so the replicas' gradients add up to
                # one device's, through the statistics a SyncBatchNorm shares too; the value is its own
                # part's. (Where the global batch is unknown, the optimizer weighs the part by its rows.)
                values = per_example.numel() // rows if rows else 1
                share = _plus(total / (rows_all * values), penalty * (rows / rows_all))
                loss = share + (loss - share).detach()
        self._loss_records[rid] = record
        if shares and training and self._mopt is not None:
            self._mopt.set_gradient_weight(1, divide=False)
        return loss

    def _outputs_loss(self, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool) -> Tensor:
        """compute_loss for several outputs: sum of loss_weight * the output's loss, each reduced as Keras
        reduces it on one device, plus the regularization. Where every loss is a mean over its values (the
        default) the replicas' gradients weigh by rows, as one loss's do. Otherwise (a sum, ignore_class) the
        outputs' means divide by different counts, which no one weight per replica can give: each replica
        then takes its share of one device's loss (its sums over the global counts, one meeting), whose
        gradients add up to one device's, and the returned value is still its own part's loss."""
        compiled = self._outputs
        dtype = data_adapter.module_dtype(self._net)
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else ctx.local_replica_id
        rows = data_adapter.rows(x) if x is not None else data_adapter.rows(y_pred)
        terms = []
        for out in compiled.losses:
            y_t = data_adapter.cast_inputs(data_adapter.as_labels(compiled.part_of(y, out.path, "a loss")), dtype)
            per_example = out.loss.per_example(y_t, compile_utils.select(y_pred, out.path))
            sw = data_adapter.cast_inputs(compile_utils.sample_weight_of(sample_weight, out.path, compiled), dtype)
            sw = data_adapter.weights_like(sw, per_example)
            if sw is not None:
                per_example = per_example * sw
            terms.append((out, y_t, per_example))
        penalty = self._adapter.regularization(self._net)

        def weighed(out: compile_utils.OutputLoss, value: Tensor) -> Tensor:
            return value if out.weight is None else value * out.weight

        if not compile_utils.shares_needed(compiled):
            values = [pe.sum() / max(pe.numel(), 1) for _, _, pe in terms]
            loss = sum(weighed(out, v) for (out, _, _), v in zip(terms, values)) + penalty
            self._loss_records[rid] = (loss.detach().double() * rows, rows)
            for (out, _, _), v in zip(terms, values):
                self._track_output_loss(out, v.detach().double() * rows, rows)
            return self._as_share(loss, rows, rid, training)
        local = [out.loss.kept(y_t) if getattr(out.loss, "ignore_class", None) is not None else pe.numel()
                 for out, y_t, pe in terms]
        counts, rows_all = self._global_sums(ctx, local, rows)
        shares, values = [], []
        for (out, _, pe), c, c_all in zip(terms, local, counts):
            total = pe.sum()
            if out.loss.reduction == "sum":
                shares.append(total)
                values.append(total)
            else:
                shares.append(total / c_all.clamp(min=1).to(total.device, total.dtype))
                values.append(total / torch.as_tensor(c, device=total.device).clamp(min=1).to(total.dtype))
        share = sum(weighed(out, v) for (out, _, _), v in zip(terms, shares)) \
            + penalty * (rows / rows_all).to(shares[0].dtype)
        value = sum(weighed(out, v) for (out, _, _), v in zip(terms, values)) + penalty
        if training and self._mopt is not None:
            self._mopt.set_gradient_weight(1, divide=False)  # (the shares' gradients add up to one device's)
        self._loss_records[rid] = (share.detach().double() * rows_all, rows)
        for (out, _, _), v in zip(terms, shares):
            self._track_output_loss(out, v.detach().double() * rows_all, rows)
        return share + (value - share).detach()

    @staticmethod
    def _track_output_loss(out: compile_utils.OutputLoss, total: Tensor, rows: int) -> None:
        """An output's loss tracker (several outputs): its unweighted loss, weighted by the batch's rows."""
        if out.tracker is not None:
            out.tracker.total.assign_add(total)
            out.tracker.count.assign_add(rows)

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Mapping[str, Any]:
        """Updates the compiled metrics with this replica's part (each output's with its labels; only the
        weighted_metrics with the sample weights, as Keras 3) and returns the logs (get_metrics_result)."""
        compiled = self._outputs
        if y_pred is not None and compiled is not None:
            if y is None:
                y = self._adapter.labels(x)
            y_pred = self._built_for(y, y_pred)
            for output in compiled.metric_sets:
                if not output.metrics:
                    continue
                y_p = compile_utils.select(y_pred, output.path).detach()
                y_t = data_adapter.cast_inputs(data_adapter.as_labels(compiled.part_of(y, output.path, "metrics")),
                                               y_p.dtype if y_p.is_floating_point() else None)
                sw = compile_utils.sample_weight_of(sample_weight, output.path, compiled) if output.weighted else None
                while isinstance(sw, Tensor) and sw.dim() > 1 and sw.shape[-1] == 1:
                    sw = sw.squeeze(-1)
                for m in output.metrics:
                    m.update_state(y_t, y_p, sw)
        return self.get_metrics_result()

    def get_metrics_result(self) -> Mapping[str, Any]:
        """Every metric's result by name (Keras's), each read across the replicas when it is asked for:
        fit reads them after the step, in cross-replica context."""
        return self._logs_view if self._logs_view is not None else {}

    def zero_grad(self) -> None:
        """Clears the gradients of the replica's copy (every copy's outside strategy.run), as Keras's
        train_step does first."""
        self._net.zero_grad(set_to_none=True)

    def _built_for(self, y: Any, y_pred: Any) -> Any:
        """The outputs as the compiled losses and metrics read them, once those are built against them: a
        module's first step with several outputs (or metrics whose state the data sizes) builds them, in
        one merge_call that every replica joins, an empty part's too (_empty_part)."""
        compiled = self._outputs
        view = self._adapter.prediction(y_pred) if compiled.single and not compile_utils.is_nested(y) else y_pred
        if compiled.needs_build(y):
            self._build_compiled(y, view)
        return view

    def _build_compiled(self, y: Any, y_pred: Any) -> None:
        compiled = self._outputs
        seen = _Seen(y, y_pred)
        ctx = md.get_replica_context()

        def build(strategy: Any, seen: Any) -> None:
            parts = strategy.experimental_local_results(seen) if isinstance(seen, md.PerReplica) else (seen,)
            first = next((p for p in parts if p.y_pred is not None), None)
            if first is not None and compiled.needs_build(first.y):
                compiled.build(first.y, first.y_pred)

        if ctx is None or ctx.strategy is not self.distribute_strategy:
            with self.distribute_strategy.scope():
                build(self.distribute_strategy, seen)
        else:
            ctx.merge_call(build, args=(seen,))

    def _as_share(self, loss: Tensor, rows: int, rid: int, training: bool) -> Tensor:
        """`loss`, a mean over this replica's part, with the gradient of its share of the global batch's
        loss (its rows' part) where the global batch is known: the replicas' gradients then add up to one
        device's, through what they share in the step (a SyncBatchNorm's statistics) too. Elsewhere the
        optimizer weighs the part by its examples."""
        rows_all = self._global_rows.get(rid)
        if not rows_all:
            return loss
        if training and self._mopt is not None:
            self._mopt.set_gradient_weight(1, divide=False)
        share = loss * (rows / rows_all)
        return share + (loss - share).detach()

    def _empty_part(self, x: Any, y: Any, training: bool) -> None:
        """An empty part of a short last batch: it joins the first step's build of the compiled losses and
        metrics, the count of the global batch that a loss with reduction="sum" or ignore_class makes, and
        in training weighs nothing in the replicas' average."""
        compiled = self._outputs
        ctx = md.get_replica_context()
        # (as the replicas with examples weigh theirs: shares summed where the global batch is known)
        sums = bool(self._global_rows.get(0 if ctx is None else ctx.local_replica_id))
        if compiled is not None:
            labels = y if y is not None else self._adapter.labels(x)
            if compiled.needs_build(labels):
                self._build_compiled(labels, None)
            loss = compiled.single_loss
            if compiled.single and loss is not None and (
                    loss.reduction == "sum" or getattr(loss, "ignore_class", None) is not None):
                self._global_counts(ctx, torch.zeros((), dtype=torch.int64), 0)
                sums = True
            elif not compiled.single and compile_utils.shares_needed(compiled):
                self._global_sums(ctx, [torch.zeros((), dtype=torch.int64) for _ in compiled.losses], 0)
                sums = True
        if training and self._mopt is not None:
            self._mopt.set_gradient_weight(0, divide=not sums)

    @staticmethod
    def _global_counts(ctx: Any, kept: Tensor | None, rows: int) -> tuple[Tensor, Tensor]:
        """The labels kept and the rows of the global batch, as float64 tensors (one meeting of every
        replica; nothing is read on the host)."""
        (kept_all,), rows_all = _Steps._global_sums(ctx, [kept if kept is not None else rows], rows)
        return kept_all, rows_all

    @staticmethod
    def _global_sums(ctx: Any, counts: Sequence[Tensor | int], rows: int) -> tuple[list[Tensor], Tensor]:
        """`counts` (numbers or one-element tensors) and the rows, summed over the replicas, as float64
        tensors: one meeting of every replica; nothing is read on the host."""
        device = next((c.device for c in counts if isinstance(c, Tensor)), None)
        local = torch.zeros(len(counts) + 1, dtype=torch.float64, device=device)
        for i, c in enumerate(counts):
            local[i] = c
        local[-1] = float(rows)
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            local = ctx.all_reduce(md.ReduceOp.SUM, local)
        return list(local[:-1]), local[-1]

    def _track_loss(self, loss: Tensor, x: Any) -> None:
        """The reported loss is Keras's: each step's loss (regularization included) weighted by its batch
        size. This replica adds what compute_loss worked out as its part of that (so the sum over the
        replicas is one device's), or, for a compute_loss of your own, its loss weighted by its rows."""
        ctx = md.get_replica_context()
        record = self._loss_records.pop(0 if ctx is None else ctx.local_replica_id, None)
        if record is None:
            rows = data_adapter.rows(x)
            record = (loss.detach().double() * rows, rows)
        self._loss_tracker.total.assign_add(record[0])  # (no device sync: the values stay tensors)
        self._loss_tracker.count.assign_add(record[1])

    # ---- fit / evaluate / predict: the loops, on the caller's thread ----------------------------------


class _Seen:
    """What one replica saw at the first step (the labels, and the outputs: None for an empty part), handed
    to the merge_call that builds the compiled losses and metrics, as one value per replica."""

    def __init__(self, y: Any, y_pred: Any):
        self.y, self.y_pred = y, y_pred


def _describe(given: Any) -> str:
    """A compile() argument in an error: a name as it is, else its type."""
    return repr(given) if isinstance(given, str) else type(given).__name__


class _Logs(Mapping):
    """What the default steps return (get_metrics_result): every metric's result by name, computed when
    a value is asked for - after the step, in cross-replica context, where a read sums the replicas'
    state - so that a step reads nothing it does not need to."""

    def __init__(self, model: _Steps):
        self._model = model

    def _by_name(self) -> dict[str, Any]:
        return dict(self._model._log_entries())

    def __getitem__(self, name: str) -> Tensor:
        return self._by_name()[name].result()

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name())

    def __len__(self) -> int:
        return len(self._by_name())

    def __repr__(self) -> str:
        return f"<logs of {', '.join(self._by_name())}>"


def _plus(loss: Tensor, penalty: Tensor | float) -> Tensor:
    """loss + penalty, without the torch call (and its backward node) of adding the number 0 - the
    regularization of a module without any, every step."""
    return loss if isinstance(penalty, (int, float)) and penalty == 0 else loss + penalty


class _OptimizerSteps:
    """What a compiled (or Model.build_optimizer) optimizer recipe does when a step calls it: the mirrored
    optimizer's step, zero_grad and Keras's scale_loss / apply on the calling replica, with that
    replica's fp16 loss scale (a GradScaler) where the model has one."""

    def __init__(self, mirrored: Any, model: _Steps):
        self.mirrored = mirrored
        self._model = weakref.ref(model)  # (the model holds the recipe, which holds this)
        self._scaled: dict[int, bool] = {}  # per replica: whether it scaled a loss since its last update

    def _scaler(self) -> tuple[int, Any]:
        model = self._model()
        scalers = model._scalers if model is not None else []
        if not scalers:
            return 0, None
        ctx = md.get_replica_context()
        rid = 0 if ctx is None else ctx.local_replica_id
        return rid, scalers[rid]

    def scale_loss(self, loss: Tensor, factor: float | None) -> Tensor:
        rid, scaler = self._scaler()
        if factor is not None:
            loss = loss * factor  # Keras's loss_scale_factor, which a Keras optimizer's apply() undoes
        if scaler is None:
            return loss
        self._scaled[rid] = True
        return scaler.scale(loss)

    def step(self) -> None:
        rid, scaler = self._scaler()
        if scaler is None:
            self.mirrored.step()
            return
        if not self._scaled.get(rid):  # (an empty part: its scaler must hold the scale that step() unscales by)
            scaler.scale(torch.zeros((), device=self.mirrored.optimizer.param_groups[0]["params"][0].device))
        self._scaled[rid] = False
        self.mirrored.step(grad_scaler=scaler)  # (reduced first, then unscaled: every replica skips alike)
        scaler.update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.mirrored.zero_grad(set_to_none=set_to_none)

    def apply(self, grads: Sequence[Tensor | None], variables: Sequence[Any] | None) -> None:
        """Keras's apply: sets the given gradients on `variables` (the optimizer's parameters where None),
        then steps."""
        params = ([p for g in self.mirrored.param_groups for p in g["params"]] if variables is None
                  else [getattr(v, "value", v) for v in variables])
        if len(params) != len(grads):
            raise ValueError(f"optimizer.apply: {len(grads)} gradients for {len(params)} variables; give one "
                             "gradient (or None) per variable, in the same order.")
        for p, g in zip(params, grads):
            if g is not p.grad:
                p.grad = g
        self.step()
