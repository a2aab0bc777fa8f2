#!/usr/bin/env python3
"""Blank the GPU code for other architectures out of CUDA fat binaries, in place.

    fatbin_keep_arch.py [--arch 90] [--dry-run] LIB.so...

A CUDA library's .nv_fatbin section holds, for each kernel bundle, one cubin (SASS) per target
architecture and sometimes PTX (its __nv_relfatbin section, where it has one, holds the same as
relocatable code for device linking, and is treated the same way). A GPU of compute capability
9.0 (H100/H200) can only run sm_90 (or sm_90a) SASS, or PTX of compute_90 or lower, which the
driver compiles. This script keeps exactly those entries. Every other entry (sm_75/80/86/89/100/
120 SASS, PTX above compute_90) gets the payload of the smallest entry of its own kind,
architecture and flags in the same library, padded with zeros: it stays a valid (compressed)
cubin for its architecture, so anything that reads every entry, as cuobjdump does, still reads
the whole fat binary, but it holds that small donor's code instead of its own. Nothing moves: the
section and every entry keep their size and offset, and kind and architecture stay in every
header, so the library loads and links as before and the driver's choice on a 9.0 GPU is the
same entry as before; the zeros compress to nothing.

Checked here with cuobjdump 13.1 (from the triton wheel): the listing is unchanged, and every
kept cubin and PTX extracts byte for byte as from the original. Not checked here: a run on a GPU
(preflight_sm90.sh does that with the GPU machine's own torch).

Fatbin layout (as in cuobjdump and the open decompressors):
  container: u32 magic 0xBA55ED50, u16 version, u16 header_size, u64 payload_size
  entry:     u16 kind (1 PTX, 2 ELF), u16 ?, u32 header_size, u64 payload_size, ...,
             u32 arch at byte 28; the payload follows the entry header.
"""

import argparse
import mmap
import struct
import sys

MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


SECTIONS = (b".nv_fatbin", b"__nv_relfatbin")  # loadable code; relocatable code for device linking


def fatbin_sections(f):
    """[(offset, size)] of the fat binary sections of an ELF64 little-endian file; [] if it has
    none or is no such file."""
    f.seek(0)
    ident = f.read(64)
    if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2 or ident[5] != 1:
        return []
    (e_shoff,) = struct.unpack_from("<Q", ident, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", ident, 0x3A)
    f.seek(e_shoff)
    shdrs = f.read(e_shentsize * e_shnum)
    secs = [struct.unpack_from("<IIQQQQIIQQ", shdrs, i * e_shentsize) for i in range(e_shnum)]
    stroff, strsize = secs[e_shstrndx][4], secs[e_shstrndx][5]
    f.seek(stroff)
    names = f.read(strsize)
    return [
        (s[4], s[5])
        for s in secs
        if names[s[0] : names.index(b"\0", s[0])] in SECTIONS and s[1] != 8
    ]  # 8: NOBITS


def payload_used(mm, head):
    """Bytes of an entry's payload that hold data: the compressed size for a compressed entry
    (u32 at +16), else the whole payload (the rest is padding)."""
    ehsize, psize, csize = struct.unpack_from("<IQI", mm, head + 4)
    return csize if csize else psize


def blank(mm, head, donor):
    """Replace the payload of the entry whose header is at `head` by the donor entry's (a small
    entry of the same kind, architecture and header size), padded with zeros to the same size,
    and take the donor's header but for the payload size. The entry stays a valid cubin (or PTX)
    for its architecture, so tools that read every entry, such as cuobjdump, read the whole fat
    binary; its code is the donor's."""
    ehsize, psize = struct.unpack_from("<IQ", mm, head + 4)
    used = payload_used(mm, donor)
    header = bytearray(mm[donor : donor + ehsize])
    struct.pack_into("<Q", header, 8, psize)
    payload = mm[donor + ehsize : donor + ehsize + used]
    mm[head : head + ehsize] = bytes(header)
    mm[head + ehsize : head + ehsize + psize] = payload + bytes(psize - used)


def usable(kind, arch, keep):
    """SASS for exactly this architecture (sm_90 and sm_90a share arch 90), or PTX up to it."""
    return arch == keep if kind == KIND_ELF else arch <= keep


def entries_of(mm, off, size, path):
    """Yield (kind, arch, header offset, payload size) for every entry of every container."""
    pos, end = off, off + size
    while pos + 16 <= end:
        magic, _ver, hsize, psize = struct.unpack_from("<IHHQ", mm, pos)
        if magic != MAGIC:
            pos += 8  # padding between containers
            continue
        cend = pos + hsize + psize
        if cend > end:
            raise ValueError(f"{path}: fatbin container at {pos:#x} runs past the section")
        p = pos + hsize
        while p + 64 <= cend:
            kind, _u, ehsize, epsize = struct.unpack_from("<HHIQ", mm, p)
            (arch,) = struct.unpack_from("<I", mm, p + 28)
            if kind not in (KIND_PTX, KIND_ELF) or ehsize < 64 or p + ehsize + epsize > cend:
                raise ValueError(f"{path}: unexpected fatbin entry at {p:#x} (kind {kind})")
            yield kind, arch, p, epsize
            p += ehsize + epsize
        pos = cend + (-(cend - off) % 8)


def process(path, keep, dry_run):
    """Returns (bytes blanked, bytes kept for `keep`, bytes of other entries left as they were)."""
    with open(path, "rb" if dry_run else "r+b") as f:
        secs = fatbin_sections(f)
        if not secs:
            return 0, 0, 0
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ if dry_run else mmap.ACCESS_WRITE)
        entries = [e for sec in secs for e in entries_of(mm, *sec, path)]

        def key(head, kind, arch):  # same kind, arch, header size and flags
            return kind, arch, bytes(mm[head + 4 : head + 8]), bytes(mm[head + 40 : head + 48])

        donors = {}  # the smallest entry of each key
        for kind, arch, head, n in entries:
            k = key(head, kind, arch)
            if k not in donors or n < donors[k][1]:
                donors[k] = (head, n)
        blanked = kept = other = 0
        for kind, arch, head, n in entries:
            if usable(kind, arch, keep):
                kept += n
                continue
            donor = donors[key(head, kind, arch)][0]
            if donor == head or payload_used(mm, donor) > n:
                other += n
                continue
            blanked += n
            if not dry_run:
                blank(mm, head, donor)
        if not dry_run:
            mm.flush()
        mm.close()
        return blanked, kept, other


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("libs", nargs="+")
    args = ap.parse_args()
    for lib in args.libs:
        b, k, o = process(lib, args.arch, args.dry_run)
        print(
            f"{lib}: blanked {b / 2**20:.1f} MiB, kept {k / 2**20:.1f} MiB for sm_{args.arch}, "
            f"left {o / 2**20:.1f} MiB of other entries (the smallest of their kind) as they were"
        )


if __name__ == "__main__":
    sys.exit(main())
