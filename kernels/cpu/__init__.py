"""The CPU kernels: attention, norms, rotary, the KV store, activations and
matrix products compiled for the instruction set this CPU has (numba, LLVM IR
tiles, AMX, oneDNN)."""
