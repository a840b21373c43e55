"""``shardsafe diff`` and ``shardsafe convert``: compare checkpoints tensor by tensor, and turn
one format into another, streaming so memory stays near the largest tensor."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from .cli_common import plural, progress_bar, require_path
from .errors import CheckpointError, CheckpointExistsError

# --------------------------------------------------------------------------- diff


def cmd_diff(args: argparse.Namespace) -> int:
    import torch

    from .convert import open_source

    require_path(args.a)
    require_path(args.b)
    a = open_source(args.a, trust=args.trust)
    b = open_source(args.b, trust=args.trust)
    ka, kb = set(a.tensor_keys()), set(b.tensor_keys())
    only_a, only_b = sorted(ka - kb), sorted(kb - ka)
    differing = 0
    rows = []
    common_keys = [k for k in a.tensor_keys() if k in kb]
    with progress_bar(
        sum(math.prod(a.tensor_meta(k)[0]) * a.tensor_meta(k)[1].itemsize for k in common_keys),
        "diff",
    ) as bar:
        for key in common_keys:
            (sa, da), (sb, db) = a.tensor_meta(key), b.tensor_meta(key)
            if sa != sb or da != db:
                rows.append(
                    (key, f"shape/dtype {tuple(sa)} {da} vs {tuple(sb)} {db}", math.inf, math.inf)
                )
                differing += 1
                continue
            ta, tb = a.read_tensor(key), b.read_tensor(key)
            bar.update(ta.numel() * ta.element_size())
            if ta.dtype.is_floating_point or ta.dtype.is_complex:
                x, y = _wide(ta), _wide(tb)
                diff = (x - y).abs()
                same_nan = torch.isnan(x) & torch.isnan(y)
                diff = torch.where(same_nan, torch.zeros_like(diff), diff).nan_to_num(nan=math.inf)
                max_abs = float(diff.max()) if diff.numel() else 0.0
                scale = float(y.abs().max()) if y.numel() else 0.0
                max_rel = max_abs / scale if scale else (0.0 if max_abs == 0 else math.inf)
                bad = max_abs > args.atol + args.rtol * scale
            else:
                neq = int((ta != tb).sum())
                max_abs = float(neq)
                max_rel = neq / max(1, ta.numel())
                bad = neq > 0
            if bad:
                differing += 1
            if bad or args.all:
                rows.append((key, "differs" if bad else "same", max_abs, max_rel))
    from .convert.flatten import common_leaves

    # compared leaf by leaf, so that an export (flat keys, DCP's dicts for lists) equals its
    # source; a format without common state (Hugging Face, say) is not a difference, only a note
    ca, cb = common_leaves(a.common(), ka), common_leaves(b.common(), kb)
    common_keys_differ = common_differences(ca, cb) if ca and cb else []
    common_differs = bool(common_keys_differ)
    if bool(ca) != bool(cb) and not args.json:
        print(f"  note: only {'A' if ca else 'B'} has common (non-tensor) state; not compared")
    if args.json:
        json.dump(
            {
                "only_in_a": only_a,
                "only_in_b": only_b,
                "common_state_differs": common_differs,
                "common_differences": common_keys_differ,
                "tensors": [
                    {"key": k, "status": s, "max_abs": m, "max_rel": r} for k, s, m, r in rows
                ],
            },
            sys.stdout,
            indent=1,
            default=str,
        )
        print()
    else:
        for k in only_a:
            print(f"- {k}  (only in {args.a})")
        for k in only_b:
            print(f"+ {k}  (only in {args.b})")
        for k, status, m, r in rows:
            print(
                f"{'!' if status != 'same' else ' '} {k}  {status}  max_abs={m:.6g}  max_rel={r:.6g}"
            )
        for where in common_keys_differ:
            print(f"! common state {where}")
        total = len(common_keys)
        print(
            f"{total - differing} of {total} shared {plural(total, 'tensor')} equal (atol={args.atol}, rtol={args.rtol}); "
            f"{len(only_a)} only in A, {len(only_b)} only in B"
        )
    return 1 if (differing or only_a or only_b or common_differs) else 0


def _wide(t: Any) -> Any:
    import torch

    return t.to(torch.complex128 if t.dtype.is_complex else torch.float64)


def common_differences(a: dict[tuple[str, ...], Any], b: dict[tuple[str, ...], Any]) -> list[str]:
    """Where two common states (as :func:`common_leaves`) differ, by path: ``['x']['y'] differs``,
    ``only in A``..."""
    out = []
    for path in list(a) + [p for p in b if p not in a]:
        where = "".join(f"[{c}]" if c.isdigit() else f"[{c!r}]" for c in path) or "(root)"
        if path not in b:
            out.append(f"{where} only in A")
        elif path not in a:
            out.append(f"{where} only in B")
        elif _plain(a[path]) != _plain(b[path]):
            out.append(f"{where} differs: {_short(a[path])} vs {_short(b[path])}")
    return out


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _plain(x: Any) -> Any:
    """Common state made comparable (tensors by value)."""
    import torch

    if isinstance(x, torch.Tensor):
        return (
            "tensor",
            str(x.dtype),
            tuple(x.shape),
            x.detach().cpu().contiguous().view(-1).view(torch.uint8).tolist()
            if x.numel() < 1 << 16
            else x.sum().item(),
        )
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return repr(x)


# --------------------------------------------------------------------------- convert


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from .convert import (
        SelectedSource,
        export_dcp,
        export_hf,
        export_torch,
        open_source,
        parse_rename_rules,
    )
    from .convert.native import export_shardsafe
    from .convert.publish import refuse_overlap
    from .convert.source import total_nbytes

    require_path(args.src)
    refuse_overlap(args.src, args.dst)  # before anything is read or written
    source = open_source(args.src, trust=args.trust, fmt=args.source_format)
    rules: list[Any] = []
    for r in args.rename or []:
        rules.extend(parse_rename_rules(r))
    if args.rename_file:
        rules.extend(parse_rename_rules(Path(args.rename_file)))
    dtype = None
    if args.dtype:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            print(
                f"error: unknown --dtype {args.dtype!r} (e.g. bfloat16, float16)", file=sys.stderr
            )
            return 2
    if args.map:
        if args.to != "hf" or not args.heads or not args.query_groups:
            print(
                "error: --map megatron-gpt needs --to hf, --heads and --query-groups",
                file=sys.stderr,
            )
            return 2
        from .convert.megatron_hf import megatron_gpt_to_hf

        source = megatron_gpt_to_hf(
            source, num_attention_heads=args.heads, num_query_groups=args.query_groups
        )
    if args.to == "hf":
        selected: Any = source
    else:
        selected = (
            SelectedSource(source, prefix=args.prefix, rename=rules or None, dtype=dtype)
            if (args.prefix or rules or dtype)
            else source
        )
    from .storage import is_url

    if is_url(args.dst) and args.to != "shardsafe":
        return _convert_via_local_copy(args)
    with progress_bar(total_nbytes(selected), f"convert -> {args.to}") as bar:
        done = [0]

        def progress(n: int, total: int, key: str) -> None:
            bar.update(n - done[0])
            done[0] = n

        if args.to == "torch":
            export_torch(selected, args.dst, progress=progress, overwrite=args.overwrite)
        elif args.to == "hf":
            export_hf(
                selected,
                args.dst,
                max_shard_size=args.max_shard_size,
                dtype=dtype,
                prefix=args.prefix,
                rename=rules or None,
                progress=progress,
                overwrite=args.overwrite,
            )
            if args.map:
                from .convert.megatron_hf import llama_config, write_llama_config

                config = llama_config(
                    source,
                    num_attention_heads=args.heads,
                    num_query_groups=args.query_groups,
                    rms_norm_eps=args.norm_eps,
                    rope_theta=args.rope_theta,
                )
                write_llama_config(Path(args.dst), config)
        elif args.to == "dcp":
            export_dcp(selected, args.dst, progress=progress, overwrite=args.overwrite)
        elif args.to == "megatron":
            from .convert.megatron_export import export_megatron

            export_megatron(selected, args.dst, progress=progress, overwrite=args.overwrite)
        else:
            export_shardsafe(selected, args.dst, progress=progress, overwrite=args.overwrite)
    print(f"wrote {args.dst} ({args.to})")
    return 0


def _replaced_by_export(loc: Any, to: str) -> list[str]:
    """What an ``--overwrite`` export to an object store may delete at ``loc``: an export of
    the same kind only, as the file-system writers do; anything else is refused, not deleted."""
    from .convert.dcp import MEGATRON_CONFIG_FILE
    from .convert.hf import OWN_FILES

    parent, name = loc.parent, loc.name
    if not parent.is_dir(name):
        if to == "torch":
            return [name]
        raise CheckpointExistsError(
            f"{loc.url} is a file, not a {to} export; move or delete it yourself, or pick another path"
        )
    entries = parent.list_dir(name)
    if to == "hf":  # its own files only; config, tokenizer and the rest stay
        return [f"{name}/{e}" for e in entries if OWN_FILES.fullmatch(e)]
    marker = {"dcp": ".metadata", "megatron": MEGATRON_CONFIG_FILE}.get(to)
    if marker is not None and marker in entries:
        return [name]
    if not entries:
        return [name]
    what = f"a directory holding {', '.join(sorted(entries)[:5])}"
    raise CheckpointExistsError(
        f"{loc.url} is {what}, not a {to} export; --overwrite replaces an export of the same "
        "kind only: move or delete it yourself, or pick another path"
    )


def _convert_via_local_copy(args: argparse.Namespace) -> int:
    """torch/hf/dcp writers need a file system: write into a temporary directory, then upload."""
    import tempfile

    from .location import locate

    loc = locate(args.dst)
    if loc.parent.exists(loc.name) and not args.overwrite:
        raise CheckpointError(f"{args.dst} already exists; pass --overwrite to replace it")
    doomed = _replaced_by_export(loc, args.to) if loc.parent.exists(loc.name) else []
    with tempfile.TemporaryDirectory(prefix="shardsafe-convert-") as tmp:
        local = os.path.join(tmp, loc.name)
        rc = cmd_convert(argparse.Namespace(**{**vars(args), "dst": local}))
        if rc:
            return rc
        for rel in doomed:
            loc.parent.remove_tree(rel)
        files = (
            [local]
            if os.path.isfile(local)
            else [os.path.join(d, f) for d, _, names in os.walk(local) for f in names]
        )
        for path in files:
            rel = loc.name if path == local else f"{loc.name}/{os.path.relpath(path, local)}"
            with open(path, "rb") as src, loc.parent.open_write(rel) as out:
                while chunk := src.read(64 << 20):
                    out.write(chunk)
    print(f"uploaded to {args.dst}")
    return 0
