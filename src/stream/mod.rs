//! The order stream between admission and the worker: `stream.orders`, read by the
//! consumer group `seckill-workers`.
//!
//! [`entry`]: the entry format; [`group`]: the consumer group (read, claim, ack,
//! touch); [`dead`]: dead letters and settling buried orders; [`trim`]: trimming;
//! [`inspect`]: reading the stream as it is; [`readmit`]: an order admitted again into
//! its sale's current state.

mod dead;
mod entry;
mod group;
mod inspect;
mod readmit;
mod trim;

pub(crate) use dead::{dead_letter, settle_dead};
pub(crate) use entry::parse_id as parse_entry_id;
pub use entry::{DeadReason, Delivery};
pub(crate) use group::{
    ack, claim, delivery_counts, ensure_group, entry_ids, forget_idle_consumers, read,
    still_pending, touch,
};
pub use group::{ReadFrom, GROUP};
pub(crate) use inspect::{entries, held_in, page, range};
pub use inspect::{stats, StreamStats};
pub(crate) use readmit::{readmit, Readmission, Readmitted};
pub(crate) use trim::trim_acknowledged;
