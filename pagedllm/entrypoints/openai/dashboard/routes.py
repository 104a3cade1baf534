"""The dashboard's routes: the page's files and its JSON feed.

The page files hold no data and a browser cannot send an API key when it navigates,
so they are served without one (like /health); the feed, which names requests and
shows the engine's state, needs the key like /metrics and /debug/stats do, and is open
exactly when /metrics is (--metrics-without-key). The page takes a key from the URL
fragment (`/dashboard#key=KEY`: never sent to the server or logged) or asks for it.
"""

from __future__ import annotations

import json
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from pagedllm.entrypoints.openai.dashboard.feed import DashboardFeed

# File name -> media type of what the page loads (nothing else is served from here).
_FILES = {"index.html": "text/html; charset=utf-8",
          "dashboard.js": "text/javascript; charset=utf-8",
          "dashboard.css": "text/css; charset=utf-8"}
STATE_PATH = "/dashboard/state"
PAGE_PATHS = frozenset({"/dashboard", "/dashboard/"} |
                       {f"/dashboard/{name}" for name in _FILES})


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


def add_dashboard_routes(app: FastAPI, feed: DashboardFeed) -> None:
    # Read once: the files ship in the package and do not change while serving.
    files = {name: _read(name) for name in _FILES}

    def file_response(name: str) -> Response:
        return Response(files[name], media_type=_FILES[name],
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard", include_in_schema=False)
    @app.get("/dashboard/", include_in_schema=False)
    async def dashboard_page() -> Response:
        return file_response("index.html")

    @app.get("/dashboard/dashboard.js", include_in_schema=False)
    async def dashboard_js() -> Response:
        return file_response("dashboard.js")

    @app.get("/dashboard/dashboard.css", include_in_schema=False)
    async def dashboard_css() -> Response:
        return file_response("dashboard.css")

    @app.get(STATE_PATH)
    async def dashboard_state(since: float | None = None) -> Response:
        """The dashboard's data: counters, the KV block grid (sampled at most every
        snapshot_s), history points newer than `since`, the request timeline."""
        state = await feed.state(since)
        return Response(json.dumps(state, separators=(",", ":")),
                        media_type="application/json",
                        headers={"Cache-Control": "no-store"})
