"""images.py against independent numpy references and the TFDS fixture's expected pixels."""
from __future__ import annotations

import io
import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from mirrored.data.images import (central_crop, convert_image_dtype, decode_image, decode_jpeg,
                                  decode_png, encode_jpeg, encode_png, normalize,
                                  pad_to_bounding_box, random_crop, random_flip_left_right,
                                  random_flip_up_down, resize, resize_with_crop_or_pad, to_chw,
                                  to_hwc)
from mirrored.data.tfrecord import parse_example, read_records


def rng_image(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# Decoding and encoding


def test_decodes_fixture_jpegs_like_expected(fixtures_dir):
    # The expected means come from TF's decoder (libjpeg's fast integer DCT, fancy upsampling),
    # written with 4 decimals. simplejpeg with fastdct=True is measured 5.0e-5 off at worst over
    # the 40 images, i.e. exact up to that rounding; Pillow's accurate DCT was up to 0.89 off.
    expected = json.loads((fixtures_dir / "tfds" / "cassava_expected.json").read_text())
    for split, rows in expected["splits"].items():
        path = fixtures_dir / "tfds/cassava/0.1.0" / f"cassava-{split}.tfrecord-00000-of-00001"
        for i, (record, row) in enumerate(zip(read_records(path), rows)):
            jpeg = parse_example(record)["image"][0]
            image = decode_image(jpeg, name=f"record {i} of {path.name}")
            assert image.dtype == torch.uint8
            assert list(image.shape) == row["shape"]
            assert abs(image.double().mean().item() - row["mean"]) <= 1e-4, (split, i)


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_png_round_trip_is_exact(channels):
    pixels = rng_image(13, 17, channels)
    data = encode_png(torch.from_numpy(pixels))
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    decoded = decode_png(data, channels=0)
    assert decoded.dtype == torch.uint8 and decoded.shape == (13, 17, channels)
    np.testing.assert_array_equal(decoded.numpy(), pixels)
    assert decoded.numpy().flags.writeable


def test_channel_conversions_follow_pillow_modes():
    rgba = rng_image(6, 5, 4)
    data = encode_png(rgba)
    np.testing.assert_array_equal(decode_image(data, 3).numpy(), rgba[..., :3])  # alpha dropped
    gray = decode_image(data, 1).numpy()[..., 0].astype(np.float64)
    r, g, b = (rgba[..., i].astype(np.float64) for i in range(3))
    assert np.abs(gray - (0.299 * r + 0.587 * g + 0.114 * b)).max() <= 1.0  # ITU-R 601-2 luma
    gray_png = encode_png(rgba[..., :1])
    rgb = decode_image(gray_png, 3).numpy()
    np.testing.assert_array_equal(rgb, np.repeat(rgba[..., :1], 3, axis=2))
    assert decode_image(gray_png, 4).numpy()[..., 3].min() == 255


# tf.io.decode_png(channels=1) of the 16x16 RGB image below, measured on TF 2.21 (libpng's rgb_to_gray).
_TF_GRAY_OF_RGB_PNG = bytes.fromhex(
    "010a131c262f38414a535d666f78818b131c26303a434d57616b747e88929b59252f39444e58636d77828c96a1abb573"
    "37414c57626d78838e99a4aeb9c4cf8e48545f6b76828d99a4b0bbc7d2c0cc8b5a66727e8b97a3afbbc7b6c2cedae6a5"
    "6c7985929fabb8c5d1c1cdda505d1d297e8b99a6b3c0cdbd34414f5c69763727909eacb9313f4c3d4b58667482723341"
    "0c1a283745534553616f7e8c7d8c4d5c1e2d3b4a594b5a697887958796a56776303f4f5e6d606f7f8e9e909fafbe6473"
    "4252627282748595a597a7b8c86e7e8e5364758579899aaa9eaebfd0c38798a8657788998d9eafc0b4c6d7cbdca1b2a6"
    "77899bada1b3c5b9cbddee4d5e24182a"
)


def _color_ramp() -> np.ndarray:
    y, x = np.mgrid[0:16, 0:16]
    return np.stack([(x * 17 + y * 3) % 256, (y * 29 + x * 7) % 256, (x * y * 5 + 11) % 256], -1).astype(np.uint8)


def test_color_png_to_gray_matches_tf_exactly():
    """decode_png(channels=1) of an RGB or RGBA PNG gives TF's gray levels bit for bit (Pillow's own
    convert("L") rounds differently: 117 of these 256 pixels one level off); gray pixels stay."""
    rgb = _color_ramp()
    want = np.frombuffer(_TF_GRAY_OF_RGB_PNG, np.uint8).reshape(16, 16, 1)
    alpha = rgb[..., :1] // 2 + 3
    for pixels in (rgb, np.concatenate([rgb, alpha], -1)):  # TF drops alpha before the conversion
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="PNG")
        got = decode_image(out.getvalue(), 1)
        assert got.dtype == torch.uint8 and np.array_equal(got.numpy(), want)
    gray_rgb = np.repeat(np.arange(256, dtype=np.uint8).reshape(16, 16, 1), 3, axis=-1)
    out = io.BytesIO()
    Image.fromarray(gray_rgb).save(out, format="PNG")
    assert np.array_equal(decode_image(out.getvalue(), 1).numpy()[..., 0], gray_rgb[..., 0])


def test_decodes_palette_and_16_bit_pngs():
    palette = Image.new("P", (4, 3))
    palette.putpalette([10, 20, 30] * 256)
    out = io.BytesIO()
    palette.save(out, format="PNG")
    assert decode_image(out.getvalue(), 0).numpy().reshape(-1, 3).tolist()[0] == [10, 20, 30]
    deep = np.array([[0, 255, 256, 65535]], dtype=np.uint16)
    out = io.BytesIO()
    Image.fromarray(deep).save(out, format="PNG")
    assert decode_image(out.getvalue(), 0)[..., 0].tolist() == [[0, 0, 1, 255]]  # high byte


def test_jpeg_round_trip_is_close():
    y, x = np.mgrid[0:48, 0:64]
    smooth = np.stack([x * 4, y * 5, (x + y) * 2], axis=-1).astype(np.uint8)
    data = encode_jpeg(torch.from_numpy(smooth), quality=95)
    assert data[:3] == b"\xff\xd8\xff"
    decoded = decode_jpeg(data)
    assert decoded.shape == (48, 64, 3)
    assert np.abs(decoded.numpy().astype(int) - smooth).mean() < 2.0


def smooth_jpeg(mode: str = "RGB", **save_args) -> tuple[np.ndarray, bytes]:
    y, x = np.mgrid[0:40, 0:56]
    pixels = np.stack([x * 4, y * 5, (x + y) * 2, 255 - x * 3], axis=-1).astype(np.uint8)
    pixels = pixels[..., :len(mode)] if mode != "L" else pixels[..., 0]
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, format="JPEG", quality=92, **save_args)
    return pixels, out.getvalue()


def pillow_decode(data: bytes, mode: str) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        array = np.array(image.convert(mode), dtype=np.float64)
    return array[..., None] if array.ndim == 2 else array


def test_jpeg_channels_and_layouts():
    # Reference: Pillow's decode (accurate DCT), which may differ by a couple of levels per pixel.
    _, color = smooth_jpeg()
    rgb = decode_image(color, 3)
    assert rgb.shape == (40, 56, 3) and rgb.numpy().flags.writeable
    assert np.abs(rgb.numpy() - pillow_decode(color, "RGB")).max() <= 3
    assert decode_image(color, 0).shape == (40, 56, 3)
    # channels=1 is libjpeg's luma plane, as in TF; the ITU-R 601-2 luma of RGB is within rounding.
    gray = decode_image(color, 1).numpy()[..., 0].astype(np.float64)
    r, g, b = (rgb.numpy()[..., i].astype(np.float64) for i in range(3))
    assert np.abs(gray - (0.299 * r + 0.587 * g + 0.114 * b)).max() <= 3
    rgba = decode_image(color, 4).numpy()  # RGBA output: Pillow
    assert rgba.shape == (40, 56, 4) and rgba[..., 3].min() == 255
    assert np.abs(rgba[..., :3] - pillow_decode(color, "RGB")).max() == 0
    _, stored_gray = smooth_jpeg("L")
    one = decode_image(stored_gray, 0)
    assert one.shape == (40, 56, 1)
    assert np.abs(one.numpy() - pillow_decode(stored_gray, "L")).max() <= 3
    np.testing.assert_array_equal(decode_image(stored_gray, 3).numpy(), one.numpy().repeat(3, 2))


def test_progressive_and_cmyk_jpegs_decode():
    _, progressive = smooth_jpeg(progressive=True)
    assert np.abs(decode_image(progressive).numpy() - pillow_decode(progressive, "RGB")).max() <= 3
    _, cmyk = smooth_jpeg("CMYK")  # routed to Pillow, whose CMYK -> RGB it keeps
    for channels in (0, 3):
        np.testing.assert_array_equal(decode_image(cmyk, channels).numpy(),
                                      pillow_decode(cmyk, "RGB"))


def test_jpeg_decodes_the_same_on_threads():
    jpegs = [encode_jpeg(rng_image(64, 48, 3, seed=seed), quality=90) for seed in range(16)]
    serial = [decode_image(j) for j in jpegs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(decode_image, jpegs))
    for one, other in zip(serial, threaded):
        assert torch.equal(one, other)


def test_jpeg_over_the_pixel_limit_is_refused(monkeypatch):
    _, jpeg = smooth_jpeg()  # 40 x 56 = 2240 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow refuses past twice the limit
    with pytest.raises(ValueError, match="record 2 .*exceeds limit"):
        decode_image(jpeg, name="record 2")


def test_bad_bytes_error_names_the_record():
    with pytest.raises(ValueError, match=r"record 5 of cassava-train.*b'not an image"):
        decode_image(b"not an image at all", name="record 5 of cassava-train")
    jpeg = encode_jpeg(rng_image(32, 32, 3))
    for truncated in (jpeg[:200], jpeg[:len(jpeg) // 2]):  # in the header, in the scan
        with pytest.raises(ValueError, match="cannot decode record 1"):
            decode_image(truncated, name="record 1")
    with pytest.raises(ValueError, match="channels=2"):
        decode_image(encode_png(rng_image(2, 2, 3)), channels=2)
    with pytest.raises(TypeError, match="encoded image bytes"):
        decode_image(np.zeros((2, 2, 3), np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        encode_png(np.zeros((2, 2, 3), np.float32))
    with pytest.raises(ValueError, match="1 or 3 channels"):
        encode_jpeg(np.zeros((2, 2, 4), np.uint8))


# ---------------------------------------------------------------------------------------------
# Resizing: references written from the definitions, with loops, in float64


def ref_bilinear(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Half-pixel-center bilinear: source = (dst + 0.5) * in / out - 0.5, edges clamped."""
    in_h, in_w = image.shape[:2]
    out = np.zeros((out_h, out_w, image.shape[2]))
    for i in range(out_h):
        sy = max((i + 0.5) * in_h / out_h - 0.5, 0.0)
        y0 = min(int(math.floor(sy)), in_h - 1)
        y1, fy = min(y0 + 1, in_h - 1), sy - y0
        for j in range(out_w):
            sx = max((j + 0.5) * in_w / out_w - 0.5, 0.0)
            x0 = min(int(math.floor(sx)), in_w - 1)
            x1, fx = min(x0 + 1, in_w - 1), sx - x0
            top = image[y0, x0] * (1 - fx) + image[y0, x1] * fx
            bottom = image[y1, x0] * (1 - fx) + image[y1, x1] * fx
            out[i, j] = top * (1 - fy) + bottom * fy
    return out


def ref_kernel_weights(in_size: int, out_size: int, kernel, radius: float,
                       widen: bool) -> np.ndarray:
    """Dense [out, in] weights: kernel at (p + 0.5 - center) / s, s = scale if widened, taps
    outside the image dropped and the rest renormalized (TF's scale_and_translate rule)."""
    scale = in_size / out_size
    s = max(scale, 1.0) if widen else 1.0
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = (i + 0.5) * scale
        for p in range(in_size):
            distance = p + 0.5 - center
            weights[i, p] = kernel(distance / s) if abs(distance) < radius * s else 0.0
        weights[i] /= weights[i].sum()
    return weights


def keys_cubic(x: float, a: float = -0.5) -> float:
    x = abs(x)
    if x <= 1:
        return (a + 2) * x**3 - (a + 3) * x**2 + 1
    if x < 2:
        return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
    return 0.0


def triangle(x: float) -> float:
    return max(0.0, 1 - abs(x))


def apply_separable(image: np.ndarray, wh: np.ndarray, ww: np.ndarray) -> np.ndarray:
    return np.einsum("ip,jq,pqc->ijc", wh, ww, image.astype(np.float64))


SIZES = [(7, 9), (20, 30), (5, 40), (1, 1), (13, 13)]


def test_bilinear_matches_reference():
    image = rng_image(13, 13, 3).astype(np.float64)
    for out_size in SIZES:
        got = resize(torch.from_numpy(image.astype(np.uint8)), out_size)
        assert got.dtype == torch.float32 and got.shape == (*out_size, 3)
        # 1e-3 on 0..255 values is 4e-6 relative: the float32 rounding of source coordinates.
        np.testing.assert_allclose(got.numpy(), ref_bilinear(image, *out_size), atol=1e-3)
        unit = image / 255  # in [0, 1], as after convert_image_dtype
        got = resize(torch.from_numpy(unit.astype(np.float32)), out_size)
        np.testing.assert_allclose(got.numpy(), ref_bilinear(unit, *out_size), atol=1e-4)


def _torch_path(image: torch.Tensor) -> torch.Tensor:
    """A copy of the image routed to torch's kernel: resize leaves tensors that need autograd to it."""
    return image.float().clone().requires_grad_()


@pytest.mark.parametrize("route", ["opencv", "torch"])
@pytest.mark.parametrize("in_shape, out_size", [
    ((375, 500, 3), (224, 224)),  # the reference workload's downscale
    ((40, 1000, 3), (70, 33)),  # far apart scales, upsampling one side
    ((13, 13, 1), (27, 5)),  # one channel keeps its axis
    ((9, 30, 4), (9, 30)),  # same size: a float copy
    ((6, 7, 2), (1, 1)),
    ((5, 7, 130), (3, 9)),  # a feature map: torch's kernel either way
])
def test_bilinear_routes_match_float64_reference(route, in_shape, out_size):
    image = torch.from_numpy(rng_image(*in_shape, seed=3))
    got = resize(_torch_path(image) if route == "torch" else image, out_size).detach()
    assert got.dtype == torch.float32 and got.shape == (*out_size, in_shape[2]) and got.is_contiguous()
    want = ref_bilinear(image.numpy().astype(np.float64), *out_size)
    # On 0..255 values. OpenCV computes source coordinates in float64, torch (like TF) in float32,
    # whose rounding at coordinate ~1000 (6e-5) times a 255-level step gives up to ~1.5e-2.
    np.testing.assert_allclose(got.numpy(), want, atol=2e-3 if route == "opencv" else 2e-2, rtol=0)


def test_bilinear_routes_agree_on_batches_and_strided_input():
    batch = torch.from_numpy(rng_image(3, 50, 60, 3, seed=4))
    strided = batch[:, ::2, 1::3]  # a view with odd strides: copied before OpenCV reads it
    for images in (batch, strided, strided.float() / 255):
        fast = resize(images, (17, 23))
        slow = resize(_torch_path(images), (17, 23)).detach()
        assert fast.shape == slow.shape == (3, 17, 23, 3) and fast.is_contiguous()
        scale = float(images.max())
        torch.testing.assert_close(fast, slow, atol=1e-4 * scale, rtol=0)
        for n in range(3):  # a batch gives each image's own resize
            torch.testing.assert_close(fast[n], resize(images[n], (17, 23)), atol=0, rtol=0)
    assert resize(batch[:0], (17, 23)).shape == (0, 17, 23, 3)  # an empty batch stays one


def test_bilinear_is_single_threaded_in_opencv():
    import cv2

    resize(rng_image(8, 8, 3), (4, 4))  # imports and sets up OpenCV
    assert cv2.getNumThreads() == 1  # the map's threads are the parallelism


def test_bilinear_batched_float_input():
    batch = np.random.default_rng(1).random((3, 11, 6, 2)).astype(np.float32)
    got = resize(torch.from_numpy(batch), (4, 15))
    assert got.shape == (3, 4, 15, 2) and got.is_contiguous()
    for n in range(3):
        np.testing.assert_allclose(got[n].numpy(), ref_bilinear(batch[n].astype(np.float64), 4, 15),
                                   atol=1e-4)


@pytest.mark.parametrize("method, kernel, radius, antialias", [
    ("bicubic", keys_cubic, 2.0, False),
    ("bicubic", keys_cubic, 2.0, True),
    ("bilinear", triangle, 1.0, True),
])
def test_kernel_resizes_match_reference(method, kernel, radius, antialias):
    image = rng_image(13, 13, 3).astype(np.float64) / 255
    # Plain bicubic reads TF's table of the kernel at 1/1024 steps: up to ~8e-4 of the range off
    # the exact kernel (its slope is at most 1.5, the offset off by at most 1/2048, over 4 taps).
    atol = 1e-3 if method == "bicubic" and not antialias else 1e-4
    for out_size in SIZES:
        got = resize(image.astype(np.float32), out_size, method=method, antialias=antialias)
        wh = ref_kernel_weights(13, out_size[0], kernel, radius, antialias)
        ww = ref_kernel_weights(13, out_size[1], kernel, radius, antialias)
        np.testing.assert_allclose(got.numpy(), apply_separable(image, wh, ww), atol=atol)


# tf.image.resize(method="bicubic") of _ramp(h, w), float32 little-endian, measured on TF 2.21.
_TF_BICUBIC = {
    ((8, 8), (3, 5)): bytes.fromhex(
        "c9339d3ebdff703f8181103ff2e2903eac7e1b3f85e1c33e36c0ec3e00203b3f0abd663e60f4c33ebbd3033f"
        "7457ce3b2000443f62b49a3e1078223f"
    ),
    ((5, 7), (9, 11)): bytes.fromhex(
        "c867cabd15b7b53e9a01613f084b253f30fadb3e10be8d3e5657073dce42613e7a13623fb6b6533f5e8b283f"
        "59368d3d7836a23e7174263f48f5373fbab7233f74bbe83e8c615b3ecc618b3eba992a3f949d113f8e21d73e"
        "5fc2ca3ed14d8c3e2d15833eea8c543faddb7a3fac433e3f59010c3ffbcbc93ee244983e12defe3d3412453c"
        "507e363f136c093f3b1fc13ef783293ff7862b3ff949f93e6f842d3f2cee343f1aebeb3e9be66d3e667fcc3d"
        "267f643fd4d5483f00301a3f03e0e23eac49753e0000003e0d0a2d3f0e2d723f18d5363f2c2a073fb201d73e"
        "2ada073f67a8c73ea7518d3e61b1103fcaaa0a3fdfa09e3ee90efc3ec6c0063f5d4ca63ef318103fc796483f"
        "f5768c3e09c8e53d10362d3dd29b1c3fcf0c4c3f96a01d3f11a4db3e3b63613e824a5a3d27a9023f5062663f"
        "6c21103fbc0ce03e00c8933e2dff9f3e70a5103fdcff643f02453e3f953e073f5e7ebc3efe49c83e8abae23e"
        "1ea03d3fff21233fcee5e13e18e6103e9c47d73e7c90843f01bd6c3f394a383f02c60f3f2aa2a63e3c9e333e"
    ),
}


def _ramp(h: int, w: int) -> np.ndarray:
    i, j = np.mgrid[0:h, 0:w]
    return (((i * 7 + j * 13) % 17) / 16).astype(np.float32)[..., None]


@pytest.mark.parametrize("in_size, out_size", list(_TF_BICUBIC))
def test_plain_bicubic_is_bit_exact_with_tf(in_size, out_size):
    """Down- and upsampling: TF's tabulated weights, float32 positions and border renormalization
    give its output bit for bit."""
    want = np.frombuffer(_TF_BICUBIC[in_size, out_size], "<f4").reshape(*out_size, 1)
    got = resize(torch.from_numpy(_ramp(*in_size)), out_size, method="bicubic")
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


@pytest.mark.parametrize("in_size, out_size", [((12, 12), (4, 6)), ((12, 10), (5, 7)),
                                               ((5, 7), (12, 10))])
def test_area_is_the_mean_over_covered_area(in_size, out_size):
    # Reference: replicate each pixel out_size times, so each output covers whole blocks.
    image = rng_image(*in_size, 2).astype(np.float64)
    (h, w), (oh, ow) = in_size, out_size
    fine = image.repeat(oh, axis=0).repeat(ow, axis=1)
    expected = fine.reshape(oh, h, ow, w, 2).mean(axis=(1, 3))
    got = resize(torch.from_numpy(image.astype(np.uint8)), out_size, method="area")
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-4)


def test_nearest_keeps_dtype_and_matches_reference():
    image = rng_image(5, 7, 3)
    got = resize(image, (11, 4), method="nearest")
    assert got.dtype == torch.uint8
    rows = [min(int(math.floor((i + 0.5) * 5 / 11)), 4) for i in range(11)]
    cols = [min(int(math.floor((j + 0.5) * 7 / 4)), 6) for j in range(4)]
    np.testing.assert_array_equal(got.numpy(), image[rows][:, cols])


def test_resize_validates_size():
    for size in [(0, 5), (5,), (2, 3, 4), (2.5, 3), "ab", (True, 2), None]:
        with pytest.raises(ValueError, match="size must be"):
            resize(rng_image(4, 4, 3), size)


def test_resize_validates_image_and_method():
    with pytest.raises(ValueError, match="unknown method 'lanczos'"):
        resize(rng_image(4, 4, 3), (2, 2), method="lanczos")
    with pytest.raises(ValueError, match="HWC image or an NHWC batch"):
        resize(rng_image(4, 4), (2, 2))
    for empty in (rng_image(0, 4, 3), rng_image(4, 0, 3), rng_image(4, 4, 0), rng_image(2, 4, 4, 0)):
        with pytest.raises(ValueError, match=r"the image is empty \(shape"):
            resize(empty, (2, 2))


# ---------------------------------------------------------------------------------------------
# Layout and dtype


def test_convert_image_dtype_follows_tf():
    everything = torch.arange(256, dtype=torch.uint8)
    floats = convert_image_dtype(everything)
    np.testing.assert_array_equal(floats.numpy(),
                                  np.arange(256, dtype=np.float32) * np.float32(1 / 255))
    assert floats.min() == 0 and floats.max() == 1
    assert torch.equal(convert_image_dtype(floats, torch.uint8), everything)
    edge = convert_image_dtype(torch.tensor([-0.2, 0.0, 0.5, 0.999, 1.0, 1.3]), torch.uint8)
    assert edge.tolist() == [0, 0, 127, 255, 255, 255]  # x * 255.5, truncated, saturated
    wide = convert_image_dtype(everything, torch.int32)
    assert wide.tolist() == [v << 23 for v in range(256)]
    assert torch.equal(convert_image_dtype(wide, torch.uint8), everything)
    assert convert_image_dtype(floats, torch.float64).dtype == torch.float64
    assert convert_image_dtype(floats) is floats
    with pytest.raises(TypeError, match="unsupported dtype torch.bool"):
        convert_image_dtype(everything, torch.bool)


def test_convert_image_dtype_precision_and_saturation():
    """Measured on TF 2.21 (saturate=True): float64 is scaled in float64 (1/255.5 - 1e-12 is 0, not
    float32's 1), and a negative signed integer becomes 0 in an unsigned type (not 254 or 255)."""
    just_below = torch.tensor([1 / 255.5 - 1e-12, 2 / 255.5 - 1e-12], dtype=torch.float64)
    assert convert_image_dtype(just_below, torch.uint8).tolist() == [0, 1]
    assert convert_image_dtype(torch.tensor([-1, -128, 5], dtype=torch.int8), torch.uint8).tolist() == [0, 0, 10]
    assert convert_image_dtype(torch.tensor([-1, 32767], dtype=torch.int16), torch.uint8).tolist() == [0, 255]


def test_sixteen_bit_color_png_to_gray_keeps_pillows_conversion():
    """libpng's rgb_to_gray runs on 16-bit values before the drop to 8 bits, which Pillow does first:
    TF's exact weights are applied to 8-bit PNGs only; a 16-bit one is gray by Pillow, as before."""
    import struct
    import zlib

    rgb16 = (np.arange(8 * 8 * 3, dtype=np.uint16).reshape(8, 8, 3) * 331).astype(">u2")

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\x00" + row.tobytes() for row in rgb16)  # filter type 0 on each row
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    assert data[24] == 16  # a 16-bit PNG (IHDR's bit depth)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("L"))
    assert np.array_equal(decode_image(data, 1).numpy()[..., 0], want)


def test_layout_views():
    image = torch.from_numpy(rng_image(4, 5, 3))
    chw = to_chw(image)
    assert chw.shape == (3, 4, 5) and chw.data_ptr() == image.data_ptr()
    assert torch.equal(to_hwc(chw), image)
    batch = torch.from_numpy(rng_image(2, 4, 5, 3))
    nchw = to_chw(batch)
    assert nchw.shape == (2, 3, 4, 5) and nchw.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(to_hwc(nchw), batch)


def test_normalize_matches_numpy():
    image = np.random.default_rng(2).random((2, 4, 5, 3)).astype(np.float32)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    got = normalize(torch.from_numpy(image), mean, std)
    np.testing.assert_allclose(got.numpy(), (image - np.array(mean)) / np.array(std), rtol=1e-5,
                               atol=1e-6)
    chw = normalize(to_chw(torch.from_numpy(image)), mean, std, axis=1)
    np.testing.assert_allclose(to_hwc(chw).numpy(), got.numpy(), rtol=1e-6)
    with pytest.raises(TypeError, match="convert_image_dtype"):
        normalize(torch.zeros(2, 2, 3, dtype=torch.uint8), mean, std)
    with pytest.raises(ValueError, match="mean has 2 values but the image has 3 channels"):
        normalize(torch.zeros(2, 2, 3), [0.5, 0.5], std)
    with pytest.raises(ValueError, match="std contains 0"):
        normalize(torch.zeros(2, 2, 3), mean, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="axis=5 is not an axis of the image"):
        normalize(torch.zeros(2, 2, 3), mean, std, axis=5)
    with pytest.raises(ValueError, match="quality=90.5; use an integer"):
        encode_jpeg(torch.zeros(2, 2, 3, dtype=torch.uint8), quality=90.5)


# ---------------------------------------------------------------------------------------------
# Crops, pads and flips


def test_flips_are_either_identity_or_mirror_and_reproducible():
    image = torch.from_numpy(rng_image(3, 4, 2))
    seen = set()
    for seed in range(20):
        out = random_flip_left_right(image, torch.Generator().manual_seed(seed))
        again = random_flip_left_right(image, torch.Generator().manual_seed(seed))
        assert torch.equal(out, again)
        flipped = torch.equal(out, image.flip(1))
        assert flipped or torch.equal(out, image)
        seen.add(flipped)
        up_down = random_flip_up_down(image, torch.Generator().manual_seed(seed))
        assert torch.equal(up_down, image.flip(0)) or torch.equal(up_down, image)
    assert seen == {True, False}


def test_batched_flip_decides_per_image():
    batch = torch.from_numpy(rng_image(16, 3, 4, 2))
    out = random_flip_left_right(batch, torch.Generator().manual_seed(0))
    flipped = [torch.equal(out[n], batch[n].flip(1)) for n in range(16)]
    for n in range(16):
        assert flipped[n] or torch.equal(out[n], batch[n])
    assert 0 < sum(flipped) < 16


def test_random_crop_is_a_window_of_the_image():
    image = torch.from_numpy(rng_image(10, 12, 3))
    offsets = set()
    for seed in range(30):
        crop = random_crop(image, (4, 5), torch.Generator().manual_seed(seed))
        assert crop.shape == (4, 5, 3)
        found = [(y, x) for y in range(7) for x in range(8)
                 if torch.equal(image[y:y + 4, x:x + 5], crop)]
        assert found
        offsets.add(found[0])
    assert len(offsets) > 5
    assert random_crop(image, (4, 5, 3)).shape == (4, 5, 3)  # TF's full-shape form
    batch = torch.from_numpy(rng_image(2, 10, 12, 3))
    assert random_crop(batch, (6, 6)).shape == (2, 6, 6, 3)
    with pytest.raises(ValueError, match="cannot crop 11x5"):
        random_crop(image, (11, 5))
    with pytest.raises(ValueError, match="outside height and width"):
        random_crop(image, (4, 5, 1))


def test_central_crop_follows_tf_arithmetic():
    image = torch.arange(10 * 10).reshape(10, 10, 1)
    crop = central_crop(image, 0.5)
    # TF: start = int((10 - 10 * 0.5) / 2) = 2, size = 10 - 2 * 2 = 6
    assert torch.equal(crop, image[2:8, 2:8])
    assert central_crop(image, 1.0).shape == image.shape
    with pytest.raises(ValueError, match="central_fraction"):
        central_crop(image, 0.0)


def test_pad_and_crop_or_pad():
    image = torch.from_numpy(rng_image(3, 4, 2))
    padded = pad_to_bounding_box(image, 1, 2, 6, 7)
    assert padded.shape == (6, 7, 2)
    assert torch.equal(padded[1:4, 2:6], image) and padded.sum() == image.to(torch.int64).sum()
    with pytest.raises(ValueError, match="does not fit"):
        pad_to_bounding_box(image, 4, 0, 6, 7)
    # Target taller and narrower: pad rows evenly ((7-3)//2 = 2 on top), crop columns centrally.
    out = resize_with_crop_or_pad(image, 7, 2)
    assert out.shape == (7, 2, 2)
    assert torch.equal(out[2:5], image[:, 1:3]) and out[:2].sum() == 0 and out[5:].sum() == 0
    batch = torch.from_numpy(rng_image(2, 3, 4, 2))
    assert resize_with_crop_or_pad(batch, 5, 5).shape == (2, 5, 5, 2)
