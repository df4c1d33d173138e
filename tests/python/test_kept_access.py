#!/usr/bin/python3
"""Reading and writing kept blocks outside their uses, in the CPU-emulation mode: state_dict
and load_state_dict of a module under vramswap.offload_frozen and of an optimizer under
vramswap.offload_optimizer, vramswap.materialize, and remove(). Between its uses a kept block
may be evicted: its pages are unmapped, and a read or write of its tensor faults ("cudasim:
illegal address ... host access to reserved device VA that is not mapped", SIGSEGV; on a GPU
an illegal memory access).

The model: scripts/train_kept.py's LoRA-style model, smaller (a frozen 512x1024 embedding,
four frozen 1024x1024 layers each with a rank-8 adapter, a frozen 1024x512 head), AdamW on
the adapters, three steps, the forwards under vramswap.offload(), at half the peak of the
same run without offload (below the frozen weights alone).
frozen     offload_frozen(model). After the third step: torch.save(model.state_dict()) and
           torch.save(optimizer.state_dict()) (to a BytesIO), bit-identical to plain torch's.
           Then materialize(model) refuses with an out-of-memory that names materialize and
           the bytes (the frozen weights exceed the limit), materialize(model.layers[1])
           lets its weights be read; a fourth step still matches plain torch. Then
           model.load_state_dict of the saved state dict with every tensor halved (the frozen
           weights change), read back by state_dict() and used by a fifth step, both
           bit-identical to plain torch's, the kept bytes unchanged; remove() puts back what
           fits and refuses the rest with an out-of-memory that names remove().
optimizer  the same model with its head trained too (AdamW's state of the head is kept:
           2 x 2 MiB), offload_frozen(model) and offload_optimizer(optimizer); one forward
           without grad (an evaluation) after the third step pushes the state out. Then the
           same saves, materialize(optimizer) and a read of every state tensor, a fourth
           step; optimizer.load_state_dict and model.load_state_dict of the saved state dicts
           (the state kept as it is loaded: the kept bytes unchanged), the state read under
           materialize and a fifth step bit-identical to plain torch's; and remove() of the
           optimizer's offload, then optimizer.state_dict() again.
The loads read the saved files with torch.load(mmap=True): host memory, outside vramswap's
also in the CPU-emulation mode, as a checkpoint's CPU tensors are on a GPU.

Each run is a child process (`--child MODE CASE OUT LIMIT`), so a fault is a failed check:
ref (no vramswap), peak (vramswap, no limit, no offload), offload (the limit and the
features). The child writes what it reached to OUT/CASE.MODE.json as it goes.

Usage: python3 tests/python/test_kept_access.py [CASE...]   (exit status 0: every check held)
"""
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import harness  # noqa: E402

MIB = 1 << 20
STEPS = 3
SCRIPT = Path(__file__).resolve()
CASES = ("frozen", "optimizer")


def build(torch, case):
    import train_kept
    model, data = train_kept.lora_model(rank=8, layers=4)
    if case == "optimizer":
        for p in model.head.parameters():
            p.requires_grad = True
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, data, opt


def digest(t):
    """sha256 of t's bytes, read through numpy (no allocation of vramswap's)."""
    import torch
    return hashlib.sha256(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def child(mode, case, out, limit):
    import torch
    torch.set_num_threads(1)
    vramswap = None
    result = {"stages": []}
    path = os.path.join(out, f"{case}.{mode}.json")

    def reached(stage, **info):
        result["stages"].append(stage)
        result.update(info)
        with open(path, "w") as f:
            json.dump(result, f)

    if mode == "ref":
        model, data, opt = build(torch, case)
    else:
        import vramswap
        config = {"horizon": 2}
        if limit:
            config["limit"] = str(limit)
        if mode == "offload":
            # A model larger than the limit: built in ordinary memory, its frozen weights moved
            # into vramswap's blocks one by one as offload_frozen keeps them.
            model, data, opt = build(torch, case)
            vramswap.sim.install_cpu(**config)
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.clone()  # into vramswap's memory
        else:
            vramswap.sim.install_cpu(**config)
            model, data, opt = build(torch, case)
    frozen = opt_off = None
    if mode == "offload":
        frozen = vramswap.offload_frozen(model)
        if case == "optimizer":
            opt_off = vramswap.offload_optimizer(opt)
        result["kept_weight_bytes"] = frozen.kept_bytes()
    if vramswap is not None:
        vramswap.reset_peak_stats()
    scope = vramswap.offload if mode == "offload" else None

    def step():
        if scope:
            with scope():
                loss = model(*data)
        else:
            loss = model(*data)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().item()

    losses = [step() for _ in range(STEPS)]
    if case == "optimizer":
        # An evaluation on a batch four times the training one: the weights stream, and the
        # state (needed only after the next backward) leaves to make room.
        with torch.no_grad():
            losses.append(model(*(torch.cat([t] * 4) for t in data)).item())
    stats = vramswap.memory_stats() if vramswap is not None else {}
    reached("trained", losses=losses, kept_bytes_after_training=stats.get("kept_bytes", 0))

    # The optimizer case saves the optimizer first: a fault there is the optimizer's own.
    for what in (("model", "optimizer") if case == "frozen" else ("optimizer", "model")):
        started = time.perf_counter()
        buf = io.BytesIO()
        torch.save((model if what == "model" else opt).state_dict(), buf)
        with open(os.path.join(out, f"{case}.{mode}.{what}.pt"), "wb") as f:
            f.write(buf.getvalue())
        reached(f"{what}_state_dict", **{f"{what}_state_dict_s": time.perf_counter() - started})
    if vramswap is not None:
        s = vramswap.memory_stats()
        reached("saved", peak_after_saves=s["peak_reserved_bytes"], reserved_after_saves=s["reserved_bytes"])

    # What a program reads directly, with no materialize: every parameter (and, in the
    # optimizer case, every state tensor) read through its address, and p.sum() of each, the
    # issue's own sequence (Note [Kept blocks stay addressable]: an evicted kept block's
    # address reaches its host copy, and a kept block that shares its granules never leaves).
    reached("direct_reads", direct={n: digest(p) for n, p in model.named_parameters()},
            direct_sums=[p.detach().sum().item() for p in model.parameters()],
            direct_states=[digest(t) for st in opt.state.values() for t in st.values()],
            evicted_at_direct_reads=(vramswap.memory_stats()["evicted_bytes"] if mode == "offload" else 0))

    # What a program reads directly, after materialize (in every mode: the same digests).
    if mode == "offload" and case == "frozen":
        try:
            with vramswap.materialize(model):
                pass
            reached("materialize_model", materialize_model_error="")
        except vramswap.OutOfMemoryError as e:
            reached("materialize_model", materialize_model_error=str(e))
    def materialized(obj, read):
        """read() with obj's kept blocks held on the device (offload mode), or plainly."""
        with vramswap.materialize(obj) if mode == "offload" else contextlib.nullcontext():
            return read()

    def state_digests():
        return [digest(t) for st in opt.state.values() for t in st.values()]

    layer1 = materialized(model.layers[1], lambda: {n: digest(p) for n, p in model.layers[1].named_parameters()})
    reached("materialize_layer", layer1=layer1)
    if case == "optimizer":
        reached("materialize_optimizer", states=materialized(opt, state_digests))

    losses.append(step())
    trained = {n: digest(p) for n, p in model.named_parameters() if p.requires_grad}
    reached("fourth_step", losses=losses, trained=trained)

    # The checkpoint of the third step loaded back, read with mmap=True (host memory, outside
    # vramswap's also in the CPU-emulation mode, as torch.load's CPU tensors are on a GPU);
    # in the frozen case every tensor halved first, so that the frozen weights change. The
    # optimizer case loads the optimizer first: a fault there is the optimizer's own.
    def checkpoint(what):
        return torch.load(os.path.join(out, f"{case}.{mode}.{what}.pt"), mmap=True, weights_only=True)

    def model_digests():
        return {k: digest(t) for k, t in model.state_dict().items()}

    if case == "optimizer":
        opt.load_state_dict(checkpoint("optimizer"))
        reached("load_optimizer")
    sd = checkpoint("model")
    if case == "frozen":
        for t in sd.values():
            t.mul_(0.5)
    loaded = {k: digest(t) for k, t in sd.items()}
    model.load_state_dict(sd)
    del sd
    stats = vramswap.memory_stats() if vramswap is not None else {}
    reached("load_model", loaded_model=loaded, model_after_load=model_digests(),
            kept_bytes_after_load=stats.get("kept_bytes", 0))
    if case == "optimizer":
        reached("read_loaded_optimizer", states_after_load=materialized(opt, state_digests))
    loss = step()
    stats = vramswap.memory_stats() if vramswap is not None else {}
    reached("step_after_load", loss_after_load=loss, model_after_step=model_digests(),
            kept_bytes_after_step=stats.get("kept_bytes", 0))

    if mode == "offload" and case == "frozen":
        try:
            frozen.remove()
            reached("remove", remove_error="")
        except vramswap.OutOfMemoryError as e:
            reached("remove", remove_error=str(e))
    if case == "optimizer":
        if opt_off is not None:
            opt_off.remove()
        states = [digest(t) for st in opt.state.values() for t in st.values()]
        reached("remove_optimizer", states_after_remove=states)
    if vramswap is not None:
        reached("end", peak_reserved=vramswap.memory_stats()["peak_reserved_bytes"])


def run(mode, case, tmp, limit=0):
    """-> (info, status, stderr, seconds): the child's JSON (what it reached) and its exit."""
    env = dict(os.environ)
    env.setdefault("VRAMSWAP_LOG", "warn")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--child", mode, case, tmp, str(limit)], env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    try:
        with open(os.path.join(tmp, f"{case}.{mode}.json")) as f:
            info = json.load(f)
    except (OSError, ValueError):
        info = {"stages": []}
    return info, proc.returncode, proc.stderr, seconds


def load(tmp, case, mode, what):
    import torch
    try:
        return torch.load(os.path.join(tmp, f"{case}.{mode}.{what}.pt"), weights_only=True)
    except OSError:
        return None


def equal(a, b):
    """a and b (nested dicts, lists and tensors) are the same, tensors bit for bit."""
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def check_case(check, case, tmp):
    ref, rc, err, ref_s = run("ref", case, tmp)
    check(rc == 0, f"{case}: the run without vramswap completed ({rc}) {err[-300:]}")
    peak, rc, err, peak_s = run("peak", case, tmp)
    check(rc == 0, f"{case}: the run without a limit completed ({rc}) {err[-300:]}")
    peak_bytes = peak.get("peak_reserved", 0)
    limit = peak_bytes * 50 // 100 // MIB * MIB
    off, rc, err, off_s = run("offload", case, tmp, limit)
    print(f"== {case}: peak without offload {peak_bytes / MIB:.1f} MiB, limit {limit / MIB:.0f} MiB (50%); "
          f"frozen weights kept {off.get('kept_weight_bytes', 0) / MIB:.1f} MiB; children took "
          f"{ref_s:.1f} s (ref), {peak_s:.1f} s (peak), {off_s:.1f} s (offload); state_dict + torch.save: "
          f"the module's {off.get('model_state_dict_s', float('nan')):.2f} s, the optimizer's "
          f"{off.get('optimizer_state_dict_s', float('nan')):.2f} s")
    tail = "\n".join(err.strip().splitlines()[-3:])
    check(rc == 0, f"{case}: the run under the limit completed (exit status {rc}; stages reached "
          f"{off['stages']}){': ' + tail if rc else ''}")
    if case == "frozen":
        check(off.get("kept_weight_bytes", 0) > limit,
              f"{case}: the frozen weights ({off.get('kept_weight_bytes', 0)} B) exceed the limit ({limit} B)")
    check(off.get("losses", [])[:STEPS] == ref["losses"][:STEPS] and len(ref["losses"]) >= STEPS,
          f"{case}: losses of the {STEPS} steps bit-identical ({off.get('losses')})")
    for what in ("model", "optimizer"):
        a, b = load(tmp, case, "ref", what), load(tmp, case, "offload", what)
        n = len(a) if what == "model" else len(a["state"])
        check(b is not None and equal(a, b),
              f"{case}: torch.save({what}.state_dict()) after {STEPS} steps bit-identical to plain torch's "
              f"({n} {'tensors' if what == 'model' else 'parameters with state'})")
    check(0 < off.get("peak_after_saves", limit + 1) <= limit,
          f"{case}: peak reserved within the limit through the saves ({off.get('peak_after_saves')} <= {limit})")
    check(off.get("direct") == ref.get("direct") and off.get("direct_sums") == ref.get("direct_sums")
          and off.get("direct_states") == ref.get("direct_states") and ref.get("direct"),
          f"{case}: every parameter{' and state tensor' if case == 'optimizer' else ''} read directly (no "
          f"materialize) and p.sum() of each are plain torch's, with "
          f"{off.get('evicted_at_direct_reads', 0) / MIB:.1f} MiB of kept blocks evicted then")
    if case == "frozen":
        message = off.get("materialize_model_error", "")
        kept = str(off.get("kept_weight_bytes", "?"))
        check("materialize" in message and kept in message and "out of memory" in message.lower(),
              f"frozen: materialize(model), whose frozen weights exceed the limit, refuses with an "
              f"out-of-memory naming materialize and the bytes ({message[:300]!r})")
    check(off.get("layer1") == ref.get("layer1") and ref.get("layer1"),
          f"{case}: the parameters of model.layers[1] read under materialize are plain torch's")
    if case == "optimizer":
        check(off.get("states") == ref.get("states") and ref.get("states"),
              f"optimizer: every state tensor read under materialize(optimizer) is plain torch's")
    check(off.get("losses") == ref["losses"] and off.get("trained") == ref.get("trained"),
          f"{case}: a step after the saves still bit-identical (losses {off.get('losses')})")
    if case == "optimizer":
        check(off.get("states_after_load") == ref.get("states_after_load") and ref.get("states_after_load"),
              "optimizer: after optimizer.load_state_dict(the third step's state) every state tensor read under "
              "materialize(optimizer) is plain torch's")
    changed = "the frozen weights halved" if case == "frozen" else "as saved"
    check(off.get("model_after_load") == off.get("loaded_model") == ref.get("loaded_model")
          and ref.get("model_after_load") == ref.get("loaded_model") and ref.get("loaded_model"),
          f"{case}: model.load_state_dict(the third step's checkpoint, {changed}) into frozen weights that had left "
          f"the device: state_dict() after it reads the loaded tensors")
    check(off.get("kept_bytes_after_load") == off.get("kept_bytes_after_step") == off.get("kept_bytes_after_training")
          and off.get("kept_bytes_after_training"),
          f"{case}: kept bytes after the loads and after the next step as before them (the loaded tensors kept "
          f"as they are loaded, nothing left kept of the replaced ones: {off.get('kept_bytes_after_training')}, "
          f"{off.get('kept_bytes_after_load')}, {off.get('kept_bytes_after_step')})")
    check("loss_after_load" in ref and off.get("loss_after_load") == ref.get("loss_after_load")
          and off.get("model_after_step") == ref.get("model_after_step"),
          f"{case}: the step after the loads bit-identical to plain torch's, loss ({off.get('loss_after_load')}) and "
          f"every parameter after it (the frozen weights the loaded ones, also after they left and came back)")
    if case == "frozen":
        message = off.get("remove_error", None)
        check(message is not None and ("remove" in message and "out of memory" in message.lower()),
              f"frozen: remove() with the frozen weights above the limit refuses with an out-of-memory "
              f"naming remove() ({(message or '')[:300]!r})")
    else:
        check(off.get("states_after_remove") == ref.get("states_after_remove") and ref.get("states_after_remove"),
              "optimizer: after remove() the state (brought back, ordinary) reads as plain torch's")
    check(0 < off.get("peak_reserved", limit + 1) <= limit,
          f"{case}: peak reserved within the limit to the end ({off.get('peak_reserved')} <= {limit})")


def main(argv):
    if argv and argv[0] == "--child":
        child(argv[1], argv[2], argv[3], int(argv[4]))
        return 0
    check = harness.Checks()
    with tempfile.TemporaryDirectory() as tmp:
        for case in argv or CASES:
            started = time.perf_counter()
            check_case(check, case, tmp)
            print(f"   {case}: {time.perf_counter() - started:.1f} s")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
