"""The one home for sharding: mesh axis names, the parallel layouts (TP, DP, DEP), the rules that map
parameters' logical axes onto a mesh, and the start-up checks of a layout against a model config.

Every parameter leaf carries logical axis names (dsv41_jax.params.tensor_specs: "layers", "experts",
"expert_inter", "q_heads", "embed", ...). A rule table maps a logical name to a mesh axis; `partition_spec`
turns a leaf's logical axes into a PartitionSpec. Code that places parameters (checkpoints, the engine) and
the sharded ops (dsv41_jax.parallel, called only through dsv41_jax.ops) use these tables, never parameter
names.

Layouts (`Parallel`; one mesh axis each, built by the engine from its flags):
- "tp" (--tensor-parallel-size N, axis "tensor"): attention and indexer heads, WO-A output groups, WO-B input
  columns and the routed + shared experts' intermediate dim are split; everything else (the single latent
  KV and its pages, norms, mHC, gate, embeddings, head, Engram) is replicated.
- "dp" (--data-parallel-size N, axis "data"): every rank holds a full replica and owns its requests; with
  `ep` (--enable-expert-parallel, "DEP") the routed experts are split over the same ranks instead.
Invariant: when `check_layout` accepts (cfg, layout) every split dim divides evenly, FP8 / MXFP4 scale blocks
never straddle two ranks, and the FP8 activation blocks of a row-parallel GEMM stay inside one rank, so the
sharded ops compute exactly the single-device numbers up to the order of the cross-rank sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

# mesh axis names
EXPERT = "expert"  # expert parallelism (checkpoint tools' meshes: experts split across devices)
TENSOR = "tensor"  # tensor parallelism (heads / intermediate dims split)
DATA = "data"  # data-parallel attention ranks (DP / DEP)

# logical axis -> mesh axis for meshes built without a layout (the checkpoint tools): experts split over the
# "expert" axis (or the mesh's only axis), everything else replicated.
DEFAULT_RULES: dict[str, str] = {"experts": EXPERT}

TP_RULES: dict[str, str] = {
    "q_heads": TENSOR,  # wq_b rows (column-parallel)
    "heads": TENSOR,  # attention sinks
    "index_heads": TENSOR,  # indexer wq_b rows
    "index_head_weights": TENSOR,  # indexer weights_proj rows
    "o_groups": TENSOR,  # WO-A rows (per output group) and WO-B columns (row-parallel, psum)
    "expert_inter": TENSOR,  # routed + shared experts: w1/w3 rows, w2 columns (psum)
}
A2A_CHOICES = ("auto", "ragged", "padded", "emulated")


@dataclass(frozen=True)
class Parallel:
    """A parallel layout: mode "tp" or "dp" over `size` devices (one mesh axis).

    ep: (dp) routed experts split across the ranks, dispatched with all-to-all (DEP).
    a2a: the expert dispatch transport: "ragged" (lax.ragged_all_to_all: GPU), "padded" (all_to_all of
         capacity-padded blocks: every backend), "emulated" (ragged semantics built from all_gather: CPU tests
         of the ragged bookkeeping), "auto" (ragged on GPU, padded elsewhere; resolved by `resolved`).
    capacity_factor: rows each rank may receive per call, as a multiple of its own routed rows (n*k);
         0 = lossless (the worst case: every rank sends everything to one rank). Rows beyond it are dropped
         and counted (the engine's `moe_dropped_tokens`)."""
    mode: str = "tp"
    size: int = 1
    ep: bool = False
    a2a: str = "auto"
    capacity_factor: float = 0.0

    def __post_init__(self):
        if self.mode not in ("tp", "dp"):
            raise ValueError(f"parallel mode must be 'tp' or 'dp', got {self.mode!r}")
        if self.size < 1:
            raise ValueError(f"parallel size must be >= 1, got {self.size}")
        if self.ep and self.mode != "dp":
            raise ValueError("expert parallelism runs over the data-parallel ranks (DEP); under tensor parallelism "
                             "the experts are split on their intermediate dim")
        if self.a2a not in A2A_CHOICES:
            raise ValueError(f"all-to-all backend must be one of {A2A_CHOICES}, got {self.a2a!r}")
        if self.capacity_factor < 0:
            raise ValueError("the MoE capacity factor must be >= 0 (0: lossless)")

    @staticmethod
    def from_flags(tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                   force_mesh: bool = False, **kw) -> Parallel | None:
        """The layout of the engine flags; None for the plain single-device path (no mesh at all)."""
        tp, dp, ep = tensor_parallel_size, data_parallel_size, enable_expert_parallel
        if tp < 1 or dp < 1:
            raise ValueError("--tensor-parallel-size and --data-parallel-size must be >= 1")
        if tp > 1 and dp > 1:
            raise ValueError(f"tensor parallelism with data parallelism (TP {tp} x DP {dp}) is not supported: use "
                             "--tensor-parallel-size N (low latency) or --data-parallel-size N "
                             "--enable-expert-parallel (throughput)")
        if tp > 1 and ep:
            raise ValueError("--enable-expert-parallel needs --data-parallel-size (DEP); under "
                             "--tensor-parallel-size the experts are split on their intermediate dim")
        if tp > 1:
            return Parallel("tp", tp, **kw)
        if dp > 1 or ep:
            return Parallel("dp", dp, ep=ep, **kw)
        return Parallel("tp", 1, **kw) if force_mesh else None

    @property
    def axis(self) -> str:
        return TENSOR if self.mode == "tp" else DATA

    @property
    def rules(self) -> dict[str, str]:
        if self.mode == "tp":
            return dict(TP_RULES)
        return {"experts": DATA} if self.ep else {}

    def resolved(self, backend: str) -> Parallel:
        """`a2a="auto"` made concrete for a backend ("gpu" / "cuda" / "cpu" / ...)."""
        if self.a2a != "auto":
            return self
        ragged = backend in ("gpu", "cuda", "rocm")
        return Parallel(self.mode, self.size, self.ep, "ragged" if ragged else "padded", self.capacity_factor)

    def describe(self) -> str:
        if self.mode == "tp":
            return f"TP{self.size}"
        return f"{'DEP' if self.ep else 'DP'}{self.size}"

    def mesh(self, devices=None) -> Mesh:
        """A one-axis mesh over the first `size` devices (Auto axis type: shard_map reshards mismatched inputs
        instead of failing)."""
        import jax

        devs = list(jax.devices() if devices is None else devices)
        if len(devs) < self.size:
            raise ValueError(f"{self.describe()} needs {self.size} devices, {len(devs)} visible")
        return Mesh(np.array(devs[:self.size]), (self.axis,), axis_types=(AxisType.Auto,))

    def abstract_mesh(self) -> AbstractMesh:
        """The same mesh without devices (ahead-of-time lowering for device counts this host does not have)."""
        return AbstractMesh((self.size,), (self.axis,), axis_types=(AxisType.Auto,))


# ----------------------------------------------------------------------------- specs
def resolve_axis(mesh, axis: str, fallback_first: bool = True) -> str | None:
    """A rule's mesh axis if the mesh has it; otherwise the mesh's first axis (single-axis meshes built
    without names, as the checkpoint tools make) when `fallback_first`, else None."""
    if axis in mesh.axis_names:
        return axis
    return mesh.axis_names[0] if fallback_first and len(mesh.axis_names) == 1 else None


def partition_spec(axes: tuple, shape: tuple, mesh, rules: dict[str, str] | None = None,
                   strict: bool = False) -> PartitionSpec:
    """A leaf's PartitionSpec. A dim whose size the mesh axis does not divide is replicated, or (strict, the
    parallel layouts) raises ValueError: a silently replicated dim would break the sharded ops' specs."""
    fallback = rules is None
    rules = DEFAULT_RULES if rules is None else rules
    spec, used = [], set()
    for name, size in zip(axes, shape):
        target = rules.get(name) if name is not None else None
        ax = resolve_axis(mesh, target, fallback_first=fallback) if target else None
        if ax is not None and size % mesh.shape[ax] and strict:
            raise ValueError(f"logical axis {name!r} of size {size} does not divide over {ax}={mesh.shape[ax]}")
        if ax is None or ax in used or size % mesh.shape[ax]:
            spec.append(None)
        else:
            spec.append(ax)
            used.add(ax)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def named_sharding(axes: tuple, shape: tuple, mesh, rules: dict[str, str] | None = None,
                   strict: bool = False) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(axes, shape, mesh, rules, strict))


def param_partition_specs(cfg, par: Parallel, mesh) -> dict:
    """A pytree of PartitionSpecs shaped like the parameters of `cfg` under layout `par`."""
    import jax

    from dsv41_jax.params import abstract_params, param_axes

    return jax.tree.map(lambda a, x: partition_spec(a, x.shape, mesh, par.rules, strict=True), param_axes(cfg),
                        abstract_params(cfg), is_leaf=lambda v: isinstance(v, tuple))


# ----------------------------------------------------------------------------- start-up checks
def check_layout(cfg, par: Parallel | None, n_devices: int | None = None, process_count: int = 1):
    """Raise ValueError with the flag and the model dim at fault unless `par` can run `cfg` on `n_devices`."""
    if par is None:
        return
    n = par.size
    flag = "--tensor-parallel-size" if par.mode == "tp" else "--data-parallel-size"
    if n_devices is not None and n > n_devices:
        raise ValueError(f"{par.describe()}: {flag} {n} is more ranks than devices ({n_devices} visible)")
    if process_count > 1 and n_devices is not None and n != n_devices:
        raise ValueError(f"multi-host: {flag} {n} must use every device of the {process_count} processes "
                         f"({n_devices})")
    fp8 = cfg.weight_format == "fp8"

    def need(ok, what):
        if not ok:
            raise ValueError(f"{par.describe()}: {flag} {n} {what}")

    if par.mode == "tp":
        H, d, G, oL = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
        Hi, di, I = cfg.index_n_heads, cfg.index_head_dim, cfg.moe_inter_dim
        need(H % n == 0, f"must divide n_heads ({H})")
        need(G % n == 0, f"must divide o_groups ({G}): WO-A is split by output group")
        need(Hi % n == 0, f"must divide index_n_heads ({Hi})")
        need(I % n == 0, f"must divide moe_inter_dim ({I})")
        if fp8:  # FP8 / MXFP4 scale blocks of 32 and the FP8 activation blocks must not straddle ranks
            for size, name in ((H * d, "n_heads*head_dim"), (G * oL, "o_groups*o_lora_rank"),
                               (Hi * di, "index_n_heads*index_head_dim"), (I, "moe_inter_dim")):
                need(size % (32 * n) == 0, f"must divide {name} ({size}) into multiples of 32 (FP8 blocks)")
    elif par.ep:
        E = cfg.n_routed_experts
        need(E % n == 0, f"must divide n_routed_experts ({E}) (--enable-expert-parallel)")
    from dsv41_jax.params import param_specs

    shape = {par.axis: n}
    for path, leaf in param_specs(cfg).items():  # the safety net: every leaf splits evenly
        for name, size in zip(leaf.axes, leaf.shape):
            if par.rules.get(name) in shape and size % n:
                raise ValueError(f"{par.describe()}: parameter {'.'.join(map(str, path))} dim {name!r} ({size}) "
                                 f"does not divide by {n}")
