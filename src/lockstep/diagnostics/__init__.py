"""Seeing into a running job: hang reports, replica and non-finite checks, the overlap timeline.

Each module is one diagnostic; the DDP wrapper builds the ones its arguments ask for. Nothing here
imports ``lockstep.ddp`` (the reducer and the wrapper are reached through the objects handed in).
"""
