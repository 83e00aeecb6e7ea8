"""A Lightning strategy that trains with lockstep's DDP: ``Trainer(strategy="lockstep_ddp")``.

Lightning's ``DDPStrategy`` builds ``torch.nn.parallel.DistributedDataParallel`` through a name its
module imported; this strategy builds lockstep's instead and is otherwise Lightning's own (launcher,
process group, samplers, checkpoints, teardown). Importing this module registers it under
``"lockstep_ddp"`` (and ``"lockstep_ddp_spawn"``) in Lightning's strategy registry. Works with the
``lightning`` package and with the older ``pytorch_lightning`` one, whichever is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # one package for the type checker: with both installed, their classes are distinct types
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
else:
    try:  # the unified package first, then the older standalone one
        from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    except ImportError:  # pragma: no cover - depends on what the user installed
        from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

from lockstep.ddp.wrapper import DistributedDataParallel

__all__ = ["LockstepDDPStrategy"]


class LockstepDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy with lockstep's ``DistributedDataParallel``; takes DDPStrategy's arguments.

    DDP keyword arguments (``find_unused_parameters=True``, ``static_graph=True``, ``bucket_cap_mb``...)
    pass through to lockstep's DDP as they would to torch's.
    """

    strategy_name = "lockstep_ddp"

    def _setup_model(self, model: Any) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(module=model, device_ids=device_ids, **self._ddp_kwargs)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in (("lockstep_ddp", "popen"), ("lockstep_ddp_spawn", "spawn")):
            strategy_registry.register(
                name, cls, description=f"lockstep's DDP with start_method {start_method!r}", start_method=start_method,
                override=True,
            )


LockstepDDPStrategy.register_strategies(StrategyRegistry)
