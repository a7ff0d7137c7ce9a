#!/usr/bin/python3
"""Independent writer of Megatron indexed datasets (.bin/.idx, "MMIDIDX" version 1) for forge's tests.

Written from the format description alone (docs/formats.md, "Megatron indexed datasets"), with the
standard library and numpy, so that forge's C++ reader and writer are checked against a second
implementation:

  .idx  magic b"MMIDIDX\\x00\\x00" | u64 version = 1 | u8 dtype code | u64 sequence count S
        | u64 document-index count D | int32 lengths[S] | int64 byte offsets[S] | int64 document indices[D]
  .bin  the sequences' tokens back to back in the dtype

Dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.

Usage:
  /usr/bin/python3 tests/reference/megatron_indexed.py          # rewrite tests/fixtures/megatron/*
  /usr/bin/python3 tests/reference/megatron_indexed.py --check  # verify the committed files are current
"""

import argparse
import json
import os
import struct
import sys

import numpy as np

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "megatron")

DTYPE_CODES = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "float64": 6, "float32": 7, "uint16": 8}

# Each dataset: its token dtype and its documents; a document is a list of sequences (lists of token ids).
# They include the extremes of each dtype, a document of two sequences and an empty sequence.
DATASETS = {
    "tiny_uint16": {
        "dtype": "uint16",
        "documents": [
            [[0, 1, 2, 3, 4]],
            [[65535, 100, 7]],
            [[9], [10, 11]],
            [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]],
            [[31000, 2]],
        ],
    },
    "tiny_int32": {
        "dtype": "int32",
        "documents": [
            [[100000, 1, 2147483647]],
            [[0], []],
            [[70000, 70001, 70002, 70003]],
        ],
    },
}


def encode(dtype_name, documents):
    """Returns (bin bytes, idx bytes) for the documents."""
    dtype = np.dtype(dtype_name).newbyteorder("<")
    sequences = [seq for doc in documents for seq in doc]
    data = b"".join(np.asarray(seq, dtype=dtype).tobytes() for seq in sequences)

    lengths = [len(seq) for seq in sequences]
    offsets, position = [], 0
    for length in lengths:
        offsets.append(position)
        position += length * dtype.itemsize
    assert position == len(data)
    # Document boundaries as sequence indices: 0, then the end of every document.
    boundaries, count = [0], 0
    for doc in documents:
        count += len(doc)
        boundaries.append(count)

    index = b"MMIDIDX\x00\x00"
    index += struct.pack("<Q", 1)
    index += struct.pack("<B", DTYPE_CODES[dtype_name])
    index += struct.pack("<Q", len(lengths))
    index += struct.pack("<Q", len(boundaries))
    index += np.asarray(lengths, dtype="<i4").tobytes()
    index += np.asarray(offsets, dtype="<i8").tobytes()
    index += np.asarray(boundaries, dtype="<i8").tobytes()
    return data, index


def decode(data, index):
    """Reads the files back with an independent parser (used by --check)."""
    assert index[:9] == b"MMIDIDX\x00\x00"
    version, code, count, doc_count = struct.unpack_from("<QBQQ", index, 9)
    assert version == 1
    name = {v: k for k, v in DTYPE_CODES.items()}[code]
    at = 34
    lengths = np.frombuffer(index, dtype="<i4", count=count, offset=at)
    at += 4 * count
    offsets = np.frombuffer(index, dtype="<i8", count=count, offset=at)
    at += 8 * count
    boundaries = np.frombuffer(index, dtype="<i8", count=doc_count, offset=at)
    assert at + 8 * doc_count == len(index)
    dtype = np.dtype(name).newbyteorder("<")
    sequences = [
        np.frombuffer(data, dtype=dtype, count=int(n), offset=int(o)).tolist() for n, o in zip(lengths, offsets)
    ]
    return name, [sequences[boundaries[i] : boundaries[i + 1]] for i in range(len(boundaries) - 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify the committed fixtures instead of writing")
    args = parser.parse_args()

    listing = json.dumps(DATASETS, indent=1, sort_keys=True) + "\n"
    files = {"documents.json": listing.encode()}
    for name, spec in DATASETS.items():
        data, index = encode(spec["dtype"], spec["documents"])
        assert decode(data, index) == (spec["dtype"], spec["documents"])
        files[name + ".bin"] = data
        files[name + ".idx"] = index

    if args.check:
        stale = []
        for name, content in files.items():
            path = os.path.join(FIXTURE_DIR, name)
            if not os.path.exists(path) or open(path, "rb").read() != content:
                stale.append(name)
        if stale:
            print("stale or missing fixtures: " + ", ".join(stale))
            return 1
        print(f"{len(files)} fixtures are current")
        return 0

    os.makedirs(FIXTURE_DIR, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(FIXTURE_DIR, name), "wb") as f:
            f.write(content)
        print(f"wrote {name} ({len(content)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
