// k6 load test: every virtual user grabs with a token of its own.
//
//   seckill token --user 1 --count 2000 > tokens.txt
//   k6 run -e BASE=http://127.0.0.1:8080 -e VOUCHER=1 -e TOKENS=tokens.txt load/k6/seckill.js
//
// Each VU takes the token at its index (VU n uses line n), presses "grab" once per
// iteration; a repeat press by the same user answers 409 already_ordered, which counts
// as an expected outcome. Thresholds fail the run on any 5xx or a slow p99.
import http from 'k6/http';
import { check } from 'k6';
import { SharedArray } from 'k6/data';
import { Counter } from 'k6/metrics';

const tokens = new SharedArray('tokens', () =>
  open(__ENV.TOKENS || 'tokens.txt').split('\n').filter((line) => line.length > 0));

const admitted = new Counter('seckill_admitted');
const refused = new Counter('seckill_refused');

export const options = {
  scenarios: {
    storm: {
      executor: 'constant-vus',
      vus: Number(__ENV.VUS || 64),
      duration: __ENV.DURATION || '30s',
    },
  },
  thresholds: {
    // 202 admitted, 409 sold_out / already_ordered / not_started / ended: all fine.
    'http_req_failed{expected_response:false}': ['rate==0'],
    checks: ['rate==1'],
    'http_req_duration{name:seckill}': ['p(99)<10'],
  },
};

export default function () {
  const token = tokens[(__VU - 1) % tokens.length];
  const res = http.post(`${__ENV.BASE}/vouchers/${__ENV.VOUCHER}/seckill`, null, {
    headers: { Authorization: `Bearer ${token}` },
    tags: { name: 'seckill' },
    responseCallback: http.expectedStatuses(202, 409),
  });
  check(res, {
    'admitted or refused, never an error': (r) => r.status === 202 || r.status === 409,
    'admitted answers carry an order id string': (r) =>
      r.status !== 202 || typeof r.json('order_id') === 'string',
  });
  if (res.status === 202) admitted.add(1);
  else refused.add(1);
}
