"""PowerSGD gradient compression (Vogels, Karimireddy & Jaggi, NeurIPS 2019) as a DDP communication hook.

Each gradient matrix M (a weight's gradient viewed as ``(shape[0], -1)``, n x m)
travels as two thin factors instead of n*m numbers: P = M Q (n x r) is summed
over ranks and orthogonalised, then Q = M^T P (m x r) is averaged, and every
rank rebuilds the same rank-r approximation P Q^T of the averaged gradient. One
power-iteration step per training step is enough because Q is reused from the
previous step (warm start) and each rank adds back what the approximation
missed last time (error feedback). Vectors (biases, norms) and matrices too
small to gain ``min_compression_rate`` are averaged uncompressed. Until
``start_powerSGD_iter`` the hook is a plain average: early gradients change
too fast for a low-rank approximation to track (the paper's warm-up).
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lockstep.comm_hooks.base import BucketLike, Future, average_async, collectives_up_front, completed


@dataclass
class PowerSGDState:
    """Settings and per-parameter memory of ``powersgd_hook``; pass it as the hook's ``state``.

    Field order follows torch's ``PowerSGDState`` so positional calls port over.
    """

    process_group: dist.ProcessGroup | None = None
    """The group to average over; ``None`` is the default group."""
    matrix_approximation_rank: int = 1
    """r: the approximation's rank. Wire cost per matrix (n + m) * r instead of n * m."""
    start_powerSGD_iter: int = 1_000
    """Iterations (steps of the hook's last bucket) of plain averaging before compression starts. 0 and 1
    are fine: memory is kept per parameter, so DDP's bucket rebuild after step 1 loses nothing (torch's
    PowerSGD, keyed by bucket, needs > 1)."""
    min_compression_rate: float = 2.0
    """Compress a matrix only if n * m > min_compression_rate * (n + m) * r; smaller ones go uncompressed."""
    use_error_feedback: bool = True
    """Keep each rank's approximation error and add it to the next step's gradient (one tensor per matrix)."""
    warm_start: bool = True
    """Reuse last step's Q (identical on all ranks); otherwise draw a fresh random Q every step."""
    random_seed: int = 0
    """Seed for the initial Q: every rank must draw the same one, so it is a seed, never rank-dependent."""

    iteration: int = field(default=0, init=False)
    """Steps seen so far (counted when the last bucket of a backward is reduced)."""
    numel_sent: int = field(default=0, init=False)
    """Elements all-reduced by compressed steps (P, Q and uncompressed tensors), for the compression rate."""
    numel_dense: int = field(default=0, init=False)
    """Elements those steps would have all-reduced without compression."""
    errors: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    qs: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    rng: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.matrix_approximation_rank, int) or self.matrix_approximation_rank < 1:
            raise ValueError(f"matrix_approximation_rank must be an int >= 1, got {self.matrix_approximation_rank!r}")
        if not isinstance(self.start_powerSGD_iter, int) or self.start_powerSGD_iter < 0:
            raise ValueError(f"start_powerSGD_iter must be an int >= 0, got {self.start_powerSGD_iter!r}")
        if not self.min_compression_rate >= 1.0:
            raise ValueError(
                f"min_compression_rate must be >= 1 (a rate below 1 sends more), got {self.min_compression_rate!r}"
            )
        if self.process_group is not None and not isinstance(self.process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a ProcessGroup or None, got {type(self.process_group).__name__}")
        self.rng = torch.Generator().manual_seed(self.random_seed)

    @property
    def compression_rate(self) -> float:
        """Dense elements per element sent, over the compressed steps so far (0 before the first)."""
        return self.numel_dense / self.numel_sent if self.numel_sent else 0.0

    def _advance(self, bucket: BucketLike) -> None:
        if bucket.is_last():
            self.iteration += 1


def _matrix_shape(grad: torch.Tensor, state: PowerSGDState) -> tuple[int, int, int] | None:
    """(n, m, r) if this gradient is worth compressing, else None."""
    if grad.ndim <= 1:
        return None
    n = grad.shape[0]
    m = grad.numel() // n if n else 0
    r = min(state.matrix_approximation_rank, n, m)
    if r == 0 or n * m <= state.min_compression_rate * (n + m) * r:
        return None
    return n, m, r


def _orthogonalise(p: torch.Tensor) -> None:
    """Replace p's columns by an orthonormal basis of their span, in place.

    Householder QR in fp32 (half-precision factors lose orthogonality); unlike
    Gram-Schmidt it needs no epsilon for a zero or dependent column. Every rank
    holds the same summed P here, so every rank gets the same basis.
    """
    p.copy_(torch.linalg.qr(p.float(), mode="reduced").Q)


@collectives_up_front  # every collective from the call (the P and Q all-reduces synchronously)
def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Average the bucket with rank-r PowerSGD compression (see the module docstring).

    Synchronous after the warm-up: the P and Q all-reduces depend on each
    other, and issuing them from Future callbacks could interleave with other
    buckets' collectives in a different order on each rank. The uncompressed
    tensors' all-reduce is launched first and overlaps the matrix products.
    Collectives per bucket: three (uncompressed, P, Q); all ranks issue them in
    the same order.
    """
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"powersgd_hook needs a PowerSGDState as its state, got {type(state).__name__}")
    group = state.process_group
    buffer = bucket.buffer()
    if state.iteration < state.start_powerSGD_iter:
        state._advance(bucket)
        return average_async(buffer, group)

    world_size = dist.get_world_size(group)
    plain: list[torch.Tensor] = []
    matrices: list[tuple[int, torch.Tensor, int]] = []  # (key, M as an n x m view into the buffer, r)
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        shape = _matrix_shape(grad, state)
        if shape is None:
            plain.append(grad)
        else:
            n, m, r = shape
            # Keyed by the parameter's storage, not the bucket: survives DDP rebuilding its buckets.
            matrices.append((param.data_ptr(), grad.view(n, m), r))

    plain_flat = plain_work = None
    if plain:
        plain_flat = torch.cat([g.reshape(-1) for g in plain]).div_(world_size)
        plain_work = dist.all_reduce(plain_flat, group=group, async_op=True)

    if matrices:
        _compress_matrices(state, matrices, group, world_size)

    if plain_work is not None and plain_flat is not None:  # set together
        plain_work.wait()
        offset = 0
        for g in plain:
            g.copy_(plain_flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    state.numel_sent += (plain_flat.numel() if plain_flat is not None else 0) + sum(
        (mat.shape[0] + mat.shape[1]) * r for _, mat, r in matrices
    )
    state.numel_dense += buffer.numel()
    state._advance(bucket)
    return completed(buffer)


def _compress_matrices(
    state: PowerSGDState,
    matrices: list[tuple[int, torch.Tensor, int]],
    group: dist.ProcessGroup | None,
    world_size: int,
) -> None:
    """Replace each M (a view into the bucket) by the rank-r approximation of the ranks' average."""
    dtype, device = matrices[0][1].dtype, matrices[0][1].device
    if state.use_error_feedback:
        for key, mat, _ in matrices:
            error = state.errors.get(key)
            if error is not None and error.shape == mat.shape and error.dtype == mat.dtype:
                mat.add_(error)

    qs = []
    for key, mat, r in matrices:
        q = state.qs.get(key) if state.warm_start else None
        if q is None or q.shape != (mat.shape[1], r) or q.dtype != dtype:
            # Drawn in the same order from the same seed on every rank, so the Qs agree without a broadcast;
            # on the CPU generator so every device draws the same numbers (one host-to-device copy per new Q).
            q = torch.randn(mat.shape[1], r, generator=state.rng).to(device=device, dtype=dtype)
        qs.append(q)

    # One flat buffer per factor: one all-reduce for all the bucket's Ps, one for its Qs.
    p_flat = torch.empty(sum(mat.shape[0] * r for _, mat, r in matrices), dtype=dtype, device=device)
    ps = _split(p_flat, [(mat.shape[0], r) for _, mat, r in matrices])
    for (_, mat, _), q, p in zip(matrices, qs, ps):
        torch.matmul(mat, q, out=p)
    dist.all_reduce(p_flat, group=group)  # the sum: its scale vanishes in the orthogonalisation
    for p in ps:
        _orthogonalise(p)

    q_flat = torch.empty(sum(mat.shape[1] * r for _, mat, r in matrices), dtype=dtype, device=device)
    new_qs = _split(q_flat, [(mat.shape[1], r) for _, mat, r in matrices])
    for (_, mat, _), p, q in zip(matrices, ps, new_qs):
        torch.matmul(mat.t(), p, out=q)
    dist.all_reduce(q_flat, group=group)
    q_flat.div_(world_size)  # Q = mean(M)^T P, so P Q^T approximates the averaged gradient

    for (key, mat, _), p, q in zip(matrices, ps, new_qs):
        approx = p @ q.t()  # an n x m temporary per matrix
        if state.use_error_feedback:
            state.errors[key] = mat - approx  # this rank's own residual, local by design
        mat.copy_(approx)
        if state.warm_start:
            state.qs[key] = q


def _split(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    views, offset = [], 0
    for rows, cols in shapes:
        views.append(flat[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return views
