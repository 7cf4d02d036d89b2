"""Why N devices are not N times faster: a communication cost model for data parallelism.

Pure functions (numpy, no torch), so every formula is tested without processes.

- A message of S bytes on a link costs ``alpha + S / beta`` per hop (latency alpha,
  bandwidth beta). Ring all-reduce over N ranks takes 2(N-1) hops, each carrying S/N:
  ``T(N, S) = 2(N-1) alpha + 2(N-1)/N * S / beta``. The bandwidth term tends to 2S/beta,
  so it barely grows with N; the latency term grows linearly.
- Hierarchical all-reduce (G devices per node, M nodes): reduce-scatter inside each node
  on the fast link, a ring all-reduce of each 1/G shard between nodes on the slow link,
  all-gather inside the node.
- DDP splits the gradients into buckets (1 MiB first, then ``bucket_cap_mb``) in the
  order backward produces them and all-reduces each bucket as soon as it is complete,
  overlapping communication with the rest of backward. What is left after backward ends
  (the exposed communication) is added to the step.
- Epoch times measured at several N fit ``fixed + compute / N + comm * (N-1) / N**2``:
  a fixed cost per epoch, compute split N ways, and ring communication whose per-step
  cost grows as (N-1)/N while the number of steps falls as 1/N.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from paratrain.config import LINK_PRESETS

MIB = 2**20
DDP_FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class Link:
    """One link: bandwidth in GB/s (1e9 bytes) per direction, latency per message in us."""

    name: str
    bandwidth_gbps: float
    latency_us: float
    note: str = ""

    @property
    def alpha_s(self) -> float:
        """Latency per message, in seconds."""
        return self.latency_us * 1e-6

    @property
    def beta_bps(self) -> float:
        """Bandwidth, in bytes per second."""
        return self.bandwidth_gbps * 1e9

    def describe(self) -> str:
        """The link as one line: name, bandwidth, latency and what it is."""
        text = f"{self.name}: {self.bandwidth_gbps:g} GB/s, {self.latency_us:g} us"
        return f"{text} ({self.note})" if self.note else text


# the links `--link NAME` names (config.LINK_PRESETS: line rates per direction, latency
# as a collective library sees one message)
PRESETS: dict[str, Link] = {
    name: Link(name, bandwidth, latency, note)
    for name, (bandwidth, latency, note) in LINK_PRESETS.items()
}


def ring_all_reduce_s(n: int, nbytes: float, link: Link) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes / link.beta_bps


@dataclass(frozen=True)
class Network:
    """Where the ranks are: one flat ring on ``link``, or nodes of ``per_node`` devices
    joined by ``link`` with ``intra`` inside each node (hierarchical all-reduce)."""

    link: Link
    per_node: int | None = None
    intra: Link | None = None

    def all_reduce_s(self, n: int, nbytes: float) -> float:
        """Seconds for one all-reduce of ``nbytes`` over ``n`` devices on this network."""
        if not self.per_node or self.intra is None:
            return ring_all_reduce_s(n, nbytes, self.link)
        inside = min(self.per_node, n)
        nodes = math.ceil(n / inside)
        if nodes == 1:
            return ring_all_reduce_s(n, nbytes, self.intra)
        # reduce-scatter + all-gather inside a node cost what a ring all-reduce does there
        local = ring_all_reduce_s(inside, nbytes, self.intra)
        return local + ring_all_reduce_s(nodes, nbytes / inside, self.link)

    def describe(self) -> str:
        """The network as one line: one link, or the link inside a node and the one between nodes."""
        if not self.per_node or self.intra is None:
            return f"ring all-reduce on {self.link.describe()}"
        return (
            f"hierarchical all-reduce: {self.per_node} devices per node on "
            f"{self.intra.describe()}; between nodes {self.link.describe()}"
        )


# --- fitting alpha and beta -------------------------------------------------------------


@dataclass(frozen=True)
class LinkFit:
    alpha_s: float
    beta_bps: float
    rms_error: float  # relative, over the fitted points
    max_error: float
    points: int

    def link(self, name: str = "measured") -> Link:
        """The fitted alpha and beta as a Link, so predictions can use them like a preset."""
        return Link(name, self.beta_bps / 1e9, self.alpha_s * 1e6, "fitted here")


def fit_alpha_beta(samples: Iterable[tuple[int, float, float]]) -> LinkFit:
    """Least squares of the ring model on measured all-reduce times.

    ``samples`` are (ranks, bytes, seconds). Residuals are relative (each row divided by
    its time), so 4 KB messages weigh as much as 256 MB ones and the latency is fitted
    from the small messages, the bandwidth from the large ones.
    """
    rows = [(n, float(s), float(t)) for n, s, t in samples if n > 1 and t > 0]
    if len(rows) < 2:
        raise ValueError("fitting alpha and beta needs all-reduce times at 2 or more sizes")
    hops = np.array([2.0 * (n - 1) for n, _, _ in rows])
    volume = np.array([2.0 * (n - 1) / n * s for n, s, _ in rows])
    times = np.array([t for _, _, t in rows])
    design = np.stack([hops, volume], axis=1) / times[:, None]
    (alpha, inverse_beta), *_ = np.linalg.lstsq(design, np.ones_like(times), rcond=None)
    if alpha < 0 or inverse_beta <= 0:  # keep the physical quantities physical
        alpha = max(alpha, 0.0)
        inverse_beta = max(
            float(np.sum(volume * (times - alpha * hops)) / np.sum(volume**2)), 1e-15
        )
    predicted = alpha * hops + inverse_beta * volume
    errors = np.abs(predicted - times) / times
    return LinkFit(
        float(alpha),
        float(1 / inverse_beta),
        float(np.sqrt(np.mean(errors**2))),
        float(errors.max()),
        len(rows),
    )


# --- one training step ------------------------------------------------------------------


@dataclass
class StepProfile:
    """One process's training step without communication, measured on this machine.

    ``gradients`` are (seconds after backward started, bytes sent) for every parameter,
    in the order backward produced them.
    """

    before_backward_s: float  # data + forward
    backward_s: float
    after_backward_s: float  # optimizer
    gradients: list[tuple[float, int]] = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        """Seconds of one step's computation: data and forward, backward, optimizer."""
        return self.before_backward_s + self.backward_s + self.after_backward_s

    @property
    def gradient_bytes(self) -> int:
        """Bytes all-reduced per step: every gradient once."""
        return sum(nbytes for _, nbytes in self.gradients)

    def scaled(self, factor: float) -> StepProfile:
        """Every phase ``factor`` times longer: the compute of a process that shares its
        machine with others (measured as the no_sync step at that N)."""
        return StepProfile(
            factor * self.before_backward_s,
            factor * self.backward_s,
            factor * self.after_backward_s,
            [(factor * when, nbytes) for when, nbytes in self.gradients],
        )


def ddp_buckets(
    gradients: Sequence[tuple[float, int]],
    cap_bytes: float,
    first_cap_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> list[tuple[float, int]]:
    """Group gradients as DDP does once it has seen one backward: consecutive in ready
    order, a bucket closed when it reaches its cap. Returns (ready time, bytes) each."""
    buckets: list[tuple[float, int]] = []
    ready, size = 0.0, 0
    for when, nbytes in gradients:
        ready, size = max(ready, when), size + nbytes
        if size >= (first_cap_bytes if not buckets else cap_bytes):
            buckets.append((ready, size))
            ready, size = 0.0, 0
    if size:
        buckets.append((ready, size))
    return buckets


def overlapped_communication(
    buckets: Sequence[tuple[float, int]], backward_s: float, all_reduce_s: Callable[[float], float]
) -> tuple[float, float]:
    """(total, exposed) seconds: buckets all-reduced one after another, each starting when
    it is complete and the previous one is done; exposed = what runs past backward."""
    clock = total = 0.0
    for ready, nbytes in buckets:
        seconds = all_reduce_s(nbytes)
        clock = max(clock, ready) + seconds
        total += seconds
    return total, max(0.0, clock - backward_s)


@dataclass(frozen=True)
class Prediction:
    n: int
    step_s: float
    communication_s: float  # all buckets, overlapped or not
    exposed_s: float  # the part that lengthens the step
    images_per_s: float
    speedup: float
    efficiency: float
    epoch_s: float  # an epoch of the given number of images, split N ways


def predict(
    profile: StepProfile,
    ns: Iterable[int],
    network: Network,
    batch_size: int,
    bucket_cap_mb: float = 25.0,
    epoch_images: int = 10_000,
) -> list[Prediction]:
    """Weak scaling: every process keeps ``batch_size`` and the measured compute time."""
    buckets = ddp_buckets(profile.gradients, bucket_cap_mb * MIB)
    out = []
    for n in ns:

        def all_reduce_s(nbytes: float, n: int = n) -> float:
            return network.all_reduce_s(n, nbytes)

        total, exposed = overlapped_communication(buckets, profile.backward_s, all_reduce_s)
        step = profile.compute_s + exposed
        speedup = n * profile.compute_s / step
        steps_per_epoch = math.ceil(epoch_images / (batch_size * n))
        out.append(
            Prediction(
                n,
                step,
                total,
                exposed,
                n * batch_size / step,
                speedup,
                speedup / n,
                steps_per_epoch * step,
            )
        )
    return out


def powers_of_two(last: int, also: Iterable[int] = ()) -> list[int]:
    """1, 2, 4, ... up to ``last``, with ``also`` merged in: the N at which predictions are printed."""
    ns = {1 << k for k in range(int(math.log2(max(last, 1))) + 1)} | set(also)
    return sorted(n for n in ns if 1 <= n <= last)


# --- calibration from a user's epoch times ----------------------------------------------


@dataclass(frozen=True)
class Calibration:
    """``epoch(N) = fixed_s + compute_s / N + communication_s * (N-1) / N**2``.

    The latency part of ring communication per epoch goes as (N-1)/N = 1 - 1/N, which is
    a fixed cost plus a compute-like term, so it is carried by those two.
    """

    fixed_s: float
    compute_s: float
    communication_s: float
    measured: tuple[tuple[int, float], ...]

    def epoch_s(self, n: int) -> float:
        """The fitted epoch time at ``n`` processes."""
        return self.fixed_s + self.compute_s / n + self.communication_s * (n - 1) / n**2

    def communication_share(self, n: int) -> float:
        """The share of the fitted epoch at ``n`` that is communication."""
        return self.communication_s * (n - 1) / n**2 / self.epoch_s(n)

    def fixed_share(self, n: int) -> float:
        """The share of the fitted epoch at ``n`` that no N can shorten."""
        return self.fixed_s / self.epoch_s(n)

    def errors(self) -> list[float]:
        """Each measured point's relative error against the fit: how far to trust it."""
        return [(self.epoch_s(n) - t) / t for n, t in self.measured]

    def speedup_limit(self) -> float:
        """The speedup no N can pass: the fixed cost alone stays."""
        return self.epoch_s(1) / self.fixed_s if self.fixed_s > 0 else math.inf


def calibrate(points: Sequence[tuple[int, float]]) -> Calibration:
    """Non-negative least squares (relative residuals) of the three terms on the points."""
    if len({n for n, _ in points}) < 3:
        raise ValueError("calibration needs epoch times at 3 or more different N")
    if any(n < 1 or t <= 0 for n, t in points):
        raise ValueError("every N must be 1 or more and every time positive")
    ns = np.array([float(n) for n, _ in points])
    times = np.array([float(t) for _, t in points])
    basis = np.stack([np.ones_like(ns), 1 / ns, (ns - 1) / ns**2], axis=1) / times[:, None]
    target = np.ones_like(times)
    best, best_residual = np.zeros(3), math.inf
    # three unknowns: trying every subset of active terms is exact non-negative least squares
    for size in (1, 2, 3):
        for active in itertools.combinations(range(3), size):
            coef, *_ = np.linalg.lstsq(basis[:, active], target, rcond=None)
            if (coef < 0).any():
                continue
            residual = float(np.sum((basis[:, active] @ coef - target) ** 2))
            if residual < best_residual:
                best = np.zeros(3)
                best[list(active)] = coef
                best_residual = residual
    return Calibration(
        float(best[0]), float(best[1]), float(best[2]), tuple((int(n), float(t)) for n, t in points)
    )
