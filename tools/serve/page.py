"""The live page at `/`: the attempts table and the report's timeline, kept current by the event stream.

The page is static: it holds no ledger data, so it needs no token to load. Its script reads
`GET /v1/attempts` and `GET /v1/attempts/{id}/timeline` (the SVG `quiesce.tools.audit.report.gantt`
draws, every ledger string escaped there), then follows `GET /v1/events` and, on each event,
re-reads the table and the timeline of the attempt the event concerns (at most every
`REFRESH_MS`) — no reload. It reads the stream with `fetch` (not `EventSource`) so it can send the
API token, which it asks for when the API answers 401 and keeps in `sessionStorage` only.

Table cells are set with `textContent`, never as HTML. A Content-Security-Policy (sent as a
header) allows only this script and style (by sha256) and connections to this origin. For tests
and operators alike the script states what it did in `<body>` attributes: `data-live` (1 while
the stream is open), `data-events` (events received), `data-errors` (script errors).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from functools import cache
from typing import Final

from quiesce.tools.audit.report import CSS as REPORT_CSS

REFRESH_MS: Final = 150

CSS: Final = (
    REPORT_CSS
    + """
header { display: flex; gap: 16px; align-items: baseline; }
#state { color: var(--mute); }
#state.ready { color: var(--ok); } #state.down { color: var(--bad); }
tr.selected td { background: #eef4ff; }
tbody tr { cursor: pointer; }
#token-form { display: none; margin: 8px 0; }
#token-form.shown { display: block; }
"""
)

SCRIPT: Final = (
    """
(function () {
  "use strict";
  var REFRESH_MS = __REFRESH_MS__;
  var errors = [];
  var body = document.body;
  var selected = null, pinned = false, timer = null, lastSeq = 0, received = 0;
  function record(message) {
    errors.push(String(message));
    body.setAttribute("data-errors", JSON.stringify(errors));
  }
  window.addEventListener("error", function (e) { record(e.message || "error"); });
  window.addEventListener("securitypolicyviolation", function (e) { record("csp: " + e.violatedDirective); });
  function headers() {
    var token = sessionStorage.getItem("quiesce-token");
    return token ? { "Authorization": "Bearer " + token } : {};
  }
  function askToken() { document.getElementById("token-form").className = "shown"; }
  document.getElementById("token-form").addEventListener("submit", function (e) {
    e.preventDefault();
    sessionStorage.setItem("quiesce-token", document.getElementById("token").value);
    document.getElementById("token-form").className = "";
    refresh(); follow();
  });
  function api(path) {
    return fetch(path, { headers: headers(), cache: "no-store" }).then(function (r) {
      if (r.status === 401) { askToken(); throw new Error("401"); }
      if (!r.ok) { throw new Error(path + ": " + r.status); }
      return r;
    });
  }
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    td.textContent = text === null || text === undefined ? "-" : String(text);
    if (cls) { td.className = cls; }
    tr.appendChild(td);
  }
  function seconds(row) {
    if (!row.ended_at) { return "-"; }
    var s = (Date.parse(row.ended_at) - Date.parse(row.started_at)) / 1000;
    return s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
  }
  function renderRows(rows) {
    var tbody = document.getElementById("attempts");
    tbody.textContent = "";
    rows.slice().reverse().forEach(function (row) {
      var tr = document.createElement("tr");
      tr.setAttribute("data-checkpoint-id", row.checkpoint_id);
      tr.setAttribute("data-outcome", row.outcome || "open");
      tr.setAttribute("data-state", row.state);
      if (row.checkpoint_id === selected) { tr.className = "selected"; }
      var outcome = row.outcome || "open (" + row.state + ")";
      var known = ["published", "restored", "resumed", "aborted", "abandoned"];
      cell(tr, row.checkpoint_id);
      cell(tr, row.kind);
      cell(tr, outcome, "outcome-" + (known.indexOf(row.outcome) >= 0 ? row.outcome : "open"));
      cell(tr, row.started_at.replace("T", " ").slice(0, 23));
      cell(tr, seconds(row), "num");
      cell(tr, row.participants.length, "num");
      cell(tr, row.calls, "num");
      cell(tr, row.failures, "num");
      tr.addEventListener("click", function () { selected = row.checkpoint_id; pinned = true; refresh(); });
      tbody.appendChild(tr);
    });
    if (selected === null && rows.length) { selected = rows[rows.length - 1].checkpoint_id; }
  }
  function renderTimeline() {
    var title = document.getElementById("timeline-title");
    var box = document.getElementById("timeline");
    if (selected === null) { return Promise.resolve(); }
    return api("/v1/attempts/" + encodeURIComponent(selected) + "/timeline").then(function (r) {
      return r.text();
    }).then(function (svg) {
      title.textContent = selected;
      box.innerHTML = svg;  /* drawn by the server's report code: every ledger string escaped */
      body.setAttribute("data-timeline", selected);
    });
  }
  function state() {
    return fetch("/readyz", { cache: "no-store" }).then(function (r) { return r.json(); }).then(function (s) {
      var el = document.getElementById("state");
      el.textContent = s.state + (s.busy ? " — " + s.busy : "") + (s.epoch ? " — epoch " + s.epoch : "");
      el.className = s.ready ? "ready" : (s.state === "standby" ? "" : "down");
    });
  }
  function refresh() {
    timer = null;
    return Promise.all([
      api("/v1/attempts?limit=50").then(function (r) { return r.json(); })
        .then(renderRows).then(renderTimeline),
      state()
    ]).catch(function (e) {
      if (String(e.message) !== "401") { body.setAttribute("data-last-error", String(e)); }
    });
  }
  function soon(event) {
    if (event && event.checkpoint_id && !pinned) { selected = event.checkpoint_id; }
    if (timer === null) { timer = setTimeout(refresh, REFRESH_MS); }
  }
  function follow() {
    var h = headers();
    if (lastSeq) { h["Last-Event-ID"] = String(lastSeq); }
    fetch("/v1/events", { headers: h, cache: "no-store" }).then(function (r) {
      if (r.status === 401) { askToken(); return; }
      if (!r.ok || !r.body) { throw new Error("events: " + r.status); }
      body.setAttribute("data-live", "1");
      var reader = r.body.getReader(), decoder = new TextDecoder(), buffer = "";
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) { throw new Error("stream ended"); }
          buffer += decoder.decode(chunk.value, { stream: true });
          var parts = buffer.split("\\n\\n");
          buffer = parts.pop();
          parts.forEach(function (block) {
            var data = null, id = null;
            block.split("\\n").forEach(function (line) {
              if (line.indexOf("data: ") === 0) { data = line.slice(6); }
              else if (line.indexOf("id: ") === 0) { id = line.slice(4); }
            });
            if (data === null) { return; }
            if (id) { lastSeq = Math.max(lastSeq, parseInt(id, 10) || 0); }
            received += 1;
            body.setAttribute("data-events", String(received));
            soon(JSON.parse(data));
          });
          return pump();
        });
      }
      return pump();
    }).catch(function (e) {
      body.setAttribute("data-live", "0");
      body.setAttribute("data-last-error", String(e));
      setTimeout(function () { refresh(); follow(); }, 1000);
    });
  }
  body.setAttribute("data-errors", JSON.stringify(errors));
  refresh().then(follow);
})();
"""
).replace("__REFRESH_MS__", str(REFRESH_MS))

BODY: Final = """<body data-live="0" data-events="0">
<header><h1>quiesce — live</h1><span id="state">connecting…</span></header>
<form id="token-form"><label>API token <input id="token" type="password" autocomplete="off"></label>
<button type="submit">use</button></form>
<table class="summary"><thead><tr><th>attempt</th><th>kind</th><th>outcome</th><th>started (UTC)</th>
<th>duration</th><th>participants</th><th>calls</th><th>failures</th></tr></thead>
<tbody id="attempts"></tbody></table>
<section class="attempt"><h2 id="timeline-title">no attempt yet</h2><div id="timeline"></div>
<p class="legend"><span class="sw-ack"></span>acknowledged<span class="sw-fail"></span>failed
<span class="sw-unk"></span>unknown<span class="sw-comp"></span>rollback / recovery
<span class="sw-dead"></span>deadline<span class="sw-rec"></span>recovery action</p></section>
"""


@dataclass(frozen=True)
class Page:
    html: str
    csp: str


def _sha256_b64(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


@cache
def render_page() -> Page:
    """The page and its Content-Security-Policy (built once)."""
    csp = (
        f"default-src 'none'; script-src 'sha256-{_sha256_b64(SCRIPT)}';"
        f" style-src 'sha256-{_sha256_b64(CSS)}'; connect-src 'self'; img-src data:; base-uri 'none';"
        " form-action 'none'; frame-ancestors 'none'"
    )
    html = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>quiesce — live</title><style>{CSS}</style></head>"
        f"{BODY}<script>{SCRIPT}</script></body></html>\n"
    )
    return Page(html, csp)
