#!/usr/bin/env python3
"""Checks bench/torch_deepseek_v3.py's model against the correctness twin tests/reference/deepseek_v3_twin.py:
for each of the twin's configs, the twin's initial weights and correction biases are loaded into the bench
model under their Hugging Face names, and the losses (main, each MTP depth, balance, total) and every gradient
are compared in fp32. Run: /usr/bin/python3 bench/check_torch_deepseek_v3.py"""
import os
import re
import sys

import torch

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(root, "tests", "reference"))
sys.path.insert(0, os.path.join(root, "bench"))
import deepseek_v3_twin as twin  # noqa: E402
import torch_deepseek_v3 as bench  # noqa: E402

RENAMES = [("self_attn.q_a_proj.", "attn.q_a."), ("self_attn.q_a_layernorm.", "attn.q_a_norm."),
           ("self_attn.q_b_proj.", "attn.q_b."), ("self_attn.q_proj.", "attn.q."),
           ("self_attn.kv_a_proj_with_mqa.", "attn.kv_a."), ("self_attn.kv_a_layernorm.", "attn.kv_a_norm."),
           ("self_attn.kv_b_proj.", "attn.kv_b."), ("self_attn.o_proj.", "attn.o."),
           ("input_layernorm.", "n1."), ("post_attention_layernorm.", "n2."),
           ("mlp.gate.weight", "mlp.router"), ("mlp.gate.e_score_correction_bias", "mlp.bias"),
           ("mlp.shared_experts.", "mlp.shared."), ("gate_proj.", "gate."), ("up_proj.", "up."),
           ("down_proj.", "down.")]


def bench_name(hf, n):
    if hf == "model.embed_tokens.weight":
        return "embed.weight"
    if hf == "model.norm.weight":
        return "norm.weight"
    if hf == "lm_head.weight":
        return "head.weight"
    layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", hf).groups()
    layer = int(layer)
    if layer >= n:
        prefix = f"mtp.{layer - n}."
        if rest in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
            return prefix + rest
        if rest == "shared_head.norm.weight":
            return prefix + "norm.weight"
        prefix += "layer."
    else:
        prefix = f"layers.{layer}."
    for old, new in RENAMES:
        rest = rest.replace(old, new)
    return prefix + rest


def check(name, spec):
    model, initial, biases, input_ids, labels, _ = twin.setup(spec)
    params = {k: t.clone().requires_grad_(True) for k, t in initial.items()}
    ref = twin.losses(params, biases, model, input_ids, labels)
    ref["total"].backward()

    c = bench.Cfg(twin.hf_config(model))
    ours = bench.DeepseekV3(c, input_ids.shape[1], twin.SEQ_AUX_LOSS_COEFF)
    state = ours.state_dict()
    loaded = {bench_name(k, c.layers): v for k, v in dict(initial, **biases).items()}
    missing = set(state) - set(loaded) - {"cos", "sin", "mask"}
    assert not missing and set(loaded) <= set(state), (missing, set(loaded) - set(state))
    ours.load_state_dict(dict(state, **loaded))
    total, main, depth, balance = ours(input_ids.long(), labels.long())
    total.backward()
    named = dict(ours.named_parameters())
    diffs = {"main": abs(float(main - ref["main"])), "balance": abs(float(balance - ref["balance"])),
             "total": abs(float(total - ref["total"]))}
    for k, (a, b) in enumerate(zip(depth, ref["mtp"]), start=1):
        diffs[f"mtp{k}"] = abs(float(a - b))
    grad = 0.0
    for k, p in params.items():
        g_ref = p.grad if p.grad is not None else torch.zeros_like(p)
        g = named[bench_name(k, c.layers)].grad
        g = torch.zeros_like(g_ref) if g is None else g
        scale = max(float(g_ref.abs().max()), 1e-12)
        grad = max(grad, float((g - g_ref).abs().max()) / scale)
    ok = all(v < 1e-5 for v in diffs.values()) and grad < 1e-4 and len(depth) == len(ref["mtp"])
    print(f"{name}: |bench - twin| " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
          + f"; gradients {grad:.1e} of each tensor's max: " + ("ok" if ok else "MISMATCH"))
    return ok


def main():
    torch.set_num_threads(1)
    results = [check(n, s) for n, s in twin.CONFIGS.items()]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
