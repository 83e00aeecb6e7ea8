"""lockstep inside the libraries that build torch's DDP for you: Accelerate, Lightning, HF Trainer.

``torch_ddp.use_as_torch_ddp()`` makes them build lockstep's DDP; ``autoload`` does the same in every
process when ``LOCKSTEP_AS_TORCH_DDP=1`` is set; ``lightning`` has a Lightning strategy.
Nothing here is imported by ``import lockstep``.
"""
