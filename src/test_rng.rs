//! Tests only: a fixed pseudo-random sequence (xorshift64), so that the property tests
//! check the same cases on every run.

pub struct TestRng(u64);

impl TestRng {
    /// `seed` must not be 0 (the sequence would stay 0).
    pub fn new(seed: u64) -> TestRng {
        assert_ne!(seed, 0);
        TestRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}
