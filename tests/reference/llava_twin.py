#!/usr/bin/python3
"""PyTorch twin of forge's LLaVA: a vision encoder (CLIP or SigLIP), the projector and a LLaMA, with the image
features spliced into the text where the image tokens are. Writes the golden fixtures the C++ tests compare
against.

    /usr/bin/python3 tests/reference/llava_twin.py     # regenerate every fixture (a few seconds)

The model follows Hugging Face LlavaForConditionalGeneration (transformers 4.4x) semantics, written out in
plain torch so that every step is visible (transformers is not a dependency):

- CLIPVisionModel: patch embedding = a convolution with stride patch_size and no bias; a class token before
  the patches; learned position embeddings (positions 0..patches); `pre_layrnorm`; pre-norm encoder layers
  x + attn(ln1(x)), x + mlp(ln2(x)) with biased q/k/v/out projections, bidirectional softmax attention
  scaled by head_dim^-0.5, and fc2(act(fc1(x))); hidden_states[0] is the pre_layrnorm output and
  hidden_states[i] layer i's. `post_layernorm` only touches the pooled output, which LLaVA never reads.
- SiglipVisionModel: the same encoder layers; the patch convolution has a bias, there is no class token and
  no pre-encoder norm (hidden_states[0] is the embeddings).
- LLaVA: features = hidden_states[vision_feature_layer] (a list: concatenated along channels); under the
  "default" strategy the class token is dropped; projector linear_2(act(linear_1(features))); the text
  embeddings of the image_token_index tokens are replaced by the projected features in order (batch-major, as
  masked_scatter does); then the LLaMA (tests/reference/llama_twin.py's semantics).
- Loss: mean cross-entropy over labels != -100, labels already shifted (forge's convention): image tokens
  and the prompt before each image carry -100.

Everything is fp32, single-threaded and seeded. Each fixture is tests/fixtures/<name>.config.json (a Hugging
Face config.json) and tests/fixtures/<name>.safetensors: the weights under their Hugging Face names, the batch
(pixel_values, input_ids, labels), the logits, the loss, the image features after the projector, and the
gradient of every parameter ("grad.<name>"; a parameter the loss does not reach, such as the encoder's last
layer under vision_feature_layer = -2, has none).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_twin import FIXTURE_DIR, IGNORE_INDEX, write_safetensors  # noqa: E402
from llama_twin import attention as llama_attention, mlp as llama_mlp, rms_norm, rope_inv_freq  # noqa: E402

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
            tie_word_embeddings=False, max_position_embeddings=64)

CONFIGS = {
    # CLIP, as llava-1.5: quick_gelu, the second-to-last layer's patches, a 2-layer GELU projector.
    "llava_clip_tiny": dict(
        vision=dict(model_type="clip_vision_model", hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                    num_attention_heads=3, num_channels=3, image_size=12, patch_size=4, hidden_act="quick_gelu",
                    layer_norm_eps=1e-5),
        llava=dict(image_token_index=5, projector_hidden_act="gelu", vision_feature_layer=-2,
                   vision_feature_select_strategy="default"),
        seed=4321,
    ),
    # SigLIP: gelu_pytorch_tanh, two layers' features concatenated, the class-token-free "full" strategy.
    "llava_siglip_tiny": dict(
        vision=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=36, num_hidden_layers=2,
                    num_attention_heads=2, num_channels=3, image_size=12, patch_size=4,
                    hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False),
        llava=dict(image_token_index=7, projector_hidden_act="gelu", vision_feature_layer=[-1, 1],
                   vision_feature_select_strategy="full"),
        seed=8765,
    ),
}

BATCH, SEQ = 2, 26


def activation(name):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name in ("gelu_pytorch_tanh", "gelu_new"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(name)


def clip(vision):
    return vision["model_type"] == "clip_vision_model"


def patches(vision):
    return (vision["image_size"] // vision["patch_size"]) ** 2


def feature_layers(spec):
    layers = spec["llava"]["vision_feature_layer"]
    return layers if isinstance(layers, list) else [layers]


def tokens_per_image(spec):
    full = spec["llava"]["vision_feature_select_strategy"] == "full"
    return patches(spec["vision"]) + (1 if full and clip(spec["vision"]) else 0)


def parameter_shapes(spec):
    v, t = spec["vision"], TEXT
    h, f, c, p = v["hidden_size"], v["intermediate_size"], v["num_channels"], v["patch_size"]
    pre = "vision_tower.vision_model."
    shapes = []
    if clip(v):
        shapes.append((pre + "embeddings.class_embedding", (h,)))
    shapes.append((pre + "embeddings.patch_embedding.weight", (h, c, p, p)))
    if not clip(v):
        shapes.append((pre + "embeddings.patch_embedding.bias", (h,)))
    shapes.append((pre + "embeddings.position_embedding.weight", (patches(v) + (1 if clip(v) else 0), h)))
    if clip(v):
        shapes += [(pre + "pre_layrnorm.weight", (h,)), (pre + "pre_layrnorm.bias", (h,))]
    for i in range(v["num_hidden_layers"]):
        lp = f"{pre}encoder.layers.{i}."
        shapes += [(lp + "layer_norm1.weight", (h,)), (lp + "layer_norm1.bias", (h,))]
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            shapes += [(lp + f"self_attn.{proj}.weight", (h, h)), (lp + f"self_attn.{proj}.bias", (h,))]
        shapes += [(lp + "layer_norm2.weight", (h,)), (lp + "layer_norm2.bias", (h,)),
                   (lp + "mlp.fc1.weight", (f, h)), (lp + "mlp.fc1.bias", (f,)),
                   (lp + "mlp.fc2.weight", (h, f)), (lp + "mlp.fc2.bias", (h,))]
    shapes += [(pre + "post_layernorm.weight", (h,)), (pre + "post_layernorm.bias", (h,))]
    th = t["hidden_size"]
    shapes += [("multi_modal_projector.linear_1.weight", (th, h * len(feature_layers(spec)))),
               ("multi_modal_projector.linear_1.bias", (th,)),
               ("multi_modal_projector.linear_2.weight", (th, th)),
               ("multi_modal_projector.linear_2.bias", (th,))]
    q_dim, kv_dim = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    inter, vocab = t["intermediate_size"], t["vocab_size"]
    shapes.append(("language_model.model.embed_tokens.weight", (vocab, th)))
    for i in range(t["num_hidden_layers"]):
        lp = f"language_model.model.layers.{i}."
        shapes += [(lp + "input_layernorm.weight", (th,)), (lp + "self_attn.q_proj.weight", (q_dim, th)),
                   (lp + "self_attn.k_proj.weight", (kv_dim, th)), (lp + "self_attn.v_proj.weight", (kv_dim, th)),
                   (lp + "self_attn.o_proj.weight", (th, q_dim)), (lp + "post_attention_layernorm.weight", (th,)),
                   (lp + "mlp.gate_proj.weight", (inter, th)), (lp + "mlp.up_proj.weight", (inter, th)),
                   (lp + "mlp.down_proj.weight", (th, inter))]
    shapes += [("language_model.model.norm.weight", (th,)), ("language_model.lm_head.weight", (vocab, th))]
    return shapes


def init_parameters(spec, generator):
    """Norm weights 1 + 0.1 n; biases and class token 0.1 n (so that each shows in the gradients); matrices
    and embeddings 0.05 n (the tiny encoder's activations stay of order one)."""
    params = {}
    for name, shape in parameter_shapes(spec):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        is_norm = ("norm" in name or "layrnorm" in name) and name.endswith(".weight") and len(shape) == 1
        if is_norm:
            params[name] = 1.0 + 0.1 * noise
        elif len(shape) == 1:
            params[name] = 0.1 * noise
        else:
            params[name] = 0.05 * noise
    return params


def layer_norm(x, params, prefix, eps):
    return F.layer_norm(x, x.shape[-1:], params[prefix + ".weight"], params[prefix + ".bias"], eps)


def encoder(params, vision, pixel_values):
    """hidden_states of the vision model: [embeddings (after pre_layrnorm for CLIP), layer 1, ..., layer L]."""
    pre = "vision_tower.vision_model."
    h, heads, p = vision["hidden_size"], vision["num_attention_heads"], vision["patch_size"]
    eps, act = vision["layer_norm_eps"], activation(vision["hidden_act"])
    bias = None if clip(vision) else params[pre + "embeddings.patch_embedding.bias"]
    x = F.conv2d(pixel_values, params[pre + "embeddings.patch_embedding.weight"], bias, stride=p)
    x = x.flatten(2).transpose(1, 2)  # [images, patches, hidden], patches row-major
    if clip(vision):
        cls = params[pre + "embeddings.class_embedding"].expand(x.shape[0], 1, h)
        x = torch.cat([cls, x], dim=1)
    x = x + params[pre + "embeddings.position_embedding.weight"]
    if clip(vision):
        x = layer_norm(x, params, pre + "pre_layrnorm", eps)
    states = [x]
    n, t = x.shape[0], x.shape[1]
    d = h // heads
    for i in range(vision["num_hidden_layers"]):
        lp = f"{pre}encoder.layers.{i}."
        y = layer_norm(x, params, lp + "layer_norm1", eps)

        def proj(name, z):
            return F.linear(z, params[lp + f"self_attn.{name}.weight"], params[lp + f"self_attn.{name}.bias"])

        q = proj("q_proj", y).view(n, t, heads, d).transpose(1, 2)
        k = proj("k_proj", y).view(n, t, heads, d).transpose(1, 2)
        v = proj("v_proj", y).view(n, t, heads, d).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) * d ** -0.5
        o = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(n, t, h)
        x = x + proj("out_proj", o)
        y = layer_norm(x, params, lp + "layer_norm2", eps)
        y = F.linear(y, params[lp + "mlp.fc1.weight"], params[lp + "mlp.fc1.bias"])
        y = F.linear(act(y), params[lp + "mlp.fc2.weight"], params[lp + "mlp.fc2.bias"])
        x = x + y
        states.append(x)
    return states


def image_features(params, spec, pixel_values):
    states = encoder(params, spec["vision"], pixel_values)
    selected = torch.cat([states[i] for i in feature_layers(spec)], dim=-1)
    if spec["llava"]["vision_feature_select_strategy"] == "default" and clip(spec["vision"]):
        selected = selected[:, 1:]
    act = activation(spec["llava"]["projector_hidden_act"])
    x = F.linear(selected, params["multi_modal_projector.linear_1.weight"],
                 params["multi_modal_projector.linear_1.bias"])
    return F.linear(act(x), params["multi_modal_projector.linear_2.weight"],
                    params["multi_modal_projector.linear_2.bias"])


def forward(params, spec, pixel_values, input_ids):
    """Logits [B, T, V] and the projected image features [images, tokens_per_image, text hidden]."""
    features = image_features(params, spec, pixel_values)
    embeds = F.embedding(input_ids.long(), params["language_model.model.embed_tokens.weight"])
    mask = (input_ids == spec["llava"]["image_token_index"]).unsqueeze(-1).expand_as(embeds)
    assert int(mask[..., 0].sum()) == features.shape[0] * features.shape[1], "image tokens != features"
    x = embeds.masked_scatter(mask, features.reshape(-1).to(embeds.dtype))
    t = TEXT
    freqs = torch.outer(torch.arange(input_ids.shape[1], dtype=torch.float32), rope_inv_freq(t))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    lm = {name[len("language_model."):]: value for name, value in params.items() if name.startswith("language_model.")}
    for i in range(t["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + llama_attention(rms_norm(x, lm[p + "input_layernorm.weight"], t["rms_norm_eps"]), lm,
                                p + "self_attn.", t, cos, sin)
        x = x + llama_mlp(rms_norm(x, lm[p + "post_attention_layernorm.weight"], t["rms_norm_eps"]), lm, p + "mlp.")
    x = rms_norm(x, lm["model.norm.weight"], t["rms_norm_eps"])
    return F.linear(x, lm["lm_head.weight"]), features


def make_batch(spec, generator):
    """Two sequences: [bos, image, caption] and [prompt, image, text, image, text]; the labels are the next
    token except where it is an image token or the prompt before an image (-100), forge's shifted convention."""
    image_token, n = spec["llava"]["image_token_index"], tokens_per_image(spec)
    vocab = TEXT["vocab_size"]

    def text(count):
        out = torch.randint(8, vocab, (count,), generator=generator, dtype=torch.int64)
        return out

    image = torch.full((n,), image_token, dtype=torch.int64)
    first = torch.cat([torch.tensor([1]), image, text(SEQ - 1 - n)])
    second = torch.cat([text(2), image, text(3), image, text(SEQ - 5 - 2 * n)])
    input_ids = torch.stack([first, second])
    assert input_ids.shape == (BATCH, SEQ)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    labels[input_ids.roll(-1, dims=1) == image_token] = IGNORE_INDEX
    labels[0, 0] = IGNORE_INDEX        # the bos before the image
    labels[1, :2] = IGNORE_INDEX       # the prompt of the second sequence
    labels[:, -1] = IGNORE_INDEX
    images = 3
    v = spec["vision"]
    pixel_values = torch.randn((images, v["num_channels"], v["image_size"], v["image_size"]), generator=generator)
    return pixel_values, input_ids.to(torch.int32), labels.to(torch.int32)


def hf_config(spec):
    config = dict(architectures=["LlavaForConditionalGeneration"], model_type="llava", torch_dtype="float32",
                  multimodal_projector_bias=True, vision_config=dict(spec["vision"]),
                  text_config=dict(model_type="llama", **TEXT))
    config.update(spec["llava"])
    return config


def generate(name, spec):
    generator = torch.Generator().manual_seed(spec["seed"])
    initial = init_parameters(spec, generator)
    pixel_values, input_ids, labels = make_batch(spec, generator)
    params = {n: t.clone().requires_grad_(True) for n, t in initial.items()}
    logits, features = forward(params, spec, pixel_values, input_ids)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(),
                           ignore_index=IGNORE_INDEX, reduction="mean")
    loss.backward()
    tensors = list(initial.items())
    tensors += [("pixel_values", pixel_values), ("input_ids", input_ids), ("labels", labels),
                ("logits", logits.detach()), ("loss", loss.detach().reshape(1)), ("image_features", features.detach())]
    unreached = [n for n in initial if params[n].grad is None]
    tensors += [("grad." + n, params[n].grad) for n in initial if params[n].grad is not None]
    metadata = dict(generator="tests/reference/llava_twin.py", torch_version=torch.__version__, seed=str(spec["seed"]),
                    loss="mean cross-entropy over labels != -100; labels already shifted",
                    no_gradient=",".join(unreached))
    base = os.path.join(FIXTURE_DIR, name)
    with open(base + ".config.json", "w") as f:
        json.dump(hf_config(spec), f, indent=2, sort_keys=True)
        f.write("\n")
    write_safetensors(base + ".safetensors", tensors, metadata)
    print(f"{name}: loss {float(loss):.6f}, {features.shape[0]} images x {features.shape[1]} tokens, "
          f"{len(unreached)} parameters without gradient, {os.path.getsize(base + '.safetensors')} bytes")


def main():
    assert sys.byteorder == "little", "safetensors data is little-endian"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    names = sys.argv[1:] or list(CONFIGS)
    for name in names:
        generate(name, CONFIGS[name])


if __name__ == "__main__":
    main()
