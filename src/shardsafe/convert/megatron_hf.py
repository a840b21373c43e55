"""Megatron-Core GPT (Llama-style) tensors under Hugging Face Llama names and layouts.

A Megatron-Core GPT checkpoint stores every decoder tensor once, stacked over layers (a leading
layer axis), with the TP1 layout of its fused weights:

* ``linear_qkv.weight`` ``[L, G * (H/G + 2) * d, h]``: per query group ``g``, its ``H/G`` query
  heads, then its key head, then its value head (``d`` rows each);
* ``linear_fc1.weight`` ``[L, 2 * f, h]``: SwiGLU's gate rows, then its up rows;
* norms fused into the next linear (``linear_qkv.layer_norm_weight``,
  ``linear_fc1.layer_norm_weight``) or standalone (``input_layernorm``, ``pre_mlp_layernorm``).

:func:`megatron_gpt_to_hf` exposes them as ``model.layers.{i}.self_attn.q_proj.weight``... one
tensor at a time. Rotary embeddings need no permutation: Megatron's non-interleaved rotary and
Hugging Face's ``rotate_half`` split each head the same way. Keys it cannot place raise
:class:`UnsupportedFormatError` naming them (biases, QK norms, MoE, MTP are not mapped).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .errors import UnsupportedFormatError
from .source import DictSource, Shape, TensorSource

_L = "decoder.layers."
_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_PLAIN = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_SKIPPED_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state")


def megatron_gpt_to_hf(
    source: TensorSource, *, num_attention_heads: int, num_query_groups: int
) -> DictSource:
    """``source``'s Megatron GPT tensors as Hugging Face Llama tensors (read lazily)."""
    heads, groups = num_attention_heads, num_query_groups
    if heads <= 0 or groups <= 0 or heads % groups:
        raise UnsupportedFormatError(
            f"num_attention_heads ({heads}) must be a positive multiple of num_query_groups ({groups})"
        )
    out: dict[str, tuple[Shape, torch.dtype, Callable[[], torch.Tensor]]] = {}
    unplaced: list[str] = []

    def add(name: str, shape: Shape, dtype: torch.dtype, fn: Callable[[], torch.Tensor]) -> None:
        out[name] = (tuple(shape), dtype, fn)

    for key in source.tensor_keys():
        shape, dtype = source.tensor_meta(key)
        if key in _TOP:
            add(_TOP[key], shape, dtype, _whole(source, key))
            continue
        if key.startswith(_SKIPPED_PREFIXES) or not key.startswith(("decoder.", "embedding.")):
            continue
        rest = key[len(_L) :] if key.startswith(_L) else None
        if rest is None or not (
            rest in _NORMS
            or rest in _PLAIN
            or rest.endswith(("linear_qkv.weight", "linear_fc1.weight"))
        ):
            unplaced.append(key)
            continue
        layers = shape[0]
        for i in range(layers):
            base = f"model.layers.{i}."
            layer = _layer_reader(source, key, i)
            if rest in _NORMS:
                add(base + _NORMS[rest], shape[1:], dtype, layer)
            elif rest in _PLAIN:
                add(base + _PLAIN[rest], shape[1:], dtype, layer)
            elif rest == "self_attention.linear_qkv.weight":
                _add_qkv(add, base, shape[1:], dtype, layer, heads, groups, key)
            elif rest == "mlp.linear_fc1.weight":
                rows, cols = shape[1:]
                if rows % 2:
                    raise UnsupportedFormatError(
                        f"{key}: SwiGLU fc1 needs an even row count, got {rows}"
                    )
                half = rows // 2
                add(
                    base + "mlp.gate_proj.weight",
                    (half, cols),
                    dtype,
                    _rows(layer, 0, half),
                )
                add(
                    base + "mlp.up_proj.weight",
                    (half, cols),
                    dtype,
                    _rows(layer, half, rows),
                )
            else:
                unplaced.append(key)
                break
    if unplaced:
        raise UnsupportedFormatError(
            f"no Hugging Face Llama name for {len(unplaced)} Megatron keys: {sorted(unplaced)[:10]} "
            "(biases, QK norms, MoE experts and MTP layers are not mapped)"
        )
    if not out:
        raise UnsupportedFormatError(
            "no Megatron GPT tensors found (expected decoder.layers.* keys)"
        )
    return DictSource(out, source.common())


def _whole(source: TensorSource, key: str) -> Callable[[], torch.Tensor]:
    return lambda: source.read_tensor(key)


def _rows(layer: Callable[[], torch.Tensor], start: int, stop: int) -> Callable[[], torch.Tensor]:
    return lambda: layer()[start:stop].contiguous()


def _layer_reader(source: TensorSource, key: str, i: int) -> Callable[[], torch.Tensor]:
    return lambda: source.read_tensor(key)[i].contiguous()


def _add_qkv(
    add: Callable[..., None],
    base: str,
    shape: Shape,
    dtype: torch.dtype,
    layer: Callable[[], torch.Tensor],
    heads: int,
    groups: int,
    key: str,
) -> None:
    rows, cols = shape
    per_group = heads // groups + 2
    if rows % (groups * per_group):
        raise UnsupportedFormatError(
            f"{key}: {rows} rows do not split into {groups} query groups of {per_group} heads"
        )
    d = rows // (groups * per_group)
    q_rows = heads // groups * d

    def part(which: str) -> torch.Tensor:
        w = layer().view(groups, per_group * d, cols)
        if which == "q":
            return w[:, :q_rows].reshape(heads * d, cols)
        start = q_rows if which == "k" else q_rows + d
        return w[:, start : start + d].reshape(groups * d, cols)

    add(base + "self_attn.q_proj.weight", (heads * d, cols), dtype, lambda: part("q"))
    add(base + "self_attn.k_proj.weight", (groups * d, cols), dtype, lambda: part("k"))
    add(base + "self_attn.v_proj.weight", (groups * d, cols), dtype, lambda: part("v"))


def llama_config(
    hf: TensorSource,
    *,
    num_attention_heads: int,
    num_query_groups: int,
    rms_norm_eps: float = 1e-5,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 4096,
) -> dict[str, Any]:
    """A ``config.json`` for ``LlamaForCausalLM`` with the sizes read from the mapped tensors."""
    vocab, hidden = hf.tensor_meta("model.embed_tokens.weight")[0]
    layers = 1 + max(
        int(k.split(".")[2]) for k in hf.tensor_keys() if k.startswith("model.layers.")
    )
    ffn = hf.tensor_meta("model.layers.0.mlp.gate_proj.weight")[0][0]
    dtype = hf.tensor_meta("model.embed_tokens.weight")[1]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_query_groups,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in hf.tensor_keys(),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_llama_config(dst: Path, config: dict[str, Any]) -> bool:
    """Write ``config.json`` unless one is there (a user's own config wins); True if written."""
    path = dst / "config.json"
    if path.exists():
        return False
    path.write_text(json.dumps(config, indent=2) + "\n")
    return True
