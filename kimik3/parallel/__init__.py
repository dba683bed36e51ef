"""Multi-GPU: sizing of layouts (tensor / expert parallel) and, on torch.distributed, the
sharded model and the lock-step engine workers."""
