"""The sides of the AgentX A/B: EngineArgs-named overrides of the server's defaults, and their flags.

`DAY0` is the day-0 baseline, defined once here as what a straightforward compiled port would have been:
compiled fixed-shape programs, XLA's ops, exact SWA snapshots instead of bounded replay (the decoder on every
prompt row), no long-prefill threshold, no prefill interval, and each step collected before the next is
scheduled (no async scheduling). `DAY0_EAGER` is the same with eager execution (the step under
`jax.disable_jit()`), the first baseline, kept as its own side. `OPTIMISED` = the server's defaults; `EXACT` =
the defaults but exact SWA snapshots (isolates bounded replay's share).
"""

from __future__ import annotations

DAY0 = {"swa_bounded_replay": False, "kernels": "xla", "long_prefill_token_threshold": 0,
        "prefill_schedule_interval": 1, "async_scheduling": False}
DAY0_EAGER = {**DAY0, "execution": "eager"}
OPTIMISED: dict = {}  # the server defaults
EXACT = {"swa_bounded_replay": False}  # the defaults but exact SWA snapshots: isolates bounded replay's share
SIDES = {"day0": DAY0, "day0-eager": DAY0_EAGER, "exact": EXACT, "optimised": OPTIMISED}


def server_flags(overrides: dict) -> list[str]:
    """EngineArgs-named overrides as `python -m serving.run` flags (booleans as --x / --no-x)."""
    out = []
    for k, v in overrides.items():
        name = k.replace("_", "-")
        if isinstance(v, bool):
            out.append(f"--{name}" if v else f"--no-{name}")
        else:
            out += [f"--{name}", str(v)]
    return out
