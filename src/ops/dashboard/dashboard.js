// The sluice dashboard: polls the admin API (/admin/stats, /admin/deny, /admin/top,
// /admin/fleet, and /admin/config when the configuration changed) and draws what
// it reads. Every time shown is UTC, and says so. Every
// value from the server goes into the page as text (textContent, attributes set
// through the DOM), never as markup: route names and deny reasons are written by
// operators and, through the API, possibly by anyone holding a token.
"use strict";

(() => {
  const TOKEN_KEY = "sluice-admin-token";
  const POLL_MS = 1000;
  const SVG = "http://www.w3.org/2000/svg";
  // The decisions drawn as lines; the rest add up to "other".
  const LINES = [
    ["allowed", "allowed"],
    ["limited", "limited"],
    ["denied", "denied"],
    ["other", "other"],
    ["errors", "upstream errors"],
  ];
  // The upstream's columns of a route's history: its answers by class, and the
  // requests it did not answer. Never counted in "other" (they are not decisions).
  const UPSTREAM = ["upstream_2xx", "upstream_3xx", "upstream_4xx", "upstream_5xx", "upstream_failed"];
  // Always shown; the other decisions only once they happened, in this order.
  const MAIN = ["allowed", "limited", "denied"];
  const ORDER = [...MAIN, "delayed", "shadow", "store_error_allowed", "store_error_denied", "bad_request", "unauthorized"];

  const $ = (id) => document.getElementById(id);
  let token = sessionStorage.getItem(TOKEN_KEY) || "";
  let configHash = null;
  let config = null;
  let timer = null;
  let stopped = false;
  const routeViews = new Map();

  // === DOM helpers ===

  // el("div", {class: "x", dataset: {route: name}}, "text", child...)
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    setAttrs(e, attrs);
    for (const c of children) {
      if (c === null || c === undefined) continue;
      e.append(typeof c === "string" || typeof c === "number" ? String(c) : c);
    }
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    setAttrs(e, attrs);
    return e;
  }

  function setAttrs(e, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "dataset") Object.assign(e.dataset, v);
      else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
  }

  function clear(e) {
    while (e.firstChild) e.removeChild(e.firstChild);
  }

  function row(dl, term, ...value) {
    dl.append(el("dt", null, term), el("dd", null, ...value));
  }

  function badge(ok, yes, no) {
    return el("span", { class: ok ? "badge ok" : "badge bad" }, ok ? yes : no);
  }

  // "2026-11-26 22:03:04 UTC" from an RFC 3339 time or milliseconds since the epoch.
  function utc(t) {
    const d = new Date(typeof t === "number" ? t : Date.parse(t));
    if (Number.isNaN(d.getTime())) return "";
    return `${d.toISOString().slice(0, 19).replace("T", " ")} UTC`;
  }

  // "22:03:04 UTC".
  function utcTime(t) {
    return utc(t).slice(11);
  }

  // === banners across the page ===

  function showBanner(id, text) {
    let b = document.getElementById(`banner-${id}`);
    if (!b) {
      b = el("div", { id: `banner-${id}`, class: "banner", role: "alert" });
      $("banners").append(b);
    }
    if (b.textContent !== text) b.textContent = text;
  }

  function hideBanner(id) {
    const b = document.getElementById(`banner-${id}`);
    if (b) b.remove();
  }

  function ago(iso, nowMs) {
    const t = Date.parse(iso);
    if (!Number.isFinite(t)) return "";
    const s = Math.round((nowMs - t) / 1000);
    return s >= 0 ? `${duration(s)} ago` : `in ${duration(-s)}`;
  }

  function duration(s) {
    if (s < 60) return `${s}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
    if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
    return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
  }

  function rate(r) {
    if (Number.isInteger(r)) return String(r);
    if (r >= 100) return r.toFixed(0);
    if (r >= 10) return r.toFixed(1);
    return r.toFixed(2);
  }

  // === the admin API ===

  class Unauthorized extends Error {}

  async function api(method, path, body) {
    const headers = {};
    if (token) headers.Authorization = `Bearer ${token}`;
    const init = { method, headers, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const r = await fetch(path, init);
    if (r.status === 401) throw new Unauthorized("the admin API wants a (valid) token");
    return r;
  }

  async function getJson(path) {
    const r = await api("GET", path);
    if (!r.ok) throw new Error(`${path}: ${r.status} ${(await r.text()).trim()}`);
    return r.json();
  }

  // === polling ===

  async function refresh() {
    const [stats, deny, top, fleet] = await Promise.all([
      getJson("/admin/stats"),
      getDenyPage(),
      getTop(),
      getFleet(),
    ]);
    if (stats.config.hash !== configHash) {
      const c = await getJson("/admin/config");
      config = c.config;
      configHash = stats.config.hash;
      buildRoutes(config.routes || []);
    }
    $("version").textContent = `v${stats.version}`;
    renderStore(stats);
    renderConfig(stats);
    renderUnmatched(stats.unmatched);
    renderRoutes(stats);
    renderTop(top);
    renderFleet(fleet);
    renderBanners(stats, fleet);
    renderDeny(deny);
  }

  // The fleet view every few seconds (its heartbeats come every 2 s).
  const FLEET_EVERY_MS = 3000;
  let fleetAt = 0;
  let fleetLast = null;

  // The top offenders: summed over the fleet once the last fleet view saw more
  // than one live instance on Redis (this instance's own if that cannot be read).
  async function getTop() {
    if (fleetLast && fleetLast.store === "redis" && fleetLast.live > 1) {
      const r = await api("GET", "/admin/top?n=50&scope=fleet");
      if (r.ok) return { rows: await r.json(), fleet: fleetLast.live };
    }
    return { rows: await getJson("/admin/top?n=50"), fleet: 0 };
  }

  async function getFleet() {
    const now = Date.now();
    if (fleetLast && now - fleetAt < FLEET_EVERY_MS) return fleetLast;
    fleetLast = await getJson("/admin/fleet");
    fleetAt = now;
    return fleetLast;
  }

  function renderBanners(stats, fleet) {
    const last = stats.config.last_reload;
    if (last && last.result !== "success") {
      let first = String(last.error || "").split("\n")[0].trim();
      if (!/[.!?]$/.test(first)) first += ".";
      showBanner(
        "reload",
        `The last reload failed (${utc(last.at)}, via ${last.trigger}): ${first} The configuration loaded ${utc(stats.config.loaded_at)} is still serving.`
      );
    } else hideBanner("reload");
    if (!stats.ready) {
      showBanner("ready", `Not ready (/readyz answers 503): ${stats.not_ready.join(", ")}.`);
    } else hideBanner("ready");
    if (stats.store.degraded) {
      showBanner("degraded", `Degraded: ${stats.store.degraded}.`);
    } else hideBanner("degraded");
    if (fleet && fleet.consistent === false) {
      showBanner(
        "fleet",
        `The fleet runs ${fleet.config_hashes} different configurations: an instance has not reloaded (see Fleet).`
      );
    } else hideBanner("fleet");
  }

  async function poll() {
    timer = null;
    if (stopped) return;
    try {
      await refresh();
      showApp();
      $("status").textContent = `updated ${utcTime(Date.now())}`;
      $("status").className = "muted";
    } catch (e) {
      if (e instanceof Unauthorized) {
        showLogin(token ? "That token was refused." : "");
        return;
      }
      $("status").textContent = `admin API: ${e.message}`;
      $("status").className = "error";
    }
    timer = setTimeout(poll, POLL_MS);
  }

  function restart() {
    stopped = false;
    if (timer) clearTimeout(timer);
    poll();
  }

  function showApp() {
    $("login").hidden = true;
    $("app").hidden = false;
    $("forget").hidden = !token;
  }

  function showLogin(message) {
    stopped = true;
    if (timer) clearTimeout(timer);
    timer = null;
    $("app").hidden = true;
    $("login").hidden = false;
    $("forget").hidden = true;
    $("login-error").textContent = message;
    $("status").textContent = "";
    $("token").focus();
  }

  // === store, configuration, unmatched ===

  function renderStore(stats) {
    const s = stats.store;
    const dl = $("store");
    clear(dl);
    row(dl, "backend", s.backend);
    row(dl, "health", badge(s.ready, "answers", "unavailable"));
    row(dl, "/readyz", badge(stats.ready, "ready", `not ready: ${stats.not_ready.join(", ")}`));
    row(dl, "store errors", el("span", { class: s.errors > 0 ? "error" : "" }, s.errors));
    row(dl, "on_error", s.on_error);
    if (s.degraded) row(dl, "degraded", el("span", { class: "error degraded" }, s.degraded));
    const d = stats.deny_entries;
    row(dl, "deny entries", `${d.static} static · ${d.api} api · ${d.ban} ban`);
  }

  function renderConfig(stats) {
    const c = stats.config;
    const dl = $("config");
    clear(dl);
    row(dl, "hash", el("code", null, c.hash.slice(0, 12)));
    row(dl, "loaded", `${utc(c.loaded_at)} (${ago(c.loaded_at, stats.now_ms)})`);
    const last = c.last_reload;
    if (!last) {
      row(dl, "last reload", el("span", { class: "muted" }, "none since start"));
    } else {
      const ok = last.result === "success";
      row(
        dl,
        "last reload",
        badge(ok, "success", "failure"),
        ` via ${last.trigger}, ${utc(last.at)} (${ago(last.at, stats.now_ms)})`
      );
      if (!ok) row(dl, "error", el("pre", { class: "error", id: "reload-error" }, last.error));
    }
    row(dl, "reloads", `${c.reloads.success} succeeded · ${c.reloads.failure} failed`);
  }

  function renderUnmatched(u) {
    const dl = $("unmatched");
    clear(dl);
    row(dl, "no route (404)", el("span", { class: "n", dataset: { decision: "unmatched" } }, u.totals.unmatched));
    row(dl, "denied by IP", el("span", { class: "n", dataset: { decision: "denied" } }, u.totals.denied));
    row(dl, "bad requests", el("span", { class: "n", dataset: { decision: "bad_request" } }, u.totals.bad_request));
  }

  // === routes ===

  function limitText(l, i) {
    const name = l.name || `${l.algorithm}_${i}`;
    const parts = [];
    if (l.limit !== null && l.limit !== undefined) parts.push(`limit ${l.limit}`);
    if (l.window) parts.push(`per ${l.window}`);
    if (l.rate) parts.push(`rate ${l.rate}`);
    if (l.burst !== null && l.burst !== undefined) parts.push(`burst ${l.burst}`);
    if (l.lease) parts.push(`lease ${l.lease}`);
    if (l.cost !== null && l.cost !== undefined) parts.push(costText(l.cost));
    if (l.count && Array.isArray(l.count.status)) parts.push(`counts answers ${l.count.status.join(", ")}`);
    return el(
      "li",
      { dataset: { limit: name } },
      el("b", null, name),
      " ",
      el("span", { class: "algo" }, l.algorithm),
      ` ${parts.join(", ")}`
    );
  }

  // A cost is units, or what a response header says (`{response_header, default}`).
  function costText(c) {
    if (typeof c !== "object") return `cost ${c}`;
    if (c.response_header) {
      const d = c.default !== null && c.default !== undefined ? c.default : 1;
      return `cost from response header ${c.response_header} (default ${d})`;
    }
    return `cost ${JSON.stringify(c)}`;
  }

  function matchText(m) {
    const parts = [];
    if (m.host) parts.push(`host ${m.host}`);
    if (m.methods) parts.push(m.methods.join(","));
    if (m.path) parts.push(`path ${m.path}`);
    if (m.path_prefix) parts.push(`prefix ${m.path_prefix}`);
    if (m.path_regex) parts.push(`regex ${m.path_regex}`);
    if (m.headers) {
      for (const [k, v] of Object.entries(m.headers)) parts.push(`${k}: ${v}`);
    }
    if (m.case_insensitive) parts.push("(any case)");
    return parts.length ? parts.join(" · ") : "everything";
  }

  function keyText(k) {
    return Array.isArray(k) ? k.join(" + ") : String(k);
  }

  function buildRoutes(routes) {
    const box = $("routes");
    clear(box);
    routeViews.clear();
    if (routes.length === 0) box.append(el("p", { class: "muted" }, "No routes."));
    for (const r of routes) {
      const info = el("dl", { class: "route-info" });
      row(info, "match", matchText(r.match || {}));
      if (r.upstream) row(info, "upstream", r.upstream);
      if (r.respond) row(info, "responds", `${r.respond.status}`);
      row(info, "key", keyText(r.key));
      const flags = [];
      if (r.on_limit === "delay") flags.push(`delay up to ${r.max_delay}`);
      if (r.shadow) flags.push("shadow (never refuses)");
      if (r.ban) flags.push(`ban after ${r.ban.after} in ${r.ban.within} for ${r.ban.for}`);
      if (flags.length) row(info, "on limit", flags.join(" · "));
      const limits = el("ul", { class: "limits" });
      (r.limits || []).forEach((l, i) => limits.append(limitText(l, i)));
      if (!r.limits || r.limits.length === 0) limits.append(el("li", { class: "muted" }, "no limits"));
      const tiers = (r.overrides || []).length;
      if (tiers) limits.append(el("li", { class: "muted" }, `+ ${tiers} override tier${tiers > 1 ? "s" : ""}`));

      const counters = el("div", { class: "counters" });
      const chart = svg("svg", { class: "chart", viewBox: "0 0 320 90", preserveAspectRatio: "none" });
      const top = el("span", { class: "tick top" });
      const startTick = el("span", { class: "tick start" }, "-5m");
      const endTick = el("span", { class: "tick end" }, "now");
      const plot = el("div", { class: "plot" }, chart, top, startTick, endTick);
      const longChart = svg("svg", { class: "chart", viewBox: "0 0 320 90", preserveAspectRatio: "none" });
      const longTop = el("span", { class: "tick top" });
      const longStart = el("span", { class: "tick start" }, "-2h");
      const longEnd = el("span", { class: "tick end" }, "now");
      const longPlot = el("div", { class: "plot" }, longChart, longTop, longStart, longEnd);
      // What the upstream answered, and what sluice could not forward.
      const upstream = el("div", { class: "upstream small" });
      const byLimit = el("div", { class: "by-limit small" });
      const offenders = el("div", { class: "offenders" });
      const legend = el("div", { class: "legend" });
      for (const [key, label] of LINES) legend.append(el("span", { class: `key ${key}` }, label));
      const card = el(
        "article",
        { class: "card route", dataset: { route: r.name } },
        el("div", { class: "route-head" }, el("h3", null, r.name)),
        el("div", { class: "route-body" },
          el("div", { class: "route-left" }, info, limits, byLimit),
          el("div", { class: "route-right" }, counters, upstream, plot, longPlot, legend)),
        offenders
      );
      box.append(card);
      routeViews.set(r.name, {
        counters, chart, top, startTick, endTick, longChart, longTop, longStart, longEnd,
        upstream, byLimit, offenders, cells: new Map(), topShown: null,
        isUpstream: Boolean(r.upstream), hasLimits: Boolean(r.limits && r.limits.length),
      });
    }
  }

  function renderRoutes(stats) {
    for (const r of stats.routes) {
      const v = routeViews.get(r.name);
      if (!v) continue;
      const samples = series(r.history, withUpstream(r), stats.now_ms);
      const rates = lastRates(samples);
      for (const d of ORDER.filter((d) => d in r.totals)) {
        const n = r.totals[d];
        let cell = v.cells.get(d);
        if (!cell) {
          const num = el("div", { class: "n" });
          const per = el("div", { class: "rate" });
          cell = { box: el("div", { class: `counter ${d}`, dataset: { decision: d } }, num, el("div", { class: "label" }, d.replaceAll("_", " ")), per), num, per };
          v.cells.set(d, cell);
          v.counters.append(cell.box);
        }
        cell.box.hidden = !MAIN.includes(d) && n === 0;
        cell.num.textContent = String(n);
        cell.per.textContent = `${rate(rates[d] || 0)}/s`;
      }
      // Beside the decisions: the requests the upstream failed (answered 5xx or not
      // at all), which "allowed" counts too.
      if (v.isUpstream && r.upstream) {
        const n = upstreamErrors(r);
        let cell = v.cells.get("upstream_errors");
        if (!cell) {
          const num = el("div", { class: "n" });
          const per = el("div", { class: "rate" });
          cell = { box: el("div", { class: "counter errors", dataset: { decision: "upstream_errors" } }, num, el("div", { class: "label" }, "upstream errors"), per), num, per };
          v.cells.set("upstream_errors", cell);
          v.counters.append(cell.box);
        }
        cell.box.hidden = n === 0;
        cell.num.textContent = String(n);
        cell.per.textContent = `${rate((rates.upstream_5xx || 0) + (rates.upstream_failed || 0))}/s`;
      }
      v.top.textContent = `${drawChart(v.chart, samples, stats.now_ms, stats.keep_ms)}/s · last 5 minutes`;
      v.startTick.textContent = utcTime(stats.now_ms - stats.keep_ms);
      v.endTick.textContent = `${utcTime(stats.now_ms)} (now)`;
      if (r.long_history) {
        const long = series(r.long_history, withUpstream(r), stats.now_ms);
        v.longTop.textContent = `${drawChart(v.longChart, long, stats.now_ms, stats.long_keep_ms)}/s · last 2 hours, a point a minute`;
        v.longStart.textContent = utcTime(stats.now_ms - stats.long_keep_ms);
        v.longEnd.textContent = `${utcTime(stats.now_ms)} (now)`;
      }
      renderUpstream(v, r);
      renderByLimit(v, r);
    }
  }

  // A route's totals with its upstream's columns (`UPSTREAM`), for its charts.
  function withUpstream(r) {
    const t = { ...r.totals };
    if (r.upstream && r.history && "upstream_5xx" in r.history) {
      t.upstream_2xx = r.upstream["2xx"];
      t.upstream_3xx = r.upstream["3xx"];
      t.upstream_4xx = r.upstream["4xx"];
      t.upstream_5xx = r.upstream["5xx"];
      const e = r.upstream_errors;
      t.upstream_failed = e.connect + e.timeout + e.reset + e.busy;
    }
    return t;
  }

  // Since start: answered 5xx, or not answered.
  function upstreamErrors(r) {
    const e = r.upstream_errors;
    return r.upstream["5xx"] + e.connect + e.timeout + e.reset + e.busy;
  }

  function renderUpstream(v, r) {
    clear(v.upstream);
    if (!v.isUpstream || !r.upstream) return;
    // The chips count the last minutes (the history kept), so an incident's red
    // goes once it is over; the totals since start are in their titles.
    const recent = r.upstream_recent || {};
    const u = r.upstream;
    const e = r.upstream_errors;
    v.upstream.append(el("span", { class: "muted" }, "upstream answered, last 5 min "));
    for (const c of ["2xx", "3xx", "4xx", "5xx"]) {
      const n = recent[c] || 0;
      const bad = c === "5xx" && n > 0;
      v.upstream.append(
        el("span", { class: `status s${c[0]}${bad ? " bad" : ""}`, dataset: { code: c }, title: `${u[c]} since start` }, `${c} ${n}`)
      );
    }
    const failed = recent.failed || 0;
    const total = e.connect + e.timeout + e.reset + e.busy;
    v.upstream.append(
      el(
        "span",
        { class: `status failed${failed > 0 ? " bad" : ""}`, dataset: { code: "failed" }, title: `${total} since start` },
        `not answered ${failed}`
      )
    );
    if (total > 0) {
      v.upstream.append(
        el("span", { class: "muted" }, ` (since start: connect ${e.connect}, timeout ${e.timeout}, reset ${e.reset}, busy ${e.busy})`)
      );
    }
    // Each target, in use or left out (`max_fails`, `health_check`).
    const targets = r.upstream_targets || [];
    if (targets.length) {
      const list = el("div", { class: "targets" }, el("span", { class: "muted" }, "targets "));
      for (const t of targets) {
        list.append(
          el("span", { class: `target${t.healthy ? "" : " bad"}`, dataset: { target: t.target, state: t.state } }, `${t.target} ${t.state}`),
          " "
        );
      }
      v.upstream.append(list);
    }
  }

  function renderByLimit(v, r) {
    clear(v.byLimit);
    const names = Object.keys(r.refused_by_limit || {});
    if (!names.length) return;
    v.byLimit.append(el("div", { class: "muted" }, "refused (429) by limit"));
    const ul = el("ul", { class: "by-limit-list" });
    for (const n of names) {
      ul.append(el("li", { dataset: { limit: n } }, el("b", null, r.refused_by_limit[n]), ` ${n}`));
    }
    v.byLimit.append(ul);
  }

  // === top offenders, with deny buttons ===

  function renderTop({ rows, fleet }) {
    const scope = fleet ? `summed over the fleet's ${fleet} live instances` : "this instance";
    const byRoute = new Map();
    for (const row of rows) {
      if (!byRoute.has(row.route)) byRoute.set(row.route, []);
      byRoute.get(row.route).push(row);
    }
    // Envoy's rate limit service: each domain with refusals, a card of its own.
    for (const name of byRoute.keys()) {
      if (name.startsWith("rls:") && !routeViews.has(name)) addRlsDomain(name);
    }
    for (const [name, v] of routeViews) {
      if (!v.hasLimits) continue;
      const mine = (byRoute.get(name) || []).slice(0, 10);
      const text = JSON.stringify([scope, mine.map((r) => [r.key, r.ip, r.refused, r.allowed, r.denied || null])]);
      if (text === v.topShown) continue;
      v.topShown = text;
      drawOffenders(name, v, mine, scope);
    }
  }

  // A domain of Envoy's rate limit service (`rls:DOMAIN` in /admin/top): its top
  // offenders only, with the same deny buttons as a route's.
  function addRlsDomain(name) {
    const offenders = el("div", { class: "offenders" });
    $("routes").append(el(
      "article",
      { class: "card route rls", dataset: { route: name } },
      el("div", { class: "route-head" }, el("h3", null, name),
        el("span", { class: "muted small" }, " Envoy's rate limit service")),
      offenders
    ));
    routeViews.set(name, { offenders, cells: new Map(), topShown: null, hasLimits: true, rls: true });
  }

  function drawOffenders(route, v, rows, scope) {
    // The inputs are kept across redraws (an operator may be typing in them).
    if (!v.ttl) {
      v.ttl = el("input", { class: "short", value: "1h", "aria-label": `ttl for ${route}` });
      v.reason = el("input", { class: "wide", value: `top offender on ${route}`, "aria-label": `reason for ${route}` });
      v.topMessage = el("span", { class: "small" });
      v.topBody = el("tbody");
      v.topScope = el("span", { class: "muted small top-scope" });
      v.offenders.append(
        el("h4", null, "Top offenders ", v.topScope),
        el("div", { class: "deny-form" }, el("label", { class: "small muted" }, "deny for ", v.ttl), el("label", { class: "small muted wide" }, "reason ", v.reason), v.topMessage),
        el("table", { class: "deny top" },
          el("thead", null, el("tr", null, el("th", null, "key"), el("th", null, "ip"), el("th", null, "refused"), el("th", null, "allowed"), el("th", null, "last seen"), el("th", null, ""))),
          v.topBody)
      );
    }
    v.topScope.textContent = `most refused in the last 1–2 minutes, ${scope}`;
    clear(v.topBody);
    if (!rows.length) {
      v.topBody.append(el("tr", null, el("td", { colspan: "6", class: "muted" }, "No one refused lately.")));
      return;
    }
    for (const r of rows) {
      const refused = r.error > 0 ? `${r.refused} (±${r.error})` : String(r.refused);
      // One already denied says so, instead of offering to deny it again.
      const actions = r.denied
        ? el("td", { class: "actions" }, el("span", { class: "badge bad denied-mark" }, `${r.denied} denied`))
        : el("td", { class: "actions" },
          confirmButton("Deny key", () => denyFromTop(v, { key: r.key }, `key ${r.key}`)), " ",
          confirmButton("Deny IP", () => denyFromTop(v, { ip: r.ip }, `ip ${r.ip}`)));
      v.topBody.append(
        el("tr", { class: r.denied ? "denied" : "", dataset: { key: r.key, ip: r.ip, denied: r.denied || "" } },
          el("td", { class: "value" }, el("code", null, r.key)),
          el("td", { class: "value" }, el("code", null, r.ip)),
          el("td", { class: "num" }, refused),
          el("td", { class: "num" }, String(r.allowed)),
          el("td", null, utcTime(r.last_seen)),
          actions)
      );
    }
  }

  // A button that asks once more before it acts: the first click turns it into
  // "Confirm …" (for 5 seconds), the second acts.
  function confirmButton(label, act) {
    const b = el("button", { type: "button", class: "remove" }, label);
    let armed = null;
    b.addEventListener("click", () => {
      if (armed) {
        clearTimeout(armed);
        armed = null;
        b.textContent = label;
        b.classList.remove("confirm");
        act();
        return;
      }
      b.textContent = `Confirm ${label.toLowerCase()}?`;
      b.classList.add("confirm");
      armed = setTimeout(() => {
        armed = null;
        b.textContent = label;
        b.classList.remove("confirm");
      }, 5000);
    });
    return b;
  }

  // The same command as `sluice deny add`: POST /admin/deny.
  async function denyFromTop(v, target, what) {
    const body = { ...target };
    const ttl = v.ttl.value.trim();
    const reason = v.reason.value;
    if (ttl) body.ttl = ttl;
    if (reason) body.reason = reason;
    try {
      const r = await api("POST", "/admin/deny", body);
      const text = (await r.text()).trim();
      v.topMessage.textContent = r.ok ? `Denied ${what}${ttl ? ` for ${ttl}` : ""}.` : `${r.status}: ${text}`;
      v.topMessage.className = r.ok ? "small ok" : "small error";
      if (r.ok) renderDeny(await getDenyPage());
    } catch (e) {
      if (e instanceof Unauthorized) return showLogin("That token was refused.");
      v.topMessage.textContent = e.message;
      v.topMessage.className = "small error";
    }
  }

  // === the fleet ===

  // An instance's own allowed · limited · denied, over its routes.
  function instanceDecisions(routes) {
    const sum = { allowed: 0, limited: 0, denied: 0 };
    for (const c of Object.values(routes)) for (const d of MAIN) sum[d] += c[d] || 0;
    return MAIN.map((d) => `${d} ${sum[d]}`).join(" · ");
  }

  function renderFleet(f) {
    const degraded = f.degraded ? `degraded: limits divided by ${f.divided_by} in each instance while Redis is unreachable; ` : "";
    const note = degraded + (f.store === "redis"
      ? `${f.live} live instance${f.live === 1 ? "" : "s"} on this Redis, counts summed over them since each started${f.instances.length > f.live ? ` (${f.instances.length - f.live} stale: missed two heartbeats, not summed)` : ""}`
      : "memory store: this instance alone");
    $("fleet-note").textContent = f.error ? `${note} (${f.error})` : note;
    const totals = $("fleet-totals");
    clear(totals);
    for (const [route, c] of Object.entries(f.routes || {})) {
      const parts = MAIN.map((d) => `${d} ${c[d] || 0}`);
      totals.append(el("div", { class: "fleet-route", dataset: { route } }, el("b", null, route), ` ${parts.join(" · ")}`));
    }
    const body = $("fleet");
    clear(body);
    const hashes = new Set(f.instances.map((i) => i.config_hash));
    for (const i of f.instances) {
      const odd = hashes.size > 1;
      body.append(
        el("tr", { dataset: { id: i.id } },
          el("td", null, el("code", null, i.id), i.self ? el("span", { class: "muted" }, " (this one)") : null),
          el("td", null, i.addr),
          el("td", null, i.version),
          el("td", null, el("code", { class: odd ? "error" : "" }, i.config_hash.slice(0, 12))),
          el("td", null, badge(i.ready, "ready", i.stale ? "stale" : "not ready")),
          el("td", { class: "decisions" }, instanceDecisions(i.routes || {})),
          el("td", null, utcTime(i.last_seen)))
      );
    }
  }

  // The samples (oldest first) plus the counters now: [{at, totals: {decision: n}}].
  function series(h, totals, now) {
    const out = [];
    const decisions = Object.keys(totals);
    for (let i = 0; i < h.at_ms.length; i++) {
      const t = {};
      for (const d of decisions) t[d] = h[d][i];
      out.push({ at: h.at_ms[i], totals: t });
    }
    if (!out.length || now > out[out.length - 1].at) out.push({ at: now, totals });
    return out;
  }

  function group(totals) {
    let other = 0;
    for (const [d, n] of Object.entries(totals)) if (!MAIN.includes(d) && !UPSTREAM.includes(d)) other += n;
    const errors = (totals.upstream_5xx || 0) + (totals.upstream_failed || 0);
    return { allowed: totals.allowed || 0, limited: totals.limited || 0, denied: totals.denied || 0, other, errors };
  }

  function ratesBetween(a, b) {
    const dt = (b.at - a.at) / 1000;
    const out = {};
    for (const d of Object.keys(b.totals)) out[d] = dt > 0 ? Math.max(0, (b.totals[d] - (a.totals[d] || 0)) / dt) : 0;
    return out;
  }

  // Per second over the last two sample intervals (and the moments since).
  function lastRates(samples) {
    if (samples.length < 2) return {};
    const n = samples.length;
    const from = samples[Math.max(0, n - 3)];
    return ratesBetween(from, samples[n - 1]);
  }

  function drawChart(chart, samples, now, keep) {
    clear(chart);
    const W = 320, top = 16, bottom = 76;
    const start = now - keep;
    const points = { allowed: [], limited: [], denied: [], other: [], errors: [] };
    let max = 0;
    for (let i = 1; i < samples.length; i++) {
      if (samples[i].at < start) continue;
      const r = group(ratesBetween(samples[i - 1], samples[i]));
      for (const k of Object.keys(points)) {
        points[k].push([samples[i].at, r[k]]);
        max = Math.max(max, r[k]);
      }
    }
    const scale = niceMax(max);
    const x = (t) => ((t - start) / keep) * W;
    const y = (v) => bottom - (v / scale) * (bottom - top);
    chart.append(svg("line", { x1: 0, x2: W, y1: bottom, y2: bottom, class: "axis" }));
    chart.append(svg("line", { x1: 0, x2: W, y1: top, y2: top, class: "grid" }));
    for (const [k] of LINES) {
      const pts = points[k];
      if (!pts.length) continue;
      chart.append(
        svg("polyline", {
          class: `line ${k}`,
          points: pts.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
        })
      );
    }
    return rate(scale);
  }

  function niceMax(v) {
    if (v <= 1) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  // === deny list ===

  // The list comes a page at a time (it may hold 100,000 entries): the page shown
  // is the one after the last cursor of `denyCursors` ("" for the first).
  const DENY_PAGE = 100;
  let denyCursors = [""];

  async function getDenyPage() {
    const after = denyCursors[denyCursors.length - 1];
    const path = `/admin/deny?limit=${DENY_PAGE}` + (after ? `&after=${after}` : "");
    const r = await api("GET", path);
    if (!r.ok) throw new Error(`/admin/deny: ${r.status} ${(await r.text()).trim()}`);
    const entries = await r.json();
    const total = Number(r.headers.get("X-Total-Count") || entries.length);
    const next = /[?&]after=([0-9a-f]+)>; rel="next"/.exec(r.headers.get("Link") || "");
    return { entries, total, next: next ? next[1] : null };
  }

  async function turnDenyPage(cursor) {
    if (cursor === null) denyCursors.pop();
    else denyCursors.push(cursor);
    denyShown = null;
    renderDeny(await getDenyPage());
  }

  // Rebuilt only when the list changed, so a button is never swapped out under a click.
  let denyShown = null;
  let denyNext = null;

  function renderDeny(page) {
    const { entries, total, next } = page;
    // A later page that emptied (its entries expired or were removed): back one.
    if (entries.length === 0 && denyCursors.length > 1) {
      turnDenyPage(null);
      return;
    }
    const text = JSON.stringify(page);
    if (text === denyShown) return;
    denyShown = text;
    denyNext = next;
    const first = (denyCursors.length - 1) * DENY_PAGE;
    $("deny-count").textContent =
      total > entries.length
        ? `${first + 1}–${first + entries.length} of ${total} entries`
        : `${total} ${total === 1 ? "entry" : "entries"}`;
    $("deny-prev").hidden = denyCursors.length <= 1;
    $("deny-next").hidden = next === null;
    const body = $("deny");
    clear(body);
    if (entries.length === 0) {
      body.append(el("tr", null, el("td", { colspan: "6", class: "muted" }, "No entries.")));
      return;
    }
    for (const e of entries) {
      const expires = e.expires_at ? utc(e.expires_at) : "never";
      let action = null;
      if (e.source !== "static") {
        action = el("button", { type: "button", class: "remove" }, "Remove");
        action.addEventListener("click", () => removeEntry(e.kind, e.value));
      } else {
        action = el("span", { class: "muted small" }, "in rules.yaml");
      }
      const source = e.route ? `${e.source} (${e.route})` : e.source;
      body.append(
        el(
          "tr",
          { dataset: { kind: e.kind, value: e.value } },
          el("td", null, e.kind),
          el("td", { class: "value" }, el("code", null, e.value)),
          el("td", null, source),
          el("td", null, expires),
          el("td", { class: "reason" }, e.reason || ""),
          el("td", null, action)
        )
      );
    }
  }

  function say(text, ok) {
    const m = $("deny-message");
    m.textContent = text;
    m.className = ok ? "small ok" : "small error";
  }

  async function addEntry(ev) {
    ev.preventDefault();
    const kind = $("deny-kind").value;
    const value = $("deny-value").value.trim();
    const ttl = $("deny-ttl").value.trim();
    const reason = $("deny-reason").value;
    if (!value) return say(`Give the ${kind} to deny.`, false);
    const body = { [kind]: value };
    if (ttl) body.ttl = ttl;
    if (reason) body.reason = reason;
    await change("POST", body, `Denied ${kind} ${value}.`, () => {
      $("deny-value").value = "";
      $("deny-ttl").value = "";
      $("deny-reason").value = "";
    });
  }

  async function removeEntry(kind, value) {
    await change("DELETE", { [kind]: value }, `Removed ${kind} ${value}.`, () => {});
  }

  async function change(method, body, done, after) {
    try {
      const r = await api(method, "/admin/deny", body);
      if (!r.ok) return say(`${r.status}: ${(await r.text()).trim()}`, false);
      after();
      say(done, true);
      renderDeny(await getDenyPage());
    } catch (e) {
      if (e instanceof Unauthorized) return showLogin("That token was refused.");
      say(e.message, false);
    }
  }

  // === start ===

  document.addEventListener("DOMContentLoaded", () => {
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      token = $("token").value.trim();
      if (token) sessionStorage.setItem(TOKEN_KEY, token);
      else sessionStorage.removeItem(TOKEN_KEY);
      $("token").value = "";
      restart();
    });
    $("forget").addEventListener("click", () => {
      token = "";
      sessionStorage.removeItem(TOKEN_KEY);
      restart();
    });
    $("deny-form").addEventListener("submit", addEntry);
    $("deny-prev").addEventListener("click", () => turnDenyPage(null).catch((e) => say(e.message, false)));
    $("deny-next").addEventListener("click", () => {
      if (denyNext) turnDenyPage(denyNext).catch((e) => say(e.message, false));
    });
    restart();
  });
})();
