"""The gateway's CORS answers: a page of a listed origin may send any request header
(the OpenAI SDKs add their own), a page of another origin gets no CORS headers."""

from __future__ import annotations

import httpx
import pytest

from trtllm_worker.config import Settings
from trtllm_worker.gateway.app import create_app

PAGE = "https://app.example"
SDK_HEADERS = (
    "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
    "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
    "x-stainless-runtime-version,x-stainless-timeout,openai-organization"
)


async def preflight(origins: str, origin: str, headers: str) -> httpx.Response:
    app = create_app(Settings(_env_file=None, gateway_cors_origins=origins))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        return await http.options(
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": headers,
            },
        )


@pytest.mark.parametrize("origins", [PAGE, f"http://other.example,{PAGE}", "*"])
async def test_a_listed_origin_may_send_the_sdks_headers(origins: str) -> None:
    answer = await preflight(origins, PAGE, SDK_HEADERS)
    assert answer.status_code == 200, answer.text
    allowed = {h.strip().lower() for h in answer.headers["access-control-allow-headers"].split(",")}
    assert set(SDK_HEADERS.split(",")) <= allowed
    assert answer.headers["access-control-allow-origin"] in (PAGE, "*")


async def test_an_origin_not_listed_is_refused() -> None:
    answer = await preflight("http://other.example", PAGE, "authorization")
    assert answer.status_code == 400
    assert "access-control-allow-origin" not in answer.headers
