"""Issue 26: Dataset.map_with_generator hands the map function a generator seeded by (seed, pass,
element index), so random augmentation is the same for any num_parallel_calls, across runs and after
a resume; mr.data.images' random augmentations draw from it."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import mirrored as mr
from mirrored._seeds import derive_seed

pytestmark = pytest.mark.timeout(120)
images = mr.data.images


def _augment(image, label, g):
    if int(label) % 3 == 0:
        time.sleep(0.002)  # some elements finish late, so parallel workers complete out of order
    image = images.random_crop(image, (6, 6), g)
    image = images.random_flip_left_right(image, g)
    image = images.random_flip_up_down(image, g)
    image = images.random_brightness(image, 0.2, g)
    image = images.random_contrast(image, 0.5, 1.5, g)
    return image, label


def _pipeline(parallel, seed=5):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(40, 8, 8, 3, generator=g)
    ds = mr.data.Dataset.from_tensor_slices((x, torch.arange(40)))
    return ds.shuffle(40, seed=1).map_with_generator(_augment, seed=seed, num_parallel_calls=parallel).batch(8)


def _epoch(ds):
    return [(a.clone(), b.clone()) for a, b in ds]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a, b))


def test_the_output_is_the_same_for_any_num_parallel_calls_and_across_builds():
    runs = {p: _pipeline(p) for p in (None, 1, 4, mr.data.AUTOTUNE)}
    epochs = {p: [_epoch(ds), _epoch(ds)] for p, ds in runs.items()}
    for p in (1, 4, mr.data.AUTOTUNE):
        assert _equal(epochs[None][0], epochs[p][0]) and _equal(epochs[None][1], epochs[p][1])
    assert _equal(epochs[None][0], _epoch(_pipeline(4)))  # a new build (a new run) repeats pass 0
    assert not _equal(epochs[None][0], epochs[None][1])  # pass 1 draws anew
    assert not _equal(epochs[None][0], _epoch(_pipeline(None, seed=6)))


def test_element_i_of_pass_k_draws_from_a_generator_seeded_by_seed_k_and_i():
    ds = mr.data.Dataset.range(5).map_with_generator(lambda i, g: torch.rand(2, generator=g), seed=9)
    list(ds)  # pass 0
    got = list(ds)  # pass 1
    for i, value in enumerate(got):
        want = torch.rand(2, generator=torch.Generator().manual_seed(derive_seed(9, 1, i)))
        assert torch.equal(value, want)


def test_a_distributed_iterator_resumed_mid_epoch_in_a_fresh_pipeline_continues_the_augmentation():
    strategy = mr.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    whole = iter(strategy.experimental_distribute_dataset(_pipeline(4)))
    first = [strategy.experimental_local_results(next(whole)) for _ in range(2)]
    state = whole.get_state()
    rest = [strategy.experimental_local_results(b) for b in whole]
    del first
    fresh = iter(strategy.experimental_distribute_dataset(_pipeline(mr.data.AUTOTUNE)))
    fresh.set_state(state)
    resumed = [strategy.experimental_local_results(b) for b in fresh]
    assert len(resumed) == len(rest) == 3
    for want, got in zip(rest, resumed):
        for (wx, wy), (gx, gy) in zip(want, got):
            assert torch.equal(wx, gx) and torch.equal(wy, gy)


def test_dataset_state_between_epochs_holds_the_pass_count():
    ds = _pipeline(4)
    _epoch(ds)
    state = ds.get_state()
    assert state["generators"] == [{"seed": 5, "epoch": 1}]
    want = _epoch(ds)
    fresh = _pipeline(None)
    fresh.set_state(state)
    assert _equal(want, _epoch(fresh))


def test_brightness_and_contrast_match_tfs_formulas():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(2, 4, 5, 3, generator=g)
    delta = float(torch.empty(()).uniform_(-0.3, 0.3, generator=torch.Generator().manual_seed(7)))
    torch.testing.assert_close(images.random_brightness(x, 0.3, torch.Generator().manual_seed(7)), x + delta)
    xn = x.numpy().astype(np.float64)
    mean = xn.mean(axis=(1, 2), keepdims=True)  # per image and channel, as tf.image.adjust_contrast
    torch.testing.assert_close(images.adjust_contrast(x, 1.7), torch.from_numpy((xn - mean) * 1.7 + mean).float())
    u8 = torch.tensor([[[250, 3, 128]]], dtype=torch.uint8)  # TF: to [0, 1], add, back with saturation
    want = np.clip((u8.numpy() / 255.0 + 0.1) * 255.5, 0, 255).astype(np.uint8)
    assert torch.equal(images.adjust_brightness(u8, 0.1), torch.from_numpy(want))
    with pytest.raises(ValueError, match="upper=0.5 must be > lower=1.0"):
        images.random_contrast(x, 1.0, 0.5)
    a = images.stateless_random_flip_left_right(x, seed=(1, 2))
    assert torch.equal(a, images.stateless_random_flip_left_right(x, seed=(1, 2)))
    with pytest.raises(ValueError, match="pair"):
        images.stateless_random_crop(x, (2, 2), seed=(1,))


def test_file_sharded_workers_draw_other_numbers_for_their_kth_elements(tmp_path):
    """Issues 24 x 26: FILE auto-sharding gives each worker every 2nd file, and the worker's copy of
    map_with_generator numbers its own elements from 0; with the seed unchanged worker 1's k-th image
    drew worker 0's k-th image's numbers (the same crop and flip for different images). Each part's
    seed now takes the part in, so the two workers' draws differ, and each part repeats its own."""
    from mirrored.data import auto_shard

    for i in range(4):
        (tmp_path / f"f{i}.txt").write_text(str(i))
    ds = mr.data.Dataset.list_files(str(tmp_path / "*.txt"), shuffle=False).map_with_generator(
        lambda path, g: torch.rand(3, generator=g), seed=0)

    def draws(index: int) -> list[torch.Tensor]:
        return list(auto_shard.shard_files(ds, 2, index))

    zero, one = draws(0), draws(1)
    assert len(zero) == len(one) == 2
    for a, b in zip(zero, one):
        assert not torch.equal(a, b)
    for a, b in zip(zero, draws(0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_parallel_calls", [None, 2])
def test_a_failing_function_is_named_once_with_its_element(num_parallel_calls):
    """Issue 26 cleanup: map and map_with_generator share one loop; an error in the function carries one
    note naming the element, sequential or on worker threads (the parallel path used to add two)."""
    def fail_on_3(x, generator=None):
        if int(x) == 3:
            raise ValueError("three")
        return x

    for ds in (mr.data.Dataset.range(6).map(fail_on_3, num_parallel_calls=num_parallel_calls),
               mr.data.Dataset.range(6).map_with_generator(fail_on_3, seed=1, num_parallel_calls=num_parallel_calls)):
        with pytest.raises(ValueError, match="three") as caught:
            list(ds)
        notes = [n for n in getattr(caught.value, "__notes__", []) if "function, element" in n]
        assert len(notes) == 1 and notes[0].endswith("function, element 3"), notes
