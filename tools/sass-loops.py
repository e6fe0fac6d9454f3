#!/usr/bin/env python3
"""Static SASS of generated CUDA kernels: a measurement for machines without a GPU.

    tools/sass-loops.py [--arch sm_90] [--base REV] [FILE.cu ...]
    tools/sass-loops.py [--arch sm_90] --pairs OLD.cu NEW.cu [OLD.cu NEW.cu ...]

Compiles each file with NVRTC (the options the runtime uses), disassembles the cubin with
cuobjdump and prints, per kernel: its instructions, those laid out before the step loop
(the prologue, roughly: the compiler may place other code there too), the step loop's
instructions (the
smallest backward-branch region holding the most HMMA: a static proxy for one pipeline step,
both warp roles' code included; the instructions of loops nested in it, which run many times
a step, are shown apart) and the loop's opcode mix. With --base REV the same files
as of git revision REV are compiled too and each row shows REV -> working tree; with
--pairs the files are taken two at a time, each row OLD -> NEW (two forms of one kernel,
e.g. a lowering option's, written by a test or mla-export).

Default files: the checked-in decode split kernels (cuda/sparse_mla_decode_split_*.cu).

These counts are what the compiler emitted, not what a step issues or how long it waits:
timing needs a GPU (tools/gpu-decode-ab.sh). They say whether a change removed the
instructions it meant to, before a GPU is at hand.

Needs NVRTC 12.8 (tools/test.sh puts it in target/nvrtc) and cuobjdump, from PyPI:
    python3 -m pip install --target target/cuobjdump nvidia-cuda-cuobjdump
(or on PATH, or CUOBJDUMP=path); cuobjdump -sass runs nvdisasm, which must be on PATH:
    python3 -m pip install --target target/nvdisasm nvidia-cuda-nvdisasm
    PATH=$PWD/target/nvdisasm/nvidia/cu13/bin:$PATH
"""
import argparse
import collections
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_nvrtc():
    env = os.environ.get("NVRTC")
    cands = [env] if env else []
    cands += glob.glob(os.path.join(ROOT, "target/nvrtc/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"))
    cands += ["libnvrtc.so.12", "libnvrtc.so"]
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    sys.exit("sass-loops: NVRTC not found: run tools/test.sh once (it installs NVRTC 12.8 into "
             "target/nvrtc), or set NVRTC=/path/libnvrtc.so.12")


def find_cuobjdump():
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    cands += glob.glob(os.path.join(ROOT, "target/cuobjdump/nvidia/*/bin/cuobjdump"))
    for c in cands:
        if c and os.path.isfile(c):
            if not os.access(c, os.X_OK):
                os.chmod(c, 0o755)
            return c
    sys.exit("sass-loops: cuobjdump not found: python3 -m pip install --target "
             "target/cuobjdump nvidia-cuda-cuobjdump (or set CUOBJDUMP=path)")


def compile_cubin(nv, src, arch, name):
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None):
        sys.exit(f"sass-loops: nvrtcCreateProgram failed for {name}")
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-lineinfo"]
    rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    if rc:
        n = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        nv.nvrtcGetProgramLog(prog, log)
        sys.exit(f"sass-loops: {name} does not compile for {arch}:\n{log.value.decode()}")
    n = ctypes.c_size_t()
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetCUBIN(prog, buf)
    return buf.raw


INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def instructions(cuobjdump, cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True,
                             check=True).stdout
    finally:
        os.unlink(path)
    ins = []
    for line in out.splitlines():
        m = INSTR.search(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)))
    return ins


def loops(ins):
    """Backward-branch regions: (first, last) instruction indices."""
    at = {a: i for i, (a, _, _) in enumerate(ins)}
    out = []
    for i, (a, op, rest) in enumerate(ins):
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < a and int(t.group(1), 16) in at:
            out.append((at[int(t.group(1), 16)], i))
    return out


def step_loop(ins):
    """The step loop's instructions, those of the loops nested in it (a loop the compiler
    kept rolled, e.g. over rows: run many times a step, counted once here), and the
    instructions laid out before it (the prologue, with whatever else the compiler placed
    there)."""
    regions = loops(ins)
    best = None
    for j, i in regions:
        h = sum(o == "HMMA" for _, o, _ in ins[j:i + 1])
        if not h:
            continue
        key = (h, -(i - j))
        if best is None or key > best[0]:
            best = (key, (j, i))
    if best is None:
        return [], 0, 0
    j, i = best[1]
    inner = [(a, b) for a, b in regions if j <= a and b <= i and (a, b) != (j, i)]
    covered = set()
    for a, b in inner:
        covered.update(range(a, b + 1))
    return ins[j:i + 1], len(covered), j


def stats(nv, cuobjdump, src, arch, name):
    ins = instructions(cuobjdump, compile_cubin(nv, src, arch, name))
    loop, inner, before = step_loop(ins)
    return len(ins), len(loop), collections.Counter(o for _, o, _ in loop), inner, before


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90", help="NVRTC target (sm_80, sm_89, sm_90, sm_120)")
    ap.add_argument("--base", help="git revision to compare against (the same files there)")
    ap.add_argument("--top", type=int, default=10, help="opcodes shown per loop")
    ap.add_argument("--pairs", action="store_true",
                    help="files are OLD NEW pairs: compare each pair, not against a revision")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    if args.pairs and (args.base or not args.files or len(args.files) % 2):
        sys.exit("sass-loops: --pairs takes OLD.cu NEW.cu pairs (an even number of files) "
                 "and no --base")
    files = args.files or sorted(glob.glob(os.path.join(ROOT, "cuda/sparse_mla_decode_split_*.cu")))
    for f in files:
        if not os.path.isfile(f):
            sys.exit(f"sass-loops: no file {f} (FILE.cu: a generated kernel, e.g. under cuda/)")
    nv, cuobjdump = find_nvrtc(), find_cuobjdump()
    if args.pairs:
        for o, f in zip(files[::2], files[1::2]):
            old = stats(nv, cuobjdump, open(o).read(), args.arch, os.path.basename(o))
            new = stats(nv, cuobjdump, open(f).read(), args.arch, os.path.basename(f))
            compare(f"{os.path.basename(o)} -> {os.path.basename(f)}", args, old, new)
        return
    for f in files:
        name = os.path.basename(f)
        new = stats(nv, cuobjdump, open(f).read(), args.arch, name)
        if not args.base:
            mix = ", ".join(f"{k} {v}" for k, v in new[2].most_common(args.top))
            print(f"{name} [{args.arch}]: {new[0]} instructions, {new[4]} before the step "
                  f"loop, step loop {new[1]} ({new[3]} in inner loops): {mix}")
            continue
        rel = os.path.relpath(os.path.abspath(f), ROOT)
        old_src = subprocess.run(["git", "-C", ROOT, "show", f"{args.base}:{rel}"],
                                 capture_output=True, text=True)
        if old_src.returncode:
            print(f"{name} [{args.arch}]: not in {args.base}; now {new[0]} instructions, "
                  f"{new[4]} before the step loop, step loop {new[1]}")
            continue
        old = stats(nv, cuobjdump, old_src.stdout, args.arch, name)
        compare(name, args, old, new)


def compare(name, args, old, new):
    delta = new[2].copy()
    delta.subtract(old[2])
    moved = sorted(((v, k) for k, v in delta.items() if v), key=lambda x: -abs(x[0]))
    mix = ", ".join(f"{k} {v:+d}" for v, k in moved[:args.top]) or "no opcode moved"
    ratio = f"{new[1] / old[1]:.3f}" if old[1] else "no HMMA loop"
    print(f"{name} [{args.arch}]: {old[0]} -> {new[0]} instructions, before the step "
          f"loop {old[4]} -> {new[4]}, step loop {old[1]} -> {new[1]} ({ratio}; in inner "
          f"loops {old[3]} -> {new[3]}): {mix}")


if __name__ == "__main__":
    main()
