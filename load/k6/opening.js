// k6, the opening second, open-loop: distinct shoppers arrive at a fixed rate from the
// sale's begin_time on, whether or not anyone has been answered yet (a closed-loop run,
// each virtual user waiting for its answer before pressing again, is not what an
// opening is). load/k6/opening-check then compares Postgres with the answers.
//
//   scripts/k6 run --console-output=answers.log -e JWT_SECRET=... load/k6/opening.js
//   load/k6/opening-check answers.log        # every 202 in Postgres, the stock sold once
//
// setup() opens a sale of STOCK units as an admin, beginning LEAD_MS after it asks, and
// waits for its begin_time: the arrivals start at the opening. Each arrival is a user of
// its own (FIRST_USER + its number), with a token minted here (HS256, the server's
// JWT_SECRET; JWT_ISSUER / JWT_AUDIENCE when the server checks them).
//
//   -e BASE=http://127.0.0.1:8080
//   -e RATE=4000 -e DURATION=5s    arrivals per second, for so long (20,000 shoppers)
//   -e STOCK=2000                  units of the sale
//   -e VUS=400 -e MAX_VUS=4000     virtual users allocated first, and at most
//   -e FIRST_USER=2000000          the first shopper's user id
//   -e LEAD_MS=1000                from setup's request to the opening
//   -e PATH_OF=grab                `healthz`: the same arrivals on GET /healthz (the
//                                  server's own ceiling, for a ratio)
//
// It prints admitted, sold_out, other answers, the grab's p50/p95/p99, the time from the
// opening to the last unit sold and the iterations k6 dropped (it could not hold the
// rate). Thresholds fail the run on any failed request, any answer but 202 with an order
// id or 409 sold_out, and any dropped iteration. Each 202 is logged ("admitted <user>
// <order id> <voucher>") for the check.
import http from 'k6/http';
import exec from 'k6/execution';
import { check, fail, sleep } from 'k6';
import { Counter, Trend } from 'k6/metrics';
import { token } from './seckill.js';

const BASE = __ENV.BASE || 'http://127.0.0.1:8080';
const FIRST_USER = Number(__ENV.FIRST_USER || 2000000);
const HEALTHZ = (__ENV.PATH_OF || 'grab') === 'healthz';
const RATE = Number(__ENV.RATE || 4000);

const admitted = new Counter('seckill_admitted');
const soldOut = new Counter('seckill_sold_out');
const other = new Counter('seckill_other_answers');
// Each answer's time (a grab's, or /healthz's).
const answered = new Trend('seckill_answer_duration', true);
// Milliseconds from the opening to each 202: its max is when the last unit sold.
const admittedAt = new Trend('seckill_admitted_after_opening', true);

export const options = {
  scenarios: {
    opening: {
      executor: 'constant-arrival-rate',
      rate: RATE,
      timeUnit: '1s',
      duration: __ENV.DURATION || '5s',
      preAllocatedVUs: Number(__ENV.VUS || 400),
      maxVUs: Number(__ENV.MAX_VUS || 4000),
    },
  },
  thresholds: {
    http_req_failed: ['rate==0'],
    checks: ['rate==1'],
    dropped_iterations: ['count==0'],
    seckill_other_answers: ['count==0'],
  },
  // The figures the summary prints.
  summaryTrendStats: ['p(50)', 'p(95)', 'p(99)', 'max'],
};

export function setup() {
  if (!__ENV.JWT_SECRET) fail('set -e JWT_SECRET=<the server\'s secret>');
  if (HEALTHZ) return { voucher: 0, begin: Date.now() };
  const begin = Date.now() + Number(__ENV.LEAD_MS || 1000);
  const res = http.post(`${BASE}/vouchers`, JSON.stringify({
    shop_id: 1, title: 'k6 opening', pay_value: 5000, actual_value: 10000,
    seckill: {
      stock: Number(__ENV.STOCK || 2000),
      begin_time: new Date(begin).toISOString(),
      end_time: new Date(begin + 3600 * 1000).toISOString(),
    },
  }), {
    headers: { Authorization: `Bearer ${token(1, true)}`, 'Content-Type': 'application/json' },
    responseCallback: http.expectedStatuses(201),
  });
  if (res.status !== 201) fail(`creating the sale: ${res.status} ${res.body}`);
  sleep(Math.max(0, begin - Date.now()) / 1000);
  return { voucher: res.json('id'), begin };
}

export default function (data) {
  if (HEALTHZ) {
    const res = http.get(`${BASE}/healthz`, { tags: { name: 'healthz' } });
    answered.add(res.timings.duration);
    check(res, { 'healthz answers 200': (r) => r.status === 200 });
    return;
  }
  const user = FIRST_USER + exec.scenario.iterationInTest;
  const res = http.post(`${BASE}/vouchers/${data.voucher}/seckill`, null, {
    headers: { Authorization: `Bearer ${token(user, false)}` },
    tags: { name: 'seckill' },
    responseCallback: http.expectedStatuses(202, 409),
  });
  answered.add(res.timings.duration);
  const code = res.status === 409 ? res.json('error.code') : null;
  const orderId = res.status === 202 ? res.json('order_id') : null;
  const expected = check(res, {
    'admitted with an order id string': () => res.status !== 202 || typeof orderId === 'string',
    'refused only as sold_out': () => res.status !== 409 || code === 'sold_out',
  });
  if (res.status === 202) {
    admitted.add(1);
    admittedAt.add(Date.now() - data.begin);
    console.log(`admitted ${user} ${orderId} ${data.voucher}`);
  } else if (code === 'sold_out') {
    soldOut.add(1);
  }
  if (!expected || (res.status !== 202 && code !== 'sold_out')) other.add(1);
}

export function handleSummary(data) {
  const m = data.metrics;
  const count = (name) => (m[name] ? m[name].values.count : 0);
  const ms = (name, stat) => (m[name] ? `${m[name].values[stat].toFixed(1)} ms` : '-');
  const name = 'seckill_answer_duration';
  const lines = [
    `arrivals: ${count('iterations')} at ${RATE}/s, dropped ${count('dropped_iterations')}`,
    HEALTHZ
      ? 'GET /healthz'
      : `admitted ${count('seckill_admitted')}, sold_out ${count('seckill_sold_out')}, other ${count('seckill_other_answers')}`,
    `p50 ${ms(name, 'p(50)')}, p95 ${ms(name, 'p(95)')}, p99 ${ms(name, 'p(99)')}`,
  ];
  if (!HEALTHZ) lines.push(`last unit sold ${ms('seckill_admitted_after_opening', 'max')} after the opening`);
  const thresholds = Object.entries(m)
    .flatMap(([metric, v]) => Object.entries(v.thresholds || {}).map(([t, r]) => `${metric} ${t}: ${r.ok ? 'ok' : 'CROSSED'}`));
  const out = { stdout: `${lines.concat(thresholds).join('\n')}\n` };
  if (__ENV.SUMMARY) out[__ENV.SUMMARY] = JSON.stringify(data);
  return out;
}
