#!/usr/bin/env python3
"""Golden fixtures for forge's Qwen2 from Hugging Face transformers' own Qwen2ForCausalLM (not a twin).

Regenerate in a virtualenv with torch + transformers (numpy comes with them; the safetensors package is not
needed, the files are written by llama_twin.py's small writer):

    python -m venv /tmp/venv && /tmp/venv/bin/pip install torch transformers
    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/qwen2_golden.py            # every fixture (~4 s)
    OMP_NUM_THREADS=1 /tmp/venv/bin/python tests/reference/qwen2_golden.py --check    # fp32 vs float64 HF run

The committed files were produced with transformers 5.25.0 and torch 2.15.0 (the PyPI +cu132 wheel, run
on the CPU), Python 3.11; the versions are also in each file's __metadata__ (`transformers_version`,
`torch_version`).

For each config below it writes tests/fixtures/<name>.config.json (the architecture keys of
Qwen2Config.to_dict()) and tests/fixtures/<name>.safetensors in exactly the format of llama_twin.py's
fixtures: the initial weights under their Hugging Face names (plus the q/k/v projection biases), one batch
with its logits, loss and gradients, `rope.inv_freq`, and an 8-step AdamW run with gradient clipping (the
families' `adamw_steps`; llama_twin.py's runs take 3) whose procedure and hyper-parameters are
llama_twin.py's (imported from it). Everything is fp32, eager
attention, single-threaded, seeded and deterministic, so re-running reproduces the files byte for byte
with the same torch/transformers build.

`--check` rebuilds each fixture's batch and runs the same HF model in float64, reporting how far the fp32
logits, loss and gradients sit from it.
"""

import json
import os
import sys

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_twin  # noqa: E402  (AdamW settings, batches, loss and the safetensors writer, shared)
from llama_twin import ADAMW, IGNORE_INDEX, make_batch, mean_loss, write_safetensors  # noqa: E402

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
    rope_theta=10000.0,
    tie_word_embeddings=False,
    use_sliding_window=False,
    attention_dropout=0.0,
)

# Seeds: the first small ones whose AdamW run is well conditioned (see the float64 check in generate()).
CONFIGS = {
    "qwen2_tiny": dict(model=dict(COMMON), batch=2, seq=12, seed=2),
    "qwen2_tiny_tied": dict(
        model=dict(COMMON, num_key_value_heads=1, tie_word_embeddings=True),  # MQA, tied head
        batch=2,
        seq=16,
        seed=7,
    ),
}

# The config.json keys written (everything else in Qwen2Config.to_dict() is bookkeeping or generation).
CONFIG_KEYS = [
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "rope_theta", "tie_word_embeddings", "use_sliding_window", "sliding_window", "max_window_layers",
    "attention_dropout",
]

BIAS_STD = 0.1  # q/k/v biases: large enough to move the logits and loss measurably


def hf_config(model):
    return Qwen2Config(architectures=["Qwen2ForCausalLM"], attn_implementation="eager", **model)


def config_json(config):
    """The architecture keys of config.to_dict(), as save_pretrained would write them."""
    full = config.to_dict()
    out = {}
    for key in CONFIG_KEYS:
        if key in full:
            out[key] = full[key]
        elif key == "rope_theta":  # newer transformers keep it inside rope_parameters
            out[key] = full["rope_parameters"]["rope_theta"]
        else:
            raise KeyError(f"Qwen2Config.to_dict() has no {key!r}")
    return out


def build_model(model, dtype=torch.float32):
    config = hf_config(model)
    torch.manual_seed(0)  # transformers' own init draws from the global generator; overwritten below anyway
    net = Qwen2ForCausalLM(config).to(dtype)
    net.eval()  # no dropout anywhere (attention_dropout is 0 in any case)
    assert net.config._attn_implementation == "eager", net.config._attn_implementation
    if model["tie_word_embeddings"]:
        assert net.lm_head.weight is net.model.embed_tokens.weight
    return net


def init_parameters(net, generator):
    """normal(0, 0.02) for matrices, 1 + 0.1 * normal for norm weights (as llama_twin.py), 0.1 * normal
    for the q/k/v biases; drawn in named_parameters() order (tied: no lm_head.weight) from `generator`."""
    params = {}
    for name, p in net.named_parameters():
        noise = torch.randn(tuple(p.shape), generator=generator, dtype=torch.float32)
        if name.endswith(".bias"):
            params[name] = BIAS_STD * noise
        elif p.dim() == 1:
            params[name] = 1.0 + 0.1 * noise
        else:
            params[name] = 0.02 * noise
    return params


def load(net, values):
    named = dict(net.named_parameters())
    assert set(named) == set(values), sorted(set(named) ^ set(values))
    with torch.no_grad():
        for name, value in values.items():
            named[name].copy_(value.to(named[name].dtype))


def logits_of(net, input_ids):
    """Logits [B, T, V]; positions 0..T-1, no padding (no attention mask: causal only)."""
    return net(input_ids=input_ids.long(), use_cache=False).logits


def forward_loss(net, input_ids, labels):
    """Logits and the training loss: the mean cross-entropy, plus, when the config sets output_router_logits
    (Mixtral, Qwen3-MoE), router_aux_loss_coef times the load-balancing loss transformers' model computes
    itself (its aux_loss: load_balancing_loss_func over every layer's router logits), as its own loss adds
    it. Returns (logits, loss, aux_loss or None)."""
    if getattr(net.config, "output_router_logits", False):
        out = net(input_ids=input_ids.long(), use_cache=False, output_router_logits=True)
        return out.logits, mean_loss(out.logits, labels) + net.config.router_aux_loss_coef * out.aux_loss, \
            out.aux_loss
    logits = logits_of(net, input_ids)
    return logits, mean_loss(logits, labels), None


GREEDY_PROMPT, GREEDY_NEW = 8, 16


def greedy_tokens(net, input_ids):
    """Greedy decoding of GREEDY_NEW tokens after the first GREEDY_PROMPT ids of the batch's first row, by
    transformers' model itself: the whole sequence through its forward for every new token, the argmax of
    the last row (no end-of-sequence token). forge generate --greedy (with its KV cache) must print these.

    Not model.generate(): in transformers 5.25 its cached decoding of the MoE fixtures (Mixtral with a
    window, Qwen3-MoE with a dense layer) picks other tokens than the model's own forward on the same
    prefix, by margins of 1e-2 (not rounding); for the dense families the two agree."""
    sequence = input_ids[:1, :GREEDY_PROMPT].long()
    with torch.no_grad():
        for _ in range(GREEDY_NEW):
            last = logits_of(net, sequence)[0, -1]
            sequence = torch.cat([sequence, last.argmax().reshape(1, 1)], dim=1)
    return sequence[0, GREEDY_PROMPT:].to(torch.int32).contiguous()


def adamw_run(initial, model, batches, dtype=torch.float32, family=None):
    """llama_twin.adamw_run on the HF model: torch AdamW (foreach=False), weight decay on 2-D tensors only
    (the biases are 1-D and get none, like the norm weights), clip_grad_norm_ before each step.

    Returns the losses, the gradient norms before clipping and the final weights."""
    net = (family or QWEN2)["build"](model, dtype)
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
        _, loss, _ = forward_loss(net, input_ids, labels)
        loss.backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_(ordered, ADAMW["max_grad_norm"])))
        losses.append(float(loss.detach()))
        optimizer.step()
    return losses, grad_norms, {n: named[n].detach().clone() for n in names}


def first_batch(name, spec, family=None):
    """The seeded initial weights, the first batch and the AdamW batches of fixture `name`."""
    model = spec["model"]
    family = family or QWEN2
    generator = torch.Generator().manual_seed(spec["seed"])
    net = family["build"](model)
    initial = family.get("init_parameters", init_parameters)(net, generator)
    load(net, initial)
    input_ids, labels = make_batch(model, spec["batch"], spec["seq"], generator)
    steps = family.get("adamw_steps", ADAMW["steps"])
    step_batches = [make_batch(model, spec["batch"], spec["seq"], generator) for _ in range(steps)]
    return net, initial, input_ids, labels, step_batches


def generate(name, spec, family=None):
    """Writes fixture `name` of `family` (a dict like QWEN2 below; default Qwen2)."""
    family = family or QWEN2
    model = spec["model"]
    net, initial, input_ids, labels, step_batches = first_batch(name, spec, family)

    logits, loss, aux_loss = forward_loss(net, input_ids, labels)
    greedy = greedy_tokens(net, input_ids)
    loss.backward()
    named = dict(net.named_parameters())
    grads = {n: named[n].grad.detach().clone() for n in initial}
    rotary = net.model.rotary_emb  # Gemma 3 keeps a table per layer type: the full layers' is written
    inv_freq = getattr(rotary, "inv_freq", getattr(rotary, "full_attention_inv_freq", None))
    inv_freq = inv_freq.detach().float().clone()

    losses, grad_norms, final = adamw_run(initial, model, step_batches, family=family)
    assert min(grad_norms) > ADAMW["max_grad_norm"], grad_norms  # clipping acts at every step
    # Adam's first step moves a weight by lr * g / (|g| + eps): a gradient entry of size ~eps = 1e-8 passes
    # its fp32 rounding noise (~1e-10 absolute) straight into the update. The seeds are chosen so that no
    # such entry occurs: the same run in float64 must end within 1e-4 of each tensor's largest weight
    # (the C++ golden test allows 3e-4).
    _, _, final64 = adamw_run(initial, model, step_batches, torch.float64, family)
    fp64_rel = max(float((final[n].double() - final64[n]).abs().max() / final64[n].abs().max()) for n in final)
    assert fp64_rel < 1e-4, f"{name}: final weights {fp64_rel:.2e} from float64; pick another seed"

    # A family whose modules fuse tensors that checkpoints keep apart (transformers 5's MoE experts) maps
    # every weight-shaped dict to the checkpoint's names.
    to_checkpoint = family.get("checkpoint_names", lambda tensors: tensors)
    initial, grads, final = to_checkpoint(initial), to_checkpoint(grads), to_checkpoint(final)
    tensors = [(n, t) for n, t in initial.items()]
    tensors += [("input_ids", input_ids), ("labels", labels), ("logits", logits.detach()),
                ("loss", loss.detach().reshape(1)), ("rope.inv_freq", inv_freq),
                ("greedy.prompt", input_ids[0, :GREEDY_PROMPT].contiguous()), ("greedy.tokens", greedy)]
    if aux_loss is not None:  # the load-balancing loss before its coefficient (loss holds both)
        tensors += [("router_aux_loss", aux_loss.detach().reshape(1))]
    tensors += [("grad." + n, grads[n]) for n in initial]
    for k, (step_ids, step_labels) in enumerate(step_batches):
        tensors += [(f"step{k}.input_ids", step_ids), (f"step{k}.labels", step_labels)]
    tensors += [("adamw.losses", torch.tensor(losses, dtype=torch.float32)),
                ("adamw.grad_norms", torch.tensor(grad_norms, dtype=torch.float32))]
    tensors += [("final." + n, t) for n, t in final.items()]

    metadata = {key: repr(value) for key, value in ADAMW.items()}
    metadata.update(
        optimizer="torch.optim.AdamW(foreach=False)",
        weight_decay_applies_to=family["weight_decay_applies_to"],
        grad_clip="torch.nn.utils.clip_grad_norm_: coef = max_grad_norm / (norm + 1e-6), applied when < 1",
        loss="mean cross-entropy over labels != -100; labels already shifted" +
             (" + router_aux_loss_coef x router_aux_loss (transformers' aux_loss)" if aux_loss is not None else ""),
        ignore_index=str(IGNORE_INDEX),
        seed=str(spec["seed"]),
        init=family["init"],
        final_vs_float64=f"{fp64_rel:.2e}",
        model_class=family["model_class"],
        generator=family["generator"],
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
    )
    os.makedirs(FIXTURE_DIR, exist_ok=True)
    base = os.path.join(FIXTURE_DIR, name)
    with open(base + ".config.json", "w") as f:
        json.dump(family["config_json"](net.config), f, indent=2, sort_keys=True)
        f.write("\n")
    write_safetensors(base + ".safetensors", tensors, metadata)
    print(f"{name}: loss {float(loss.detach()):.6f}, adamw losses {[round(x, 6) for x in losses]}, "
          f"grad norms {[round(x, 4) for x in grad_norms]}, final weights vs float64 {fp64_rel:.1e}, "
          f"{os.path.getsize(base + '.safetensors')} bytes")


def check(name, spec, family=None):
    """The fp32 run against the same HF model in float64 on the fixture's first batch, and how far the
    family's own option moves the float64 logits (it must matter)."""
    family = family or QWEN2
    net, initial, input_ids, labels, _ = first_batch(name, spec, family)
    logits, loss, _ = forward_loss(net, input_ids, labels)
    loss.backward()
    ref = family["build"](spec["model"], torch.float64)
    load(ref, initial)
    ref_logits, ref_loss, _ = forward_loss(ref, input_ids, labels)
    ref_loss.backward()
    logit_error = float((logits.detach().double() - ref_logits.detach()).abs().max())
    loss_error = abs(float(loss.detach()) - float(ref_loss.detach()))
    named, ref_named = dict(net.named_parameters()), dict(ref.named_parameters())
    grad_error = max(float((named[n].grad.double() - ref_named[n].grad).abs().max() /
                           ref_named[n].grad.abs().max()) for n in initial)
    effect = family["option_effect"](spec, initial, input_ids, ref, ref_logits.detach())
    ok = logit_error < 1e-5 and loss_error < 1e-5 and grad_error < 1e-5 and (effect is None or effect > 1e-3)
    moved = "n/a" if effect is None else f"{effect:.2e}"
    print(f"{name}: max |logit - float64| {logit_error:.2e}, |loss diff| {loss_error:.2e}, "
          f"max grad rel diff {grad_error:.2e}, max logit change without {family['option']} {moved}: "
          f"{'ok' if ok else 'MISMATCH'}")
    return ok


def bias_effect(spec, initial, input_ids, ref, ref_logits):
    """Without the biases the logits would differ by this much: they must matter."""
    no_bias = {n: (torch.zeros_like(t) if n.endswith(".bias") else t) for n, t in initial.items()}
    load(ref, no_bias)
    with torch.no_grad():
        return float((logits_of(ref, input_ids) - ref_logits).abs().max())


# What differs between the families that share this procedure (families_golden.py defines Qwen3's and
# Mistral's): the model, the config.json keys, the family's own option for --check, the metadata notes.
QWEN2 = dict(
    build=build_model,
    config_json=config_json,
    option="biases",
    option_effect=bias_effect,
    weight_decay_applies_to="2-D weights (matrices, embeddings); 1-D norm weights and q/k/v biases get 0",
    init="matrices normal(0, 0.02); norm weights 1 + 0.1*normal; q/k/v biases 0.1*normal",
    model_class="transformers.Qwen2ForCausalLM (attn_implementation=eager, float32)",
    generator="tests/reference/qwen2_golden.py",
    adamw_steps=8,
)


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
