#!/usr/bin/python3
"""PIL + numpy twin of forge's image decoding and of Hugging Face's CLIP / SigLIP image processors.

Writes tests/fixtures/images/: small deterministic JPEG and PNG files, and expected.json with what PIL and
Hugging Face's processors compute from them, which tests/data/image/image_test.cpp and image_processor_test.cpp
compare forge against.

transformers is not installable here (no network, no PyTorch needed), so this script reimplements the
processors' arithmetic with PIL and numpy, following transformers' image_processing_clip.py,
image_processing_siglip.py and image_transforms.py (resize through PIL.Image.resize on the uint8 image,
get_resize_output_image_size with default_to_square=False for a shortest edge, integer center-crop offsets
with zero padding, rescale in float64 then float32, normalize in float32). The images enter the processor
as `Image.open(f).convert("RGB")`, as LLaVA's data loader feeds them.

Every pixel array is stored prediction-coded ("dz": each byte minus the LOCO-I median-edge prediction from
its neighbours, mod 256, then zlib; see dz()): smooth images compress well that way. The processed float values
are stored exactly as the uint8 image after resize and crop plus one 3 x 256 table per config (rescale and
normalize act per value); the script checks that table lookup reproduces its float32 pixel_values bit for
bit before writing.

Usage: /usr/bin/python3 tests/reference/image_twin.py   (Debian python3-pil 9.4 and python3-numpy)
"""

import io
import json
import os
import struct
import sys
import zlib

import numpy as np
import PIL
from PIL import Image

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "fixtures", "images"))

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


# ------------------------------------------------------------------------------------------- fixture images


def pattern(h, w, seed, channels=3):
    """Smooth gradients, a disc, stripes and mild noise: edges for the filters, compressible as a whole."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    planes = []
    for c in range(channels):
        fx, fy = rng.uniform(0.5, 3.0, 2)
        p = 128 + 90 * np.sin(fx * 2 * np.pi * x / w + c) * np.cos(fy * 2 * np.pi * y / h)
        disc = (x - w * rng.uniform(0.3, 0.7)) ** 2 + (y - h * rng.uniform(0.3, 0.7)) ** 2 < (min(h, w) / 4) ** 2
        p = np.where(disc, 255 - p, p)
        p = np.where((x.astype(int) // 4) % 5 == c, 20.0, p)  # sharp stripes
        planes.append(np.clip(np.round(p), 0, 255).astype(np.uint8))
    return np.stack(planes, axis=-1)


def png_chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_raw_png(path, w, h, bit_depth, color_type, rows, interlaced=False):
    """A PNG with exact control over the sample format (PIL cannot write 16-bit RGB nor Adam7 interlacing).
    `rows` are the unfiltered scanlines' bytes; interlaced needs 8-bit samples."""
    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 1 if interlaced else 0)
    if not interlaced:
        raw = b"".join(b"\x00" + r for r in rows)
    else:
        px = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(h, w, -1)
        raw = b""
        for x0, y0, dx, dy in [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]:
            sub = px[y0::dy, x0::dx]
            if sub.size:
                raw += b"".join(b"\x00" + r.tobytes() for r in sub)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(raw, 9))
                + png_chunk(b"IEND", b""))


def make_images():
    """Returns the fixture file names (supported images first) and writes them."""
    names = []

    def save(name, im, **kw):
        im.save(os.path.join(OUT, name), **kw)
        names.append(name)

    save("rgb_37x23.png", Image.fromarray(pattern(23, 37, 1)))
    rgba = pattern(181, 300, 2, channels=4)
    rgba[..., 3] = np.linspace(0, 255, 300).astype(np.uint8)[None, :]  # alpha from 0 to 255: dropped
    save("rgba_300x181.png", Image.fromarray(rgba, "RGBA"))
    save("gray_48x64.png", Image.fromarray(pattern(64, 48, 3, channels=1)[..., 0], "L"))
    la = pattern(31, 20, 4, channels=2)
    save("gray_alpha_20x31.png", Image.fromarray(la, "LA"))
    inter = pattern(29, 45, 17)
    write_raw_png(os.path.join(OUT, "rgb_interlaced_45x29.png"), 45, 29, 8, 2, [r.tobytes() for r in inter], interlaced=True)
    names.append("rgb_interlaced_45x29.png")
    pal = Image.fromarray(pattern(40, 50, 5)).quantize(colors=200, method=Image.Quantize.MEDIANCUT)
    pal.info["transparency"] = 3
    save("palette_50x40.png", pal, transparency=3)
    pal4 = Image.fromarray(pattern(17, 33, 6)).quantize(colors=12, method=Image.Quantize.MEDIANCUT)
    save("palette_4bit_33x17.png", pal4, bits=4)
    save("bilevel_29x13.png", Image.fromarray(pattern(13, 29, 7, channels=1)[..., 0] > 128))
    rgb16 = pattern(18, 24, 8).astype(np.uint16) * 257 + np.random.RandomState(9).randint(0, 256, (18, 24, 3)).astype(np.uint16)
    write_raw_png(os.path.join(OUT, "rgb16_24x18.png"), 24, 18, 16, 2, [r.astype(">u2").tobytes() for r in rgb16])
    names.append("rgb16_24x18.png")
    big = pattern(240, 320, 10)
    save("rgb_420_320x240.jpg", Image.fromarray(big), quality=90, subsampling=2)  # 4:2:0
    save("rgb_444_61x47.jpg", Image.fromarray(pattern(47, 61, 11)), quality=95, subsampling=0)
    save("rgb_420_odd_37x23.jpg", Image.fromarray(pattern(23, 37, 12)), quality=85, subsampling=2)
    save("rgb_422_progressive_123x77.jpg", Image.fromarray(pattern(77, 123, 13)), quality=80, subsampling=1,
         progressive=True)
    save("gray_90x70.jpg", Image.fromarray(pattern(70, 90, 14, channels=1)[..., 0], "L"), quality=90)
    # Refused on purpose: 16-bit grayscale PNG and CMYK JPEG.
    g16 = (pattern(9, 11, 15, channels=1)[..., 0].astype(np.uint16) * 257)
    write_raw_png(os.path.join(OUT, "refused_gray16_11x9.png"), 11, 9, 16, 0, [r.astype(">u2").tobytes() for r in g16])
    Image.fromarray(pattern(10, 12, 16, channels=4), "CMYK").save(os.path.join(OUT, "refused_cmyk_12x10.jpg"), quality=90)
    return names


# -------------------------------------------------------------------------- Hugging Face processor semantics


def get_resize_output_image_size(height, width, size):
    """transformers.image_transforms.get_resize_output_image_size for an int size, default_to_square=False."""
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size, int(size * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def hf_resize(image, size_hw, resample):
    """transformers.image_transforms.resize on a uint8 HWC array: through PIL, back to uint8."""
    h, w = size_hw
    return np.array(Image.fromarray(image).resize((w, h), resample=resample))


def hf_center_crop(image, crop_hw):
    """transformers.image_transforms.center_crop (channels last here), zero padding when too small."""
    orig_h, orig_w = image.shape[:2]
    ch, cw = crop_hw
    top, left = (orig_h - ch) // 2, (orig_w - cw) // 2
    bottom, right = top + ch, left + cw
    if top >= 0 and bottom <= orig_h and left >= 0 and right <= orig_w:
        return image[top:bottom, left:right]
    new_h, new_w = max(ch, orig_h), max(cw, orig_w)
    padded = np.zeros((new_h, new_w) + image.shape[2:], dtype=image.dtype)
    top_pad, left_pad = -(-(new_h - orig_h) // 2), -(-(new_w - orig_w) // 2)  # ceil
    padded[top_pad:top_pad + orig_h, left_pad:left_pad + orig_w] = image
    top, bottom, left, right = top + top_pad, bottom + top_pad, left + left_pad, right + left_pad
    return padded[max(0, top):min(new_h, bottom), max(0, left):min(new_w, right)]


def hf_rescale(image, scale):
    return (image.astype(np.float64) * scale).astype(np.float32)


def hf_normalize(image, mean, std):
    if not np.issubdtype(image.dtype, np.floating):
        image = image.astype(np.float32)
    mean = np.array(mean if isinstance(mean, list) else [mean] * 3, dtype=image.dtype)
    std = np.array(std if isinstance(std, list) else [std] * 3, dtype=image.dtype)
    return (image - mean) / std


class Processor:
    """CLIPImageProcessor / SiglipImageProcessor.preprocess for one RGB PIL image, in their order."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.kind = cfg["image_processor_type"]

    def uint8_stage(self, image):
        """Resize and center crop: the part that stays uint8."""
        cfg = self.cfg
        arr = np.array(image)
        if cfg.get("do_resize", True):
            size = cfg["size"]
            if "shortest_edge" in size:
                out = get_resize_output_image_size(arr.shape[0], arr.shape[1], size["shortest_edge"])
            else:
                out = (size["height"], size["width"])
            arr = hf_resize(arr, out, cfg.get("resample", 3))
        if self.kind == "CLIPImageProcessor" and cfg.get("do_center_crop", True):
            crop = cfg["crop_size"]
            arr = hf_center_crop(arr, (crop["height"], crop["width"]))
        return arr

    def float_stage(self, arr):
        cfg = self.cfg
        if cfg.get("do_rescale", True):
            arr = hf_rescale(arr, cfg.get("rescale_factor", 1 / 255))
        if cfg.get("do_normalize", True):
            arr = hf_normalize(arr, cfg["image_mean"], cfg["image_std"])
        return arr.astype(np.float32).transpose(2, 0, 1)  # channels first; float32 even when nothing ran

    def table(self):
        values = np.tile(np.arange(256, dtype=np.uint8)[:, None, None], (1, 1, 3))  # 256 x 1 x 3
        return self.float_stage(values)[:, :, 0]  # 3 x 256


CONFIGS = {
    # As Hugging Face writes them (openai/clip-vit-large-patch14 style, google/siglip-base-patch16-224 style).
    "clip": {
        "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "feature_extractor_type": "CLIPFeatureExtractor",
        "image_mean": OPENAI_CLIP_MEAN, "image_processor_type": "CLIPImageProcessor", "image_std": OPENAI_CLIP_STD,
        "processor_class": "CLIPProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": 224},
    },
    "siglip": {
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "SiglipImageProcessor", "image_std": [0.5, 0.5, 0.5], "processor_class": "SiglipProcessor",
        "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"height": 224, "width": 224},
    },
    # Small extra cases: other filters, non-square crops, padding, no resize.
    "clip_bilinear_small": {
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 20}, "crop_size": {"height": 16, "width": 18},
        "resample": 2, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
    },
    "clip_pad_bicubic": {
        "image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 11}, "crop_size": {"height": 25, "width": 14},
        "resample": 3, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.9, 1.1, 0.7], "rescale_factor": 0.0039,
    },
    "clip_no_resize_unnormalized": {
        "image_processor_type": "CLIPImageProcessor", "do_resize": False, "crop_size": {"height": 21, "width": 36},
        "do_normalize": False, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
    },
    "siglip_nearest_small": {
        "image_processor_type": "SiglipImageProcessor", "size": {"height": 19, "width": 27}, "resample": 0,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    },
    "siglip_bilinear_rescale_only": {
        "image_processor_type": "SiglipImageProcessor", "size": {"height": 31, "width": 13}, "resample": 2,
        "do_normalize": False, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    },
}


def with_defaults(cfg):
    """Hugging Face's constructor defaults for keys a config leaves out."""
    full = dict(cfg)
    if cfg["image_processor_type"] == "CLIPImageProcessor":
        full.setdefault("size", {"shortest_edge": 224})
        full.setdefault("crop_size", {"height": 224, "width": 224})
    else:
        full.setdefault("size", {"height": 224, "width": 224})
    full.setdefault("image_mean", OPENAI_CLIP_MEAN if cfg["image_processor_type"] == "CLIPImageProcessor" else [0.5] * 3)
    full.setdefault("image_std", OPENAI_CLIP_STD if cfg["image_processor_type"] == "CLIPImageProcessor" else [0.5] * 3)
    return full


# ------------------------------------------------------------------------------------------------- writing


def dz(arr):
    """Prediction-coded zlib of a uint8 H x W x C array: each byte minus the median-edge (LOCO-I) prediction
    from the same channel of its left (a), upper (b) and upper-left (c) neighbours, 0 outside the image:
    min(a, b) if c >= max(a, b), max(a, b) if c <= min(a, b), else a + b - c; mod 256."""
    a = arr.astype(np.int16)
    left, up, upleft = np.zeros_like(a), np.zeros_like(a), np.zeros_like(a)
    left[:, 1:], up[1:], upleft[1:, 1:] = a[:, :-1], a[:-1], a[:-1, :-1]
    hi, lo = np.maximum(left, up), np.minimum(left, up)
    pred = np.where(upleft >= hi, lo, np.where(upleft <= lo, hi, left + up - upleft))
    return zlib.compress(((a - pred) % 256).astype(np.uint8).tobytes(), 9)


def put(name, arr):
    with open(os.path.join(OUT, "data", name), "wb") as f:
        f.write(dz(arr))
    return "data/" + name


def f32_list(values):
    return [float(v) for v in np.asarray(values, dtype=np.float32)]


def main():
    os.makedirs(os.path.join(OUT, "data"), exist_ok=True)
    for old in os.listdir(os.path.join(OUT, "data")):
        os.remove(os.path.join(OUT, "data", old))
    names = make_images()
    manifest = {"generator": f"tests/reference/image_twin.py, Pillow {PIL.__version__}, numpy {np.__version__}",
                "encoding": "dz: each byte minus its LOCO-I (median edge) prediction in its channel, mod 256, then zlib",
                "images": [], "configs": {}, "cases": [], "resizes": []}
    decoded = {}
    for name in names:
        with Image.open(os.path.join(OUT, name)) as im:
            mode = im.mode
            rgb = im.convert("RGB")
        arr = np.array(rgb)
        decoded[name] = rgb
        manifest["images"].append({"file": name, "pil_mode": mode, "height": arr.shape[0], "width": arr.shape[1],
                                   "rgb": put(name + ".rgb.dz", arr)})

    for cname, cfg in CONFIGS.items():
        path = f"{cname}.preprocessor_config.json"
        with open(os.path.join(OUT, path), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        proc = Processor(with_defaults(cfg))
        table = proc.table()
        manifest["configs"][cname] = {"file": path, "table": [f32_list(table[c]) for c in range(3)]}
        for name in names:
            u8 = proc.uint8_stage(decoded[name])
            expected = proc.float_stage(u8)  # the full float32 computation
            via_table = np.stack([table[c][u8[..., c]] for c in range(3)])
            assert expected.dtype == np.float32 and np.array_equal(expected.view(np.uint32), via_table.view(np.uint32)), (cname, name)
            manifest["cases"].append({"image": name, "config": cname, "height": u8.shape[0], "width": u8.shape[1],
                                      "uint8": put(f"{name}.{cname}.dz", u8)})

    # Resizes on their own, every implemented filter, up and down, one side kept, extreme ratios.
    sizes = [(1, 1), (5, 3), (23, 37), (23, 50), (40, 37), (61, 97), (7, 300), (300, 2)]
    for name in ["rgb_37x23.png", "rgb_420_320x240.jpg"]:
        src = decoded[name]
        # The large image: shrinking by large and fractional factors, one side kept.
        chosen = [(1, 1), (5, 3), (7, 300), (300, 2), (17, 320), (60, 80), (91, 137)] if src.size == (320, 240) else sizes
        for resample in (0, 2, 3):
            for h, w in chosen:
                out = np.array(src.resize((w, h), resample=resample))
                manifest["resizes"].append({"image": name, "resample": resample, "height": h, "width": w,
                                            "rgb": put(f"{name}.resize{resample}_{h}x{w}.dz", out)})

    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(OUT) for fn in fns)
    print(f"wrote {len(names)} images, {len(manifest['cases'])} processed cases, {len(manifest['resizes'])} resizes "
          f"to {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    sys.exit(main())
