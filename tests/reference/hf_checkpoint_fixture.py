#!/usr/bin/python3
"""Writes a small sharded bf16 Hugging Face LlamaForCausalLM folder and the twin's outputs for it.

    /usr/bin/python3 tests/reference/hf_checkpoint_fixture.py

Outputs (committed; the C++ tests in tests/models/pretrained_test.cpp read them):

  tests/fixtures/hf_llama_tiny_bf16/config.json                      Hugging Face config ("torch_dtype": "bfloat16")
  tests/fixtures/hf_llama_tiny_bf16/model-0000{1,2,3}-of-00003.safetensors   BF16 weights in three shards
  tests/fixtures/hf_llama_tiny_bf16/model.safetensors.index.json     {"metadata": {"total_size"}, "weight_map"}
  tests/fixtures/hf_llama_tiny_bf16.golden.safetensors               input_ids, labels, logits, loss (fp32)

The folder looks like what transformers' save_pretrained writes for a bf16 model, including the per-layer
`rotary_emb.inv_freq` buffers (F32) older transformers versions saved, which a loader must tolerate. The
golden logits and loss are computed by llama_twin.py's model in fp32 from the bf16-rounded weights, so a
loader that widens bf16 exactly must reproduce them to fp32 tolerance.
"""

import json
import os
import struct
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_twin  # noqa: E402  (the model code, shared with the other fixtures)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures")
NAME = "hf_llama_tiny_bf16"
SEED = 4321

MODEL = dict(
    vocab_size=48,
    hidden_size=16,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=None,
    tie_word_embeddings=False,
    max_position_embeddings=32,
)
BATCH, SEQ = 2, 10

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int32: "I32"}


def tensor_bytes(tensor):
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def write_safetensors(path, tensors, metadata):
    """u64 header length, JSON header padded with spaces to 8 bytes, the data back to back."""
    header = {"__metadata__": metadata}
    blobs, offset = [], 0
    for name, tensor in tensors:
        blob = tensor_bytes(tensor)
        header[name] = dict(dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape),
                            data_offsets=[offset, offset + len(blob)])
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    return offset


def read_header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    return header, data


def main():
    assert sys.byteorder == "little"
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(SEED)
    weights_fp32 = llama_twin.init_parameters(MODEL, generator)
    input_ids, labels = llama_twin.make_batch(MODEL, BATCH, SEQ, generator)

    # What the checkpoint stores, and the fp32 values a loader must recover from it exactly.
    stored = {name: t.to(torch.bfloat16) for name, t in weights_fp32.items()}
    widened = {name: t.float() for name, t in stored.items()}
    logits = llama_twin.forward(widened, MODEL, input_ids)
    loss = llama_twin.mean_loss(logits, labels)

    inv_freq = llama_twin.rope_inv_freq(MODEL)
    layer = lambda i: sorted(n for n in stored if n.startswith(f"model.layers.{i}."))  # noqa: E731
    shard_names = [f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)]
    shard_tensors = [
        ["model.embed_tokens.weight"] + layer(0),
        layer(1),
        ["lm_head.weight", "model.norm.weight"],
    ]
    folder = os.path.join(FIXTURES, NAME)
    os.makedirs(folder, exist_ok=True)
    for stale in os.listdir(folder):
        os.remove(os.path.join(folder, stale))

    weight_map, total_size = {}, 0
    for k, (file, names) in enumerate(zip(shard_names, shard_tensors)):
        tensors = [(n, stored[n]) for n in names]
        if k < 2:  # the buffer old transformers versions saved with each layer
            tensors.append((f"model.layers.{k}.self_attn.rotary_emb.inv_freq", inv_freq))
        total_size += write_safetensors(os.path.join(folder, file), tensors, {"format": "pt"})
        weight_map.update({n: file for n, _ in tensors})
    assert sorted(n for n in weight_map if "rotary_emb" not in n) == sorted(stored)

    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, f,
                  indent=2)
        f.write("\n")
    config = llama_twin.hf_config(MODEL)
    config.update(torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, initializer_range=0.02,
                  pretraining_tp=1, use_cache=True, attention_dropout=0.0, transformers_version="4.44.0")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")

    golden = os.path.join(FIXTURES, NAME + ".golden.safetensors")
    write_safetensors(golden, [("input_ids", input_ids), ("labels", labels), ("logits", logits.detach()),
                               ("loss", loss.detach().reshape(1))],
                      {"generator": "tests/reference/hf_checkpoint_fixture.py", "seed": str(SEED),
                       "weights": "fp32 widening of the bf16 weights in " + NAME + "/",
                       "loss": "mean cross-entropy over labels != -100; labels already shifted",
                       "torch_version": torch.__version__})

    # Read the shards back: every weight's bits are those of the bf16 tensor, offsets tile the data.
    for file in shard_names:
        header, data = read_header(os.path.join(folder, file))
        for name, entry in sorted((n, e) for n, e in header.items() if n != "__metadata__"):
            begin, stop = entry["data_offsets"]
            if name in stored:
                assert data[begin:stop] == tensor_bytes(stored[name]), name
        end = max(e["data_offsets"][1] for n, e in header.items() if n != "__metadata__")
        assert end == len(data), file
    sizes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"{NAME}: loss {float(loss):.6f}, folder {sizes} bytes, golden {os.path.getsize(golden)} bytes")


if __name__ == "__main__":
    main()
