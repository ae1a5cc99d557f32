//! One stream entry: its fields (written by `lua/seckill.lua`), parsed leniently so a
//! bad entry is dead-lettered rather than failing a read.

use chrono::{DateTime, Utc};
use redis::{RedisResult, Value};

use crate::domain::{Epoch, OrderId, UserId, VoucherId};
use crate::keys::{entry_field, SaleSegment};
use crate::store::orders::NewOrder;

/// What the worker is delivered, one order at a time: an order of a stream entry (an
/// entry holds the orders of one admission call; they share its `entry_id`), or what
/// cannot be an order.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    Order {
        entry_id: String,
        order: NewOrder,
    },
    /// An entry that must go to the dead-letter stream without being written: malformed
    /// (missing or non-numeric fields, or deleted from the stream), or a poison entry
    /// delivered too often. `order` is set when the fields did parse.
    DeadLetter {
        entry_id: String,
        fields: Vec<(String, String)>,
        order: Option<NewOrder>,
        reason: DeadReason,
    },
}

/// Why an entry goes to the dead-letter stream; its text is the dead letter's `reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeadReason {
    /// Deleted from the stream while pending (nothing left to read).
    Deleted,
    /// Missing or non-numeric fields.
    Malformed,
    /// An order naming a voucher of another shard (not written by the admission script).
    OtherShard,
    /// Delivered this often without being written.
    Poison { deliveries: u64 },
    /// Will never be written, for this reason (Postgres refused it, ...).
    Refused(String),
}

impl std::fmt::Display for DeadReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeadReason::Deleted => f.write_str("malformed: entry no longer in the stream"),
            DeadReason::Malformed => f.write_str("malformed: missing or non-numeric fields"),
            DeadReason::OtherShard => f.write_str("malformed: voucher of another shard"),
            DeadReason::Poison { deliveries } => {
                write!(f, "delivered {deliveries} times without being written")
            }
            DeadReason::Refused(why) => f.write_str(why),
        }
    }
}

impl Delivery {
    pub(crate) fn entry_id(&self) -> &str {
        match self {
            Delivery::Order { entry_id, .. } | Delivery::DeadLetter { entry_id, .. } => entry_id,
        }
    }

    pub fn order(&self) -> Option<&NewOrder> {
        match self {
            Delivery::Order { order, .. } => Some(order),
            Delivery::DeadLetter { order, .. } => order.as_ref(),
        }
    }

    /// Turns the entry into a dead letter with `reason`.
    pub(crate) fn into_dead_letter(self, reason: DeadReason) -> Delivery {
        match self {
            Delivery::Order { entry_id, order } => Delivery::DeadLetter {
                entry_id,
                fields: order_fields(&order),
                order: Some(order),
                reason,
            },
            Delivery::DeadLetter {
                entry_id,
                fields,
                order,
                ..
            } => Delivery::DeadLetter {
                entry_id,
                fields,
                order,
                reason,
            },
        }
    }

    /// The orders of one stream entry (an entry that is deleted or does not parse is
    /// one dead letter).
    pub(super) fn parse(entry_id: String, fields: Option<Vec<(String, String)>>) -> Vec<Delivery> {
        let Some(fields) = fields else {
            return vec![Delivery::DeadLetter {
                entry_id,
                fields: Vec::new(),
                order: None,
                reason: DeadReason::Deleted,
            }];
        };
        let orders = match fields.first() {
            Some((k, _)) if k == entry_field::ORDERS => orders_of_a_call(&fields),
            _ => one_order(&fields).map(|o| vec![o]),
        };
        match orders {
            Some(orders) => orders
                .into_iter()
                .map(|order| Delivery::Order {
                    entry_id: entry_id.clone(),
                    order,
                })
                .collect(),
            None => vec![Delivery::DeadLetter {
                entry_id,
                fields,
                order: None,
                reason: DeadReason::Malformed,
            }],
        }
    }
}

fn positive(v: &str) -> Option<i64> {
    v.parse::<i64>().ok().filter(|n| *n > 0)
}

fn admitted_at(ms: i64) -> Option<DateTime<Utc>> {
    DateTime::<Utc>::from_timestamp_millis(ms)
}

/// An entry of one order, each field named once (earlier releases, tools).
fn one_order(fields: &[(String, String)]) -> Option<NewOrder> {
    let get = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| positive(v))
    };
    let voucher_id = VoucherId::new(get(entry_field::VOUCHER_ID)?)?;
    // Absent in a sale of one segment; else `<segment>/<segments>`.
    let (segment, segments) = match fields.iter().find(|(k, _)| k == entry_field::SEGMENT) {
        None => (0, 1),
        Some((_, v)) => SaleSegment::parse_label(voucher_id, v).map(|p| (p.segment, p.segments))?,
    };
    // Absent in earlier releases' entries and tools'.
    let epoch = match fields.iter().find(|(k, _)| k == entry_field::EPOCH) {
        None => None,
        Some((_, v)) => Some(Epoch::new(positive(v)?)?),
    };
    Some(NewOrder {
        segment,
        segments,
        epoch,
        id: OrderId::new(get(entry_field::ORDER_ID)?)?,
        voucher_id,
        user_id: UserId::new(get(entry_field::USER_ID)?)?,
        admitted_at: admitted_at(get(entry_field::ADMITTED_MS)?)?,
    })
}

/// The orders of one admission call's entry, read in order: `orders` N, `admitted_ms`,
/// then runs of `voucher_id` [`part`] [`epoch`] and pairs `order_id`, `user_id`.
/// Anything out of place, or a count that is not N, and the whole entry is malformed.
fn orders_of_a_call(fields: &[(String, String)]) -> Option<Vec<NewOrder>> {
    let mut rest = fields.iter();
    let n = positive(&rest.next()?.1)? as usize;
    let (k, v) = rest.next()?;
    let admitted_at = match k.as_str() {
        entry_field::ADMITTED_MS => admitted_at(positive(v)?)?,
        _ => return None,
    };
    let mut orders = Vec::with_capacity(n.min(4096));
    let mut sale: Option<(VoucherId, u8, u8)> = None;
    let mut epoch: Option<Epoch> = None;
    while let Some((k, v)) = rest.next() {
        match k.as_str() {
            entry_field::VOUCHER_ID => {
                sale = Some((VoucherId::new(positive(v)?)?, 0, 1));
                epoch = None;
            }
            entry_field::SEGMENT => {
                let (voucher_id, _, _) = sale?;
                let p = SaleSegment::parse_label(voucher_id, v)?;
                sale = Some((voucher_id, p.segment, p.segments));
            }
            entry_field::EPOCH => {
                sale?;
                epoch = Some(Epoch::new(positive(v)?)?);
            }
            entry_field::ORDER_ID => {
                let (voucher_id, segment, segments) = sale?;
                let id = OrderId::new(positive(v)?)?;
                let (k, v) = rest.next()?;
                if k != entry_field::USER_ID {
                    return None;
                }
                orders.push(NewOrder {
                    segment,
                    segments,
                    epoch,
                    id,
                    voucher_id,
                    user_id: UserId::new(positive(v)?)?,
                    admitted_at,
                });
            }
            _ => return None,
        }
    }
    (orders.len() == n).then_some(orders)
}

fn order_fields(order: &NewOrder) -> Vec<(String, String)> {
    let mut fields = vec![
        (entry_field::ORDER_ID.into(), order.id.to_string()),
        (entry_field::VOUCHER_ID.into(), order.voucher_id.to_string()),
        (entry_field::USER_ID.into(), order.user_id.to_string()),
        (
            entry_field::ADMITTED_MS.into(),
            order.admitted_at.timestamp_millis().to_string(),
        ),
    ];
    if let Some(label) = order.sale_segment().label() {
        fields.push((entry_field::SEGMENT.into(), label));
    }
    if let Some(epoch) = order.epoch {
        fields.push((entry_field::EPOCH.into(), epoch.to_string()));
    }
    fields
}

/// `[[stream, [[id, [field, value, ...] | nil], ...]], ...]` or nil on timeout.
pub(super) fn parse_read_reply(reply: Value) -> RedisResult<Vec<Delivery>> {
    let mut out = Vec::new();
    let streams = match reply {
        Value::Nil => return Ok(out),
        Value::Array(streams) => streams,
        Value::Map(pairs) => pairs
            .into_iter()
            .map(|(k, v)| Value::Array(vec![k, v]))
            .collect(),
        _ => return Err(unexpected()),
    };
    for stream in streams {
        let Value::Array(mut segments) = stream else {
            return Err(unexpected());
        };
        let Some(entries) = segments.pop() else {
            return Err(unexpected());
        };
        out.extend(parse_entries(entries)?);
    }
    Ok(out)
}

/// The orders of a stream reply's entries, in order (several per entry).
pub(super) fn parse_entries(entries: Value) -> RedisResult<Vec<Delivery>> {
    Ok(parse_raw(entries)?
        .into_iter()
        .flat_map(|(id, fields)| Delivery::parse(id, fields))
        .collect())
}

/// Delivery ids and fields of a stream reply (`None`: the entry was deleted). Field names
/// and values that are not UTF-8 are kept, lossily, so a poison entry stays visible.
pub(super) fn parse_raw(entries: Value) -> RedisResult<Vec<RawEntry>> {
    let Value::Array(entries) = entries else {
        return Err(unexpected());
    };
    let text = |v: &Value| match v {
        Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        other => redis::from_redis_value_ref::<String>(other).ok(),
    };
    let mut out = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(mut pair) = entry else {
            return Err(unexpected());
        };
        if pair.len() != 2 {
            return Err(unexpected());
        }
        let fields = pair.pop().expect("two elements");
        let id: String = redis::from_redis_value(pair.pop().expect("two elements"))?;
        let fields = match fields {
            Value::Nil => None,
            Value::Array(flat) => Some(
                flat.chunks(2)
                    .filter_map(|kv| match kv {
                        [k, v] => Some((text(k)?, text(v)?)),
                        _ => None,
                    })
                    .collect(),
            ),
            _ => return Err(unexpected()),
        };
        out.push((id, fields));
    }
    Ok(out)
}

/// A stream entry's id and its fields (`None` when the entry was deleted).
pub(crate) type RawEntry = (String, Option<Vec<(String, String)>>);

pub(super) fn unexpected() -> redis::RedisError {
    redis::RedisError::from((
        redis::ErrorKind::UnexpectedReturnType,
        "unexpected reply to a stream read",
    ))
}

pub(crate) fn parse_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(id: String, fields: Option<Vec<(String, String)>>) -> Delivery {
        let mut all = Delivery::parse(id, fields);
        assert_eq!(all.len(), 1, "{all:?}");
        all.remove(0)
    }

    #[test]
    fn an_entry_of_a_call_parses_into_each_of_its_orders_with_its_sale_and_segment() {
        let all = Delivery::parse(
            "7-1".into(),
            fields(&[
                ("orders", "3"),
                ("admitted_ms", "1790000000000"),
                ("voucher_id", "2"),
                ("order_id", "10"),
                ("user_id", "3"),
                ("order_id", "11"),
                ("user_id", "4"),
                ("voucher_id", "5"),
                ("part", "1/3"),
                ("order_id", "12"),
                ("user_id", "6"),
            ]),
        );
        let got: Vec<_> = all
            .iter()
            .map(|e| {
                let o = e.order().expect("an order");
                (
                    e.entry_id(),
                    o.id.get(),
                    o.voucher_id.get(),
                    o.user_id.get(),
                    o.segment,
                    o.segments,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("7-1", 10, 2, 3, 0, 1),
                ("7-1", 11, 2, 4, 0, 1),
                ("7-1", 12, 5, 6, 1, 3)
            ]
        );
        assert!(all
            .iter()
            .all(|e| e.order().unwrap().admitted_at.timestamp_millis() == 1790000000000));
    }

    #[test]
    fn an_entry_of_a_call_out_of_order_or_miscounted_is_one_malformed_dead_letter() {
        let head = [("orders", "2"), ("admitted_ms", "1790000000000")];
        let bodies: [&[(&str, &str)]; 5] = [
            // One order for a count of two.
            &[("voucher_id", "2"), ("order_id", "10"), ("user_id", "3")],
            // An order before any sale.
            &[
                ("order_id", "10"),
                ("user_id", "3"),
                ("voucher_id", "2"),
                ("order_id", "11"),
                ("user_id", "4"),
            ],
            // A user without its order.
            &[
                ("voucher_id", "2"),
                ("user_id", "3"),
                ("order_id", "11"),
                ("user_id", "4"),
            ],
            // A segment of another sale's number of segments.
            &[
                ("voucher_id", "2"),
                ("part", "4/3"),
                ("order_id", "10"),
                ("user_id", "3"),
                ("order_id", "11"),
                ("user_id", "4"),
            ],
            // A stray field.
            &[
                ("voucher_id", "2"),
                ("order_id", "10"),
                ("user_id", "3"),
                ("x", "1"),
                ("order_id", "11"),
                ("user_id", "4"),
            ],
        ];
        for body in bodies {
            let all: Vec<(&str, &str)> = head.iter().chain(body).copied().collect();
            let parsed = Delivery::parse("1-0".into(), fields(&all));
            assert!(
                matches!(
                    parsed.as_slice(),
                    [Delivery::DeadLetter {
                        reason: DeadReason::Malformed,
                        ..
                    }]
                ),
                "{body:?}: {parsed:?}"
            );
        }
    }

    fn fields(pairs: &[(&str, &str)]) -> Option<Vec<(String, String)>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn a_complete_entry_parses_into_an_order() {
        let e = one(
            "1-0".into(),
            fields(&[
                ("order_id", "9"),
                ("voucher_id", "2"),
                ("user_id", "3"),
                ("admitted_ms", "1790000000000"),
            ]),
        );
        let Delivery::Order { order, .. } = e else {
            panic!("not an order: {e:?}")
        };
        assert_eq!(
            (order.id.get(), order.voucher_id.get(), order.user_id.get()),
            (9, 2, 3)
        );
        assert_eq!(
            order.segment, 0,
            "an entry without a segment is of segment 0"
        );
    }

    #[test]
    fn an_entry_of_a_segmented_sale_carries_its_segment_and_a_bad_segment_is_malformed() {
        let with = |segment: &str| {
            one(
                "1-0".into(),
                fields(&[
                    ("order_id", "9"),
                    ("voucher_id", "2"),
                    ("user_id", "3"),
                    ("admitted_ms", "1790000000000"),
                    ("part", segment),
                ]),
            )
        };
        assert_eq!(
            with("5/8").order().map(|o| (o.segment, o.segments)),
            Some((5, 8))
        );
        for bad in ["5", "3/3", "1/65", "-1/2", "x/2", "", "1/"] {
            assert!(
                matches!(with(bad), Delivery::DeadLetter { .. }),
                "segment {bad:?}"
            );
        }
    }

    #[test]
    fn entries_with_missing_or_bad_fields_or_no_fields_are_malformed() {
        for f in [
            fields(&[("order_id", "9"), ("voucher_id", "2"), ("admitted_ms", "1")]),
            fields(&[
                ("order_id", "x"),
                ("voucher_id", "2"),
                ("user_id", "3"),
                ("admitted_ms", "1"),
            ]),
            fields(&[
                ("order_id", "-9"),
                ("voucher_id", "2"),
                ("user_id", "3"),
                ("admitted_ms", "1"),
            ]),
            None,
        ] {
            assert!(matches!(one("1-0".into(), f), Delivery::DeadLetter { .. }));
        }
    }
}
