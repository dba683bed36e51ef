"""Multi-process groups for tensor/expert parallelism on torch.distributed: starting the ranks
(``launch``) and the workers' lock-step loop (``worker``). Below the engine: it needs the loader
and the model only; rank 0's runner that drives the workers is ``kimik3.engine.run.parallel_runner``,
the collectives the model issues are ``kimik3.distributed``."""
