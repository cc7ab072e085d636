"""The pools on the scheduler's dashboard: a page, a JSON endpoint, the plugin.

Dask's dashboard shows a pool as one long task per slot.  This module, loaded
into the scheduler, adds what the pools' owners report
(:mod:`fiber_dask.engine.poolstats`):

* ``/fiber/pools.json`` on the scheduler's HTTP server: the live pools and
  the held locks (:mod:`fiber_dask.comm.lockstats`), the document of
  :meth:`fiber_dask.engine.poolstats.PoolStore.document` (needs nothing
  beyond distributed);
* ``/fiber-pools``, a bokeh app registered with the scheduler's dashboard as
  distributed registers its own pages (listed in its "More..." menu): one row
  per pool (done, in flight, queued, failed, re-runs, items per second, busy)
  and each slot's busy fraction, and the held locks with their holders,
  refreshed every second from that same document.  Needs bokeh (``pip
  install "fiber-dask[diagnostics]"``) and a scheduler that serves its
  dashboard.

How it gets there:

* the embedded cluster and ``fiber-dask up`` preload it into their scheduler;
* an existing scheduler: ``dask scheduler --preload fiber_dask.dashboard`` (or
  ``DASK_DISTRIBUTED__SCHEDULER__PRELOAD=fiber_dask.dashboard``), or from any
  client ``client.register_plugin(PoolDashboard())``
  (fiber-dask must be installed where the scheduler runs).  Without it the
  pools still run; they are just not reported, and ``fiber-dask info`` says so.
"""

from __future__ import annotations

import html
import logging
import sys
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from .backends.base import scheduler_preloads as preload_modules
from .engine import poolstats

__all__ = [
    "PoolDashboard",
    "dask_setup",
    "preload_modules",
    "summary",
    "PAGE",
    "JSON_PATH",
    "defer",
    "connect_on_request",
    "wait_built",
]

logger = logging.getLogger("fiber_dask.dashboard")

#: The dashboard page (below the dashboard's prefix).
PAGE = "fiber-pools"
#: The JSON endpoint (below the dashboard's prefix).
JSON_PATH = "fiber/pools.json"


class PoolDashboard(SchedulerPlugin):
    """Scheduler plugin: keep the pools' reports, serve them on the dashboard.

    Examples
    --------
    On a scheduler started without the preload::

        >>> from fiber_dask.dashboard import PoolDashboard
        >>> client.register_plugin(PoolDashboard())  # doctest: +SKIP
    """

    name = "fiber-dask-pools"

    def __init__(self) -> None:
        self.store = poolstats.PoolStore()

    async def start(self, scheduler: Any) -> None:
        from tornado.ioloop import PeriodicCallback

        existing = scheduler.extensions.get("fiber-pools")
        if isinstance(existing, poolstats.PoolStore):
            # Registered again (a client's register_plugin on a preloaded
            # scheduler): keep the store the routes already serve.
            self.store = existing
            return
        self.store.install(scheduler)
        expire = PeriodicCallback(self.store.expire, poolstats.STALE_AFTER * 500)
        scheduler.periodic_callbacks["fiber-pools-expire"] = expire
        expire.start()
        _install_routes(scheduler, self)

    def remove_client(self, scheduler: Any, client: str) -> None:
        self.store.drop_client(client)


def dask_setup(scheduler: Any) -> None:
    """Preload hook (``dask scheduler --preload fiber_dask.dashboard``)."""
    from distributed import Scheduler

    if not isinstance(scheduler, Scheduler):
        logger.warning(
            "fiber-dask: fiber_dask.dashboard is a scheduler preload, not a %s one; "
            "ignored",
            type(scheduler).__name__,
        )
        return
    if PoolDashboard.name not in scheduler.plugins:
        # Started by the scheduler right after its preloads.
        scheduler.add_plugin(PoolDashboard())


# ----------------------------------------------------------------- the routes


class PoolsJSON(web.RequestHandler):
    """``GET /fiber/pools.json``: the live pools."""

    def initialize(self, store: poolstats.PoolStore) -> None:
        self.store = store

    def get(self) -> None:
        self.set_header("Cache-Control", "no-store")
        self.write(self.store.document())


def _bokeh_apps(scheduler: Any) -> list[Any]:
    # Not imported here: with bokeh not loaded there is no bokeh app, and
    # importing it (~0.8 s) in the scheduler's start would delay the
    # embedded cluster's workers (the dashboard comes on request, connect_on_request).
    server = sys.modules.get("bokeh.server.server")
    if server is None:
        return []
    BokehTornado = server.BokehTornado  # noqa: N806 - the class
    application = getattr(scheduler, "http_application", None)
    return [
        a
        for a in getattr(application, "applications", [])
        if isinstance(a, BokehTornado)
    ]


def _install_routes(scheduler: Any, plugin: PoolDashboard) -> None:
    application = getattr(scheduler, "http_application", None)
    if application is None:
        logger.info("fiber-dask: the scheduler serves no HTTP: no pools page")
        return
    dashboards = _bokeh_apps(scheduler)
    prefix = dashboards[0].prefix if dashboards else "/"
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    application.add_handlers(
        r".*", [(prefix + JSON_PATH, PoolsJSON, {"store": plugin.store})]
    )
    if not dashboards:
        if getattr(scheduler, _DEFERRED, False) or _deferring:
            return  # the page comes with the dashboard (connect_on_request)
        logger.info(
            "fiber-dask: the scheduler shows no bokeh dashboard (bokeh missing or "
            "the dashboard disabled): /%s is not served, %s is",
            PAGE,
            prefix + JSON_PATH,
        )
        return
    _install_page(scheduler, plugin, prefix)


def _install_page(scheduler: Any, plugin: PoolDashboard, prefix: str) -> None:
    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables
    from tornado.ioloop import IOLoop

    variables = template_variables(scheduler)
    app = BokehApplication(
        {"/" + PAGE: _page(plugin.store)},
        scheduler,
        prefix=prefix,
        template_variables=variables,
    )
    scheduler.http_application.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    plugin.store.page = prefix + PAGE
    try:
        # In the "More..." menu of every dashboard page (distributed's
        # template variables are one shared, memoised dict per scheduler).
        plots = variables["plots"]
        if not any(p.get("url") == PAGE for p in plots):
            plots.append({"url": PAGE, "name": "Fiber Pools"})
    except (KeyError, TypeError, AttributeError):  # pragma: no cover
        pass


# ------------------------------------------------------- the deferred dashboard

#: Set on a scheduler whose bokeh dashboard :func:`connect_on_request` builds.
_DEFERRED = "_fiber_dask_dashboard_deferred"

#: The :class:`threading.Event` on such a scheduler, set once it is built.
_BUILT = "_fiber_dask_dashboard_built"

#: Schedulers :func:`defer` has set up whose :func:`connect_on_request` has
#: not run yet: the pools plugin starts inside ``Scheduler.__init__``, before
#: the scheduler can be marked, and must not log that there is no dashboard.
_deferring = 0


def defer(scheduler_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``scheduler_kwargs`` for a scheduler whose bokeh dashboard
    :func:`connect_on_request` builds when its first page is asked for.

    Building distributed's dashboard (importing bokeh, and constructing the
    bokeh-tornado application: several hundred route regexes) costs the
    scheduler 0.5-1.1 s of CPU in ``Scheduler.__init__``, before a single
    worker process is started: the longest single step of the embedded
    cluster's start on 2 cores (benchmarks/slotstart.py).  Its HTTP server
    still starts at once (the dashboard's address is bound and shown, and
    ``/fiber/pools.json``, ``/health`` and ``/metrics`` are served); the bokeh
    pages are built by the first request for one of them.
    """
    import importlib.util

    # Whether bokeh is there, without importing it (that alone is ~0.8 s).
    if importlib.util.find_spec("bokeh") is None:
        return scheduler_kwargs  # the scheduler says the dashboard is missing
    global _deferring
    _deferring += 1
    return {**scheduler_kwargs, "dashboard": False}


def wait_built(scheduler: Any, timeout: float | None = None) -> bool:
    """Wait until ``scheduler``'s deferred dashboard is built (at once if it
    was not deferred); False if ``timeout`` ran out first.  It is built by
    the first request for one of its pages (:func:`connect_on_request`)."""
    built = getattr(scheduler, _BUILT, None)
    return True if built is None else built.wait(timeout)


class _BuildOnRequest(web.RequestHandler):
    """Any path the scheduler's own routes do not serve, until the dashboard
    is built: build it, then send the browser back to the same address,
    which bokeh's routes now serve (or, for a path nobody serves, the
    scheduler's 404)."""

    def initialize(self, build: Any) -> None:
        self.build = build

    async def get(self, *args: Any) -> None:
        await self.build()
        self.set_header("Cache-Control", "no-store")
        self.redirect(self.request.uri or "/")

    head = get


def connect_on_request(scheduler: Any) -> None:
    """Build ``scheduler``'s bokeh dashboard (distributed's pages and the
    pools page) when the first request for one of its pages comes: bokeh is
    imported in a thread, and only the application's hand-over runs on the
    scheduler's event loop; that request waits for it (~0.5-1 s) and is then
    redirected to the page.

    Why on request rather than on a timer (a second after the cluster was
    up, as before): building it costs the owner's process 0.35-0.5 s of CPU
    even on a quiet machine, taken from whatever the program does then --- at
    1024 slots, the first ES iteration ran 0.47 s of owner CPU against 0.13 s
    for the next ones (benchmarks/RESULTS.md, "Scaling, session 7").  Most
    embedded clusters live for one script that nobody watches.

    ``scheduler`` is one started with :func:`defer`'s arguments, in this
    process (the embedded cluster's).
    """
    import asyncio
    import threading

    global _deferring
    setattr(scheduler, _DEFERRED, True)
    _deferring = max(0, _deferring - 1)
    built = threading.Event()  # set once attach() ran (or will never run)
    setattr(scheduler, _BUILT, built)
    waiting: list[asyncio.Future] = []  # requests waiting for the build (loop)

    def build_thread() -> None:
        try:
            import distributed.dashboard.scheduler  # noqa: F401
        except ImportError:  # a bokeh distributed does not support
            logger.warning("fiber-dask: no dashboard", exc_info=True)
        try:
            scheduler.loop.add_callback(attach)
        except RuntimeError:  # the loop closed meanwhile
            built.set()

    def attach() -> None:
        try:
            if "distributed.dashboard.scheduler" in sys.modules:
                _attach()
        finally:
            # Whatever happened, requests go to the real routes from now on
            # (a failed build shows the scheduler's 404, not a redirect loop).
            applications = getattr(scheduler.http_application, "applications", [])
            if lazy in applications:
                applications.remove(lazy)
            built.set()
            for fut in waiting:
                if not fut.done():
                    fut.set_result(None)
            waiting.clear()

    def _attach() -> None:
        if scheduler.status.name not in ("running", "paused"):
            return  # closing (or closed) meanwhile
        from distributed.dashboard.scheduler import connect

        try:
            connect(scheduler.http_application, scheduler.http_server, scheduler)
            plugin = scheduler.plugins.get(PoolDashboard.name)
            if isinstance(plugin, PoolDashboard):
                _install_page(scheduler, plugin, "/")
        except Exception:  # noqa: BLE001 - the cluster runs on without it
            logger.warning("fiber-dask: the dashboard did not start", exc_info=True)

    async def build() -> None:
        # On the scheduler's loop, in the first request's handler.
        if built.is_set():
            return
        fut = asyncio.get_running_loop().create_future()
        if not waiting:
            threading.Thread(
                target=build_thread, name="fiber-dashboard", daemon=True
            ).start()
        waiting.append(fut)
        await fut

    lazy = web.Application([(r"/.*", _BuildOnRequest, {"build": build})])

    def install() -> None:
        application = getattr(scheduler, "http_application", None)
        if application is None or not hasattr(application, "add_application"):
            built.set()
            return
        application.add_application(lazy)
        plugin = scheduler.plugins.get(PoolDashboard.name)
        if isinstance(plugin, PoolDashboard):
            # Where the page will be: a request for it builds it.
            plugin.store.page = "/" + PAGE

    scheduler.loop.add_callback(install)  # thread-safe


# ------------------------------------------------------------------- the page

_COLUMNS = [
    ("name", "Pool"),
    ("id", "ID"),
    ("owner", "Owner"),
    ("state", "State"),
    ("processes", "Slots"),
    ("done", "Done"),
    ("in_flight", "In flight"),
    ("queued", "Queued"),
    ("failed", "Failed"),
    ("reruns", "Re-runs"),
    ("rate", "Items/s"),
    ("busy", "Busy"),
]

#: Relative column widths (the table fills the page's width).
_WIDTHS = {"name": 70, "id": 100, "owner": 260, "state": 60}


def _rows(doc: dict[str, Any]) -> tuple[dict[str, list], dict[str, list]]:
    """Table columns for the pools, and bar data for their slots."""
    pools: dict[str, list] = {key: [] for key, _ in _COLUMNS}
    slots: dict[str, list] = {"label": [], "busy": [], "worker": [], "text": []}
    for p in doc["pools"]:
        for key, _ in _COLUMNS:
            if key == "owner":
                pools[key].append(f"{p['program']} (pid {p['pid']} on {p['host']})")
            else:
                pools[key].append(p[key])
        for s in p["slots"]:
            slots["label"].append(f"{p['name']} {s['name']}")
            slots["busy"].append(s["busy"])
            slots["worker"].append(s["worker"] or "not connected")
            slots["text"].append(f"{s['busy']:.0%}")
    return pools, slots


def _page(store: poolstats.PoolStore) -> Any:
    def pools_doc(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
        from bokeh.layouts import column
        from bokeh.models import (
            ColumnDataSource,
            DataTable,
            Div,
            FactorRange,
            HoverTool,
            LabelSet,
            NumberFormatter,
            TableColumn,
        )
        from bokeh.plotting import figure
        from distributed.dashboard.components.scheduler import BOKEH_THEME, env

        first = store.document()
        pools, slots = _rows(first)
        table_source = ColumnDataSource(pools)
        slot_source = ColumnDataSource(slots)
        formats = {
            "rate": NumberFormatter(format="0,0.0"),
            "busy": NumberFormatter(format="0 %"),
        }
        table = DataTable(
            source=table_source,
            columns=[
                TableColumn(
                    field=k,
                    title=t,
                    width=_WIDTHS.get(k, 60),
                    **({"formatter": formats[k]} if k in formats else {}),
                )
                for k, t in _COLUMNS
            ],
            index_position=None,
            sizing_mode="stretch_width",
            height=60 + 28 * max(1, len(first["pools"])),
        )
        header = Div(sizing_mode="stretch_width")
        bars = figure(
            title="Busy fraction of each slot (last "
            f"{poolstats.WINDOW:g} s: share of time it had work)",
            y_range=FactorRange(factors=list(reversed(slots["label"]))),
            x_range=(0, 1.15),
            height=_bars_height(len(slots["label"])),
            sizing_mode="stretch_width",
            toolbar_location=None,
            tools="",
        )
        bars.hbar(
            y="label",
            right="busy",
            height=0.7,
            source=slot_source,
            color="#1f77b4",
        )
        bars.add_layout(
            LabelSet(
                x="busy",
                y="label",
                text="text",
                source=slot_source,
                x_offset=4,
                y_offset=-6,
                text_font_size="10px",
            )
        )
        bars.add_tools(HoverTool(tooltips=[("slot", "@label"), ("worker", "@worker")]))
        bars.xaxis.axis_label = "busy fraction"

        def update() -> None:
            document = store.document()
            pools, slots = _rows(document)
            header.text = _header(document)
            table_source.data = pools
            table.height = 60 + 28 * max(1, len(document["pools"]))
            labels = list(reversed(slots["label"]))
            if list(bars.y_range.factors) != labels:
                bars.y_range.factors = labels
                bars.height = _bars_height(len(labels))
            slot_source.data = slots

        header.text = _header(first)
        doc.add_periodic_callback(update, int(poolstats.INTERVAL * 1000))
        doc.title = "Dask: fiber-dask pools"
        doc.add_root(column(header, table, bars, sizing_mode="stretch_width"))
        doc.template = env.get_template("simple.html")
        doc.template_variables.update(extra)
        doc.theme = BOKEH_THEME

    return pools_doc


def _bars_height(n: int) -> int:
    return 80 + 22 * max(1, n)


def summary(pool: dict[str, Any]) -> str:
    """One line of a pool's numbers, as the page and ``fiber-dask info`` say it."""
    return (
        f"{pool['name']} ({pool['id']}), {pool['program']} pid {pool['pid']} on "
        f"{pool['host']}, {pool['state']}: {pool['processes']} slots, "
        f"{pool['done']} done, {pool['in_flight']} in flight, {pool['queued']} "
        f"queued, {pool['failed']} failed, {pool['reruns']} re-runs, "
        f"{pool['rate']:g} items/s, busy {pool['busy']:.0%}"
    )


def _header(document: dict[str, Any]) -> str:
    pools = document["pools"]
    if pools:
        n = len(pools)
        what = f"{n} live pool{'s' * (n != 1)}"
        items = "".join(f"<li>{html.escape(summary(p))}</li>" for p in pools)
    else:
        what, items = "No live pool reports to this scheduler", ""
    return (
        f"<h2>fiber-dask pools</h2><p>{what}, updated every "
        f"{document['interval']:g} s (the numbers of <code>{JSON_PATH}</code> and "
        f"<code>fiber-dask info</code>).</p>"
        + (f"<ul>{items}</ul>" if items else "")
        + _locks_html(document.get("locks") or [])
    )


def _locks_html(locks: list[dict[str, Any]]) -> str:
    """The held locks: which process holds each, where, for how long."""
    from .comm.lockstats import describe

    if not locks:
        return (
            "<h3>Held locks</h3>"
            "<p>No Lock, RLock, Semaphore or Condition is held.</p>"
        )
    items = "".join(f"<li>{html.escape(describe(lock))}</li>" for lock in locks)
    return f"<h3>Held locks</h3><ul>{items}</ul>"
