"""Planning and measuring: the alpha-beta cost model, ``lockstep plan``, and ``lockstep bench``."""
