#!/usr/bin/env python3
"""PyTorch peer of `forge bench --model`: trains the same LLaMA (Hugging Face Llama semantics) on random
tokens and prints tokens/s. On the CPU with Debian's python3-torch: /usr/bin/python3 bench/torch_llama.py
CONFIG; on a GPU (bench/gpu/run_all.sh) with --device cuda.

fp32, or bf16 autocast (PyTorch's usual mixed precision: fp32 master weights, bf16 matmuls). Attention is
PyTorch's fused scaled_dot_product_attention where it exists (2.0 and later: flash attention on GPUs),
written out otherwise (1.13). On a GPU AdamW is the fused (multi-tensor) one, and MFU is printed against the
H100/H200 dense bf16 peak (989 TFLOP/s), with the same FLOP count as forge (LlamaConfig::flops_per_token)."""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(q, k, v, mask, rep):
    """Causal grouped-query attention, [b, heads, t, hd] each (k, v with heads / rep heads). The kv heads are
    expanded to the query heads first: every fused backend takes that (enable_gqa is not taken by all), and
    the copies cost little beside the attention itself."""
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


class Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim", h // self.nh)
        f = c["intermediate_size"]
        L = torch.nn.Linear
        self.q, self.k, self.v = L(h, self.nh * self.hd, bias=False), L(h, self.nkv * self.hd, bias=False), L(h, self.nkv * self.hd, bias=False)
        self.o = L(self.nh * self.hd, h, bias=False)
        self.gate, self.up, self.down = L(h, f, bias=False), L(h, f, bias=False), L(f, h, bias=False)
        self.n1, self.n2 = RMSNorm(h, c["rms_norm_eps"]), RMSNorm(h, c["rms_norm_eps"])

    def forward(self, x, cos, sin, mask):
        b, t, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        a = attend(q, k, v, mask, self.nh // self.nkv)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(torch.nn.Module):
    def __init__(self, c, seq):
        super().__init__()
        self.embed = torch.nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.head = torch.nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        inv = 1.0 / (c.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())
        fused_attention = hasattr(F, "scaled_dot_product_attention")
        self.register_buffer("mask", None if fused_attention else torch.full((seq, seq), float("-inf")).triu(1))
        # Hugging Face Llama's initialisation, as forge's: every matrix N(0, initializer_range), norms ones.
        # (PyTorch's layer defaults, N(0, 1) embeddings among them, train at another pace on the same data.)
        std = c.get("initializer_range", 0.02)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                    module.weight.normal_(0.0, std)

    def forward(self, ids, targets):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def flops_per_token(c, seq):
    h, f, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    hd = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    matmul = L * (h * q + 2 * h * kv + q * h + 3 * h * f) + V * h
    return 6 * matmul + 12 * L * seq * q


PEAK_BF16_TFLOPS = 989.0  # H100 / H200 SXM, dense (forge's train/peak.h)


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
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gpu = a.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("torch_llama.py: --device cuda, but this PyTorch sees no GPU")
    c = json.load(open(a.config))
    torch.manual_seed(0)
    if gpu:
        with torch.device("cuda"):  # initialised where it lives: no host copy of a billion-parameter model
            model = Llama(c, a.seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    else:
        model = Llama(c, a.seq)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if a.grad_accum < 1:
        raise SystemExit("torch_llama.py: --grad-accum must be at least 1")
    ids = torch.randint(0, c["vocab_size"], (a.grad_accum, a.batch, a.seq + 1), device=a.device)
    micro = [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in ids]

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in micro:
            with torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                loss = model(x, y) / a.grad_accum
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(total)  # waits for the step (a device's queue drains here, as forge's loss copy does)

    losses = [step() for _ in range(a.warmup)]  # every step's loss, warm-up included, as forge bench lists them
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses += [step() for _ in range(a.steps)]
    dt = (time.perf_counter() - t0) / a.steps
    tps = a.grad_accum * a.batch * a.seq / dt
    gflops = tps * flops_per_token(c, a.seq) / 1e9
    where = f"{torch.get_num_threads()} threads"
    result = {"engine": "pytorch", "device": a.device, "dtype": a.dtype, "batch": a.batch,
              "grad_accum": a.grad_accum, "seq": a.seq,
              "tokens_per_s": tps, "model_gflops": gflops}
    if gpu:
        where = torch.cuda.get_device_name()
        result["mfu"] = gflops / 1e3 / PEAK_BF16_TFLOPS
        result["peak_device_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result["losses"] = losses
    print(f"pytorch {torch.__version__} {a.dtype}: {tps:.0f} tokens/s | {gflops:.1f} model GFLOP/s | "
          f"{dt:.3f} s/step | loss {losses[-1]:.3f} | {where}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
