//! Utilities that belong to no stage.
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A multiplicative hasher: keys are addresses and small ids, already well spread.
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(v as u64);
    }
    fn write_u8(&mut self, v: u8) {
        self.write_u64(v as u64);
    }
    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A hash map for the library's own tables: keyed by addresses, ids and the like, with
/// no adversary to hash against. Also wherever a process's start or exit makes a map: a
/// std one seeds its hasher with a `getrandom` call (once a thread), in every process.
pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;
/// The set of `FxMap`.
pub type FxSet<K> = std::collections::HashSet<K, BuildHasherDefault<FxHasher>>;

/// Grows `v` to `len` zeros at its end. A large vector is a mapping of its own
/// (`interpose::malloc::RealAllocator`): a fresh zeroed one costs no memory until its
/// pages are written, where `resize` would write every new element (a table by stack id
/// sized to the next power of two after `import torch`'s 2M stacks: 8 MB never used).
pub fn grow_zeroed<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if len <= v.len() {
        return;
    }
    let mut grown = vec![T::default(); len];
    grown[..v.len()].copy_from_slice(v);
    *v = grown;
}

#[cfg(test)]
mod tests {
    #[test]
    fn grow_zeroed_keeps_the_contents_and_adds_zeros() {
        let mut v = vec![1u32, 2, 3];
        super::grow_zeroed(&mut v, 1 << 20);
        assert_eq!((&v[..4], v.len(), v.iter().filter(|&&x| x != 0).count()), (&[1, 2, 3, 0][..], 1 << 20, 3));
        super::grow_zeroed(&mut v, 2);
        assert_eq!(v.len(), 1 << 20);
    }
}
