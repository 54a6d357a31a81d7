"""kvserve on Ray Serve: N engine replicas behind one ingress that serves the same OpenAI API.

Layout of the Serve application:
- `engine-0` .. `engine-{N-1}`: one deployment each, holding one Serve replica (an `EngineReplica`,
  ray_replica.py: its own LLMEngine and KV pool). One deployment per engine rather than one deployment
  with N replicas, because prefix affinity must address a particular engine, and Serve's handles only
  address deployments; the names stay put when Serve replaces a dead replica, so the hash ring does too.
- `ingress`: the FastAPI app of openai_api.py over a `RayEngineClient` (ray_client.py) that routes each
  request by prefix affinity and relays its stream.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from types import FrameType

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from kvserve.config import EngineConfig
from kvserve.model.registry import load_tokenizer
from kvserve.server.openai_api import build_app
from kvserve.server.ray_client import RayEngineClient, first_answer
from kvserve.server.ray_replica import EngineReplica, ReplicaInfo
from kvserve.server.replica_metrics import ReplicaCollector
from kvserve.server.routing import RoutingConfig

logger = logging.getLogger(__name__)

APP_NAME = "kvserve"


@dataclass(frozen=True)
class RayServeConfig:
    num_replicas: int = 2
    # Ray resources each engine replica reserves: one device per replica on GPU hosts.
    replica_num_cpus: float = 1.0
    replica_num_gpus: float = 0.0
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    # How often Serve checks a replica (a dead one is replaced after at most this long).
    health_check_period_s: float = 2.0
    # Seconds in-flight requests get to finish when a replica or the ingress is shut down.
    graceful_shutdown_timeout_s: float = 30.0
    # Serve's own per-replica concurrency cap; the engine's queue (429) is the real limit, so it is high.
    max_ongoing_requests: int = 4096

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.replica_num_cpus < 0 or self.replica_num_gpus < 0:
            raise ValueError("replica_num_cpus and replica_num_gpus must be >= 0")


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async __init__
        self,
        model: str,
        engines: dict[str, DeploymentHandle],
        routing: RoutingConfig,
        api_key: str | None,
        served_model_name: str | None,
    ) -> None:
        info: ReplicaInfo = await first_answer(handle.info.remote() for handle in engines.values())
        self.client = RayEngineClient(engines, load_tokenizer(model), info, routing)
        self.client.start()
        self.api_key = api_key
        self.served_model_name = served_model_name

    def __serve_build_asgi_app__(self) -> FastAPI:
        collector = ReplicaCollector(self.client.replica_views)
        return build_app(self.client, self.api_key, self.served_model_name, extra_collectors=[collector])

    def set_routing(self, routing: RoutingConfig) -> None:
        """Switch the routing policy at run time (e.g. to compare policies on warm engines)."""
        self.client.set_routing(routing)

    async def __del__(self) -> None:
        await self.client.close()


def build_ray_app(
    engine_config: EngineConfig,
    config: RayServeConfig,
    api_key: str | None = None,
    served_model_name: str | None = None,
) -> Application:
    replica = serve.deployment(
        EngineReplica,
        ray_actor_options={"num_cpus": config.replica_num_cpus, "num_gpus": config.replica_num_gpus},
        health_check_period_s=config.health_check_period_s,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        max_ongoing_requests=config.max_ongoing_requests,
    )
    engines = {
        f"engine-{i}": replica.options(name=f"engine-{i}").bind(engine_config) for i in range(config.num_replicas)
    }
    ingress = Ingress.options(  # type: ignore[attr-defined]  # @serve.deployment made it a Deployment
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        max_ongoing_requests=config.max_ongoing_requests,
    )
    return ingress.bind(engine_config.model, engines, config.routing, api_key, served_model_name)


def serve_ray(
    engine_config: EngineConfig,
    config: RayServeConfig,
    address: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
) -> None:
    """`kvserve serve --replicas N`: join the Ray cluster at `address` ("auto", an address; None: $RAY_ADDRESS
    or a new local cluster), run the application until SIGINT/SIGTERM, then delete it, which gives
    in-flight requests graceful_shutdown_timeout_s to finish."""
    import ray

    ray.init(address=address)
    signal.signal(signal.SIGTERM, _interrupt)  # after ray.init, which installs a handler of its own
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(
            build_ray_app(engine_config, config, api_key, served_model_name),
            name=APP_NAME,
            route_prefix="/",
            blocking=True,
        )
    except KeyboardInterrupt:
        logger.info("shutting down: deleting the %s application", APP_NAME)
    finally:
        serve.delete(APP_NAME)
        ray.shutdown()


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM ends the blocking serve.run like Ctrl-C, so the finally runs
