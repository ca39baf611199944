//! The growth rule's core, shared by the library (which decides which small stacks the
//! timeline follows) and the command (which flags growing stacks): a series rises
//! steadily when at least 70% of its steps go up and at most 15% go down.

/// Whether `ups` rises and `downs` falls out of `steps` steps make a steady rise.
pub fn mostly_rising(steps: u64, ups: u64, downs: u64) -> bool {
    ups * 10 >= steps * 7 && downs * 100 <= steps * 15
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
}
