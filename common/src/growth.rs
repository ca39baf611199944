//! The growth rule's core, shared by the library and the `leaktrace` command.
//!
//! Two forms, one idea (a series rises steadily; most of its history goes up, little
//! goes down):
//! * **On a series** (`rises_steadily`: the command's verdict on a followed stack or a
//!   line of the user's code, and the library's choice of the lines whose holders it
//!   looks for while they grow): at least 70% of its *pairs* of points (an earlier one,
//!   a later one) rise, and at most 15% of its steps go down. Pairs, not steps: memory
//!   that grows in steps (a Python list's or a `std::vector`'s buffer, which is
//!   reallocated larger now and then) is flat between some points and not others,
//!   depending on where the points fall. Counted by steps, a list that kept every
//!   step's loss rose at 10 of 15 steps in one run and 13 of 15 in the next, on either
//!   side of the 70% line; counted by pairs, a flat stretch costs only the pairs inside
//!   it, so a rise spread over many steps passes wherever the points fall, while a
//!   plateau (one long flat stretch, whose pairs are many) and a single jump (two flat
//!   halves) still fail.
//! * **On counts** (`mostly_rising`: the library's `collector::state::Trend`, which keeps
//!   only how many of a group's steps went up and down at reports, to choose the small
//!   stacks the timeline follows): at least 70% of the steps go up and at most 15% go
//!   down. Stricter on a staircase; it decides only what is followed, not the verdict.

/// Whether `ups` rises and `downs` falls out of `steps` steps make a steady rise.
pub fn mostly_rising(steps: u64, ups: u64, downs: u64) -> bool {
    ups * 10 >= steps * 7 && downs * 100 <= steps * 15
}

/// Whether `values` rise steadily: at least 70% of the pairs (earlier, later) rise and
/// at most 15% of the steps go down (the module's comment says why pairs).
pub fn rises_steadily(values: &[u64]) -> bool {
    let n = values.len() as u64;
    if n < 2 {
        return false;
    }
    let steps = n - 1;
    let downs = values.windows(2).filter(|w| w[1] < w[0]).count() as u64;
    // The steps first: they cost a pass, the pairs a sort.
    downs * 100 <= steps * 15 && rising_pairs(values) * 10 >= n * (n - 1) / 2 * 7
}

/// How many pairs `i < j` have `values[j] > values[i]`, in O(n log n) (the library asks
/// after every timeline point, for up to 256 lines of up to 1,024 points): each value's
/// rank among the distinct values, and a Fenwick tree of the ranks seen so far.
fn rising_pairs(values: &[u64]) -> u64 {
    let mut distinct = values.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let mut tree = vec![0u64; distinct.len() + 1];
    let mut rising = 0;
    for v in values {
        // Ranks are 1-based in the tree; the earlier values below `v` are those of
        // ranks 1..=rank-1.
        let rank = distinct.partition_point(|d| d < v) + 1;
        let mut i = rank - 1;
        while i > 0 {
            rising += tree[i];
            i &= i - 1;
        }
        let mut i = rank;
        while i < tree.len() {
            tree[i] += 1;
            i += i & i.wrapping_neg();
        }
    }
    rising
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seventy_percent_up_and_fifteen_percent_down_at_most() {
        assert!(mostly_rising(10, 7, 1));
        assert!(!mostly_rising(10, 6, 0));
        assert!(!mostly_rising(20, 16, 4));
        assert!(mostly_rising(20, 17, 3));
    }

    #[test]
    fn rising_pairs_match_counting_every_pair() {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for len in 0..60 {
            let values: Vec<u64> = (0..len)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng % 8
                })
                .collect();
            let every: u64 = (0..values.len()).map(|i| (i + 1..values.len()).filter(|&j| values[j] > values[i]).count() as u64).sum();
            assert_eq!(rising_pairs(&values), every, "{values:?}");
        }
    }

    #[test]
    fn a_staircase_rises_a_plateau_a_jump_and_noise_do_not() {
        // A list's buffer between 16 points: up at 10 steps, flat at 5 (a run that the
        // steps' rule called flat).
        let list = [25984, 32992, 32992, 37152, 41824, 47104, 47104, 53024, 59680, 67168, 67168, 75616, 85120, 85120, 85120, 95808];
        assert!(rises_steadily(&list));
        assert!(!mostly_rising(15, 10, 0));
        let plateau: Vec<u64> = (0..16).map(|i: u64| i.min(5) * 4096).collect();
        assert!(!rises_steadily(&plateau));
        let jump: Vec<u64> = (0..16).map(|i| if i < 8 { 0 } else { 1 << 20 }).collect();
        assert!(!rises_steadily(&jump));
        let noisy: Vec<u64> = (0..16).map(|i| if i % 2 == 0 { 10_000 } else { 50_000 }).collect();
        assert!(!rises_steadily(&noisy));
        let dips: Vec<u64> = (0..20).map(|i| 1000 + i * 4096 - if i % 10 == 5 { 6000 } else { 0 }).collect();
        assert!(rises_steadily(&dips));
        assert!(!rises_steadily(&[5]));
        assert!(rises_steadily(&[1, 2]));
    }
}
