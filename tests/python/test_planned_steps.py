#!/usr/bin/python3
"""Planned eviction on real autograd, in the CPU-emulation mode: three training steps of
models.build()'s transformer (forward under vramswap.offload(), backward, an SGD update)
with VRAMSWAP_LIMIT at half the run's peak without offload. vramswap records the first
step and follows its plan from the second on (VRAMSWAP_PLAN=auto, the default).

Checks (beside harness.py's: bit-identical losses and gradients, evictions, prefetches, the
limit, every handle released): the second and third steps followed the plan
(num_planned_steps >= 2, no divergence) and the plan's evictions moved bytes.

Usage: python3 tests/python/test_planned_steps.py   (exit status 0: every check held)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

HORIZON = 2
LIMIT_PERCENT = {"train3": 50}


def extra_checks(check, runs):
    s = runs["train3"][3]["stats"]
    check(s["num_planned_steps"] >= 2, f"train3: steps 2 and 3 followed the plan (num_planned_steps "
          f"{s['num_planned_steps']})")
    check(s["num_plan_divergences"] == 0, f"train3: no step diverged ({s['num_plan_divergences']})")
    check(s["planned_bytes_d2h"] > 0, f"train3: the plan's evictions moved {s['planned_bytes_d2h']} bytes")


if __name__ == "__main__":
    sys.exit(harness.main(__file__, sys.argv[1:], LIMIT_PERCENT, HORIZON, extra_checks=extra_checks))
