"""Convert an HF-layout checkpoint to an Orbax one (what `checkpoints.load` restores fastest).

    python -m checkpoints.convert --hf DIR --out DIR [--weight-format fp8|bf16] [--force]

Imports with `import_hf` (validated, streamed onto the default device) and saves with `save_orbax`
(DIR/params + DIR/dsv41_config.json). The weight format defaults to the checkpoint's own (FP8/FP4 kept).
"""

from __future__ import annotations

import argparse
import time

import dsv41_jax  # noqa: F401  (sets XLA flags before the backend starts)
from checkpoints.hf_import import import_hf
from checkpoints.orbax_io import save_orbax
from checkpoints.tree import nbytes


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="HF checkpoint directory")
    ap.add_argument("--out", required=True, help="Orbax output directory")
    ap.add_argument("--weight-format", choices=["fp8", "bf16"], default=None)
    ap.add_argument("--force", action="store_true", help="replace an existing Orbax checkpoint in --out")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg, params = import_hf(a.hf, weight_format=a.weight_format)
    t1 = time.perf_counter()
    save_orbax(a.out, cfg, params, overwrite=a.force)
    t2 = time.perf_counter()
    print(f"{a.hf} -> {a.out}: {cfg.weight_format} weights, {nbytes(params) / 2 ** 20:.1f} MiB "
          f"(import {t1 - t0:.1f} s, save {t2 - t1:.1f} s)")


if __name__ == "__main__":
    main()
