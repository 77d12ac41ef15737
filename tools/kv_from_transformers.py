"""Write a model's KV for its held-out prompts as vLLM CPU chunks, without vLLM.

    python tools/kv_from_transformers.py MODEL_DIR OUT.safetensors [N_PROMPTS]

Runs the model with ``transformers`` (float32, one thread) on the first N prompts of
``MODEL_DIR/heldout_prompts.json`` (the trained model of ``make model`` has them) and lays
each prompt's K and V out as the connector stores a chunk on vLLM's CPU backend:
``[layers, blocks, kv_heads, block_size, 2 * head_size]`` with K transposed inside each
block and head, then V (block size 128). ``lmcache-core bench codecs --kv OUT`` reads it.
The same numbers as ``--from-engine`` captures (vLLM computes the same float32 KV), for
machines where starting an engine is not an option.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM

from lmcache_core.cli.bench_codecs import save_kv_file

BLOCK = 128


def main(argv: list[str]) -> int:
    path, out = argv[0], argv[1]
    n = int(argv[2]) if len(argv) > 2 else 16
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with open(f"{path}/heldout_prompts.json") as f:
        prompts = [p["token_ids"] for p in json.load(f)["prompts"][:n]]
    cfg = model.config
    D, H, L = cfg.head_dim, cfg.num_key_value_heads, cfg.num_hidden_layers
    chunks = []
    with torch.no_grad():
        for p in prompts:
            cache = model(torch.tensor([p]), use_cache=True).past_key_values
            T = len(p) - len(p) % BLOCK
            B = T // BLOCK
            chunk = torch.empty(L, B, H, BLOCK, 2 * D)
            for layer in range(L):
                k = cache.layers[layer].keys[0, :, :T]  # [H, T, D]
                v = cache.layers[layer].values[0, :, :T]
                flat = chunk[layer].view(B, H, BLOCK * 2 * D)
                flat[..., : BLOCK * D] = (
                    k.reshape(H, B, BLOCK, D).permute(1, 0, 3, 2).reshape(B, H, -1)
                )
                flat[..., BLOCK * D :] = (
                    v.reshape(H, B, BLOCK, D).permute(1, 0, 2, 3).reshape(B, H, -1)
                )
            chunks.append(chunk)
    save_kv_file(out, chunks)
    print(f"{len(chunks)} chunks of {list(chunks[0].shape)} float32 -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
