// The live view: renders each snapshot of /live/events (one JSON object a second) in
// place, keyed by sale id. Text only goes in through textContent (titles are data).
"use strict";

const STALE_AFTER_MS = 5000;
const status = document.getElementById("status");
const salesEl = document.getElementById("sales");
const cards = new Map();
let lastSnapshot = 0;
// The last snapshot's own time, and when it last moved: snapshots that keep arriving
// with the same `at` (a producer that stopped, a proxy replaying) are stale too.
let lastAt = null;
let lastAdvance = 0;
let source = null;

function setStatus(kind, text) {
  status.className = "status " + kind;
  status.textContent = text;
}

function set(root, field, value) {
  // A figure may be shown twice (persisted heads one sum and ends the other).
  for (const el of root.querySelectorAll('[data-field="' + field + '"]')) {
    if (el.textContent !== String(value)) el.textContent = value;
  }
}

function fmt(n) {
  // null: not known right now (a store did not answer, the sale is not loaded, no rate
  // yet): never shown as 0.
  return typeof n === "number" ? n.toLocaleString("en-US") : "–";
}

function ms(n) {
  if (typeof n !== "number") return "–";
  return (n < 10 ? n.toFixed(2) : n < 100 ? n.toFixed(1) : Math.round(n).toLocaleString("en-US")) + " ms";
}

// What the badge says: an open sale with nothing left is sold out, not "open".
function badgeOf(s) {
  return s.state === "open" && s.sold_out ? "sold out" : s.state;
}

function until(iso, now) {
  let s = Math.max(0, Math.round((Date.parse(iso) - now) / 1000));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  s %= 60;
  return (h ? h + "h " : "") + (h || m ? m + "m " : "") + s + "s";
}

// A lottery sale's line: its window and entrants so far, then its draw.
function lotteryLine(l, now) {
  if (l.drawn_at !== null) return "Lottery drawn: " + fmt(l.winners) + " winners among " + fmt(l.entrants) + " entrants";
  const open = now < Date.parse(l.window_end);
  return (open ? "Lottery: entries close in " + until(l.window_end, now) : "Lottery: the draw is due")
    + " · " + fmt(l.entrants) + " entrants so far";
}

function card(id) {
  let el = cards.get(id);
  if (!el) {
    el = document.getElementById("sale").content.firstElementChild.cloneNode(true);
    el.dataset.saleId = id;
    cards.set(id, el);
  }
  return el;
}

function staleFor(now) {
  return Math.max(now - lastSnapshot, now - lastAdvance);
}

function render(snap) {
  lastSnapshot = Date.now();
  if (snap.at !== lastAt) { lastAt = snap.at; lastAdvance = lastSnapshot; }
  if (staleFor(lastSnapshot) <= STALE_AFTER_MS) setStatus("live", "live");
  const w = document.getElementById("worker");
  set(w, "lag", fmt(snap.worker.lag));
  set(w, "pending", fmt(snap.worker.pending));
  set(w, "dead_letters", fmt(snap.worker.dead_letters));
  set(w, "at", new Date(snap.at).toLocaleTimeString());
  const down = document.getElementById("unavailable");
  down.hidden = snap.unavailable.length === 0;
  down.textContent = down.hidden ? "" : "Not answering: " + snap.unavailable.join(", ") + " (figures shown are the last known)";

  // More sales than the server shows (LIVE_MAX_SALES): say so rather than hide it.
  const cut = document.getElementById("truncated");
  cut.hidden = snap.truncated !== true;
  cut.textContent = cut.hidden ? "" : "Showing " + fmt(snap.sales.length) + " of " + fmt(snap.open_total)
    + " sales (selling ones first, then upcoming, then sold out, then just ended)";

  const now = Date.parse(snap.at);
  const seen = new Set();
  snap.sales.forEach((s, i) => {
    const el = card(s.id);
    seen.add(s.id);
    set(el, "title", s.title);
    set(el, "id", "#" + s.id);
    const badge = el.querySelector('[data-field="state"]');
    const shown = badgeOf(s);
    badge.className = "badge " + shown.replace(" ", "-");
    set(el, "state", shown);
    set(el, "when", s.state === "upcoming" ? "opens in " + until(s.begin_time, now)
      : s.state === "open" ? "ends in " + until(s.end_time, now) : "ended");
    const lottery = el.querySelector('[data-field="lottery"]');
    lottery.hidden = !s.lottery;
    set(el, "lottery", s.lottery ? lotteryLine(s.lottery, now) : "");
    const remaining = s.remaining === null ? null : s.remaining;
    set(el, "remaining", remaining === null ? "–" : fmt(remaining));
    set(el, "initial_stock", fmt(s.initial_stock));
    const bar = el.querySelector(".bar");
    bar.setAttribute("aria-valuemax", s.initial_stock);
    // Not loaded in Redis yet (it loads on the first grab): Postgres's count of units
    // not taken by a written order, so the bar does not read as sold out.
    const left = remaining !== null ? remaining
      : s.initial_stock - (s.orders.persisted - s.orders.units_back);
    // What the bar shows, for screen readers too.
    bar.setAttribute("aria-valuenow", Math.max(0, left));
    const pct = s.initial_stock > 0 ? Math.max(0, (100 * left) / s.initial_stock) : 0;
    el.querySelector(".fill").style.width = pct.toFixed(1) + "%";
    set(el, "grabs_per_sec", fmt(s.grabs_per_sec));
    set(el, "errors_per_sec", fmt(s.errors_per_sec));
    // Errors as a share of grabs, when there are any.
    const share = s.errors_per_sec > 0 && s.grabs_per_sec > 0
      ? "(" + (100 * s.errors_per_sec / s.grabs_per_sec).toFixed(1) + "%)" : "";
    set(el, "error_share", share);
    el.querySelector(".rates .errors").classList.toggle("bad", s.errors_per_sec > 0);
    set(el, "admission_p99", ms(s.admission_p99_ms));
    for (const k of ["sold_out", "already_ordered", "rate_limited", "unavailable", "unknown", "answered_at_edge"]) set(el, k, fmt(s.outcomes[k]));
    for (const k of ["unavailable", "unknown"]) {
      el.querySelector('[data-field="' + k + '"]').parentElement.classList.toggle("bad", s.outcomes[k] > 0);
    }
    for (const k of ["admitted", "persisted", "in_flight", "created", "paid", "used", "refunding", "refunded", "cancelled", "expired", "late_payments"]) set(el, k, fmt(s.orders[k]));
    set(el, "sale_dead_letters", fmt(s.dead_letters));
    set(el, "stale_epoch", fmt(s.stale_epoch));
    if (salesEl.children[i] !== el) salesEl.insertBefore(el, salesEl.children[i] || null);
  });
  for (const [id, el] of cards) {
    if (!seen.has(id)) { el.remove(); cards.delete(id); }
  }
  document.getElementById("empty").hidden = snap.sales.length > 0;
}

// A refused stream (503: too many pages watch this instance) is retried after 3 s,
// doubling to 60 s, each wait ±50% at random so that refused pages do not come back
// all at once; the first snapshot resets it.
const RETRY_FIRST_MS = 3000;
const RETRY_MAX_MS = 60000;
let refusals = 0;
let retryTimer = null;

function retryDelay(n) {
  const base = Math.min(RETRY_MAX_MS, RETRY_FIRST_MS * Math.pow(2, n));
  return Math.round(base * (0.5 + Math.random()));
}

function connect() {
  retryTimer = null;
  if (source) source.close();
  source = new EventSource("/live/events");
  source.addEventListener("snapshot", (e) => {
    refusals = 0;
    render(JSON.parse(e.data));
  });
  source.onerror = () => {
    setStatus("down", "reconnecting…");
    // The browser retries a dropped stream by itself, but not one the server refused.
    if (source.readyState === EventSource.CLOSED && retryTimer === null) {
      const wait = retryDelay(refusals++);
      setStatus("down", "busy; retrying in " + Math.round(wait / 1000) + "s");
      retryTimer = setTimeout(connect, wait);
    }
  };
}

setInterval(() => {
  const stale = staleFor(Date.now());
  if (lastSnapshot && stale > STALE_AFTER_MS && !status.classList.contains("down")) {
    setStatus("stale", "no update for " + Math.round(stale / 1000) + "s");
  }
}, 1000);

connect();
