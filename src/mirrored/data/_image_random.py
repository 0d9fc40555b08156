"""Random image augmentation on a given generator: brightness and contrast (tf.image's adjust_* and
random_*), and tf.image.stateless_random_*, which take a seed pair instead of a generator.

The generator is what Dataset.map_with_generator hands its function, so augmented pipelines are
the same for any num_parallel_calls and after a resume. Re-exported by images.py; uses it and torch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from mirrored._seeds import derive_seed
from mirrored.data import images


def adjust_brightness(image: torch.Tensor, delta: float) -> torch.Tensor:
    """tf.image.adjust_brightness: adds `delta` to a float image; an integer image is converted to
    [0, 1] floats, shifted, and converted back (saturating), as TF does."""
    image = images._as_image(image, "adjust_brightness")
    if image.dtype.is_floating_point:
        return image + delta
    return images.convert_image_dtype(images.convert_image_dtype(image) + delta, image.dtype)


def adjust_contrast(image: torch.Tensor, contrast_factor: float) -> torch.Tensor:
    """tf.image.adjust_contrast: (x - mean) * factor + mean, the mean per image and channel over
    height and width; integer images go through [0, 1] floats as in adjust_brightness."""
    image = images._as_image(image, "adjust_contrast")
    work = image if image.dtype.is_floating_point else images.convert_image_dtype(image)
    mean = work.mean(dim=(-3, -2), keepdim=True)
    out = (work - mean) * contrast_factor + mean
    return out if image.dtype.is_floating_point else images.convert_image_dtype(out, image.dtype)


def random_brightness(image: torch.Tensor, max_delta: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """tf.image.random_brightness: adjust_brightness by a delta uniform in [-max_delta, max_delta)."""
    if max_delta < 0:
        raise ValueError(f"random_brightness: max_delta={max_delta} must be non-negative.")
    delta = float(torch.empty(()).uniform_(-max_delta, max_delta, generator=generator))
    return adjust_brightness(image, delta)


def random_contrast(image: torch.Tensor, lower: float, upper: float,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """tf.image.random_contrast: adjust_contrast by a factor uniform in [lower, upper)."""
    if upper <= lower:
        raise ValueError(f"random_contrast: upper={upper} must be > lower={lower}.")
    if lower < 0:
        raise ValueError(f"random_contrast: lower={lower} must be non-negative.")
    factor = float(torch.empty(()).uniform_(lower, upper, generator=generator))
    return adjust_contrast(image, factor)


def _generator(seed: Sequence[int], op: str) -> torch.Generator:
    seed = tuple(int(s) for s in (seed.tolist() if isinstance(seed, torch.Tensor) else seed))
    if len(seed) != 2:
        raise ValueError(f"{op}: seed must be a pair of ints, as TF's stateless ops take it (e.g. seed=(1, 2)); "
                         f"got {seed!r}.")
    return torch.Generator().manual_seed(derive_seed(*seed))


def stateless_random_crop(image: torch.Tensor, size: Sequence[int], seed: Sequence[int]) -> torch.Tensor:
    """tf.image.stateless_random_crop: random_crop with the offset a function of `seed` (a pair)."""
    return images.random_crop(image, size, _generator(seed, "stateless_random_crop"))


def stateless_random_flip_left_right(image: torch.Tensor, seed: Sequence[int]) -> torch.Tensor:
    """tf.image.stateless_random_flip_left_right: the flip a function of `seed` (a pair)."""
    return images.random_flip_left_right(image, _generator(seed, "stateless_random_flip_left_right"))


def stateless_random_flip_up_down(image: torch.Tensor, seed: Sequence[int]) -> torch.Tensor:
    """tf.image.stateless_random_flip_up_down: the flip a function of `seed` (a pair)."""
    return images.random_flip_up_down(image, _generator(seed, "stateless_random_flip_up_down"))


def stateless_random_brightness(image: torch.Tensor, max_delta: float, seed: Sequence[int]) -> torch.Tensor:
    """tf.image.stateless_random_brightness: the delta a function of `seed` (a pair)."""
    return random_brightness(image, max_delta, _generator(seed, "stateless_random_brightness"))


def stateless_random_contrast(image: torch.Tensor, lower: float, upper: float,
                              seed: Sequence[int]) -> torch.Tensor:
    """tf.image.stateless_random_contrast: the factor a function of `seed` (a pair)."""
    return random_contrast(image, lower, upper, _generator(seed, "stateless_random_contrast"))
