"""`pagedserve serve`: the three ports over the model registry, until SIGTERM or SIGINT.

Start: refuse an insecure configuration (token authorization off on a non-loopback address
without --allow-insecure), choose the keys (given, kept from the key file, or generated), open
the startup archives (a bad one stops the start with a clear error), then listen on the
inference, management and metrics addresses, each with its connection limits
(pagedserve.server.serving.connections), and only then write the key file (a start that cannot bind its ports
leaves a running server's key file alone). The inference app's `cleanup_ctx` (`lifecycle`)
owns the registry, the workers and the thread pool: on start it restores the snapshot and
registers the `load_models` archives in the background (the ports already answer; /ready turns
200 once every version that should serve has a ready worker); on stop it stops them.

Stop (SIGTERM or SIGINT): new requests get 503 with Retry-After; in-flight ones get up to
`drain_grace` seconds to finish (the drain's event fires when the last one ends); those left
are cut with an error reply (a stream: an error event, then `[DONE]`); the workers stop while
the ports still answer 503; then the ports close, exit 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from pagedserve.server.app.inference import build_inference_app, shape_for_path
from pagedserve.server.app.startup import check_secure, startup_models
from pagedserve.server.common.auth import KeyStore, choose_keys, write_key_file
from pagedserve.server.common.config import ServerConfig, ServerConfigError, parse_address
from pagedserve.server.console.app import sign_in_line
from pagedserve.server.management.app import build_management_app
from pagedserve.server.metrics.families import ServerMetrics, build_metrics_app
from pagedserve.server.serving.connections import ConnectionLimits, GuardedAppRunner, PathShape
from pagedserve.server.serving.state import Drain, ServerState
from pagedserve.server.workers.adapters import is_adapter
from pagedserve.server.workers.archives import LoadedArchive, resolve_url
from pagedserve.server.workers.devices import assign_devices, cuda_visible_devices, visible_gpus
from pagedserve.server.workers.lifecycle import BudgetCollector
from pagedserve.server.workers.pool import WorkerStartFailed
from pagedserve.server.workers.registry import ModelRegistry, worker_threads
from pagedserve.server.workers.rules import ConflictError
from pagedserve.server.workers.snapshot import Snapshotter
from pagedserve.server.workers.version import EngineBuilder, ModelVersion

if TYPE_CHECKING:
    from pagedserve.engine.core.async_llm import AsyncLLM

logger = logging.getLogger("pagedserve")

CUT_WAIT_S = 5.0  # for the requests cut after drain_grace to send their error replies


def build_state(config: ServerConfig, make_engine: EngineBuilder, keys: KeyStore | None) -> ServerState:
    """The state the three apps share: registry (no worker yet), metrics, thread pool, keys."""
    executor = ThreadPoolExecutor(config.frontend_threads, thread_name_prefix="pagedserve-fe")
    registry = ModelRegistry(
        executor,
        make_engine,
        allow_custom_handlers=config.allow_custom_handlers,
        default_workers=config.default_workers_per_model,
        job_queue_size=config.job_queue_size,
        memory_budget=config.memory_budget,
        keep_alive=config.keep_alive,
        kv_offload=config.kv_offload,
    )
    metrics = ServerMetrics(versions=registry.all_versions, vllm=config.vllm_metrics)
    metrics.registry.register(BudgetCollector(registry.lifecycle))
    return ServerState(
        config=config,
        registry=registry,
        metrics=metrics,
        keys=keys,
        executor=executor,
        drain=Drain(max_per_client=config.max_in_flight_per_client),
    )


def connection_limits(config: ServerConfig, shape: PathShape | None = None) -> ConnectionLimits:
    limits = ConnectionLimits(
        header_timeout=config.header_read_timeout,
        body_timeout=config.body_read_timeout,
        max_connections=config.max_connections,
        per_client_connections=config.max_connections_per_client,
    )
    if shape is not None:
        limits.shape = shape
    return limits


def _path_shape(port: str) -> PathShape | None:
    """The error shape of aiohttp's own replies (parser errors) on `port`, by the path named."""
    return shape_for_path if port == "inference" else None  # else TorchServe's


class Server:
    """One `pagedserve serve` run: state, apps, runners."""

    def __init__(self, config: ServerConfig, out: Callable[[str], None] = print) -> None:
        self.config = config
        self.out = out
        self.state: ServerState | None = None
        self.runners: list[web.AppRunner] = []
        self.ports: dict[str, int] = {}  # "inference" / "management" / "metrics" -> bound port
        self.snapshot = Snapshotter(config.snapshot_path) if config.snapshot_path else None
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._startup: asyncio.Task | None = None  # the startup registrations
        self._workers_stopped = False

    # -- start ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Listen on the three ports; the startup registrations go on in the background."""
        config = self.config
        check_secure(config)
        models = startup_models(config)  # errors here stop the start before anything listens
        keys, write_keys = None, False
        if not config.disable_token_auth:
            try:
                chosen, write_keys = choose_keys(
                    config.key_file,
                    inference=config.inference_key,
                    management=config.management_key,
                    keep_key_file=config.keep_key_file,
                )
            except ValueError as exc:
                raise ServerConfigError(str(exc)) from None
            keys = KeyStore(chosen, Path(config.key_file).expanduser().absolute())
        self.state = state = build_state(config, self._make_engine, keys)
        if self.snapshot is not None:
            self.snapshot.adapters = state.adapters
        restored = self.snapshot.load() if self.snapshot and config.restore_snapshot else []
        opened = [(m, await state.registry.open(m.path)) for m in models]

        async def lifecycle(app: web.Application) -> AsyncIterator[None]:
            self._startup = asyncio.create_task(self._register_at_start(restored, opened))
            yield
            await self._stop_workers()
            state.executor.shutdown(wait=False, cancel_futures=True)
            state.limits.shutdown()

        apps = {
            "inference": build_inference_app(state, contexts=[lifecycle]),
            "management": build_management_app(state),
            "metrics": build_metrics_app(state.metrics),
        }
        for name, app in apps.items():
            host, port = parse_address(getattr(config, f"{name}_address"))
            runner = GuardedAppRunner(
                app, connection_limits(config, _path_shape(name)), access_log=None, shutdown_timeout=2.0
            )
            await runner.setup()
            self.runners.append(runner)
            await web.TCPSite(runner, host, port).start()
            port = runner.addresses[0][1]  # the real one when 0 was asked
            self.ports[name] = state.ports[name] = port
            self.out(f"pagedserve: {name} API listening on http://{host}:{port}")
        if keys is not None:
            if write_keys:  # only now that every port is ours
                write_key_file(keys.path, keys.keys)
            self.out(
                f"pagedserve: token authorization on; keys in {keys.path} "
                f"({'written' if write_keys else 'kept'}; send 'Authorization: Bearer <key>')"
            )
        else:
            self.out("pagedserve: token authorization is OFF (--disable-token-auth)")
        # The keys ride in the fragment, which the browser keeps to itself; printed with them
        # only to a terminal unless told (stdout under a service manager is a log).
        with_keys = config.console_link_keys
        self.out(sign_in_line(state, sys.stdout.isatty() if with_keys is None else with_keys))

    def _started(self) -> ServerState:
        """The server's state, built by `start`."""
        if self.state is None:
            raise RuntimeError("the server is not started")
        return self.state

    async def _register_at_start(self, restored, opened) -> None:
        """The snapshot's models, then the `load_models` archives (the lifecycle's task)."""
        registry = self._started().registry
        registry.on_change = self._rebalance_threads
        registry.lifecycle.progress = self.out  # a line per worker ready while starting
        try:
            await self._restore(restored)
            models = [(m, a) for m, a in opened if not is_adapter(a)]
            await asyncio.gather(
                *(self._register_startup(archive, model.url, model.name) for model, archive in models)
            )  # in parallel, in the budget
            # LoRA adapters once their base versions are there: the snapshot's, then --models'
            if self.snapshot is not None:
                for e in self.snapshot.adapter_entries:
                    await self._restore_adapter(e)
            for model, archive in opened:
                if is_adapter(archive):
                    await self._register_adapter(archive, model.url, model.name)
        except Exception:  # a bug: the server keeps serving what did register
            logger.exception("the startup registrations failed")
        self._save_snapshot()
        if self.snapshot is not None:  # from now on each change is saved before it is made
            registry.persist = lambda: self.snapshot.save(registry)
        registry.startup_done = True
        self.out(f"pagedserve: ready ({len(registry.all_versions())} model version(s) registered)")

    async def _restore(self, entries) -> None:
        """Every snapshot entry at once: workers start in parallel, within the memory budget."""
        await asyncio.gather(*(self._restore_one(e) for e in entries))

    async def _restore_one(self, e) -> None:
        registry = self._started().registry
        store = self.config.model_store_path
        try:
            path = resolve_url(e.url, store, self.config.allowed_urls)
            archive = await registry.open(path, chat_template=e.chat_template)
            try:
                entry = await registry.register(
                    archive,
                    url=e.url,
                    name=e.name,
                    initial_workers=e.min_workers,
                    max_workers=e.max_workers,
                    synchronous=True,
                    make_default=e.default,
                )
            except WorkerStartFailed as exc:
                # Registered all the same: its workers keep retrying with back-off
                # (describe shows lastError) rather than the registration being lost.
                logger.error(
                    "snapshot: workers of %s %s failed to start (%s); retrying in the background",
                    e.name,
                    e.version,
                    exc,
                )
                entry = await registry.register(
                    archive,
                    url=e.url,
                    name=e.name,
                    initial_workers=e.min_workers,
                    max_workers=e.max_workers,
                    synchronous=False,
                    make_default=e.default,
                )
            entry.loaded_at_startup = True
            await registry.lifecycle.restore(entry, e.state, e.pinned)
            self.out(f"pagedserve: restored {e.name} {e.version} from the snapshot")
        except (OSError, ValueError, RuntimeError) as exc:
            logger.error(
                "snapshot: could not restore %s %s: %s; it stays in the snapshot for the next start",
                e.name,
                e.version,
                exc,
            )
            if self.snapshot is not None:  # (entries come from it)
                self.snapshot.carry(e)

    async def _restore_adapter(self, e) -> None:
        try:
            path = resolve_url(e.url, self.config.model_store_path, self.config.allowed_urls)
            archive = await self._started().registry.open(path)
            if not is_adapter(archive):
                raise ValueError(f"{e.url} is not a LoRA adapter archive")
            await self._register_adapter(archive, e.url, e.name, quiet=False)
        except (OSError, LookupError, ValueError, RuntimeError) as exc:
            logger.error(
                "snapshot: could not restore adapter %s: %s; it stays in the snapshot for the next start", e.name, exc
            )
            if self.snapshot is not None:
                self.snapshot.carry_adapter(e)

    async def _register_adapter(self, archive: LoadedArchive, url: str, name: str | None, quiet: bool = True) -> None:
        """A LoRA adapter onto its base version (given with --models, or from the snapshot)."""
        try:
            adapter = await self._started().adapters.register(self._started().registry, archive, url, name)
        except ConflictError:
            logger.info("adapter %s is already registered", name or archive.name)
            return
        except (LookupError, ValueError) as exc:
            if not quiet:
                raise
            logger.error("adapter %s: %s", name or archive.name, exc)
            return
        self.out(
            f"pagedserve: registered adapter {adapter.name} on {adapter.base.name} {adapter.base.version} from {url}"
        )

    async def _register_startup(self, archive: LoadedArchive, url: str, name: str | None) -> None:
        try:
            entry = await self._started().registry.register(
                archive, url=url, name=name, synchronous=True, loaded_at_startup=True
            )
        except ConflictError:
            logger.info("%s %s is already registered (snapshot)", name or archive.name, archive.version)
            return
        except WorkerStartFailed as exc:
            logger.error("model %s: workers failed to start: %s", name or archive.name, exc)
            return
        self.out(f"pagedserve: registered {entry.name} {entry.version} ({entry.min_workers} worker(s)) from {url}")

    def _make_engine(self, entry: ModelVersion, worker_name: str, on_dead) -> AsyncLLM:
        from pagedserve.engine.config.engine import EngineConfig
        from pagedserve.engine.core.async_llm import AsyncLLM
        from pagedserve.engine.model.model_config import DeviceType

        options = entry.model_config.engine_options()
        options["num_threads"] = self._worker_threads(entry)
        if self.config.kv_offload is not None and "kv_offload" not in options:
            if options.get("tensor_parallel_size", 1) == 1:
                options["kv_offload"] = self.config.kv_offload
            else:  # the server-wide default does not apply to a tensor-parallel model
                logger.warning("%s: kv_offload is not used with tensor parallelism", worker_name)
        if entry.model_config.device_type is DeviceType.GPU:
            options["device"] = "cuda"
            slot = next((s for s in entry.pool.slots if worker_name.endswith(f"#{s.id}")), None)
            if slot is not None:  # its own GPUs: round-robin, a TP group on consecutive ones
                slot.devices = assign_devices(
                    slot.index, visible_gpus(), entry.model_config.device_ids, options.get("tensor_parallel_size", 1)
                )
                options["visible_devices"] = cuda_visible_devices(slot.devices)
        # The registry opened and verified the archive (custom handler rules included).
        config = EngineConfig(model=str(entry.model_dir), model_verified=True, **options)
        return AsyncLLM(
            config,
            entry.tokenizer,
            name=worker_name,
            on_dead=on_dead,
            heartbeat_timeout=self.config.worker_heartbeat_timeout,
        )

    def _worker_threads(self, entry: ModelVersion) -> int:
        """Torch threads for a worker of `entry`: its model-config's num_threads, else the
        server's worker_threads, else an even share of the cores among all workers."""
        configured = entry.model_config.engine_options().get("num_threads")
        if configured is not None:
            return configured
        return worker_threads(self.config.worker_threads, self._started().registry.total_workers())

    def _rebalance_threads(self) -> None:
        """Size the ready workers again when their number changed: a worker sized for fewer
        neighbours would oversubscribe the cores."""
        from pagedserve.engine.core.async_llm import EngineDeadError

        if self.state is None:
            return
        for version in self.state.registry.all_versions():
            threads = self._worker_threads(version)
            for engine in version.workers():
                if engine.num_threads != threads:
                    with contextlib.suppress(EngineDeadError):  # found dead: restarted sized anew
                        engine.set_num_threads(threads)

    def _save_snapshot(self) -> None:
        if self.snapshot is None or self.state is None:
            return
        try:
            self.snapshot.save(self.state.registry)
        except OSError as exc:
            logger.error("could not write the snapshot %s: %s", self.snapshot.path, exc)

    # -- run and stop --------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():
            self._force.set()
            return
        self.out(
            f"pagedserve: {signal.Signals(sig).name}: draining (up to "
            f"{self.config.drain_grace:g}s for requests in flight)"
        )
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        """The shutdown sequence (docs/operations.md): readiness turns 503 and new requests get
        503 with Retry-After; requests in flight get up to drain_grace seconds (or until a
        second signal) to finish; those still running are cut (a stream ends with an error
        event and `[DONE]`, a whole reply is a 503); the workers stop; only then do the ports
        close, so that a load balancer sees a draining port, never a refused one, until exit."""
        state = self.state
        if state is not None:
            state.drain.begin()
            idle = asyncio.ensure_future(state.drain.wait_idle(self.config.drain_grace))
            force = asyncio.ensure_future(self._force.wait())
            await asyncio.wait({idle, force}, return_when=asyncio.FIRST_COMPLETED)
            force.cancel()
            if state.drain.in_flight:
                self.out(f"pagedserve: aborting {state.drain.cut()} request(s) still in flight")
                await state.drain.wait_idle(CUT_WAIT_S)  # their error replies go out
            await self._stop_workers()
        for runner in reversed(self.runners):
            await runner.cleanup()
        if self.runners:
            self.out("pagedserve: stopped")
        self.runners.clear()

    async def _stop_workers(self) -> None:
        """Cancel the startup registrations and stop every worker (once)."""
        if self._workers_stopped or self.state is None:
            return
        self._workers_stopped = True
        if self._startup is not None:
            self._startup.cancel()
            await asyncio.gather(self._startup, return_exceptions=True)
        await self.state.registry.shutdown()


async def serve(config: ServerConfig) -> int:
    server = Server(config)
    server.install_signal_handlers()
    try:
        await server.start()  # a failed start raises here
        await server.wait()
    finally:
        await server.stop()
    return 0


def run_serve(config: ServerConfig) -> int:
    """Run in the foreground until SIGTERM/SIGINT. The front end does not import torch (only to
    ask about GPUs where a GPU driver is loaded); if a custom handler does, torch keeps one
    thread here (pagedserve.server.workers.registry), leaving the cores to the workers."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = asyncio.new_event_loop()
    try:
        code = loop.run_until_complete(serve(config))
    except BaseException:
        loop.close()
        raise
    # Stopped in order: workers first, the ports last. Exit now: asyncio.run's and the
    # interpreter's teardown (joining executor threads, and more) would leave seconds between
    # the ports closing and the process ending, in which a load balancer sees a refused port
    # on a live process.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
