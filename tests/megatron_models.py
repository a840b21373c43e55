"""Real Megatron-Core GPT models and optimizers on gloo CPU ranks, for the Megatron tests.

Models build on CPU as they are (``use_cpu_initialization=True``, the local layer spec).
Megatron-Core's optimizers do not: their constructors allocate buffers with
``device=torch.cuda.current_device()`` or ``device='cuda'`` and accept parameters only when
``param.type()`` names a CUDA tensor type. :func:`cpu_as_cuda` maps exactly those touch points
to the CPU while the optimizer is built and used, so the optimizer's own code, its
``sharded_state_dict`` included, runs unchanged; nothing it emits is built by hand.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 64
SEQ = 8


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    d = torch.device(device)
    return torch.device("cpu") if d.type == "cuda" else device


class _NoStream:
    """The current CUDA stream where there is none: CPU work is ordered already."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


@contextlib.contextmanager
def cpu_as_cuda() -> Iterator[None]:
    """Let Megatron-Core optimizer code that names CUDA run on CPU tensors (see module doc)."""
    saved: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, name: str, value: Any) -> None:
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    def with_cpu(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        return call

    real_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = real_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(out, str) and out.startswith("torch."):
            return out.replace("torch.", "torch.cuda.", 1)
        return out

    try:
        patch(torch.cuda, "current_device", lambda: torch.device("cpu"))
        patch(torch.cuda, "synchronize", lambda *a, **k: None)
        patch(torch.cuda, "empty_cache", lambda *a, **k: None)
        patch(torch.cuda, "current_stream", lambda *a, **k: _NoStream())  # 0.19's grad sync
        for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
            patch(torch, name, with_cpu(getattr(torch, name)))
        patch(torch.Tensor, "type", cuda_type)
        patch(torch.Tensor, "cuda", lambda self, *a, **k: self)
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def init_parallel(tp: int, pp: int, seed: int = 1234) -> None:
    """Megatron's parallel state on the already initialised gloo group."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp
    )
    torch.manual_seed(seed)
    mp_random.get_cuda_rng_tracker().reset()


def gpt(tp: int, pp: int, seed: int = 1234, layers: int = 2) -> Any:
    """A tiny Llama-style GPTModel (RMSNorm, SwiGLU, rotary, untied embeddings, GQA)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    init_parallel(tp, pp, seed)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=pp,
        tensor_model_parallel_size=tp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    torch.manual_seed(seed + parallel_state.get_tensor_model_parallel_rank())
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def with_optimizer(model: Any, distributed: bool, **config: Any) -> tuple[Any, Any]:
    """Megatron's DDP wrapper and Adam (its DistributedOptimizer when ``distributed``);
    ``config`` sets further OptimizerConfig fields."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    with cpu_as_cuda():
        ddp = DistributedDataParallel(
            model.config,
            DistributedDataParallelConfig(
                use_distributed_optimizer=distributed, grad_reduce_in_fp32=True
            ),
            model,
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=1e-2,
                use_distributed_optimizer=distributed,
                bf16=False,
                **config,
            ),
            [ddp],
        )
    return ddp, opt


def train_step(ddp: Any, opt: Any, seed: int) -> None:
    """One optimizer step with gradients set from ``seed`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    with cpu_as_cuda():
        opt.zero_grad()
        for _, p in sorted(ddp.module.named_parameters()):
            g = torch.randn(p.shape, generator=gen)
            p.main_grad.copy_(g)
        ok, _, _ = opt.step()
    assert ok


def named_params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def adam_state(opt: Any, model: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter name, the Adam moments of a (non-distributed) Megatron optimizer."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for sub in getattr(opt, "chained_optimizers", [opt]):
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                st = sub.optimizer.state[p]
                out[names[id(p)]] = {k: st[k].clone() for k in ("exp_avg", "exp_avg_sq")}
    return out


def dist_adam_state(opt: Any, model: Any) -> dict[str, dict[str, Any]]:
    """Per parameter name, this DP rank's flat range of the main param and Adam moments."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, dict[str, Any]] = {}
    for sub in getattr(opt, "chained_optimizers", [opt]):
        for gbuf_range_maps in sub.gbuf_ranges:
            for per_bucket in gbuf_range_maps.values():
                for gbuf_range_map in per_bucket:
                    for param, ranges in gbuf_range_map["param_map"].items():
                        r = ranges["param"]
                        with cpu_as_cuda():
                            tensors = sub._get_main_param_and_optimizer_states(param)
                        out[names[id(param)]] = {
                            "range": (r.start, r.end),
                            **{
                                k: tensors[k].detach().clone()
                                for k in ("param", "exp_avg", "exp_avg_sq")
                            },
                        }
    return out


COLUMN = ("word_embeddings.weight", "linear_qkv.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def consolidate(parts: list[dict[str, Any]], layers_per_stage: int) -> dict[str, torch.Tensor]:
    """The TP1/PP1 tensors from every rank's ``{"tp","pp","tensors": {local name: tensor}}``.

    Written from Megatron-Core's layouts, independently of any checkpoint code: column-parallel
    weights concatenate on dim 0, row-parallel on dim 1, SwiGLU's ``linear_fc1`` holds this TP
    rank's gate rows then its up rows, norms are replicated; PP stage ``s`` numbers its layers
    from ``s * layers_per_stage``.
    """
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for part in parts:
        for name, t in part["tensors"].items():
            if name.startswith("decoder.layers."):
                idx, rest = name[len("decoder.layers.") :].split(".", 1)
                name = f"decoder.layers.{int(idx) + part['pp'] * layers_per_stage}.{rest}"
            by_name.setdefault(name, {})[part["tp"]] = t
    out: dict[str, torch.Tensor] = {}
    for name, shards in by_name.items():
        ordered = [shards[r] for r in sorted(shards)]
        if name.endswith("linear_fc1.weight"):
            halves = [s.chunk(2, dim=0) for s in ordered]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif name.endswith(COLUMN):
            out[name] = torch.cat(ordered, dim=0)
        elif name.endswith(ROW):
            out[name] = torch.cat(ordered, dim=1)
        else:
            assert all(torch.equal(s, ordered[0]) for s in ordered), name
            out[name] = ordered[0]
    return out
