"""The parallel machinery of the example GPT (pure PyTorch, gloo): layout and process groups,
tensor-parallel layers, the per-stage model, and the ZeRO-1 distributed Adam.

The layout follows Megatron-Core: global rank = ``(pp_rank * dp + dp_rank) * tp + tp_rank``,
so TP neighbours are adjacent ranks. Every parameter carries ``tp_axis`` (the axis it is split
on across the TP group, or None when replicated), and the module tree is named after the
*global* model (``decoder.layers.<global index>...``) so that a parameter's name, and hence
its checkpoint key, does not depend on the layout.

Choices made here, and why:

* The word embedding is vocab-parallel (rows split over TP, masked lookup + all-reduce), as is
  the LM head (column-parallel over the vocabulary; the logits are gathered before a plain
  cross-entropy, which keeps the loss code obvious at these sizes).
* Embedding and LM head are not tied: tying across pipeline stages needs an extra all-reduce
  that adds nothing to what a checkpoint has to describe.
* Weights are initialised globally from a seed derived from the parameter's name only, then
  sliced, so TP1 and TP2 models start bit-identical.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Layout:
    """The parallel layout ``(tp, pp, dp)``; world size is their product."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, tp_rank, dp_rank)`` of a global rank."""
        return rank // (self.tp * self.dp), rank % self.tp, (rank // self.tp) % self.dp

    def rank_of(self, pp_rank: int, tp_rank: int, dp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank


@dataclass
class ParallelState:
    """This rank's place in the layout and its process groups (None when the group is size 1)."""

    layout: Layout
    rank: int
    pp_rank: int
    tp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.layout.rank_of(self.pp_rank - 1, self.tp_rank, self.dp_rank)

    @property
    def next_rank(self) -> int:
        return self.layout.rank_of(self.pp_rank + 1, self.tp_rank, self.dp_rank)

    @classmethod
    def create(cls, layout: Layout) -> ParallelState:
        """Build the TP and DP groups; every rank must call this, in the same order."""
        if not dist.is_initialized() or dist.get_world_size() != layout.world:
            raise RuntimeError(
                f"torch.distributed must be initialised with world size {layout.world}"
            )
        rank = dist.get_rank()
        pp_rank, tp_rank, dp_rank = layout.coords(rank)
        tp_group = dp_group = None
        for p in range(layout.pp):  # new_group is collective: all ranks create all groups
            for d in range(layout.dp):
                ranks = [layout.rank_of(p, t, d) for t in range(layout.tp)]
                group = dist.new_group(ranks) if layout.tp > 1 else None
                if rank in ranks:
                    tp_group = group
            for t in range(layout.tp):
                ranks = [layout.rank_of(p, t, d) for d in range(layout.dp)]
                group = dist.new_group(ranks) if layout.dp > 1 else None
                if rank in ranks:
                    dp_group = group
        return cls(layout, rank, pp_rank, tp_rank, dp_rank, tp_group, dp_group)


# -- TP communication as autograd functions (Megatron's mappings) -----------------------------
class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward: the input of a column-parallel layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward: the output of a row-parallel layer."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather on the last axis forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


def copy_to_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    return x if ps.tp_group is None else _CopyToTP.apply(x, ps.tp_group)


def reduce_from_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    return x if ps.tp_group is None else _ReduceFromTP.apply(x, ps.tp_group)


def gather_from_tp(x: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    return x if ps.tp_group is None else _GatherFromTP.apply(x, ps.tp_group)


# -- layers -------------------------------------------------------------------------------------
def tp_param(global_shape: tuple[int, ...], tp_axis: int | None, ps: ParallelState) -> nn.Parameter:
    """An uninitialised parameter holding this rank's TP shard; ``tp_axis`` records the split."""
    shape = list(global_shape)
    if tp_axis is not None:
        if shape[tp_axis] % ps.layout.tp:
            raise ValueError(
                f"axis {tp_axis} of {global_shape} does not split over tp={ps.layout.tp}"
            )
        shape[tp_axis] //= ps.layout.tp
    param = nn.Parameter(torch.empty(shape))
    param.tp_axis = tp_axis  # type: ignore[attr-defined]
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows (and b) split over TP."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        ps: ParallelState,
        *,
        bias: bool = True,
        gather_output: bool = False,
    ):
        super().__init__()
        self.ps, self.gather_output = ps, gather_output
        self.weight = tp_param((d_out, d_in), 0, ps)
        self.bias = tp_param((d_out,), 0, ps) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.ps), self.weight, self.bias)
        return gather_from_tp(y, self.ps) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's input columns split over TP; b is replicated, added after the sum."""

    def __init__(self, d_in: int, d_out: int, ps: ParallelState):
        super().__init__()
        self.ps = ps
        self.weight = tp_param((d_out, d_in), 1, ps)
        self.bias = tp_param((d_out,), None, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.ps) + self.bias


class LayerNorm(nn.Module):
    """A replicated layernorm whose parameters are tagged like every other parameter."""

    def __init__(self, d: int, ps: ParallelState):
        super().__init__()
        self.weight = tp_param((d,), None, ps)
        self.bias = tp_param((d,), None, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP: each rank looks up its vocabulary range, then all-reduce."""

    def __init__(self, vocab: int, d: int, ps: ParallelState):
        super().__init__()
        self.ps = ps
        self.weight = tp_param((vocab, d), 0, ps)
        self.start = ps.tp_rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.ps)


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes; the defaults make one step take milliseconds on a CPU.

    ``ffn=200`` and ``hidden=40`` give row lengths that do not divide the ZeRO shard size, so
    the distributed optimizer's ranges cut parameters in the middle of rows.
    """

    vocab: int = 128
    hidden: int = 40
    heads: int = 4
    ffn: int = 200
    layers: int = 4
    seq: int = 32
    seed: int = 1234


class Attention(nn.Module):
    """Causal self-attention; QKV rows are ordered (head, q|k|v, head_dim) so a TP split keeps heads whole."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        if cfg.heads % ps.layout.tp or cfg.hidden % cfg.heads:
            raise ValueError(
                f"heads={cfg.heads} must split over tp={ps.layout.tp} and divide hidden={cfg.hidden}"
            )
        self.local_heads, self.head_dim = cfg.heads // ps.layout.tp, cfg.hidden // cfg.heads
        self.linear_qkv = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, ps)
        self.linear_proj = RowParallelLinear(cfg.hidden, cfg.hidden, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.linear_qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(cfg.hidden, cfg.ffn, ps)
        self.linear_fc2 = RowParallelLinear(cfg.ffn, cfg.hidden, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden, ps)
        self.self_attention = Attention(cfg, ps)
        self.pre_mlp_layernorm = LayerNorm(cfg.hidden, ps)
        self.mlp = MLP(cfg, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the layers on a stage: contiguous, earlier stages take the remainder."""
    if num_layers < pp:
        raise ValueError(f"{num_layers} layers cannot fill {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class Decoder(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        owned = stage_layers(cfg.layers, ps.layout.pp, ps.pp_rank)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, ps) for i in owned})
        self.final_layernorm = LayerNorm(cfg.hidden, ps) if ps.is_last_stage else None


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab, cfg.hidden, ps)
        self.position_embeddings = nn.Module()
        self.position_embeddings.weight = tp_param((cfg.seq, cfg.hidden), None, ps)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(ids) + self.position_embeddings.weight[: ids.shape[1]]


class GPTStage(nn.Module):
    """The part of the GPT that one pipeline stage owns (and nothing else)."""

    def __init__(self, cfg: GPTConfig, ps: ParallelState):
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.embedding = Embedding(cfg, ps) if ps.is_first_stage else None
        self.decoder = Decoder(cfg, ps)
        self.output_layer = (
            ColumnParallelLinear(cfg.hidden, cfg.vocab, ps, bias=False, gather_output=True)
            if ps.is_last_stage
            else None
        )
        init_parameters(self, cfg, ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or full logits (last stage) out."""
        if self.embedding is not None:
            x = self.embedding(x)
        for layer in self.decoder.layers.values():
            x = layer(x)
        if self.output_layer is not None:
            assert self.decoder.final_layernorm is not None
            x = self.output_layer(self.decoder.final_layernorm(x))
        return x


def param_seed(seed: int, name: str) -> int:
    """A seed that depends only on the run seed and the parameter's global name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def global_shape(param: torch.Tensor, tp: int) -> tuple[int, ...]:
    shape = list(param.shape)
    axis = param.tp_axis  # type: ignore[attr-defined]
    if axis is not None:
        shape[axis] *= tp
    return tuple(shape)


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: GPTConfig, ps: ParallelState) -> None:
    """Draw every full global tensor from its name's seed, then keep this rank's TP slice."""
    for name, param in model.named_parameters():
        full_shape = global_shape(param, ps.layout.tp)
        if "layernorm" in name:
            full = torch.ones(full_shape) if name.endswith("weight") else torch.zeros(full_shape)
        else:
            gen = torch.Generator().manual_seed(param_seed(cfg.seed, name))
            std = (
                0.02 / math.sqrt(2 * cfg.layers)
                if "linear_proj" in name or "linear_fc2" in name
                else 0.02
            )
            full = torch.randn(full_shape, generator=gen) * std
        axis = param.tp_axis  # type: ignore[attr-defined]
        if axis is not None:
            full = full.chunk(ps.layout.tp, dim=axis)[ps.tp_rank]
        param.copy_(full)


# -- ZeRO-1 distributed Adam --------------------------------------------------------------------
@dataclass(frozen=True)
class ParamRange:
    """Where a dp rank's optimizer range meets one parameter.

    ``param_start:param_stop`` indexes the row-major flattening of the TP-local shard;
    ``shard_start:shard_stop`` indexes this dp rank's optimizer buffers.
    """

    name: str
    param_start: int
    param_stop: int
    shard_start: int
    shard_stop: int


def zero_param_ranges(
    numels: list[tuple[str, int]], dp: int, dp_rank: int
) -> tuple[list[ParamRange], int]:
    """Lay the parameters end to end, pad to a multiple of ``dp``, give each dp rank one contiguous
    range; return the pieces of parameters in ``dp_rank``'s range and the padded length."""
    total = sum(n for _, n in numels)
    padded = -(-total // dp) * dp
    shard = padded // dp
    lo, hi = dp_rank * shard, (dp_rank + 1) * shard
    out, offset = [], 0
    for name, n in numels:
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            out.append(ParamRange(name, a - offset, b - offset, a - lo, b - lo))
        offset += n
    return out, padded


class DistributedAdam:
    """AdamW over one flat fp32 buffer per (pp stage, tp rank), each dp rank owning a range.

    The model's parameters become views of ``param_buffer``; each dp rank keeps master weights
    and moments only for its range. A step all-reduces the flat gradient over dp (gloo has no
    reduce-scatter), updates the range, and all-gathers the parameters back.
    """

    def __init__(
        self,
        model: nn.Module,
        ps: ParallelState,
        *,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        self.ps, self.lr, self.betas, self.eps, self.weight_decay = ps, lr, betas, eps, weight_decay
        self.params = dict(model.named_parameters())
        numels = [(name, p.numel()) for name, p in self.params.items()]
        self.ranges, padded = zero_param_ranges(numels, ps.layout.dp, ps.dp_rank)
        self.param_buffer = torch.zeros(padded, dtype=torch.float32)
        self.grad_buffer = torch.zeros(padded, dtype=torch.float32)
        self.offsets: dict[str, int] = {}
        offset = 0
        with torch.no_grad():
            for name, p in self.params.items():
                view = self.param_buffer[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
                self.offsets[name] = offset
                offset += p.numel()
        shard = padded // ps.layout.dp
        self.shard = (ps.dp_rank * shard, (ps.dp_rank + 1) * shard)
        self.fp32_param = self.param_buffer[self.shard[0] : self.shard[1]].clone()
        self.exp_avg = torch.zeros(shard, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(shard, dtype=torch.float32)
        self.step_count = 0

    def state_buffers(self) -> dict[str, torch.Tensor]:
        """The per-range optimizer state, by the name it has in a checkpoint."""
        return {
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "fp32_param": self.fp32_param,
        }

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        grads = self.grad_buffer.zero_()
        for name, p in self.params.items():
            if p.grad is not None:
                grads[self.offsets[name] : self.offsets[name] + p.numel()].copy_(p.grad.reshape(-1))
        if self.ps.dp_group is not None:
            dist.all_reduce(grads, group=self.ps.dp_group)
        lo, hi = self.shard
        g = grads[lo:hi]
        self.step_count += 1
        b1, b2 = self.betas
        self.exp_avg.mul_(b1).add_(g, alpha=1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (self.exp_avg_sq / (1 - b2**self.step_count)).sqrt_().add_(self.eps)
        self.fp32_param.mul_(1 - self.lr * self.weight_decay)
        self.fp32_param.addcdiv_(self.exp_avg, denom, value=-self.lr / (1 - b1**self.step_count))
        self.param_buffer[lo:hi].copy_(self.fp32_param)
        if self.ps.dp_group is not None:
            parts = list(self.param_buffer.chunk(self.ps.layout.dp))
            dist.all_gather(
                parts, self.fp32_param.clone(), group=self.ps.dp_group
            )  # fills the views
