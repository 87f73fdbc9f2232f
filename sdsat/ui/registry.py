"""The page's models: loaded once, on first use, and shared read-only by every visitor.

Only names from the operator's list can be loaded, and never with `trust_remote_code`.
"""

from __future__ import annotations

import logging
import threading
import time

from .. import hardware
from ..compute import ComputeStopped, compute_thread
from ..engine import Activity, Engine
from ..errors import first_line
from ..models import LoadConfig, ModelLoadError
from ..tuning import TuneProgress
from .settings import Limits, SettingError
from .zerogpu import on_zero_gpu

log = logging.getLogger(__name__)


class EngineCache:
    """Engines keyed by the operator's model names; each loads at most once, then is shared.

    A model that fails to load is not retried for `limits.load_retry_s` seconds: requests in that
    window (and those that were waiting for the failed load) get its reason at once instead of
    queueing behind another slow failure; the first request after it tries again.
    """

    def __init__(self, limits: Limits):
        self.limits = limits
        self._engines: dict[str, Engine] = {}
        self._locks = {name: threading.Lock() for name in limits.models}
        self._failures: dict[str, tuple[float, ModelLoadError]] = {}  # name -> (when, why) of its last failed load
        self.activity = Activity()  # the decodes of every model here: a tuning behind the page waits for all of them

    def add(self, engine: Engine) -> None:
        """Share an engine loaded elsewhere (tests, a start-up script); its name must be on the list."""
        if engine.name not in self._locks:
            raise SettingError(f"model {engine.name!r} is not on the operator's list: {', '.join(self.limits.models)}")
        self._engines[engine.name] = engine

    def is_loaded(self, name: str) -> bool:
        return isinstance(name, str) and name in self._engines

    def failure(self, name: str) -> str | None:
        """Why `name` last failed to load, while that failure stands; None otherwise."""
        recorded = self._failures.get(name) if isinstance(name, str) else None
        return str(recorded[1]) if recorded else None

    def get(self, name: str, warm_up: bool = True) -> Engine:
        """The engine for `name`, loading it on first use; with `warm_up`, it also settles auto's plan for this
        machine (`_settle`: the tuning kept on disk, else one measured behind the page) and runs a few tokens.

        Raises:
            SettingError: `name` is not on the operator's list.
            ModelLoadError: the operator listed a model that cannot be loaded (now or in the last
                `load_retry_s` seconds).
        """
        if not isinstance(name, str) or name not in self._locks:  # API callers may send any JSON value
            raise SettingError(f"model must be one of: {', '.join(self.limits.models)} (set by the operator); "
                               f"got {name!r}")
        if name in self._engines:
            return self._engines[name]
        self._raise_recent_failure(name)
        with self._locks[name]:
            if name not in self._engines:
                self._raise_recent_failure(name)
                # on the compute thread, as all of the server's torch work (compute.py); a visitor waits for it,
                # so it is urgent: a measurement under way pauses for it
                self._engines[name] = compute_thread().run(self._load, name, warm_up, urgent=True)
        return self._engines[name]

    def _load(self, name: str, warm_up: bool) -> Engine:
        config = LoadConfig(model=name, device=self.limits.device, dtype=self.limits.dtype,
                            quantization=self.limits.quantization, trust_remote_code=False, measure_kernels=False)
        try:
            engine = Engine.load(config)
            engine.activity = self.activity
            if warm_up:
                self._settle(engine)
                engine.warm_up()
        except Exception as err:  # whatever breaks a load, the server keeps serving and says why
            error = err if isinstance(err, ModelLoadError) else ModelLoadError(
                f"cannot load model {name!r}: {type(err).__name__}: {first_line(err)}")
            self._failures[name] = (time.monotonic(), error)
            log.warning("%s (the server keeps serving; a request after %g s tries again)", error,
                        self.limits.load_retry_s, exc_info=not isinstance(err, (ModelLoadError, OSError)))
            raise error from err
        self._failures.pop(name, None)
        return engine

    def _raise_recent_failure(self, name: str) -> None:
        recorded = self._failures.get(name)
        if recorded and time.monotonic() - recorded[0] < self.limits.load_retry_s:
            raise recorded[1]



    def _settle(self, engine: Engine) -> None:
        """auto's plan for this machine: the tuning kept on disk (measured under load: measured again behind the
        page once the machine is quiet), else the fallback form now and a tuning behind the page (`_tune_behind`).
        A model too large to load twice is measured before it serves. On ZeroGPU, where nothing may run on
        the GPU outside a request, the machine is not measured at all."""
        if on_zero_gpu():
            return
        try:
            if engine.use_stored_tuning():
                if any(engine.tuning.noisy.values()) and engine.can_twin and self.limits.quiet_wait_s > 0:
                    self._tune_behind(engine, "noisy", when_quiet=True)
            elif engine.can_twin:
                self._tune_behind(engine, "missing")
            else:
                engine.tune()
        except Exception as err:  # the model still decodes; only auto's plan is missing
            log.warning("could not measure the pass costs of %s (%s: %s); auto keeps its default settings",
                        engine.name, type(err).__name__, first_line(err), exc_info=True)

    def _tune_behind(self, engine: Engine, remeasure: str, when_quiet: bool = False) -> None:
        """Measure this machine on a second copy of the model, between requests (on the compute thread, where a
        visitor's decode runs between two measurements rather than beside one); then
        that copy, tuned and warmed up, replaces `engine` in the cache. A request that already holds `engine`
        (a race under way) finishes on it, with the settings it started with."""
        shown = engine.tuning is None  # a kept plan measured again stays in use: nothing to show meanwhile
        if shown:
            engine.measuring = TuneProgress(label="loading a second copy of the model to measure")

        compute = compute_thread()

        def between_requests(state: TuneProgress) -> None:
            if shown:
                engine.measuring = state
            compute.serve_urgent()  # the visitors who came during the last step decode first
            engine.activity.wait_idle()

        def job() -> None:  # waits here; the torch work runs on the compute thread, between requests
            try:
                if when_quiet and not _wait_quiet(engine, self.limits.quiet_wait_s):
                    log.info("the machine stayed busy: the measurement taken under load stays in use")
                    return
                engine.activity.wait_idle()
                twin = compute.run(engine.twin)
                compute.run(twin.tune, remeasure, on_step=between_requests)
                compute.run(twin.warm_up)
                with self._locks[engine.name]:  # unless the engine was replaced or its load failed meanwhile
                    if self._engines.get(engine.name) is engine:
                        self._engines[engine.name] = twin
            except ComputeStopped:  # the process is exiting
                pass
            except Exception as err:  # the engine serving now keeps its fallback settings
                log.warning("could not measure the pass costs of %s (%s: %s); auto keeps its fallback settings",
                            engine.name, type(err).__name__, first_line(err), exc_info=True)
            finally:
                engine.measuring = None

        threading.Thread(target=job, name=f"sdsat-tuning-{engine.name}", daemon=True).start()


def _wait_quiet(engine: Engine, limit_s: float, every_s: float = 10.0) -> bool:
    """Wait (at most `limit_s`) until the machine is quiet: no request of ours decoding, and a load average
    that leaves the cores free. True when it is."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not engine.activity.busy and hardware.machine_is_quiet():
            return True
        time.sleep(every_s)
    return False


def max_context(engine: Engine) -> int | None:
    """The model's context length, where its config states one."""
    value = getattr(engine.model.config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
