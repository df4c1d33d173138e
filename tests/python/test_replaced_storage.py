#!/usr/bin/python3
"""The tracker when the program gives a saved tensor's storage other memory between forward
and backward, as FSDP does with its unsharded parameters, in the CPU-emulation mode.

FSDP (fully_shard, and FSDP1's flat parameters) all-gathers a layer's parameters into the
storage of an unsharded parameter before the layer's forward, frees that memory after it
(`untyped_storage().resize_(0)`), and all-gathers again into the same storage (a fresh
allocation) before the layer's backward. Under `vramswap run` the first gather runs inside
the offload scope, so the weight autograd saves is a tagged block, packed; the program then
frees that block while the tracker's alias still holds the storage. Backward must read what
the storage holds then (the second gather), as it does without vramswap.

The child (`--child`) installs the CPU-emulation mode, then runs the same step twice: with
no offload scope (the reference: the allocator alone changes no result) and inside
vramswap.offload(). A "layer" with one square weight, sharded in two halves: gather (resize
the storage, copy the shards in, the version counter kept, as FSDP does), two matmuls and a
ReLU that save the weight twice, free after the forward, gather again before backward, free
after it. Checked: the loss, the input's and the weight's gradients bit-identical to the
reference; the weight's saved block was packed and found replaced at unpack (the tracker's
`replaced` counter); every other saved block was unpacked by vramswap; at the end no
handle is tracked and nothing is on the host.

Usage: python3 tests/python/test_replaced_storage.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as the other Python tests).
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from environment import child_environment  # noqa: E402
from harness import Checks  # noqa: E402

N, BATCH = 256, 512  # a 256 KiB weight and 512 KiB activations: all tagged (>= 64 KiB)


def child(out):
    import hashlib

    import torch
    import vramswap
    torch.set_num_threads(1)
    vramswap.sim.install_cpu()

    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(N // 2, N, generator=g) for _ in range(2)]
    inputs = torch.randn(BATCH, N, generator=g)
    weight = torch.nn.Parameter(torch.empty(N, N))  # the unsharded parameter: no memory between uses
    weight.untyped_storage().resize_(0)

    def gather():
        weight.untyped_storage().resize_(N * N * weight.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(weight):
            torch.cat(shards, out=weight.data)

    def free():
        weight.untyped_storage().resize_(0)

    def step(scope):
        weight.grad = None
        x = inputs.clone().requires_grad_(True)
        with scope():
            gather()
            h = torch.relu(x * 1.0 @ weight)  # saves x * 1.0 (tagged) and the weight; relu its output
            loss = (h @ weight).square().mean()  # saves h and the weight again; square its input
            free()
        gather()  # FSDP's pre-backward all-gather: new memory for the saved weight's storage
        loss.backward()
        free()

        def sha(t):
            return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        return {"loss": sha(loss), "x_grad": sha(x.grad), "weight_grad": sha(weight.grad)}

    import contextlib
    ref = step(contextlib.nullcontext)
    error = None
    try:
        got = step(vramswap.offload)
    except Exception as e:  # noqa: BLE001  (the report names it)
        got, error = None, f"{type(e).__name__}: {e}"
    st = vramswap.memory_stats()
    with open(out, "w") as f:
        json.dump({"ref": ref, "got": got, "error": error, "tracker": vramswap.tracker_stats(),
                   "tracked": st["num_tracked_blocks"], "host_bytes": st["host_bytes"]}, f)


def main():
    check = Checks()
    with tempfile.TemporaryDirectory(prefix="vramswap-replaced-") as tmp:
        out = Path(tmp) / "result.json"
        proc = subprocess.run([sys.executable, __file__, "--child", str(out)], env=child_environment(
            {"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=300)
        check(proc.returncode == 0 and out.exists(), f"the child ran (status {proc.returncode}) {proc.stderr[-800:]}")
        if check.failures:
            return check.finish()
        r = json.loads(out.read_text())
    t = r["tracker"]
    check(r["error"] is None and r["got"] == r["ref"],
          f"inside offload(), the loss and both gradients are bit-identical to the step without it "
          f"({r['error'] or 'no error'})")
    check(t.get("replaced") == 2,
          f"the two saved references of the weight were packed and found replaced at unpack "
          f"(replaced {t.get('replaced')}; tracker {t})")
    check(t["packs"] == 6 and t["unpacks"] == 4,
          f"the other saved blocks were unpacked by vramswap (packs {t['packs']}, unpacks {t['unpacks']})")
    check(r["tracked"] == 0 and r["host_bytes"] == 0,
          f"at the end no handle tracked ({r['tracked']}) and nothing on the host ({r['host_bytes']} B)")
    return check.finish()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
