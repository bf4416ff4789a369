"""The cost model: how long an engine step takes, fitted online to the steps workers report, and
what that predicts for a request's TTFT and for a stream's ITL. Pure Python (no torch, no numpy):
the router's path choice and the planner share it.

One step costs, in seconds,

    c0 + c1 * prompt tokens + c2 * prompt attention + c3 * decode streams + c4 * decode context

(prompt attention: per prompt chunk, its tokens times the positions they attend to; decode context:
the sum of the decode streams' lengths). The coefficients are a least-squares fit over the last
`window` steps, kept non-negative (a feature whose weight would come out negative is dropped and
the rest refitted), so the model never predicts that more work is cheaper. Until it has
`min_samples` steps, `min_each` of them with prompt tokens and `min_each` with decode streams, it
is not `ready` and its users fall back to fixed rules: a fit to a few decode steps and one short
prompt says nothing of what a 512-token chunk costs (a benchmark's first seconds showed it, with
multi-second stalls from chunks it thought cheap).

TTFT is predicted by stepping a worker's scheduler rules forward over what is queued there
(`prefill_finish_seconds`); the planner's queueing (wait at a percentile for a pool of k workers)
is an M/M/1 wait per worker on top of each request's own service time (`pool_wait_quantile`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pdserve import clock, slo

# Features are scaled to about 1 for typical steps, so that the normal equations are well
# conditioned: per 1k prompt tokens, per 1M attended positions, per 10 streams, per 10k context.
_SCALE = (1.0, 1e-3, 1e-6, 0.1, 1e-4)
_RIDGE = 1e-9
# A local prefill's steps (prompt tokens beside decode streams) must fit the ITL budget at the SLO's
# percentile, not on average: a step predicted at exactly the budget runs over it about half the
# time. The path choice divides its budget by the recent under-prediction of such steps: the SLO
# percentile of observed / predicted over the last MIXED_WINDOW of them (1 until MIXED_MIN_SAMPLES
# were seen; never below 1), predicted by the fit of the moment. Not by the fit each was predicted
# with as it ran: a young fit's errors would outlive it, since a margin that keeps local prefills
# off keeps new mixed steps from coming to correct it (measured: a margin of 2.24 from a DPD
# server's first seconds held it to no local prefill at all through documents x8 and x16; the
# same server's margin by the fit of the moment ran 1.1-1.5 in five runs of that load).
MIXED_WINDOW = 200
MIXED_MIN_SAMPLES = 20


@dataclass(frozen=True)
class Step:
    """What one step computes (the features of the model)."""

    prefill_tokens: int = 0
    prefill_attention: int = 0
    decode_streams: int = 0
    decode_context: int = 0

    def features(self) -> tuple[float, ...]:
        raw = (1.0, self.prefill_tokens, self.prefill_attention, self.decode_streams, self.decode_context)
        return tuple(value * scale for value, scale in zip(raw, _SCALE, strict=True))


def chunk_attention(start: int, tokens: int) -> int:
    """Attention work of a prompt chunk of `tokens` from position `start` (as the engine counts it)."""
    return tokens * (start + (tokens + 1) // 2)


class StepCostModel:
    def __init__(
        self, window: int = 2000, min_samples: int = 12, refit_seconds: float = 1.0, min_each: int = 4
    ) -> None:
        self.min_samples = min_samples
        self.min_each = min_each
        self._samples: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        # The window's normal equations, kept as steps come and go, so that a fit solves a 5 x 5
        # system instead of summing the window again (summing the window was 17% of a simulated
        # hour's time, and milliseconds of the router's loop a second). Summed anew from the
        # window every `window` evictions, so rounding cannot drift.
        self._normal = _NormalEquations()
        self._evicted = 0
        self._with_prompt = 0  # samples in the window with prompt tokens
        self._with_streams = 0  # ... and with decode streams
        self.largest_prompt_step = 0  # the most prompt tokens of any step it was given
        self._coef: tuple[float, ...] | None = None
        self._dirty = False
        # At most one fit a second: each refit changes the predictions path choice makes and the
        # stall margin is reckoned again per fit (busy workers report steps every few ms).
        self.refit_seconds = refit_seconds
        self._fitted_at = -math.inf
        # The last mixed steps (prompt tokens beside decode streams): (features, seconds).
        self._mixed: deque[tuple[tuple[float, ...], float]] = deque(maxlen=MIXED_WINDOW)
        self._fits = 0  # how many fits so far: a margin is reckoned once per fit and mixed step
        self._margin_for: tuple[int, int, float] | None = None  # (fits, mixed steps seen, quantile)
        self._mixed_seen = 0
        self._margin = 1.0
        # The ratios observed / predicted of the mixed steps, by fit `_ratios_fit`, up to the
        # `_ratios_seen`-th mixed step: a refit reckons them all again, a new step only its own
        # (all 200 a path choice were 9% of a simulated hour's time).
        self._ratios: deque[float | None] = deque(maxlen=MIXED_WINDOW)
        self._ratios_fit = -1
        self._ratios_seen = 0

    def add(self, step: Step, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            features = step.features()
            if len(self._samples) == self._samples.maxlen:
                leaving = self._samples[0]  # about to fall out of the window
                self._count(leaving[0], -1)
                self._normal.add(*leaving, sign=-1.0)
                self._evicted += 1
            self._normal.add(features, seconds)
            if step.prefill_tokens and step.decode_streams:
                self._mixed.append((features, seconds))
                self._mixed_seen += 1
            self.largest_prompt_step = max(self.largest_prompt_step, step.prefill_tokens)
            self._samples.append((features, seconds))
            if self._evicted >= len(self._samples):
                self._normal = _NormalEquations.of(self._samples)
                self._evicted = 0
            self._count(features, 1)
            self._dirty = True

    def _count(self, features: tuple[float, ...], sign: int) -> None:
        self._with_prompt += sign * (features[1] > 0)
        self._with_streams += sign * (features[3] > 0)

    def mixed_step_margin(self, quantile: float = 0.9) -> float:
        """How much longer than the fit of the moment predicts the recent steps with prompt tokens
        beside decode streams ran (this quantile of observed / predicted; never below 1, and 1
        until MIXED_MIN_SAMPLES of them were seen or while the model is not `ready`)."""
        if len(self._mixed) < MIXED_MIN_SAMPLES or self.coefficients() is None:
            return 1.0
        key = (self._fits, self._mixed_seen, quantile)
        if self._margin_for != key:  # a path choice a request: reckoned again only when it can change
            ratios = [ratio for ratio in self._mixed_ratios() if ratio is not None]
            enough = len(ratios) >= MIXED_MIN_SAMPLES
            self._margin = max(1.0, slo.quantile(ratios, quantile) or 1.0) if enough else 1.0
            self._margin_for = key
        return self._margin

    def _mixed_ratios(self) -> deque[float | None]:
        """observed / predicted by the fit of the moment for each recent mixed step (None where it
        predicts nothing): all of them again after a refit, else only the steps new since."""
        assert self._coef is not None
        coef = self._coef
        if self._ratios_fit != self._fits:
            self._ratios.clear()
            self._ratios_seen = self._mixed_seen - len(self._mixed)
            self._ratios_fit = self._fits
        new = min(self._mixed_seen - self._ratios_seen, len(self._mixed))  # (more may have come and gone)
        c0, c1, c2, c3, c4 = coef
        for (x0, x1, x2, x3, x4), seconds in itertools.islice(self._mixed, len(self._mixed) - new, None):
            predicted = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3 + c4 * x4
            self._ratios.append(seconds / predicted if predicted > 0 else None)
        self._ratios_seen = self._mixed_seen
        return self._ratios

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def ready(self) -> bool:
        return (
            len(self._samples) >= self.min_samples
            and self._with_prompt >= self.min_each
            and self._with_streams >= self.min_each
        )

    def coefficients(self) -> tuple[float, ...] | None:
        """(c0 .. c4) in seconds per unit of each raw feature; None before `ready`."""
        if not self.ready:
            return None
        now = clock.monotonic()
        if self._coef is None or (self._dirty and now - self._fitted_at >= self.refit_seconds):
            self._coef = _fit_non_negative(self._normal)
            self._dirty = False
            self._fitted_at = now
            self._fits += 1
        return tuple(c * s for c, s in zip(self._coef, _SCALE, strict=True))

    def step_seconds(self, step: Step) -> float:
        coef = self.coefficients()
        if coef is None:
            raise RuntimeError("the cost model has too few samples to predict (check `ready`)")
        return _seconds(
            coef, step.prefill_tokens, step.prefill_attention, step.decode_streams, step.decode_context
        )

    # -- predictions built on steps -----------------------------------------------------------------
    def prefill_finish_seconds(
        self,
        prompt_tokens: int,
        ahead: Sequence[int],
        *,
        chunk: int,
        budget: int,
        short_first: bool,
        decode_streams: int = 0,
        decode_context: int = 0,
        max_steps: int = 400,
        interrupts: bool = False,
        cached: int = 0,
    ) -> tuple[float, float]:
        """(seconds until a new prompt of `prompt_tokens` has its first token, the longest step on
        the way) on a worker with the prompts `ahead` (remaining tokens, oldest first) still to
        prefill and `decode_streams` streams decoding in every step.

        Follows the engine's scheduler: every step each prompt takes up to `chunk` tokens, oldest
        first, within `budget` tokens; the prefill role (`short_first`) runs waiting prompts of at
        most one chunk in a step of their own first. The step in progress is half done, unless
        the worker `interrupts` it for such a prompt: between two layers, when the prompt is
        shorter than what each prompt ahead still has left (then it waits for no step). The
        first `cached` tokens of the prompt are in the worker's prefix cache: only the rest is
        computed (attending to them), as the engine does."""
        remaining = [t for t in ahead if t > 0]
        new = max(1, prompt_tokens)
        cached = min(max(0, cached), new - 1)
        todo = new - cached
        elapsed = longest = 0.0
        jumps_in = (
            interrupts
            and short_first
            and todo <= chunk
            and all(t - min(chunk, t) / 2 > todo for t in remaining)
        )
        if (remaining or decode_streams) and not jumps_in:  # a step is running when the request arrives
            first = _first_step(remaining, chunk, budget, decode_streams, decode_context)
            elapsed = 0.5 * self.step_seconds(first)
        if short_first and todo <= chunk:
            shorts = [t for t in remaining if t <= chunk]  # short ones ahead go in the same step
            attention = sum(chunk_attention(0, t) for t in shorts) + chunk_attention(cached, todo)
            seconds = self.step_seconds(Step(sum(shorts) + todo, attention))
            return elapsed + seconds, seconds
        coef = self.coefficients()
        if coef is None:
            raise RuntimeError("the cost model has too few samples to predict (check `ready`)")
        # [done, total] of each prompt still to prefill, oldest first; the new one last. The prompts
        # done at the head leave (this loop runs for every path choice, over queues of dozens); one
        # done behind an unfinished one takes no more tokens until it reaches the head.
        queue = deque([[0, total] for total in remaining])
        queue.append([cached, new])
        mine = queue[-1]
        tokens = 0
        seconds = 0.0
        for _ in range(max_steps):
            tokens = attention = 0
            left = budget - decode_streams
            for prompt in queue:
                if left <= 0:
                    break
                done, total = prompt
                take = min(chunk, total - done, left)
                tokens += take
                attention += take * (done + (take + 1) // 2)  # chunk_attention(done, take)
                prompt[0] = done + take
                left -= take
            seconds = _seconds(coef, tokens, attention, decode_streams, decode_context)
            elapsed += seconds
            longest = max(longest, seconds)
            if mine[0] >= new:
                return elapsed, longest
            while queue[0][0] >= queue[0][1]:  # (the new one, unfinished, is last)
                queue.popleft()
        # Past max_steps (a very deep queue): the rest at the rate of the last step.
        left_tokens = sum(total - done for done, total in queue)
        return elapsed + left_tokens / max(1, tokens) * seconds, longest

    def prefill_alone_seconds(self, prompt_tokens: int, chunk: int, budget: int, cached: int = 0) -> float:
        """A prompt's own prefill time on an idle worker (with `cached` of its tokens in its prefix
        cache): what no number of workers can shorten."""
        return self.prefill_finish_seconds(
            prompt_tokens, (), chunk=chunk, budget=budget, short_first=False, cached=cached
        )[0]

    def decode_step_seconds(self, streams: int, context_per_stream: float) -> float:
        return self.step_seconds(Step(0, 0, streams, round(streams * context_per_stream)))

    def largest_chunk_within(
        self, step_s: float, prompt_tokens: int, decode_streams: int, decode_context: int, limit: int
    ) -> int:
        """The most tokens per step (at most `limit`) that a prompt of `prompt_tokens` can take
        beside `decode_streams` streams with every step within `step_s` (0 if not even one token).
        Its last chunk is the dearest (it attends to the whole prompt before it), so that is the
        one checked; the step grows with the chunk, so a bisection finds it. Never more than
        twice the largest prompt step the model has seen: it is not trusted far beyond its data."""
        return _largest(
            min(limit, prompt_tokens, 2 * self.largest_prompt_step),
            lambda n: (
                self.step_seconds(
                    Step(n, chunk_attention(prompt_tokens - n, n), decode_streams, decode_context)
                )
                <= step_s
            ),
        )

    def chunk_within(self, step_s: float, base: Step, start: int, limit: int) -> int:
        """The most tokens (at most `limit`) of a prompt chunk from position `start` that a step
        already holding `base` can take and stay within `step_s` (0 if not even one). Bisection:
        the step grows with the chunk. Never more than twice the largest prompt step seen."""

        def fits(n: int) -> bool:
            step = Step(
                base.prefill_tokens + n,
                base.prefill_attention + chunk_attention(start, n),
                base.decode_streams,
                base.decode_context,
            )
            return self.step_seconds(step) <= step_s

        return _largest(min(limit, 2 * self.largest_prompt_step), fits)

    def max_streams_within(self, itl_s: float, context_per_stream: float, limit: int) -> int:
        """The most streams one worker can decode with a step of at most `itl_s` (0 if not even one)."""
        return _largest(limit, lambda n: self.decode_step_seconds(n, context_per_stream) <= itl_s)


def _seconds(coef: tuple[float, ...], tokens: int, attention: int, streams: int, context: int) -> float:
    """A step's time by the coefficients (c0 .. c4 per raw feature), summed in the features' order."""
    c0, c1, c2, c3, c4 = coef
    return c0 + c1 * tokens + c2 * attention + c3 * streams + c4 * context


def _largest(high: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [0, high] with fits(n), for a `fits` true up to some n and false after
    (0 when not even 1 fits): a bisection."""
    low, high = 0, max(0, high)
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _first_step(
    remaining: list[int], chunk: int, budget: int, decode_streams: int, decode_context: int
) -> Step:
    """The step a worker is running when a request arrives: a chunk of each prompt ahead."""
    tokens = attention = 0
    left = budget - decode_streams
    for total in remaining:
        if left <= 0:
            break
        take = min(chunk, total, left)
        tokens += take
        attention += chunk_attention(0, take)
        left -= take
    return Step(tokens, attention, decode_streams, decode_context)


def pool_wait_quantile(
    arrival_rate: float, service_seconds: float, workers: int, p: float, service_cv2: float = 1.0
) -> float:
    """The p-quantile of the wait before service in a pool of `workers`, each a single-server queue
    with an even share of `arrival_rate` (requests/s), a mean service time of `service_seconds`
    and a squared coefficient of variation of it of `service_cv2` (1: exponential, M/M/1; 0: all
    alike). Mean wait from the Pollaczek-Khinchine formula, W = rho/(1-rho) * S * (1+cv2)/2; its
    tail exponential, P(W > t) = rho * exp(-t rho / W) (exact for M/M/1). inf when the pool
    cannot keep up."""
    if arrival_rate <= 0 or service_seconds <= 0:
        return 0.0
    if workers < 1:
        return math.inf
    rho = arrival_rate * service_seconds / workers
    if rho >= 1.0:
        return math.inf
    if rho <= 1.0 - p:
        return 0.0
    mean_if_waiting = service_seconds * (1.0 + service_cv2) / (2.0 * (1.0 - rho))  # W / rho
    return mean_if_waiting * math.log(rho / (1.0 - p))


def workers_for_wait(
    arrival_rate: float,
    service_seconds: float,
    p: float,
    wait_budget_s: float,
    max_utilisation: float = 0.9,
    service_cv2: float = 1.0,
) -> int:
    """The fewest workers whose p-quantile wait is within `wait_budget_s` and whose utilisation
    stays at most `max_utilisation` (0 when there is no demand)."""
    if arrival_rate <= 0 or service_seconds <= 0:
        return 0
    k = max(1, math.ceil(arrival_rate * service_seconds / max_utilisation))
    while pool_wait_quantile(arrival_rate, service_seconds, k, p, service_cv2) > wait_budget_s and k < 10_000:
        k += 1
    return k


def fit_step_time(samples: Sequence[tuple[Step, float]]) -> tuple[float, ...]:
    """(c0 .. c4), in seconds per unit of each raw feature, fitted to measured steps by least
    squares on the relative error (each step weighs the same, a 10 ms decode step as much as a
    1 s prompt), every coefficient >= 0. `pdserve profile` fits its step times with it."""
    weighted = [
        (tuple(x / seconds for x in step.features()), 1.0)
        for step, seconds in samples
        if seconds > 0 and math.isfinite(seconds)
    ]
    if not weighted:
        raise ValueError("no step with a positive time to fit")
    coef = _fit_non_negative(_NormalEquations.of(weighted))
    return tuple(c * s for c, s in zip(coef, _SCALE, strict=True))


class _NormalEquations:
    """Sums of x x^T and x y over samples (x the scaled features, y the seconds): what a least
    squares fit needs of them."""

    def __init__(self) -> None:
        width = len(_SCALE)
        self.xx = [[0.0] * width for _ in range(width)]
        self.xy = [0.0] * width
        self.count = 0

    @classmethod
    def of(cls, samples: Iterable[tuple[tuple[float, ...], float]]) -> _NormalEquations:
        sums = cls()
        for features, y in samples:
            sums.add(features, y)
        return sums

    def add(self, features: tuple[float, ...], y: float, sign: float = 1.0) -> None:
        for r, xr in enumerate(features):
            if xr:
                weighted = sign * xr
                self.xy[r] += weighted * y
                row = self.xx[r]
                for c, xc in enumerate(features):
                    row[c] += weighted * xc
        self.count += 1 if sign > 0 else -1


def _fit_non_negative(sums: _NormalEquations) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0 (active set: drop the most negative, refit)."""
    active = list(range(len(_SCALE)))
    while True:
        coef = _least_squares(sums, active)
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))
        if not active:
            return tuple(0.0 for _ in _SCALE)


def _least_squares(sums: _NormalEquations, active: list[int]) -> tuple[float, ...]:
    ata = [[sums.xx[r][c] for c in active] for r in active]
    atb = [sums.xy[r] for r in active]
    for slot in range(len(active)):
        ata[slot][slot] += _RIDGE * sums.count
    solution = _solve(ata, atb)
    coef = [0.0] * len(_SCALE)
    for slot, i in enumerate(active):
        coef[i] = solution[slot]
    return tuple(coef)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (n <= 5). A singular column gets weight 0."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            continue
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col] != 0.0:
                factor = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-15 else 0.0 for i in range(n)]
