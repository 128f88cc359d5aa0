"""The status page's HTML, stylesheet and script; its content is :mod:`.status`.

:func:`render_html` renders a :func:`replicator.observe.status.snapshot`; every
value is HTML-escaped (peer names come from the wire).  :data:`SCRIPT` and
:data:`STYLE` are served as files, so the Content-Security-Policy
(:data:`CSP`) allows no inline script or style at all; the script refreshes
the page from ``/status.json`` and builds every cell with ``textContent``.
"""

import html
import time
from typing import Any

from .writers import duration

#: The page's Content-Security-Policy: nothing inline, nothing external.
CSP = (b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       b"connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

def _e(value: Any) -> str:
    return html.escape("-" if value is None else str(value), quote=True)


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def sparkline(history: list[list[float]], now: float, window: float) -> str:
    """An inline SVG polyline of ``[[time, lag], ...]`` over ``window``
    seconds ending at ``now`` (120 x 24 units; a flat line when no lag)."""
    width, height = 120.0, 24.0
    top = max([lag for _, lag in history] + [1])
    points = " ".join(
        f"{max(0.0, width - (now - t) / window * width):.1f},"
        f"{height - 1 - (lag / top) * (height - 2):.1f}" for t, lag in history)
    return (f'<svg class="spark" viewBox="0 0 120 24" width="120" height="24" role="img" '
            f'aria-label="lag over the last {window / 60:.0f} minutes, max {top}">'
            f'<line class="axis" x1="0" y1="23.5" x2="120" y2="23.5" stroke="#cccccc"/>'
            f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" '
            f'points="{points}"/></svg>')


def _cell(label: str, inner: str, cls: str | None = None) -> str:
    """One ``<td>``: ``inner`` is HTML already escaped."""
    attr = f' class="{cls}"' if cls else ""
    return f'<td data-label="{label}"{attr}>{inner}</td>'


def _rows(rows: list[list[str]], empty: str, columns: int) -> str:
    """Table rows of cells (:func:`_cell`), or one row saying ``empty``."""
    out = "".join("<tr>" + "".join(cells) + "</tr>" for cells in rows)
    return out or f'<tr><td colspan="{columns}">{empty}</td></tr>'


def linear_text(stream: dict[str, Any]) -> str:
    """The linear cell: the token, and what holds it if anything does."""
    holder = stream.get("linear_holder")
    if stream["linear"] is None or not holder:
        return "-" if stream["linear"] is None else str(stream["linear"])
    return f"{stream['linear']} (held by {holder['by']}, for {holder['held']})"


def link_text(w: dict[str, Any]) -> str:
    """The link cell of a remote writer: its state (connected, since when,
    or when last heard where connections are not known)."""
    link = w.get("link")
    if w["local"] or not link:
        return "-"
    text = link["text"]
    if link["connected"] is not None:
        age = link["heard_age"]
        text += "; never heard" if age is None else f"; last heard {duration(age)} ago"
    return text




def _writer_cells(stream: dict[str, Any], w: dict[str, Any], now: float,
                  window: float) -> list[str]:
    if w["local"]:
        ids = ", ".join(str(i) for i in w["in_flight_ids"])
        more = w["in_flight"] - len(w["in_flight_ids"])
        flight = f"{w['in_flight']}" + (f" ({ids}{', …' if more > 0 else ''})" if ids else "")
        lag_cell, reader = "-", "-"
    else:
        flight = "-"
        reader = _e(w["reader_position"])
        lag_cell = (f'<span class="lag">{_e(w["lag"])}</span>'
                    + sparkline(w["lag_history"], now, window))
    return [_cell("stream", _e(stream["name"])),
            _cell("writer", _e(w["writer"]) + (" (local)" if w["local"] else "")),
            _cell("link", _e(link_text(w))),
            _cell("position", _e(w["position"]), "num"),
            _cell("linear", _e(linear_text(stream)), "num"),
            _cell("in flight", _e(flight)),
            _cell("reader", reader, "num"),
            _cell("lag (15 min)", lag_cell),
            _cell("verdict", _e(w["verdict"]), w.get("level", "ok"))]


def _writer_rows(snap: dict[str, Any]) -> str:
    return _rows([_writer_cells(stream, w, snap["now"], snap["window"])
                  for stream in snap["streams"] for w in stream["writers"]], "no streams", 9)


def _connection_rows(snap: dict[str, Any]) -> str:
    return _rows([[_cell("peer", _e(c["peer"])), _cell("address", _e(c["address"])),
                   _cell("role", _e(c["role"])),
                   _cell("queued lines", _e(c["queued_lines"]), "num"),
                   _cell("queued bytes", _e(c["queued_bytes"]), "num"),
                   _cell("state", _e(c["state_text"]), "bad" if c["state"] != "connected"
                         else None)]
                  for c in snap["connections"]], "no replication connections", 6)


def _reader_rows(snap: dict[str, Any]) -> str:
    return _rows([[_cell("reader", _e(r["reader"])), _cell("stream", _e(r["stream"])),
                   _cell("connected", _e(r["connected"]), "num"),
                   _cell("position", _e("-" if r["position"] is None else r["position"]),
                         "num"),
                   _cell("lag", _e("-" if r["lag"] is None else r["lag"]), "num")]
                  for r in snap.get("readers", [])], "no HTTP readers yet", 5)


def _disconnect_rows(snap: dict[str, Any]) -> str:
    return _rows([[_cell("at", _e(_when(d["at"]))), _cell("peer", _e(d["peer"])),
                   _cell("address", _e(d["address"])), _cell("reason", _e(d["reason"]))]
                  for d in snap["disconnects"]], "none since start", 4)


def _span(at: float, until: float, end: str = "{}") -> str:
    """``2026-11-25 19:14:29 – 19:14:40 UTC``: the end's date only if it
    differs; ``end`` says what the end is (``{}``: its time)."""
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
    stop = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(until))
    if stop[:10] == start[:10]:
        stop = stop[11:]
    return f"{start} – {end.format(stop)}"


def period(p: dict[str, Any]) -> str:
    """When a problem (of ``/status.json``) was: ``2026-11-25 19:14:29 –
    19:14:40 UTC``, ``2026-11-25 19:14:29 UTC – ongoing``, or, one from
    before the restart that had not ended, ``2026-11-25 19:14:29 – ongoing
    at the stop (19:20:03 UTC), end unknown`` (``not recorded, before the
    restart at …`` when the stop did not say)."""
    at, until = p["at"], p.get("until")
    if until is not None:
        return _span(at, until)
    if p.get("before_restart"):
        if p.get("stopped_at") is not None:
            return _span(at, p["stopped_at"], "ongoing at the stop ({}), end unknown")
        if p.get("restarted_at") is not None:
            return _span(at, p["restarted_at"], "ongoing at the stop (not recorded, before "
                                                "the restart at {}), end unknown")
        return f"{_when(at)} – ongoing at the stop, end unknown"
    return f"{_when(at)} – ongoing"


def _problem_rows(snap: dict[str, Any]) -> str:
    rows, marked = [], False
    for p in snap["problems"]:
        if p.get("before_restart") and not marked and snap.get("started_at") is not None:
            rows.append(f'<li class="restart">restart at {_e(_when(snap["started_at"]))}: '
                        'the problems below are from before it</li>')
            marked = True
        rows.append(f'<li><time>{_e(period(p))}</time> {_e(p["reason"])}</li>')
    return "".join(rows) or "<li>none since start</li>"


def banner(snap: dict[str, Any]) -> tuple:
    """The verdict line and its class: ``unhealthy: …`` (``bad``, what
    ``/health`` answers 503 for), ``warning: …`` (``warn``: a writer down,
    a linear token held; ``/health`` still 200) or ``healthy`` (``ok``)."""
    if not snap["healthy"]:
        return f"unhealthy: {snap['problem']}", "bad"
    if snap.get("warning"):
        return f"warning: {snap['warning']}", "warn"
    return "healthy", "ok"


def render_html(snap: dict[str, Any]) -> bytes:
    verdict, verdict_class = banner(snap)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>replicator {_e(snap["instance"])}</title>
<link rel="stylesheet" href="/status.css">
<script src="/status.js" defer></script>
</head><body>
<header><h1>replicator <span id="instance">{_e(snap["instance"])}</span>
<small id="role">{_e(snap["role"])}</small>
<small id="version">{_e(snap.get("version", ""))}</small></h1>
<p id="verdict" class="{verdict_class}">{_e(verdict)}</p>
<p class="muted">as of <span id="updated">{_e(_when(snap["now"]))}</span>
<span id="refresh">(server-rendered)</span></p></header>
<main>
<section><h2>Streams and writers</h2>
<table id="writers"><thead><tr><th>stream</th><th>writer</th><th>link</th><th>position</th>
<th>linear</th><th>in flight</th><th>reader</th><th>lag (15 min)</th><th>verdict</th></tr></thead>
<tbody>{_writer_rows(snap)}</tbody></table></section>
<section><h2>Connections</h2>
<table id="connections"><thead><tr><th>peer</th><th>address</th><th>role</th>
<th>queued lines</th><th>queued bytes</th><th>state</th></tr></thead>
<tbody>{_connection_rows(snap)}</tbody></table></section>
<section><h2>HTTP readers</h2>
<table id="readers"><thead><tr><th>reader</th><th>stream</th><th>connected</th>
<th>position</th><th>lag</th></tr></thead>
<tbody>{_reader_rows(snap)}</tbody></table></section>
<section><h2>Recent disconnects</h2>
<table id="disconnects"><thead><tr><th>at</th><th>peer</th><th>address</th><th>reason</th>
</tr></thead><tbody>{_disconnect_rows(snap)}</tbody></table></section>
<section><h2>Recent problems</h2><ul id="problems">{_problem_rows(snap)}</ul></section>
</main></body></html>
"""
    return page.encode("utf-8")


STYLE = b"""
body{font:14px/1.4 system-ui,sans-serif;margin:0 auto;padding:12px;max-width:1400px;color:#222}
h1{font-size:20px;margin:4px 0}h1 small{font-weight:normal;color:#666;margin-left:8px}
h2{font-size:16px;margin:18px 0 6px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #ddd;vertical-align:middle}
th{background:#f3f3f3}.num{text-align:right;font-variant-numeric:tabular-nums}
.ok{color:#176f2c}.bad{color:#b00020;font-weight:bold}.warn{color:#8a5300;font-weight:bold}
.muted{color:#666;margin:0}
#verdict.stale{color:#fff;background:#222;padding:6px 10px;font-weight:bold;font-size:18px}
body.stale main{opacity:.45}
#verdict{font-size:16px;margin:4px 0}.spark{vertical-align:middle;margin-left:6px;color:#1f5fbf}
.lag{display:inline-block;min-width:3em;text-align:right}
ul{padding-left:18px}time{color:#666;margin-right:6px}
li.restart{list-style:none;margin:6px 0 2px -18px;color:#666;border-top:1px solid #ddd}
@media (max-width:700px){
 thead{display:none}table,tbody,tr,td{display:block;width:auto}
 tr{border:1px solid #ddd;margin:0 0 8px;padding:4px}
 td,td.num{border:none;padding:2px 4px;text-align:left}
 td[data-label]:not([data-label=""])::before{content:attr(data-label) ": ";color:#666}
}
"""

SCRIPT = b"""'use strict';
// Refreshes the status page from /status.json (no secret needed); builds
// every cell with textContent, never HTML from data.
(function () {
  var SVG = 'http://www.w3.org/2000/svg';
  function when(t) {
    return t == null ? '-'
      : new Date(t * 1000).toISOString().slice(0, 19).replace('T', ' ') + ' UTC';
  }
  function txt(v) { return v == null ? '-' : String(v); }
  function age(t) {
    t = Math.max(0, Math.floor(t));
    if (t < 60) { return t + 's'; }
    if (t < 3600) { return Math.floor(t / 60) + 'm' + String(t % 60).padStart(2, '0') + 's'; }
    return Math.floor(t / 3600) + 'h' + String(Math.floor(t % 3600 / 60)).padStart(2, '0') + 'm';
  }
  function span(at, until, end) {
    var start = when(at).slice(0, 19), stop = when(until);
    stop = stop.slice(0, 10) === start.slice(0, 10) ? stop.slice(11) : stop;
    return start + ' \u2013 ' + (end || '{}').replace('{}', stop);
  }
  function period(p) {
    if (p.until != null) { return span(p.at, p.until); }
    if (p.before_restart) {
      if (p.stopped_at != null) {
        return span(p.at, p.stopped_at, 'ongoing at the stop ({}), end unknown');
      }
      if (p.restarted_at != null) {
        return span(p.at, p.restarted_at,
          'ongoing at the stop (not recorded, before the restart at {}), end unknown');
      }
      return when(p.at) + ' \u2013 ongoing at the stop, end unknown';
    }
    return when(p.at) + ' \u2013 ongoing';
  }
  function linearText(st) {
    var h = st.linear_holder;
    if (st.linear == null || !h) { return txt(st.linear); }
    return st.linear + ' (held by ' + h.by + ', for ' + h.held + ')';
  }
  function linkText(w) {
    var l = w.link;
    if (w.local || !l) { return '-'; }
    var text = l.text;
    if (l.connected != null) {
      text += l.heard_age == null ? '; never heard' : '; last heard ' + age(l.heard_age) + ' ago';
    }
    return text;
  }
  function cell(tr, label, value, cls) {
    var td = document.createElement('td');
    if (label) { td.setAttribute('data-label', label); }
    if (cls) { td.className = cls; }
    if (value instanceof Node) { td.appendChild(value); } else { td.textContent = txt(value); }
    tr.appendChild(td);
    return td;
  }
  function spark(history, now, win) {
    var top = 1;
    history.forEach(function (p) { if (p[1] > top) { top = p[1]; } });
    var svg = document.createElementNS(SVG, 'svg');
    svg.setAttribute('class', 'spark');
    svg.setAttribute('viewBox', '0 0 120 24');
    svg.setAttribute('width', '120');
    svg.setAttribute('height', '24');
    svg.setAttribute('role', 'img');
    svg.setAttribute('aria-label',
                     'lag over the last ' + Math.round(win / 60) + ' minutes, max ' + top);
    var axis = document.createElementNS(SVG, 'line');
    [['class', 'axis'], ['x1', '0'], ['y1', '23.5'], ['x2', '120'], ['y2', '23.5'],
     ['stroke', '#cccccc']].forEach(function (a) { axis.setAttribute(a[0], a[1]); });
    svg.appendChild(axis);
    var line = document.createElementNS(SVG, 'polyline');
    line.setAttribute('fill', 'none');
    line.setAttribute('stroke', 'currentColor');
    line.setAttribute('stroke-width', '1.5');
    line.setAttribute('points', history.map(function (p) {
      var x = Math.max(0, 120 - (now - p[0]) / win * 120);
      return x.toFixed(1) + ',' + (23 - p[1] / top * 22).toFixed(1);
    }).join(' '));
    svg.appendChild(line);
    return svg;
  }
  function fill(id, rows, empty, cols) {
    var body = document.querySelector('#' + id + ' tbody');
    var out = document.createDocumentFragment();
    rows.forEach(function (r) { out.appendChild(r); });
    if (!rows.length) {
      var tr = document.createElement('tr');
      var td = cell(tr, '', empty);
      td.setAttribute('colspan', String(cols));
      out.appendChild(tr);
    }
    body.replaceChildren(out);
  }
  function render(s) {
    document.getElementById('instance').textContent = s.instance;
    document.getElementById('role').textContent = s.role;
    var v = document.getElementById('verdict');
    if (!s.healthy) {
      v.textContent = 'unhealthy: ' + s.problem;
      v.className = 'bad';
    } else if (s.warning) {
      v.textContent = 'warning: ' + s.warning;
      v.className = 'warn';
    } else {
      v.textContent = 'healthy';
      v.className = 'ok';
    }
    document.body.classList.remove('stale');
    document.getElementById('updated').textContent = when(s.now);
    var rows = [];
    s.streams.forEach(function (st) {
      st.writers.forEach(function (w) {
        var tr = document.createElement('tr');
        cell(tr, 'stream', st.name);
        cell(tr, 'writer', w.writer + (w.local ? ' (local)' : ''));
        cell(tr, 'link', linkText(w));
        cell(tr, 'position', w.position, 'num');
        cell(tr, 'linear', linearText(st), 'num');
        if (w.local) {
          var ids = w.in_flight_ids.join(', ');
          var more = w.in_flight > w.in_flight_ids.length ? ', \\u2026' : '';
          cell(tr, 'in flight', w.in_flight + (ids ? ' (' + ids + more + ')' : ''));
          cell(tr, 'reader', null, 'num');
          cell(tr, 'lag (15 min)', null);
        } else {
          cell(tr, 'in flight', null);
          cell(tr, 'reader', w.reader_position, 'num');
          var box = document.createElement('span');
          var n = document.createElement('span');
          n.className = 'lag';
          n.textContent = txt(w.lag);
          box.appendChild(n);
          box.appendChild(spark(w.lag_history, s.now, s.window));
          cell(tr, 'lag (15 min)', box);
        }
        cell(tr, 'verdict', w.verdict, w.level || 'ok');
        rows.push(tr);
      });
    });
    fill('writers', rows, 'no streams', 9);
    fill('connections', s.connections.map(function (c) {
      var tr = document.createElement('tr');
      cell(tr, 'peer', c.peer);
      cell(tr, 'address', c.address);
      cell(tr, 'role', c.role);
      cell(tr, 'queued lines', c.queued_lines, 'num');
      cell(tr, 'queued bytes', c.queued_bytes, 'num');
      cell(tr, 'state', c.state_text, c.state !== 'connected' ? 'bad' : null);
      return tr;
    }), 'no replication connections', 6);
    fill('readers', (s.readers || []).map(function (r) {
      var tr = document.createElement('tr');
      cell(tr, 'reader', r.reader);
      cell(tr, 'stream', r.stream);
      cell(tr, 'connected', r.connected, 'num');
      cell(tr, 'position', r.position, 'num');
      cell(tr, 'lag', r.lag, 'num');
      return tr;
    }), 'no HTTP readers yet', 5);
    fill('disconnects', s.disconnects.map(function (d) {
      var tr = document.createElement('tr');
      cell(tr, 'at', when(d.at));
      cell(tr, 'peer', d.peer);
      cell(tr, 'address', d.address);
      cell(tr, 'reason', d.reason);
      return tr;
    }), 'none since start', 4);
    var list = document.getElementById('problems');
    var items = document.createDocumentFragment();
    var marked = false;
    s.problems.forEach(function (p) {
      if (p.before_restart && !marked && s.started_at != null) {
        var mark = document.createElement('li');
        mark.className = 'restart';
        mark.textContent = 'restart at ' + when(s.started_at) +
          ': the problems below are from before it';
        items.appendChild(mark);
        marked = true;
      }
      var li = document.createElement('li');
      var t = document.createElement('time');
      t.textContent = period(p);
      li.appendChild(t);
      li.appendChild(document.createTextNode(' ' + p.reason));
      items.appendChild(li);
    });
    if (!s.problems.length) {
      var li = document.createElement('li');
      li.textContent = 'none since start';
      items.appendChild(li);
    }
    list.replaceChildren(items);
    document.getElementById('refresh').textContent = '(refreshed)';
    document.body.setAttribute('data-refreshed', String(s.now));
  }
  // After STALE_AFTER refreshes failed in a row, the page says that what it
  // shows is stale, and since when (the last answer, on this browser's clock).
  var STALE_AFTER = 2;
  var failures = 0;
  var lastAnswer = Date.now() / 1000;  // the page itself was just served
  function failed(e) {
    failures += 1;
    var why = '(refresh failed ' + failures + ' time' + (failures > 1 ? 's' : '') +
      ' in a row: ' + e.message + ')';
    document.getElementById('refresh').textContent = why;
    if (failures >= STALE_AFTER) {
      var v = document.getElementById('verdict');
      v.textContent = 'STALE: no answer from this daemon since ' + when(lastAnswer) +
        ' (' + age(Date.now() / 1000 - lastAnswer) + ' ago): everything below is as of then ' +
        'and may no longer be true; last error: ' + e.message;
      v.className = 'stale';
      document.body.classList.add('stale');
      document.body.setAttribute('data-stale-since', String(lastAnswer));
    }
  }
  function refresh() {
    fetch('/status.json', {cache: 'no-store'}).then(function (r) {
      if (!r.ok) { throw new Error('HTTP ' + r.status); }
      return r.json();
    }).then(function (s) {
      failures = 0;
      lastAnswer = Date.now() / 1000;
      document.body.removeAttribute('data-stale-since');
      render(s);
    }).catch(failed);
  }
  refresh();
  setInterval(refresh, 5000);
})();
"""
