#!/usr/bin/env python3
"""PyTorch peer of forge's LLaVA training: the same model (tests/reference/llava_twin.py's plain-torch copy of
Hugging Face LlavaForConditionalGeneration, built from the same config.json), trained with AdamW on random
images and tokens, one image per sequence at its start; prints tokens/s and images/s. bf16 autocast (fp32
master weights, bf16 matmuls) or fp32. CPU, Debian's python3-torch:

    /usr/bin/python3 bench/torch_llava.py configs/llava-tiny.json --batch 32 --seq 96
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
import llava_twin  # noqa: E402

CLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                     num_channels=3, image_size=224, patch_size=32, hidden_act="quick_gelu", layer_norm_eps=1e-5)
SIGLIP_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                       num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                       layer_norm_eps=1e-6)
LLAMA_DEFAULTS = dict(rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                      max_position_embeddings=2048)


def spec_of(config):
    """llava_twin's spec (vision, llava) and TEXT from a config.json, with Hugging Face's defaults."""
    vision = dict(config["vision_config"])
    defaults = CLIP_DEFAULTS if vision.get("model_type", "clip_vision_model") == "clip_vision_model" else SIGLIP_DEFAULTS
    for k, v in defaults.items():
        vision.setdefault(k, v)
    vision.setdefault("model_type", "clip_vision_model")
    text = dict(LLAMA_DEFAULTS)
    text.update({k: v for k, v in config["text_config"].items() if k not in ("model_type", "architectures")})
    text.setdefault("num_key_value_heads", text["num_attention_heads"])
    text.setdefault("head_dim", text["hidden_size"] // text["num_attention_heads"])
    llava = dict(image_token_index=config.get("image_token_index", 32000),
                 projector_hidden_act=config.get("projector_hidden_act", "gelu"),
                 vision_feature_layer=config.get("vision_feature_layer", -2),
                 vision_feature_select_strategy=config.get("vision_feature_select_strategy", "default"))
    return dict(vision=vision, llava=llava), text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=96)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--freeze-vision", action="store_true", help="the encoder does not train (LLaVA's stages)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    spec, text = spec_of(json.load(open(a.config)))
    llava_twin.TEXT = text
    g = torch.Generator().manual_seed(0)
    params = {n: t.requires_grad_(not (a.freeze_vision and n.startswith("vision_tower.")))
              for n, t in llava_twin.init_parameters(spec, g).items()}
    trained = [p for p in params.values() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    v = spec["vision"]
    per_image = llava_twin.tokens_per_image(spec)
    if per_image >= a.seq:
        raise SystemExit(f"torch_llava.py: --seq {a.seq} holds no text after {per_image} image tokens")
    pixels = torch.randn((a.batch, v["num_channels"], v["image_size"], v["image_size"]), generator=g)
    ids = torch.randint(0, min(256, text["vocab_size"]), (a.batch, a.seq), generator=g)
    ids[:, :per_image] = spec["llava"]["image_token_index"]
    labels = torch.full_like(ids, -100)
    labels[:, per_image:-1] = ids[:, per_image + 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            logits, _ = llava_twin.forward(params, spec, pixels, ids)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        return float(loss)

    for _ in range(a.warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    dt = (time.perf_counter() - t0) / a.steps
    result = {"engine": "pytorch", "dtype": a.dtype, "batch": a.batch, "seq": a.seq,
              "tokens_per_s": a.batch * a.seq / dt, "images_per_s": a.batch / dt, "seconds_per_step": dt,
              "loss": loss, "threads": torch.get_num_threads()}
    print(f"pytorch {torch.__version__} {a.dtype}: {result['tokens_per_s']:.0f} tokens/s | "
          f"{result['images_per_s']:.1f} images/s | {dt:.3f} s/step | {torch.get_num_threads()} threads")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
