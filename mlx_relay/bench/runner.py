"""Runs a scenario against one or more targets: closed or open loop, bounded, cancellable.

- Closed loop: `concurrency` workers, each sending its next job as soon as its last one ends.
- Open loop: jobs arrive as a Poisson process at `rate` per second (seeded: every target sees
  the same arrival times), whatever is still in flight.
- A sweep runs each load level in turn; each level sends the same jobs (from the seed).
- Several targets: each level's jobs are cut into waves of about `wave_requests` requests;
  target A runs a wave, then B runs the same wave, ..., the order reversing every wave (ABBA),
  so drift of the machine (heat, background load) falls on every target alike. A target's
  throughput is over the time it was being driven.
- Bounded: at most `max_requests` requests per level and target, and `max_duration_s` for the
  whole run, after which it stops by itself. `stop()` (Ctrl-C) or an enclosing cancel scope end
  it as cleanly; `result()` then holds every request finished so far.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Literal

import anyio
import msgspec
import numpy as np

from mlx_relay.bench.driver import Driver
from mlx_relay.bench.errors import BenchError, TargetError
from mlx_relay.bench.progress import Progress
from mlx_relay.bench.records import Outcome, RequestRecord
from mlx_relay.bench.scenario import Scenario
from mlx_relay.bench.session import session_request
from mlx_relay.bench.workload import BenchRequest, ChatJob, Job, build_jobs

StopReason = Literal["completed", "max_duration", "interrupted"]


class Level(msgspec.Struct, frozen=True):
    """A load level: `concurrency` workers (closed loop), or `rate` arrivals a second (open loop)."""

    concurrency: int | None = None
    rate: float | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise BenchError("a load level has either a concurrency or a rate")
        if (self.concurrency is not None and self.concurrency < 1) or (self.rate is not None and self.rate <= 0):
            raise BenchError("concurrency must be at least 1 and rate positive")

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"rate={self.rate:g}/s"


class RunConfig(msgspec.Struct, frozen=True, kw_only=True):
    levels: list[Level] = msgspec.field(default_factory=lambda: [Level(concurrency=1)])
    max_requests: int = 200  # per level and target
    max_duration_s: float = 300.0  # the whole run
    seed: int | None = None  # None: the scenario's
    wave_requests: int | None = None  # several targets: requests per wave (default 4 x concurrency, >= 8)
    warmup_requests: int = 1  # per target, before measuring; not recorded


class LevelResult(msgspec.Struct, kw_only=True):
    target: str
    level: str
    concurrency: int | None
    rate: float | None
    elapsed_s: float  # time this target was driven at this level
    in_flight: int  # requests cut off by a stop (not recorded)
    skipped: int  # session turns not sent because an earlier turn failed
    records: list[RequestRecord]


class BenchResult(msgspec.Struct, kw_only=True):
    scenario: str
    seed: int
    stop_reason: StopReason
    elapsed_s: float
    results: list[LevelResult]


class _Tally:
    """What one target did at one level so far."""

    def __init__(self, target: str, level: Level) -> None:
        self.target = target
        self.level = level
        self.records: list[RequestRecord] = []
        self.elapsed_s = 0.0
        self.in_flight = 0
        self.skipped = 0

    def result(self) -> LevelResult:
        return LevelResult(target=self.target, level=self.level.label, concurrency=self.level.concurrency,
                           rate=self.level.rate, elapsed_s=self.elapsed_s, in_flight=self.in_flight,
                           skipped=self.skipped, records=list(self.records))


def wave_size(level: Level, configured: int | None) -> int:
    if configured is not None:
        return max(1, configured)
    if level.concurrency is not None:
        return max(8, 4 * level.concurrency)
    return max(8, math.ceil(10 * (level.rate or 1.0)))  # about ten seconds of arrivals


def split_waves(jobs: Sequence[Job], size: int) -> list[list[Job]]:
    """Consecutive groups of at least `size` requests (a session stays in one wave)."""
    waves: list[list[Job]] = [[]]
    count = 0
    for job in jobs:
        if count >= size:
            waves.append([])
            count = 0
        waves[-1].append(job)
        count += job.request_count
    return [w for w in waves if w]


def arrival_offsets(seed: int, level_index: int, wave_index: int, rate: float, n: int) -> list[float]:
    """Poisson arrival times (seconds from the wave's start, the first at 0) of `n` jobs at
    `rate` a second; the same for every target."""
    rng = np.random.default_rng([seed, 0xA441, level_index, wave_index])
    gaps = rng.exponential(1.0 / rate, size=max(0, n - 1))
    return [0.0, *(float(x) for x in np.cumsum(gaps))][:n]


class BenchRun:
    def __init__(self, scenario: Scenario, drivers: Sequence[Driver], config: RunConfig = RunConfig(),
                 progress: Progress | None = None) -> None:
        if not drivers:
            raise BenchError("no target to run against")
        labels = [d.label for d in drivers]
        if len(set(labels)) != len(labels):
            raise BenchError(f"target labels must be unique, got {labels}")
        self.scenario = scenario
        self.drivers = list(drivers)
        self.config = config
        self.progress = progress
        self.seed = scenario.seed if config.seed is None else config.seed
        self._scope = anyio.CancelScope()
        self._tallies = {(i, d.label): _Tally(d.label, level) for i, level in enumerate(config.levels)
                         for d in self.drivers}
        self._stopped = False
        self._completed = False
        self._t0: float | None = None
        self._t_end: float | None = None

    # -- control -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """End the run now (Ctrl-C); `run` returns the partial result."""
        self._stopped = True
        self._scope.cancel()

    def result(self) -> BenchResult:
        """The result so far (complete once `run` has returned)."""
        reason: StopReason = "completed"
        if not self._completed:
            reason = "max_duration" if self._scope.cancelled_caught and not self._stopped else "interrupted"
        end = self._t_end if self._t_end is not None else time.perf_counter()
        return BenchResult(scenario=self.scenario.name, seed=self.seed, stop_reason=reason,
                           elapsed_s=end - self._t0 if self._t0 is not None else 0.0,
                           results=[t.result() for t in self._tallies.values()])

    async def run(self) -> BenchResult:
        """Run once (a BenchRun is single-use); returns the result, partial if stopped."""
        if self._t0 is not None:
            raise BenchError("a BenchRun runs once; make a new one")
        self._t0 = time.perf_counter()
        self._scope.deadline = anyio.current_time() + self.config.max_duration_s
        try:
            with self._scope:
                jobs = await anyio.to_thread.run_sync(build_jobs, self.scenario, self.seed, self.config.max_requests)
                await self._warmup(jobs)
                for index, level in enumerate(self.config.levels):
                    await self._run_level(index, level, jobs)
                self._completed = True
        finally:
            self._t_end = time.perf_counter()
        return self.result()

    # -- the load ----------------------------------------------------------------------------------
    async def _warmup(self, jobs: Sequence[Job]) -> None:
        firsts: list[BenchRequest] = []
        for job in jobs:
            firsts.append(job.request if isinstance(job, ChatJob) else session_request(job, 0, []))
            if len(firsts) >= self.config.warmup_requests:
                break
        for driver in self.drivers:
            for request in firsts:
                m = (await driver.send(request)).measurement
                if m.error == "connection":
                    raise TargetError(f"cannot reach {driver.description}: {m.error_detail}")

    async def _run_level(self, index: int, level: Level, jobs: Sequence[Job]) -> None:
        size = wave_size(level, self.config.wave_requests)
        waves = [list(jobs)] if len(self.drivers) == 1 else split_waves(jobs, size)
        if self.progress:
            self.progress.begin(level.label, sum(j.request_count for j in jobs) * len(self.drivers))
        try:
            for w, wave in enumerate(waves):
                for driver in self.drivers if w % 2 == 0 else self.drivers[::-1]:
                    if self.progress:
                        self.progress.on_target(driver.label if len(self.drivers) > 1 else "")
                    await self._run_wave(index, w, level, wave, driver, self._tallies[index, driver.label])
        finally:
            if self.progress:
                self.progress.end()

    async def _run_wave(self, index: int, w: int, level: Level, wave: list[Job], driver: Driver,
                        tally: _Tally) -> None:
        t0 = anyio.current_time()
        try:
            async with anyio.create_task_group() as tg:
                if level.concurrency is not None:
                    queue = iter(wave)
                    for _ in range(min(level.concurrency, len(wave))):
                        tg.start_soon(self._worker, queue, driver, tally)
                else:
                    assert level.rate is not None
                    offsets = arrival_offsets(self.seed, index, w, level.rate, len(wave))
                    for job, offset in zip(wave, offsets, strict=True):
                        await anyio.sleep_until(t0 + offset)
                        tg.start_soon(self._run_job, job, driver, tally)
        finally:
            tally.elapsed_s += anyio.current_time() - t0

    async def _worker(self, queue: Iterator[Job], driver: Driver, tally: _Tally) -> None:
        for job in queue:  # shared by the wave's workers: each takes the next job
            await self._run_job(job, driver, tally)

    async def _run_job(self, job: Job, driver: Driver, tally: _Tally) -> None:
        if isinstance(job, ChatJob):
            await self._send(job.request, driver, tally)
            return
        replies: list[str] = []
        for turn in range(job.request_count):
            outcome = await self._send(session_request(job, turn, replies), driver, tally)
            if outcome.measurement.error is not None:  # later turns would resend a reply we lack
                left = job.request_count - turn - 1
                tally.skipped += left
                if self.progress:
                    self.progress.skip(left)
                return
            replies.append(outcome.text)

    async def _send(self, request: BenchRequest, driver: Driver, tally: _Tally) -> Outcome:
        assert self._t0 is not None
        start = time.perf_counter() - self._t0
        tally.in_flight += 1
        outcome = await driver.send(request)
        tally.in_flight -= 1
        record = RequestRecord.of(outcome.measurement, request_id=request.id, scenario=request.scenario,
                                  target=driver.label, level=tally.level.label, start_s=start)
        tally.records.append(record)
        if self.progress:
            self.progress.on_record(record)
        return outcome
