"""The live page at `/`: what holds each server, the attempts with the report's timeline, and the
published snapshots — kept current by the event stream.

The page is static: it holds no ledger data, so it needs no token to load. Its script reads
`GET /v1/status` (each server's fence, the checkpoint id holding it, since when, what frees it,
the control plane it speaks),
`GET /v1/attempts`, `GET /v1/attempts/{id}/timeline` (the SVG `quiesce.tools.audit.report.gantt`
draws, every ledger string escaped there) and `GET /v1/snapshots`; then follows `GET /v1/events`
and, on each event, reads them again (at most every `REFRESH_MS`; the servers and snapshots also
every `POLL_MS`, as another process may change them) — no reload.

Rules kept here:
- The API token: when the API answers 401 the page shows only what it needs (the token the
  service was started with, `QUIESCE_API_TOKEN`) and a field for it; the token is kept in the
  tab's `sessionStorage` only, and sent as the bearer header (the stream is read with `fetch`, not
  `EventSource`, for that). A refused token is forgotten and said so.
- An attempt's id links to `#attempt=ID`, which selects it and shows its timeline (a URL to share);
  the timeline shown can be saved as its SVG.
- Cells are set with `textContent`, never as HTML. A Content-Security-Policy (sent as a header)
  allows only this script and style (by sha256) and connections to this origin: no external asset.
- For tests and operators the script states what it did in `<body>` attributes: `data-auth`
  (`unknown`, `ok`, `needed`, `refused`), `data-live` (1 while the stream is open), `data-events`
  (events received), `data-timeline` (the attempt shown), `data-status` (`idle` or `held`),
  `data-errors` (script errors).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from functools import cache
from typing import Final

from quiesce.tools.audit.report import CSS as REPORT_CSS

REFRESH_MS: Final = 150
POLL_MS: Final = 5000

CSS: Final = (
    REPORT_CSS
    + """
header { display: flex; gap: 16px; align-items: baseline; } header h1 { white-space: nowrap; }
#state { color: var(--mute); }
#state.ready { color: var(--ok); } #state.down { color: var(--bad); }
tr.selected td { background: #eef4ff; }
#attempts tr { cursor: pointer; }
td a { color: inherit; }
table.summary td.frees { white-space: normal; overflow-wrap: anywhere; min-width: 24em; }
td code { font-size: 12px; background: #f6f8fa; padding: 1px 4px; border-radius: 3px; }
.phase-idle { color: var(--ok); } .phase-held { color: var(--unk); font-weight: 600; }
.phase-down { color: var(--bad); font-weight: 600; }
.latest { color: var(--ok); font-weight: 600; }
.note { color: var(--mute); margin: 0; }
#auth { display: none; max-width: 46em; border: 1px solid #d8dee4; border-left: 4px solid var(--unk);
        padding: 4px 16px 12px; margin: 16px 0; }
#auth h2 { margin-top: 12px; }
#auth-refused { display: none; color: var(--bad); font-weight: 600; }
body[data-auth="needed"] #auth, body[data-auth="refused"] #auth { display: block; }
body[data-auth="refused"] #auth-refused { display: block; }
body[data-auth="needed"] #live, body[data-auth="refused"] #live { display: none; }
#timeline-svg { display: none; margin-left: 12px; font-size: 12px; font-weight: normal; }
body[data-timeline] #timeline-svg { display: inline; }
"""
)

SCRIPT: Final = (
    (
        """
(function () {
  "use strict";
  var REFRESH_MS = __REFRESH_MS__, POLL_MS = __POLL_MS__;
  var errors = [];
  var body = document.body;
  var selected = null, pinned = false, timer = null, lastSeq = 0, received = 0;
  var tried = false, following = false, svgUrl = null;
  function $(id) { return document.getElementById(id); }
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
  function authorized() { return body.getAttribute("data-auth") !== "needed"
                                 && body.getAttribute("data-auth") !== "refused"; }
  function unauthorized() {
    sessionStorage.removeItem("quiesce-token");
    body.setAttribute("data-auth", tried ? "refused" : "needed");
    $("token").focus();
  }
  $("token-form").addEventListener("submit", function (e) {
    e.preventDefault();
    sessionStorage.setItem("quiesce-token", $("token").value);
    $("token").value = "";
    tried = true;
    body.setAttribute("data-auth", "unknown");
    refresh().then(follow);
  });
  function api(path) {
    var sent = sessionStorage.getItem("quiesce-token");  // a 401 speaks only of the token it carried
    return fetch(path, { headers: headers(), cache: "no-store" }).then(function (r) {
      if (r.status === 401) {
        if (sessionStorage.getItem("quiesce-token") === sent) { unauthorized(); }
        throw new Error("401");
      }
      if (!r.ok) { throw new Error(path + ": " + r.status); }
      body.setAttribute("data-auth", "ok");
      return r;
    });
  }
  function json(path) { return api(path).then(function (r) { return r.json(); }); }
  function cell(tr, text, cls) {
    var td = document.createElement("td");
    td.textContent = text === null || text === undefined || text === "" ? "-" : String(text);
    if (cls) { td.className = cls; }
    tr.appendChild(td);
    return td;
  }
  function code(td, text) {
    td.textContent = "";
    var c = document.createElement("code");
    c.textContent = text;
    td.appendChild(c);
  }
  function utc(at) {
    if (!at) { return "-"; }
    var t = Date.parse(at);
    return isNaN(t) ? String(at) : new Date(t).toISOString().replace("T", " ").slice(0, 19);
  }
  function ago(at) {
    var t = Date.parse(at);
    if (!at || isNaN(t)) { return utc(at); }
    var s = Math.max(0, Math.round((Date.now() - t) / 1000));
    var d = s < 120 ? s + " s" : s < 7200 ? Math.round(s / 60) + " min" : Math.round(s / 3600) + " h";
    return utc(at) + " (" + d + " ago)";
  }
  function seconds(row) {
    if (!row.ended_at) { return "-"; }
    var s = (Date.parse(row.ended_at) - Date.parse(row.started_at)) / 1000;
    return s < 1 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(2) + " s";
  }
  function bytes(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], v = n, i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return i === 0 ? n + " B" : v.toFixed(1) + " " + units[i];
  }
  function renderStatus(s) {
    var tbody = $("servers");
    tbody.textContent = "";
    s.servers.forEach(function (srv) {
      var tr = document.createElement("tr");
      tr.setAttribute("data-server", srv.name);
      tr.setAttribute("data-held", srv.held ? "1" : "0");
      cell(tr, srv.name);
      cell(tr, srv.reachable ? srv.phase : "unreachable",
           srv.reachable ? (srv.held ? "phase-held" : "phase-idle") : "phase-down");
      cell(tr, srv.held_by);
      cell(tr, srv.holder_kind);
      cell(tr, srv.since ? ago(srv.since) : "-");
      cell(tr, srv.deadline_left_s === null ? "-" : srv.deadline_left_s.toFixed(1) + " s", "num");
      var frees = cell(tr, srv.error, "frees");
      if (srv.frees) { code(frees, srv.frees); }
      cell(tr, srv.plane || "v1");
      tbody.appendChild(tr);
    });
    var held = s.servers.filter(function (srv) { return srv.held; }).length;
    var down = s.servers.filter(function (srv) { return !srv.reachable; }).length;
    $("servers-summary").textContent = s.idle
      ? "all " + s.servers.length + " servers idle: nothing holds them"
      : held + " of " + s.servers.length + " servers held" + (down ? ", " + down + " unreachable" : "")
        + (s.unfinished.length ? "; unfinished in the ledger: " + s.unfinished.join(", ") : "");
    body.setAttribute("data-status", s.idle ? "idle" : "held");
  }
  function renderSnapshots(list) {
    var tbody = $("snapshots");
    tbody.textContent = "";
    list.slice().reverse().forEach(function (snap) {
      var tr = document.createElement("tr");
      tr.setAttribute("data-snapshot", snap.id);
      tr.setAttribute("data-latest", snap.latest ? "1" : "0");
      cell(tr, snap.id);
      cell(tr, utc(snap.created));
      cell(tr, bytes(snap.size), "num");
      cell(tr, snap.files, "num");
      cell(tr, snap.participants.join(", "));
      cell(tr, snap.latest ? "LATEST" : "", snap.latest ? "latest" : "");
      tbody.appendChild(tr);
    });
    $("snapshots-summary").textContent = list.length
      ? list.length + " published, newest first"
      : "no snapshot published yet";
  }
  function renderRows(rows) {
    var tbody = $("attempts");
    tbody.textContent = "";
    rows.slice().reverse().forEach(function (row) {
      var tr = document.createElement("tr");
      tr.setAttribute("data-checkpoint-id", row.checkpoint_id);
      tr.setAttribute("data-outcome", row.outcome || "open");
      tr.setAttribute("data-state", row.state);
      if (row.checkpoint_id === selected) { tr.className = "selected"; }
      var outcome = row.outcome || "open (" + row.state + ")";
      var known = ["published", "restored", "resumed", "aborted", "abandoned"];
      var id = cell(tr, "");
      var link = document.createElement("a");
      link.href = "#attempt=" + encodeURIComponent(row.checkpoint_id);
      link.textContent = row.checkpoint_id;
      id.textContent = "";
      id.appendChild(link);
      cell(tr, row.kind);
      cell(tr, outcome, "outcome-" + (known.indexOf(row.outcome) >= 0 ? row.outcome : "open"));
      cell(tr, utc(row.started_at));
      cell(tr, seconds(row), "num");
      cell(tr, row.participants.length, "num");
      cell(tr, row.calls, "num");
      cell(tr, row.failures, "num");
      tr.addEventListener("click", function (e) {
        if (e.target !== link) { location.hash = link.getAttribute("href"); }
      });
      tbody.appendChild(tr);
    });
    $("attempts-summary").textContent = rows.length ? "" : "no attempt yet";
    if (selected === null && rows.length) { selected = rows[rows.length - 1].checkpoint_id; }
  }
  function renderTimeline() {
    var title = $("timeline-title");
    if (selected === null) {
      title.textContent = "no attempt yet";
      return Promise.resolve();
    }
    return api("/v1/attempts/" + encodeURIComponent(selected) + "/timeline").then(function (r) {
      return r.text();
    }).then(function (svg) {
      title.textContent = "timeline of " + selected;
      $("timeline").innerHTML = svg;  /* drawn by the server's report code: every ledger string escaped */
      if (svgUrl) { URL.revokeObjectURL(svgUrl); }
      svgUrl = URL.createObjectURL(new Blob([svg], { type: "image/svg+xml" }));
      var save = $("timeline-svg");
      save.href = svgUrl;
      save.setAttribute("download", selected + ".svg");
      body.setAttribute("data-timeline", selected);
    });
  }
  function state() {
    return fetch("/readyz", { cache: "no-store" }).then(function (r) { return r.json(); }).then(function (s) {
      var el = $("state");
      el.textContent = s.state + (s.busy ? " — " + s.busy : "") + (s.epoch ? " — epoch " + s.epoch : "");
      el.className = s.ready ? "ready" : (s.state === "standby" ? "" : "down");
    });
  }
  function quiet(e) {
    if (String(e.message) !== "401") { body.setAttribute("data-last-error", String(e)); }
  }
  function poll() {
    return Promise.all([
      json("/v1/status").then(renderStatus),
      json("/v1/snapshots").then(renderSnapshots)
    ]).catch(quiet);
  }
  function refresh() {
    timer = null;
    return Promise.all([
      json("/v1/attempts?limit=50").then(renderRows).then(renderTimeline).catch(quiet),
      poll(),
      state().catch(quiet)
    ]);
  }
  function soon(event) {
    if (event && event.checkpoint_id && !pinned) { selected = event.checkpoint_id; }
    if (timer === null) { timer = setTimeout(refresh, REFRESH_MS); }
  }
  function chosen() {
    var m = /^#attempt=(.+)$/.exec(location.hash);
    if (!m) { return; }
    selected = decodeURIComponent(m[1]);
    pinned = true;
    refresh().then(function () { $("timeline-section").scrollIntoView(); });
  }
  window.addEventListener("hashchange", chosen);
  function follow() {
    if (following || !authorized()) { return; }
    following = true;
    var h = headers();
    if (lastSeq) { h["Last-Event-ID"] = String(lastSeq); }
    fetch("/v1/events", { headers: h, cache: "no-store" }).then(function (r) {
      if (r.status === 401) { following = false; unauthorized(); return; }
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
      following = false;
      body.setAttribute("data-live", "0");
      body.setAttribute("data-last-error", String(e));
      setTimeout(function () { refresh().then(follow); }, 1000);
    });
  }
  setInterval(function () { if (authorized()) { poll(); } }, POLL_MS);
  body.setAttribute("data-errors", JSON.stringify(errors));
  chosen();
  refresh().then(follow);
})();
"""
    )
    .replace("__REFRESH_MS__", str(REFRESH_MS))
    .replace("__POLL_MS__", str(POLL_MS))
)

BODY: Final = """<body data-auth="unknown" data-live="0" data-events="0">
<header><h1>quiesce — live</h1><span id="state">connecting…</span></header>
<section id="auth"><h2>This page needs the service's API token</h2>
<p>This service was started with an API token (<code>QUIESCE_API_TOKEN</code>), and shows nothing
without it. Paste that token below: it is kept in this browser tab only (<code>sessionStorage</code>)
and sent only to this service, as <code>Authorization: Bearer …</code>.</p>
<p id="auth-refused">The service refused that token: check the value of <code>QUIESCE_API_TOKEN</code>
where <code>quiesce serve</code> runs.</p>
<form id="token-form"><label>API token <input id="token" type="password" autocomplete="off"></label>
<button type="submit">use it</button></form></section>
<main id="live">
<section><h2>Servers</h2><p class="note" id="servers-summary">loading…</p>
<table class="summary"><thead><tr><th>server</th><th>phase</th><th>held by</th><th>kind</th>
<th>since (UTC)</th><th>deadline left</th><th>what frees it</th><th>plane</th></tr></thead>
<tbody id="servers"></tbody></table></section>
<section><h2>Attempts</h2><p class="note" id="attempts-summary">loading…</p>
<table class="summary"><thead><tr><th>attempt</th><th>kind</th><th>outcome</th><th>started (UTC)</th>
<th>duration</th><th>participants</th><th>calls</th><th>failures</th></tr></thead>
<tbody id="attempts"></tbody></table></section>
<section class="attempt" id="timeline-section"><h2><span id="timeline-title">loading…</span>
<a id="timeline-svg">save as SVG</a></h2><div id="timeline"></div>
<p class="legend"><span class="sw-ack"></span>acknowledged<span class="sw-fail"></span>failed
<span class="sw-unk"></span>unknown<span class="sw-comp"></span>rollback / recovery
<span class="sw-dead"></span>deadline<span class="sw-rec"></span>recovery action</p></section>
<section><h2>Snapshots</h2><p class="note" id="snapshots-summary">loading…</p>
<table class="summary"><thead><tr><th>snapshot</th><th>created (UTC)</th><th>size</th><th>files</th>
<th>participants</th><th>latest</th></tr></thead><tbody id="snapshots"></tbody></table></section>
</main>
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
