#!/usr/bin/env python3
"""Golden fixtures for forge's Qwen3 and Mistral from Hugging Face transformers' own Qwen3ForCausalLM and
MistralForCausalLM (not twins).

    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/families_golden.py           # every fixture
    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/families_golden.py --check   # fp32 vs float64

The procedure, the file format and the AdamW run are qwen2_golden.py's (and so llama_twin.py's), which this
script imports; only the model classes and configs differ. What each family adds shows in its fixtures:

- Qwen3: QK-norm (`self_attn.q_norm.weight`, `k_norm.weight`, an RMSNorm over head_dim applied per head to
  q and k before RoPE; initialised 1 + 0.1 * normal like every 1-D weight), no biases, and a head_dim (12)
  that is not hidden_size / num_attention_heads (8).
- Mistral: `sliding_window` 5 against sequences of 12 and 16 (a query at position i sees keys j with
  i - 5 < j <= i, transformers' masking_utils.sliding_window_overlay), and one config without a window.

`--check` also reports how much the family's own option moves the logits (QK-norm weights set to one,
resp. the window removed): it must matter.
"""

import json
import os
import sys

import torch
import transformers
from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_twin  # noqa: E402
from llama_twin import ADAMW, IGNORE_INDEX, make_batch, mean_loss, write_safetensors  # noqa: E402
from qwen2_golden import init_parameters, load, logits_of  # noqa: E402  (family-independent helpers)

FIXTURE_DIR = llama_twin.FIXTURE_DIR

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=88,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)

FAMILIES = {
    "qwen3": dict(
        config=Qwen3Config,
        model=Qwen3ForCausalLM,
        keys=["attention_bias", "head_dim", "use_sliding_window", "sliding_window", "max_window_layers"],
    ),
    "mistral": dict(config=MistralConfig, model=MistralForCausalLM, keys=["head_dim", "sliding_window"]),
}

# Seeds: the first small ones whose AdamW run is well conditioned (the float64 replay in generate()).
CONFIGS = {
    "qwen3_tiny": dict(family="qwen3", model=dict(COMMON, head_dim=12, rope_theta=10000.0, attention_bias=False,
                                                  use_sliding_window=False), batch=2, seq=12, seed=1),
    "qwen3_tiny_tied": dict(family="qwen3", model=dict(COMMON, head_dim=8, num_key_value_heads=1,
                                                       tie_word_embeddings=True, rope_theta=1e6,
                                                       attention_bias=False, use_sliding_window=False),
                            batch=2, seq=16, seed=1),
    "mistral_tiny_window": dict(family="mistral", model=dict(COMMON, sliding_window=5, rope_theta=10000.0),
                                batch=2, seq=12, seed=3),
    "mistral_tiny": dict(family="mistral", model=dict(COMMON, num_key_value_heads=1, head_dim=12,
                                                      sliding_window=None, rope_theta=1e6), batch=2, seq=16,
                         seed=6),
}

BASE_KEYS = [
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "tie_word_embeddings", "attention_dropout",
]


def family_of(spec):
    return FAMILIES[spec["family"]]


def config_json(config, family):
    """The architecture keys of config.to_dict(), as save_pretrained would write them."""
    full = config.to_dict()
    out = {}
    for key in BASE_KEYS + family["keys"]:
        if key in full:
            out[key] = full[key]
        elif key == "rope_theta":  # transformers 5 keeps it inside rope_parameters
            out[key] = full["rope_parameters"]["rope_theta"]
        else:
            raise KeyError(f"to_dict() has no {key!r}")
    return out


def build_model(spec, dtype=torch.float32, model=None):
    family = family_of(spec)
    model = model if model is not None else spec["model"]
    name = family["model"].__name__
    config = family["config"](architectures=[name], attn_implementation="eager", **model)
    torch.manual_seed(0)  # transformers' own init draws from the global generator; overwritten anyway
    net = family["model"](config).to(dtype)
    net.eval()
    assert net.config._attn_implementation == "eager", net.config._attn_implementation
    if model["tie_word_embeddings"]:
        assert net.lm_head.weight is net.model.embed_tokens.weight
    return net


def adamw_run(initial, spec, batches, dtype=torch.float32):
    """qwen2_golden.adamw_run on this family's model."""
    net = build_model(spec, dtype)
    load(net, initial)
    named = dict(net.named_parameters())
    names = list(initial)
    ordered = [named[n] for n in names]
    groups = [
        dict(params=[named[n] for n in names if named[n].dim() >= 2], weight_decay=ADAMW["weight_decay"]),
        dict(params=[named[n] for n in names if named[n].dim() < 2], weight_decay=0.0),
    ]
    optimizer = torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=(ADAMW["beta1"], ADAMW["beta2"]),
                                  eps=ADAMW["eps"], foreach=False)
    losses, grad_norms = [], []
    for input_ids, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = mean_loss(logits_of(net, input_ids), labels)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(ordered, ADAMW["max_grad_norm"])))
        losses.append(float(loss.detach()))
        optimizer.step()
    return losses, grad_norms, {n: named[n].detach().clone() for n in names}


def first_batch(spec):
    generator = torch.Generator().manual_seed(spec["seed"])
    net = build_model(spec)
    initial = init_parameters(net, generator)
    load(net, initial)
    input_ids, labels = make_batch(spec["model"], spec["batch"], spec["seq"], generator)
    step_batches = [make_batch(spec["model"], spec["batch"], spec["seq"], generator) for _ in range(ADAMW["steps"])]
    return net, initial, input_ids, labels, step_batches


def generate(name, spec):
    net, initial, input_ids, labels, step_batches = first_batch(spec)
    logits = logits_of(net, input_ids)
    loss = mean_loss(logits, labels)
    loss.backward()
    named = dict(net.named_parameters())
    grads = {n: named[n].grad.detach().clone() for n in initial}
    inv_freq = net.model.rotary_emb.inv_freq.detach().float().clone()

    losses, grad_norms, final = adamw_run(initial, spec, step_batches)
    assert min(grad_norms) > ADAMW["max_grad_norm"], grad_norms  # clipping acts at every step
    _, _, final64 = adamw_run(initial, spec, step_batches, torch.float64)
    fp64_rel = max(float((final[n].double() - final64[n]).abs().max() / final64[n].abs().max()) for n in final)
    assert fp64_rel < 1e-4, f"{name}: final weights {fp64_rel:.2e} from float64; pick another seed"

    tensors = [(n, t) for n, t in initial.items()]
    tensors += [("input_ids", input_ids), ("labels", labels), ("logits", logits.detach()),
                ("loss", loss.detach().reshape(1)), ("rope.inv_freq", inv_freq)]
    tensors += [("grad." + n, grads[n]) for n in initial]
    for k, (step_ids, step_labels) in enumerate(step_batches):
        tensors += [(f"step{k}.input_ids", step_ids), (f"step{k}.labels", step_labels)]
    tensors += [("adamw.losses", torch.tensor(losses, dtype=torch.float32)),
                ("adamw.grad_norms", torch.tensor(grad_norms, dtype=torch.float32))]
    tensors += [("final." + n, t) for n, t in final.items()]

    metadata = {key: repr(value) for key, value in ADAMW.items()}
    metadata.update(
        optimizer="torch.optim.AdamW(foreach=False)",
        weight_decay_applies_to="2-D weights (matrices, embeddings); 1-D weights (norms, QK-norms) get 0",
        grad_clip="torch.nn.utils.clip_grad_norm_: coef = max_grad_norm / (norm + 1e-6), applied when < 1",
        loss="mean cross-entropy over labels != -100; labels already shifted",
        ignore_index=str(IGNORE_INDEX),
        seed=str(spec["seed"]),
        init="matrices normal(0, 0.02); 1-D weights 1 + 0.1*normal",
        final_vs_float64=f"{fp64_rel:.2e}",
        model_class=f"transformers.{family_of(spec)['model'].__name__} (attn_implementation=eager, float32)",
        generator="tests/reference/families_golden.py",
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
    )
    base = os.path.join(FIXTURE_DIR, name)
    with open(base + ".config.json", "w") as f:
        json.dump(config_json(net.config, family_of(spec)), f, indent=2, sort_keys=True)
        f.write("\n")
    write_safetensors(base + ".safetensors", tensors, metadata)
    print(f"{name}: loss {float(loss.detach()):.6f}, adamw losses {[round(x, 6) for x in losses]}, "
          f"final weights vs float64 {fp64_rel:.1e}, {os.path.getsize(base + '.safetensors')} bytes")


def option_effect(spec, initial, input_ids, ref_logits):
    """How far the logits move without the family's option (QK-norm weights at one; no window)."""
    if spec["family"] == "qwen3":
        values = {n: (torch.ones_like(t) if "_norm." in n and "self_attn" in n else t) for n, t in initial.items()}
        net = build_model(spec, torch.float64)
    else:
        if spec["model"]["sliding_window"] is None:
            return None  # nothing to remove
        values = initial
        net = build_model(spec, torch.float64, dict(spec["model"], sliding_window=None))
    load(net, values)
    with torch.no_grad():
        return float((logits_of(net, input_ids) - ref_logits).abs().max())


def check(name, spec):
    net, initial, input_ids, labels, _ = first_batch(spec)
    logits = logits_of(net, input_ids)
    loss = mean_loss(logits, labels)
    loss.backward()
    ref = build_model(spec, torch.float64)
    load(ref, initial)
    ref_logits = logits_of(ref, input_ids)
    ref_loss = mean_loss(ref_logits, labels)
    ref_loss.backward()
    logit_error = float((logits.detach().double() - ref_logits.detach()).abs().max())
    loss_error = abs(float(loss.detach()) - float(ref_loss.detach()))
    named, ref_named = dict(net.named_parameters()), dict(ref.named_parameters())
    grad_error = max(float((named[n].grad.double() - ref_named[n].grad).abs().max() /
                           ref_named[n].grad.abs().max()) for n in initial)
    effect = option_effect(spec, initial, input_ids, ref_logits.detach())
    ok = logit_error < 1e-5 and loss_error < 1e-5 and grad_error < 1e-5 and (effect is None or effect > 1e-3)
    moved = "n/a" if effect is None else f"{effect:.2e}"
    print(f"{name}: max |logit - float64| {logit_error:.2e}, |loss diff| {loss_error:.2e}, "
          f"max grad rel diff {grad_error:.2e}, logit change without the option {moved}: "
          f"{'ok' if ok else 'MISMATCH'}")
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
