#!/usr/bin/env python3
"""The GPU suite: one GPT-style training step under torch's allocator, save_on_cpu and
vramswap (with and without offload), on a real GPU; peak device memory, step time, what
vramswap moved, and whether every result is bit-identical to torch's.

Workload: a GPT-style decoder (token + position embeddings, N pre-norm blocks of causal
self-attention and an MLP whose hidden activation is an in-place relu_, both with residual
connections, a final layer norm, an LM head, cross-entropy) on fixed random tokens, with no
optimizer: every step is zero-grad + forward + backward on the same batch, so every step's
loss and gradients must be the same bits. Attention is
torch.nn.functional.scaled_dot_product_attention where torch has it (2.0+), else explicit
softmax attention (--attention). The default size is bf16, meant for an 80 GB H100: by count
about 28 GiB saved for backward and a peak near 35 GiB without offload, about a second a step
(estimates; see SIZES). --tiny is fp32 with explicit attention, for --cpu-sim and quick checks.
Every dimension is an option (--layers, --d-model, --heads, --seq, --batch, --vocab, --dtype).

Modes, each in its own child process (vramswap must be torch's allocator before CUDA
initializes, and its limit is fixed at its first allocation):
  torch                 torch's caching allocator, no offload: the baseline (peak from
                        torch.cuda.max_memory_allocated / max_memory_reserved)
  vramswap              vramswap.install() with no limit, no offload: the allocator's own cost
                        (peak from vramswap.memory_stats(): torch's counters do not see it)
  vramswap_offload@P    vramswap.install(limit=P% of the vramswap mode's peak reserved bytes),
                        the forward under vramswap.offload() (--percents; default 80,60)
  save_on_cpu           torch.autograd.graph.save_on_cpu(pin_memory=True) around the forward:
                        torch's own answer, every saved tensor copied to pinned host memory
Each mode runs --warmup steps, then --steps timed ones (CUDA-synchronized wall time; the
median is reported); peaks are those of the timed steps; vramswap's counters are per timed
step. Determinism: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8,
TF32 off, the same seed and data in every child; each child hashes (sha256) every step's loss
and every final gradient, and the parent compares them with the torch mode's.

Output: a JSON file (date, device, driver, torch and CUDA versions, the command line, the
workload, every mode's figures) and a Markdown table, named
bench/results/gpu-<date>-<device slug>.{json,md} (with -2, -3, ... when taken), or in --out.
Each offload mode also records the last step's memory history and dumps a snapshot
(vramswap.dump_snapshot) that torch's own `python -m torch.cuda._memory_viz stats` must read.
Exit status: 0 when every check held; 1 when a vramswap mode's loss or gradients differ from
torch's, a vramswap offload mode's peak passed its limit or its snapshot could not be read by
torch's tool, or any mode failed other than by
running out of memory (an error, a crash, a timeout); 2 for bad usage or no CUDA device. A
mode that runs out of memory is reported, not a failure (--strict: it is one for the vramswap
modes, and so is an offload mode that evicted nothing or left handles tracked).

--cpu-sim runs the same logic with no GPU: vramswap.sim.install_cpu() in place of install(),
torch CPU tensors, fp32, torch's default CPU allocator as the `torch` mode, no save_on_cpu
(it needs pinned memory and a GPU), and offload limits of 80% and 60%; results go to --out (default: a new temporary
directory), never to bench/results. CTest runs `--cpu-sim --tiny --strict` so that the suite
cannot rot.

Environment: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR, VRAMSWAP_TORCH_EXT,
VRAMSWAP_TORCH_EXT_CUDA and VRAMSWAP_LOG pass to the children; every other VRAMSWAP_* variable
is removed from their environment (the suite sets the configuration it measures).

Usage: python3 tests/gpu/suite.py [--tiny] [--cpu-sim] [--percents 80,60] [--out DIR] ...
       (scripts/gpu builds the library and runs this; --help lists every option)
"""
import argparse
import contextlib
import ctypes
import datetime
import hashlib
import json
import math
import os
import pickle
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGIN_PYTHON = REPO / "plugin" / "python"
RESULTS_DIR = REPO / "bench" / "results"
MIB = 1 << 20
GIB = 1 << 30
# Limits are rounded down to this: the VMM allocation granularity of current GPUs, the unit
# in which vramswap maps device memory.
LIMIT_GRANULE = 2 * MIB

# Model sizes. default: 16 blocks of width 2048 over 16 x 2048 tokens in bf16: about 0.94 G
# parameters (1.9 GB, as much again for gradients) and, by count, about 26 GiB of activations
# saved for backward (13 tensors of batch x seq x d_model per block, 128 MiB each) plus 2 GiB
# of log-probabilities: a peak near 35 GiB, most of an 80 GB card's worth of what offload is
# for, and a step of about a second on an H100 (estimates, to be replaced by the first
# measurement). tiny: for --cpu-sim (cudasim, reference BLAS on one core: about a second a
# step) and quick checks, the same workload on a GPU. Its attention is explicit, in fp32,
# with 16 heads of width 8, so that the saved attention probabilities (8 MiB a block,
# evictable) outweigh the batch x seq x d_model tensors of 256 KiB (tagged too at the default
# VRAMSWAP_MIN_OFFLOAD_BYTES, 64 KiB; they share pages).
SIZES = {
    "default": {"layers": 16, "d_model": 2048, "heads": 16, "seq": 2048, "batch": 16, "vocab": 32768,
                "horizon": 4, "dtype": "bf16", "attention": "auto"},
    "tiny": {"layers": 4, "d_model": 128, "heads": 16, "seq": 256, "batch": 2, "vocab": 512,
             "horizon": 4, "dtype": "fp32", "attention": "explicit"},
}
# Offload limits, in % of the vramswap mode's peak reserved bytes.
DEFAULT_PERCENTS = {"gpu": "80,60", "cpu_sim": "80,60"}
VRAMSWAP_COUNTERS = ("num_evictions", "num_prefetches", "num_faults", "num_late_prefetches", "num_clean_reuses",
                     "bytes_evicted_total", "bytes_prefetched_total", "num_ooms",
                     # planned eviction (VRAMSWAP_PLAN): the timed steps repeat the warm-up's
                     "num_planned_steps", "num_plan_divergences", "num_plan_backoffs", "planned_bytes_d2h",
                     # where the host's time went (process-wide): waiting for the device, VMM calls, pinning
                     "host_wait_ns", "host_vmm_ns", "host_pin_ns",
                     # what the VMM calls did, in bytes and in calls (a call costs the same for any size)
                     "host_vmm_mapped_bytes", "host_vmm_unmapped_bytes", "host_vmm_created_bytes",
                     "host_vmm_released_bytes", "host_vmm_map_calls", "host_vmm_unmap_calls",
                     "host_vmm_create_calls", "host_vmm_release_calls")
PASSED_ENV = ("VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR", "VRAMSWAP_CACHE_DIR",
              "VRAMSWAP_TORCH_EXT", "VRAMSWAP_TORCH_EXT_CUDA", "VRAMSWAP_LOG")
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")  # the two settings cuBLAS documents as deterministic


def is_vramswap_mode(mode):
    return mode.startswith("vramswap")


def offload_percent(mode):
    """P for "vramswap_offload@P", else None."""
    m = re.fullmatch(r"vramswap_offload@(\d+)", mode)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------
# The workload (runs in the children; torch is imported by the caller).
# ---------------------------------------------------------------------------------------

def build_model(torch, cfg, device, dtype):
    """The GPT-style model. Module constructors take device and dtype, so the parameters are
    initialized where they live (on the GPU: by CUDA's RNG, reproducible for a given seed)."""
    nn = torch.nn
    F = torch.nn.functional
    d, heads, seq = cfg["d_model"], cfg["heads"], cfg["seq"]
    kw = {"device": device, "dtype": dtype}
    use_sdpa = cfg["attention"] == "sdpa"

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d, **kw)
            self.proj = nn.Linear(d, d, **kw)
            if not use_sdpa:
                pos = torch.arange(seq, device=device)
                self.future = pos[None, :] > pos[:, None]  # True above the diagonal

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(x).split(C, dim=2)
            q, k, v = (t.view(B, T, heads, C // heads).transpose(1, 2) for t in (q, k, v))
            if use_sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // heads))
                att = att.masked_fill(self.future[:T, :T], float("-inf"))
                y = torch.softmax(att, dim=-1) @ v
            return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = nn.LayerNorm(d, **kw)
            self.attn = Attention()
            self.norm2 = nn.LayerNorm(d, **kw)
            self.fc1 = nn.Linear(d, 4 * d, **kw)
            self.fc2 = nn.Linear(4 * d, d, **kw)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            h = self.fc1(self.norm2(x))
            h.relu_()  # in place: autograd saves its result, the storage fc2 saves too
            return x + self.fc2(h)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(cfg["vocab"], d, **kw)
            self.positions = nn.Embedding(seq, d, **kw)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.norm = nn.LayerNorm(d, **kw)
            self.head = nn.Linear(d, cfg["vocab"], bias=False, **kw)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.tokens(idx) + self.positions(torch.arange(T, device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    return GPT()


def make_batch(torch, cfg, device):
    """Fixed random tokens and targets, drawn on the CPU (the same in every child)."""
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    shape = (cfg["batch"], cfg["seq"])
    idx = torch.randint(cfg["vocab"], shape, generator=gen)
    targets = torch.randint(cfg["vocab"], shape, generator=gen)
    return idx.to(device), targets.to(device)


def tensor_digest(torch, t):
    """sha256 of a tensor's dtype, shape and bytes (copied to the host first): equal digests
    mean bit-identical tensors. No numpy (torch wheels do not require it)."""
    if t is None:
        return "none"
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    n = t.numel() * t.element_size()
    if n:
        h.update(ctypes.string_at(t.data_ptr(), n))
    return h.hexdigest()


def is_oom(torch, exc):
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(exc, oom_type)) or "out of memory" in str(exc).lower()


def run_mode(spec, result):
    """Runs one mode in this (child) process, filling `result`."""
    mode, cfg = spec["mode"], spec["config"]
    cpu_sim = cfg["cpu_sim"]
    import torch  # CUBLAS_WORKSPACE_CONFIG is in the environment the parent gave us

    vramswap = None
    if is_vramswap_mode(mode):
        sys.path.insert(0, str(PLUGIN_PYTHON))
        import vramswap
        config = {"horizon": cfg["horizon"]}
        if spec.get("limit_bytes"):
            config["limit"] = str(spec["limit_bytes"])
        if cpu_sim:
            vramswap.sim.install_cpu(**config)
        elif not hasattr(vramswap, "install"):
            raise RuntimeError("vramswap.install() does not exist in plugin/python/vramswap: the "
                               "vramswap modes need the CUDA install")
        else:
            # before anything initializes CUDA; "extension" or "ctypes" (vramswap/cuda.py)
            result["install_backend"] = vramswap.install(**config)
    result["torch_version"] = torch.__version__

    torch.use_deterministic_algorithms(True)
    if cpu_sim:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # the same reduction order in every child, and CTest runs in parallel
    else:
        device = torch.device("cuda", 0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg["dtype"]]

    def synchronize():
        if not cpu_sim:
            torch.cuda.synchronize()
        elif vramswap is not None:
            vramswap.sim.synchronize()

    # Peak device memory: vramswap's counters in its modes (torch's do not see its blocks),
    # torch's elsewhere; none for torch's default CPU allocator.
    if vramswap is not None:
        def reset_peaks():
            vramswap.reset_peak_stats()

        def memory():
            s = vramswap.memory_stats()
            return {k: s.get(k) for k in ("allocated_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                                          "peak_resident_bytes", "peak_host_bytes", "device_limit_bytes",
                                          "num_tracked_blocks")}
    elif not cpu_sim:
        def reset_peaks():
            torch.cuda.reset_peak_memory_stats()

        def memory():
            return {"allocated_bytes": torch.cuda.memory_allocated(),
                    "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
    else:
        def reset_peaks():
            pass

        def memory():
            return {}

    def counters():
        if vramswap is None:
            return {}
        s = vramswap.memory_stats()
        return {k: s.get(k, 0) for k in VRAMSWAP_COUNTERS}

    if mode == "save_on_cpu":
        def scope():
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
    elif offload_percent(mode) is not None:
        scope = vramswap.offload
    else:
        scope = contextlib.nullcontext

    torch.manual_seed(cfg["seed"])
    model = build_model(torch, cfg, device, dtype)
    idx, targets = make_batch(torch, cfg, device)
    params = list(model.parameters())
    result["num_parameters"] = sum(p.numel() for p in params)
    synchronize()
    result["model_allocated_bytes"] = memory().get("allocated_bytes")

    times, losses = [], []
    snapshot = offload_percent(mode) is not None and spec.get("snapshot")
    for step in range(cfg["warmup"] + cfg["steps"]):
        if step == cfg["warmup"]:
            synchronize()
            reset_peaks()
            before = counters()
        if snapshot and step == cfg["warmup"] + cfg["steps"] - 1:
            vramswap.record_memory_history(max_entries=1_000_000)  # the last step's events
        for p in params:
            p.grad = None
        synchronize()
        start = time.perf_counter()
        with scope():
            loss = model(idx, targets)
        loss.backward()
        synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
        del loss
    after = counters()
    result.update(memory())
    result["step_times_s"] = times
    result["median_step_s"] = statistics.median(times[cfg["warmup"]:])
    if vramswap is not None:
        steps = cfg["steps"]
        result["per_step"] = {k: (after[k] - before[k]) / steps for k in VRAMSWAP_COUNTERS}
        result["totals"] = after
        result["tracker"] = vramswap.tracker_stats()
    if snapshot:
        result["snapshot"] = check_snapshot(vramswap, torch, spec["snapshot"])
    result["loss_values"] = [float(l.float().item()) for l in losses]
    result["loss_digests"] = [tensor_digest(torch, l) for l in losses]
    result["grad_digests"] = {name: tensor_digest(torch, p.grad) for name, p in model.named_parameters()}


def check_snapshot(vramswap, torch, path):
    """Dumps the memory snapshot (vramswap.dump_snapshot: torch's layout, the last step's
    trace) and has torch's own tool read it: `python -m torch.cuda._memory_viz stats` on
    the dump (torch 2.1+), on memory_snapshot()'s segment list for older torch, whose tool
    reads only that. Returns what the tool said, and the trace's evictions and fetches."""
    vramswap.dump_snapshot(path)
    with open(path, "rb") as f:
        data = pickle.load(f)  # what was written (builtin types only: vramswap's own dump)
    read = path
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 1):
        read = path + ".segments"
        with open(read, "wb") as f:
            pickle.dump(data["segments"], f)
    viz = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", read],
                         capture_output=True, text=True, timeout=300)
    trace = [e for t in data["device_traces"] for e in t]
    return {"viz_status": viz.returncode, "viz_output": (viz.stdout + viz.stderr)[-2000:],
            "segments": len(data["segments"]), "trace_events": len(trace),
            "trace_evictions": sum(e.get("vramswap") == "evict" for e in trace),
            "trace_fetches": sum(e.get("vramswap") == "fetch" for e in trace)}


def child_main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    result = {"mode": spec["mode"], "status": "error", "message": ""}
    try:
        run_mode(spec, result)
        result["status"] = "ok"
    except Exception as exc:  # reported to the parent, which decides what it means
        import torch
        result["status"] = "oom" if is_oom(torch, exc) else "error"
        result["message"] = f"{type(exc).__name__}: {exc}".strip()[:2000]
        result["traceback"] = traceback.format_exc()[-6000:]
        # On install()'s ctypes path a refused allocation is a RuntimeError carrying
        # vramswap's report (is_oom matches its text); vramswap also counted it.
        vramswap = sys.modules.get("vramswap")
        if result["status"] == "error" and vramswap is not None:
            try:
                ooms = vramswap.memory_stats().get("num_ooms", 0)
            except Exception:  # noqa: BLE001 - not installed, or the library is unusable
                ooms = 0
            if ooms:
                result["status"] = "oom"
                result["message"] = (f"vramswap refused {ooms} allocation(s) (num_ooms; install()'s "
                                     f"ctypes path surfaces that as a CUDA error): {result['message']}")
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


# The out-of-memory check: what a program sees when vramswap refuses an allocation.
OOM_LIMIT = 64 * MIB
OOM_REQUEST = 256 * MIB


def oom_main(out_path, cpu_sim):
    """Child: vramswap installed with a limit of OOM_LIMIT, a 4 MiB tensor kept, then a
    request of OOM_REQUEST. Records the exception raised (its type, whether it is
    torch.cuda.OutOfMemoryError, its message) and whether allocating works again after it."""
    import torch
    sys.path.insert(0, str(PLUGIN_PYTHON))
    import vramswap
    result = {"status": "error", "limit_bytes": OOM_LIMIT, "request_bytes": OOM_REQUEST}
    try:
        if cpu_sim:
            vramswap.sim.install_cpu(limit=str(OOM_LIMIT))
            device = torch.device("cpu")
        else:
            result["install_backend"] = vramswap.install(limit=str(OOM_LIMIT))
            device = torch.device("cuda", 0)
        kept = torch.ones(MIB, device=device)  # 4 MiB of fp32
        try:
            torch.empty(OOM_REQUEST, dtype=torch.uint8, device=device)
            result["message"] = f"no exception: {fmt_bytes(OOM_REQUEST)} allocated under a limit of {fmt_bytes(OOM_LIMIT)}"
        except Exception as exc:  # what the check is about
            oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
            result.update(exception=f"{type(exc).__module__}.{type(exc).__qualname__}",
                          is_torch_oom=oom_type is not None and isinstance(exc, oom_type),
                          is_runtime_error=isinstance(exc, RuntimeError),
                          message=str(exc).strip()[:1500])
            again = torch.ones(MIB, device=device)
            result["recovered"] = float((kept + again).sum().item()) == 2.0 * MIB
            result["num_ooms"] = vramswap.memory_stats().get("num_ooms", 0)
            result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        result["message"] = f"{type(exc).__name__}: {exc}".strip()[:1500]
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(out_path).write_text(json.dumps(result))
    return 0


def oom_failures(oom):
    """What the out-of-memory check's result breaks: an exception other than
    torch.cuda.OutOfMemoryError on the extension path (and in the CPU-emulation mode), one
    that is not a RuntimeError on the ctypes path, no exception, or no recovery."""
    if oom.get("status") in ("skipped", None):
        return []
    if oom.get("status") != "ok":
        return [f"out-of-memory check: {oom.get('status')}: {oom.get('message', '')[:300]}"]
    failures = []
    if oom.get("install_backend") == "ctypes":
        if not oom.get("is_runtime_error"):
            failures.append(f"out-of-memory check: the ctypes path raised {oom['exception']}, not a RuntimeError")
    elif not oom.get("is_torch_oom"):
        failures.append(f"out-of-memory check: raised {oom['exception']}, not torch.cuda.OutOfMemoryError")
    if not oom.get("recovered"):
        failures.append("out-of-memory check: allocating after the refused request did not work")
    if not oom.get("num_ooms"):
        failures.append("out-of-memory check: vramswap's num_ooms did not count the refusal")
    return failures


def info_main(out_path):
    """Child: what torch sees of the device (the parent itself never initializes CUDA, so
    that no context of its own sits on the card while the modes run)."""
    import torch
    info = {"torch_version": torch.__version__, "torch_cuda": torch.version.cuda,
            "has_sdpa": hasattr(torch.nn.functional, "scaled_dot_product_attention"),  # torch 2.0+
            "cuda_available": torch.cuda.is_available(), "device_count": 0}
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), name=props.name,
                    total_memory_bytes=props.total_memory,
                    capability=f"{props.major}.{props.minor}")
        try:
            version = ctypes.c_int(0)
            if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
                info["driver_cuda_version"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
        except OSError:
            pass
    Path(out_path).write_text(json.dumps(info))
    return 0


# ---------------------------------------------------------------------------------------
# The parent.
# ---------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="tests/gpu/suite.py",
        description="vramswap's GPU suite: peak memory, step time and bit-identity of a GPT-style "
                    "training step under torch, save_on_cpu, vramswap and vramswap with offload.")
    p.add_argument("--cpu-sim", action="store_true",
                   help="no GPU: vramswap.sim.install_cpu() and CPU tensors (results go to --out)")
    p.add_argument("--tiny", action="store_true", help="the tiny model (same as --size tiny)")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="model size preset (default: default on a GPU, tiny with --cpu-sim)")
    for key in ("layers", "d_model", "heads", "seq", "batch", "vocab"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, dest=key,
                       help=f"override the size's {key}")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameters and activations (default: the size's, bf16 or fp32 for tiny; "
                        "fp32 with --cpu-sim)")
    p.add_argument("--attention", choices=("auto", "sdpa", "explicit"), default=None,
                   help="auto: scaled_dot_product_attention where torch has it (2.0+), else explicit "
                        "(default: the size's, auto or explicit for tiny)")
    p.add_argument("--percents", default=None,
                   help="vramswap_offload limits, in %% of the vramswap mode's peak reserved bytes "
                        f"(default {DEFAULT_PERCENTS['gpu']}; {DEFAULT_PERCENTS['cpu_sim']} with --cpu-sim)")
    p.add_argument("--modes", default=None,
                   help="comma-separated subset of torch,vramswap,offload,save_on_cpu (default: all)")
    p.add_argument("--horizon", type=int, default=None,
                   help="VRAMSWAP_HORIZON (default: the size's, 4; 2 for tiny)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (default 2; 1 with --cpu-sim)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps (default 5; 2 with --cpu-sim)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="directory for the JSON and Markdown (default: bench/results on a GPU, "
                        "a new temporary directory with --cpu-sim)")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds for all modes together; modes not started in time are skipped "
                        "(default 420)")
    p.add_argument("--child-timeout", type=float, default=240.0,
                   help="seconds one mode may take (default 240)")
    p.add_argument("--strict", action="store_true",
                   help="also fail when a vramswap mode runs out of memory, an offload mode evicts "
                        "nothing, or handles stay tracked after backward")
    args = p.parse_args(argv)
    if args.tiny and args.size not in (None, "tiny"):
        p.error("--tiny and --size disagree")
    if args.percents is None:
        args.percents = DEFAULT_PERCENTS["cpu_sim" if args.cpu_sim else "gpu"]
    try:
        args.percents = [int(x) for x in args.percents.split(",") if x.strip()]
    except ValueError:
        p.error(f"--percents: expected comma-separated integers, got {args.percents!r}")
    if any(not 1 <= x <= 100 for x in args.percents):
        p.error("--percents: each percentage must be 1 to 100")
    known = {"torch", "vramswap", "offload", "save_on_cpu"}
    args.modes = set(args.modes.split(",")) if args.modes else set(known)
    if args.modes - known:
        p.error(f"--modes: unknown {sorted(args.modes - known)} (known: {sorted(known)})")
    if "torch" not in args.modes:
        p.error("--modes: the torch mode is the reference every mode is compared with; "
                "it cannot be left out")
    if "offload" in args.modes and "vramswap" not in args.modes:
        p.error("--modes: offload limits are a percentage of the vramswap mode's peak; keep vramswap")
    out = Path(args.out).resolve() if args.out else None
    if out and args.cpu_sim and (out == RESULTS_DIR.resolve() or RESULTS_DIR.resolve() in out.parents):
        p.error("--cpu-sim results never go to bench/results (that is for GPU measurements)")
    return args


def resolve_config(args, torch_has_sdpa):
    size = "tiny" if args.tiny else (args.size or ("tiny" if args.cpu_sim else "default"))
    cfg = dict(SIZES[size])
    for key in cfg:
        if getattr(args, key, None) is not None:
            cfg[key] = getattr(args, key)
    if cfg["d_model"] % cfg["heads"]:
        raise SystemExit(f"suite.py: d_model {cfg['d_model']} is not a multiple of heads {cfg['heads']}")
    attention = cfg["attention"]
    if attention == "auto":
        attention = "sdpa" if torch_has_sdpa else "explicit"
    elif attention == "sdpa" and not torch_has_sdpa:
        raise SystemExit("suite.py: --attention sdpa: this torch has no "
                         "torch.nn.functional.scaled_dot_product_attention (added in 2.0)")
    cfg.update(size=size, attention=attention, cpu_sim=args.cpu_sim,
               dtype=args.dtype or ("fp32" if args.cpu_sim else cfg["dtype"]),
               seed=args.seed,
               warmup=args.warmup if args.warmup is not None else (1 if args.cpu_sim else 2),
               steps=args.steps if args.steps is not None else (2 if args.cpu_sim else 5))
    if cfg["steps"] < 1 or cfg["warmup"] < 0:
        raise SystemExit("suite.py: --steps must be at least 1 and --warmup at least 0")
    return cfg


def child_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSWAP_") or k in PASSED_ENV}
    removed = sorted(k for k in os.environ if k.startswith("VRAMSWAP_") and k not in PASSED_ENV)
    if env.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
        env["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS[0]
    env.setdefault("VRAMSWAP_LOG", "warn")
    return env, removed


class Runner:
    """Runs children one at a time within the time budget."""

    def __init__(self, args, tmp):
        self.args = args
        self.tmp = Path(tmp)
        self.deadline = time.monotonic() + args.time_budget
        self.env, self.removed_env = child_env()

    def _spawn(self, argv, timeout):
        try:
            cmd = [sys.executable, str(Path(__file__).resolve())] + argv
            return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout), None
        except subprocess.TimeoutExpired as exc:
            return None, exc

    def info(self):
        out = self.tmp / "info.json"
        proc, timed_out = self._spawn(["--child-info", str(out)], 120)
        if timed_out or proc.returncode != 0 or not out.exists():
            detail = "timed out" if timed_out else (proc.stderr or proc.stdout)[-3000:]
            raise SystemExit(f"suite.py: asking torch about the device failed: {detail}")
        return json.loads(out.read_text())

    def _measure(self, script, extra_args):
        """tests/gpu/<script> --json in a child: {"status": "ok", its JSON...}, or
        {"status": ..., "message": ...}."""
        remaining = self.deadline - time.monotonic()
        if remaining < 15:
            return {"status": "skipped", "message": "the time budget was spent"}
        out = self.tmp / (Path(script).stem + ".json")
        cmd = [sys.executable, str(Path(__file__).resolve().parent / script), "--json", str(out)] + extra_args
        try:
            proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=min(120, remaining))
        except subprocess.TimeoutExpired:
            return {"status": "timeout", "message": "no result after 120 s"}
        if proc.returncode != 0 or not out.exists():
            return {"status": "error", "message": tail(proc.stderr or proc.stdout)}
        return {"status": "ok", **json.loads(out.read_text())}

    def copies(self):
        """tests/gpu/copy_cost.py: what one pinned copy costs by size."""
        return self._measure("copy_cost.py", ["--cpu-sim"] if self.args.cpu_sim else [])

    def copy_order(self):
        """tests/gpu/copy_order.py: whether a copy on a second stream waits for another's queue."""
        return self._measure("copy_order.py", ["--cpu-sim"] if self.args.cpu_sim else [])

    def vmm(self):
        """tests/gpu/vmm_cost.py: what CUDA's VMM calls and pinning cost."""
        return self._measure("vmm_cost.py", ["--cpu-sim", "--granules", "32"] if self.args.cpu_sim else [])

    def hooks(self):
        """tests/gpu/allocator_hooks.py: empty_cache, expandable segments, host VMM."""
        return self._measure("allocator_hooks.py", ["--cpu-sim"] if self.args.cpu_sim else [])

    def oom(self):
        """oom_main in a child: its result, or {"status": ..., "message": ...}."""
        remaining = self.deadline - time.monotonic()
        if remaining < 15:
            return {"status": "skipped", "message": "the time budget was spent"}
        out = self.tmp / "oom.json"
        argv = ["--child-oom", str(out)] + (["--cpu-sim"] if self.args.cpu_sim else [])
        proc, timed_out = self._spawn(argv, min(120, remaining))
        if timed_out:
            return {"status": "timeout", "message": "no result after 120 s"}
        if not out.exists():
            return {"status": "crashed", "message": tail(proc.stderr or proc.stdout)}
        return json.loads(out.read_text())

    def run(self, mode, cfg, limit_bytes=None):
        remaining = self.deadline - time.monotonic()
        if remaining < 15:
            return {"mode": mode, "status": "skipped",
                    "message": f"the time budget (--time-budget {self.args.time_budget:g} s) was spent"}
        out = self.tmp / f"{mode.replace('@', '_')}.json"
        spec = self.tmp / f"{mode.replace('@', '_')}.spec.json"
        spec.write_text(json.dumps({"mode": mode, "config": cfg, "limit_bytes": limit_bytes,
                                    "out": str(out), "snapshot": str(out.with_suffix(".snapshot.pickle"))}))
        timeout = min(self.args.child_timeout, remaining)
        started = time.monotonic()
        proc, timed_out = self._spawn(["--child", str(spec)], timeout)
        wall = time.monotonic() - started
        if timed_out:
            result = {"mode": mode, "status": "timeout",
                      "message": f"no result after {timeout:.0f} s (--child-timeout / --time-budget)",
                      "stderr_tail": tail(timed_out.stderr)}
        elif out.exists():
            result = json.loads(out.read_text())
            if proc.returncode != 0:
                result["message"] += f" (child exit status {proc.returncode})"
        else:
            rc = proc.returncode
            how = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
            result = {"mode": mode, "status": "crashed",
                      "message": f"the child died ({how}) without a result",
                      "stderr_tail": tail(proc.stderr)}
        if proc is not None and proc.stderr.strip() and "stderr_tail" not in result:
            result["stderr_tail"] = tail(proc.stderr)
        result["child_wall_s"] = round(wall, 1)
        if limit_bytes:
            result["limit_bytes"] = limit_bytes
        return result


def tail(text, lines=25):
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").strip().splitlines()[-lines:])


def compare(result, ref):
    """(identical, what differs) of result against ref, or (None, why) when either has no result."""
    if result.get("status") != "ok" or ref is None or ref.get("status") != "ok":
        return None, "no result to compare"
    diffs = []
    if result["loss_digests"] != ref["loss_digests"]:
        diffs.append("loss")
    diffs += [n for n, d in ref["grad_digests"].items() if result["grad_digests"].get(n) != d]
    if result["grad_digests"].keys() != ref["grad_digests"].keys():
        diffs.append("the set of parameters")
    return not diffs, diffs


def fmt_bytes(n):
    if n is None:
        return "n/a"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def fmt_seconds(s):
    return "n/a" if s is None else (f"{s:.2f} s" if s >= 10 else f"{s * 1000:.0f} ms")


def markdown(report):
    cfg, dev = report["workload"], report["device"]
    lines = [f"# vramswap GPU suite: {dev['name']}, {report['date']}", ""]
    device = dev["name"]
    if dev.get("total_memory_bytes"):
        device += f", {fmt_bytes(dev['total_memory_bytes'])}"
    if dev.get("driver"):
        device += f", driver {dev['driver']}"
    lines.append(f"- device: {device}")
    lines.append(f"- torch {report['torch_version']}"
                 + (f", CUDA {dev['torch_cuda']}" if dev.get("torch_cuda") else ""))
    lines.append(f"- workload: GPT-style, {cfg['layers']} blocks, d_model {cfg['d_model']}, "
                 f"{cfg['heads']} heads, "
                 f"batch {cfg['batch']} x seq {cfg['seq']}, vocab {cfg['vocab']}, {cfg['dtype']}, "
                 f"{cfg['attention']} attention, {report.get('num_parameters') or '?'} parameters; "
                 f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps per mode, horizon {cfg['horizon']}")
    backends = sorted({r["install_backend"] for r in report["modes"] if r.get("install_backend")})
    if backends:
        lines.append(f"- vramswap.install() path: {', '.join(backends)}")
    lines.append(f"- command: `{report['command']}`")
    lines += ["", "| mode | status | limit | peak allocated | peak reserved | median step | vs torch "
              "| evictions/step | prefetches/step | faults/step | evicted/step | prefetched/step "
              "| host wait/step | VMM calls/step | mapped/step | identical to torch |",
              "| --- " * 16 + "|"]
    base = next((r.get("median_step_s") for r in report["modes"] if r["mode"] == "torch"), None)
    for r in report["modes"]:
        ok = r["status"] == "ok"
        per = r.get("per_step") or {}
        step = r.get("median_step_s")
        status = r["status"]
        if not ok:
            status = f"{status}: {r.get('message', '')[:160]}".replace("|", "\\|").replace("\n", " ")
        ident = {True: "yes", False: "**NO**", None: "n/a"}[r.get("identical_to_torch")]
        cells = [
            r["mode"], status,
            fmt_bytes(r["limit_bytes"]) if r.get("limit_bytes") else "-",
            fmt_bytes(r.get("peak_allocated_bytes")) if ok else "-",
            fmt_bytes(r.get("peak_reserved_bytes")) if ok else "-",
            fmt_seconds(step) if ok else "-",
            f"{step / base:.2f}x" if ok and base and step else "n/a",
            *(f"{per[k]:g}" if k in per else "-" for k in ("num_evictions", "num_prefetches", "num_faults")),
            *(fmt_bytes(per[k]) if k in per else "-"
              for k in ("bytes_evicted_total", "bytes_prefetched_total")),
            *(fmt_seconds(per[k] / 1e9) if k in per else "-" for k in ("host_wait_ns", "host_vmm_ns")),
            fmt_bytes(per["host_vmm_mapped_bytes"]) if "host_vmm_mapped_bytes" in per else "-",
            "(reference)" if r["mode"] == "torch" else ident,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Peaks are over the timed steps: torch's counters (torch.cuda.max_memory_*) for torch "
              "and save_on_cpu, vramswap.memory_stats() for the vramswap modes, where reserved is the "
              "device memory mapped and allocated also counts evicted blocks (they keep their "
              "addresses). Offload limits are a percentage of the vramswap mode's peak reserved bytes; "
              "vramswap's counters are per timed step; host wait and VMM calls are the host time "
              "vramswap's calls spent waiting for the device and in CUDA's virtual memory calls "
              "(host_wait_ns, host_vmm_ns), mapped the bytes given pages by cuMemMap "
              "(host_vmm_mapped_bytes). \"identical\": every step's loss and every "
              "gradient bit-identical (sha256) to the torch mode's.", ""]
    lines += snapshot_markdown(report["modes"])
    lines += copies_markdown(report.get("copies") or {})
    lines += copy_order_markdown(report.get("copy_order") or {})
    lines += vmm_markdown(report.get("vmm") or {})
    lines += oom_markdown(report.get("oom") or {})
    lines += hooks_markdown(report.get("allocator_hooks") or {})
    lines.append("Checks: all held." if not report["failures"] else "Checks:")
    lines += [f"- FAIL: {f}" for f in report["failures"]]
    lines += [f"- note: {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def snapshot_markdown(modes):
    """Each offload mode's snapshot check (check_snapshot): torch's _memory_viz read the dump."""
    rows = [(r["mode"], r["snapshot"]) for r in modes if r.get("snapshot")]
    if not rows:
        return []
    lines = ["Memory snapshots (vramswap.dump_snapshot of the last step, read by the installed torch's "
             "`python -m torch.cuda._memory_viz stats`):", ""]
    for mode, s in rows:
        read = "read" if s.get("viz_status") == 0 else f"**not read** (exit status {s.get('viz_status')})"
        lines.append(f"- {mode}: {read}; {s.get('segments')} segments, {s.get('trace_events')} trace events, "
                     f"{s.get('trace_evictions')} evictions and {s.get('trace_fetches')} fetches in the trace")
    return lines + [""]


def vmm_markdown(vmm):
    """The VMM section (tests/gpu/vmm_cost.py): host time per call, as vramswap makes them."""
    if vmm.get("status") != "ok":
        return [f"VMM calls: {vmm.get('status', 'not measured')}: {vmm.get('message', '')}", ""]
    per = {k: vmm[k]["median_us"] for k in ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease")}
    pinned = ", ".join(f"{fmt_bytes(int(n))} {p['alloc_us'] / 1000:.1f} ms"
                       for n, p in sorted(vmm["pinned"].items(), key=lambda kv: int(kv[0])))
    lines = [f"VMM calls (host time, median of {vmm['granules']} granules of {fmt_bytes(vmm['granule_bytes'])}): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in per.items())
            + f"; one cuMemSetAccess over all {vmm['granules']} granules {vmm['cuMemSetAccess_range']['median_us'] / 1000:.1f} ms, "
            f"one cuMemUnmap over them {vmm['cuMemUnmap_range']['median_us'] / 1000:.1f} ms. Pinning (cuMemHostAlloc): {pinned}.", ""]
    by_size = vmm.get("one_handle_by_granules") or {}
    if by_size:
        lines += ["One handle per block (map + access + unmap, host time): "
                  + ", ".join(f"{n} granule{'s' if n != '1' else ''} {t['map'] + t['access'] + t['unmap']:.1f} us"
                              for n, t in by_size.items()) + ".", ""]
    events = vmm.get("events") or {}
    if events:
        lines += ["Events (host time, median): " + ", ".join(f"{k} {v['median_us']:.2f} us" for k, v in events.items())
                  + ".", ""]
    busy = vmm.get("busy") or {}
    if busy:
        lines += [f"Per granule while the device is busy{'' if busy.get('device_still_busy') else ' (it finished during the calls)'}: "
                  + ", ".join(f"{k} {busy[k]['median_us']:.1f} us" for k in ("cuMemMap", "cuMemSetAccess", "cuMemUnmap"))
                  + " (median).", ""]
    return lines


def oom_markdown(oom):
    """The out-of-memory check's line."""
    if oom.get("status") != "ok":
        return [f"Out-of-memory check: {oom.get('status', 'not run')}: {oom.get('message', '')[:300]}", ""]
    path = f" (install() path: {oom['install_backend']})" if oom.get("install_backend") else ""
    return [f"Out-of-memory check{path}: {fmt_bytes(oom['request_bytes'])} asked for under a limit of "
            f"{fmt_bytes(oom['limit_bytes'])} raised `{oom['exception']}`"
            f" (torch.cuda.OutOfMemoryError: {'yes' if oom.get('is_torch_oom') else 'no'}); allocating "
            f"afterwards {'worked' if oom.get('recovered') else '**failed**'}. Message: "
            f"\"{oom.get('message', '')[:400]}\"".replace("|", "\\|").replace("\n", " "), ""]


def hooks_markdown(hooks):
    """The allocator-hooks line (tests/gpu/allocator_hooks.py)."""
    if hooks.get("status") != "ok":
        return [f"Allocator hooks: {hooks.get('status', 'not run')}: {hooks.get('message', '')[:300]}", ""]
    parts = []
    for name, c in (hooks.get("cases") or {}).items():
        facts = ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("status", "message"))
        parts.append(f"{name} {c['status']}" + (f" ({facts})" if facts else "")
                     + (f": {c['message'][:200]}" if c.get("message") else ""))
    return ["Allocator hooks (tests/gpu/allocator_hooks.py): " + "; ".join(parts).replace("|", "\\|") + ".", ""]


def clock_words(measured):
    """What a measurement's times are (its "clock"): cudasim's model or the card's."""
    return "cudasim's model, not a card" if measured.get("clock") == "cudasim" else "device time (CUDA events)"


def copies_markdown(copies):
    """The copy-cost section (tests/gpu/copy_cost.py): per size the device time of one copy
    each way, and the fit t = a + s / B with its break-even size s* = a * B."""
    if copies.get("status") != "ok":
        return [f"Copy cost: {copies.get('status', 'not measured')}: {copies.get('message', '')}", ""]

    def size(n):
        return fmt_bytes(n) if n >= MIB else f"{n / 1024:.0f} KiB"

    where = clock_words(copies)
    lines = [f"Copy cost (pinned host memory, one cudaMemcpyAsync per copy; {where}):", "",
             "| bytes | device to host | host to device |", "| --- | --- | --- |"]
    rows = {(r["direction"], r["bytes"]): r for r in copies["rows"]}
    for nbytes in sorted({r["bytes"] for r in copies["rows"]}):
        cells = [size(nbytes)]
        for d in ("device_to_host", "host_to_device"):
            r = rows.get((d, nbytes))
            cells.append(f"{r['device_ns_per_copy'] / 1000:.2f} us" if r else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for d, f in copies.get("fit", {}).items():
        rate = f"{f['bytes_per_ns']:.1f} GB/s" if f.get("bytes_per_ns") is not None else "n/a"
        be = size(f["breakeven_bytes"]) if f.get("breakeven_bytes") is not None else "n/a"
        lines.append(f"- {d.replace('_', ' ')}: fixed cost {f['fixed_ns'] / 1000:.2f} us, rate {rate}, "
                     f"break-even size (fixed cost = transfer time) {be}"
                     + ("; the host was slower than the device at the smallest size" if f.get("host_bound_at_smallest")
                        else ""))
    lines += ["", "VRAMSWAP_MIN_OFFLOAD_BYTES (64 KiB by default) should not be far below the break-even "
              "size: below it a block's copies spend more time on their fixed cost than on its bytes.", ""]
    return lines


def copy_order_markdown(order):
    """The copy-order section (tests/gpu/copy_order.py): when a small host-to-device copy on a
    second stream landed, against a queue of large ones on the first."""
    if order.get("status") != "ok":
        return [f"Copy order: {order.get('status', 'not measured')}: {order.get('message', '')}", ""]
    where = clock_words(order)
    lines = [f"Copy order ({order['queue']} copies of {fmt_bytes(order['big_bytes'])} host to device on one stream, "
             f"then {fmt_bytes(order['small_bytes'])} on another; {where}):", "",
             "| second stream | queue landed | its copy landed | share of the queue's time |",
             "| --- | ---: | ---: | ---: |"]
    for c in order["cases"]:
        lines.append(f"| {c['case']} ({c['priority']}) | {c['queue_ns'] / 1e6:.3f} ms | {c['small_ns'] / 1e6:.3f} ms | "
                     f"{c['small_share']:.3f} |")
    lines += ["", "Near 1: the second stream's copy waited for the whole queue (as cudasim serves copies); "
              "far below: the copy engine took it sooner, and a second fetch stream would let an urgent "
              "fetch pass planned ones.", ""]
    return lines


def measurement(label, run):
    """Runs one of the Runner's measurement steps (copies, copy order, VMM calls), saying so
    on a line of its own with its status: its result."""
    print(f"{label:24s} ...", end="", flush=True)
    result = run()
    print(f" {result['status']}" + (f": {result.get('message', '')}" if result["status"] != "ok" else ""))
    return result


def measurement_failures(label, result):
    """A measurement step's failure for the report's list: an error or a timeout (a skipped
    step is not one)."""
    if result["status"] in ("error", "timeout"):
        return [f"{label}: {result['status']}: {result.get('message', '')[:300]}"]
    return []


def output_paths(args, date, slug):
    """GPU results are never overwritten (-2, -3, ... when a name is taken): they are
    committed. --cpu-sim results are: a smoke run's files are not worth keeping."""
    if args.out:
        out_dir = Path(args.out)
    elif args.cpu_sim:
        out_dir = Path(tempfile.mkdtemp(prefix="vramswap-gpu-suite-"))
    else:
        out_dir = RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"cpu-sim-{date}" if args.cpu_sim else f"gpu-{date}-{slug}"
    n = 1
    while True:
        name = stem if n == 1 else f"{stem}-{n}"
        json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
        if args.cpu_sim or not (json_path.exists() or md_path.exists()):
            return json_path, md_path
        n += 1


def device_slug(name):
    """"NVIDIA H100 80GB HBM3" -> "h100": the first word with a digit, after the vendor."""
    words = re.findall(r"[a-z0-9]+", name.lower().replace("nvidia", ""))
    for w in words:
        if re.search(r"\d", w):
            return w
    return words[0] if words else "gpu"


def nvidia_smi():
    """Driver release and name of GPU 0 from nvidia-smi, or {} when it is not there."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {}
    try:
        query = [exe, "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader", "-i", "0"]
        out = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    parts = [p.strip() for p in out.split(",")]
    return {"driver": parts[0], "smi_name": parts[1], "smi_memory": parts[2]} if len(parts) == 3 else {}


def main(argv):
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in [sys.executable, os.path.relpath(__file__)] + argv)
    with tempfile.TemporaryDirectory(prefix="vramswap-gpu-suite-work-") as tmp:
        runner = Runner(args, tmp)
        info = runner.info()
        if args.cpu_sim:
            device = {"name": "cudasim (CPU emulation, no GPU)", "torch_cuda": None}
            slug = "cpu-sim"
        else:
            if not info["cuda_available"]:
                print(f"suite.py: no CUDA device is visible to torch {info['torch_version']} "
                      f"(built for CUDA {info['torch_cuda']}); this suite measures a real GPU. Use "
                      "--cpu-sim to exercise it without one.", file=sys.stderr)
                return 2
            device = {k: info.get(k) for k in ("name", "total_memory_bytes", "capability", "torch_cuda",
                                               "driver_cuda_version", "device_count")}
            device.update(nvidia_smi())
            slug = device_slug(device["name"])
        cfg = resolve_config(args, info["has_sdpa"])

        print(f"device: {device['name']}" + (f" (driver {device['driver']})" if device.get("driver") else ""))
        print(f"torch {info['torch_version']}; workload: {json.dumps(cfg, sort_keys=True)}")
        if runner.removed_env:
            print(f"note: not passed to the modes: {', '.join(runner.removed_env)}")

        plan = ["torch"]
        if "vramswap" in args.modes:
            plan.append("vramswap")
        if "offload" in args.modes:
            plan += [f"vramswap_offload@{p}" for p in args.percents]
        if "save_on_cpu" in args.modes and not args.cpu_sim:
            plan.append("save_on_cpu")  # last: the slowest, and the least needed in a tight budget

        results = []
        by_mode = {}
        for mode in plan:
            limit = None
            pct = offload_percent(mode)
            if pct is not None:
                base = by_mode.get("vramswap", {})
                peak = base.get("peak_reserved_bytes") if base.get("status") == "ok" else None
                if not peak:
                    r = {"mode": mode, "status": "skipped",
                         "message": "no peak from the vramswap mode to set a limit from"}
                    results.append(r)
                    by_mode[mode] = r
                    print(f"{mode:24s} skipped: {r['message']}")
                    continue
                limit = max(LIMIT_GRANULE, peak * pct // 100 // LIMIT_GRANULE * LIMIT_GRANULE)
            print(f"{mode:24s} ...", end="", flush=True)
            r = runner.run(mode, cfg, limit)
            results.append(r)
            by_mode[mode] = r
            if r["status"] == "ok":
                print(f" ok: median step {fmt_seconds(r['median_step_s'])}, peak reserved "
                      f"{fmt_bytes(r.get('peak_reserved_bytes'))} ({r['child_wall_s']} s)")
                if r.get("stderr_tail"):  # warnings (e.g. install() falling back to ctypes)
                    print("    stderr: " + "\n    ".join(r["stderr_tail"].splitlines()[-8:]))
            else:
                print(f" {r['status']}: {r.get('message', '')}")
                if r.get("traceback"):
                    print("    " + r["traceback"].strip().replace("\n", "\n    "))
                elif r.get("stderr_tail"):
                    print("    " + r["stderr_tail"].replace("\n", "\n    "))
        if args.cpu_sim:
            results.append({"mode": "save_on_cpu", "status": "skipped",
                            "message": "needs a GPU (pinned host memory and device copies)"})
        copies = measurement("copies", runner.copies)
        order = measurement("copy order", runner.copy_order)
        vmm = measurement("VMM calls", runner.vmm)
        hooks = measurement("allocator hooks", runner.hooks)
        print(f"{'out-of-memory check':24s} ...", end="", flush=True)
        oom = runner.oom()
        print(f" {oom['status']}: " + (f"{oom.get('exception')}: {oom.get('message', '')[:300]}"
                                       if oom["status"] == "ok" else oom.get("message", "")))

    failures, notes = evaluate(results, by_mode, args)
    failures += measurement_failures("copies", copies)
    failures += oom_failures(oom)
    failures += measurement_failures("copy order", order)
    failures += measurement_failures("VMM calls", vmm)
    failures += measurement_failures("allocator hooks", hooks)
    ref = by_mode.get("torch", {})
    date = datetime.date.today().isoformat()
    for r in results:  # the digests did their work; the files keep one per mode
        if "grad_digests" in r:
            digests = json.dumps(r.pop("grad_digests"), sort_keys=True).encode()
            r["grads_digest"] = hashlib.sha256(digests).hexdigest()
    report = {"date": date, "command": command, "device": device, "torch_version": info["torch_version"],
              "workload": cfg, "num_parameters": ref.get("num_parameters"), "modes": results, "copies": copies, "copy_order": order, "vmm": vmm, "allocator_hooks": hooks, "oom": oom,
              "failures": failures, "notes": notes, "passed": not failures}
    json_path, md_path = output_paths(args, date, slug)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    md_path.write_text(md)
    print()
    print(md)
    print(f"wrote {json_path} and {md_path}")
    print("PASS" if not failures else f"FAIL: {len(failures)} check(s) failed")
    return 0 if not failures else 1


def evaluate(results, by_mode, args):
    """Compares every mode with torch (and the offload modes with vramswap); returns
    (failures, notes)."""
    failures, notes = [], []
    ref = by_mode.get("torch")
    for r in results:
        mode, status = r["mode"], r["status"]
        if status in ("error", "crashed", "timeout"):
            failures.append(f"{mode}: {status}: {r.get('message', '')[:300]}")
        elif status == "oom":
            if args.strict and is_vramswap_mode(mode):
                failures.append(f"{mode}: ran out of memory (--strict): {r.get('message', '')[:300]}")
            else:
                notes.append(f"{mode} ran out of memory")
        elif status == "skipped" and args.strict and is_vramswap_mode(mode):
            failures.append(f"{mode}: skipped (--strict): {r.get('message', '')}")
        if mode == "torch" or status != "ok":
            continue
        identical, diffs = compare(r, ref)
        r["identical_to_torch"] = identical
        if identical is False:
            what = (f"{mode}: loss or gradients differ from the torch mode's "
                    f"({len(diffs)}: {', '.join(diffs[:8])})")
            (failures if is_vramswap_mode(mode) else notes).append(what)
        if offload_percent(mode) is not None:
            same, _ = compare(r, by_mode.get("vramswap"))
            r["identical_to_vramswap"] = same
            limit, peak = r.get("limit_bytes"), r.get("peak_reserved_bytes")
            if limit and peak is not None and peak > limit:
                failures.append(f"{mode}: peak reserved {fmt_bytes(peak)} passed the limit {fmt_bytes(limit)}")
            if args.strict and not (r.get("totals") or {}).get("num_evictions"):
                failures.append(f"{mode}: no eviction under a limit of {fmt_bytes(limit)} (--strict)")
            snap = r.get("snapshot")
            if snap and snap["viz_status"] != 0:
                failures.append(f"{mode}: torch.cuda._memory_viz stats could not read vramswap's snapshot: "
                                f"{snap['viz_output'][-300:]}")
            if args.strict and snap and not snap["trace_evictions"]:
                failures.append(f"{mode}: the snapshot's trace shows no eviction (--strict)")
            if args.strict and r.get("num_tracked_blocks"):
                failures.append(f"{mode}: {r['num_tracked_blocks']} handles still tracked after "
                                "backward (--strict)")
    if ref is not None and ref["status"] != "ok":
        notes.append("the torch mode has no result: nothing could be checked for bit-identity")
    return failures, notes


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "--child-info":
        sys.exit(info_main(sys.argv[2]))
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--child-oom":
        sys.exit(oom_main(sys.argv[2], cpu_sim=sys.argv[3:] == ["--cpu-sim"]))
    sys.exit(main(sys.argv[1:]))
