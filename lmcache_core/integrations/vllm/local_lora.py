"""Small random LoRA adapters for the local Llama models (tests), written without PEFT.

An adapter directory holds what vLLM's LoRA loader reads: ``adapter_config.json`` (rank,
alpha, target modules) and ``adapter_model.safetensors`` with PEFT's tensor names
(``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``). :func:`merge_lora` adds ``alpha / r * B @ A`` to a ``transformers``
model's weights, the reference the adapter's outputs are compared with.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["LoraSpec", "make_local_lora", "merge_lora"]


@dataclass(frozen=True)
class LoraSpec:
    """Shape and seed of a local adapter for a model made by ``local_model``."""

    seed: int = 0
    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    std: float = 0.1  # of A's and B's entries: large enough to change greedy outputs


def _module_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``(in, out)`` features of each attention projection of a Llama-style config."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }


def make_local_lora(
    path: str | os.PathLike[str], base_model: str | os.PathLike[str], spec: LoraSpec | None = None
) -> Path:
    """Write a random adapter for the model in ``base_model`` into ``path``."""
    import torch
    from safetensors.torch import save_file

    spec = spec or LoraSpec()
    config = json.loads((Path(base_model) / "config.json").read_text())
    shapes = _module_shapes(config)
    unknown = sorted(set(spec.target_modules) - set(shapes))
    if unknown:
        raise ValueError(f"unsupported target modules {unknown} (supported: {sorted(shapes)})")
    gen = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for mod in spec.target_modules:
            fin, fout = shapes[mod]
            name = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            a = torch.randn(spec.rank, fin, generator=gen) * spec.std
            b = torch.randn(fout, spec.rank, generator=gen) * spec.std
            tensors[f"{name}.lora_A.weight"] = a.contiguous()
            tensors[f"{name}.lora_B.weight"] = b.contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": Path(base_model).name,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return out


def merge_lora(model: Any, adapter: str | os.PathLike[str]) -> Any:
    """Add the adapter in ``adapter`` to a ``transformers`` model's weights (in place)."""
    import torch
    from safetensors.torch import load_file

    root = Path(adapter)
    cfg = json.loads((root / "adapter_config.json").read_text())
    scale = float(cfg["lora_alpha"]) / float(cfg["r"])
    tensors = load_file(str(root / "adapter_model.safetensors"))
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            weight = modules[name].weight
            weight += (scale * (b.float() @ a.float())).to(weight.dtype)
    return model
