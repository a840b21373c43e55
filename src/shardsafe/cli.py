"""The ``shardsafe`` command line: inspect, verify (and more as they land).

Exit codes: 0 ok, 1 a check failed, 2 usage error or unreadable input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from .errors import CheckpointError

EXAMPLES = """examples:
  shardsafe verify ckpt/step_100
  shardsafe inspect ckpt/step_100 --json
"""


def _progress_bar(total: int, desc: str) -> Any:
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


def cmd_verify(args: argparse.Namespace) -> int:
    from .reader import CheckpointReader

    reader = CheckpointReader(args.path)
    with _progress_bar(reader.manifest.total_bytes, "verify") as bar:
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
        f"{args.path}: shardsafe v{m.version}, saved by {m.world_size} ranks at {m.created}, {m.total_bytes} bytes in {len(m.files)} files"
    )
    width = max((len(r["key"]) for r in rows), default=10)
    for r in rows:
        print(
            f"  {r['key']:<{width}}  {r['dtype']:<10} {tuple(r['shape'])!s:<20} {r['pieces']:>4} pieces {r['bytes']:>12} B"
        )
    for ukey in m.objects:
        print(f"  {ukey}  (object)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardsafe",
        description="Inspect and check shardsafe checkpoints.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "verify", help="re-read every byte, check checksums and coverage (exit 1 if damaged)"
    )
    p.add_argument("path")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("inspect", help="list keys with shape, dtype, pieces, bytes and files")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_inspect)
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
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
