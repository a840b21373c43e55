#!/usr/bin/env python
"""Save-planning benchmark: a 3D-parallel GPT on thousands of simulated ranks, in one process.

    .venv/bin/python benchmarks/bench_planning.py [--tp 8] [--pp 8] [--dp 64] [--layers 40]
                                                  [--hidden 5120] [--vocab 51200] [--repeat 3]
                                                  [--out bench_out]

Builds every rank's ``LocalPlan`` directly (no tensors) the way a Megatron-Core GPT with a
distributed optimizer describes its state, then times what the coordinator does for an
uncached save (``make_global_plan``, plus the JSON round trip of the gathered plans) and
what every rank does for a re-save with a cached plan (``LocalPlan.structure_hash()``; the
global work is one all-gather of a 16-byte token, independent of the model). Reports the
size of the gathered local plans and of the manifest such a save would write.

The model: ``layers`` transformer layers of qkv, proj, fc1, fc2 weights and biases and two
layernorms, plus word embedding, output layer and final layernorm, in bf16. Layer
parameters are stacked over the layer axis (one key per parameter kind, global shape
``(layers, ...)``) and each PP stage holds its layers as one piece per layer, as Megatron-Core
does. Column-parallel weights split on axis 0, row-parallel on axis 1, TP-replicated
parameters have ``replica_id`` nonzero on tp > 0; all weights are replicated over DP
(``replica_id`` nonzero on dp > 0). Optimizer state (exp_avg, exp_avg_sq, fp32 param) is
distributed: for each (pp, tp) the TP-local chunks of all its parameters are concatenated
into one flat buffer split evenly over the DP ranks, so ranges cut parameters mid-row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from shardsafe.checksum import DEFAULT_BLOCK_BYTES, block_count
from shardsafe.commit import assemble
from shardsafe.format import (
    Extent,
    Manifest,
    data_file_name,
)
from shardsafe.planning import GlobalPlan, LocalPlan, ObjectDesc, PieceDesc, make_global_plan


@dataclass(frozen=True)
class Param:
    """One parameter kind: its per-layer (or whole) shape and how TP splits it."""

    key: str
    shape: tuple[int, ...]
    tp_axis: int | None  # None: replicated over TP
    stacked: bool  # a per-layer parameter, stacked over the layer axis
    stage: str  # "all" (layers), "first" or "last"


@dataclass(frozen=True)
class Config:
    tp: int
    pp: int
    dp: int
    layers: int
    hidden: int
    vocab: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """Megatron's order: tp fastest, then dp, then pp."""
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return tp, pp, dp


def params(cfg: Config) -> list[Param]:
    h, f = cfg.hidden, 4 * cfg.hidden
    layer = [
        ("input_layernorm.weight", (h,), None),
        ("input_layernorm.bias", (h,), None),
        ("self_attention.linear_qkv.weight", (3 * h, h), 0),
        ("self_attention.linear_qkv.bias", (3 * h,), 0),
        ("self_attention.linear_proj.weight", (h, h), 1),
        ("self_attention.linear_proj.bias", (h,), None),
        ("pre_mlp_layernorm.weight", (h,), None),
        ("pre_mlp_layernorm.bias", (h,), None),
        ("mlp.linear_fc1.weight", (f, h), 0),
        ("mlp.linear_fc1.bias", (f,), 0),
        ("mlp.linear_fc2.weight", (h, f), 1),
        ("mlp.linear_fc2.bias", (h,), None),
    ]
    out = [Param("embedding.word_embeddings.weight", (cfg.vocab, h), 0, False, "first")]
    out += [Param(f"decoder.layers.{k}", s, a, True, "all") for k, s, a in layer]
    out += [
        Param("decoder.final_layernorm.weight", (h,), None, False, "last"),
        Param("decoder.final_layernorm.bias", (h,), None, False, "last"),
        Param("output_layer.weight", (cfg.vocab, h), 0, False, "last"),
    ]
    return out


def tensor_count(cfg: Config) -> int:
    return sum(cfg.layers if p.stacked else 1 for p in params(cfg))


@dataclass(frozen=True)
class Chunk:
    """One TP-local parameter chunk held by a (pp, tp) position: its box in the global tensor."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    tp_replicated: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def stage_chunks(cfg: Config, pp: int, tp: int) -> list[Chunk]:
    """The parameter chunks of one (pp, tp) position, in the order of its state dict."""
    per_stage = cfg.layers // cfg.pp
    out: list[Chunk] = []
    for p in params(cfg):
        if (p.stage == "first" and pp != 0) or (p.stage == "last" and pp != cfg.pp - 1):
            continue
        shape = list(p.shape)
        offset = [0] * len(shape)
        if p.tp_axis is not None:
            part = shape[p.tp_axis] // cfg.tp
            offset[p.tp_axis], shape[p.tp_axis] = tp * part, part
        if not p.stacked:
            out.append(Chunk(p.key, p.shape, tuple(offset), tuple(shape), p.tp_axis is None))
            continue
        for layer in range(pp * per_stage, (pp + 1) * per_stage):
            out.append(
                Chunk(
                    p.key,
                    (cfg.layers, *p.shape),
                    (layer, *offset),
                    (1, *shape),
                    p.tp_axis is None,
                )
            )
    return out


def local_plan(cfg: Config, rank: int, chunks: dict[tuple[int, int], list[Chunk]]) -> LocalPlan:
    tp, pp, dp = cfg.coords(rank)
    mine = chunks[(pp, tp)]
    pieces = [
        PieceDesc(
            c.key,
            "bfloat16",
            c.global_shape,
            c.offset,
            c.shape,
            None,
            dp == 0 and (not c.tp_replicated or tp == 0),
            c.numel * 2,
        )
        for c in mine
    ]
    # distributed optimizer: this dp rank's share of the (pp, tp) flat buffer
    total = sum(c.numel for c in mine)
    lo, hi = total * dp // cfg.dp, total * (dp + 1) // cfg.dp
    start = 0
    for c in mine:
        a, b = max(lo, start), min(hi, start + c.numel)
        if a < b:
            for kind in ("exp_avg", "exp_avg_sq", "fp32_param"):
                pieces.append(
                    PieceDesc(
                        f"optimizer.state.{kind}.{c.key}",
                        "float32",
                        c.global_shape,
                        c.offset,
                        c.shape,
                        (a - start, b - start),
                        not c.tp_replicated or tp == 0,
                        (b - a) * 4,
                    )
                )
        start += c.numel
    objects = (
        ObjectDesc(
            f"rng_state/shard_{pp}.{tp}.{dp}_{cfg.pp}.{cfg.tp}.{cfg.dp}",
            "rng_state",
            (cfg.pp, cfg.tp, cfg.dp),
            (pp, tp, dp),
            True,
        ),
    )
    return LocalPlan(rank, tuple(pieces), objects)


def build_plans(cfg: Config) -> list[LocalPlan]:
    chunks = {(pp, tp): stage_chunks(cfg, pp, tp) for pp in range(cfg.pp) for tp in range(cfg.tp)}
    return [local_plan(cfg, r, chunks) for r in range(cfg.world)]


def manifest_for(
    plans: list[LocalPlan], plan: GlobalPlan, block_bytes: int = DEFAULT_BLOCK_BYTES
) -> Manifest:
    """The manifest ``commit.assemble`` writes, from per-rank write records with dummy checksums."""
    dummy = "0123456789abcdef"
    results = []
    for lp, assignment in zip(plans, plan.assignments, strict=True):
        pos = [0, 0]
        record: dict[str, Any] = {
            "pieces": {},
            "blobs": {},
            "objects": {},
            "files": {},
            "common": None,
        }
        for n, i in enumerate(assignment.pieces):
            d = lp.pieces[i]
            f = n % 2
            name = data_file_name(lp.rank, f)
            sums = (dummy,) * block_count(d.nbytes, block_bytes)
            record["pieces"][str(i)] = Extent(name, pos[f], d.nbytes, sums).to_json()
            pos[f] += -(-d.nbytes // 4096) * 4096
        for j in assignment.objects:
            blob = f"r{lp.rank}.o{j}.0"
            record["objects"][str(j)] = {
                "$tensor": {"dtype": "uint8", "shape": [5064], "blob": blob}
            }
            record["blobs"][blob] = Extent(
                data_file_name(lp.rank, 0), pos[0], 5064, (dummy,)
            ).to_json()
            pos[0] += 5120
        record["files"] = {data_file_name(lp.rank, f): pos[f] for f in range(2) if pos[f]}
        if lp.rank == 0:
            record["common"] = {"$dict": [["iteration", 1000], ["checkpoint_version", 3.0]]}
        results.append(record)
    return assemble((plans, plan), results, None, block_bytes)


def timed(fn: Any, repeat: int) -> tuple[list[float], Any]:
    times = []
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--vocab", type=int, default=51200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    cfg = Config(args.tp, args.pp, args.dp, args.layers, args.hidden, args.vocab)
    if cfg.layers % cfg.pp or cfg.hidden % cfg.tp or cfg.vocab % cfg.tp:
        ap.error("layers must divide by pp, hidden and vocab by tp")

    t0 = time.perf_counter()
    plans = build_plans(cfg)
    t_build = time.perf_counter() - t0
    n_pieces = sum(len(lp.pieces) for lp in plans)
    n_keys = len({p.key for lp in plans for p in lp.pieces})
    model_bytes = sum(math.prod(p.shape) * (cfg.layers if p.stacked else 1) for p in params(cfg))

    # what each rank sends, and what the coordinator parses, for an uncached plan
    texts = [json.dumps(lp.to_json()) for lp in plans]
    plan_json_bytes = sum(len(t) for t in texts)
    t_parse, parsed = timed(
        lambda: [LocalPlan.from_json(json.loads(t)) for t in texts], args.repeat
    )
    assert parsed == plans
    t_plan, plan = timed(lambda: make_global_plan(plans), args.repeat)
    t_reply, _ = timed(lambda: [json.dumps(a.to_json()) for a in plan.assignments], args.repeat)

    # a re-save: each rank hashes its own structure; globally one tiny all-gather
    hash_times = []
    for lp in plans:
        t = time.perf_counter()
        lp.structure_hash()
        hash_times.append(time.perf_counter() - t)

    written = plan.bytes_per_rank(plans)
    t_man, manifest = timed(lambda: manifest_for(plans, plan), 1)
    t_dump, raw = timed(manifest.dumps, 1)
    t_load, _ = timed(lambda: Manifest.loads(raw), 1)

    uncached = min(t_parse) + min(t_plan) + min(t_reply)
    lines = [
        f"GPT: {cfg.layers} layers, hidden {cfg.hidden}, vocab {cfg.vocab}: {tensor_count(cfg)} parameter tensors, "
        f"{model_bytes / 1e9:.1f} B params (bf16 weights + fp32 exp_avg, exp_avg_sq, main param)",
        f"layout: TP{cfg.tp} x PP{cfg.pp} x DP{cfg.dp} = {cfg.world} ranks; {n_keys} keys; "
        f"{n_pieces} pieces over all ranks ({n_pieces / cfg.world:.0f} per rank), built in {t_build:.2f} s",
        "",
        f"{'step (best of ' + str(args.repeat) + ')':<58} {'seconds':>9}",
        f"{f'uncached: make_global_plan({cfg.world:,} local plans)':<58} {min(t_plan):>9.3f}   "
        f"all: {', '.join(f'{t:.3f}' for t in t_plan)}",
        f"{'uncached: coordinator parses the gathered plans (JSON)':<58} {min(t_parse):>9.3f}",
        f"{'uncached: coordinator encodes the assignments (JSON)':<58} {min(t_reply):>9.3f}",
        f"{'uncached: coordinator total':<58} {uncached:>9.3f}",
        f"{'cached: structure_hash() per rank, mean':<58} {statistics.fmean(hash_times):>9.5f}",
        f"{'cached: structure_hash() per rank, max':<58} {max(hash_times):>9.5f}",
        f"{'cached: structure_hash() of all ranks, serially':<58} {sum(hash_times):>9.3f}",
        f"{'manifest: assemble / dumps / loads':<58} {t_man[0]:>9.3f} / {t_dump[0]:.3f} / {t_load[0]:.3f}",
        "",
        f"gathered LocalPlans (JSON): {plan_json_bytes / 1e6:.2f} MB in total, "
        f"{plan_json_bytes / cfg.world / 1e3:.1f} kB per rank on average",
        f"manifest.json: {len(raw) / 1e6:.2f} MB ({sum(len(t.pieces) for t in manifest.tensors.values())} stored pieces, "
        f"{len(manifest.files)} data files, {len(manifest.objects)} objects)",
        f"checkpoint: {sum(written) / 1e9:.1f} GB; bytes written per rank: min {min(written) / 1e9:.2f} GB, "
        f"max {max(written) / 1e9:.2f} GB, {sum(1 for w in written if w == 0)} ranks write nothing",
        "",
        f"[{'pass' if min(t_plan) < 2.0 else 'MISS'}] uncached make_global_plan under 2 s: {min(t_plan):.3f} s "
        f"(whole uncached coordinator step {uncached:.3f} s)",
        f"cached re-save: each rank hashes its own plan ({statistics.fmean(hash_times) * 1e3:.2f} ms), then one "
        "all-gather of a 16-byte plan id; no global work grows with the model or the world",
    ]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "planning.json"), "w") as f:
        json.dump(
            {
                "config": cfg.__dict__,
                "tensors": tensor_count(cfg),
                "keys": n_keys,
                "pieces": n_pieces,
                "make_global_plan_s": t_plan,
                "parse_s": t_parse,
                "reply_s": t_reply,
                "structure_hash_mean_s": statistics.fmean(hash_times),
                "structure_hash_max_s": max(hash_times),
                "local_plans_json_bytes": plan_json_bytes,
                "manifest_bytes": len(raw),
                "bytes_per_rank_min": min(written),
                "bytes_per_rank_max": max(written),
            },
            f,
            indent=1,
        )
    return 0 if min(t_plan) < 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
