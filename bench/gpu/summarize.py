#!/usr/bin/env python3
"""Sums up a bench/gpu/run_all.sh run from its JSON lines: the training step per precision (tokens/s, MFU,
FP8 throughput against bf16 and the losses after one optimizer step side by side), where each forge run's step went (its op profile,
by kind of op, and the largest rows of the bf16 run), forge's bf16 step against PyTorch's on the same model, and
forge's attention against PyTorch's scaled_dot_product_attention per shape and pass. Files that are
missing or empty are skipped, so it works on whatever stages ran.

  python3 bench/gpu/summarize.py OUT_DIR"""
import json
import os
import sys


def read(path):
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"{path}: skipped a line that is not JSON: {line[:80]}")
    return rows


def after_one_step(r):
    # `forge bench` repeats one batch of random tokens, which the 8B-shaped model memorises within 3-4 steps (its
    # last losses are all near 0), so recipes compare on the loss after the first optimizer step.
    losses = r["losses"]
    return losses[1] if len(losses) > 1 else losses[0]


def training(rows):
    forge = [r for r in rows if r.get("engine") == "forge"]
    torch = [r for r in rows if r.get("engine") == "pytorch"]
    if not forge and not torch:
        return
    print("training step (LLaMA-3-8B shape, 4 layers; accum = micro-batches per optimizer step):")
    bf16 = {r.get("grad_accum", 1): r for r in forge if r["fp8"] == "off"}
    order = {"off": 0, "delayed": 1, "current": 2, "block": 3}
    for r in sorted(forge, key=lambda r: (r.get("grad_accum", 1), order.get(r["fp8"], 9))):
        accum = r.get("grad_accum", 1)
        name = "bf16" if r["fp8"] == "off" else f"fp8 {r['fp8']}"
        line = (f"  forge {name:<12} accum {accum}  {r['tokens_per_s']:>9.0f} tokens/s  MFU {100 * r['mfu']:5.1f}% "
                f"(of {r['peak_gflops'] / 1e3:.0f} TFLOP/s)  {r['seconds_per_step']:.3f} s/step  "
                f"peak {r['peak_device_gib']:.1f} GiB  loss after step 1 {after_one_step(r):.4f}")
        base = bf16.get(accum)
        if base and r["fp8"] != "off":
            ratio = r["tokens_per_s"] / base["tokens_per_s"]
            rel = (after_one_step(r) - after_one_step(base)) / after_one_step(base)
            line += f"  -> {ratio:.2f}x bf16 throughput, loss {100 * rel:+.2f}% vs bf16"
        print(line)
    for r in torch:
        accum = r.get("grad_accum", 1)
        line = (f"  pytorch {'bf16':<10} accum {accum}  {r['tokens_per_s']:>9.0f} tokens/s  MFU {100 * r.get('mfu', 0):5.1f}%  "
                f"peak {r.get('peak_device_gib', 0):.1f} GiB  loss after step 1 {after_one_step(r):.4f}")
        base = bf16.get(accum)
        if base:
            line += f"  -> forge bf16 is {base['tokens_per_s'] / r['tokens_per_s']:.2f}x PyTorch"
        print(line)


def kind(op):
    if op in ("gemm", "fp8_gemm"):
        return "GEMM"
    if op.startswith("linear_cross_entropy"):
        return "loss head"
    if op.startswith("attention"):
        return "attention"
    if op.startswith("fp8_") or op.startswith("amax"):
        return "FP8 casts"
    if op in ("adamw", "sum_squares", "sum_squares_accumulate", "scale_inplace"):
        return "optimizer"
    if op in ("memset", "copy"):
        return "memset/copy"
    return "other ops"


def profiles(rows):
    runs = [r for r in rows if r.get("engine") == "forge" and "profile" in r]
    if not runs:
        return
    kinds = ["GEMM", "loss head", "attention", "FP8 casts", "optimizer", "memset/copy", "other ops"]
    print("where a step goes (ms per step from one profiled step; unattributed = the GPU idle or in collectives):")
    print("  " + f"{'run':<22}" + "".join(f"{k:>12}" for k in kinds) + f"{'unattrib.':>12}{'wall':>10}")
    for r in runs:
        p = r["profile"]
        by_kind = {k: 0.0 for k in kinds}
        for row in p["rows"]:
            by_kind[kind(row["op"])] += row["seconds"]
        name = ("bf16" if r["fp8"] == "off" else f"fp8 {r['fp8']}") + f" accum {r.get('grad_accum', 1)}"
        print("  " + f"{name:<22}" + "".join(f"{1e3 * by_kind[k]:>12.1f}" for k in kinds) +
              f"{1e3 * max(0.0, p['wall_seconds'] - p['op_seconds']):>12.1f}{1e3 * p['wall_seconds']:>10.1f}")
    # FP8 runs only the transformer layers' Linears; on this 4-layer cut the bf16 loss head holds 38% of the matmul
    # FLOPs, which bounds the step's speed-up. The layers' own ratio (the step minus its loss head) is what a
    # full-depth model, whose head weighs little, would see.
    bf16_runs = {r.get("grad_accum", 1): r for r in runs if r["fp8"] == "off"}
    for r in runs:
        base = bf16_runs.get(r.get("grad_accum", 1))
        if r["fp8"] == "off" or not base:
            continue
        def without_head(p):
            return p["wall_seconds"] - sum(row["seconds"] for row in p["rows"] if kind(row["op"]) == "loss head")
        ratio = without_head(base["profile"]) / without_head(r["profile"])
        print(f"  fp8 {r['fp8']:<8} accum {r.get('grad_accum', 1)}: step without the loss head {ratio:.2f}x bf16's")
    base = max((r for r in runs if r["fp8"] == "off"), key=lambda r: r.get("grad_accum", 1), default=None)
    if base:
        p = base["profile"]
        print(f"  largest rows of bf16 accum {base.get('grad_accum', 1)} (of {len(p['rows'])}):")
        for row in p["rows"][:15]:
            t = row["seconds"]
            rate = f"{row['flops'] / t / 1e12:7.1f} TFLOP/s" if row["flops"] and t else f"{row['bytes'] / t / 1e9:7.0f} GB/s  " if t else ""
            print(f"    {1e3 * t:8.2f} ms  {row['calls']:>4} calls  {rate}  {row['op']:<30} {row['detail']}")


def attention(forge_rows, torch_rows):
    if not forge_rows:
        return
    key = lambda r: (r["pass"], r["batch"], r["seq"])
    peer = {key(r): r for r in torch_rows}
    print("attention (causal GQA, 32/8 heads of 128):")
    for r in forge_rows:
        line = f"  {r['pass']:<8} b{r['batch']} s{r['seq']:<5}  forge {r['tflops']:6.1f} TFLOP/s"
        p = peer.get(key(r))
        if p:
            line += f"  pytorch {p['tflops']:6.1f} TFLOP/s  -> {r['tflops'] / p['tflops']:.2f}x"
        print(line)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    training(read(os.path.join(out, "train.jsonl")))
    profiles(read(os.path.join(out, "train.jsonl")))
    attention(read(os.path.join(out, "attention.jsonl")), read(os.path.join(out, "attention_torch.jsonl")))


if __name__ == "__main__":
    main()
