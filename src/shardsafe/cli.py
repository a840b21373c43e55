"""The ``shardsafe`` command line: ls, inspect, verify, diff, convert.

Exit codes: 0 ok, 1 a check failed (damage, differences), 2 usage error or unreadable input.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import CheckpointError

EXAMPLES = """examples:
  shardsafe ls ckpt/                                   # checkpoints under a root: step, committed?, size, age
  shardsafe inspect ckpt/step_000100 [--json]          # keys, shapes, dtypes, pieces, bytes, files
  shardsafe verify ckpt/step_000100                    # re-read everything; exit 1 if damaged
  shardsafe diff ckpt/step_000100 ckpt/step_000200     # per-tensor differences; exit 1 if any
  shardsafe convert ckpt/step_000100 model.pt --to torch
  shardsafe convert ckpt/step_000100 hf_model/ --to hf --prefix model. --dtype bfloat16 --max-shard-size 2GB \\
      --rename 'decoder\\.layers\\.(\\d+)\\. => model.layers.\\1.'
  shardsafe convert hf_model/ ckpt/from_hf --to shardsafe   # then load it into any TP/PP layout
  shardsafe convert megatron_iter_0000100/ model.pt --to torch   # PyTorch DCP / Megatron torch_dist
"""


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=None,
        file=sys.stderr,
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# --------------------------------------------------------------------------- verify / inspect


def cmd_verify(args: argparse.Namespace) -> int:
    from .reader import CheckpointReader

    reader = CheckpointReader(args.path)
    with _bar(reader.manifest.total_bytes, "verify") as bar:
        report = reader.verify(progress=bar.update)
    if report.ok:
        print(
            f"OK {args.path}: {report.tensors} tensors, {report.objects} objects, {report.bytes_checked} bytes checked"
        )
        return 0
    print(f"FAILED {args.path}: {len(report.problems)} problems", file=sys.stderr)
    for p in report.problems:
        print(f"  {p}", file=sys.stderr)
    return 1


def cmd_inspect(args: argparse.Namespace) -> int:
    from .convert import detect_format

    fmt = detect_format(args.path)
    if fmt == "shardsafe":
        return _inspect_shardsafe(args)
    return _inspect_other(args, fmt)


def _inspect_shardsafe(args: argparse.Namespace) -> int:
    from .reader import CheckpointReader

    m = CheckpointReader(args.path).manifest
    rows: list[dict[str, Any]] = []
    for key, t in m.tensors.items():
        files = sorted({p.extent.file for p in t.pieces})
        rows.append(
            {
                "key": key,
                "shape": list(t.shape),
                "dtype": t.dtype,
                "pieces": len(t.pieces),
                "bytes": t.nbytes,
                "files": files,
            }
        )
    if args.json:
        json.dump(
            {
                "path": args.path,
                "format": "shardsafe",
                "version": m.version,
                "world_size": m.world_size,
                "created": m.created,
                "total_bytes": m.total_bytes,
                "tensors": rows,
                "objects": sorted(m.objects),
                "files": {k: v.nbytes for k, v in m.files.items()},
            },
            sys.stdout,
            indent=1,
        )
        print()
        return 0
    print(
        f"{args.path}: shardsafe v{m.version}, saved by {m.world_size} ranks at {m.created}, {_size(m.total_bytes)} in {len(m.files)} files"
    )
    _print_rows(rows)
    for ukey in m.objects:
        print(f"  {ukey}  (object)")
    return 0


def _inspect_other(args: argparse.Namespace, fmt: str) -> int:
    from .convert import open_source

    source = open_source(args.path, trust=args.trust, fmt=fmt)
    rows: list[dict[str, Any]] = []
    for key in source.tensor_keys():
        shape, dtype = source.tensor_meta(key)
        pieces = getattr(source, "chunk_count", lambda _k: 1)(key)
        rows.append(
            {
                "key": key,
                "shape": list(shape),
                "dtype": str(dtype).removeprefix("torch."),
                "pieces": pieces,
                "bytes": math.prod(shape) * dtype.itemsize,
            }
        )
    if args.json:
        json.dump({"path": args.path, "format": fmt, "tensors": rows}, sys.stdout, indent=1)
        print()
        return 0
    print(f"{args.path}: {fmt}, {len(rows)} tensors, {_size(sum(r['bytes'] for r in rows))}")
    _print_rows(rows)
    return 0


def _print_rows(rows: list[dict[str, Any]]) -> None:
    width = max((len(r["key"]) for r in rows), default=10)
    for r in rows:
        print(
            f"  {r['key']:<{width}}  {r['dtype']:<14} {tuple(r['shape'])!s:<22} {r['pieces']:>5} pieces {_size(r['bytes']):>10}"
        )


# --------------------------------------------------------------------------- ls


def cmd_ls(args: argparse.Namespace) -> int:
    from .format import MANIFEST_NAME, Manifest
    from .location import LOCK_SUFFIX, OLD_MARK, TMP_MARK
    from .storage import storage_for

    root = storage_for(args.root)
    if not root.is_dir(""):
        raise CheckpointError(f"{args.root}: not a directory")
    names = root.list_dir("")
    if MANIFEST_NAME in names:  # the root itself is a checkpoint
        names, root = (
            [os.path.basename(os.path.normpath(args.root))],
            storage_for(os.path.dirname(os.path.abspath(args.root))),
        )
    rows = []
    now = time.time()
    for name in names:
        if name.endswith(LOCK_SUFFIX) or not root.is_dir(name):
            continue
        hidden = TMP_MARK in name or OLD_MARK in name
        state, size, created = "committed", 0, None
        if root.exists(f"{name}/{MANIFEST_NAME}"):
            try:
                m = Manifest.loads(
                    root.read_bytes(f"{name}/{MANIFEST_NAME}"), f"{name}/{MANIFEST_NAME}"
                )
                size, created = m.total_bytes, m.created
            except CheckpointError:
                state = "corrupt"
            if hidden:
                state = "uncommitted"
        else:
            state = "uncommitted"
            size = sum(root.size(f"{name}/data/{f}") for f in root.list_dir(f"{name}/data"))
        match = re.search(r"(\d+)$", name.split(TMP_MARK)[0].split(OLD_MARK)[0])
        age = ""
        try:
            mtime = (
                os.path.getmtime(os.path.join(root.root, name)) if "://" not in root.root else None
            )
            age = _age(now - mtime) if mtime else ""
        except OSError:
            pass
        rows.append((int(match.group(1)) if match else None, name, state, size, created or "", age))
    rows.sort(key=lambda r: (r[0] is None, r[0] if r[0] is not None else 0, r[1]))
    if args.json:
        json.dump(
            [
                dict(zip(("step", "name", "state", "bytes", "created", "age"), r, strict=True))
                for r in rows
            ],
            sys.stdout,
            indent=1,
        )
        print()
        return 0
    if not rows:
        print(f"{args.root}: no checkpoints")
        return 0
    print(f"{'step':>10}  {'state':<11} {'size':>10}  {'age':>8}  name")
    for step, name, state, size, _, age in rows:
        print(
            f"{'' if step is None else step:>10}  {state:<11} {_size(size):>10}  {age:>8}  {name}"
        )
    return 0


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


# --------------------------------------------------------------------------- diff


def cmd_diff(args: argparse.Namespace) -> int:
    import torch

    from .convert import open_source

    a = open_source(args.a, trust=args.trust)
    b = open_source(args.b, trust=args.trust)
    ka, kb = set(a.tensor_keys()), set(b.tensor_keys())
    only_a, only_b = sorted(ka - kb), sorted(kb - ka)
    differing = 0
    rows = []
    common_keys = [k for k in a.tensor_keys() if k in kb]
    with _bar(
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
    ca, cb = a.common(), b.common()
    # a format without common state (Hugging Face, say) is not a difference, only a note
    common_differs = bool(ca) and bool(cb) and _plain(ca) != _plain(cb)
    if bool(ca) != bool(cb) and not args.json:
        print(f"  note: only {'A' if ca else 'B'} has common (non-tensor) state; not compared")
    if args.json:
        json.dump(
            {
                "only_in_a": only_a,
                "only_in_b": only_b,
                "common_state_differs": common_differs,
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
        if common_differs:
            print("! common state differs")
        total = len(common_keys)
        print(
            f"{total - differing} of {total} shared tensors equal (atol={args.atol}, rtol={args.rtol}); "
            f"{len(only_a)} only in A, {len(only_b)} only in B"
        )
    return 1 if (differing or only_a or only_b or common_differs) else 0


def _wide(t: Any) -> Any:
    import torch

    return t.to(torch.complex128 if t.dtype.is_complex else torch.float64)


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
    from .convert.source import total_nbytes

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
            raise SystemExit(f"shardsafe convert: error: unknown --dtype {args.dtype!r}")
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
    with _bar(total_nbytes(selected), f"convert -> {args.to}") as bar:
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
        elif args.to == "dcp":
            export_dcp(selected, args.dst, progress=progress, overwrite=args.overwrite)
        else:
            export_shardsafe(selected, args.dst, progress=progress, overwrite=args.overwrite)
    print(f"wrote {args.dst} ({args.to})")
    return 0


def _convert_via_local_copy(args: argparse.Namespace) -> int:
    """torch/hf/dcp writers need a file system: write into a temporary directory, then upload."""
    import tempfile

    from .location import locate

    loc = locate(args.dst)
    if loc.parent.exists(loc.name) and not args.overwrite:
        raise CheckpointError(f"{args.dst} already exists; pass --overwrite to replace it")
    with tempfile.TemporaryDirectory(prefix="shardsafe-convert-") as tmp:
        local = os.path.join(tmp, loc.name)
        rc = cmd_convert(argparse.Namespace(**{**vars(args), "dst": local}))
        if rc:
            return rc
        if args.overwrite:
            loc.parent.remove_tree(loc.name)
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


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="List, inspect, verify, compare and convert distributed checkpoints.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ls", help="checkpoints under a root: step, committed or not, size, age")
    p.add_argument("root")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_ls)

    p = sub.add_parser(
        "inspect",
        help="keys with global shape, dtype, pieces, bytes and files (also DCP / Megatron)",
    )
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--trust",
        action="store_true",
        help="unpickle DCP/Megatron metadata without restrictions (trusted files only)",
    )
    p.set_defaults(fn=cmd_inspect)

    p = sub.add_parser(
        "verify", help="re-read every byte, check checksums and coverage (exit 1 if damaged)"
    )
    p.add_argument("path")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser(
        "diff",
        help="per-tensor max abs / relative difference, missing and extra keys (exit 1 if any)",
    )
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p.add_argument("--all", action="store_true", help="list equal tensors too")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--trust", action="store_true", help="unpickle DCP/Megatron metadata without restrictions"
    )
    p.set_defaults(fn=cmd_diff)

    p = sub.add_parser(
        "convert", help="to a torch.save file, a Hugging Face folder, PyTorch DCP or shardsafe"
    )
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=("torch", "hf", "dcp", "shardsafe"))
    p.add_argument(
        "--from",
        dest="source_format",
        choices=("shardsafe", "dcp", "hf", "torch"),
        help="skip detection",
    )
    p.add_argument("--prefix", help="take only keys under this prefix (removed from the names)")
    p.add_argument(
        "--rename",
        action="append",
        metavar="'REGEX => REPL'",
        help="rename rule (repeatable, applied in order)",
    )
    p.add_argument("--rename-file", help="a file of 'regex => replacement' lines")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument(
        "--max-shard-size", default="5GB", help="hf: largest safetensors file (default 5GB)"
    )
    p.add_argument("--overwrite", action="store_true")
    p.add_argument(
        "--trust",
        action="store_true",
        help="unpickle DCP/Megatron files without restrictions (trusted files only)",
    )
    p.set_defaults(fn=cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        return int(args.fn(args))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if args.command == "verify" else 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
