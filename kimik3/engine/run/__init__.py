"""Running the model: the batch builder, the model runner (CUDA graphs, sampling on device) and rank 0's runner for tensor/expert-parallel groups."""
