"""Issue 29: fit, evaluate, predict and mirrored modules run 2-D / 3-D convolutions in channels_last
memory by default (compile(memory_format="auto")), with the results of the NCHW path up to float
reassociation; "preserve" keeps today's path bit for bit; checkpoints hold the standard layout.
References are plain PyTorch loops, in NCHW and in channels_last converted by hand."""
from __future__ import annotations

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

import mirrored as mr
from mirrored.distribute import input as input_lib
from _replicas import strategy_of  # tests/_replicas.py

N_EXAMPLES, GLOBAL_BATCH, EPOCHS = 24, 8, 2  # 3 steps an epoch; on 3 replicas 3/3/2 examples each

# The channels_last kernels (oneDNN) add each output's products in another order than the NCHW ones, and
# N replicas sum their parts' gradients in another order than one backward does: float32 reassociation, a
# few ulps per step (measured: <= 8e-8 on weights of size ~0.3 after 6 momentum-SGD steps). A wrong split,
# weighting, permuted layout or missed update is > 1e-3 off.
RTOL, ATOL = 1e-5, 1e-6


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(N_EXAMPLES, 3, 10, 10, generator=g), torch.randint(0, 4, (N_EXAMPLES,), generator=g)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(),
                         nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _plain_torch(net, x, y):
    """One device, the whole global batch, the mean cross-entropy (the sum over the batch's rows)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for _ in range(EPOCHS):
        for i in range(0, N_EXAMPLES, GLOBAL_BATCH):
            xb, yb = x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]
            loss = F.cross_entropy(net(xb), yb, reduction="none").sum() / len(xb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net


def _fit(replicas, **compile_kwargs):
    x, y = _data()
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = mr.Model(_net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", **compile_kwargs)
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0)
    return model


def _conv_weights(module):
    return [m.weight for m in module.modules() if isinstance(m, nn.Conv2d)]


@pytest.mark.filterwarnings("ignore:MirroredStrategy. 3 CPU replicas share")
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_fit_runs_channels_last_by_default_and_matches_the_nchw_path(replicas):
    x, y = _data()
    want = _plain_torch(_net(), x, y)  # the user's NCHW module, as today
    model = _fit(replicas)
    assert model.memory_format == "channels_last"
    for copy_ in model.replicas:  # every replica's copy converted, once, before the optimizer was built
        assert all(w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
                   for w in _conv_weights(copy_) if w.shape[-1] > 1)
    for (name, got), ref in zip(model.module.named_parameters(), want.parameters()):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=name)
    for other in model.replicas[1:]:
        for a, b in zip(model.module.parameters(), other.parameters()):
            assert torch.equal(a, b) and a.stride() == b.stride()
    model.check_in_sync()


def test_one_replica_channels_last_is_bitwise_the_module_converted_by_hand():
    x, y = _data()
    want = _plain_torch(_net().to(memory_format=torch.channels_last), x, y)
    for got, ref in zip(_fit(1).module.parameters(), want.parameters()):
        assert torch.equal(got, ref)


def test_preserve_keeps_todays_path_bit_for_bit():
    """Regression test for issue 29: the opt-out changes nothing, layout or bits."""
    x, y = _data()
    want = _plain_torch(_net(), x, y)
    model = _fit(1, memory_format="preserve")
    assert model.memory_format == "as given"
    for got, ref in zip(model.module.parameters(), want.parameters()):
        assert torch.equal(got, ref) and got.stride() == ref.stride()
    two = _fit(2, memory_format="preserve")
    for got, ref in zip(two.module.parameters(), _net().parameters()):
        assert got.stride() == ref.stride()


def test_a_checkpoint_from_channels_last_loads_into_a_plain_nchw_module(tmp_path):
    model = _fit(2)
    x, _ = _data()
    model.save(tmp_path / "model.safetensors")
    model.save_weights(tmp_path / "weights.safetensors")
    for name in ("model.safetensors", "weights.safetensors"):
        tensors = safetensors.torch.load_file(str(tmp_path / name))  # (read by safetensors alone)
        state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        assert all(t.is_contiguous() for t in state.values())
        plain = _net()
        plain.load_state_dict(state)
        assert all(w.is_contiguous() for w in _conv_weights(plain))
        with torch.no_grad():
            want = plain(x).numpy()
        np.testing.assert_allclose(model.predict(x, batch_size=GLOBAL_BATCH, verbose=0), want, rtol=1e-5, atol=1e-6)


def test_compile_switches_the_format_and_back_to_the_modules_own():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(_net())
    assert model.memory_format == "channels_last"  # predict and evaluate before compile() run it too
    strides = [w.stride() for w in _conv_weights(_net())]
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", memory_format="preserve")
    for copy_ in model.replicas:
        assert [w.stride() for w in _conv_weights(copy_)] == strides
    with pytest.raises(ValueError, match=r"memory_format='nhwc'.*\"preserve\""):
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", memory_format="nhwc")


def test_auto_leaves_float64_and_conv_free_modules_as_given_and_names_3d():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        assert mr.Model(_net().double()).memory_format == "as given"  # no fast float64 channels-last kernels
        assert mr.Model(nn.Linear(3, 2)).memory_format == "as given"
        video = mr.Model(nn.Sequential(nn.Conv3d(2, 4, 3), nn.AdaptiveAvgPool3d(1), nn.Flatten()))
    assert video.memory_format == "channels_last_3d"
    assert video.module[0].weight.is_contiguous(memory_format=torch.channels_last_3d)


def test_custom_loop_mirror_runs_channels_last_and_matches_plain_torch():
    x, y = _data()
    want = _net()
    opt = torch.optim.SGD(want.parameters(), lr=0.1)
    F.cross_entropy(want(x[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]).backward()
    opt.step()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(_net())
        mopt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1)
    assert mnet.memory_format == "channels_last"

    def step(xb, yb):
        loss = F.cross_entropy(mnet(xb), yb, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=GLOBAL_BATCH).backward()
        mopt.step()

    for xb, yb in strategy.experimental_distribute_dataset(
            mr.data.Dataset.from_tensor_slices((x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])).batch(GLOBAL_BATCH)):
        strategy.run(step, args=(xb, yb))
    for got, ref in zip(mnet.parameters(), want.parameters()):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)
    strategy.check_in_sync(mnet)


def test_check_in_sync_still_names_a_copy_that_differs():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(_net())
    with torch.no_grad():
        mnet.values[1][0].weight[0, 0, 0, 0] += 1
    with pytest.raises(mr.distribute.OutOfSyncError, match=r"0\.weight"):
        strategy.check_in_sync(mnet)


def test_a_view_after_a_convolution_gets_the_fix_in_its_error():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4 * 8 * 8, 2)

        def forward(self, x):
            return self.fc(self.conv(x).view(len(x), -1))

    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(Flat())
    x = torch.randn(4, 3, 10, 10)
    with pytest.raises(RuntimeError, match=r"\.reshape\(\).*memory_format=\"preserve\""):
        model.predict(x, batch_size=4, verbose=0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", memory_format="preserve")
    assert model.predict(x, batch_size=4, verbose=0).shape == (4, 2)


def test_a_batch_copied_to_a_device_is_written_channels_last_in_that_one_copy():
    """The split's copy to a replica's device (a GPU; the meta device here) writes the layout the
    convolutions read; a batch that stays where it is is not copied at all."""
    batch = torch.randn(2, 3, 4, 5)
    moved = input_lib._to_device(batch, torch.device("meta"), channels_last=True)
    assert moved.is_contiguous(memory_format=torch.channels_last) and not moved.is_contiguous()
    video = input_lib._to_device(torch.randn(2, 3, 4, 5, 6), torch.device("meta"), channels_last=True)
    assert video.is_contiguous(memory_format=torch.channels_last_3d)
    assert input_lib._to_device(batch, torch.device("meta")).is_contiguous()
    assert input_lib._to_device(batch, torch.device("cpu"), channels_last=True) is batch
    with pytest.raises(ValueError, match="InputOptions.memory_format='nhwc'"):
        strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        iter(strategy.experimental_distribute_dataset([batch], mr.InputOptions(memory_format="nhwc")))


def test_the_profiler_says_which_format_ran(capsys):
    x, y = _data()
    for memory_format, ran in (("auto", "channels_last"), ("preserve", "as given")):
        strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
        with strategy.scope():
            model = mr.Model(_net())
            model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", memory_format=memory_format)
        profiler = mr.profiler.Profiler()
        model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, callbacks=[profiler])
        assert profiler.summary()["memory_format"] == ran
        profiler.print_summary()
        assert f"convolutions in {ran} memory" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:MirroredStrategy. 3 CPU replicas share")
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_evaluate_and_predict_run_channels_last_and_match_the_plain_nchw_module(replicas):
    """Issue 29: the inference paths convert too, and give the user's NCHW module's outputs."""
    x, y = _data()
    plain = _net()  # the same initial weights, NCHW, never converted
    with torch.no_grad():
        logits = plain(x)
    want_loss = F.cross_entropy(logits, y).item()  # 3 equal batches: the mean of their means
    want_accuracy = (logits.argmax(1) == y).double().mean().item()
    strategy = strategy_of(replicas)
    with strategy.scope():
        model = mr.Model(_net())  # (logits: mirrored's loss strings read logits)
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    assert model.memory_format == "channels_last"
    loss, accuracy = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert accuracy == pytest.approx(want_accuracy)
    np.testing.assert_allclose(model.predict(x, batch_size=GLOBAL_BATCH, verbose=0), logits.numpy(), rtol=RTOL,
                               atol=ATOL)


def test_conv3d_fit_runs_channels_last_3d_and_matches_the_plain_ncdhw_loop():
    """Issue 29: 3-D convolutions get channels_last_3d, with the NCDHW loop's weights up to reassociation."""
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(N_EXAMPLES, 2, 4, 5, 5, generator=g), torch.randint(0, 3, (N_EXAMPLES,), generator=g)

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 2), nn.ReLU(),
                             nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 3))

    want = _plain_torch(net(), x, y)
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mr.Model(net())
        model.compile(optimizer=mr.optimizers.SGD(learning_rate=0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy")
    model.fit(mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH), epochs=EPOCHS, verbose=0)
    assert model.memory_format == "channels_last_3d"
    for copy_ in model.replicas:
        assert all(m.weight.is_contiguous(memory_format=torch.channels_last_3d) and not m.weight.is_contiguous()
                   for m in copy_.modules() if isinstance(m, nn.Conv3d))
    for (name, got), ref in zip(model.module.named_parameters(), want.parameters()):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL, msg=name)
    model.check_in_sync()


def test_a_custom_loop_checkpoint_is_contiguous_and_a_restore_keeps_channels_last(tmp_path):
    """Issue 29: tf.train.Checkpoint-style files of a mirrored module (weights and momentum buffers)
    hold the standard layout and load into a plain NCHW module; reading one back into a channels_last
    module copies values in place, so its convolutions stay channels_last."""
    x, y = _data()
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        mnet = strategy.mirror(_net())
        mopt = strategy.mirror_optimizer(torch.optim.SGD, mnet, lr=0.1, momentum=0.9)

    def step(xb, yb):
        loss = F.cross_entropy(mnet(xb), yb, reduction="none")
        mr.losses.compute_average_loss(loss, global_batch_size=GLOBAL_BATCH).backward()
        mopt.step()

    for xb, yb in strategy.experimental_distribute_dataset(
            mr.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)):
        strategy.run(step, args=(xb, yb))
    path = mr.train.Checkpoint(model=mnet, optimizer=mopt).write(str(tmp_path / "ckpt"))
    tensors = safetensors.torch.load_file(path)  # (read by safetensors alone)
    assert tensors and all(t.is_contiguous() for t in tensors.values())
    plain = _net()
    plain.load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    with torch.no_grad():
        for got, ref in zip(plain.parameters(), mnet.values[0].parameters()):
            assert torch.equal(got, ref)
    with strategy.scope():
        other = strategy.mirror(_net())  # (the initial weights: the read must bring the trained ones)
    mr.train.Checkpoint(model=other).read(path)
    for copy_ in other.values:
        assert all(w.is_contiguous(memory_format=torch.channels_last) for w in _conv_weights(copy_) if w.shape[-1] > 1)
        for got, ref in zip(copy_.parameters(), plain.parameters()):
            assert torch.equal(got, ref)
