#!/usr/bin/python3
"""PyTorch twin of forge's Llama: writes the golden fixtures the C++ tests compare against.

Run from anywhere (Debian's python3-torch; no transformers, no safetensors package needed):

    /usr/bin/python3 tests/reference/llama_twin.py           # regenerate every fixture
    /usr/bin/python3 tests/reference/llama_twin.py --check   # compare with an independent float64 loop model

For each config below it writes tests/fixtures/<name>.config.json (a Hugging Face config.json) and
tests/fixtures/<name>.safetensors holding the initial weights under their Hugging Face names, one batch with
its logits, loss and gradients, and a 3-step AdamW run. The model follows Hugging Face LlamaForCausalLM
semantics, written out here in plain torch so every step is visible. Everything is fp32, single-threaded
and seeded, so re-running reproduces the files byte for byte (with the same torch build).
"""

import json
import math
import os
import struct
import sys

import torch
import torch.nn.functional as F

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")
IGNORE_INDEX = -100

# Optimiser hyper-parameters shared by every fixture (also recorded in each file's __metadata__).
ADAMW = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=1.0, steps=3)

CONFIGS = {
    "llama_tiny": dict(
        model=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=88,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=None,
            tie_word_embeddings=False,
            max_position_embeddings=64,
        ),
        batch=2,
        seq=12,  # not a power of two, to catch indexing that assumes one
        seed=1234,
    ),
    "llama_tiny_tied_llama3": dict(
        model=dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=88,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,  # MQA
            head_dim=8,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            # original_max_position_embeddings=8 < seq=16, so the rescaled frequencies change the output.
            rope_scaling=dict(
                rope_type="llama3",
                type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8,
            ),
            tie_word_embeddings=True,
            max_position_embeddings=64,
        ),
        batch=2,
        seq=16,
        seed=5678,
    ),
}


def hf_config(model):
    """The Hugging Face config.json for `model`."""
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        torch_dtype="float32",
        attention_bias=False,
        mlp_bias=False,
    )
    config.update(model)
    return config


def parameter_shapes(model):
    """Every parameter, in a fixed order, with its Hugging Face name and shape ([out, in] for linears)."""
    h, inter, v = model["hidden_size"], model["intermediate_size"], model["vocab_size"]
    q_dim = model["num_attention_heads"] * model["head_dim"]
    kv_dim = model["num_key_value_heads"] * model["head_dim"]
    shapes = [("model.embed_tokens.weight", (v, h))]
    for i in range(model["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q_dim, h)),
            (p + "self_attn.k_proj.weight", (kv_dim, h)),
            (p + "self_attn.v_proj.weight", (kv_dim, h)),
            (p + "self_attn.o_proj.weight", (h, q_dim)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not model["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (v, h)))
    return shapes


def init_parameters(model, generator):
    """normal(0, 0.02) for matrices; 1 + 0.1 * normal for norm weights, so norms matter in gradients."""
    params = {}
    for name, shape in parameter_shapes(model):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        params[name] = (1.0 + 0.1 * noise) if len(shape) == 1 else 0.02 * noise
    return params


def rope_inv_freq(model):
    """inv_freq = theta^(-2i/d), with Hugging Face's llama3 rescaling when configured."""
    dim, theta = model["head_dim"], model["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = model["rope_scaling"]
    if scaling is None:
        return inv_freq
    assert scaling["rope_type"] == "llama3"
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms_norm(x, weight, eps):
    # Hugging Face computes the statistics in fp32 and casts back before the weight multiply.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def attention(x, params, prefix, model, cos, sin):
    batch, seq, _ = x.shape
    heads, kv_heads, d = model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"]
    q = F.linear(x, params[prefix + "q_proj.weight"]).view(batch, seq, heads, d).transpose(1, 2)
    k = F.linear(x, params[prefix + "k_proj.weight"]).view(batch, seq, kv_heads, d).transpose(1, 2)
    v = F.linear(x, params[prefix + "v_proj.weight"]).view(batch, seq, kv_heads, d).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    # GQA: query head h reads kv head h // (heads / kv_heads).
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(d))
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(batch, seq, heads * d)
    return F.linear(out, params[prefix + "o_proj.weight"])


def mlp(x, params, prefix):
    gate = F.linear(x, params[prefix + "gate_proj.weight"])
    up = F.linear(x, params[prefix + "up_proj.weight"])
    return F.linear(F.silu(gate) * up, params[prefix + "down_proj.weight"])


def forward(params, model, input_ids):
    """Logits [B, T, V] of LlamaForCausalLM for `input_ids` [B, T] (positions 0..T-1)."""
    eps = model["rms_norm_eps"]
    seq = input_ids.shape[1]
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), rope_inv_freq(model))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    x = F.embedding(input_ids.long(), params["model.embed_tokens.weight"])
    for i in range(model["num_hidden_layers"]):
        p = f"model.layers.{i}."
        normed = rms_norm(x, params[p + "input_layernorm.weight"], eps)
        x = x + attention(normed, params, p + "self_attn.", model, cos, sin)
        x = x + mlp(rms_norm(x, params[p + "post_attention_layernorm.weight"], eps), params, p + "mlp.")
    x = rms_norm(x, params["model.norm.weight"], eps)
    head = params["model.embed_tokens.weight" if model["tie_word_embeddings"] else "lm_head.weight"]
    return F.linear(x, head)


def mean_loss(logits, labels):
    """Mean cross-entropy over the labels that are not IGNORE_INDEX; labels are already shifted."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(),
                           ignore_index=IGNORE_INDEX, reduction="mean")


def make_batch(model, batch, seq, generator):
    """input_ids and next-token labels [B, T] int32, with a few labels ignored."""
    tokens = torch.randint(0, model["vocab_size"], (batch, seq + 1), generator=generator, dtype=torch.int64)
    input_ids = tokens[:, :-1].to(torch.int32).contiguous()
    labels = tokens[:, 1:].to(torch.int32).contiguous()
    ignored = torch.randperm(batch * seq, generator=generator)[:3]
    labels.view(-1)[ignored] = IGNORE_INDEX
    return input_ids, labels


def adamw_run(initial, model, batches):
    """ADAMW["steps"] steps of torch AdamW with grad-norm clipping.

    Returns the losses, the gradient norms before clipping and the final weights."""
    names = list(initial)
    params = {n: initial[n].clone().requires_grad_(True) for n in names}
    ordered = [params[n] for n in names]
    # Matrices and embeddings decay; norm weights (1-D) do not.
    groups = [
        dict(params=[params[n] for n in names if params[n].dim() >= 2], weight_decay=ADAMW["weight_decay"]),
        dict(params=[params[n] for n in names if params[n].dim() < 2], weight_decay=0.0),
    ]
    optimizer = torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]),
                                  eps=ADAMW["eps"], foreach=False)
    losses, grad_norms = [], []
    for input_ids, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = mean_loss(forward(params, model, input_ids), labels)
        loss.backward()
        # Scales by max_norm / (norm + 1e-6) when that is below 1; returns the norm before clipping.
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(ordered, ADAMW["max_grad_norm"])))
        losses.append(float(loss))
        optimizer.step()
    return losses, grad_norms, {n: params[n].detach().clone() for n in names}


def write_safetensors(path, tensors, metadata):
    """Minimal safetensors writer: u64 header length, JSON header padded to 8 bytes, raw LE data."""
    dtype_names = {torch.float32: "F32", torch.int32: "I32"}
    header = {"__metadata__": metadata}
    offset = 0
    blobs = []
    for name, tensor in tensors:
        # Native byte order; main() checks that it is little-endian.
        blob = tensor.detach().contiguous().numpy().tobytes()
        header[name] = dict(dtype=dtype_names[tensor.dtype], shape=list(tensor.shape),
                            data_offsets=[offset, offset + len(blob)])
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def generate(name, spec):
    model, batch, seq = spec["model"], spec["batch"], spec["seq"]
    generator = torch.Generator().manual_seed(spec["seed"])
    initial = init_parameters(model, generator)
    input_ids, labels = make_batch(model, batch, seq, generator)
    step_batches = [make_batch(model, batch, seq, generator) for _ in range(ADAMW["steps"])]

    params = {n: t.clone().requires_grad_(True) for n, t in initial.items()}
    logits = forward(params, model, input_ids)
    loss = mean_loss(logits, labels)
    loss.backward()

    losses, grad_norms, final = adamw_run(initial, model, step_batches)

    tensors = [(n, t) for n, t in initial.items()]
    tensors += [("input_ids", input_ids), ("labels", labels), ("logits", logits.detach()),
                ("loss", loss.detach().reshape(1)), ("rope.inv_freq", rope_inv_freq(model))]
    tensors += [("grad." + n, params[n].grad) for n in initial]
    for k, (step_ids, step_labels) in enumerate(step_batches):
        tensors += [(f"step{k}.input_ids", step_ids), (f"step{k}.labels", step_labels)]
    tensors += [("adamw.losses", torch.tensor(losses, dtype=torch.float32)),
                ("adamw.grad_norms", torch.tensor(grad_norms, dtype=torch.float32))]
    tensors += [("final." + n, t) for n, t in final.items()]

    metadata = {key: repr(value) for key, value in ADAMW.items()}
    metadata.update(
        optimizer="torch.optim.AdamW(foreach=False)",
        weight_decay_applies_to="2-D weights (matrices, embeddings); 1-D norm weights get 0",
        grad_clip="torch.nn.utils.clip_grad_norm_: coef = max_grad_norm / (norm + 1e-6), applied when < 1",
        loss="mean cross-entropy over labels != -100; labels already shifted",
        ignore_index=str(IGNORE_INDEX),
        seed=str(spec["seed"]),
        generator="tests/reference/llama_twin.py",
        torch_version=torch.__version__,
    )
    os.makedirs(FIXTURE_DIR, exist_ok=True)
    base = os.path.join(FIXTURE_DIR, name)
    with open(base + ".config.json", "w") as f:
        json.dump(hf_config(model), f, indent=2, sort_keys=True)
        f.write("\n")
    write_safetensors(base + ".safetensors", tensors, metadata)
    print(f"{name}: loss {float(loss):.6f}, adamw losses {[round(x, 6) for x in losses]}, "
          f"grad norms {[round(x, 4) for x in grad_norms]}, {os.path.getsize(base + '.safetensors')} bytes")


def loop_inv_freq(model):
    """rope_inv_freq again, one frequency at a time in float64, as the piecewise rule reads."""
    d, theta, scaling = model["head_dim"], model["rope_theta"], model["rope_scaling"]
    result = []
    for i in range(d // 2):
        f = theta ** (-2.0 * i / d)
        if scaling is not None:
            old = scaling["original_max_position_embeddings"]
            low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
            wavelen = 2 * math.pi / f
            if wavelen > old / low:
                f = f / factor
            elif wavelen >= old / high:
                s = (old / wavelen - low) / (high - low)
                f = (1 - s) * f / factor + s * f
        result.append(f)
    return result


def loop_forward(initial, model, input_ids):
    """An independent float64 forward with explicit loops over heads and positions (no repeat_interleave,
    no rotate_half), used by --check to catch slips in the vectorised twin above."""
    w = {n: t.double() for n, t in initial.items()}
    heads, kv_heads, d = model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"]
    eps, half = model["rms_norm_eps"], d // 2
    inv_freq = loop_inv_freq(model)

    def norm(x, weight):
        return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    def rope(vec, t):
        out = vec.clone()
        for i in range(half):
            c, s = math.cos(t * inv_freq[i]), math.sin(t * inv_freq[i])
            out[i] = vec[i] * c - vec[i + half] * s
            out[i + half] = vec[i + half] * c + vec[i] * s
        return out

    batch, seq = input_ids.shape
    x = w["model.embed_tokens.weight"][input_ids.long()]
    for layer in range(model["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        n = norm(x, w[p + "input_layernorm.weight"])
        q, k, v = (n @ w[p + f"self_attn.{m}_proj.weight"].T for m in "qkv")
        attn = torch.zeros(batch, seq, heads * d, dtype=torch.float64)
        for b in range(batch):
            for h in range(heads):
                g = h // (heads // kv_heads)
                keys = [rope(k[b, s, g * d:(g + 1) * d], s) for s in range(seq)]
                for t in range(seq):
                    query = rope(q[b, t, h * d:(h + 1) * d], t)
                    scores = torch.stack([query @ keys[s] for s in range(t + 1)]) / math.sqrt(d)
                    probs = torch.softmax(scores, dim=0)
                    values = [probs[s] * v[b, s, g * d:(g + 1) * d] for s in range(t + 1)]
                    attn[b, t, h * d:(h + 1) * d] = sum(values)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        n = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = n @ w[p + "mlp.gate_proj.weight"].T, n @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = norm(x, w["model.norm.weight"])
    return x @ w["model.embed_tokens.weight" if model["tie_word_embeddings"] else "lm_head.weight"].T


def check(name, spec):
    """Compares the fp32 twin with the float64 loop forward on the fixture's batch."""
    model = spec["model"]
    generator = torch.Generator().manual_seed(spec["seed"])
    initial = init_parameters(model, generator)
    input_ids, labels = make_batch(model, spec["batch"], spec["seq"], generator)
    logits = forward(initial, model, input_ids).double()
    reference = loop_forward(initial, model, input_ids)
    logit_error = float((logits - reference).abs().max())
    loss_error = abs(float(mean_loss(logits, labels)) - float(mean_loss(reference, labels)))
    freq_error = max(abs(a - b) / b for a, b in zip(rope_inv_freq(model).tolist(), loop_inv_freq(model)))
    ok = logit_error < 1e-5 and loss_error < 1e-5 and freq_error < 1e-6
    print(f"{name}: max |logit - float64 loop| {logit_error:.2e}, |loss diff| {loss_error:.2e}, "
          f"inv_freq rel diff {freq_error:.2e}: {'ok' if ok else 'MISMATCH'}")
    return ok


def main():
    assert sys.byteorder == "little", "safetensors data is little-endian"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args = sys.argv[1:]
    if args[:1] == ["--check"]:
        results = [check(name, CONFIGS[name]) for name in (args[1:] or list(CONFIGS))]
        sys.exit(0 if all(results) else 1)
    for name in args or list(CONFIGS):
        generate(name, CONFIGS[name])


if __name__ == "__main__":
    main()
