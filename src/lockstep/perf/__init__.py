"""Planning and measuring above the DDP: ``lockstep plan`` and ``lockstep bench`` (the alpha-beta cost model they
price with is ``lockstep.costmodel``, a leaf below every part)."""
