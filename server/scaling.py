"""Scaling a running model's workers without losing a request (``python -m server.cli scale N``).

TorchServe 0.12 removes the last workers its describe API lists. When one of them has requests
(a batch in flight, or one being gathered), the frontend re-queues them from the management thread
while the worker's own thread clears the same map (``WorkerThread.shutdown`` ->
``BatchAggregator.sendError``): a request that loses that race is neither re-run nor answered,
answered 500 ``Worker died.``, or the scale call fails with a ``ConcurrentModificationException``.
Nothing outside the frontend can make a raw ``PUT ...?min_worker=`` under load safe.

So this path lowers the count only once the workers to be removed have no request: it marks them
retiring (``server.control``) and sends describe calls (``GET /models/NAME?customized=true``) until
each of them has taken one and parked in it (``handler/control.py``). TorchServe never batches a
describe call with requests and hands requests only to idle workers, so a parked worker holds none
when the scale call removes it. The race can still strike the parked describe call itself, which
the management thread re-queues while the worker's thread answers it and clears the same map: the
scale call then answers 500 (a ``ConcurrentModificationException`` or ``NullPointerException`` in
``WorkerThread.shutdown``), having removed that worker but none listed before it. So while a scale
call answered otherwise than 200 and removed some of the workers to be removed but not all, those
left are parked again (they still are, unless one outlasted its longest park) and the call is sent
again. No request is involved either way. Raising the count is safe as it is.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import requests

from server.process import TorchServe

logger = logging.getLogger("server")

DESCRIBE_POLL_SECONDS = 0.05


class ScaleError(RuntimeError):
    """The scale could not be done (safely), or TorchServe did not reach the count asked for."""


@dataclass(frozen=True)
class ScaleResult:
    before: int
    after: int
    parked_s: float  # how long the workers to be removed took to park (0 when none was)
    statuses: tuple[int, ...]  # TorchServe's answers, one per scale call

    @property
    def status(self) -> int:
        """TorchServe's answer to the last scale call."""
        return self.statuses[-1]


def scale(server: TorchServe, workers: int, park_timeout_s: float) -> ScaleResult:
    """Set the model's workers to ``workers``, lowering the count only through parked workers."""
    if workers < 1:
        raise ScaleError("at least one worker: a model without workers answers every request 503")
    described = server.describe()
    current = described["workers"]
    if described["continuousBatching"] and workers > 1:
        raise ScaleError(
            f"{server.model_name} runs continuous batching, which TorchServe 0.12 serves with one worker per model; "
            "for several workers set continuousBatching: false in model-config.yaml and rebuild the archive (make mar)"
        )
    if workers < len(current):
        try:
            responses, parked_s, after = _scale_down(server, workers, current, park_timeout_s)
        finally:
            server.control.end_retirement()
    else:
        responses, parked_s, after = [server.scale(workers)], 0.0, len(server.describe()["workers"])
    statuses = tuple(response.status_code for response in responses)
    if after != workers:
        raise ScaleError(
            f"asked for {workers} worker(s), TorchServe answered {statuses[-1]} {responses[-1].text.strip()}; "
            f"{after} worker(s) now"
        )
    if statuses[-1] != 200:
        logger.warning("TorchServe answered %d to the scale call; %d worker(s) now", statuses[-1], after)
    return ScaleResult(len(current), after, parked_s, statuses)


def _scale_down(
    server: TorchServe, workers: int, listed: list[dict], park_timeout_s: float
) -> tuple[list[requests.Response], float, int]:
    """Park the workers to be removed, then the scale call; again while a call that failed removed
    some of them but not all (see above). TorchServe's answers, the seconds parked, the workers left."""
    responses, parked_s = [], 0.0
    while True:
        # Workers still loading (or refused and retried) hold no request and cannot park.
        leaving = [worker["id"] for worker in listed[workers:] if worker["status"] == "READY"]
        server.control.retire(leaving, park_timeout_s)
        parked_s += _park(server, leaving, park_timeout_s)
        server.control.retire(leaving, park_timeout_s)  # a fresh expiry: none unparks before the scale call
        responses.append(server.scale(workers))
        before, listed = len(listed), server.describe()["workers"]
        if responses[-1].status_code == 200 or not workers < len(listed) < before:
            return responses, parked_s, len(listed)
        logger.warning(
            "TorchServe answered %d to the scale call after removing %d of the %d worker(s) to be removed; "
            "asking again",
            responses[-1].status_code,
            before - len(listed),
            before - workers,
        )


def _park(server: TorchServe, leaving: list[str], timeout_s: float) -> float:
    """Send describe calls until every worker in ``leaving`` parked in one; the seconds it took."""
    started = time.monotonic()
    pool = ThreadPoolExecutor(max(len(leaving), 1), thread_name_prefix="describe")
    calls: list[Future] = []
    try:
        while not set(leaving) <= server.control.parked():
            if time.monotonic() - started > timeout_s:
                raise ScaleError(
                    f"worker(s) {sorted(set(leaving) - server.control.parked())} stayed busy for {timeout_s:.0f} s; "
                    "nothing was changed (try again, or with a longer --park-timeout)"
                )
            # one call in flight per leaving worker: parked ones hold theirs, the others are queued
            calls = [call for call in calls if not call.done()]
            if len(calls) < len(leaving):
                calls.append(pool.submit(_describe_call, server, timeout_s))
            time.sleep(DESCRIBE_POLL_SECONDS)
    finally:
        pool.shutdown(wait=False)  # parked calls end when their workers go (or are released)
    parked_s = time.monotonic() - started
    logger.info("worker(s) %s parked after %.1f s", leaving, parked_s)
    return parked_s


def _describe_call(server: TorchServe, timeout_s: float) -> None:
    """One describe call: a worker takes it when it is next idle."""
    try:
        # Connection: close, so that the late answer of a call TorchServe re-queued goes nowhere.
        params, headers = {"customized": "true"}, {"Connection": "close"}
        server.management("GET", server.model_url, params=params, headers=headers, timeout=timeout_s + 30)
    except requests.RequestException as error:  # a removed worker's call may end either way
        logger.debug("describe call ended: %s", error)
