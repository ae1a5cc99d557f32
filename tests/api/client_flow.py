"""The whole flow through a client generated from the API document by openapi-python-client
(scripts/generate-client): what a user of the document gets, run by tests/api/client.rs.

Reads SECKILL_BASE, SECKILL_ADMIN (an administrator's token), SECKILL_SHOPPERS (three
shoppers' tokens, comma-separated), SECKILL_STAFF (a token of shop 7's staff) and
SECKILL_PAYMENT_SECRET (what the payment provider signs with) from the environment.
The provider's notification is sent with httpx, signed over its raw bytes, as a
provider would; everything else goes through the generated package
`seckill_client` is on PYTHONPATH. Prints each step; exits non-zero on the first answer
that is not what the flow expects, and prints "flow ok" at the end.
"""

import datetime
import hashlib
import hmac
import json
import os
import sys
import time
import uuid

import httpx

from seckill_client import AuthenticatedClient, Client
from seckill_client.api.orders import (
    cancel_order,
    checkout_order,
    get_order,
    list_my_orders,
    list_shop_orders,
    redeem_order,
    refund_order,
)
from seckill_client.api.seckill import grab_voucher
from seckill_client.api.vouchers import (
    close_sale,
    create_voucher,
    get_voucher,
    list_sale_orders,
)
from seckill_client.models import (
    Admitted,
    Checkout,
    CreateSeckill,
    CreateVoucher,
    ErrorBody,
    ErrorCode,
    OrderPage,
    OrderResponse,
    OrderStatus,
    PayType,
    RedeemOrder,
    VoucherResponse,
)

BASE = os.environ["SECKILL_BASE"]
admin = AuthenticatedClient(base_url=BASE, token=os.environ["SECKILL_ADMIN"], raise_on_unexpected_status=True)
alice, bob, carol = (
    AuthenticatedClient(base_url=BASE, token=t, raise_on_unexpected_status=True)
    for t in os.environ["SECKILL_SHOPPERS"].split(",")
)
anonymous = Client(base_url=BASE, raise_on_unexpected_status=True)
staff = AuthenticatedClient(base_url=BASE, token=os.environ["SECKILL_STAFF"], raise_on_unexpected_status=True)
SECRET = os.environ["SECKILL_PAYMENT_SECRET"].encode()


def provider_notifies(kind, order_id, amount):
    """The payment provider's signed notification: `Seckill-Signature: t=..,v1=..`."""
    raw = json.dumps(
        {
            "id": f"evt_{uuid.uuid4().hex}",
            "type": kind,
            "order_id": order_id,
            "amount": amount,
            "currency": "CNY",
            "transaction_id": f"tx_{uuid.uuid4().hex}",
        }
    ).encode()
    t = int(time.time())
    v1 = hmac.new(SECRET, f"{t}.".encode() + raw, hashlib.sha256).hexdigest()
    answer = httpx.post(
        f"{BASE}/payments/notifications",
        content=raw,
        headers={"content-type": "application/json", "seckill-signature": f"t={t},v1={v1}"},
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["outcome"]


def step(what):
    print(f"-- {what}", flush=True)


def expect(response, status, kind):
    """The parsed answer, after checking its status and model."""
    assert response.status_code == status, (status, response.status_code, response.content)
    assert isinstance(response.parsed, kind), (kind, response.parsed, response.content)
    return response.parsed


def expect_error(response, status, code):
    error = expect(response, status, ErrorBody).error
    assert error.code == code, (code, error.code, error.message)
    assert isinstance(error.code, ErrorCode)
    print(f"   {status} {error.code.value}: {error.message}")
    return error


def written(client, order_id):
    """The order once the worker has written it (`created`): pending before that."""
    deadline = time.monotonic() + 15
    while True:
        order = expect(get_order.sync_detailed(order_id, client=client), 200, OrderResponse)
        if order.status != OrderStatus.PENDING:
            return order
        assert time.monotonic() < deadline, f"order {order_id} still pending"
        time.sleep(0.1)


now = datetime.datetime.now(datetime.timezone.utc)

step("an administrator creates a sale of 2 units, paid within 10 minutes")
sale = expect(
    create_voucher.sync_detailed(
        client=admin,
        body=CreateVoucher(
            shop_id=7,
            title="client flow",
            sub_title="generated",
            rules="one per person",
            pay_value=5000,
            actual_value=10000,
            refundable=True,
            seckill=CreateSeckill(
                stock=2,
                begin_time=now - datetime.timedelta(minutes=1),
                end_time=now + datetime.timedelta(hours=1),
                pay_within_secs=600,
            ),
        ),
    ),
    201,
    VoucherResponse,
)
assert sale.seckill.stock == 2 and sale.seckill.initial_stock == 2, sale
assert sale.seckill.pay_within_secs == 600, sale
print(f"   voucher {sale.id}")

step("a shopper may not create one; nobody without a token may grab")
expect_error(
    create_voucher.sync_detailed(client=alice, body=CreateVoucher(shop_id=7, title="x", pay_value=1, actual_value=2)),
    403,
    ErrorCode.FORBIDDEN,
)
expect_error(grab_voucher.sync_detailed(sale.id, client=anonymous), 401, ErrorCode.UNAUTHORIZED)

step("alice grabs it")
admitted = expect(grab_voucher.sync_detailed(sale.id, client=alice), 202, Admitted)
assert admitted.status == "pending", admitted
first = admitted.order_id
assert isinstance(first, str) and first.isdigit() and int(first) > 2**53, first
print(f"   order {first}")
held = expect_error(grab_voucher.sync_detailed(sale.id, client=alice), 409, ErrorCode.ALREADY_ORDERED)
assert held.order_id == first, held

step("alice reads her order")
order = written(alice, first)
assert order.order_id == first and order.voucher_id == sale.id, order
assert order.status == OrderStatus.CREATED, order
assert isinstance(order.pay_before, datetime.datetime), order
assert order.paid_at is None and order.payment is None, order
expect_error(get_order.sync_detailed(first, client=bob), 404, ErrorCode.NOT_FOUND)

step("alice checks out; the payment provider confirms her payment")
checkout = expect(checkout_order.sync_detailed(first, client=alice), 200, Checkout)
assert checkout.order_id == first and checkout.amount == 5000 and checkout.currency == "CNY", checkout
assert checkout.pay_before == order.pay_before, checkout
assert provider_notifies("payment.succeeded", first, checkout.amount) == "paid"
paid = expect(get_order.sync_detailed(first, client=alice), 200, OrderResponse)
assert paid.status == OrderStatus.PAID, paid
assert isinstance(paid.paid_at, datetime.datetime), paid
assert paid.payment.provider == PayType.PROVIDER and paid.payment.amount == 5000, paid
assert isinstance(paid.redeem_code, str) and len(paid.redeem_code) == 16, paid
expect_error(checkout_order.sync_detailed(first, client=alice), 409, ErrorCode.ORDER_PAID)
expect_error(cancel_order.sync_detailed(first, client=alice), 409, ErrorCode.ORDER_PAID)

step("the shop's staff redeem alice's coupon with her code, once")
expect_error(
    redeem_order.sync_detailed(first, client=staff, body=RedeemOrder(code="0" * 16)), 422, ErrorCode.VALIDATION
)
used = expect(redeem_order.sync_detailed(first, client=staff, body=RedeemOrder(code=paid.redeem_code)), 200, OrderResponse)
assert used.status == OrderStatus.USED and isinstance(used.used_at, datetime.datetime), used
expect_error(
    redeem_order.sync_detailed(first, client=staff, body=RedeemOrder(code=paid.redeem_code)), 409, ErrorCode.ORDER_USED
)
expect_error(refund_order.sync_detailed(first, client=alice), 409, ErrorCode.ORDER_USED)
listed = expect(list_shop_orders.sync_detailed(7, client=staff), 200, OrderPage)
assert [o.order_id for o in listed.items] == [first], listed

step("bob grabs the second unit and cancels it")
second = expect(grab_voucher.sync_detailed(sale.id, client=bob), 202, Admitted).order_id
written(bob, second)
cancelled = expect(cancel_order.sync_detailed(second, client=bob), 200, OrderResponse)
assert cancelled.status == OrderStatus.CANCELLED, cancelled
assert isinstance(cancelled.closed_at, datetime.datetime), cancelled
expect_error(checkout_order.sync_detailed(second, client=bob), 409, ErrorCode.ORDER_CLOSED)
stock = expect(get_voucher.sync_detailed(sale.id, client=anonymous), 200, VoucherResponse).stock
assert stock == 1, f"the cancelled unit is back on sale: stock {stock}"

step("each lists their orders")
mine = expect(list_my_orders.sync_detailed(client=alice), 200, list)
assert [(o.order_id, o.status) for o in mine] == [(first, OrderStatus.USED)], mine
bobs = expect(list_my_orders.sync_detailed(client=bob), 200, list)
assert [(o.order_id, o.status) for o in bobs] == [(second, OrderStatus.CANCELLED)], bobs

step("the administrator pages through the sale's orders")
page = expect(list_sale_orders.sync_detailed(sale.id, client=admin, limit=1), 200, OrderPage)
assert len(page.items) == 1 and isinstance(page.next_, str), page
rest = expect(list_sale_orders.sync_detailed(sale.id, client=admin, after=page.next_), 200, OrderPage)
assert {o.order_id for o in page.items + rest.items} == {first, second}, (page, rest)
assert rest.next_ is None, rest

step("carol buys the unit back on sale, pays, asks for a refund; the provider refunds her")
third = expect(grab_voucher.sync_detailed(sale.id, client=carol), 202, Admitted).order_id
written(carol, third)
assert provider_notifies("payment.succeeded", third, 5000) == "paid"
refunding = expect(refund_order.sync_detailed(third, client=carol), 200, OrderResponse)
assert refunding.status == OrderStatus.REFUNDING and refunding.refund_reason.value == "requested", refunding
assert provider_notifies("refund.succeeded", third, 5000) == "refunded"
refunded = expect(get_order.sync_detailed(third, client=carol), 200, OrderResponse)
assert refunded.status == OrderStatus.REFUNDED and isinstance(refunded.refunded_at, datetime.datetime), refunded
stock = expect(get_voucher.sync_detailed(sale.id, client=anonymous), 200, VoucherResponse).stock
assert stock == 1, f"the refunded unit is back on sale: stock {stock}"

step("the administrator closes the sale; a later grab hears `ended`")
closed = expect(close_sale.sync_detailed(sale.id, client=admin), 200, VoucherResponse)
assert closed.seckill.end_time <= datetime.datetime.now(datetime.timezone.utc), closed
expect_error(grab_voucher.sync_detailed(sale.id, client=carol), 409, ErrorCode.ENDED)

print("flow ok", flush=True)
sys.exit(0)
