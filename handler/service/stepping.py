"""Stepping: in each iteration, the jobs that would pass their time limit (or the grace period of
a stopping server) are cancelled, then ``choose`` picks the jobs of one latent shape for ONE
denoiser forward whatever their steps, scheduler and guidance, and streamed requests get their
progress lines. Out of memory halves the forward and retries, so only a job that does not fit
alone fails."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from handler.api.protocol import Preview, Response, deadline_exceeded, does_not_fit, internal_error, shutting_down
from handler.engine.loading import release_cached_memory
from handler.engine.profiling import StepsProfiler
from handler.engine.scheduling import StepProfile, choose, slack
from handler.engine.step_engine import StepEngine
from handler.engine.timing import StepTimer
from handler.metrics import DiffusionMetrics
from handler.service.answers import Answers
from handler.service.flights import Flights

logger = logging.getLogger(__name__)


class Stepping:
    """Advances the jobs in ``flights``; failures and progress lines are answered through ``answers``."""

    def __init__(
        self,
        engine: StepEngine,
        profile: StepProfile,
        metrics: DiffusionMetrics,
        flights: Flights,
        answers: Answers,
        clock: Callable[[], float],
        request_timeout_seconds: float,
        drain_left: Callable[[], float | None],
        profiler: StepsProfiler | None = None,
    ):
        self.engine = engine
        self.profile = profile
        self.metrics = metrics
        self.flights = flights
        self.answers = answers
        self.clock = clock
        self.timer = StepTimer(engine.device)  # step times off the step's path: no wait for the device
        self.request_timeout = request_timeout_seconds
        self.drain_left = drain_left
        self.profiler = profiler  # handler.profiler's window over served forwards (None: off)

    def cancel_expired(self) -> dict[str, Response]:
        """For the unfinished jobs whose next step (by the profile's estimate) would end past their
        time limit, 504; past the end of the server's stop grace period, 503."""
        now, responses = self.clock(), {}
        drain_left = self.drain_left()
        for rid, flight in list(self.flights.items()):
            job = flight.job
            step_seconds = self.profile.forward_seconds(job.latent_shape)
            if not job.done and drain_left is not None and step_seconds >= drain_left:
                logger.warning(
                    "request %s cancelled after %d of %d steps: the server is stopping and its grace period ends",
                    rid,
                    job.step,
                    job.total_steps,
                )
                self.metrics.cancelled("shutdown")
                responses[rid] = self.answers.fail(rid, shutting_down((job.step, job.total_steps)))
                continue
            if job.done or now + step_seconds < flight.expires:
                continue
            logger.warning(
                "request %s cancelled after %d of %d steps: past its time limit of %g s",
                rid,
                job.step,
                job.total_steps,
                self.request_timeout,
            )
            self.metrics.cancelled("deadline")
            responses[rid] = self.answers.fail(rid, deadline_exceeded(job.step, job.total_steps, self.request_timeout))
        return responses

    def step_chosen(self) -> dict[str, Response]:
        """One forward for the least-slack jobs of one latent shape, up to the profile's cap; the
        jobs left out are counted as waiting."""
        waiting = {rid: flight.job for rid, flight in self.flights.items() if not flight.job.done}
        chosen: list[str] = []
        responses: dict[str, Response] = {}
        if waiting:
            now = self.clock()
            slacks = {rid: slack(job, self.flights[rid].deadline, now, self.profile) for rid, job in waiting.items()}
            chosen = choose(waiting, slacks, self.profile.limits, self.profile.cost, self.profile.padding)
            responses = self.step(chosen)
        self.flights.waiting = len(waiting) - len(chosen)
        return responses

    def step(self, chosen: list[str]) -> dict[str, Response]:
        """One denoiser forward for ``chosen``. Out of memory halves the jobs that did not advance (and
        the shape's cap) and retries each half, so only a job that does not fit alone fails.
        Returns failures and progress lines by id."""
        jobs = [self.flights[rid].job for rid in chosen]
        steps_before = [job.step for job in jobs]
        rows = sum(self.profile.cost(job).memory for job in jobs)  # plain rows: a ControlNet's count more
        cached_before = [job.cached_steps for job in jobs]
        if self.profiler:
            self.profiler.before(sum(job.rows for job in jobs))
        started = self.timer.start()
        try:
            control_forwards = self.engine.step(jobs)
            self.timer.stop(started, self.metrics.step_seconds)
        except torch.OutOfMemoryError as error:
            out_of_memory = error
        except Exception as error:  # one failing step must not fail the requests that did not take it
            logger.exception("denoising step for requests %s failed", chosen)
            return {rid: self.answers.fail(rid, internal_error("denoising", error)) for rid in chosen}
        else:
            cached = zip(jobs, cached_before, strict=True)
            return self._stepped(
                chosen, control_forwards, sum(job.images for job, before in cached if job.cached_steps > before)
            )
        finally:
            if self.profiler:
                self.profiler.after()
        # Retried outside the except block, whose traceback would keep the failed forward's tensors alive.
        release_cached_memory()
        pending = [rid for rid, job, step in zip(chosen, jobs, steps_before, strict=True) if job.step == step]
        self.profile.ran_out_of_memory(
            jobs[0].latent_shape, rows, alone=len(chosen) == 1, padding=self.engine.padding(jobs)
        )
        if len(chosen) == 1:
            logger.error("request %s does not fit in memory even alone: %s", chosen[0], out_of_memory)
            return {chosen[0]: self.answers.fail(chosen[0], does_not_fit(self.flights[chosen[0]].request))}
        logger.warning("out of memory stepping requests %s; retrying %s in two halves", chosen, pending)
        self.metrics.out_of_memory_retry("step")
        middle = len(pending) // 2
        halves = [half for half in (pending[:middle], pending[middle:]) if half]
        return {rid: response for half in halves for rid, response in self.step(half).items()}

    def _stepped(self, chosen: list[str], control_forwards: int, cached_images: int) -> dict[str, Response]:
        """Bookkeeping of a forward that went through: metrics, progress lines, finish times."""
        images = sum(self.flights[rid].job.images for rid in chosen)
        adapters = {adapter for rid in chosen for adapter, _ in self.flights[rid].job.spec.adapters}
        self.metrics.step(images, len(adapters), control_forwards, cached_images)
        now, responses = self.clock(), {}
        for rid in chosen:
            flight = self.flights[rid]
            flight.max_step_images = max(flight.max_step_images, images)
            if flight.job.done:
                flight.denoised = now
            elif flight.request.stream:
                part = flight.api.progress(
                    flight.request, flight.job.step, flight.job.total_steps, now - flight.arrived, self._preview(rid)
                )
                if part:
                    responses[rid] = self.answers.part(flight, part, final=False)
        return responses

    def _preview(self, rid: str) -> Preview:
        """A request's images decoded from its latents as they are when called (safety checker
        included); none where that decode fails (a preview is not worth a request or a batch)."""
        job = self.flights[rid].job

        def preview() -> list:
            try:
                return self.engine.decode(job.latents, job.spec.width, job.spec.height).images
            except Exception as error:  # out of memory included: the request goes on without this preview
                logger.warning("preview of request %s skipped: %s: %s", rid, type(error).__name__, error)
                release_cached_memory()
                return []

        return preview
