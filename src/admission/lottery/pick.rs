//! The draw's procedure, for a segmented sale's draw made here: the same as
//! `draw_lottery` in `lua/seckill.lua` (a sale in one segment draws in Redis) and as
//! `scripts/verify-draw` (anyone checks a published draw), so one seed and one list of
//! entrants give the same winners wherever they are drawn.

use ring::digest::{digest, SHA1_FOR_LEGACY_USE_ONLY};

const TWO_TO_52: u64 = 1 << 52;

/// The winners among `entrants` (in increasing user id) of a draw of `stock` units with
/// `seed` (hex), in the order they were drawn: a partial Fisher-Yates shuffle whose
/// picks take the numbers SHA-1("<seed>:<c>"), c = 0, 1, 2, ..., each read as its first
/// 52 bits and used only below the largest multiple of the places left (so no place is
/// favoured).
pub fn winners(seed: &str, entrants: &[i64], stock: usize) -> Vec<i64> {
    let mut order = entrants.to_vec();
    let n = order.len();
    let k = stock.min(n);
    let mut c: u64 = 0;
    for i in 0..k {
        let m = (n - i) as u64;
        let limit = m * (TWO_TO_52 / m);
        let r = loop {
            let r = first_52_bits(seed, c);
            c += 1;
            if r < limit {
                break r;
            }
        };
        order.swap(i, i + (r % m) as usize);
    }
    order.truncate(k);
    order
}

fn first_52_bits(seed: &str, c: u64) -> u64 {
    let hash = digest(&SHA1_FOR_LEGACY_USE_ONLY, format!("{seed}:{c}").as_bytes());
    let first: [u8; 8] = hash.as_ref()[..8].try_into().expect("SHA-1 has 20 bytes");
    // The first 13 hex digits: 52 bits.
    u64::from_be_bytes(first) >> 12
}

#[cfg(test)]
mod tests {
    use super::*;

    // Each expected list is what scripts/verify-draw's `winners_of` printed for the same
    // seed, entrants and stock: the two implementations agree.

    #[test]
    fn the_winners_are_those_the_verification_script_recomputes() {
        assert_eq!(
            winners("00ff", &[3, 5, 8, 13, 21, 34, 55, 89, 144, 233], 4),
            vec![233, 5, 13, 21]
        );
        let seed = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
        let thousand: Vec<i64> = (1..=1000).collect();
        assert_eq!(
            winners(seed, &thousand, 10),
            vec![132, 240, 387, 556, 945, 812, 412, 203, 591, 322]
        );
    }

    #[test]
    fn with_more_units_than_entrants_every_entrant_wins() {
        assert_eq!(winners("ab", &[7, 9], 5), vec![7, 9]);
        assert!(winners("ab", &[], 5).is_empty());
    }
}
