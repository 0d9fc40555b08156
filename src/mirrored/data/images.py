"""Images for the input pipeline: decode/encode, resize, dtype conversion, crops and flips.

Decoded images are uint8 HWC tensors, as tf.io.decode_image gives them; every function also takes
a batch (NHWC). decode_image() decodes JPEGs to gray or RGB with simplejpeg (libjpeg-turbo) and
everything else with Pillow; both release the GIL while they decode, so a thread pool
(Dataset.map(num_parallel_calls=...)) decodes in parallel. resize() follows tf.image.resize
(half-pixel centers, float32 out); its default (bilinear) runs in OpenCV on CPU tensors, 3x faster
than torch's kernel for 3-channel images. Random ops take an optional torch.Generator (brightness,
contrast and tf.image.stateless_random_* are in _image_random.py, re-exported here). Uses torch,
numpy, simplejpeg, Pillow and OpenCV.

JPEGs go through simplejpeg with libjpeg's fast integer DCT and fancy upsampling, TF's
decode_jpeg defaults, so pixels match TF's (the fixture's mean pixels to its 4 decimals); Pillow
uses the accurate DCT, ~0.9 of a level off in the mean, and is only the fallback for the JPEGs
routed away from simplejpeg (CMYK, RGBA output, anything it rejects).
"""
from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

__all__ = [
    "central_crop", "convert_image_dtype", "crop_to_bounding_box", "decode_image", "decode_jpeg",
    "decode_png", "encode_jpeg", "encode_png", "normalize", "pad_to_bounding_box",
    "random_crop", "random_flip_left_right", "random_flip_up_down", "resize",
    "resize_with_crop_or_pad", "to_chw", "to_hwc",
    # from _image_random.py
    "adjust_brightness", "adjust_contrast", "random_brightness", "random_contrast", "stateless_random_brightness",
    "stateless_random_contrast", "stateless_random_crop", "stateless_random_flip_left_right",
    "stateless_random_flip_up_down",
]

ImageLike = torch.Tensor | np.ndarray

# channels= -> Pillow mode; 0 keeps what is stored (mapped to the nearest of L, LA, RGB, RGBA).
_CHANNEL_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
_STORED_MODES = {"L": "L", "LA": "LA", "RGB": "RGB", "RGBA": "RGBA", "1": "L", "I": "L",
                 "F": "L", "PA": "RGBA", "La": "LA", "RGBa": "RGBA"}
# JPEG colorspace (from the header) -> simplejpeg output for channels=0; CMYK and YCCK go to Pillow.
_JPEG_STORED = {"Gray": "GRAY", "YCbCr": "RGB", "RGB": "RGB"}
_JPEG_CHANNELS = {1: "GRAY", 3: "RGB"}


# --------------------------------------------------------------------------------------------
# Decoding and encoding


def decode_image(data: bytes, channels: int = 3, *, name: str = "") -> torch.Tensor:
    """Decodes JPEG/PNG/GIF/BMP/WebP/... bytes to a uint8 HWC tensor, like tf.io.decode_image.

    Args:
      channels: 0 keeps the stored channels (gray 1, gray+alpha 2, RGB 3, RGBA 4), 1 gray,
        3 RGB, 4 RGBA. Alpha is dropped, not composited, as TF does. EXIF orientation is not
        applied (TF ignores it too); an animation gives its first frame.
      name: what the bytes are, for error messages (e.g. "record 5 of train.tfrecord").
    """
    if channels not in (0, 1, 3, 4) or isinstance(channels, bool):
        raise ValueError(f"decode_image: channels={channels!r}; use 0 (as stored), 1 (gray), "
                         f"3 (RGB) or 4 (RGBA).")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode_image: expected encoded image bytes{_of(name)}, got "
                        f"{type(data).__name__}. Decode features['image'][0] from "
                        f"parse_example(), not an already decoded array.")
    array = _decode_jpeg_turbo(data, channels)
    if array is not None:
        return torch.from_numpy(array)
    try:
        with Image.open(io.BytesIO(data)) as image:
            eight_bit = data[24:25] != b"\x10"  # a PNG's IHDR bit depth (see _png_gray)
            if channels == 1 and image.format == "PNG" and image.mode in _PNG_COLOR_MODES and eight_bit:
                array = _png_gray(np.asarray(image.convert("RGB")))
            else:
                image = _to_mode(image, channels)
                array = np.array(image)  # a copy: Pillow's buffer is read-only
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        head = bytes(data[:16])
        raise ValueError(
            f"decode_image: cannot decode{_of(name)} as an image: {e} ({len(data)} bytes starting "
            f"{head!r}). Pass encoded JPEG/PNG/GIF/BMP/WebP bytes, e.g. features['image'][0] "
            f"from parse_example().") from e
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(array)


def decode_jpeg(data: bytes, channels: int = 3, *, name: str = "") -> torch.Tensor:
    """tf.io.decode_jpeg; same contract as decode_image (the format is read from the bytes)."""
    return decode_image(data, channels, name=name)


def decode_png(data: bytes, channels: int = 3, *, name: str = "") -> torch.Tensor:
    """tf.io.decode_png (8-bit out); same contract as decode_image."""
    return decode_image(data, channels, name=name)


def _decode_jpeg_turbo(data: bytes, channels: int) -> np.ndarray | None:
    """HWC pixels of a JPEG decoded like TF (fast integer DCT, fancy upsampling), or None where
    Pillow should decode instead: not a JPEG, RGBA wanted, CMYK/YCCK stored, larger than Pillow's
    decompression-bomb limit (so Pillow warns or raises as for other formats), or bytes that
    simplejpeg rejects (Pillow then decodes them or raises the error that names the record)."""
    if data[:3] != b"\xff\xd8\xff" or channels == 4:
        return None
    try:
        height, width, stored, _ = simplejpeg.decode_jpeg_header(data)
        limit = Image.MAX_IMAGE_PIXELS
        if stored not in _JPEG_STORED or (limit is not None and height * width > limit):
            return None
        colorspace = _JPEG_STORED[stored] if channels == 0 else _JPEG_CHANNELS[channels]
        return simplejpeg.decode_jpeg(data, colorspace, fastdct=True, fastupsample=False)
    except ValueError:
        return None


_PNG_COLOR_MODES = ("RGB", "RGBA", "P", "PA", "RGBa")


def _png_gray(rgb: np.ndarray) -> np.ndarray:
    """Gray from 8-bit RGB as libpng's png_set_rgb_to_gray(0.299, 0.587) computes it for TF's
    decode_png(channels=1): 15-bit fixed-point weights 9797, 19234, 3737, truncated, and gray pixels
    kept as they are (Pillow's convert("L") rounds instead: 1 level off on about half the pixels).
    Not for 16-bit PNGs (bit depth, IHDR byte 24, is 16): libpng converts those before dropping to
    8 bits, and Pillow hands over only the 8-bit values, so they keep Pillow's conversion."""
    r, g, b = (rgb[..., i].astype(np.uint32) for i in range(3))
    gray = ((9797 * r + 19234 * g + 3737 * b) >> 15).astype(np.uint8)
    return np.where((r == g) & (g == b), rgb[..., 0], gray)


def _of(name: str) -> str:
    return f" {name}" if name else ""


def _to_mode(image: Image.Image, channels: int) -> Image.Image:
    if image.mode.startswith("I;16"):
        # 16-bit gray: keep the high byte, as TF's uint8 decode does, not Pillow's clipping.
        high = (np.array(image, dtype=np.uint16) >> 8).astype(np.uint8)
        image = Image.fromarray(high, mode="L")
    if channels == 0:
        if image.mode == "P":
            mode = "RGBA" if "transparency" in image.info else "RGB"
        else:
            mode = _STORED_MODES.get(image.mode, "RGB")
    else:
        mode = _CHANNEL_MODES[channels]
    if image.mode != mode:
        return image.convert(mode)
    image.load()
    return image


def encode_jpeg(image: ImageLike, quality: int = 95) -> bytes:
    """Encodes a uint8 HWC image with 1 or 3 channels as JPEG, like tf.io.encode_jpeg."""
    if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) or not 1 <= quality <= 100:
        raise ValueError(f"encode_jpeg: quality={quality!r}; use an integer 1..100 (95 keeps fine detail).")
    array = _encodable(image, "encode_jpeg", (1, 3))
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def encode_png(image: ImageLike) -> bytes:
    """Encodes a uint8 HWC image with 1-4 channels as PNG (lossless), like tf.io.encode_png."""
    array = _encodable(image, "encode_png", (1, 2, 3, 4))
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def _encodable(image: ImageLike, op: str, channel_counts: tuple[int, ...]) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        image = image.detach().cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise TypeError(f"{op}: expected a uint8 HWC tensor or array, got {type(image).__name__}.")
    if image.dtype != np.uint8:
        raise TypeError(f"{op}: the image is {image.dtype}; encode uint8 pixels (for floats in "
                        f"[0, 1]: convert_image_dtype(image, torch.uint8)).")
    if image.ndim != 3 or image.shape[2] not in channel_counts:
        counts = " or ".join(map(str, channel_counts))
        raise ValueError(f"{op}: expected an HWC image with {counts} channels, got shape "
                         f"{tuple(image.shape)}.")
    if image.shape[2] == 1:
        image = image[:, :, 0]
    return np.ascontiguousarray(image)


# --------------------------------------------------------------------------------------------
# Layout and dtype


def _as_image(image: ImageLike, op: str, layout: str = "HWC") -> torch.Tensor:
    """The input as a tensor (numpy arrays are wrapped, not copied), checked to be 3-D or 4-D."""
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(image)
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"{op}: expected an {layout} or N{layout} tensor, got "
                        f"{type(image).__name__}.")
    if image.dim() not in (3, 4):
        raise ValueError(f"{op}: expected an {layout} image or an N{layout} batch, got shape "
                         f"{tuple(image.shape)}. Give a gray image a channel axis "
                         f"({'image[..., None]' if layout == 'HWC' else 'image[None]'}).")
    return image


def to_chw(image: torch.Tensor) -> torch.Tensor:
    """HWC -> CHW (NHWC -> NCHW) as a view: for a batch, the result is channels_last NCHW."""
    image = _as_image(image, "to_chw")
    return image.permute(2, 0, 1) if image.dim() == 3 else image.permute(0, 3, 1, 2)


def to_hwc(image: torch.Tensor) -> torch.Tensor:
    """CHW -> HWC (NCHW -> NHWC) as a view."""
    image = _as_image(image, "to_hwc", layout="CHW")
    return image.permute(1, 2, 0) if image.dim() == 3 else image.permute(0, 2, 3, 1)


def convert_image_dtype(image: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """tf.image.convert_image_dtype: integers map their full range onto [0, 1] floats and back.

    uint8 -> float32 is x * (1/255); float -> uint8 is x * 255.5 truncated, saturating outside
    [0, 1]; integer -> integer scales by the ratio of their ranges, a negative value going to 0 in
    an unsigned type: always TF's saturate=True (TF's default wraps instead). float -> float only
    casts. The scaling runs in the input's float dtype, as TF's, except that float16 and bfloat16
    are scaled in float32 (TF rounds 16.998 in half precision to 17; this truncates it to 16).
    """
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(image)
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"convert_image_dtype: expected a tensor, got {type(image).__name__}.")
    for d in (image.dtype, dtype):
        if d == torch.bool or d.is_complex or (not d.is_floating_point and _is_unsigned_wide(d)):
            raise TypeError(f"convert_image_dtype: unsupported dtype {d}; use uint8, int8, "
                            f"int16, int32, int64 or a float dtype.")
    if image.dtype == dtype:
        return image
    if image.dtype.is_floating_point and dtype.is_floating_point:
        return image.to(dtype)
    if not image.dtype.is_floating_point and dtype.is_floating_point:
        scale = torch.tensor(1.0 / torch.iinfo(image.dtype).max, dtype=dtype)
        return image.to(dtype) * scale
    out_info = torch.iinfo(dtype)
    if image.dtype.is_floating_point:
        # In the input's dtype, as TF, and in float64 where float32 cannot hold max + 0.5 (int32, int64).
        work = image.double() if out_info.bits > 16 or image.dtype == torch.float64 else image.float()
        scaled = work * (out_info.max + 0.5)
        # 2**63 - 1 rounds up to 2**63 in float64, which would overflow int64 on the cast.
        high = out_info.max if out_info.bits < 64 else math.nextafter(2.0**63, 0)
        return scaled.clamp(out_info.min, high).to(dtype)
    in_max, out_max = torch.iinfo(image.dtype).max, out_info.max
    if out_info.min == 0 and torch.iinfo(image.dtype).min < 0:
        image = image.clamp(min=0)  # saturate: -1 in int8 is 0 in uint8, not 254 (TF's saturate=True)
    if in_max > out_max:
        return torch.div(image, (in_max + 1) // (out_max + 1), rounding_mode="floor").to(dtype)
    return image.to(dtype) * ((out_max + 1) // (in_max + 1))


def _is_unsigned_wide(dtype: torch.dtype) -> bool:
    return dtype in (torch.uint16, torch.uint32, torch.uint64)


def normalize(image: torch.Tensor, mean: Sequence[float] | torch.Tensor,
              std: Sequence[float] | torch.Tensor, *, axis: int = -1) -> torch.Tensor:
    """(image - mean) / std per channel; `axis` is the channel axis (-1 for HWC/NHWC)."""
    image = _as_image(image, "normalize")
    if not image.dtype.is_floating_point:
        raise TypeError(
            f"normalize: the image is {image.dtype}; normalize a float image. Call "
            f"convert_image_dtype(image) first for statistics in [0, 1] units, or image.float() "
            f"for statistics in 0..255 units.")
    if not -image.dim() <= axis < image.dim():
        raise ValueError(f"normalize: axis={axis} is not an axis of the image (shape {tuple(image.shape)}); "
                         "use -1 for HWC/NHWC, or 0 / 1 for CHW / NCHW.")
    channels = image.shape[axis]
    mean_t = torch.as_tensor(mean, dtype=image.dtype, device=image.device).reshape(-1)
    std_t = torch.as_tensor(std, dtype=image.dtype, device=image.device).reshape(-1)
    for label, values in (("mean", mean_t), ("std", std_t)):
        if values.numel() not in (1, channels):
            raise ValueError(f"normalize: {label} has {values.numel()} values but the image has "
                             f"{channels} channels on axis {axis} (shape {tuple(image.shape)}).")
    if bool((std_t == 0).any()):
        raise ValueError(f"normalize: std contains 0 ({std_t.tolist()}); it divides.")
    shape = [1] * image.dim()
    shape[axis] = -1
    return (image - mean_t.reshape(shape)) / std_t.reshape(shape)


# --------------------------------------------------------------------------------------------
# Resizing

_RESIZE_METHODS = ("bilinear", "nearest", "bicubic", "area")
_KEYS_A = -0.5  # TF's bicubic with half-pixel centers is Keys' cubic with a = -0.5


def resize(images: ImageLike, size: Sequence[int], method: str = "bilinear",
           antialias: bool = False) -> torch.Tensor:
    """tf.image.resize: HWC or NHWC to new (height, width) = size, with half-pixel centers.

    Returns float32, except for "nearest", which keeps the input dtype (as TF does). Out-of-image
    taps get no weight and the rest are renormalized (TF's behavior at the borders). `antialias`
    widens the bilinear/bicubic kernel when downsampling; "area" averages by covered area and
    "nearest" ignores antialias, both as in TF. Plain bicubic reads the kernel from TF's table of
    1024 steps per pixel, so it gives TF's values bit for bit. Plain bilinear on a CPU tensor runs
    in OpenCV, which places samples in float64 where TF uses float32: up to ~5e-5 of the value range
    closer to exact. The first such call sets OpenCV to one thread (cv2.setNumThreads(1), for the
    whole process).
    """
    images = _as_image(images, "resize")
    if method not in _RESIZE_METHODS:
        raise ValueError(f"resize: unknown method {method!r}; use one of {_RESIZE_METHODS}.")
    height, width = _check_size(size, "resize")
    batch = images if images.dim() == 4 else images.unsqueeze(0)
    in_h, in_w = batch.shape[1], batch.shape[2]
    if in_h == 0 or in_w == 0 or batch.shape[3] == 0:
        raise ValueError(f"resize: the image is empty (shape {tuple(images.shape)}); give it at least "
                         "one row, column and channel.")
    if method == "bilinear" and not antialias:
        fast = _bilinear_opencv(images, height, width)
        if fast is not None:
            return fast
    nchw = batch.permute(0, 3, 1, 2)  # a channels_last view: interpolate works on it in place
    size = (height, width)
    if method == "nearest":
        # nearest-exact is floor((i + 0.5) * scale), TF's nearest with half-pixel centers.
        out = F.interpolate(nchw, size=size, mode="nearest-exact")
    elif method == "bilinear" and not antialias:  # what OpenCV does not take
        out = F.interpolate(nchw.float(), size=size, mode="bilinear", align_corners=False)
    elif method == "bilinear" or (method == "bicubic" and antialias):
        # torch's antialiased kernels are TF's scale_and_translate: triangle or Keys a=-0.5
        # kernels widened by the downsampling factor, out-of-image taps dropped, renormalized.
        out = F.interpolate(nchw.float(), size=size, mode=method, align_corners=False,
                            antialias=True)
    elif method == "area" and in_h % height == 0 and in_w % width == 0:
        out = F.interpolate(nchw.float(), size=size, mode="area")  # whole blocks: plain mean
    else:  # bicubic without antialias (TF's tabulated weights), area by fractional coverage
        out = _resize_separable(batch.float(), height, width, method, antialias)
        out = out.permute(0, 3, 1, 2)
    out = out.permute(0, 2, 3, 1).contiguous()
    return out if images.dim() == 4 else out[0]


def _opencv():
    """cv2, imported on first use (~0.1 s) and set to one thread per call, as albumentations sets
    it: a pipeline's parallelism is its map threads, and OpenCV's own team on the same cores would
    only contend with them (a serial map kept 1.4 cores busy)."""
    global _cv2
    if _cv2 is None:
        import cv2

        cv2.setNumThreads(1)
        _cv2 = cv2
    return _cv2


_cv2 = None


def _bilinear_opencv(images: torch.Tensor, height: int, width: int) -> torch.Tensor | None:
    """TF's bilinear resize (half-pixel centers, no antialiasing) of an HWC image or NHWC batch in
    OpenCV, as float32 in the same layout; None where torch must do it (a GPU tensor, autograd,
    more than 4 channels: torch's kernel vectorizes over many channels, and OpenCV's Python binding
    refuses more than 128).

    torch's kernel on a 3-channel channels_last image runs one pixel at a time (0.6 ms for 500x375
    to 224x224 here, against 0.13 ms in OpenCV plus 0.07 ms for the float cast): the resize was a
    third of the reference pipeline's time per image. OpenCV computes the sample positions in
    float64 where TF and torch use float32, so results differ from TF's by up to ~5e-5 of the
    value range, and are that much closer to exact bilinear interpolation."""
    if not images.is_cpu or images.requires_grad or images.shape[-1] > 4:
        return None
    cv2 = _opencv()
    src = images.float().numpy()  # float32 stays itself; OpenCV only reads it
    shape = (height, width, src.shape[-1])

    def one(image: np.ndarray) -> np.ndarray:  # (OpenCV drops a single channel's axis: reshaped back)
        return cv2.resize(np.ascontiguousarray(image), (width, height), interpolation=cv2.INTER_LINEAR).reshape(shape)

    if src.ndim == 3:
        return torch.from_numpy(one(src))
    out = np.empty((len(src), *shape), np.float32)  # (an empty batch stays one)
    for i, image in enumerate(src):
        out[i] = one(image)
    return torch.from_numpy(out)


def _check_size(size: Sequence[int], op: str) -> tuple[int, int]:
    try:
        height, width = (int(s) for s in size)
        ok = all(not isinstance(s, (bool, float)) and int(s) == s for s in size)
    except (TypeError, ValueError):
        ok = False
    if not ok or height <= 0 or width <= 0:
        raise ValueError(f"{op}: size must be (height, width) with positive ints, got {size!r}.")
    return height, width


def _resize_separable(nhwc: torch.Tensor, height: int, width: int, method: str,
                      antialias: bool) -> torch.Tensor:
    """Resizes rows, then columns, each output pixel a weighted sum of a few input pixels; used
    where torch has no kernel with TF's weights."""
    taps_h = _taps(nhwc.shape[1], height, method, antialias)
    taps_w = _taps(nhwc.shape[2], width, method, antialias)
    rows = _apply_taps(nhwc, 1, *taps_h)
    # Columns as rows of the transpose: gathering whole rows of W * C values is 3x faster than
    # gathering C values at a time along W (224 -> 448 bicubic: 29 ms -> 9 ms), and the same bits.
    return _apply_taps(rows.transpose(1, 2).contiguous(), 1, *taps_w).transpose(1, 2)


def _taps(in_size: int, out_size: int, method: str, antialias: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, weights), each [out_size, taps], for one axis; weights sum to 1 per row."""
    if method == "bicubic" and not antialias:
        return _bicubic_table_taps(in_size, out_size)
    scale = in_size / out_size
    out = np.arange(out_size, dtype=np.float64)
    if method == "area":
        # Output pixel i covers [i*scale, (i+1)*scale) of the input; weight = overlap / scale.
        start, end = out * scale, (out + 1) * scale
        n = int(math.ceil(scale)) + 1
        idx = np.floor(start).astype(np.int64)[:, None] + np.arange(n)
        overlap = np.minimum(end[:, None], idx + 1) - np.maximum(start[:, None], idx)
        weights = np.clip(overlap, 0, None) / scale
    else:
        radius = 1.0 if method == "bilinear" else 2.0
        kernel_scale = max(scale, 1.0) if antialias else 1.0
        center = (out + 0.5) * scale  # in input pixel units; pixel p has its center at p + 0.5
        support = radius * kernel_scale
        n = int(math.ceil(2 * support)) + 1
        idx = np.floor(center - support).astype(np.int64)[:, None] + np.arange(n)
        x = (idx + 0.5 - center[:, None]) / kernel_scale
        weights = _triangle(x) if method == "bilinear" else _keys_cubic(x)
    inside = (idx >= 0) & (idx < in_size)
    weights = np.where(inside, weights, 0.0)
    weights /= weights.sum(axis=1, keepdims=True)
    return (torch.from_numpy(np.clip(idx, 0, in_size - 1)),
            torch.from_numpy(weights.astype(np.float32)))


_BICUBIC_TABLE_SIZE = 1024


def _bicubic_table_taps(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TF's resize_bicubic with half-pixel centers (tf.image.resize's bicubic without antialias):
    the Keys kernel (a = -0.5) read from a table of 1024 steps per pixel, so each sample's offset
    is rounded to 1/1024 (up to ~8e-4 of the value range from the exact kernel), positions in
    float32, out-of-image taps dropped and the rest renormalized, all as TF computes them."""
    steps = _BICUBIC_TABLE_SIZE
    x = np.arange(steps + 1, dtype=np.float64) / steps
    near = (((_KEYS_A + 2) * x - (_KEYS_A + 3)) * x * x + 1).astype(np.float32)  # |d| in [0, 1]
    x = x + 1
    far = ((((_KEYS_A * x - 5 * _KEYS_A) * x + 8 * _KEYS_A) * x) - 4 * _KEYS_A).astype(np.float32)  # [1, 2]
    scale = np.float32(in_size) / np.float32(out_size)
    position = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    base = np.floor(position)
    offset = np.rint((position - base) * np.float32(steps)).astype(np.int64)  # lrintf: half to even
    idx = base.astype(np.int64)[:, None] + np.arange(-1, 3)
    weights = np.stack([far[offset], near[offset], near[steps - offset], far[steps - offset]], axis=1)
    weights = np.where((idx >= 0) & (idx < in_size), weights, np.float32(0))
    weights = weights * (np.float32(1) / weights.sum(axis=1, keepdims=True, dtype=np.float32))
    return torch.from_numpy(np.clip(idx, 0, in_size - 1)), torch.from_numpy(weights.astype(np.float32))


def _triangle(x: np.ndarray) -> np.ndarray:
    return np.clip(1.0 - np.abs(x), 0.0, None)


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    a = _KEYS_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _apply_taps(x: torch.Tensor, axis: int, idx: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
    out_size, n = idx.shape
    gathered = x.index_select(axis, idx.reshape(-1))
    shape = list(x.shape)
    shape[axis:axis + 1] = [out_size, n]
    gathered = gathered.reshape(shape)
    w_shape = [1] * len(shape)
    w_shape[axis:axis + 2] = [out_size, n]
    return (gathered * weights.reshape(w_shape)).sum(dim=axis + 1)


# --------------------------------------------------------------------------------------------
# Crops, pads and flips


def crop_to_bounding_box(image: torch.Tensor, offset_height: int, offset_width: int,
                         target_height: int, target_width: int) -> torch.Tensor:
    """tf.image.crop_to_bounding_box, as a view."""
    image = _as_image(image, "crop_to_bounding_box")
    h, w = image.shape[-3], image.shape[-2]
    if (offset_height < 0 or offset_width < 0 or target_height <= 0 or target_width <= 0
            or offset_height + target_height > h or offset_width + target_width > w):
        raise ValueError(
            f"crop_to_bounding_box: box (offset {offset_height}, {offset_width}, size "
            f"{target_height}x{target_width}) does not fit in an image of {h}x{w}.")
    return image[..., offset_height:offset_height + target_height,
                 offset_width:offset_width + target_width, :]


def pad_to_bounding_box(image: torch.Tensor, offset_height: int, offset_width: int,
                        target_height: int, target_width: int) -> torch.Tensor:
    """tf.image.pad_to_bounding_box: zeros around the image, placed at the offset."""
    image = _as_image(image, "pad_to_bounding_box")
    h, w = image.shape[-3], image.shape[-2]
    bottom, right = target_height - offset_height - h, target_width - offset_width - w
    if offset_height < 0 or offset_width < 0 or bottom < 0 or right < 0:
        raise ValueError(
            f"pad_to_bounding_box: an image of {h}x{w} at offset ({offset_height}, "
            f"{offset_width}) does not fit in {target_height}x{target_width}.")
    return F.pad(image, (0, 0, offset_width, right, offset_height, bottom))


def resize_with_crop_or_pad(image: torch.Tensor, target_height: int, target_width: int
                            ) -> torch.Tensor:
    """tf.image.resize_with_crop_or_pad: center-crops or zero-pads each side to the target."""
    image = _as_image(image, "resize_with_crop_or_pad")
    _check_size((target_height, target_width), "resize_with_crop_or_pad")
    h, w = image.shape[-3], image.shape[-2]
    crop_h, crop_w = min(h, target_height), min(w, target_width)
    image = crop_to_bounding_box(image, max((h - target_height) // 2, 0),
                                 max((w - target_width) // 2, 0), crop_h, crop_w)
    return pad_to_bounding_box(image, max((target_height - h) // 2, 0),
                               max((target_width - w) // 2, 0), target_height, target_width)


def central_crop(image: torch.Tensor, central_fraction: float) -> torch.Tensor:
    """tf.image.central_crop: keeps the central `central_fraction` of height and width (a view)."""
    image = _as_image(image, "central_crop")
    if not 0.0 < central_fraction <= 1.0:
        raise ValueError(f"central_crop: central_fraction={central_fraction}; use (0, 1].")
    h, w = image.shape[-3], image.shape[-2]
    top = int((h - h * central_fraction) / 2)
    left = int((w - w * central_fraction) / 2)
    return image[..., top:h - top, left:w - left, :]


def random_crop(image: torch.Tensor, size: Sequence[int],
                generator: torch.Generator | None = None) -> torch.Tensor:
    """tf.image.random_crop of (height, width) at a uniform offset (one offset for a batch).

    `size` may also be the full output shape, as TF takes it ((h, w, c) or (n, h, w, c)); its
    other entries must equal the image's.
    """
    image = _as_image(image, "random_crop")
    size = tuple(size)
    if len(size) == image.dim():
        if any(s != d for i, (s, d) in enumerate(zip(size, image.shape)) if i not in
               (image.dim() - 3, image.dim() - 2)):
            raise ValueError(f"random_crop: size {size} must equal the image shape "
                             f"{tuple(image.shape)} outside height and width.")
        size = size[-3:-1]
    target_h, target_w = _check_size(size, "random_crop")
    h, w = image.shape[-3], image.shape[-2]
    if target_h > h or target_w > w:
        raise ValueError(f"random_crop: cannot crop {target_h}x{target_w} from an image of "
                         f"{h}x{w}; resize or pad it first (resize_with_crop_or_pad).")
    top = int(torch.randint(0, h - target_h + 1, (), generator=generator))
    left = int(torch.randint(0, w - target_w + 1, (), generator=generator))
    return image[..., top:top + target_h, left:left + target_w, :]


def random_flip_left_right(image: torch.Tensor, generator: torch.Generator | None = None
                           ) -> torch.Tensor:
    """tf.image.random_flip_left_right: mirrors with probability 1/2, each image of a batch
    independently."""
    return _random_flip(image, -2, generator, "random_flip_left_right")


def random_flip_up_down(image: torch.Tensor, generator: torch.Generator | None = None
                        ) -> torch.Tensor:
    """tf.image.random_flip_up_down: flips vertically with probability 1/2, per image."""
    return _random_flip(image, -3, generator, "random_flip_up_down")


def _random_flip(image: torch.Tensor, axis: int, generator: torch.Generator | None,
                 op: str) -> torch.Tensor:
    image = _as_image(image, op)
    if image.dim() == 3:
        flip = bool(torch.rand((), generator=generator) < 0.5)
        return image.flip(axis) if flip else image
    flip = torch.rand(image.shape[0], generator=generator) < 0.5
    return torch.where(flip.to(image.device).reshape(-1, 1, 1, 1), image.flip(axis), image)


# Last: _image_random.py builds on the functions above.
from mirrored.data._image_random import (adjust_brightness, adjust_contrast, random_brightness,  # noqa: E402
                                         random_contrast, stateless_random_brightness, stateless_random_contrast,
                                         stateless_random_crop, stateless_random_flip_left_right,
                                         stateless_random_flip_up_down)
