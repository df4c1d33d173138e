"""What a benchmark run shows: the table, SVG plots, a Chrome trace, JSON.

  table(results)                 the text table (columns below), one row per run
  markdown_table(results)        the same as a Markdown table
  memory_svg(results, ...)       device memory over virtual time, one line per run, each
                                 run's limit drawn dashed in its colour, the card solid
  timeline_svg(result, ...)      the copy timeline of one run: compute, H2D and D2H lanes
  chrome_trace(result, ...)      one step as Chrome-trace JSON (Perfetto, chrome://tracing)
  summary(result)                a result without its timeline and series (for JSON files)
  write(out_dir, scenario, results, ...)  all of the above into a directory

Table columns: policy (and its label), limit (vramswap's VRAMSWAP_LIMIT, as a share of the
no-offload peak and in bytes), horizon, status (ok, or oom at an op), peak device (cudasim's
peak physical memory), d2h and h2d (bytes copied each way), step time (virtual), stall
(kernels waiting on copies), idle (the compute engine's idle time: step minus compute),
ideal (the per-phase bound of measure.py's Note [What is measured]) and step/ideal, bound
(the policy-independent lower bound at the run's limit: bound.py, measure.py's Note [The
bound beside every run]; "infeasible" where no policy fits) and step/bound, and first step
(the first step's time from the same run when the step measured came after warm-up steps;
"(this)" when the measured step is the first). Lines under the table say which step was
measured, why a workload could not be repeated as a step, and where a limit is infeasible.

Plots are written by hand (no plotting library): plain SVG 1.1 that browsers and GitHub
render. Times are virtual (cudasim's clock), in milliseconds on the axes.

Thread safety: pure functions of their arguments, except write(), which writes files.
"""
import html
import json
from pathlib import Path

from .._files import write_file

COLUMNS = ("policy", "limit", "horizon", "status", "peak device", "d2h", "h2d", "step time", "stall",
           "idle", "ideal", "step/ideal", "bound", "step/bound", "first step")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22")
PHASE_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "other": "#8c8c8c"}
LANE_COLORS = {"h2d": "#2ca02c", "d2h": "#d62728", "kernel": "#4c72b0"}


# ---- formatting --------------------------------------------------------------------------

def fmt_bytes(n):
    """Bytes in binary units with three significant digits: 0 B, 512 MiB, 11.7 GiB."""
    if n is None:
        return "-"
    n = int(n)
    if n == 0:
        return "0 B"
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n} B"


def fmt_ns(ns):
    """Virtual time: 0, 850 us, 12.3 ms, 1.52 s."""
    if ns is None:
        return "-"
    if ns == 0:
        return "0"
    if ns < 1_000_000:
        return f"{ns / 1e3:.3g} us"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.3g} ms"
    return f"{ns / 1e9:.3g} s"


def run_name(r):
    """A run's name in tables and legends: its label, or policy and settings."""
    if r.get("label"):
        return r["label"]
    if r["policy"] == "vramswap":
        return f"vramswap {fmt_bytes(r.get('limit_bytes'))} h{r.get('horizon')}"
    if r["policy"] == "offload_all":
        return f"offload_all h{r.get('horizon')}"
    return r["policy"]


def _limit_cell(r, reference):
    limit = r.get("limit_bytes")
    if not limit:
        return "-"
    if reference:
        return f"{100 * limit / reference:.0f}% ({fmt_bytes(limit)})"
    return fmt_bytes(limit)


def _status_cell(r):
    if r["status"] == "ok":
        return "ok"
    return f"{r['status']} at op {r.get('error_op')}/{r.get('ops_total')}"


def row(r, reference=None):
    """The table's cells for one result. `reference`: the no-offload peak (limits are shown
    as a share of it)."""
    ok = r["status"] == "ok"
    step = r.get("step_time_ns") if ok else None
    ideal = r.get("ideal_ns") if ok else None
    idle = (r["step_time_ns"] - r["compute_ns"]) if ok else None
    bound = r.get("bound_ns")
    first = r.get("first_step") or {}
    if not r.get("warmup_steps"):
        first_cell = "(this)" if "first_step" in r else "-"  # the measured step is the first
    else:
        first_cell = fmt_ns(first.get("step_time_ns")) if first.get("status") == "ok" else (first.get("status") or "-")
    return (run_name(r), _limit_cell(r, reference),
            "-" if r.get("horizon") is None else str(r["horizon"]), _status_cell(r),
            fmt_bytes(r["peak_device_bytes"]), fmt_bytes(r["bytes_d2h"]), fmt_bytes(r["bytes_h2d"]),
            fmt_ns(step), fmt_ns(r.get("stall_ns") if ok else None), fmt_ns(idle), fmt_ns(ideal),
            f"{step / ideal:.3f}" if step and ideal else "-",
            ("infeasible" if r.get("bound_note") else "-") if bound is None else fmt_ns(bound),
            f"{step / bound:.3f}" if step and bound else "-", first_cell)


def notes(results):
    """The lines under a table: what was measured (steady step or first step, and why a
    workload could not be repeated), each limit no policy can fit, and why each run that did
    not complete stopped (vramswap's out-of-memory report: the numbers, and why eviction
    could not help)."""
    out = []
    warm = sorted({r["warmup_steps"] for r in results if r.get("warmup_steps")})
    if warm:
        out.append(f"step: the step after {', '.join(map(str, warm))} warm-up step(s); first step: the first one, "
                   "from the same run")
    for why in dict.fromkeys(r["warmup_note"] for r in results if r.get("warmup_note")):
        out.append(why)
    infeasible = {}
    for r in results:
        if r.get("bound_note"):
            infeasible.setdefault(r["bound_note"], []).append(run_name(r))
    for why, names in infeasible.items():
        out.append(f"bound of {', '.join(dict.fromkeys(names))}: {why}")
    names = [run_name(r) for r in results]
    for r in results:
        if r["status"] != "ok" and r.get("error"):
            name = run_name(r)
            if names.count(name) > 1 and r.get("horizon") is not None:
                name += f", horizon {r['horizon']}"
            out.append(f"why {name} stopped: {r['error']}")
    for r in results:
        if r.get("disk_gbps") and r["status"] == "ok":
            out.append(f"{run_name(r)}: pinned tier {fmt_bytes(r['host_limit_bytes'])}, disk at {r['disk_gbps']:g} GB/s: "
                       f"{fmt_bytes(r.get('bytes_disk_write'))} written, {fmt_bytes(r.get('bytes_disk_read'))} read in "
                       f"the step; the disk's floor {fmt_ns(r.get('bound_disk_ns'))} (measure.py)")
    return out


def reference_peak(results):
    """The no-offload peak of a set of results: the "none" run that completed (the largest
    card if several), or None."""
    peaks = [r["peak_device_bytes"] for r in results if r["policy"] == "none" and r["status"] == "ok"]
    return max(peaks) if peaks else None


def table(results, reference=None):
    """The text table of `results`, one row per run, columns aligned."""
    reference = reference or reference_peak(results)
    rows = [COLUMNS] + [row(r, reference) for r in results]
    widths = [max(len(rw[i]) for rw in rows) for i in range(len(COLUMNS))]
    right = {i for i in range(4, len(COLUMNS))}
    lines = []
    for j, rw in enumerate(rows):
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(rw)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines + notes(results))


def markdown_table(results, reference=None):
    reference = reference or reference_peak(results)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 4 + ["---:"] * (len(COLUMNS) - 4)) + "|"]
    for r in results:
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row(r, reference)) + " |")
    extra = notes(results)
    return "\n".join(lines + ([""] + extra if extra else []))


def summary(r):
    """A result without its timeline and memory series, and without wall_s (this machine's
    seconds, not the model's: written results regenerate byte for byte)."""
    return {k: v for k, v in r.items() if k not in ("timeline", "series", "wall_s")}


# ---- SVG ---------------------------------------------------------------------------------

def _esc(s):
    return html.escape(str(s), quote=True)


def _nice_step(span, target=6):
    """A round tick step giving about `target` ticks over `span`."""
    if span <= 0:
        return 1
    raw = span / target
    mag = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 10 ** -len(str(int(1 / raw)))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _ticks(lo, hi, target=6):
    step = _nice_step(hi - lo, target)
    t = (lo // step) * step
    out = []
    while t <= hi + 1e-9 * step:
        if t >= lo - 1e-9 * step:
            out.append(t)
        t += step
    return out


def _tick_label(v):
    return f"{v:g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"


class _Canvas:
    """An SVG with one plot area: x and y in data units mapped to pixels."""

    def __init__(self, width, height, x_range, y_range, left=70, right=20, top=34, bottom=44):
        self.w, self.h = width, height
        self.left, self.right, self.top, self.bottom = left, right, top, bottom
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1
        self.parts = []

    def px(self, x):
        return self.left + (x - self.x0) / (self.x1 - self.x0) * (self.w - self.left - self.right)

    def py(self, y):
        return self.h - self.bottom - (y - self.y0) / (self.y1 - self.y0) * (self.h - self.top - self.bottom)

    def add(self, s):
        self.parts.append(s)

    def axes(self, title, xlabel, ylabel, yticks=True):
        a = self.add
        a(f'<text x="{self.w / 2:.1f}" y="20" text-anchor="middle" font-size="14" font-weight="bold">{_esc(title)}</text>')
        x_left, x_right = self.left, self.w - self.right
        y_bottom, y_top = self.h - self.bottom, self.top
        a(f'<rect x="{x_left}" y="{y_top}" width="{x_right - x_left}" height="{y_bottom - y_top}" '
          'fill="none" stroke="#444" stroke-width="1"/>')
        for t in _ticks(self.x0, self.x1):
            x = self.px(t)
            a(f'<line x1="{x:.1f}" y1="{y_bottom}" x2="{x:.1f}" y2="{y_bottom + 4}" stroke="#444"/>')
            a(f'<line x1="{x:.1f}" y1="{y_top}" x2="{x:.1f}" y2="{y_bottom}" stroke="#eee"/>')
            a(f'<text x="{x:.1f}" y="{y_bottom + 16}" text-anchor="middle" font-size="11">{_tick_label(t)}</text>')
        if yticks:
            for t in _ticks(self.y0, self.y1, 5):
                y = self.py(t)
                a(f'<line x1="{x_left - 4}" y1="{y:.1f}" x2="{x_left}" y2="{y:.1f}" stroke="#444"/>')
                a(f'<line x1="{x_left}" y1="{y:.1f}" x2="{x_right}" y2="{y:.1f}" stroke="#eee"/>')
                a(f'<text x="{x_left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">{_tick_label(t)}</text>')
        a(f'<text x="{(x_left + x_right) / 2:.1f}" y="{self.h - 8}" text-anchor="middle" font-size="12">{_esc(xlabel)}</text>')
        if ylabel:
            a(f'<text x="16" y="{(y_top + y_bottom) / 2:.1f}" text-anchor="middle" font-size="12" '
              f'transform="rotate(-90 16 {(y_top + y_bottom) / 2:.1f})">{_esc(ylabel)}</text>')

    def svg(self):
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                f'viewBox="0 0 {self.w} {self.h}" font-family="Helvetica, Arial, sans-serif">\n'
                f'<rect width="{self.w}" height="{self.h}" fill="white"/>\n')
        # Everything inside the plot area is clipped to it.
        return head + "\n".join(self.parts) + "\n</svg>\n"


def _downsample(points, buckets):
    """Keeps, per x bucket, the first point and the highest and lowest (a step plot keeps
    its peaks)."""
    if len(points) <= 3 * buckets:
        return points
    x0, x1 = points[0][0], points[-1][0]
    width = (x1 - x0) / buckets or 1
    out, current, group = [], None, []
    for p in points:
        b = int((p[0] - x0) / width)
        if b != current and group:
            hi = max(group, key=lambda q: q[1])
            lo = min(group, key=lambda q: q[1])
            out.extend(sorted({group[0], hi, lo, group[-1]}, key=lambda q: q[0]))
            group = []
        current = b
        group.append(p)
    if group:
        out.extend(sorted({group[0], max(group, key=lambda q: q[1]), group[-1]}, key=lambda q: q[0]))
    return out


def memory_svg(results, title, card_bytes=None, width=960, height=420):
    """Device memory mapped by the pool (cudasim's mapped bytes: live tensors and the pool's
    cache; an evicted block's pages are unmapped) over virtual time for each run with a
    series; each run's limit as a dashed line in its colour, the card as a grey line."""
    runs = [r for r in results if r.get("series")]
    t_max = max([r["step_time_ns"] for r in runs] + [1]) / 1e6
    top = max([max(p[2] for p in r["series"]) for r in runs] + [1])
    top = max(top, *(r.get("limit_bytes") or 0 for r in runs))
    if card_bytes and card_bytes > 1.5 * top:
        card_bytes = None  # far above everything: drawing it would flatten the curves
    top = max(top, card_bytes or 0) / (1 << 30) * 1.08
    c = _Canvas(width, height, (0, t_max), (0, top), right=260)
    c.axes(title, "virtual time (ms)", "device memory mapped (GiB)")
    x_end = c.w - c.right
    if card_bytes:
        y = c.py(card_bytes / (1 << 30))
        c.add(f'<line x1="{c.left}" y1="{y:.1f}" x2="{x_end}" y2="{y:.1f}" stroke="#999" stroke-width="1.5"/>')
        c.add(f'<text x="{x_end - 4}" y="{y - 4:.1f}" text-anchor="end" font-size="10" fill="#666">card {_esc(fmt_bytes(card_bytes))}</text>')
    for i, r in enumerate(runs):
        color = PALETTE[i % len(PALETTE)]
        pts = [(p[0] / 1e6, p[2] / (1 << 30)) for p in r["series"]]
        pts = [(0.0, pts[0][1] if pts else 0.0)] + pts + [(r["step_time_ns"] / 1e6, pts[-1][1] if pts else 0.0)]
        pts = _downsample(pts, 600)
        d, last_y = [], None
        for x, y in pts:  # a step plot: memory holds its value until the next op
            if last_y is not None:
                d.append(f"{c.px(x):.1f},{c.py(last_y):.1f}")
            d.append(f"{c.px(x):.1f},{c.py(y):.1f}")
            last_y = y
        c.add(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{" ".join(d)}"/>')
        if r.get("limit_bytes"):
            y = c.py(r["limit_bytes"] / (1 << 30))
            c.add(f'<line x1="{c.left}" y1="{y:.1f}" x2="{x_end}" y2="{y:.1f}" stroke="{color}" '
                  'stroke-width="1.2" stroke-dasharray="6 4"/>')
        ly = c.top + 14 + 16 * i
        c.add(f'<line x1="{x_end + 12}" y1="{ly - 4}" x2="{x_end + 32}" y2="{ly - 4}" stroke="{color}" stroke-width="2"/>')
        name = run_name(r) + (f" h{r['horizon']}" if r.get("label") and r.get("horizon") is not None else "")
        c.add(f'<text x="{x_end + 38}" y="{ly}" font-size="11">{_esc(name)}</text>')
    ly = c.top + 14 + 16 * len(runs) + 6
    c.add(f'<line x1="{x_end + 12}" y1="{ly - 4}" x2="{x_end + 32}" y2="{ly - 4}" stroke="#444" stroke-dasharray="6 4"/>')
    c.add(f'<text x="{x_end + 38}" y="{ly}" font-size="11">limit (VRAMSWAP_LIMIT)</text>')
    return c.svg()


def timeline_svg(r, title, width=1140, height=300):
    """The run's kernels and copies on their engines over virtual time: a compute lane
    (kernels coloured by phase, with stalls drawn above them), an H2D lane and a D2H lane."""
    t_max = max(r["step_time_ns"], 1) / 1e6
    lanes = (("compute", "kernel"), ("H2D", "h2d"), ("D2H", "d2h"))
    c = _Canvas(width, height, (0, t_max), (0, len(lanes)), left=80, right=200)
    c.axes(title, "virtual time (ms)", "", yticks=False)
    lane_h = (c.h - c.top - c.bottom) / len(lanes)
    phase_of = _kernel_phases(r)
    k = 0
    for li, (name, kind) in enumerate(lanes):
        y = c.top + li * lane_h
        c.add(f'<text x="{c.left - 6}" y="{y + lane_h / 2 + 4:.1f}" text-anchor="end" font-size="12">{name}</text>')
        if li:
            c.add(f'<line x1="{c.left}" y1="{y:.1f}" x2="{c.w - c.right}" y2="{y:.1f}" stroke="#ccc"/>')
    # Back-to-back operations of one kind on one lane are drawn as one rectangle (a step has
    # thousands of kernels; trace.json keeps each one).
    rects = []  # [lane, start_ns, end_ns, color, count, bytes]
    k = 0
    for e in sorted((e for e in r.get("timeline", []) if e["kind"] in ("kernel", "h2d", "d2h")),
                    key=lambda e: e["start_ns"]):
        li = {"kernel": 0, "h2d": 1, "d2h": 2}[e["kind"]]
        if e["kind"] == "kernel":
            color = PHASE_COLORS.get(phase_of.get(k, "other"), "#8c8c8c")
            k += 1
            if e.get("stall_ns"):
                rects.append([li, e["start_ns"] - e["stall_ns"], e["start_ns"], "#ff9999", 0, 0])
        else:
            color = LANE_COLORS[e["kind"]]
        last = next((q for q in reversed(rects) if q[0] == li), None)
        if last and last[3] == color and last[2] == e["start_ns"]:
            last[2] = e["end_ns"]
            last[4] += 1
            last[5] += e["bytes"]
        else:
            rects.append([li, e["start_ns"], e["end_ns"], color, 1, e["bytes"]])
    for li, t0, t1, color, count, nbytes in rects:
        x0, x1 = c.px(t0 / 1e6), c.px(t1 / 1e6)
        y = c.top + li * lane_h + 6
        what = ("stall" if count == 0 else f"{count} {'kernels' if li == 0 else 'copies'}")
        title = f"{what}, {fmt_ns(t1 - t0)}" + (f", {fmt_bytes(nbytes)}" if nbytes else "")
        opacity = ' fill-opacity="0.6"' if count == 0 else ""
        c.add(f'<rect x="{x0:.2f}" y="{y:.1f}" width="{max(x1 - x0, 0.4):.2f}" height="{lane_h - 12:.1f}" '
              f'fill="{color}"{opacity}><title>{_esc(title)}</title></rect>')
    legend = [(PHASE_COLORS["forward"], "forward kernels"), (PHASE_COLORS["backward"], "backward kernels"),
              (PHASE_COLORS["optimizer"], "optimizer kernels"), ("#ff9999", "stall (waiting on a copy)"),
              (LANE_COLORS["h2d"], "H2D copy"), (LANE_COLORS["d2h"], "D2H copy")]
    x_end = c.w - c.right
    for i, (color, text) in enumerate(legend):
        ly = c.top + 12 + 16 * i
        c.add(f'<rect x="{x_end + 10}" y="{ly - 9}" width="14" height="10" fill="{color}"/>')
        c.add(f'<text x="{x_end + 30}" y="{ly}" font-size="11">{_esc(text)}</text>')
    return c.svg()


def _kernel_phases(r):
    """kernel index (in start order) -> the phase it ran in, from the phase boundaries."""
    out = {}
    kernels = sorted((e for e in r.get("timeline", []) if e["kind"] == "kernel"), key=lambda e: e["start_ns"])
    phases = r.get("phases", [])
    j = 0
    for i, e in enumerate(kernels):
        while j + 1 < len(phases) and e["start_ns"] >= phases[j + 1]["start_ns"]:
            j += 1
        out[i] = phases[j]["name"] if phases else "other"
    return out


# ---- Chrome trace ------------------------------------------------------------------------

def _us(ns):
    """Nanoseconds as the trace's microseconds, exact (3 decimals)."""
    return ns // 1000 if ns % 1000 == 0 else round(ns / 1e3, 3)


def chrome_trace(r, title):
    """One run (one training step) as Chrome-trace JSON (the object format: traceEvents with
    complete "X" events, ts and dur in microseconds): process "GPU 0" with one thread per
    engine (compute, H2D copy, D2H copy, the disk), a "phases" thread, and counters for
    device and live memory. Perfetto (ui.perfetto.dev) and chrome://tracing open it."""
    ev = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"GPU 0: {title} (cudasim virtual time)"}}]
    tids = {"phase": 0, "kernel": 1, "h2d": 2, "d2h": 3, "other": 4, "disk read": 5, "disk write": 5}
    names = {0: "phases", 1: "compute engine (kernels)", 2: "H2D copy engine", 3: "D2H copy engine", 4: "other",
             5: "disk engine (the disk tier's reads and writes)"}
    for tid, name in names.items():
        ev.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}})
        ev.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
    for p in r.get("phases", []):
        ev.append({"name": p["name"], "cat": "phase", "ph": "X", "pid": 0, "tid": 0,
                   "ts": _us(p["start_ns"]), "dur": _us(max(p["end_ns"] - p["start_ns"], 0)),
                   "args": {"compute_ns": p["compute_ns"], "bytes_d2h": p["bytes_d2h"], "bytes_h2d": p["bytes_h2d"],
                            "ideal_ns": p["ideal_ns"]}})
    for e in r.get("timeline", []):
        kind = e["kind"] if e["kind"] in tids else "other"
        args = {"stream": e["stream"]}
        if e["bytes"]:
            args["bytes"] = e["bytes"]
        if e.get("stall_ns"):
            args["stall_ns"] = e["stall_ns"]
        name = e.get("label") or {"h2d": "copy H2D", "d2h": "copy D2H"}.get(kind, kind)
        ev.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": tids[kind],
                   "ts": _us(e["start_ns"]), "dur": _us(e["end_ns"] - e["start_ns"]), "args": args})
    last = None
    for t, live, mapped, phys in r.get("series", []):
        if (live, mapped, phys) == last:
            continue
        last = (live, mapped, phys)
        ev.append({"name": "memory", "ph": "C", "pid": 0, "ts": _us(t),
                   "args": {"mapped_bytes": mapped, "live_bytes": live, "physical_bytes": phys}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"run": run_name(r), "clock": "cudasim virtual time", "step_time_ns": r["step_time_ns"]}}


# ---- files -------------------------------------------------------------------------------

def slug(name):
    return "".join(ch if ch.isalnum() or ch in "-." else "_" for ch in name).strip("_")


def _from_default(r):
    """How far a run's horizon is from the default, 4 (runs with no horizon: 0)."""
    return 0 if r.get("horizon") is None else abs(r["horizon"] - 4)


def write(out_dir, scenario, results, featured=None, card_bytes=None, title=None):
    """Writes into `out_dir`: results.json (every run, without timelines), table.txt,
    table.md, memory.svg (the runs with a series), and for the `featured` run (default: the
    vramswap run with the lowest limit that completed, at the horizon nearest the default 4)
    timeline.svg and trace.json. Returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = title or scenario
    written = []

    def put(name, text):
        written.append(write_file(out / name, text))

    reference = reference_peak(results)
    put("results.json", json.dumps({"scenario": scenario, "reference_peak_bytes": reference,
                                    "runs": [summary(r) for r in results]}, indent=1) + "\n")
    put("table.txt", table(results, reference) + "\n")
    put("table.md", markdown_table(results, reference) + "\n")
    # One curve per policy, card and limit: the completed run whose horizon is nearest the
    # default 4.
    best = {}
    for r in results:
        if not r.get("series") or r["status"] != "ok":
            continue
        key = (r["policy"], r["card_bytes"], r.get("limit_bytes"))
        if key not in best or _from_default(r) < _from_default(best[key]):
            best[key] = r
    chosen = {id(r) for r in best.values()}
    plotted = [r for r in results if id(r) in chosen]
    if plotted:
        put("memory.svg", memory_svg(plotted, f"{title}: device memory", card_bytes=card_bytes))
    if featured is None:
        done = [r for r in results if r["policy"] == "vramswap" and r["status"] == "ok" and r.get("timeline")]
        featured = min(done, key=lambda r: (r["limit_bytes"] or 0, _from_default(r))) if done else None
    if featured is not None and featured.get("timeline") is not None:
        put("timeline.svg", timeline_svg(featured, f"{title}: {run_name(featured)}: copy timeline"))
        put("trace.json", json.dumps(chrome_trace(featured, f"{title}: {run_name(featured)}"),
                                     separators=(",", ":")) + "\n")
    return written
