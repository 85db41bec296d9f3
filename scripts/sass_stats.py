#!/usr/bin/env python3
r"""Compile a Mosaic GPU kernel's PTX for sm_90a and count its SASS instructions by the pipe that runs them.

Get the PTX from a device run: `MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=<dir>` writes `<kernel>_0.ptx` (jax
0.11.2's PTX is ISA 9.0: ptxas from CUDA 13). Then, where `ptxas` and `cuobjdump` (which needs `nvdisasm`) are on
the PATH (the H200 image: /usr/local/cuda/bin; a CPU machine: the `nvidia-cuda-nvcc`, `nvidia-cuda-cuobjdump` and
`nvidia-cuda-nvdisasm` 13.x wheels, unpacked, their `nvidia/cu13/bin`):

    python3 scripts/sass_stats.py expert_gemm_fp4_0.ptx [--cuda-bin DIR] [--sass-out k.sass] [--region A B]

Prints the registers, the instruction count, and per pipe (Hopper: an SM sub-partition issues one warp instruction
a cycle; the integer ALU and the FMA-heavy pipe that runs IMAD are 16 lanes each, so a warp instruction holds
either for 2 cycles) the opcodes with their counts; with --region, the same for the first stretch of the listing
from an instruction matching regex A to the next matching B (e.g. one pipeline step of the FP4 kernel's compute
warpgroups: from its stage barrier's wait, `SYNCS.PHASECHK.TRANS64.TRYWAIT P3, \[UR4\]`, to the slot's release,
`SYNCS.ARRIVE.TRANS64.A1T0`). What it showed for the FP4 decode is in
docs/KERNELS_EXPERT_GEMM.md ("Twenty-sixth session").
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Hopper pipes by opcode (the base name before the first '.'); NCU's pipe names
PIPES = {
    "alu": {"LOP3", "SHF", "IADD3", "PRMT", "SEL", "ISETP", "MOV", "LEA", "BMSK", "SGXT", "FLO", "POPC", "IABS",
            "IMNMX", "VIMNMX", "FSEL", "FSETP", "PLOP3", "P2R", "R2P", "BREV"},
    "fma": {"IMAD", "HMUL2", "HFMA2", "HADD2", "FMUL", "FFMA", "FADD", "IDP", "IMUL"},
    "lsu": {"LDS", "STS", "LDG", "STG", "LD", "ST", "LDSM", "STSM", "ATOMS", "ATOMG", "RED", "ATOM", "SHFL"},
    "tensor": {"HGMMA", "HMMA", "WARPGROUP"},
    "uniform": {"UMOV", "UIADD3", "USHF", "ULEA", "ULOP3", "UISETP", "UIMAD", "USEL", "UPRMT", "R2UR", "S2UR",
                "VOTEU", "UBMSK", "USGXT", "UFLO", "UPOPC", "ULDC"},
}


def pipe_of(op: str) -> str:
    base = op.split(".")[0]
    return next((p for p, ops in PIPES.items() if base in ops), "other")


def sass_of(ptx: str, cuda_bin: str | None, sass_out: str | None) -> tuple[str, str]:
    env = dict(os.environ)
    if cuda_bin:
        env["PATH"] = cuda_bin + os.pathsep + env["PATH"]
    if not os.path.isfile(ptx):
        sys.exit(f"{ptx}: no such PTX file (dump one with MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=<dir>)")
    for tool in ("ptxas", "cuobjdump", "nvdisasm"):
        if shutil.which(tool, path=env["PATH"]) is None:
            sys.exit(f"{tool} is not on the PATH: pass --cuda-bin with the directory of CUDA 13's ptxas, cuobjdump "
                     f"and nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        r = subprocess.run(["ptxas", "-arch=sm_90a", "-O3", "-v", ptx, "-o", cubin], capture_output=True, text=True,
                           env=env)
        if r.returncode:
            sys.exit(f"ptxas failed on {ptx}:\n{r.stderr[-2000:]}")
        s = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, env=env)
        if s.returncode:
            sys.exit(f"cuobjdump failed:\n{s.stderr[-2000:]}")
    if sass_out:
        with open(sass_out, "w") as fh:
            fh.write(s.stdout)
    return r.stderr, s.stdout


def opcodes(sass: str) -> list[str]:
    """The opcode (with its modifiers) of every instruction line of cuobjdump's listing, predicates dropped."""
    return re.findall(r"^\s+/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P[0-9T] )?([A-Za-z0-9_.]+)", sass, re.M)


def region(sass: str, start: str, end: str) -> str:
    """The listing from the first instruction line matching `start` to the next one matching `end`."""
    lines = sass.splitlines()
    i = next((n for n, line in enumerate(lines) if re.search(start, line)), None)
    if i is None:
        sys.exit(f"no instruction matches {start!r}")
    j = next((n for n in range(i + 1, len(lines)) if re.search(end, lines[n])), None)
    if j is None:
        sys.exit(f"no instruction after the start matches {end!r}")
    return "\n".join(lines[i:j + 1])


def print_pipes(title: str, ops: list[str]):
    by_pipe: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for op in ops:
        by_pipe[pipe_of(op)][op] += 1
    print(f"{title}: {len(ops)} instructions")
    for pipe in (*PIPES, "other"):
        c = by_pipe.get(pipe)
        if c:
            print(f"  {pipe:<8}{sum(c.values()):>6}  " + ", ".join(f"{op} {n}" for op, n in c.most_common(12)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx")
    ap.add_argument("--cuda-bin", help="directory holding ptxas, cuobjdump and nvdisasm (else the PATH's)")
    ap.add_argument("--sass-out", help="also write the SASS listing here")
    ap.add_argument("--region", nargs=2, metavar=("START", "END"), help="also count the first stretch from an "
                    "instruction matching regex START to the next matching END")
    a = ap.parse_args()
    log, sass = sass_of(a.ptx, a.cuda_bin, a.sass_out)
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    spilled = f", spills: {spills.group(1)} B stored, {spills.group(2)} B loaded" if spills else ""
    print_pipes(f"{os.path.basename(a.ptx)} ({regs.group(1) if regs else '?'} registers{spilled})", opcodes(sass))
    for line in log.splitlines():  # ptxas's own notes, e.g. wgmma serialized
        if "warning" in line.lower() or "Performance" in line:
            print("  ptxas:", line.strip())
    if a.region:
        print_pipes(f"region {a.region[0]!r} .. {a.region[1]!r}", opcodes(region(sass, *a.region)))


if __name__ == "__main__":
    main()
