#!/usr/bin/env python3
"""PyTorch peer of `forge bench --model` for DeepSeek-V3 configs: trains the same DeepseekV3ForCausalLM
(Hugging Face semantics, plus DeepSeek's multi-token prediction and sequence-wise balance loss) on random
tokens and prints tokens/s and MFU. On the CPU with Debian's python3-torch:
    /usr/bin/python3 bench/torch_deepseek_v3.py CONFIG --threads N
on a GPU with --device cuda. Same CLI shape, FLOP count (DeepseekV3Config::flops_per_token) and JSON fields
as bench/torch_llama.py.

The model, as a PyTorch user would write it (no per-token loops):
- MLA: q_a_proj -> q_a_layernorm -> q_b_proj (plain q_proj when q_lora_rank is null); kv_a_proj_with_mqa ->
  kv_a_layernorm -> kv_b_proj; one decoupled rope key shared by the heads; HF's rope_interleave gather;
  softmax scale qk_head_dim^-0.5 (times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN); fused
  scaled_dot_product_attention where PyTorch has it (2.0 and later; it takes v_head_dim != qk_head_dim),
  written out otherwise (1.13).
- Dense SwiGLU for the first first_k_dense_replace layers, DeepSeekMoE after them: fp32 sigmoid router (autocast
  off), e_score_correction_bias for the selection only, group-limited top-k (a group's score: the sum of its two
  best biased scores; HF fills dropped groups with 0), weights from the unbiased scores (normalised with +1e-20
  when norm_topk_prob) times routed_scaling_factor, shared experts of n_shared_experts * moe_intermediate_size.
  Routed experts: the (token, expert) pairs sorted by expert, each expert's SwiGLU run on its contiguous slice
  (a loop over experts), the weighted rows scattered back with index_add_.
- Loss: main + 0.3 / D * sum_k L_k (MTP depth k: enorm(embed(ids[:, k:])) | hnorm(h) -> eh_proj -> one decoder
  layer -> shared_head.norm -> lm_head, predicting targets[:, k:]) + the sequence-wise balance loss
  alpha * sum_i f_i P_i (alpha 1e-4, DeepSeek-V3's; --balance-coeff) of every MoE layer, averaged over the
  sequences. The routers' biases stay 0 (a bench has no bias update), as in forge bench.

The JSON line's "losses" are the main cross-entropy (what forge bench reports); "total_losses" add MTP and
balance. MFU is printed against --peak-gflops when given, else on a GPU against the H100/H200 dense bf16 peak.
bench/check_torch_deepseek_v3.py checks this model against tests/reference/deepseek_v3_twin.py (losses and
gradients in fp32 on the twin's weights)."""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

PEAK_BF16_TFLOPS = 989.0  # H100 / H200 SXM, dense (forge's train/peak.h)
MTP_WEIGHT = 0.3
LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: HF builds them with RMSNorm's default eps
TORCH_2_1 = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 1)


# ---- The config, as forge's DeepseekV3Config::from_json reads it.

class Cfg:
    def __init__(self, c):
        self.h, self.ffn, self.moe_ffn = c["hidden_size"], c["intermediate_size"], c["moe_intermediate_size"]
        self.layers, self.heads = c["num_hidden_layers"], c["num_attention_heads"]
        if c.get("num_key_value_heads") not in (None, self.heads):
            raise SystemExit("torch_deepseek_v3.py: MLA has no grouped-query attention (num_key_value_heads)")
        if "q_lora_rank" not in c:
            raise SystemExit("torch_deepseek_v3.py: missing key 'q_lora_rank' (null for a plain q_proj)")
        self.q_lora = c["q_lora_rank"] or 0
        self.kv_lora, self.nope, self.rope = c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        self.vd, self.qk = c["v_head_dim"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        self.experts, self.shared, self.topk = c["n_routed_experts"], c["n_shared_experts"], c["num_experts_per_tok"]
        self.groups, self.topk_group = c.get("n_group", 1), c.get("topk_group", 1)
        self.scaling = c["routed_scaling_factor"]
        self.norm_topk = c.get("norm_topk_prob", True)
        self.scoring = c.get("scoring_func", "sigmoid")
        if self.scoring not in ("sigmoid", "softmax"):
            raise SystemExit(f"torch_deepseek_v3.py: scoring_func {self.scoring!r} (sigmoid or softmax)")
        if c.get("topk_method", "noaux_tc") not in ("noaux_tc", "greedy"):
            raise SystemExit("torch_deepseek_v3.py: topk_method must be noaux_tc or greedy")
        if c.get("moe_layer_freq", 1) != 1:
            raise SystemExit("torch_deepseek_v3.py: moe_layer_freq must be 1")
        self.first_dense = c["first_k_dense_replace"]
        self.mtp = c.get("num_nextn_predict_layers", 0) or 0
        self.vocab, self.eps = c["vocab_size"], c.get("rms_norm_eps", 1e-6)
        self.tied = c.get("tie_word_embeddings", False)
        self.interleave = c.get("rope_interleave", True)
        max_pos = c.get("max_position_embeddings", 4096)
        self.theta, scaling = c.get("rope_theta"), c.get("rope_scaling")
        if c.get("rope_parameters") is not None:  # transformers v5: theta and scaling in one object
            scaling = c["rope_parameters"]
            self.theta = scaling.get("rope_theta")
        self.theta = 10000.0 if self.theta is None else float(self.theta)
        self.yarn = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "yarn":
                self.yarn = dict(factor=float(scaling["factor"]),
                                 original=scaling.get("original_max_position_embeddings", max_pos),
                                 beta_fast=scaling.get("beta_fast", 32.0), beta_slow=scaling.get("beta_slow", 1.0),
                                 mscale=scaling.get("mscale", 0.0) or 0.0,
                                 mscale_all_dim=scaling.get("mscale_all_dim", 0.0) or 0.0,
                                 attention_factor=scaling.get("attention_factor", 0.0) or 0.0,
                                 truncate=scaling.get("truncate", True))
            elif kind != "default":
                raise SystemExit(f"torch_deepseek_v3.py: rope type {kind!r} (yarn or default)")

    def is_moe(self, layer):  # layer index 0 .. layers + mtp - 1; MTP depth k is layers + k - 1
        return layer >= self.first_dense

    # RoPE (HF's default and yarn rope_init_fn, as DeepseekV3Config::rope_inv_freq), softmax scale.
    def inv_freq(self):
        d = self.rope
        f = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        y = self.yarn
        if y is None:
            return f

        def correction_dim(rotations):
            return d * math.log(y["original"] / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(y["beta_fast"]), correction_dim(y["beta_slow"])
        if y["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0.0), min(high, d - 1.0)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        return f / y["factor"] * ramp + f * (1 - ramp)

    def attention_factor(self):
        y = self.yarn
        if y is None:
            return 1.0
        if y["attention_factor"]:
            return y["attention_factor"]
        if y["mscale"] and y["mscale_all_dim"]:
            return yarn_mscale(y["factor"], y["mscale"]) / yarn_mscale(y["factor"], y["mscale_all_dim"])
        return yarn_mscale(y["factor"])

    def softmax_scale(self):
        scale = self.qk ** -0.5
        if self.yarn is not None and self.yarn["mscale_all_dim"]:
            m = yarn_mscale(self.yarn["factor"], self.yarn["mscale_all_dim"])
            scale *= m * m
        return scale

    # Counts, as DeepseekV3Config's.
    def attention_parameters(self):
        h, n = self.h, self.heads
        q = h * self.q_lora + self.q_lora + self.q_lora * n * self.qk if self.q_lora else h * n * self.qk
        kv = h * (self.kv_lora + self.rope) + self.kv_lora + self.kv_lora * n * (self.nope + self.vd)
        return q + kv + n * self.vd * self.h + 2 * h

    def layer_parameters(self, i, experts):
        h = self.h
        mlp = (self.experts * h + 3 * h * self.moe_ffn * (experts + self.shared)) if self.is_moe(i) else 3 * h * self.ffn
        return self.attention_parameters() + mlp

    def parameters(self, activated=False):
        h, k = self.h, (self.topk if activated else self.experts)
        total = self.vocab * h * (1 if self.tied else 2) + h
        total += sum(self.layer_parameters(i, k) for i in range(self.layers))
        total += sum(3 * h + 2 * h * h + self.layer_parameters(self.layers + d, k) for d in range(self.mtp))
        return total

    def flops_per_token(self, seq):
        """DeepseekV3Config::flops_per_token: 6 x the matmul multiply-adds of a token (the activated experts,
        the routers, the MTP modules' eh_proj and heads) + the attention scores, not halved for the mask."""
        h, n = float(self.h), float(self.heads)
        q = h * self.q_lora + self.q_lora * n * self.qk if self.q_lora else h * n * self.qk
        attention = q + h * (self.kv_lora + self.rope) + self.kv_lora * n * (self.nope + self.vd) + n * self.vd * h
        moe_active = self.experts * h + 3.0 * h * self.moe_ffn * (self.topk + self.shared)
        dense = 3.0 * h * self.ffn
        head = float(self.vocab) * h
        matmul = head
        for i in range(self.layers + self.mtp):
            matmul += attention + (moe_active if self.is_moe(i) else dense)
            if i >= self.layers:
                matmul += 2.0 * h * h + head  # eh_proj and the shared head
        scores = 6.0 * (self.layers + self.mtp) * n * seq * (self.qk + self.vd)
        return 6.0 * matmul + scores


def yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ---- The model.

# The norm and rotation are torch_llama.py's (the same Hugging Face semantics).
from torch_llama import RMSNorm, rotate_half  # noqa: E402


def apply_rope(x, cos, sin, interleave):
    """x [b, heads, t, d]; interleave: HF's gather of the pairs (2i, 2i+1) to (i, i + d/2) first."""
    if interleave:
        b, n, t, d = x.shape
        x = x.view(b, n, t, d // 2, 2).transpose(4, 3).reshape(b, n, t, d)
    return x * cos + rotate_half(x) * sin


class MLA(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        L = torch.nn.Linear
        if c.q_lora:
            self.q_a = L(c.h, c.q_lora, bias=False)
            self.q_a_norm = RMSNorm(c.q_lora, LATENT_NORM_EPS)
            self.q_b = L(c.q_lora, c.heads * c.qk, bias=False)
        else:
            self.q = L(c.h, c.heads * c.qk, bias=False)
        self.kv_a = L(c.h, c.kv_lora + c.rope, bias=False)
        self.kv_a_norm = RMSNorm(c.kv_lora, LATENT_NORM_EPS)
        self.kv_b = L(c.kv_lora, c.heads * (c.nope + c.vd), bias=False)
        self.o = L(c.heads * c.vd, c.h, bias=False)
        self.scale = c.softmax_scale()

    def forward(self, x, cos, sin, mask):
        c = self.c
        b, t, _ = x.shape
        q = self.q_b(self.q_a_norm(self.q_a(x))) if c.q_lora else self.q(x)
        q = q.view(b, t, c.heads, c.qk).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [c.nope, c.rope], dim=-1)
        k_latent, k_rot = torch.split(self.kv_a(x), [c.kv_lora, c.rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(k_latent)).view(b, t, c.heads, c.nope + c.vd).transpose(1, 2)
        k_pass, v = torch.split(kv, [c.nope, c.vd], dim=-1)
        q_rot = apply_rope(q_rot, cos, sin, c.interleave)
        k_rot = apply_rope(k_rot.view(b, 1, t, c.rope), cos, sin, c.interleave)  # one key for every head
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(b, c.heads, t, c.rope)), dim=-1)
        if hasattr(F, "scaled_dot_product_attention"):
            if TORCH_2_1:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:  # 2.0: no scale argument; its default is qk^-0.5
                a = F.scaled_dot_product_attention(q * (self.scale * math.sqrt(c.qk)), k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-1, -2)) * self.scale + mask[:t, :t]
            a = torch.softmax(s.float(), dim=-1).to(v.dtype) @ v
        return self.o(a.transpose(1, 2).reshape(b, t, c.heads * c.vd))


class SwiGLU(torch.nn.Module):
    def __init__(self, h, f):
        super().__init__()
        L = torch.nn.Linear
        self.gate, self.up, self.down = L(h, f, bias=False), L(h, f, bias=False), L(f, h, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoE(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.router = torch.nn.Parameter(torch.empty(c.experts, c.h))
        torch.nn.init.kaiming_uniform_(self.router, a=math.sqrt(5))  # nn.Linear's
        self.register_buffer("bias", torch.zeros(c.experts))  # e_score_correction_bias (no gradient)
        self.experts = torch.nn.ModuleList(SwiGLU(c.h, c.moe_ffn) for _ in range(c.experts))
        self.shared = SwiGLU(c.h, c.moe_ffn * c.shared) if c.shared else None

    def route(self, x):
        """x [n, h] -> scores [n, E] fp32, chosen experts [n, K], their weights [n, K] fp32."""
        c = self.c
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router)
        scores = logits.sigmoid() if c.scoring == "sigmoid" else logits.softmax(dim=-1)
        choice = scores.detach() + self.bias
        if c.topk_group < c.groups:
            per = c.experts // c.groups
            group_scores = choice.view(-1, c.groups, per).topk(2, dim=-1)[0].sum(dim=-1)
            keep = group_scores.topk(c.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), 0.0)
        topk = choice.topk(c.topk, dim=-1, sorted=False)[1]
        weights = scores.gather(1, topk)
        if c.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, topk, weights * c.scaling

    def forward(self, x, alpha):
        """x [b, t, h] -> (output [b, t, h], this layer's sequence-wise balance loss)."""
        c = self.c
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        scores, topk, weights = self.route(flat)
        # The (token, expert) pairs sorted by expert: each expert's rows are one contiguous slice.
        experts = topk.reshape(-1)
        order = experts.argsort()
        token = torch.div(order, c.topk, rounding_mode="floor")
        counts = torch.bincount(experts, minlength=c.experts).tolist()
        rows = flat[token]
        outs, start = [], 0
        for e, count in enumerate(counts):
            if count:
                outs.append(self.experts[e](rows[start:start + count]))
                start += count
        y = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(flat.shape[0], h, dtype=y.dtype, device=x.device).index_add_(0, token, y)
        if self.shared is not None:
            out = out + self.shared(flat)
        # Sequence-wise balance: alpha * sum_i f_i P_i per sequence, averaged over the sequences.
        load = torch.zeros(b, c.experts, device=x.device).scatter_add_(
            1, topk.view(b, -1), torch.ones(b, t * c.topk, device=x.device))
        f = load * (c.experts / (c.topk * t))
        p = (scores / scores.sum(dim=-1, keepdim=True)).view(b, t, -1).mean(dim=1)
        balance = alpha * (f * p).sum(dim=-1).mean()
        return out.view(b, t, h), balance  # fp32 (the weights are): the residual stream's dtype


class Layer(torch.nn.Module):
    def __init__(self, c, index):
        super().__init__()
        self.attn = MLA(c)
        self.n1, self.n2 = RMSNorm(c.h, c.eps), RMSNorm(c.h, c.eps)
        self.moe = c.is_moe(index)
        self.mlp = MoE(c) if self.moe else SwiGLU(c.h, c.ffn)

    def forward(self, x, cos, sin, mask, alpha):
        x = x + self.attn(self.n1(x), cos, sin, mask)
        if self.moe:
            y, balance = self.mlp(self.n2(x), alpha)
            return x + y, balance
        return x + self.mlp(self.n2(x)), None


class MTPModule(torch.nn.Module):
    def __init__(self, c, index):
        super().__init__()
        self.enorm, self.hnorm = RMSNorm(c.h, c.eps), RMSNorm(c.h, c.eps)
        self.eh_proj = torch.nn.Linear(2 * c.h, c.h, bias=False)
        self.layer = Layer(c, index)
        self.norm = RMSNorm(c.h, c.eps)  # shared_head.norm; the head is the main lm_head


class DeepseekV3(torch.nn.Module):
    def __init__(self, c, seq, alpha):
        super().__init__()
        self.c, self.alpha = c, alpha
        self.embed = torch.nn.Embedding(c.vocab, c.h)
        if c.tied:  # N(0, 1) rows as the head would start the loss far above ln(vocab); forge's init std
            torch.nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = torch.nn.ModuleList(Layer(c, i) for i in range(c.layers))
        self.norm = RMSNorm(c.h, c.eps)
        self.head = None if c.tied else torch.nn.Linear(c.h, c.vocab, bias=False)
        self.mtp = torch.nn.ModuleList(MTPModule(c, c.layers + k) for k in range(c.mtp))
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), c.inv_freq().float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * c.attention_factor())
        self.register_buffer("sin", emb.sin() * c.attention_factor())
        fused_attention = hasattr(F, "scaled_dot_product_attention")
        self.register_buffer("mask", None if fused_attention else torch.full((seq, seq), float("-inf")).triu(1))

    def logits(self, x, norm):
        return F.linear(norm(x), self.embed.weight if self.head is None else self.head.weight)

    def forward(self, ids, targets):
        """(total, main, [depth losses], balance); ids and targets [b, t]."""
        t = ids.shape[1]
        balances = []

        def run(layer, x, length):
            x, balance = layer(x, self.cos[:length], self.sin[:length], self.mask, self.alpha)
            if balance is not None:
                balances.append(balance)
            return x

        x = self.embed(ids)
        for layer in self.layers:
            x = run(layer, x, t)

        def ce(logits, y):
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

        main = ce(self.logits(x, self.norm), targets)
        depth_losses, hidden = [], x  # h_0: the last layer's output before the final norm
        for k, m in enumerate(self.mtp, start=1):
            length = t - k  # position i takes token t_{i+k} and predicts targets[i + k]
            joined = torch.cat((m.enorm(self.embed(ids[:, k:])), m.hnorm(hidden[:, :length])), dim=-1)
            hidden = run(m.layer, m.eh_proj(joined), length)
            depth_losses.append(ce(self.logits(hidden, m.norm), targets[:, k:]))
        total = main
        if depth_losses:
            total = total + MTP_WEIGHT / len(depth_losses) * sum(depth_losses)
        balance = sum(balances) if balances else torch.zeros((), device=ids.device)
        return total + balance, main, depth_losses, balance


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches of --batch accumulated per step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--peak-gflops", type=float, default=0.0,
                    help="peak for MFU (default: on CUDA the H100/H200 dense bf16 peak, none on the CPU)")
    ap.add_argument("--balance-coeff", type=float, default=1e-4,
                    help="alpha of the sequence-wise balance loss (DeepSeek-V3: 1e-4)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gpu = a.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("torch_deepseek_v3.py: --device cuda, but this PyTorch sees no GPU")
    if a.grad_accum < 1:
        raise SystemExit("torch_deepseek_v3.py: --grad-accum must be at least 1")
    if a.seq <= 0 or a.batch <= 0 or a.steps <= 0:
        raise SystemExit("torch_deepseek_v3.py: --seq, --batch and --steps must be positive")
    c = Cfg(json.load(open(a.config)))
    if c.mtp >= a.seq:
        raise SystemExit(f"torch_deepseek_v3.py: --seq must exceed the MTP depth {c.mtp}")
    torch.manual_seed(0)
    if gpu:
        with torch.device("cuda"):  # initialised where it lives
            model = DeepseekV3(c, a.seq, a.balance_coeff)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    else:
        model = DeepseekV3(c, a.seq, a.balance_coeff)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == c.parameters(), (counted, c.parameters())
    print(f"model: {c.parameters() / 1e6:.2f}M parameters, {c.parameters(activated=True) / 1e6:.2f}M activated "
          f"per token (MTP modules included), {c.flops_per_token(a.seq) / 1e6:.1f} MFLOP/token at seq {a.seq}")
    ids = torch.randint(0, c.vocab, (a.grad_accum, a.batch, a.seq + 1), device=a.device)
    micro = [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in ids]

    def step():
        opt.zero_grad(set_to_none=True)
        total, main_sum, mtp_sum, bal_sum = 0.0, 0.0, 0.0, 0.0
        for x, y in micro:
            with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                loss, main_loss, depth, balance = model(x, y)
                loss = loss / a.grad_accum
            loss.backward()
            total = total + loss.detach()
            main_sum = main_sum + main_loss.detach() / a.grad_accum
            mtp_sum = mtp_sum + (sum(d.detach() for d in depth) / len(depth) if depth else 0.0) / a.grad_accum
            bal_sum = bal_sum + balance.detach() / a.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # float() waits for the step (a device's queue drains here, as forge's loss copy does)
        return float(total), float(main_sum), float(mtp_sum), float(bal_sum)

    for _ in range(a.warmup):
        step()
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    results = [step() for _ in range(a.steps)]
    dt = (time.perf_counter() - t0) / a.steps
    tps = a.grad_accum * a.batch * a.seq / dt
    gflops = tps * c.flops_per_token(a.seq) / 1e9
    peak = a.peak_gflops if a.peak_gflops > 0 else (PEAK_BF16_TFLOPS * 1e3 if gpu else 0.0)
    where = torch.cuda.get_device_name() if gpu else f"{torch.get_num_threads()} threads"
    result = {"engine": "pytorch", "device": a.device, "dtype": a.dtype, "batch": a.batch,
              "grad_accum": a.grad_accum, "seq": a.seq,
              "tokens_per_s": tps, "model_gflops": gflops}
    mfu = ""
    if peak > 0:
        result["peak_gflops"] = peak
        result["mfu"] = gflops / peak
        mfu = f" | MFU {100 * gflops / peak:.1f}% of {peak:.0f} GFLOP/s"
    result["seconds_per_step"] = dt
    if gpu:
        result["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["losses"] = [r[1] for r in results]
    result["total_losses"] = [r[0] for r in results]
    total, main_loss, mtp_loss, balance = results[-1]
    print(f"pytorch {torch.__version__} {a.dtype}: {tps:.0f} tokens/s | {gflops:.1f} model GFLOP/s{mfu} | "
          f"{dt:.3f} s/step | loss {main_loss:.4f} (mtp {mtp_loss:.4f}, balance {balance:.2e}, total {total:.4f}) "
          f"| {where}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
