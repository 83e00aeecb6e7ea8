"""Seeing into a running job: hang reports (``progress``, ``watchdog``, ``report``), and further checks.

Below ``ddp/`` in the layers: the wrapper builds these and attaches them to its reducer through the
observer seam (``lockstep.ddp.observe``); nothing here imports ``ddp/``.
"""
