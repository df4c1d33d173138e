"""The shipped benchmark scenarios, and how a scenario runs.

A scenario is a workload (built by a factory), the card it runs on (its memory and its PCIe
link) and the policies it compares:

  none               vramswap's pool with no offload, on the card. When the workload does not
                     fit the card, this run reports where it ran out, and a second "none" run
                     on a card large enough (cudasim's memory is unbacked, so any size costs
                     nothing) measures the no-offload peak the limits are taken from.
  offload_all        every saved tensor copied out at save and back at use (policy_offload_all.py's
                     Note [offload_all]), restored when backward asks (horizon 0, torch's
                     save_on_cpu) and with the next 4 prefetched (a layer-prefetching
                     offloader)
  vramswap           at limits of 90%, 75% and 50% of the no-offload peak (capped at the
                     card; the whole card too when the peak does not fit it) x horizons 2, 4
                     and 8; and at limits above the peak (112%, where the default soft
                     limit is above the peak too, and 125%; horizon 4), where nothing
                     should move

Limits are rounded down to whole 2 MiB granules. Everything is deterministic: the workloads
are built from shapes (or read from a file), and cudasim's virtual time depends only on the
order of the calls (one host thread per run).

  SCENARIOS                  name -> Scenario
  DEFAULT                    the scenario `vramswap bench` and scripts/demo run with no name
  run_scenario(sc, ...)      runs every policy of a scenario; returns a ScenarioResult

Thread safety: run_scenario may be called from any thread; it starts child processes.
"""
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import runner

GiB = 1 << 30
GRANULE = 2 << 20
# VRAMSWAP_HOST_LIMIT's least value, and the unit a disk scenario's pinned tier is sized in.
HOST_TIER_MIN = 2 << 20
_REPO_ROOT = Path(__file__).resolve().parents[4]


def traces_dir():
    """Where the torch memory snapshots are: VRAMSWAP_TRACES_DIR, else bench/traces."""
    env = os.environ.get("VRAMSWAP_TRACES_DIR")
    return Path(env) if env else _REPO_ROOT / "bench" / "traces"


MAGMA27_FILE = "MAGMA27_cs336small_b32_s256_fp32_fwdbwd.pickle"


def magma27_path():
    """The MAGMA27 snapshot's path, or None when it is not there."""
    p = traces_dir() / MAGMA27_FILE
    return p if p.exists() else None


@dataclass
class Scenario:
    name: str
    description: str
    factory: object              # () -> Workload
    card_bytes: int
    pcie_gbps: float
    card_name: str = ""
    limits: tuple = (0.9, 0.75, 0.5)     # shares of the no-offload peak
    horizons: tuple = (2, 4, 8)
    # Limits above the peak, where nothing should move: 112% is the smallest at which the
    # default soft limit (90% of the limit) is above the peak too.
    above: tuple = (1.12, 1.25)
    offload_all_horizons: tuple = (0, 4)
    # Extra vramswap runs at each limit with horizon 4 and another VRAMSWAP_SOFT_LIMIT (the
    # default is 90% of the limit): how much the background-eviction headroom matters.
    soft_limits: tuple = ("95%",)
    duplex: str = "full"
    hbm_gbps: float = None
    available: object = None             # () -> None when it can run, else the reason it cannot
    notes: str = ""                      # what a reader of the results should know (README)
    kept: bool = False                   # its workload keeps tensors (frozen weights, optimizer state)
    # A disk tier behind a small pinned one (runner.py's Note [A disk in the benchmark]): the
    # pinned tier holds this share of the bytes that must leave at each limit (the no-offload
    # peak minus the limit), the rest goes on to a disk of disk_gbps (--disk overrides it).
    host_share: float = None
    disk_gbps: float = None
    _workload: object = field(default=None, repr=False)

    def workload(self):
        if self._workload is None:
            self._workload = self.factory().validate()
        return self._workload

    def unavailable(self):
        return self.available() if self.available else None


def _gpt(**shape):
    def make():
        from . import gpt
        return gpt.generate(**shape)
    return make


def _vgg(**shape):
    def make():
        from . import vgg
        return vgg.generate(**shape)
    return make


def _snapshot(file_name):
    def make():
        from . import snapshot
        return snapshot.load(traces_dir() / file_name)
    return make


def _needs_trace(file_name):
    def check():
        if not (traces_dir() / file_name).exists():
            return (f"{file_name} is not in {traces_dir()} (set VRAMSWAP_TRACES_DIR to the directory "
                    "that holds the torch memory snapshots)")
        return None
    return check


H100 = dict(card_bytes=80 * GiB, pcie_gbps=55.0, card_name="H100 80 GB, PCIe 5.0 (55 GB/s each way)")
# vDNN's card: a Titan X (Maxwell), 12 GB on PCIe 3.0 x16 (about 12 GB/s each way).
TITAN_X = dict(card_bytes=12 * GiB, pcie_gbps=12.0, card_name="Titan X (Maxwell) 12 GB, PCIe 3.0 (12 GB/s each way)")

SCENARIOS = {s.name: s for s in (
    Scenario("gpt-small", "GPT-2 small (124M): 12 layers, hidden 768, 12 heads, vocabulary 50257, sequence "
             "1024, batch 8, bf16 autocast, eager attention, fused AdamW",
             _gpt(layers=12, hidden=768, heads=12, seq=1024, batch=8), **H100,
             notes="Saved activations are 69% of the peak here (the 50257-token logits are much of the rest). "
                   "To fit a limit L at least (peak - L) bytes must leave and come back, while offload_all moves "
                   "every saved byte S, so at 50% offload_all can move at most 2 S / peak = 1.38x the traffic any "
                   "allocator must: a 1.5x saving is out of reach on this step whatever the policy."),
    # The same layout with the CS336 small model's 10,000-token vocabulary: less of the peak
    # is logits, more is saved activations (83% against gpt-small's 69%), the kind of step
    # where offloading only what must move saves the most traffic (see bench/results).
    Scenario("gpt-small-v10k", "GPT-2 small layout with a 10,000-token vocabulary (the CS336 small model's "
             "sizes): 12 layers, hidden 768, 12 heads, sequence 1024, batch 8, bf16, eager attention, fused AdamW",
             _gpt(layers=12, hidden=768, heads=12, seq=1024, batch=8, vocab=10000), **H100,
             notes="Saved activations are 83% of the peak, so at 50% offload_all can move up to 1.65x what an "
                   "allocator must. tests/bench_py/test_runner.py holds vramswap to the issue's bounds on this "
                   "step."),
    Scenario("gpt-1.3b", "GPT 1.3B: 24 layers, hidden 2048, 16 heads, sequence 2048, batch 8, bf16, eager "
             "attention, fused AdamW (does not fit an 80 GB card without offload)",
             _gpt(layers=24, hidden=2048, heads=16, seq=2048, batch=8), **H100),
    Scenario("gpt-1.3b-flash", "GPT 1.3B as gpt-1.3b with flash attention (scaled_dot_product_attention): no "
             "T x T tensors saved",
             _gpt(layers=24, hidden=2048, heads=16, seq=2048, batch=8, attention="flash"), **H100),
    # Kept tensors (vramswap.offload_frozen, offload_optimizer): what moves between uses of
    # tensors that outlive the step, beside the saved activations.
    Scenario("gpt-small-lora", "GPT-2 small with LoRA (rank 16) on every block's four Linears: their weights "
             "frozen and kept (vramswap.offload_frozen), the adapters, embeddings and norms trained; sequence "
             "1024, batch 8, bf16, eager attention, fused AdamW",
             _gpt(layers=12, hidden=768, heads=12, seq=1024, batch=8, lora_rank=16), **H100, kept=True,
             notes="The frozen weights (324 MiB, fp32) are read once a step, by autocast's cast in the forward: "
                   "once copied to the host they leave with no copy. offload_all stands for axolotl's layer "
                   "offloading beside save_on_cpu: each frozen weight out after its use (copied the first time "
                   "only) and back at its next use."),
    Scenario("gpt-medium-adamw", "GPT-2 medium (355M): 24 layers, hidden 1024, 16 heads, sequence 512, batch 1, "
             "bf16, eager attention, fused AdamW run per layer with its state kept (vramswap.offload_optimizer): "
             "parameters, gradients and AdamW state are 73% of the peak",
             _gpt(layers=24, hidden=1024, heads=16, seq=512, batch=1, kept_optimizer=True), **H100, kept=True,
             notes="AdamW's state (2.6 GiB) changes in every step: whatever of it leaves is copied out after "
                   "each optimizer step and back before the next. offload_all stands for ZeRO-Offload's state "
                   "movement with the optimizer kept on the GPU: each layer's state out after its step, back "
                   "at the next."),
    # The host is the bottleneck: the pinned tier holds a quarter of what must leave, the
    # rest goes to an NVMe-class disk (the must-show for the disk tier, as a step).
    Scenario("gpt-small-disk", "GPT-2 small at batch 2 (sequence 1024, bf16, eager attention, fused AdamW) with "
             "the pinned host tier at a quarter of the bytes that must leave at each limit and a disk tier "
             "behind it at 6 GB/s (one PCIe 4.0 NVMe drive)",
             _gpt(layers=12, hidden=768, heads=12, seq=1024, batch=2), **H100,
             limits=(0.75, 0.6), horizons=(4,), above=(), soft_limits=(), offload_all_horizons=(),
             host_share=0.25, disk_gbps=6.0,
             notes="What the pinned tier cannot hold is written to the disk and read back within the step, at a "
                   "ninth of the link's rate: the step waits for the disk. The bound beside a disk run is the larger "
                   "of the link's bound and the disk's floor (bound.py's Note [The disk's floor]): the least bytes the "
                   "disk must move in the step, at its rate. Beside each disk run, the same limit with an unlimited "
                   "pinned tier. At 50% vramswap runs out of memory in the loss with or without a disk (1.9 GiB of "
                   "untagged tensors live there and nothing cold is left to evict), so the lower limit is 60%."),
    Scenario("vgg16-b128", "VGG-16, batch 128, fp32, SGD with momentum (the vDNN case)", _vgg(batch=128), **TITAN_X,
             notes="At 50% the limit is below the step's working set: the backward of pool1 alone needs its "
                   "saved input, its indices and a new input gradient (1.53 GiB each at batch 128) beside the "
                   "parameters, gradients and momentum, so that run reports where it ran out."),
    Scenario("vgg16-b256", "VGG-16, batch 256, fp32, SGD with momentum (does not fit the card without offload)",
             _vgg(batch=256), **TITAN_X),
    Scenario("magma27", "Replay of the MAGMA27 torch memory snapshot (CS336 small LM, batch 32, sequence 256, "
             "fp32, forward and backward, no optimizer)",
             _snapshot(MAGMA27_FILE), available=_needs_trace(MAGMA27_FILE), **H100,
             notes="The replay reproduces the trace's live bytes exactly (peak 12,550,078,464 B). A snapshot does "
                   "not say when the forward last read a saved tensor, so snapshot.py makes every saved tensor "
                   "cold at the end of the forward; this trace peaks inside the forward (at cross-entropy), so "
                   "below the no-offload peak nothing is evictable when it is needed and every such limit runs "
                   "out of memory. The generated steps (gpt-*) know each tensor's cold point."),
)}
DEFAULT = "gpt-small"


def is_trace_path(name):
    """Whether a scenario name given on the command line is a trace file to replay (a file
    that exists: a torch memory snapshot, *.pickle, or an operator log of the DTR
    prototype, *.log)."""
    p = Path(name)
    return p.suffix in (".pickle", ".log") and p.is_file()


def load_trace(path):
    """The Workload of a trace file: an operator log of the DTR prototype (dtr.py) when its
    first line is one of its instructions, else a torch memory snapshot (snapshot.py).
    Raises the reader's error (dtr.DtrLogError, snapshot.SnapshotError) or OSError."""
    from . import dtr
    if dtr.is_log(path):
        return dtr.load(path)
    from . import snapshot
    return snapshot.load(path)


def trace_scenario(path, until=None):
    """A scenario that replays the trace at `path` (load_trace) on the H100 card at the
    standard limits, as `vramswap replay` replays it (until: stop at the start of that
    phase, see truncate())."""
    path = Path(path)

    def make():
        w = load_trace(path)
        return truncate(w, until) if until else w
    return Scenario(path.stem, f"Replay of {path.name}", make, **H100)


def truncate(w, phase):
    """The workload `w` up to the start of its first `phase` phase: the ops from there on
    are left out and nothing more is freed (tensors live there stay live at the end).
    meta["until"] says where it was cut. Raises ValueError when `w` has no such phase or
    starts with it."""
    at = next((i for i, op in enumerate(w.ops) if op == ("phase", phase)), None)
    if at is None:
        phases = list(dict.fromkeys(op[1] for op in w.ops if op[0] == "phase"))
        raise ValueError(f"it has no {phase} phase (its phases: {', '.join(phases) or 'none'})")
    if not any(op[0] in ("alloc", "compute") for op in w.ops[:at]):
        raise ValueError(f"nothing comes before its {phase} phase")
    from .workload import Workload
    cut = Workload(w.name, list(w.ops[:at]), dict(w.meta))
    cut.meta["until"] = {"phase": phase, "op": at, "ops_total": len(w.ops)}
    return cut


@dataclass
class ScenarioResult:
    scenario: Scenario
    results: list
    reference_peak: int          # the no-offload peak the limits are shares of
    workload_facts: dict

    @property
    def name(self):
        return self.scenario.name


def _granules(n):
    return max(GRANULE, int(n) // GRANULE * GRANULE)


def quick_share(sc, workload, reference_peak):
    """--quick's limit, as a share of the no-offload peak: the lowest of the scenario's shares
    at which some policy fits the step's working set (the bound is feasible: bound.py), so
    that the one run --quick makes shows offload at work rather than an out-of-memory
    (VGG-16 at batch 128 does not fit in half its peak; 75% is its quick share). The largest
    share when none fits."""
    from . import bound, measure
    start, _ = measure.step_start(workload.ops)
    shares = sorted(sc.limits)
    for share in shares:
        limit = _granules(share * reference_peak)
        if limit <= sc.card_bytes and bound.lower_bound(workload, limit, sc.pcie_gbps, duplex=sc.duplex,
                                                        first_op=start or 0).feasible:
            return share
    return shares[-1]


def plan(sc, reference_peak, quick_at=None):
    """The vramswap runs of a scenario once its no-offload peak is known:
    [(label, limit, horizon, soft limit or None for the default)]. quick_at (--quick, a share
    from quick_share()): vramswap only at that share with horizon 4, and above the peak."""
    limits = (quick_at,) if quick_at else sc.limits
    horizons = (4,) if quick_at else sc.horizons
    runs = []
    for share in limits:
        limit = _granules(share * reference_peak)
        if limit > sc.card_bytes:
            continue
        for h in horizons:
            runs.append((f"vramswap {share:.0%}", limit, h, None))
        for soft in sc.soft_limits:
            runs.append((f"vramswap {share:.0%} soft {soft}", limit, 4, soft))
    if reference_peak > sc.card_bytes:
        for h in horizons:
            runs.append(("vramswap card", sc.card_bytes, h, None))
    for share in sc.above:
        if share * reference_peak <= sc.card_bytes:
            runs.append((f"vramswap {share:.0%}", _granules(share * reference_peak), 4, None))
    return runs


def disk_options(sc, reference_peak, limit, disk_gbps=None):
    """A vramswap run's pinned tier and disk at `limit` (runner.run's host_limit_bytes and
    disk_gbps): {} for a scenario without a disk tier. disk_gbps overrides the scenario's."""
    if sc.host_share is None:
        return {}
    must_leave = max(0, reference_peak - limit)
    host = max(HOST_TIER_MIN, int(sc.host_share * must_leave) // HOST_TIER_MIN * HOST_TIER_MIN)
    return {"host_limit_bytes": host, "disk_gbps": disk_gbps or sc.disk_gbps}


def run_scenario(sc, quick=False, workers=2, record=True, progress=None, timeout_s=600, warmup=runner.DEFAULT_WARMUP,
                 disk_gbps=None):
    """Runs every policy of `sc` (quick: vramswap only at quick_share() with horizon 4, plus the
    limits above the peak) and returns a ScenarioResult with the results in table order. progress(msg)
    is called as runs end. warmup: the steps run before the measured one (measure.py's Note
    [Warm-up steps]). disk_gbps: the disk's rate in a scenario with a disk tier (default: the
    scenario's)."""
    w = sc.workload()
    peak_live, final_live = w.live_bytes()
    base = dict(card_bytes=sc.card_bytes, pcie_gbps=sc.pcie_gbps, duplex=sc.duplex, hbm_gbps=sc.hbm_gbps,
                record=record, warmup=warmup)
    first = [dict(base, policy="none", label="none")]
    for h in sc.offload_all_horizons:
        first.append(dict(base, policy="offload_all", label="offload_all", horizon=h))

    def note(i, r):
        if progress:
            progress(f"{sc.name}: {r.get('label') or r['policy']} done ({r['status']}, {r['wall_s']} s)")

    results = runner.run_many(w, first, workers=workers, timeout_s=timeout_s, on_result=note)
    if results[0]["status"] != "ok":
        # The no-offload peak on a card that surely holds it (the pool rounds and caches
        # above the live bytes; cudasim's memory is unbacked, so its size costs nothing).
        big = min(1 << 40, max(2 * sc.card_bytes, _granules(4 * peak_live) + GiB))
        results[1:1] = runner.run_many(w, [dict(base, policy="none", label="none, larger card", card_bytes=big)],
                                       workers=1, timeout_s=timeout_s, on_result=note)
    done = [r for r in results if r["policy"] == "none" and r["status"] == "ok"]
    if not done:
        raise runner.RunError(f"{sc.name}: no no-offload run completed, even on a larger card: "
                              + "; ".join(r.get("error") or "" for r in results if r["policy"] == "none"))
    reference = min(r["peak_device_bytes"] for r in done)
    second = []
    for label, limit, h, soft in plan(sc, reference, quick_share(sc, w, reference) if quick else None):
        run = dict(base, policy="vramswap", label=label, limit_bytes=limit, horizon=h, soft_limit=soft)
        disk = disk_options(sc, reference, limit, disk_gbps)
        if disk:
            second.append(dict(run, label=f"{label} disk", **disk))
            run["label"] = f"{label} host unlimited"
        second.append(run)
    results += runner.run_many(w, second, workers=workers, timeout_s=timeout_s, on_result=note)
    base_live = runner.live_base_bytes(w)  # a snapshot's carried-in tensors (runner.py)
    facts = {"ops": len(w.ops), "peak_live_bytes": peak_live - base_live, "final_live_bytes": final_live - base_live,
             "live_base_bytes": base_live, "saved_bytes": w.saved_bytes(), "compute_ns": w.compute_ns(),
             "meta": _plain(w.meta)}
    return ScenarioResult(sc, results, reference, facts)


def _plain(value):
    """`value` with anything JSON cannot hold turned into its repr."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
