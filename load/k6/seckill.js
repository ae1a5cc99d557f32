// k6 load test: every iteration is one grab by a user of its own.
//
//   k6 run -e BASE=http://127.0.0.1:8080 -e JWT_SECRET=... load/k6/seckill.js
//
// Needs on the server: RATE_LIMIT_PER_IP=0 (the default; every virtual user comes from
// one address). The per-user limit may stay on: no user presses twice.
//
// Each iteration mints an HS256 token for user FIRST_USER + (the test-wide iteration
// number), signed with the server's JWT_SECRET (with JWT_ISSUER / JWT_AUDIENCE when the
// server checks them), so no user recurs and the answers are 202 admitted, then 409
// sold_out. setup() opens a sale of STOCK units as an admin unless VOUCHER names one.
//
//   -e VUS=64 -e DURATION=30s   virtual users and length (defaults)
//   -e STOCK=10000              units of the sale setup() opens
//   -e VOUCHER=7                grab from this sale instead (its answers may also be
//                               already_ordered, for users of an earlier run)
//   -e FIRST_USER=1000000       the first shopper's user id
//   -e P99_MS=50                the p99 threshold of the grab, in milliseconds
//
// Thresholds (the run fails when one is crossed): no request failed (an answer other than
// 201 for the sale, 202/409 for a grab, or none), every check passed (a 202 carries an
// order id string, a 409 is sold_out or already_ordered), and the grab's p99 under P99_MS.
// The generator shares the machine with the service in a local run, so its own
// scheduling delays count in that p99: 50 ms leaves room for that on two cores; lower it
// on a separate load machine.
import http from 'k6/http';
import crypto from 'k6/crypto';
import encoding from 'k6/encoding';
import exec from 'k6/execution';
import { check, fail } from 'k6';
import { Counter } from 'k6/metrics';

const BASE = __ENV.BASE || 'http://127.0.0.1:8080';
const SECRET = __ENV.JWT_SECRET;
const FIRST_USER = Number(__ENV.FIRST_USER || 1000000);
const P99_MS = Number(__ENV.P99_MS || 50);

const admitted = new Counter('seckill_admitted');
const soldOut = new Counter('seckill_sold_out');
const alreadyOrdered = new Counter('seckill_already_ordered');

export const options = {
  scenarios: {
    storm: {
      executor: 'constant-vus',
      vus: Number(__ENV.VUS || 64),
      duration: __ENV.DURATION || '30s',
    },
  },
  thresholds: {
    http_req_failed: ['rate==0'],
    checks: ['rate==1'],
    [`http_req_duration{name:seckill}`]: [`p(99)<${P99_MS}`],
  },
};

const b64url = (text) => encoding.b64encode(text, 'rawurl');
const HEADER = b64url(JSON.stringify({ alg: 'HS256', typ: 'JWT' }));

// A token as `seckill token --user USER [--admin]` mints it, valid for an hour.
export function token(user, admin) {
  const claims = { sub: String(user), exp: Math.floor(Date.now() / 1000) + 3600 };
  if (admin) claims.role = 'admin';
  if (__ENV.JWT_ISSUER) claims.iss = __ENV.JWT_ISSUER;
  if (__ENV.JWT_AUDIENCE) claims.aud = __ENV.JWT_AUDIENCE;
  const signed = `${HEADER}.${b64url(JSON.stringify(claims))}`;
  return `${signed}.${crypto.hmac('sha256', SECRET, signed, 'base64rawurl')}`;
}

export function setup() {
  if (!SECRET) fail('set -e JWT_SECRET=<the server\'s secret>');
  if (__ENV.VOUCHER) return { voucher: __ENV.VOUCHER };
  const now = Date.now();
  const res = http.post(`${BASE}/vouchers`, JSON.stringify({
    shop_id: 1, title: 'k6 sale', pay_value: 5000, actual_value: 10000,
    seckill: {
      stock: Number(__ENV.STOCK || 10000),
      begin_time: new Date(now - 5000).toISOString(),
      end_time: new Date(now + 3600 * 1000).toISOString(),
    },
  }), {
    headers: { Authorization: `Bearer ${token(1, true)}`, 'Content-Type': 'application/json' },
    responseCallback: http.expectedStatuses(201),
  });
  if (res.status !== 201) fail(`creating the sale: ${res.status} ${res.body}`);
  return { voucher: res.json('id') };
}

export default function (data) {
  const user = FIRST_USER + exec.scenario.iterationInTest;
  const res = http.post(`${BASE}/vouchers/${data.voucher}/seckill`, null, {
    headers: { Authorization: `Bearer ${token(user, false)}` },
    tags: { name: 'seckill' },
    responseCallback: http.expectedStatuses(202, 409),
  });
  const code = res.status === 409 ? res.json('error.code') : null;
  check(res, {
    'admitted with an order id string': (r) =>
      r.status !== 202 || typeof r.json('order_id') === 'string',
    'refused only as sold_out or already_ordered': () =>
      res.status !== 409 || code === 'sold_out' || code === 'already_ordered',
  });
  if (res.status === 202) admitted.add(1);
  else if (code === 'sold_out') soldOut.add(1);
  else if (code === 'already_ordered') alreadyOrdered.add(1);
}
