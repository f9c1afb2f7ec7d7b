"""Checkpoints of a whole training state (model, optimizer, scheduler, RNG, data position, step)
through ``torch.distributed.checkpoint``, published atomically: ``Checkpointer``."""
