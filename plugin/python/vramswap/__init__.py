"""vramswap for PyTorch: saved activations evicted to host memory under pressure.

What exists so far (see DESIGN.md, "Who uses it and how"):
  vramswap.install(**config)          libvramswap.so as torch's CUDA allocator (cuda.py),
                                      before torch initializes CUDA; vramswap.installed()
  vramswap.sim.install_cpu(**config)  the CPU-emulation mode: torch's CPU tensors are
                                      allocated by libvramswap.so on cudasim (no GPU needed)
  vramswap.offload()                  the autograd tracker (saved-tensor hooks)
  vramswap.offload_frozen(module)     frozen weights streamed layer by layer (kept_frozen.py)
  vramswap.offload_optimizer(opt)     optimizer state off the device between steps (kept_optimizer.py)
  vramswap.materialize(module_or_opt) their kept blocks back on the device, for a direct read (kept.py)
  vramswap.memory_stats()             vramswap_stats_json as a dict, plus torch's key names
  vramswap.memory_allocated(), max_memory_allocated(), memory_reserved(),
  max_memory_reserved(), reset_peak_memory_stats()   torch.cuda's functions, by their names
  vramswap.record_memory_history(), snapshot(), memory_snapshot(), dump_snapshot(path)
                                      memory snapshots in torch's format (its _memory_viz
                                      reads them, and `vramswap replay`)
  vramswap.reset_peak_stats(), vramswap.empty_cache()
  python3 -m vramswap run -- script.py  an unmodified script, its forwards offloaded (__main__.py)
Setting VRAMSWAP_TORCH_DEVICE=cpu-sim makes `import vramswap` install the CPU-emulation
mode at once (with the VRAMSWAP_* environment). Like the LD_PRELOAD library, which stops a
program before main, the import then stops the program with exit status 2 when a VRAMSWAP_*
value is bad, printing one "vramswap: error:" line per value (naming the variable, the value
and what is accepted); any other VRAMSWAP_TORCH_DEVICE value than cpu-sim (or unset or
empty) stops it the same way, at every import.

Exceptions: VramswapError (a vramswap call failed), ConfigError (a ValueError: a VRAMSWAP_*
value refused) and OutOfMemoryError (an allocation vramswap cannot serve: torch's own
torch.cuda.OutOfMemoryError, a RuntimeError; see _errors.py).
"""
import ctypes
import json
import os

from ._config import ConfigError
from ._lib import VramswapError
from ._version import __version__

__all__ = ["__version__", "install", "installed", "sim", "offload", "memory_stats", "reset_peak_stats",
           "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
           "reset_peak_memory_stats", "memory_summary", "record_memory_history", "snapshot", "memory_snapshot",
           "dump_snapshot", "empty_cache", "enable_peer_access", "tracker_stats", "offload_frozen",
           "offload_optimizer", "materialize",
           "VramswapError", "ConfigError",
           "OutOfMemoryError"]

# The torch-facing parts import torch; they load on first use, so that what needs no torch
# (vramswap.bench, `python3 -m vramswap bench|replay`, memory_stats) runs without it.
_LAZY = {"sim": ("sim", None), "install": ("cuda", "install"), "installed": ("cuda", "installed"),
         "offload": ("tracker", "offload"), "tracker_stats": ("tracker", "tracker_stats"),
         "offload_frozen": ("kept_frozen", "offload_frozen"),
         "offload_optimizer": ("kept_optimizer", "offload_optimizer"),
         "materialize": ("kept", "materialize"),
         "OutOfMemoryError": ("_errors", "OutOfMemoryError")}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'vramswap' has no attribute {name!r}")
    import importlib
    module, attr = _LAZY[name]
    mod = importlib.import_module("." + module, __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


# torch.cuda.memory_stats() key -> the vramswap key that means the same thing. Left out on
# purpose: num_alloc_retries (torch frees its cache and retries; vramswap evicts instead),
# the per-pool (small_pool / large_pool) keys, inactive_split_* and the cumulative
# ".allocated" / ".freed" byte totals, which vramswap does not count.
_TORCH_KEYS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "peak_allocated_bytes",
    "active_bytes.all.current": "allocated_bytes",
    "active_bytes.all.peak": "peak_allocated_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "reserved_bytes.all.peak": "peak_reserved_bytes",
    "allocation.all.allocated": "num_allocs",
    "allocation.all.freed": "num_frees",
    # num_ooms: the same name and meaning in both
}


def _with_torch_keys(stats):
    for torch_key, key in _TORCH_KEYS.items():
        if key in stats:
            stats[torch_key] = stats[key]
    if "num_allocs" in stats and "num_frees" in stats:
        stats["allocation.all.current"] = stats["num_allocs"] - stats["num_frees"]
    return stats


def _json_document(name):
    """The JSON document C function `name` (vramswap_stats_json's contract) returns, parsed."""
    from . import _lib
    fn = getattr(_lib.lib(), name)
    for _ in range(4):
        n = fn(None, 0)
        buf = ctypes.create_string_buffer(n + 4096)
        got = fn(buf, len(buf))
        if 0 < got < len(buf):
            return json.loads(buf.value.decode())
    raise VramswapError(name + ": " + _lib.last_error())


def _stats_json():
    return _json_document("vramswap_stats_json")


def memory_stats(device=None):
    """vramswap's statistics (vramswap_stats_json) as a dict, with torch.cuda.memory_stats()'s
    key names added where they mean the same thing ("allocated_bytes.all.current",
    "allocated_bytes.all.peak", "active_bytes.all.current" (= allocated),
    "reserved_bytes.all.current" / ".peak", "allocation.all.current", "num_ooms", ...).
    Not provided: "num_alloc_retries" (vramswap evicts rather than retrying). `device`:
    None for the whole process (with a "devices" list), or a device index (an int or a
    torch.device) for that device's entry."""
    stats = _stats_json()
    if device is not None:
        index = getattr(device, "index", device)
        index = 0 if index is None else int(index)
        for entry in stats.get("devices", []):
            if entry.get("device") == index:
                return _with_torch_keys(dict(entry))
        raise ValueError(f"vramswap has no statistics for device {index}")
    for entry in stats.get("devices", []):
        _with_torch_keys(entry)
    return _with_torch_keys(stats)


def memory_allocated(device=None):
    """Bytes in live blocks (torch.cuda.memory_allocated): memory_stats(device)
    ["allocated_bytes"]. Evicted blocks count: they keep their addresses. `device` as for
    memory_stats(): None is every device together (torch's None is the current device)."""
    return memory_stats(device)["allocated_bytes"]


def max_memory_allocated(device=None):
    """The peak of memory_allocated() since the start or the last reset_peak_memory_stats()
    (torch.cuda.max_memory_allocated)."""
    return memory_stats(device)["peak_allocated_bytes"]


def memory_reserved(device=None):
    """Device memory vramswap holds mapped (torch.cuda.memory_reserved): memory_stats(device)
    ["reserved_bytes"]."""
    return memory_stats(device)["reserved_bytes"]


def max_memory_reserved(device=None):
    """The peak of memory_reserved() (torch.cuda.max_memory_reserved)."""
    return memory_stats(device)["peak_reserved_bytes"]


def _format_size(n):
    """torch's memory_summary's sizes: the number in the largest unit below 1024 of it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:6d} {unit:>3s}" if unit == "B" else f"{n:6.0f} {unit}"
        n /= 1024


def memory_summary(device=None, abbreviated=False):
    """torch.cuda.memory_summary()'s table for vramswap: allocated and reserved memory as
    torch prints them, then what vramswap adds: resident (mapped) memory, offloadable
    (tagged) blocks, bytes evicted to the host and in flight, the pinned host tier, and the
    counts of allocations, evictions, fetches, faults and out-of-memory refusals. `device`
    as for memory_stats() (None: every device together). In the "Evicted to host" row, Tot
    Alloc and Tot Freed are the bytes copied out and back. `abbreviated` is accepted for
    torch's signature (the table is always the short one)."""
    s = memory_stats(device)
    width = 75
    title = "vramswap memory summary, " + ("all devices" if device is None else
                                              f"device ID {getattr(device, 'index', device) or 0}")
    rule, thin = "|" + "=" * width + "|", "|" + "-" * width + "|"

    def row(metric, cur="", peak="", total_in="", total_out=""):
        return f"| {metric:<21s} | {cur:>10s} | {peak:>10s} | {total_in:>10s} | {total_out:>10s} |"

    def size(key):
        return _format_size(s[key]) if key in s else "-"

    def count(key):
        return str(s[key]) if key in s else "-"

    half = (width - 3) // 2
    lines = [rule, "|" + title.center(width) + "|", thin,
             "|" + f"OOMs: {s.get('num_ooms', 0)}".center(half) + " | "
             + f"evictions: {s.get('num_evictions', 0)}".center(width - half - 3) + "|",
             rule, row("Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"), thin,
             row("Allocated memory", size("allocated_bytes"), size("peak_allocated_bytes")),
             row("GPU reserved memory", size("reserved_bytes"), size("peak_reserved_bytes")),
             row("Resident (mapped)", size("resident_bytes"), size("peak_resident_bytes")),
             row("Offloadable (tagged)", size("tagged_bytes")),
             row("Evicted to host", size("evicted_bytes"), "", size("bytes_evicted_total"),
                 size("bytes_prefetched_total")),
             row("In flight", size("in_flight_bytes")),
             row("Host tier (pinned)", size("host_bytes"), size("peak_host_bytes")),
             thin,
             row("Allocations", "", "", count("num_allocs"), count("num_frees")),
             row("Evictions", "", "", count("num_evictions")),
             row("Fetches (prefetched)", "", "", count("num_prefetches")),
             row("Faults (waited)", "", "", count("num_faults")),
             row("Planned steps", "", "", count("num_planned_steps")),
             rule]
    return "\n".join(lines) + "\n"


def record_memory_history(enabled=True, max_entries=100_000):
    """torch.cuda.memory._record_memory_history()'s counterpart: from now on every device's
    pool records its actions (allocations, frees asked for and completed, pages mapped and
    unmapped, evictions' and fetches' marked, refused allocations), the last `max_entries`
    per device, for snapshot() and dump_snapshot(). enabled=False (or None) stops recording
    and drops the events kept. No Python stacks are recorded: every event's "frames" is []."""
    from . import _lib
    if enabled and (not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries <= 0):
        raise ValueError(f"record_memory_history: max_entries={max_entries!r}; expected a positive integer")
    _lib.lib().vramswap_record_history(max_entries if enabled else 0)


def snapshot():
    """The memory snapshot in torch's layout (torch.cuda.memory._snapshot(), torch 2.1 and
    later): {"segments": the mapped memory of every device's pool and the blocks on it,
    "device_traces": the events recorded since record_memory_history(), one list per device
    ordinal, "vramswap": {"evicted": blocks on the host with no page mapped}}. Evictions and
    fetches appear in the traces as "segment_unmap" and "segment_map" events with
    "vramswap": "evict" or "fetch" (src/runtime/snapshot_document.h)."""
    return _json_document("vramswap_snapshot_json")


def memory_snapshot():
    """torch.cuda.memory_snapshot(): the segments of snapshot(), a list (what torch's
    _memory_viz of torch 1.13 reads from a pickle)."""
    return snapshot()["segments"]


def dump_snapshot(path):
    """torch.cuda.memory._dump_snapshot(path): pickles snapshot() to `path`, for torch's
    tools (python -m torch.cuda._memory_viz, https://pytorch.org/memory_viz; torch 2.1 and
    later) and for `vramswap replay`. The file is written so that another user cannot
    redirect it (vramswap/_files.py)."""
    import pickle
    from ._files import write_file
    write_file(path, pickle.dumps(snapshot()))


def empty_cache():
    """Returns vramswap's cached free memory to the device (torch.cuda.empty_cache)."""
    from . import _lib
    _lib.lib().vramswap_empty_cache()


def enable_peer_access(device, peer):
    """Lets `device` read and write the blocks vramswap allocated on `peer`, after the program
    enabled CUDA peer access between them (torch does when it copies between devices): each of
    vramswap's mappings on `peer`, now and later, grants `device` access, which peer access
    alone does not give memory mapped with CUDA's VMM calls. Raises VramswapError for a device
    out of range or a grant the driver refused."""
    from . import _lib
    if _lib.lib().vramswap_enable_peer_access(int(device), int(peer)) != 0:
        raise VramswapError("vramswap_enable_peer_access: " + _lib.last_error())


def reset_peak_stats():
    """Resets the peaks (peak_allocated_bytes, peak_reserved_bytes, peak_resident_bytes,
    peak_host_bytes, peak_tagged_waste_bytes and so their torch names) to the current values."""
    from . import _lib
    _lib.lib().vramswap_reset_peak_stats()


def reset_peak_memory_stats(device=None):
    """torch.cuda.reset_peak_memory_stats's name for reset_peak_stats(): the peaks of every
    device are reset, whatever `device` says (accepted for torch's signature)."""
    reset_peak_stats()


def _install_from_environment():
    """VRAMSWAP_TORCH_DEVICE at import: checked, and cpu-sim installs the CPU-emulation mode;
    a refused value stops the program (exit status 2), as the LD_PRELOAD library does."""
    from . import _config
    device = os.environ.get("VRAMSWAP_TORCH_DEVICE", "")
    error = _config.python_key_error("VRAMSWAP_TORCH_DEVICE", device)
    if error is not None:
        _config.stop_program(ConfigError([error]), "import vramswap")
    if device == "cpu-sim":
        from . import sim
        try:
            sim.install_cpu()
        except ConfigError as e:
            _config.stop_program(e, "import vramswap (VRAMSWAP_TORCH_DEVICE=cpu-sim)")


_install_from_environment()
