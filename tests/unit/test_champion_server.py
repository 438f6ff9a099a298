"""The champion server's HTTP surface before any version is served: auth (basic with serve's auth
string, bearer with the derived key, everything else 401, /health open), /v1/models empty and
completions answered 503, not a crash. Against a real (empty) sqlite MLflow registry."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx

from infra.ops.champion_server import ChampionServer, LocalBackend
from infra.config import RolloutConfig
from infra.registry import Registry
from infra.serve import champion_api_key

AUTH = "ops:champion-password-1"


def _server(tmp_path: Path, auth: str | None) -> ChampionServer:
    reg = Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", "deltaloop-policy")
    return ChampionServer(reg, "champion", LocalBackend(RolloutConfig(), "deltaloop-policy"), tmp_path / "w", auth)


async def _calls(server: ChampionServer) -> dict[str, int]:
    basic = "Basic " + base64.b64encode(AUTH.encode()).decode()
    chat = {"model": "deltaloop-policy", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server), base_url="http://t") as c:
        out = {"health": (await c.get("/health")).status_code,
               "anon": (await c.post("/v1/chat/completions", json=chat)).status_code,
               "wrong_bearer": (await c.get("/v1/models", headers={"Authorization": "Bearer " + "0" * 64})).status_code,
               "wrong_basic": (await c.get("/v1/models", auth=("ops", "nope"))).status_code,
               "bearer_models": (await c.get("/v1/models", headers={"Authorization": f"Bearer {champion_api_key(AUTH)}"}
                                             )).status_code,
               "basic_chat": (await c.post("/v1/chat/completions", json=chat, headers={"Authorization": basic})
                              ).status_code}
        out["models_empty"] = int((await c.get("/v1/models", headers={"Authorization": basic})).json()["data"] == [])
        out["refresh"] = int(await server.refresh())
    return out


def test_auth_and_answers_before_a_champion(tmp_path: Path) -> None:
    got = asyncio.run(_calls(_server(tmp_path, AUTH)))
    assert got == {"health": 200, "anon": 401, "wrong_bearer": 401, "wrong_basic": 401, "bearer_models": 200,
                   "basic_chat": 503, "models_empty": 1, "refresh": 0}


def test_without_auth_everything_is_open(tmp_path: Path) -> None:
    got = asyncio.run(_calls(_server(tmp_path, None)))
    assert got["anon"] == 503 and got["wrong_bearer"] == 200 and got["health"] == 200
