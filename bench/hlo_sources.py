"""Trace a profile's GPU kernels back to the JAX source lines they came from, through XLA's HLO dump.

XLA names the kernel of a fusion after the fusion instruction (`input_reduce_fusion.191` runs as
`input_reduce_fusion_191`), and every instruction of the optimized HLO carries the `metadata` of the JAX
operation it came from (`op_name`, `source_file`, `source_line`). So with `--xla_dump_to=DIR
--xla_dump_hlo_as_text`, each kernel of a trace maps to one source line. Kernels that are not fusions (Pallas
kernels, which carry their own names, memcpys, sorts) keep their kernel name as their source.

Where a name occurs in several dumped modules, the largest module (the decode program of bench/profile_decode.py)
wins. Used by `python -m bench.profile_decode --sources DIR`; bench/profile_train_step.py maps its kernels to the
model's named scopes with the same parser (`instruction_metadata`).
"""

from __future__ import annotations

import collections
import glob
import os
import re

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?metadata=\{([^}]*)\}")
_FIELD = re.compile(r'(op_name|source_file|source_line|stack_frame_id)=("([^"]*)"|(\d+))')
_TABLE_ROW = re.compile(r'^(\d+) (?:"(.*)"|\{(.*)\})\s*$')
_KV = re.compile(r"(\w+)=(\d+)")
_FRAMES_SHOWN = 3  # innermost repo frames named in a source
_REPO_DIRS = ("dsv41_jax/", "pallas_kernels/", "serving/", "checkpoints/", "bench/", "training/")


def _short_file(path: str) -> str:
    for d in _REPO_DIRS:
        i = path.rfind(d)
        if i >= 0:
            return path[i:]
    return os.path.basename(path)


class _Frames:
    """The module header's FileNames / FileLocations / StackFrames tables (newer XLA writes `stack_frame_id`
    in the metadata instead of source_file / source_line)."""

    def __init__(self):
        self.tables: dict[str, dict[int, object]] = collections.defaultdict(dict)
        self.section = ""

    def feed(self, line: str) -> bool:
        """True while `line` belongs to the header tables."""
        word = line.strip()
        if word in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            self.section = word
            return True
        m = _TABLE_ROW.match(word) if self.section else None
        if m:
            self.tables[self.section][int(m.group(1))] = (m.group(2) if m.group(2) is not None
                                                          else {k: int(v) for k, v in _KV.findall(m.group(3))})
            return True
        if word:
            self.section = ""
        return False

    def chain(self, frame_id: int) -> list[str]:
        """'file:line' of the frame and its callers, innermost first, repo files only."""
        out, seen = [], set()
        frames, locs, files = (self.tables["StackFrames"], self.tables["FileLocations"], self.tables["FileNames"])
        while frame_id in frames and frame_id not in seen and len(out) < _FRAMES_SHOWN:
            seen.add(frame_id)
            fr = frames[frame_id]
            loc = locs.get(fr.get("file_location_id"), {})
            path = files.get(loc.get("file_name_id"), "?")
            if any(d in path for d in _REPO_DIRS):
                out.append(f"{_short_file(path)}:{loc.get('line', '?')}")
            parent = fr.get("parent_frame_id")
            if parent is None or parent == frame_id:
                break
            frame_id = parent
        return out


def _fields(meta: str) -> dict[str, str]:
    return {m.group(1): m.group(3) if m.group(3) is not None else m.group(4) for m in _FIELD.finditer(meta)}


def _source(f: dict[str, str], frames: _Frames) -> str:
    op = f.get("op_name", "").rsplit("/", 1)[-1]
    if "source_file" in f:
        return f"{_short_file(f['source_file'])}:{f.get('source_line', '?')} {op}".strip()
    if "stack_frame_id" in f:
        chain = frames.chain(int(f["stack_frame_id"]))
        if chain:
            return f"{' < '.join(chain)} {op}".strip()
    return op or "?"


def kernel_name(instruction: str) -> str:
    """The GPU kernel name of an HLO instruction (dots and dashes as underscores)."""
    return instruction.replace(".", "_").replace("-", "_")


def instruction_metadata(lines) -> dict[str, tuple[str, str]]:
    """One optimized HLO module's text (an iterable of lines) -> {kernel name: (full op_name, source)} of every
    instruction with metadata (also bench/profile_train_step.py's map from kernels to the model's scopes)."""
    frames, out = _Frames(), {}
    for line in lines:
        if frames.feed(line):
            continue
        m = _INSTR.match(line)
        if m:
            f = _fields(m.group(2))
            out[kernel_name(m.group(1))] = (f.get("op_name", ""), _source(f, frames))
    return out


def instruction_sources(dump_dir: str) -> dict[str, str]:
    """kernel name -> source of the instruction, over every optimized module of the dump, the largest module's
    entry winning."""
    files = sorted(glob.glob(os.path.join(dump_dir, "*after_optimizations.txt")), key=os.path.getsize)
    out: dict[str, str] = {}
    for path in files:  # smallest first: the largest module overwrites
        with open(path, errors="replace") as fh:
            out.update({k: src for k, (_, src) in instruction_metadata(fh).items()})
    return out


def by_source(rows: list[dict], dump_dir: str) -> list[dict]:
    """Profile rows ({kernel, count_per_step, us_per_step}) grouped by source line, most time first."""
    src = instruction_sources(dump_dir)
    agg = collections.defaultdict(lambda: [0.0, 0.0, set()])
    for r in rows:
        key = src.get(r["kernel"], r["kernel"])
        a = agg[key]
        a[0] += r["count_per_step"]
        a[1] += r["us_per_step"]
        a[2].add(r["kernel"])
    out = [{"source": k, "count_per_step": round(c, 1), "us_per_step": round(us, 1), "kernels": len(names)}
           for k, (c, us, names) in agg.items()]
    return sorted(out, key=lambda r: -r["us_per_step"])
