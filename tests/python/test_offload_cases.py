#!/usr/bin/python3
"""The tracker under the autograd patterns training loops use besides a plain step, on real
autograd in the CPU-emulation mode: activation checkpointing (non-reentrant and reentrant),
two-microbatch gradient accumulation (interleaved, and two graphs alive at once) and nested
offload scopes.

Each case (harness.py describes them and the child processes) trains models.build()'s
transformer with VRAMSWAP_LIMIT at LIMIT_PERCENT[case] of the case's own peak without
offload, and checks that every loss and gradient is bit-identical to the run without
vramswap, that blocks were evicted and prefetched back, that the peak stayed within the
limit and that every handle was released.

Usage: python3 tests/python/test_offload_cases.py [CASE...]   (default: all; exit status 0:
every check held)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

HORIZON = 2
LIMIT_PERCENT = {  # of each case's peak without offload
    "checkpoint": 50,
    "checkpoint_reentrant": 50,
    "accum_interleaved": 50,
    "accum_two_forwards": 50,
    "nested": 50,
}

if __name__ == "__main__":
    sys.exit(harness.main(__file__, sys.argv[1:], LIMIT_PERCENT, HORIZON))
