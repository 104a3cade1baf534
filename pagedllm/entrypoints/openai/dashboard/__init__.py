"""The live dashboard at /dashboard: a static page (index.html, dashboard.js,
dashboard.css, shipped as package data; no build step, no CDN) polling the JSON of
/dashboard/state, which `DashboardFeed` builds."""

from pagedllm.entrypoints.openai.dashboard.feed import DashboardFeed
from pagedllm.entrypoints.openai.dashboard.routes import (PAGE_PATHS, STATE_PATH,
                                                          add_dashboard_routes)

__all__ = ["DashboardFeed", "PAGE_PATHS", "STATE_PATH", "add_dashboard_routes"]
