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
import warnings
from collections.abc import Sequence
from typing import Any

from .cli_common import human_size, plural, progress_bar, require_path
from .errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError

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


# --------------------------------------------------------------------------- verify / inspect


def cmd_verify(args: argparse.Namespace) -> int:
    """One checkpoint; a manager's pointer file (``latest``) verifies the checkpoint it names; a
    root holding checkpoints verifies every committed one (exit 1 if any is damaged)."""
    require_path(args.path)
    target = _pointed_at(args.path)
    if target is not None:
        print(f"{args.path} -> {os.path.basename(target)}")
        return 0 if _verify_one(target) else 1
    steps = _committed_children(args.path)
    if not steps:  # a checkpoint, or nothing the reader can name better
        return 0 if _verify_one(args.path) else 1
    bad = 0
    for path in steps:
        try:
            ok = _verify_one(path)
        except CheckpointError as e:  # one unreadable checkpoint does not stop the others
            print(f"FAILED {path}: {e}", file=sys.stderr)
            ok = False
        bad += not ok
    print(
        f"{args.path}: {len(steps) - bad} of {plural(len(steps), 'committed checkpoint')} intact"
        + (f", {bad} damaged" if bad else "")
    )
    return 1 if bad else 0


def _verify_one(path: str) -> bool:
    from .reader import CheckpointReader

    reader = CheckpointReader(path)
    with progress_bar(reader.manifest.total_bytes, "verify") as bar:
        report = reader.verify(progress=bar.update)
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    if report.ok:
        print(
            f"OK {path}: {plural(report.tensors, 'tensor')}, {plural(report.objects, 'object')}, "
            f"{plural(report.bytes_checked, 'byte')} checked"
            + ("" if reader.manifest.digest is None else ", manifest digest matches")
        )
        return True
    print(f"FAILED {path}: {plural(len(report.problems), 'problem')}", file=sys.stderr)
    for p in report.problems:
        print(f"  {p}", file=sys.stderr)
    return False


def _pointed_at(path: str) -> str | None:
    """The checkpoint a pointer file (a manager's ``latest``) names, or None if ``path`` is none."""
    from .format import MANIFEST_NAME
    from .storage import is_url

    if is_url(path) or not os.path.isfile(path) or os.path.getsize(path) > 4096:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        return None
    target = os.path.join(os.path.dirname(path), name)
    return target if os.path.isfile(os.path.join(target, MANIFEST_NAME)) else None


def _committed_children(path: str) -> list[str] | None:
    """The committed checkpoints directly under ``path`` (step order) when ``path`` is a root
    rather than a checkpoint; None when it is (or may be) a checkpoint itself."""
    from .format import MANIFEST_NAME
    from .storage import storage_for

    root = storage_for(path)
    if not root.is_dir("") or root.exists(MANIFEST_NAME):
        return None
    names = [
        n
        for n in root.list_dir("")
        if not n.startswith(".") and root.is_dir(n) and root.exists(f"{n}/{MANIFEST_NAME}")
    ]
    names.sort(key=lambda n: (_step_of(n) is None, _step_of(n) or 0, n))
    sep = "/" if "://" in path else os.sep
    return [f"{path.rstrip(sep)}{sep}{n}" for n in names]


def _step_of(name: str) -> int | None:
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else None


def cmd_inspect(args: argparse.Namespace) -> int:
    from .convert import detect_format

    require_path(args.path)
    fmt = detect_format(args.path)
    if fmt == "shardsafe":
        return _inspect_shardsafe(args)
    return _inspect_other(args, fmt)


def _inspect_shardsafe(args: argparse.Namespace) -> int:
    from .reader import CheckpointReader

    reader = CheckpointReader(args.path)
    m = reader.manifest
    try:
        common: Any = reader.common()
    except CheckpointError as e:
        common = f"<unreadable: {e}>"
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
                "common": common,
                "files": {k: v.nbytes for k, v in m.files.items()},
            },
            sys.stdout,
            indent=1,
            default=_describe_value,
        )
        print()
        return 0
    print(
        f"{args.path}: shardsafe v{m.version}, saved by {m.world_size} ranks at {m.created}, {human_size(m.total_bytes)} in {plural(len(m.files), 'file')}"
    )
    _print_rows(rows)
    for ukey in m.objects:
        print(f"  {ukey}  (object)")
    lines = list(_common_lines(common, "", set(m.tensors)))
    print(f"common state: {plural(len(lines), 'entry') if lines else 'none'}")
    for line in lines:
        print(f"  {line}")
    return 0


def _describe_value(x: Any) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        return f"tensor {str(x.dtype).removeprefix('torch.')} {tuple(x.shape)}"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


class _TensorPlace:
    """Shown where a list of the common state had a tensor (stored as a tensor key)."""

    def __repr__(self) -> str:
        return "<tensor>"


def _common_lines(tree: Any, path: str, tensor_keys: set[str]) -> Any:
    """``path = value`` for each leaf of the common state (values shortened), without the
    places tensors were taken from: a dict only tensors filled, a list's ``None`` placeholders
    (shown as ``<tensor>`` beside other values)."""
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            yield from _common_lines(v, f"{path}.{k}" if path else str(k), tensor_keys)
    elif isinstance(tree, dict):
        if path and not any(k.startswith(f"{path}.") for k in tensor_keys):
            yield f"{path} = {{}}"
    elif isinstance(tree, (list, tuple)) and any(
        v is None and f"{path}.{i}" in tensor_keys for i, v in enumerate(tree)
    ):
        shown = [
            _TensorPlace() if v is None and f"{path}.{i}" in tensor_keys else v
            for i, v in enumerate(tree)
        ]
        if not all(isinstance(v, _TensorPlace) for v in shown):
            yield f"{path} = {_describe_value(shown if isinstance(tree, list) else tuple(shown))}"
    else:
        yield f"{path or '(root)'} = {_describe_value(tree)}"


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
    print(
        f"{args.path}: {fmt}, {plural(len(rows), 'tensor')}, {human_size(sum(r['bytes'] for r in rows))}"
    )
    _print_rows(rows)
    return 0


def _print_rows(rows: list[dict[str, Any]]) -> None:
    width = max((len(r["key"]) for r in rows), default=10)
    for r in rows:
        print(
            f"  {r['key']:<{width}}  {r['dtype']:<14} {tuple(r['shape'])!s:<22} {plural(r['pieces'], 'piece'):>10} {human_size(r['bytes']):>10}"
        )


# --------------------------------------------------------------------------- ls


def cmd_ls(args: argparse.Namespace) -> int:
    from .directory import parse_step
    from .errors import CorruptCheckpointError
    from .format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest
    from .location import DAMAGED_SUFFIX, LOCK_SUFFIX, OLD_MARK, TMP_MARK
    from .storage import storage_for

    require_path(args.root)
    root = storage_for(args.root)
    if not root.is_dir(""):
        raise CheckpointError(f"{args.root}: not a directory")
    names = root.list_dir("")
    if MANIFEST_NAME in names:  # the root itself is a checkpoint
        names, root = (
            [os.path.basename(os.path.normpath(args.root))],
            storage_for(os.path.dirname(os.path.abspath(args.root))),
        )
    # a restore that found a committed checkpoint unloadable leaves a mark beside it
    damaged = {
        n[1 : -len(DAMAGED_SUFFIX)]
        for n in names
        if n.startswith(".") and n.endswith(DAMAGED_SUFFIX)
    }
    rows = []
    now = time.time()
    for name in names:
        if name.endswith(LOCK_SUFFIX) or not root.is_dir(name):
            continue
        hidden = TMP_MARK in name or OLD_MARK in name
        if not (
            hidden
            or parse_step(name) is not None
            or root.exists(f"{name}/{MANIFEST_NAME}")
            or root.is_dir(f"{name}/data")
        ):
            continue  # logs/, a tokenizer...: not a checkpoint, nor the remains of a save
        state, size, created = "committed", 0, None
        if root.exists(f"{name}/{MANIFEST_NAME}"):
            try:
                if root.size(f"{name}/{MANIFEST_NAME}") > MAX_MANIFEST_BYTES:
                    raise CorruptCheckpointError(f"{name}/{MANIFEST_NAME} is too large")
                m = Manifest.loads(
                    root.read_bytes(f"{name}/{MANIFEST_NAME}"), f"{name}/{MANIFEST_NAME}"
                )
                size, created = m.total_bytes, m.created
            except (CheckpointError, OSError):  # one bad checkpoint does not hide the others
                state = "corrupt"
            if hidden:
                state = "uncommitted"
            elif name in damaged:
                state = "damaged"
        else:
            state = "uncommitted"
            size = sum(
                _size_or_zero(root, f"{name}/data/{f}") for f in root.list_dir(f"{name}/data")
            )
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
            f"{'' if step is None else step:>10}  {state:<11} {human_size(size):>10}  {age:>8}  {name}"
        )
    return 0


def _age(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:.0f}s"


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    from .cli_convert import cmd_convert, cmd_diff

    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="List, inspect, verify, compare and convert distributed checkpoints.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "ls",
        help="checkpoints under a root: step, committed or not, size, age",
        description="List the checkpoints under ROOT (or ROOT itself if it is one): step, "
        "state (committed; damaged: a restore could not load it and marked it; uncommitted: "
        "the remains of a save; corrupt: an unreadable manifest), size and age. Other "
        "directories are not listed.",
    )
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
        "verify",
        help="re-read every byte, check checksums and coverage (exit 1 if damaged)",
        description="Re-read every stored byte of the checkpoint at PATH and check its checksums, "
        "sizes and coverage. Exit 0 if intact, 1 if damaged, 2 if it cannot be read at all.",
    )
    p.add_argument("path")
    p.set_defaults(fn=cmd_verify)

    p = sub.add_parser(
        "diff",
        help="per-tensor max abs / relative difference, missing and extra keys (exit 1 if any)",
    )
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument(
        "--atol", type=float, default=0.0, help="absolute tolerance (default: %(default)s)"
    )
    p.add_argument(
        "--rtol",
        type=float,
        default=0.0,
        help="tolerance relative to B's largest magnitude (default: %(default)s)",
    )
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
    p.add_argument("--to", required=True, choices=("torch", "hf", "dcp", "megatron", "shardsafe"))
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
    p.add_argument(
        "--map",
        choices=("megatron-gpt",),
        help="hf: rename and re-layout a Megatron-Core GPT (Llama-style) checkpoint for transformers",
    )
    p.add_argument("--heads", type=int, help="--map megatron-gpt: number of attention heads")
    p.add_argument("--query-groups", type=int, help="--map megatron-gpt: key/value heads")
    p.add_argument("--rope-theta", type=float, default=10000.0, help="--map: config.json value")
    p.add_argument("--norm-eps", type=float, default=1e-5, help="--map: config.json value")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument(
        "--trust",
        action="store_true",
        help="unpickle DCP/Megatron files without restrictions (trusted files only)",
    )
    p.set_defaults(fn=cmd_convert)
    return parser


def _size_or_zero(root: Any, rel: str) -> int:
    """The size of a regular file, 0 for a link, FIFO, loop or anything unreadable."""
    try:
        return int(root.size(rel))
    except (OSError, CheckpointError):
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    for stream in (sys.stdout, sys.stderr):  # keys from a file may hold lone surrogates
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    with warnings.catch_warnings():  # what an export leaves out: one line each, no source
        warnings.showwarning = _warning_line
        return _run(args)


def _warning_line(message: Any, category: Any, *_: Any, **__: Any) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args.fn(args))
    except CheckpointError as e:
        message = str(e)
        if args.command == "convert":  # the library's keyword is the command's flag here
            message = message.replace("overwrite=True", "--overwrite")
        print(f"error: {message}", file=sys.stderr)
        damaged = isinstance(e, CorruptCheckpointError) and not isinstance(e, UnsafeObjectError)
        return 1 if args.command == "verify" and damaged else 2
    except ImportError as e:  # an optional extra that is not installed (s3fs...)
        extra = (
            "s3"
            if "s3" in str(e) or "fsspec" in str(e)
            else "hf"
            if "safetensors" in str(e)
            else None
        )
        hint = (
            f"; install the '{extra}' extra: pip install 'shardsafe[{extra}]' "
            f"(from a clone of shardsafe: pip install '.[{extra}]')"
            if extra
            else ""
        )
        print(f"error: {e}{hint}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
