#!/usr/bin/python3
"""PyTorch twin of Hugging Face DeepseekV3ForCausalLM plus forge's MTP and balancing: writes golden fixtures.

Run from anywhere (Debian's python3-torch; no transformers, no safetensors package needed):

    /usr/bin/python3 tests/reference/deepseek_v3_twin.py           # regenerate every fixture
    /usr/bin/python3 tests/reference/deepseek_v3_twin.py --check   # compare with an independent float64 loop model

For each config below it writes tests/fixtures/<name>.config.json (a Hugging Face config.json) and
tests/fixtures/<name>.safetensors: the initial weights and e_score_correction_bias buffers under their Hugging
Face names, one batch with its logits, MTP logits, losses (main, each MTP depth, balance, total), routing and
gradients, and a 3-step AdamW run with the auxiliary-loss-free bias update. The exact definitions are in
tests/reference/README.md (DeepSeek-V3 section). Everything is fp32, single-threaded and seeded, so re-running
reproduces the files byte for byte (with the same torch build).
"""

import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_twin import ADAMW, FIXTURE_DIR, IGNORE_INDEX, write_safetensors  # noqa: E402

# Loss and balancing constants (also in each file's __metadata__).
MTP_WEIGHT = 0.3  # lambda: total = main + MTP_WEIGHT / D * sum_k L_k + balance
SEQ_AUX_LOSS_COEFF = 0.01  # alpha of the sequence-wise balance loss (DeepSeek-V3 trains with 1e-4)
BIAS_UPDATE_RATE = 0.01  # gamma of the bias update (DeepSeek-V3: 1e-3)
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF builds them with RMSNorm's default eps
ROUTER_INIT_STD = 0.3  # router weights spread the scores so that no two experts come close to a tie
BIAS_INIT_STD = 0.1  # e_score_correction_bias: large enough that biased and unbiased selections differ
MIN_MARGIN = 1e-3  # every routing decision in the fixtures is at least this far from a tie

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=12,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,  # != qk_nope + qk_rope = 12
    n_routed_experts=8,
    num_experts_per_tok=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    rope_interleave=True,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)


def spec(seed, **overrides):
    model = dict(COMMON)
    model.update(overrides)
    return dict(model=model, batch=2, seq=10, seed=seed)


CONFIGS = {
    # (a) q LoRA, one group, one shared expert, no MTP, plain RoPE in the non-interleaved layout, tied.
    "deepseek_v3_tiny": spec(
        2031, q_lora_rank=16, n_group=1, topk_group=1, n_shared_experts=1, num_nextn_predict_layers=0,
        rope_interleave=False, tie_word_embeddings=True),
    # (b) plain q_proj, 4 groups keep 2, YaRN with both mscale paths, two shared experts, MTP depth 1; the
    # layers' eps differs from the latent norms' 1e-6.
    "deepseek_v3_yarn_mtp": spec(
        2033, q_lora_rank=None, n_group=4, topk_group=2, n_shared_experts=2, num_nextn_predict_layers=1,
        rms_norm_eps=1e-5,
        rope_scaling=dict(type="yarn", rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707)),
    # (c) MTP depth 2, no shared experts, untied, interleaved RoPE, unnormalised top-k weights, 2 groups keep 1.
    "deepseek_v3_mtp2": spec(
        2027, q_lora_rank=16, n_group=2, topk_group=1, n_shared_experts=0, num_nextn_predict_layers=2,
        norm_topk_prob=False),
}


def hf_config(model):
    config = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        hidden_act="silu",
        torch_dtype="float32",
        attention_bias=False,
        attention_dropout=0.0,
        num_key_value_heads=model["num_attention_heads"],
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        moe_layer_freq=1,
    )
    config.update(model)
    return config


def is_moe(model, layer):
    return layer >= model["first_k_dense_replace"]


def parameter_shapes(model):
    """Every tensor of the checkpoint in DeepseekV3Config::tensor_shapes order, bias buffers included."""
    h, v, heads = model["hidden_size"], model["vocab_size"], model["num_attention_heads"]
    qk = model["qk_nope_head_dim"] + model["qk_rope_head_dim"]
    kl, r, nope, vd = model["kv_lora_rank"], model["qk_rope_head_dim"], model["qk_nope_head_dim"], model["v_head_dim"]
    experts, mi = model["n_routed_experts"], model["moe_intermediate_size"]
    shapes = [("model.embed_tokens.weight", (v, h))]

    def mlp(p, width):
        shapes.extend([(p + "gate_proj.weight", (width, h)), (p + "up_proj.weight", (width, h)),
                       (p + "down_proj.weight", (h, width))])

    def layer(i, p):
        shapes.append((p + "input_layernorm.weight", (h,)))
        if model["q_lora_rank"]:
            ql = model["q_lora_rank"]
            shapes.extend([(p + "self_attn.q_a_proj.weight", (ql, h)), (p + "self_attn.q_a_layernorm.weight", (ql,)),
                           (p + "self_attn.q_b_proj.weight", (heads * qk, ql))])
        else:
            shapes.append((p + "self_attn.q_proj.weight", (heads * qk, h)))
        shapes.extend([(p + "self_attn.kv_a_proj_with_mqa.weight", (kl + r, h)),
                       (p + "self_attn.kv_a_layernorm.weight", (kl,)),
                       (p + "self_attn.kv_b_proj.weight", (heads * (nope + vd), kl)),
                       (p + "self_attn.o_proj.weight", (h, heads * vd)),
                       (p + "post_attention_layernorm.weight", (h,))])
        if not is_moe(model, i):
            mlp(p + "mlp.", model["intermediate_size"])
            return
        shapes.extend([(p + "mlp.gate.weight", (experts, h)), (p + "mlp.gate.e_score_correction_bias", (experts,))])
        for e in range(experts):
            mlp(p + f"mlp.experts.{e}.", mi)
        if model["n_shared_experts"]:
            mlp(p + "mlp.shared_experts.", mi * model["n_shared_experts"])

    n = model["num_hidden_layers"]
    for i in range(n):
        layer(i, f"model.layers.{i}.")
    shapes.append(("model.norm.weight", (h,)))
    if not model["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (v, h)))
    for k in range(model["num_nextn_predict_layers"]):
        p = f"model.layers.{n + k}."
        shapes.extend([(p + "enorm.weight", (h,)), (p + "hnorm.weight", (h,)), (p + "eh_proj.weight", (h, 2 * h))])
        layer(n + k, p)
        shapes.append((p + "shared_head.norm.weight", (h,)))
    return shapes


def is_bias(name):
    return name.endswith("e_score_correction_bias")


def init_tensors(model, generator):
    """Weights: normal(0, 0.02) matrices, router normal(0, 0.3), norms 1 + 0.1 normal; biases 0.1 normal."""
    params, biases = {}, {}
    for name, shape in parameter_shapes(model):
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if is_bias(name):
            biases[name] = BIAS_INIT_STD * noise
        elif name.endswith("mlp.gate.weight"):
            params[name] = ROUTER_INIT_STD * noise
        else:
            params[name] = (1.0 + 0.1 * noise) if len(shape) == 1 else 0.02 * noise
    return params, biases


# ---- RoPE (HF's default and yarn rope_init_fn), softmax scale.

def yarn_get_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(model):
    """[qk_rope_head_dim / 2] float64: theta^(-2i/d), blended towards theta^(-2i/d) / factor by YaRN's ramp."""
    dim, base = model["qk_rope_head_dim"], model["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = 1.0 / pos_freqs
    y = model["rope_scaling"]
    if y is None:
        return inv_freq
    factor, original = y["factor"], y["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(y["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(y["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(model):
    y = model["rope_scaling"]
    if y is None:
        return 1.0
    if y.get("mscale") and y.get("mscale_all_dim"):
        return yarn_get_mscale(y["factor"], y["mscale"]) / yarn_get_mscale(y["factor"], y["mscale_all_dim"])
    return yarn_get_mscale(y["factor"])


def softmax_scale(model):
    scale = (model["qk_nope_head_dim"] + model["qk_rope_head_dim"]) ** -0.5
    y = model["rope_scaling"]
    if y is not None and y.get("mscale_all_dim"):
        m = yarn_get_mscale(y["factor"], y["mscale_all_dim"])
        scale = scale * m * m
    return scale


def rope_tables(model, seq):
    """cos, sin [T, d] in fp32, as HF: cat(freqs, freqs), times the attention factor."""
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), rope_inv_freq(model).float())
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = rope_attention_factor(model)
    return emb.cos() * factor, emb.sin() * factor


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, cos, sin, interleave):
    """x [B, heads, T, d]. interleave: HF first gathers the pairs (2i, 2i+1) to (i, i + d/2)."""
    if interleave:
        b, h, s, d = x.shape
        x = x.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
    return x * cos + rotate_half(x) * sin


# ---- The model.

def rms_norm(x, weight, eps):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def attention(x, P, p, model, cos, sin):
    batch, seq, _ = x.shape
    heads, nope, r, vd = (model["num_attention_heads"], model["qk_nope_head_dim"], model["qk_rope_head_dim"],
                          model["v_head_dim"])
    kl = model["kv_lora_rank"]
    if model["q_lora_rank"]:
        q_latent = rms_norm(F.linear(x, P[p + "q_a_proj.weight"]), P[p + "q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = F.linear(q_latent, P[p + "q_b_proj.weight"])
    else:
        q = F.linear(x, P[p + "q_proj.weight"])
    q = q.view(batch, seq, heads, nope + r).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, r], dim=-1)
    compressed = F.linear(x, P[p + "kv_a_proj_with_mqa.weight"])
    k_latent, k_rot = torch.split(compressed, [kl, r], dim=-1)
    kv = F.linear(rms_norm(k_latent, P[p + "kv_a_layernorm.weight"], LATENT_NORM_EPS), P[p + "kv_b_proj.weight"])
    kv = kv.view(batch, seq, heads, nope + vd).transpose(1, 2)
    k_pass, value = torch.split(kv, [nope, vd], dim=-1)
    k_rot = k_rot.view(batch, 1, seq, r)  # one rope key shared by every head
    q_rot = apply_rope(q_rot, cos, sin, model["rope_interleave"])
    k_rot = apply_rope(k_rot, cos, sin, model["rope_interleave"]).expand(batch, heads, seq, r)
    query = torch.cat((q_pass, q_rot), dim=-1)
    key = torch.cat((k_pass, k_rot), dim=-1)
    scores = torch.matmul(query, key.transpose(2, 3)) * softmax_scale(model)
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = torch.matmul(probs, value).transpose(1, 2).reshape(batch, seq, heads * vd)
    return F.linear(out, P[p + "o_proj.weight"])


def mlp(x, P, p):
    return F.linear(F.silu(F.linear(x, P[p + "gate_proj.weight"])) * F.linear(x, P[p + "up_proj.weight"]),
                    P[p + "down_proj.weight"])


class RoutingStats:
    """The smallest distance of any routing decision from a tie, over every forward of a fixture."""

    def __init__(self):
        self.min_margin = float("inf")
        self.tokens_changed_by_bias = 0

    def observe(self, margin):
        self.min_margin = min(self.min_margin, margin)


def route(scores, bias, model, stats):
    """HF's DeepseekV3TopkRouter.get_topk_indices on scores [N, E]: returns top-k indices [N, K]."""
    experts, groups, k = model["n_routed_experts"], model["n_group"], model["num_experts_per_tok"]
    choice = scores.detach() + bias.unsqueeze(0)
    group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=model["topk_group"], dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    masked = choice.masked_fill(~score_mask.bool(), 0.0)
    topk = torch.topk(masked, k=k, dim=-1, sorted=False)[1]
    if stats is not None:
        # Margins: the kept groups against the best dropped one, the chosen experts against the best allowed
        # expert left out, and the k-th chosen against 0 (HF fills the dropped groups with 0.0 where DeepSeek's
        # model.py fills -inf: the two agree while every chosen biased score is positive).
        if model["topk_group"] < groups:
            g = group_scores.sort(dim=-1, descending=True)[0]
            stats.observe(float((g[:, model["topk_group"] - 1] - g[:, model["topk_group"]]).min()))
        allowed = choice.masked_fill(~score_mask.bool(), float("-inf")).sort(dim=-1, descending=True)[0]
        if k < allowed.shape[1]:
            nxt = allowed[:, k].clamp(min=0.0)  # -inf (no more allowed experts) and 0.0 fill alike
            stats.observe(float((allowed[:, k - 1] - nxt).min()))
        stats.observe(float(allowed[:, k - 1].min()))
    return topk


def moe(x, P, biases, p, model, stats, record):
    batch, seq, h = x.shape
    flat = x.reshape(-1, h)
    logits = F.linear(flat.float(), P[p + "gate.weight"].float())
    scores = logits.sigmoid()
    bias = biases[p + "gate.e_score_correction_bias"]
    topk = route(scores, bias, model, stats)
    weights = scores.gather(1, topk)
    if model["norm_topk_prob"]:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * model["routed_scaling_factor"]
    combine = torch.zeros_like(scores).scatter(1, topk, weights)  # [N, E], zero where not routed
    out = torch.zeros_like(flat)
    for e in range(model["n_routed_experts"]):
        out = out + combine[:, e:e + 1] * mlp(flat, P, p + f"experts.{e}.")
    if model["n_shared_experts"]:
        out = out + mlp(flat, P, p + "shared_experts.")
    record.append(dict(layer=p, scores=scores.view(batch, seq, -1), topk=topk.view(batch, seq, -1),
                       weights=weights.view(batch, seq, -1),
                       unbiased=torch.topk(scores.detach(), k=model["num_experts_per_tok"], dim=-1)[1]))
    return out.view(batch, seq, h)


def decoder_layer(x, P, biases, layer, model, cos, sin, stats, record):
    p = f"model.layers.{layer}."
    eps = model["rms_norm_eps"]
    x = x + attention(rms_norm(x, P[p + "input_layernorm.weight"], eps), P, p + "self_attn.", model, cos, sin)
    normed = rms_norm(x, P[p + "post_attention_layernorm.weight"], eps)
    if is_moe(model, layer):
        return x + moe(normed, P, biases, p + "mlp.", model, stats, record)
    return x + mlp(normed, P, p + "mlp.")


def head_weight(P, model):
    return P["model.embed_tokens.weight" if model["tie_word_embeddings"] else "lm_head.weight"]


def forward(P, biases, model, input_ids, stats=None):
    """Main logits [B, T, V], MTP logits (depth k: [B, T - k, V]) and the MoE layers' routing."""
    eps, n, seq = model["rms_norm_eps"], model["num_hidden_layers"], input_ids.shape[1]
    cos, sin = rope_tables(model, seq)
    ids = input_ids.long()
    record = []
    x = F.embedding(ids, P["model.embed_tokens.weight"])
    for i in range(n):
        x = decoder_layer(x, P, biases, i, model, cos, sin, stats, record)
    logits = F.linear(rms_norm(x, P["model.norm.weight"], eps), head_weight(P, model))
    mtp_logits = []
    hidden = x  # h_0: the last layer's output before the final norm
    for k in range(1, model["num_nextn_predict_layers"] + 1):
        p = f"model.layers.{n + k - 1}."
        length = seq - k  # position i needs token t_{i+k}
        emb = F.embedding(ids[:, k:], P["model.embed_tokens.weight"])
        joined = torch.cat((rms_norm(emb, P[p + "enorm.weight"], eps),
                            rms_norm(hidden[:, :length], P[p + "hnorm.weight"], eps)), dim=-1)
        hidden = F.linear(joined, P[p + "eh_proj.weight"])
        hidden = decoder_layer(hidden, P, biases, n + k - 1, model, cos[:length], sin[:length], stats, record)
        mtp_logits.append(F.linear(rms_norm(hidden, P[p + "shared_head.norm.weight"], eps), head_weight(P, model)))
    return logits, mtp_logits, record


def mean_ce(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(),
                           ignore_index=IGNORE_INDEX, reduction="mean")


def balance_loss(r, model):
    """alpha * sum_i f_i P_i per sequence, averaged over the sequences, for one MoE layer."""
    scores, topk = r["scores"], r["topk"]  # [B, T, E], [B, T, K]
    batch, seq, experts = scores.shape
    k = topk.shape[-1]
    counts = torch.zeros(batch, experts).scatter_add_(1, topk.reshape(batch, -1),
                                                      torch.ones(batch, seq * k))
    f = counts * (experts / (k * seq))
    prob = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)
    return SEQ_AUX_LOSS_COEFF * (f * prob).sum(dim=-1).mean()


def losses(P, biases, model, input_ids, labels, stats=None):
    logits, mtp_logits, record = forward(P, biases, model, input_ids, stats)
    main = mean_ce(logits, labels)
    mtp = [mean_ce(lg, labels[:, k:]) for k, lg in enumerate(mtp_logits, start=1)]
    layer_balance = [balance_loss(r, model) for r in record]
    balance = sum(layer_balance) if layer_balance else torch.zeros(())
    total = main + balance
    if mtp:
        total = total + MTP_WEIGHT / len(mtp) * sum(mtp)
    return dict(logits=logits, mtp_logits=mtp_logits, record=record, main=main, mtp=mtp,
                layer_balance=layer_balance, balance=balance, total=total)


def loads(record, model):
    """Tokens routed to each expert, per MoE layer, over the whole batch."""
    return {r["layer"]: torch.bincount(r["topk"].reshape(-1), minlength=model["n_routed_experts"]) for r in record}


def update_biases(biases, record, model):
    for layer, load in loads(record, model).items():
        load = load.float()
        name = layer + "gate.e_score_correction_bias"
        biases[name] = biases[name] + BIAS_UPDATE_RATE * torch.sign(load.mean() - load)


def make_batch(model, batch, seq, generator):
    tokens = torch.randint(0, model["vocab_size"], (batch, seq + 1), generator=generator, dtype=torch.int64)
    input_ids = tokens[:, :-1].to(torch.int32).contiguous()
    labels = tokens[:, 1:].to(torch.int32).contiguous()
    ignored = torch.randperm(batch * seq, generator=generator)[:3]
    labels.view(-1)[ignored] = IGNORE_INDEX
    return input_ids, labels


def adamw_run(initial, initial_biases, model, batches, stats):
    names = list(initial)
    params = {n: initial[n].clone().requires_grad_(True) for n in names}
    biases = {n: b.clone() for n, b in initial_biases.items()}
    groups = [
        dict(params=[params[n] for n in names if params[n].dim() >= 2], weight_decay=ADAMW["weight_decay"]),
        dict(params=[params[n] for n in names if params[n].dim() < 2], weight_decay=0.0),
    ]
    optimizer = torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]),
                                  eps=ADAMW["eps"], foreach=False)
    out = dict(losses=[], main_losses=[], grad_norms=[], loads=[])
    for input_ids, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        result = losses(params, biases, model, input_ids, labels, stats)
        result["total"].backward()
        out["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_([params[n] for n in names],
                                                                      ADAMW["max_grad_norm"])))
        out["losses"].append(float(result["total"]))
        out["main_losses"].append(float(result["main"]))
        optimizer.step()
        out["loads"].append(loads(result["record"], model))
        update_biases(biases, result["record"], model)
    out["final"] = {n: params[n].detach().clone() for n in names}
    out["final_biases"] = biases
    return out


def setup(spec):
    model = spec["model"]
    generator = torch.Generator().manual_seed(spec["seed"])
    initial, biases = init_tensors(model, generator)
    input_ids, labels = make_batch(model, spec["batch"], spec["seq"], generator)
    step_batches = [make_batch(model, spec["batch"], spec["seq"], generator) for _ in range(ADAMW["steps"])]
    return model, initial, biases, input_ids, labels, step_batches


def layer_tag(layer_prefix):
    """"model.layers.3.mlp." -> "layer3"."""
    return "layer" + layer_prefix.split(".")[2]


def generate(name, spec):
    model, initial, biases, input_ids, labels, step_batches = setup(spec)
    stats = RoutingStats()
    params = {n: t.clone().requires_grad_(True) for n, t in initial.items()}
    result = losses(params, biases, model, input_ids, labels, stats)
    result["total"].backward()
    changed = sum(int((r["topk"].sort(-1)[0].reshape(-1, r["topk"].shape[-1]) !=
                       r["unbiased"].sort(-1)[0]).any(-1).sum()) for r in result["record"])
    run = adamw_run(initial, biases, model, step_batches, stats)
    assert stats.min_margin > MIN_MARGIN, f"{name}: a routing decision is {stats.min_margin:.2e} from a tie"
    assert changed > 0, f"{name}: the correction biases change no selection"

    names = [n for n, _ in parameter_shapes(model)]  # DeepseekV3Config::tensor_shapes order, biases included
    everything = dict(initial, **biases)
    tensors = [(n, everything[n]) for n in names]
    tensors += [("input_ids", input_ids), ("labels", labels), ("logits", result["logits"].detach())]
    for k, lg in enumerate(result["mtp_logits"], start=1):
        tensors.append((f"mtp{k}.logits", lg.detach()))
    tensors += [("loss.main", result["main"].detach().reshape(1))]
    tensors += [(f"loss.mtp{k}", l.detach().reshape(1)) for k, l in enumerate(result["mtp"], start=1)]
    tensors += [("loss.balance", result["balance"].detach().reshape(1)),
                ("loss.total", result["total"].detach().reshape(1))]
    for r, lb in zip(result["record"], result["layer_balance"]):
        tag = layer_tag(r["layer"])
        order = r["topk"].sort(dim=-1)
        tensors += [(f"loss.balance.{tag}", lb.detach().reshape(1)),
                    (f"route.{tag}.experts", order[0].to(torch.int32).contiguous()),
                    (f"route.{tag}.weights", r["weights"].detach().gather(-1, order[1]).contiguous())]
    tensors += [("rope.inv_freq", rope_inv_freq(model).float()),
                ("rope.attention_factor", torch.tensor([rope_attention_factor(model)], dtype=torch.float32)),
                ("attention.softmax_scale", torch.tensor([softmax_scale(model)], dtype=torch.float32))]
    tensors += [("grad." + n, params[n].grad) for n in initial]
    for s, (step_ids, step_labels) in enumerate(step_batches):
        tensors += [(f"step{s}.input_ids", step_ids), (f"step{s}.labels", step_labels)]
        tensors += [(f"step{s}.load.{layer_tag(layer)}", load.to(torch.int32))
                    for layer, load in run["loads"][s].items()]
    tensors += [("adamw.losses", torch.tensor(run["losses"], dtype=torch.float32)),
                ("adamw.main_losses", torch.tensor(run["main_losses"], dtype=torch.float32)),
                ("adamw.grad_norms", torch.tensor(run["grad_norms"], dtype=torch.float32))]
    final = dict(run["final"], **run["final_biases"])
    tensors += [("final." + n, final[n]) for n in names]

    metadata = {key: repr(value) for key, value in ADAMW.items()}
    metadata.update(
        optimizer="torch.optim.AdamW(foreach=False)",
        weight_decay_applies_to="2-D weights (matrices, embeddings, routers); 1-D norm weights get 0",
        grad_clip="torch.nn.utils.clip_grad_norm_ over every parameter (not the biases): coef = max_grad_norm / "
                  "(norm + 1e-6), applied when < 1",
        loss="total = main + mtp_weight / D * sum_k mtp_k + balance; see tests/reference/README.md",
        mtp_weight=repr(MTP_WEIGHT),
        seq_aux_loss_coeff=repr(SEQ_AUX_LOSS_COEFF),
        bias_update_rate=repr(BIAS_UPDATE_RATE),
        bias_update="after each optimizer step: bias += rate * sign(mean(load) - load), load = tokens per expert "
                    "of that step's batch",
        latent_norm_eps=repr(LATENT_NORM_EPS),
        min_routing_margin=f"{stats.min_margin:.3e}",
        tokens_changed_by_bias=str(changed),
        ignore_index=str(IGNORE_INDEX),
        seed=str(spec["seed"]),
        generator="tests/reference/deepseek_v3_twin.py",
        torch_version=torch.__version__,
    )
    os.makedirs(FIXTURE_DIR, exist_ok=True)
    base = os.path.join(FIXTURE_DIR, name)
    with open(base + ".config.json", "w") as f:
        json.dump(hf_config(model), f, indent=2, sort_keys=True)
        f.write("\n")
    write_safetensors(base + ".safetensors", tensors, metadata)
    print(f"{name}: total {float(result['total']):.6f} (main {float(result['main']):.6f}, mtp "
          f"{[round(float(l), 6) for l in result['mtp']]}, balance {float(result['balance']):.3e}), adamw "
          f"{[round(x, 6) for x in run['losses']]}, grad norms {[round(x, 4) for x in run['grad_norms']]}, "
          f"min routing margin {stats.min_margin:.2e}, {changed} token-layers changed by the bias, "
          f"{os.path.getsize(base + '.safetensors')} bytes")


# ---- An independent float64 model with explicit loops (per token, per head, per expert), for --check.

def loop_inv_freq(model):
    d, theta, y = model["qk_rope_head_dim"], model["rope_theta"], model["rope_scaling"]
    result = []
    for i in range(d // 2):
        f = theta ** (-2.0 * i / d)
        if y is not None:
            def dim_for(rot):
                return d * math.log(y["original_max_position_embeddings"] / (rot * 2 * math.pi)) / (2 * math.log(theta))
            lo, hi = max(math.floor(dim_for(y["beta_fast"])), 0), min(math.ceil(dim_for(y["beta_slow"])), d - 1)
            if lo == hi:
                hi += 0.001
            ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep the frequency, 1: divide it by factor
            f = f * (1 - ramp) + f / y["factor"] * ramp
        result.append(f)
    return result


def loop_model(w, biases, model, input_ids, labels):
    """Returns logits, MTP logits, main, MTP and balance losses and the chosen experts, all in float64 from
    per-token vectors. RoPE rotates the pairs (2i, 2i+1) in place when interleaved (DeepSeek's complex form)
    and (i, i + d/2) otherwise; routing sorts candidates in Python, dropping disallowed groups outright."""
    heads, nope, r, vd = (model["num_attention_heads"], model["qk_nope_head_dim"], model["qk_rope_head_dim"],
                          model["v_head_dim"])
    kl, n, eps = model["kv_lora_rank"], model["num_hidden_layers"], model["rms_norm_eps"]
    experts, k_top, groups = model["n_routed_experts"], model["num_experts_per_tok"], model["n_group"]
    per_group = experts // groups
    inv_freq, qk, y = loop_inv_freq(model), nope + r, model["rope_scaling"]
    factor, scale = 1.0, qk ** -0.5
    if y is not None:  # cos and sin times mscale(mscale) / mscale(mscale_all_dim); the scores times mscale_all_dim^2
        m, m_all = (0.1 * y["mscale"] * math.log(y["factor"]) + 1), (0.1 * y["mscale_all_dim"] * math.log(y["factor"]) + 1)
        factor, scale = m / m_all, scale * m_all * m_all
    batch, seq = input_ids.shape

    def norm(x, weight, e):
        return weight * x / torch.sqrt((x * x).mean() + e)

    def rope(vec, t):
        pieces = list(vec)
        out = list(vec)
        for i in range(r // 2):
            c, s = math.cos(t * inv_freq[i]) * factor, math.sin(t * inv_freq[i]) * factor
            a, b = (2 * i, 2 * i + 1) if model["rope_interleave"] else (i, i + r // 2)
            out[a] = pieces[a] * c - pieces[b] * s
            out[b] = pieces[b] * c + pieces[a] * s
        return torch.stack(out)

    def ffn(x, p):
        g, u = w[p + "gate_proj.weight"] @ x, w[p + "up_proj.weight"] @ x
        return w[p + "down_proj.weight"] @ (g * torch.sigmoid(g) * u)

    chosen_all, balance_terms = [], []

    def layer(xs, index):
        p = f"model.layers.{index}."
        length = len(xs[0])
        out = [[None] * length for _ in range(batch)]
        for b in range(batch):
            queries, keys, values = [], [], []
            for t in range(length):
                x = norm(xs[b][t], w[p + "input_layernorm.weight"], eps)
                if model["q_lora_rank"]:
                    q = w[p + "self_attn.q_b_proj.weight"] @ norm(w[p + "self_attn.q_a_proj.weight"] @ x,
                                                                  w[p + "self_attn.q_a_layernorm.weight"], 1e-6)
                else:
                    q = w[p + "self_attn.q_proj.weight"] @ x
                c = w[p + "self_attn.kv_a_proj_with_mqa.weight"] @ x
                latent = norm(c[:kl], w[p + "self_attn.kv_a_layernorm.weight"], 1e-6)
                kv = w[p + "self_attn.kv_b_proj.weight"] @ latent
                k_rope = rope(c[kl:], t)
                queries.append([(q[h * qk:h * qk + nope], rope(q[h * qk + nope:(h + 1) * qk], t)) for h in range(heads)])
                keys.append([(kv[h * (nope + vd):h * (nope + vd) + nope], k_rope) for h in range(heads)])
                values.append([kv[h * (nope + vd) + nope:(h + 1) * (nope + vd)] for h in range(heads)])
            for t in range(length):
                head_out = []
                for h in range(heads):
                    qn, qr = queries[t][h]
                    sc = torch.stack([(qn @ keys[s][h][0] + qr @ keys[s][h][1]) * scale for s in range(t + 1)])
                    pr = torch.softmax(sc, dim=0)
                    head_out.append(sum(pr[s] * values[s][h] for s in range(t + 1)))
                out[b][t] = xs[b][t] + w[p + "self_attn.o_proj.weight"] @ torch.cat(head_out)
        if not is_moe(model, index):
            return [[x + ffn(norm(x, w[p + "post_attention_layernorm.weight"], eps), p + "mlp.") for x in row]
                    for row in out]
        bias = biases[p + "mlp.gate.e_score_correction_bias"].tolist()
        chosen_layer, balance = [], 0.0
        for b in range(batch):
            counts, prob = [0] * experts, [0.0] * experts
            for t in range(length):
                x = norm(out[b][t], w[p + "post_attention_layernorm.weight"], eps)
                scores = torch.sigmoid(w[p + "mlp.gate.weight"] @ x)
                biased = [float(scores[e]) + bias[e] for e in range(experts)]
                group_score = [sum(sorted(biased[g * per_group:(g + 1) * per_group], reverse=True)[:2])
                               for g in range(groups)]
                kept = sorted(range(groups), key=lambda g: (-group_score[g], g))[:model["topk_group"]]
                candidates = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
                chosen = sorted(candidates, key=lambda e: (-biased[e], e))[:k_top]
                weights = [scores[e] for e in chosen]
                if model["norm_topk_prob"]:
                    total = sum(weights) + 1e-20
                    weights = [wt / total for wt in weights]
                y_out = sum(wt * model["routed_scaling_factor"] * ffn(x, p + f"mlp.experts.{e}.")
                            for wt, e in zip(weights, chosen))
                if model["n_shared_experts"]:
                    y_out = y_out + ffn(x, p + "mlp.shared_experts.")
                out[b][t] = out[b][t] + y_out
                chosen_layer.append(sorted(chosen))
                for e in chosen:
                    counts[e] += 1
                ssum = scores.sum()
                for e in range(experts):
                    prob[e] = prob[e] + scores[e] / ssum / length
            balance = balance + SEQ_AUX_LOSS_COEFF * sum(experts / (k_top * length) * counts[e] * prob[e]
                                                         for e in range(experts)) / batch
        chosen_all.append(chosen_layer)
        balance_terms.append(balance)
        return out

    def logits_of(xs, norm_name):
        head = w["model.embed_tokens.weight" if model["tie_word_embeddings"] else "lm_head.weight"]
        return torch.stack([torch.stack([head @ norm(x, w[norm_name], eps) for x in row]) for row in xs])

    def ce(lg, lab):
        total, count = 0.0, 0
        for b in range(lg.shape[0]):
            for t in range(lg.shape[1]):
                target = int(lab[b, t])
                if target == IGNORE_INDEX:
                    continue
                total = total + torch.logsumexp(lg[b, t], dim=0) - lg[b, t, target]
                count += 1
        return total / count

    emb = w["model.embed_tokens.weight"]
    xs = [[emb[int(input_ids[b, t])] for t in range(seq)] for b in range(batch)]
    for i in range(n):
        xs = layer(xs, i)
    logits = logits_of(xs, "model.norm.weight")
    main = ce(logits, labels)
    mtp_logits, mtp_losses, hidden = [], [], xs
    for k in range(1, model["num_nextn_predict_layers"] + 1):
        p = f"model.layers.{n + k - 1}."
        length = seq - k
        hidden = [[w[p + "eh_proj.weight"] @ torch.cat((norm(emb[int(input_ids[b, i + k])], w[p + "enorm.weight"], eps),
                                                         norm(hidden[b][i], w[p + "hnorm.weight"], eps)))
                   for i in range(length)] for b in range(batch)]
        hidden = layer(hidden, n + k - 1)
        lg = logits_of(hidden, p + "shared_head.norm.weight")
        mtp_logits.append(lg)
        mtp_losses.append(ce(lg, labels[:, k:]))
    balance = sum(balance_terms) if balance_terms else torch.zeros((), dtype=torch.float64)
    total = main + balance + (MTP_WEIGHT / len(mtp_losses) * sum(mtp_losses) if mtp_losses else 0.0)
    return dict(logits=logits, mtp_logits=mtp_logits, main=main, mtp=mtp_losses, balance=balance, total=total,
                chosen=chosen_all)


def check(name, spec):
    model, initial, biases, input_ids, labels, _ = setup(spec)
    params = {n: t.clone().requires_grad_(True) for n, t in initial.items()}
    twin = losses(params, biases, model, input_ids, labels)
    twin["total"].backward()
    w = {n: t.double().requires_grad_(True) for n, t in initial.items()}
    ref = loop_model(w, {n: b.double() for n, b in biases.items()}, model, input_ids, labels)
    ref["total"].backward()

    routing_equal = len(twin["record"]) == len(ref["chosen"]) and all(
        r["topk"].reshape(-1, r["topk"].shape[-1]).sort(-1)[0].tolist() == chosen
        for r, chosen in zip(twin["record"], ref["chosen"]))
    diffs = dict(logits=float((twin["logits"].double() - ref["logits"]).abs().max()))
    for k, (a, b) in enumerate(zip(twin["mtp_logits"], ref["mtp_logits"]), start=1):
        diffs[f"mtp{k}.logits"] = float((a.double() - b).abs().max())
    diffs["loss.main"] = abs(float(twin["main"]) - float(ref["main"]))
    for k, (a, b) in enumerate(zip(twin["mtp"], ref["mtp"]), start=1):
        diffs[f"loss.mtp{k}"] = abs(float(a) - float(b))
    diffs["loss.balance"] = abs(float(twin["balance"]) - float(ref["balance"]))
    diffs["loss.total"] = abs(float(twin["total"]) - float(ref["total"]))
    grad_rel = 0.0
    for n in initial:
        g_ref = w[n].grad if w[n].grad is not None else torch.zeros_like(w[n])  # an expert no token chose
        scale = float(g_ref.abs().max())
        if scale == 0.0:
            grad_rel = max(grad_rel, float(params[n].grad.abs().max()))
            continue
        grad_rel = max(grad_rel, float((params[n].grad.double() - g_ref).abs().max()) / scale)
    freq_rel = max(abs(a - b) / b for a, b in zip(rope_inv_freq(model).tolist(), loop_inv_freq(model)))
    ok = (routing_equal and all(v < 1e-5 for v in diffs.values()) and grad_rel < 1e-4 and freq_rel < 1e-12)
    print(f"{name}: routing {'equal' if routing_equal else 'DIFFERS'}; max |twin - float64 loop|: "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
          + f"; gradients {grad_rel:.1e} of each tensor's max; inv_freq rel {freq_rel:.1e}: "
          + ("ok" if ok else "MISMATCH"))
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
