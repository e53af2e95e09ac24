"""Running a step on a device: `ModelRunner` (loading, kernel choices, the step), the KV cache's size and
tensors, a step's host inputs, the transfers, CUDA graphs and compiled CPU decode, tensor-parallel workers."""
