"""The dashboard at ``/ui``: routes (routes.py), what it reads beyond store.py and queue.py
(reads.py), Jinja2 templates with autoescape (pages.py, templates/), its charts (charts.py), this
process's request counts (health.py), and its CSS and script (static/)."""

from consolidation.ui.routes import add_ui_routes

__all__ = ["add_ui_routes"]
