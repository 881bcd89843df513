"""One engine over several hosts (processes) through `jax.distributed`: a driver that schedules and followers
that replay its program calls.

Every process builds the same Engine (same model, seed and flags, so the same weights, mesh and compiled
programs, in the same order). The mesh spans every device of every process; each program is one SPMD
computation, so every process must issue the same calls with the same inputs in the same order. Process 0
(the driver) owns the scheduler, the request queues and the APIs; before each device call it broadcasts a
header (what to run) and the call's host inputs to the followers (`jax.experimental.multihost_utils.
broadcast_one_to_all`, itself a small collective). Followers (`Runner.follow`) loop: receive, run, until the
driver's STOP. Outputs come back replicated to every process (the runner gathers them inside the program), so
the driver reads its own copy.

Flags follow vLLM's multi-node names: --nnodes, --node-rank, --master-addr, --master-port (serving.run).
Supported: TP or DP/DEP over all devices of all processes (one mesh axis), compiled execution, CPU (gloo
collectives, e.g. 2 processes x 2 devices over loopback) and GPU (NCCL). Not supported: recovering from a
failed program call (any failure ends the run: a follower cannot re-join a collective it left), several
engines per process group, reading the DEP overflow counter of other processes' ranks.
"""

from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("serving.engine.multihost")

OP_RUN, OP_SNAP, OP_RESET, OP_STOP = 1, 2, 3, 4
HEADER = 8  # int32 words
BARRIER_MS = 30 * 60 * 1000  # processes may reach the first collective minutes apart (compilation)
_barriers = 0


def barrier(name: str):
    """Wait for every process at the coordination service (no device collective, so no gloo deadline)."""
    global _barriers
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    _barriers += 1
    client.wait_at_barrier(f"dsv41-{name}-{_barriers}", BARRIER_MS)


def initialize(master_addr: str, master_port: int, nnodes: int, node_rank: int, local_devices: int | None = None):
    """Join the process group (before JAX starts a backend). CPU collectives go through gloo."""
    import jax

    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} must be in [0, --nnodes {nnodes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_devices:
        jax.config.update("jax_num_cpu_devices", local_devices)
    jax.distributed.initialize(coordinator_address=f"{master_addr}:{master_port}", num_processes=nnodes,
                               process_id=node_rank)
    log.info("process %d of %d joined %s:%d (%d local / %d global devices)", node_rank, nnodes, master_addr,
             master_port, jax.local_device_count(), jax.device_count())


def active() -> bool:
    import jax

    return jax.process_count() > 1


def spans_processes(mesh) -> bool:
    """True when `mesh` has devices of other processes (its programs need the followers)."""
    import jax

    me = jax.process_index()
    return any(d.process_index != me for d in mesh.devices.flat)


class Channel:
    """The driver -> followers command stream of one runner."""

    def __init__(self, keys: list):
        import jax

        self.keys = list(keys)
        self.index = {k: i for i, k in enumerate(self.keys)}
        self.driver = jax.process_index() == 0
        # handshake now, with every process here: CPU (gloo) collectives set up their connections on first use
        # with a 30 s deadline (so meet at a coordination-service barrier first); later waits are unbounded
        barrier("channel")
        h = np.asarray(self._bcast(np.full(HEADER, len(self.keys), np.int32)))
        if int(h[0]) != len(self.keys):
            raise RuntimeError(f"multi-host: the driver compiled {int(h[0])} programs, this process "
                               f"{len(self.keys)}: every process must run the same engine flags")
    @staticmethod
    def _bcast(tree):
        from jax.experimental.multihost_utils import broadcast_one_to_all

        return broadcast_one_to_all(tree)

    def send(self, op: int, key=None, *args: int, inputs=None):
        h = np.zeros(HEADER, np.int32)
        h[0], h[1] = op, -1 if key is None else self.index[key]
        h[2:2 + len(args)] = args
        self._bcast(h)
        if inputs is not None:
            self._bcast(inputs)

    def receive_header(self):
        h = np.asarray(self._bcast(np.zeros(HEADER, np.int32)))
        key = None if h[1] < 0 else self.keys[int(h[1])]
        return int(h[0]), key, [int(v) for v in h[2:]]

    def receive_inputs(self, template):
        return self._bcast(template)
