"""The environment of a child process the Python tests start: this checkout's package first
on PYTHONPATH, and none of the shell's VRAMSWAP_* settings but those that locate the build
(the library, cudasim, the extensions' cache and which extension to use), so that a
setting left in the developer's shell never changes what a test measures.

Thread safety: pure (reads os.environ).
"""
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCATING = ("VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR", "VRAMSWAP_CACHE_DIR", "VRAMSWAP_TORCH_EXT")


def child_environment(extra=None):
    """A copy of os.environ as above, with `extra` (a dict) applied last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSWAP_") or k in LOCATING}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra or {})
    return env
