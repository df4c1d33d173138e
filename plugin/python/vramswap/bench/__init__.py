"""Memory-pressure benchmarking: workloads (PyTorch memory snapshots replayed, GPT-style
training steps and VGG-16 generated from shapes) run against the real libvramswap.so on
cudasim in virtual time, beside the policies users would otherwise pick.

Nothing here imports torch: snapshots are read with an unpickler that refuses every class.
"""
