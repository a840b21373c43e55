"""Filling in the storage records of a ``torch.save`` zip archive after the fact.

``torch.serialization.skip_data`` writes an archive whose storage records are reserved but
empty, which lets a writer lay out a file of any size without holding its tensors. The bytes
are then written in place, one tensor at a time, and the CRC-32 of each record is patched in
its data descriptor and central-directory entry so that the result is a valid zip file
(``zipfile.ZipFile.testzip`` passes), exactly like one ``torch.save`` writes itself.
"""

from __future__ import annotations

import os
import struct
import zipfile
from dataclasses import dataclass

_CENTRAL_SIG = b"PK\x01\x02"
_LOCAL_SIG = b"PK\x03\x04"
_DESCRIPTOR_SIG = b"PK\x07\x08"


@dataclass(frozen=True)
class ZipRecord:
    name: str
    header_offset: int
    data_offset: int
    size: int
    central_offset: int
    has_descriptor: bool


def zip_records(path: str | os.PathLike[str]) -> dict[int, ZipRecord]:
    """Every stored record of the archive, by the file offset of its first data byte."""
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        start_dir = zf.start_dir
    records: dict[int, ZipRecord] = {}
    with open(path, "rb") as f:
        pos = start_dir
        for info in infos:
            f.seek(pos)
            head = f.read(46)
            if head[:4] != _CENTRAL_SIG:
                raise ValueError(f"{path}: malformed central directory at byte {pos}")
            name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
            f.seek(info.header_offset)
            local = f.read(30)
            if local[:4] != _LOCAL_SIG:
                raise ValueError(f"{path}: malformed local header for {info.filename}")
            local_name_len, local_extra_len = struct.unpack("<HH", local[26:30])
            data_offset = info.header_offset + 30 + local_name_len + local_extra_len
            if info.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"{path}: record {info.filename} is compressed")
            records[data_offset] = ZipRecord(
                info.filename,
                info.header_offset,
                data_offset,
                info.file_size,
                pos,
                bool(info.flag_bits & 0x08),
            )
            pos += 46 + name_len + extra_len + comment_len
    return records


def patch_crcs(path: str | os.PathLike[str], crcs: dict[ZipRecord, int]) -> None:
    """Write each record's CRC-32 where zip readers look for it."""
    with open(path, "r+b") as f:
        for record, crc in crcs.items():
            packed = struct.pack("<I", crc & 0xFFFFFFFF)
            f.seek(record.central_offset + 16)
            f.write(packed)
            if record.has_descriptor:
                f.seek(record.data_offset + record.size)
                sig = f.read(4)
                f.seek(record.data_offset + record.size + (4 if sig == _DESCRIPTOR_SIG else 0))
                f.write(packed)
            else:
                f.seek(record.header_offset + 14)
                f.write(packed)
