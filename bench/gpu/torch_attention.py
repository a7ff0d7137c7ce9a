#!/usr/bin/env python3
"""PyTorch peer of forge_gpubench_attention (bench/gpu/run_all.sh): causal grouped-query attention at the same
LLaMA-3-8B shapes (32 heads, 8 kv heads, head_dim 128; batch 1 and 2 at 4096 tokens, batch 1 at 8192) through
torch.nn.functional.scaled_dot_product_attention in bf16, which picks PyTorch's fastest fused kernel (flash or
cuDNN attention on Hopper). Its operands are already bf16 in [batch, heads, seq, dim], so unlike forge's op
it does no staging from fp32: the comparison favours the peer.

Timing as forge's bench: CUDA events around `--batch` back-to-back calls, the median of `--samples` samples,
forward 4 b h s^2 d / 2 FLOPs (causal), backward 2.5x that (the backward alone: the forward's graph is kept
and its gradient taken again). Writes the same JSON fields as forge's bench, with "engine": "pytorch"."""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = [(1, 4096, 32, 8, 128), (2, 4096, 32, 8, 128), (1, 8192, 32, 8, 128)]
PEAK_TFLOPS = 989.0  # dense bf16, H100 / H200 SXM


# Two ways to hand PyTorch grouped-query heads; the faster one is the peer (its name is in the JSON): "gqa"
# passes the kv heads as they are (enable_gqa, 2.5 and later, which not every fused backend takes), "repeat"
# expands them to the query heads first (every backend takes it; the expansion and, in backward, the sum over
# the copies count in its time).
def attend(q, k, v, rep, variant):
    if variant == "gqa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          is_causal=True)


def median_ms(fn, samples, warmup, calls):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write JSON lines here")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=5, help="calls per sample")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_attention.py: this PyTorch sees no GPU; nothing measured")
        return
    device = torch.cuda.get_device_name()
    print(f"pytorch {torch.__version__} scaled_dot_product_attention on {device}: causal GQA, bf16, "
          f"median of {a.samples} samples of {a.batch} calls")
    print(f"{'pass':<9} {'batch':>5} {'seq':>6} {'heads':>5} {'kv_heads':>8} {'dim':>5}  {'ms':>10} {'TFLOP/s':>8} "
          f"{'peak':>6}")
    out = open(a.json, "w") if a.json else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, s, h, kvh, d in SHAPES:
        def rand(heads):
            return torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, k, v = rand(h).requires_grad_(), rand(kvh).requires_grad_(), rand(kvh).requires_grad_()
        dout = rand(h)
        best = {}  # pass -> (ms, variant)
        for variant in ("gqa", "repeat"):
            try:
                with torch.no_grad():
                    fwd = median_ms(lambda: attend(q, k, v, h // kvh, variant), a.samples, a.warmup, a.batch)
                o = attend(q, k, v, h // kvh, variant)
                bwd = median_ms(lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True), a.samples,
                                a.warmup, a.batch)
                del o
            except (TypeError, RuntimeError) as e:  # enable_gqa unknown (before 2.5) or refused
                print(f"b{b} s{s} {variant}: not measured ({str(e).splitlines()[0][:100]})")
                continue
            for name, ms in (("forward", fwd), ("backward", bwd)):
                if name not in best or ms < best[name][0]:
                    best[name] = (ms, variant)
        flops = 4 * b * h * s * s * d / 2
        for name, f in (("forward", flops), ("backward", 2.5 * flops)):
            if name not in best:
                continue
            ms, variant = best[name]
            tflops = f / (ms * 1e-3) / 1e12
            print(f"{name:<9} {b:>5} {s:>6} {h:>5} {kvh:>8} {d:>5}  {ms:>10.3f} {tflops:>8.1f} "
                  f"{100 * tflops / PEAK_TFLOPS:>5.1f}%  ({variant})", flush=True)
            if out:
                out.write(json.dumps({"bench": "attention", "engine": "pytorch", "pass": name, "causal": True,
                                      "batch": b, "seq": s, "heads": h, "kv_heads": kvh, "head_dim": d, "ms": ms,
                                      "tflops": tflops, "peak_tflops": PEAK_TFLOPS,
                                      "peak_fraction": tflops / PEAK_TFLOPS, "samples": a.samples,
                                      "calls_per_sample": a.batch, "variant": variant, "device": device,
                                      "torch": torch.__version__}) + "\n")
        del q, k, v, dout
    if out:
        out.close()


if __name__ == "__main__":
    main()
