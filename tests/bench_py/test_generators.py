#!/usr/bin/env python3
"""Tests of the workload generators vramswap.bench.gpt and vramswap.bench.vgg (no torch).

  - every configuration of a grid passes Workload.validate(), frees everything but the
    persistent state (parameters, grads, optimizer states, buffers), and every tensor the
    forward saved is cold before backward reads it (batch tensors aside) and released;
  - a block's saved bytes equal the formulas written out below, for eager attention in
    bf16 autocast and fp32, flash attention, and dropout; the head's too;
  - checkpointing saves only the block inputs (plus the same head);
  - two microbatches are exactly twice the forward/backward compute and FLOPs;
  - GPT-2 small and VGG-16 have their published parameter counts; VGG-16's forward FLOPs
    and saved bytes per image match the hand count; its peak at batch 128/256 is plausible
    against the vDNN paper, and batch 256 does not fit the 12 GiB Titan X;
  - generation is deterministic.
A failing check prints a FAIL line; the exit status is 1 if any failed.

Usage: python3 tests/bench_py/test_generators.py   (about 2 s)
"""
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugin" / "python"))

from vramswap.bench import gpt, vgg  # noqa: E402
from vramswap.bench.workload import Workload, WorkloadError  # noqa: E402

GIB = 2**30
failures = []


def check(name, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))
    if not ok:
        failures.append(name)
    return ok


def lifecycle_problems(wl, held_by_loop=("idx", "targets", "images", "labels")):
    """Problems with saved tensors' lifecycles beyond what validate() checks: a tensor
    saved in the forward must be used and released in backward, and (unless the training
    loop holds it) must have gone cold before its first use. -> list of strings."""
    phase, stage, fwd_saved, problems = "other", {}, set(), []
    for i, op in enumerate(wl.ops):
        kind = op[0]
        if kind == "phase":
            phase = op[1]
        elif kind == "save":
            stage[op[1]] = "save"
            if phase == "forward":
                fwd_saved.add(op[1])
        elif kind == "cold":
            stage[op[1]] = "cold"
        elif kind == "use":
            tid = op[1]
            if (stage.get(tid) == "save" and tid in fwd_saved
                    and not tid.endswith(held_by_loop)):
                problems.append(f"op {i}: {tid} used before it went cold")
            stage[tid] = "use"
        elif kind == "release":
            stage[op[1]] = "release"
    for tid in sorted(fwd_saved):
        if stage[tid] != "release":
            problems.append(f"{tid} saved in forward but ends at {stage[tid]}")
    return problems


def forward_saved(wl, prefix=""):
    """Bytes of the tensors saved in forward phases whose tid starts with prefix."""
    sizes, phase, total = {}, "other", 0
    for op in wl.ops:
        if op[0] == "phase":
            phase = op[1]
        elif op[0] == "alloc":
            sizes[op[1]] = op[2]
        elif op[0] == "save" and phase == "forward" and op[1].startswith(prefix):
            total += sizes[op[1]]
    return total


def gpt_persistent_bytes(wl):
    m = wl.meta
    model = m["model"]
    buffers = model["layers"] * model["seq"] ** 2 * 4 if model["attention"] == "eager" else 0
    return m["param_bytes"] + m["grad_bytes"] + m["optimizer_state_bytes"] + buffers


# -- the grid ---------------------------------------------------------------------------
def test_grid():
    tiny = dict(layers=2, hidden=64, heads=4, seq=32, batch=2, vocab=100)
    count, bad = 0, []
    for ckpt, mb, dtype, attention, dropout, opt in itertools.product(
            [False, "full"], [1, 2], ["bf16", "fp16", "fp32"], ["eager", "flash"],
            [0.0, 0.1], [True, "foreach", False]):
        label = f"ckpt={ckpt} mb={mb} {dtype} {attention} p={dropout} opt={opt}"
        try:
            wl = gpt.generate(checkpointing=ckpt, microbatches=mb, dtype=dtype,
                              attention=attention, dropout=dropout, optimizer=opt, **tiny)
            wl.validate()
        except (WorkloadError, ValueError, KeyError) as e:
            bad.append(f"{label}: {e}")
            continue
        count += 1
        if wl.meta["final_live_bytes"] != gpt_persistent_bytes(wl):
            bad.append(f"{label}: final live {wl.meta['final_live_bytes']} != persistent "
                       f"{gpt_persistent_bytes(wl)}")
        problems = lifecycle_problems(wl)
        if problems:
            bad.append(f"{label}: {problems[0]} (+{len(problems) - 1} more)")
    check(f"gpt: {count} configurations validate, leave only persistent state live, and "
          "every forward-saved tensor goes cold before use and is released", not bad,
          "; ".join(bad[:3]))

    # LoRA (frozen Linears kept, adapters trained) and AdamW state kept, per chunk.
    count, bad = 0, []
    for ckpt, mb, dtype, lora, kept in itertools.product([False, "full"], [1, 2], ["bf16", "fp16"], [0, 4],
                                                         [False, True]):
        label = f"ckpt={ckpt} mb={mb} {dtype} lora={lora} kept={kept}"
        try:
            wl = gpt.generate(checkpointing=ckpt, microbatches=mb, dtype=dtype, lora_rank=lora,
                              kept_optimizer=kept, **tiny).validate()
        except (WorkloadError, ValueError, KeyError) as e:
            bad.append(f"{label}: {e}")
            continue
        count += 1
        if wl.meta["final_live_bytes"] != gpt_persistent_bytes(wl):
            bad.append(f"{label}: final live {wl.meta['final_live_bytes']} != persistent {gpt_persistent_bytes(wl)}")
        problems = lifecycle_problems(wl)
        if problems:
            bad.append(f"{label}: {problems[0]} (+{len(problems) - 1} more)")
        kinds = [op[0] for op in wl.ops]
        uses = {op[1]: 0 for op in wl.ops if op[0] == "keep"}
        for op in wl.ops:
            if op[0] == "kuse":
                uses[op[1]] += 1
        frozen = {op[1] for op in wl.ops if op[0] == "keep" and op[2]}
        want_frozen = 4 * tiny["layers"] if lora else 0
        # each kept tensor: one use in setup, then one per step (a frozen weight's cast is made
        # once per autocast region: once per microbatch, twice with checkpointing's recompute)
        per_step = {t: n - 1 for t, n in uses.items()}
        if len(frozen) != want_frozen or (kept and not set(uses) - frozen):
            bad.append(f"{label}: {len(frozen)} frozen kept tensors (want {want_frozen}), kept state {kept}")
        elif any(n < 1 for n in per_step.values()):
            bad.append(f"{label}: a kept tensor never used in the step")
        elif lora and "grad.L0.attn.qkv.w" in set(op[1] for op in wl.ops if op[0] == "alloc"):
            bad.append(f"{label}: a frozen weight has a gradient")
        elif not (kinds.count("kuse") == kinds.count("kdone")):
            bad.append(f"{label}: uses and their ends do not pair")
    check(f"gpt: {count} LoRA and kept-optimizer configurations validate, leave only persistent state live, "
          "keep the frozen weights (no gradient) and the optimizer state, each used in the step", not bad,
          "; ".join(bad[:3]))
    for kwargs, what in ((dict(lora_rank=4, dtype="fp32"), "lora_rank needs autocast"),
                         (dict(kept_optimizer=True, optimizer="foreach"), "kept_optimizer needs the fused")):
        try:
            gpt.generate(**tiny, **kwargs)
            check(f"gpt: {kwargs} is refused", False, "no error")
        except ValueError as e:
            check(f"gpt: {kwargs} is refused", what in str(e), str(e))

    bad = []
    for dtype, dropout, opt in itertools.product(["fp32", "bf16", "fp16"], [0.0, 0.5],
                                                 [True, False]):
        label = f"{dtype} p={dropout} opt={opt}"
        try:
            wl = vgg.generate(batch=2, image=32, dtype=dtype, dropout=dropout, optimizer=opt)
            wl.validate()
        except (WorkloadError, ValueError, KeyError) as e:
            bad.append(f"{label}: {e}")
            continue
        m = wl.meta
        persistent = m["param_bytes"] + m["grad_bytes"] + m["optimizer_state_bytes"]
        if m["final_live_bytes"] != persistent:
            bad.append(f"{label}: final live {m['final_live_bytes']} != {persistent}")
        problems = lifecycle_problems(wl)
        if problems:
            bad.append(f"{label}: {problems[0]}")
    check("vgg: 12 configurations validate, free all but persistent state, cold before use",
          not bad, "; ".join(bad[:3]))


def test_checker_can_fail():
    """The lifecycle check is not vacuous: drop the first cold op and it must complain."""
    wl = gpt.generate(layers=1, hidden=32, heads=2, seq=8, batch=1, vocab=16)
    first_cold = next(i for i, op in enumerate(wl.ops) if op[0] == "cold")
    broken = Workload("broken", wl.ops[:first_cold] + wl.ops[first_cold + 1:])
    broken.validate()   # still valid for the format: cold is optional
    check("the lifecycle check catches a saved tensor that never went cold",
          bool(lifecycle_problems(broken)))


# -- saved bytes against hand formulas --------------------------------------------------
# Small config: N = B*T tokens, D = C/H. Per block, what eager PyTorch saves (gpt.py's
# docstring lists the ops):
#   bf16 autocast, eager attention:
#     x 4NC; ln_1 mean+rstd 8N; ln_1 out cast 2NC; q, k copies 2*2NC; mask T^2;
#     softmax out (fp32) 4BHT^2; its bf16 cast 2BHT^2; v copy 2NC; y copy 2NC;
#     x_mid 4NC; ln_2 mean+rstd 8N; ln_2 out cast 2NC; fc out (GELU input) 2NF;
#     GELU out 2NF; weight casts 2*(3C^2 + C^2 + FC + CF)
#     = 20NC + 16N + 4NF + 6BHT^2 + T^2 + 2(4C^2 + 2FC)
#   fp32, eager: the Linear inputs are the fp32 tensors themselves, no weight casts:
#     x 4NC, 8N, ln_1 out 4NC, q k 8NC, T^2, probs 4BHT^2, v 4NC, y 4NC, x_mid 4NC, 8N,
#     ln_2 out 4NC, fc out 4NF, GELU out 4NF  = 32NC + 16N + 8NF + 4BHT^2 + T^2
#   bf16, flash: x 4NC, 8N, ln_1 cast 2NC, qkv 6NC, attention out 2NC, logsumexp 4BHT,
#     x_mid 4NC, 8N, ln_2 cast 2NC, 4NF, weight casts  = 20NC + 16N + 4NF + 4BHT + 2(4C^2+2FC)
#   dropout p > 0 (bf16, eager) adds 1-byte masks: attention probs BHT^2, the two residual
#     branches 2NC; the probs' bf16 cast is then of the dropout output (same size).
# The head (everything but the blocks): idx 8N, positions 8T, ln_f input 4NC + 8N,
# lm_head input (bf16: cast 2NC + the tied wte's cast 2VC; fp32: ln_f's output 4NC),
# log_softmax out 4NV, targets 8N (+ the embedding dropout's mask NC when p > 0).
S = dict(layers=3, hidden=64, heads=4, ffn=256, seq=48, batch=2, vocab=100)


def small_shapes():
    B, T, C, H, F, V, L = (S["batch"], S["seq"], S["hidden"], S["heads"], S["ffn"],
                           S["vocab"], S["layers"])
    return B, T, C, H, F, V, L, B * T


def test_saved_formulas():
    B, T, C, H, F, V, L, N = small_shapes()
    weights_half = 2 * (4 * C * C + 2 * F * C)
    cases = [
        ("eager bf16", dict(dtype="bf16"),
         20 * N * C + 16 * N + 4 * N * F + 6 * B * H * T * T + T * T + weights_half,
         8 * N + 8 * T + 4 * N * C + 8 * N + 2 * N * C + 2 * V * C + 4 * N * V + 8 * N),
        ("eager fp32", dict(dtype="fp32"),
         32 * N * C + 16 * N + 8 * N * F + 4 * B * H * T * T + T * T,
         8 * N + 8 * T + 4 * N * C + 8 * N + 4 * N * C + 4 * N * V + 8 * N),
        ("flash bf16", dict(dtype="bf16", attention="flash"),
         20 * N * C + 16 * N + 4 * N * F + 4 * B * H * T + weights_half,
         8 * N + 8 * T + 4 * N * C + 8 * N + 2 * N * C + 2 * V * C + 4 * N * V + 8 * N),
        ("eager bf16 dropout", dict(dtype="bf16", dropout=0.1),
         20 * N * C + 16 * N + 4 * N * F + 6 * B * H * T * T + T * T + weights_half
         + B * H * T * T + 2 * N * C,
         8 * N + 8 * T + 4 * N * C + 8 * N + 2 * N * C + 2 * V * C + 4 * N * V + 8 * N
         + N * C),
    ]
    for name, kw, per_layer, head in cases:
        wl = gpt.generate(**S, **kw)
        got_layers = [forward_saved(wl, f"mb0.L{layer}.") for layer in range(L)]
        check(f"gpt {name}: saved bytes of each block == formula {per_layer}",
              all(g == per_layer for g in got_layers), f"got {got_layers}")
        check(f"gpt {name}: meta saved_bytes_per_layer == formula",
              wl.meta["saved_bytes_per_layer"] == per_layer,
              f"{wl.meta['saved_bytes_per_layer']}")
        total = forward_saved(wl)
        check(f"gpt {name}: head saved bytes == formula {head}",
              total - L * per_layer == head, f"got {total - L * per_layer}")


def test_checkpointing():
    _, _, C, _, _, _, L, N = small_shapes()
    for dtype in ("bf16", "fp32"):
        plain = gpt.generate(**S, dtype=dtype)
        ckpt = gpt.generate(**S, dtype=dtype, checkpointing="full")
        head = forward_saved(plain) - L * plain.meta["saved_bytes_per_layer"]
        want = L * 4 * N * C + head
        check(f"gpt ckpt {dtype}: forward saves only the {L} block inputs (4NC each) + head "
              f"= {want}", forward_saved(ckpt) == want, f"got {forward_saved(ckpt)}")
        check(f"gpt ckpt {dtype}: saved bytes per layer == 4NC",
              ckpt.meta["saved_bytes_per_layer"] == 4 * N * C,
              f"{ckpt.meta['saved_bytes_per_layer']}")
        # backward recomputes each block: its saves are those of a plain block, again
        rc = ckpt.meta["saved_bytes_by_phase"]["backward"]
        check(f"gpt ckpt {dtype}: backward re-saves L blocks minus their inputs",
              rc == L * (plain.meta["saved_bytes_per_layer"] - 4 * N * C), f"got {rc}")
        fl = ckpt.meta["flops"]
        fl0 = plain.meta["flops"]
        check(f"gpt ckpt {dtype}: recompute adds forward-block FLOPs to backward",
              fl["forward"] == fl0["forward"] and fl["backward"] > fl0["backward"])
        check(f"gpt ckpt {dtype}: lower peak than without checkpointing",
              ckpt.meta["peak_live_bytes"] < plain.meta["peak_live_bytes"])


def test_microbatches():
    for kw in (dict(), dict(checkpointing="full"), dict(attention="flash", dtype="fp16")):
        one = gpt.generate(**S, **kw)
        two = gpt.generate(**S, microbatches=2, **kw)
        fb1 = one.compute_ns("forward") + one.compute_ns("backward")
        fb2 = two.compute_ns("forward") + two.compute_ns("backward")
        check(f"gpt microbatches=2 {kw}: forward+backward compute {fb2} == 2 x {fb1}",
              fb2 == 2 * fb1)
        check(f"gpt microbatches=2 {kw}: twice the forward/backward FLOPs",
              two.meta["flops"]["forward"] == 2 * one.meta["flops"]["forward"]
              and two.meta["flops"]["backward"] == 2 * one.meta["flops"]["backward"])
        check(f"gpt microbatches=2 {kw}: the optimizer step once",
              two.compute_ns("optimizer") == one.compute_ns("optimizer"))
        check(f"gpt microbatches=2 {kw}: twice the forward saves",
              two.meta["saved_bytes_forward"] == 2 * one.meta["saved_bytes_forward"])


def test_gpt2_small():
    wl = gpt.generate()   # 12L/768, b=8, s=1024, bf16, eager
    check("gpt-2 small: 124,439,808 parameters", wl.meta["params"] == 124_439_808,
          f"{wl.meta['params']:,}")
    # 6 * params * tokens for the matmuls (minus wpe, which is a lookup) + eager attention
    # 12 * L * N * T * C (QK^T and AV, forward 4NTC, backward 8NTC)
    L, C, T, N = 12, 768, 1024, 8 * 1024
    want = 6 * (124_439_808 - 1024 * 768 - 12 * (9 * 768 + 3072) - 2 * 768) * N \
        + 12 * L * N * T * C
    got = wl.meta["flops"]["forward"] + wl.meta["flops"]["backward"]
    check(f"gpt-2 small: step FLOPs {got / 1e12:.3f} T == 6 P N + attention "
          f"{want / 1e12:.3f} T (lm_head's wgrad and the embedding's dgrad aside)",
          abs(got - want) / want < 0.01)
    check("gpt-2 small: validate", wl.validate() is wl)


# -- VGG-16 ------------------------------------------------------------------------------
# Per 224 x 224 image, in elements (fp32: x4 bytes):
#   conv outputs (each saved once: ReLU's result, also the next conv's/pool's input)
#     224^2*64*2 + 112^2*128*2 + 56^2*256*3 + 28^2*512*3 + 14^2*512*3 = 13,547,520
#   pool outputs (the next conv's or the avgpool's input)
#     112^2*64 + 56^2*128 + 28^2*256 + 14^2*512 + 7^2*512 = 1,530,368 (+ as many int64
#     indices, 8 bytes each)
#   the image 3*224^2 = 150,528; avgpool output 25,088; fc1/fc2 outputs (ReLU results)
#   and the dropout outputs (fc2/fc3 inputs) 4096 each; dropout masks 4096 bytes each;
#   log_softmax 1000; label 8 bytes
# = (13,547,520 + 1,530,368 + 150,528 + 25,088 + 8192 + 8192 + 1000) x 4
#   + 1,530,368 x 8 + 8192 + 8 = 73,334,696 bytes per image (forward saves)
kVggSavedPerImage = ((13_547_520 + 1_530_368 + 150_528 + 25_088 + 2 * 4096 + 2 * 4096 + 1000)
                     * 4 + 1_530_368 * 8 + 2 * 4096 + 8)
# Forward: 15.35 G multiply-adds in the convs + 123.6 M in the FCs (the figure usually
# quoted as "VGG-16: 15.5 GFLOPs" counts multiply-adds), x2 for FLOPs.
kVggForwardFlopsPerImage = 2 * (15_346_630_656 + 123_633_664)


def test_vgg():
    w128 = vgg.generate(batch=128)
    w256 = vgg.generate(batch=256)
    m = w128.meta
    check("vgg16: 138,357,544 parameters (torchvision's count)", m["params"] == 138_357_544,
          f"{m['params']:,}")
    check(f"vgg16 b=128: forward saved bytes == 128 x {kVggSavedPerImage:,}",
          m["saved_bytes_forward"] == 128 * kVggSavedPerImage, f"{m['saved_bytes_forward']:,}")
    check("vgg16 b=128: forward FLOPs == 128 x 2 x 15.47 G multiply-adds",
          m["flops"]["forward"] == 128 * kVggForwardFlopsPerImage, f"{m['flops']['forward']}")
    # The vDNN paper (Rhu et al., MICRO 2016, abstract): VGG-16 at batch 256 "requiring 28
    # GB of memory", on a 12 GB Titan X. Its figure includes cuDNN's workspaces of the
    # performance-optimal convolution algorithms, which these workloads leave out, so ours
    # is lower: computed 20.9 GB (19.42 GiB) at 256 and 11.5 GB (10.68 GiB) at 128, i.e.
    # 8.74 GiB of forward saves (73.4 MB per image) + 1.55 GiB of weights, grads and
    # momentum + the backward's transient grads. Plausible: between 60% and 100% of the
    # paper's figure at 256, and between 30% and 55% of it (half, plus the fixed part) at 128.
    vdnn_b256 = 28e9
    p128, p256 = m["peak_live_bytes"], w256.meta["peak_live_bytes"]
    check(f"vgg16 b=256: peak {p256 / 1e9:.1f} GB within 60-100% of vDNN's 28 GB",
          0.6 * vdnn_b256 <= p256 <= vdnn_b256)
    check(f"vgg16 b=128: peak {p128 / 1e9:.1f} GB within 30-55% of vDNN's 28 GB (b=256)",
          0.3 * vdnn_b256 <= p128 <= 0.55 * vdnn_b256)
    check(f"vgg16 b=256: peak {p256 / GIB:.2f} GiB exceeds the Titan X's 12 GiB",
          p256 > vgg.kTitanXBytes and w256.meta["card_bytes"] == 12 * GIB)
    check(f"vgg16 b=128: peak {p128 / GIB:.2f} GiB fits the Titan X's 12 GiB",
          p128 < vgg.kTitanXBytes)
    fb128 = m["flops"]["forward"] + m["flops"]["backward"]
    fb256 = w256.meta["flops"]["forward"] + w256.meta["flops"]["backward"]
    check("vgg16 b=256: twice b=128's forward+backward FLOPs", fb256 == 2 * fb128)
    ratio = ((w256.compute_ns("forward") + w256.compute_ns("backward"))
             / (w128.compute_ns("forward") + w128.compute_ns("backward")))
    check(f"vgg16 b=256: {ratio:.4f} x b=128's compute time (the weight-grad accumulation "
          "does not grow with the batch)", 1.98 < ratio <= 2.0)
    bf16 = vgg.generate(batch=128, dtype="bf16")
    check("vgg16 bf16 autocast: fewer saved bytes than fp32",
          bf16.meta["saved_bytes_forward"] < m["saved_bytes_forward"])


def test_deterministic():
    for make in (lambda: gpt.generate(**S, checkpointing="full", microbatches=2, dropout=0.1),
                 lambda: gpt.generate(**S, attention="flash"),
                 lambda: vgg.generate(batch=4, image=64)):
        a, b = make(), make()
        check(f"deterministic: {a.name} twice gives identical ops and meta",
              a.ops == b.ops and a.meta == b.meta)
    check("different configurations give different ops",
          gpt.generate(**S).ops != gpt.generate(**dict(S, batch=3)).ops)


def test_describe_and_errors():
    text = gpt.describe(gpt.generate(**S))
    check("describe() names the peak and the compute", "peak" in text and "compute" in text)
    text = vgg.describe(vgg.generate(batch=2, image=32))
    check("vgg describe() names the card", "Titan X" in text)
    for kw in (dict(dtype="int8"), dict(checkpointing="selective"), dict(hidden=30, heads=4),
               dict(attention="sdpa"), dict(batch=0), dict(dropout=1.0)):
        try:
            gpt.generate(**dict(S, **kw))
            ok = False
        except ValueError:
            ok = True
        check(f"gpt.generate rejects {kw}", ok)


if __name__ == "__main__":
    for test in (test_grid, test_checker_can_fail, test_saved_formulas, test_checkpointing,
                 test_microbatches, test_gpt2_small, test_vgg, test_deterministic,
                 test_describe_and_errors):
        try:
            test()
        except Exception as e:  # a crash is a failure of that test, not of the run
            check(f"{test.__name__} ran without an exception", False, repr(e))
    print(f"{'FAIL' if failures else 'ok'}: {len(failures)} failed")
    sys.exit(1 if failures else 0)
