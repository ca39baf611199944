//! The second level of the unwind memo: a per-thread decision tree over the stack words
//! that earlier unwinds read, consulted when the 16-entry memo misses.
//!
//! A training step of a PyTorch model allocates from ~1,500 call paths, each once, then
//! the next step repeats them: far more than the memo holds, so nearly every capture of
//! the loop was unwound again (86% of them in `torch_train.py`'s steady state). Keeping
//! thousands of whole memo entries would not help by itself: paths that share a stack
//! pointer share their inner frames too (the allocator's path) and differ further out
//! (which operator called it), so comparing a capture with one stored path after another
//! would reread that shared prefix each time.
//!
//! So the stored paths form a tree. A root per stack pointer; under it, each node is one
//! (address, value) pair an unwind read, and a path from the root to a leaf is one
//! earlier capture's reads, ending in its stack id. Paths that read the same words share
//! their first nodes. A lookup reads the word at each node's address and follows the
//! child whose value is there; a leaf reached means every word that capture read holds
//! what it held then — the memo's own condition — so the unwind would give the same
//! stack. Any mismatch ends the lookup as a miss (no backtracking: a miss is only slower).
//!
//! The start RBP, which some unwinds depend on (see the memo), is a pseudo-read at the
//! head of a path (`BP_REGISTER`). Nothing here reads memory: the caller passes `read`,
//! and every address handed in was checked to lie in the thread's live stack above the
//! same stack pointer when it was recorded.
//!
//! No allocation: the tree is one mapping of `MAX_NODES` nodes, touched as used. A thread
//! starts with a limit of `FIRST_LIMIT` nodes and doubles it each time the tree fills,
//! up to `MAX_NODES`, while a budget shared by all threads (`BUDGET_NODES`) lasts: a
//! training step's paths need 64k–128k nodes (a tree of 64k was emptied every step and
//! answered nothing), a Python loop's fewer. A tree full at its limit, or read in an
//! older dlclose epoch, starts empty again; one that filled without answering a quarter
//! as many captures as it filed also stops filing for as many captures (paths taken
//! once, as during `import torch`, would only churn it).
//!
//! A lookup that fails still walks every sibling list down to where the capture's path
//! leaves the tree, a cache miss per node. While `import torch` runs, most captures
//! take paths new to their root (898k unwinds, 879k of them new stacks), so a root
//! whose lookups keep failing is looked in only now and then until one answers again
//! (`GATE_AFTER`, `GATE_EVERY`): a skipped lookup costs at most the unwind it would
//! have saved, and that root's paths are answered again after its next answer.
//!
//! **Long lists are indexed.** A function that calls many others at one depth — a
//! static initializer that registers thousands of operators, generated code, a test
//! runner calling each test — gives one node as many children as it has call sites,
//! all at the same stack pointer. Walked as a list, each lookup and each filing went
//! through them one by one: a program that calls 300,000 allocating sites from one
//! function, three times over, took 50 s under the library against 0.01 s without
//! (lists of 87k nodes, 29k steps a lookup). A list that would grow past `LONG_LIST`
//! nodes is moved to the tree's index instead — a hash table from (list, word) to the
//! node — and its first node says so (`INDEXED`): a lookup that does not match that
//! node reads the index once. Every node of a list reads the same stack word (an unwind
//! is a function of the words it read: the same words so far, the same next address),
//! so the word read for the first node is the key; a list whose nodes read different
//! words (the start RBP and a stack word) is not indexed, and stops taking nodes at
//! `LONG_LIST`, as any list once the index is full: no walk is longer. The PyTorch
//! training step's longest list has 48 nodes: nothing there changes.
use std::sync::atomic::{AtomicUsize, Ordering};

/// Nodes a thread's tree may grow to (16 bytes each: 8 MiB of address space).
pub const MAX_NODES: usize = 1 << 19;
/// A thread's first limit (512 KiB of nodes).
const FIRST_LIMIT: usize = 1 << 15;
/// Nodes all threads' trees may hold together (32 MiB).
const BUDGET_NODES: usize = 1 << 21;
static BUDGET: AtomicUsize = AtomicUsize::new(BUDGET_NODES);
/// Direct-mapped roots by stack pointer.
pub const ROOTS: usize = 1 << 12;
/// A root whose lookups failed this many times in a row is looked in only once per
/// `GATE_EVERY` captures there (paths new to it, as while `import torch` runs).
const GATE_AFTER: u32 = 8;
const GATE_EVERY: u32 = 8;
/// A node's `off` for the start-RBP pseudo-read.
const BP_REGISTER: u32 = u32::MAX;
/// A node's `off` for the end of a path; its `val` is the path's stack id, its
/// `sibling` the number of reads on the path.
const LEAF: u32 = u32::MAX - 1;
/// Node 0's `off` (set at every reset): a walk that ever came to index 0 stops there.
/// The lowest of the three tags, so one comparison sends a walk off its common case.
const STOP: u32 = u32::MAX - 2;
/// Nodes a list holds before it moves to the index (or, where it cannot, takes no more).
const LONG_LIST: usize = 64;
/// On a list's first node, in `sibling`: the list's other nodes are in the index.
const INDEXED: u32 = 1 << 31;
/// Slots of a tree's index (16 bytes each: 2 MiB of address space, touched as used).
const INDEX_SLOTS: usize = 1 << 17;
/// Entries the index takes at most: three quarters of its slots.
const INDEX_MAX: usize = INDEX_SLOTS * 3 / 4;
/// An index entry's `list` is its list's first node (below `MAX_NODES`) and, above
/// these bits, the tree's generation when it was made: entries of earlier generations
/// count as free, so a reset need not clear the index.
const GENERATION_SHIFT: u32 = 19;
const GENERATIONS: u32 = 1 << (32 - GENERATION_SHIFT);

const _: () = assert!(MAX_NODES <= 1 << GENERATION_SHIFT && (MAX_NODES as u32) < INDEXED);

/// Takes `n` nodes from the shared budget, if it has them.
fn take_budget(n: usize) -> bool {
    BUDGET.fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| b.checked_sub(n)).is_ok()
}

/// One read of a path: the word `off` bytes above the stack pointer held `val`. Its
/// first child is always the next node: a path's new nodes are filed one after another,
/// and a path that parts from another is linked at the end of a sibling list, never at
/// its head. So a lookup that matches goes on to `index + 1` without waiting for a link
/// (the walk was a chain of dependent loads, ~80 per path in a training step), and a
/// node is 16 bytes instead of 32.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Node {
    /// The word read, or the stack id on a `LEAF`.
    val: u64,
    /// Byte offset of the word from the stack pointer, or one of the tags `BP_REGISTER`,
    /// `LEAF`, `STOP`.
    off: u32,
    /// Next node of the same parent (0: none); always a later node than this one. On a
    /// `LEAF`, the number of reads on its path.
    sibling: u32,
}

/// Where a read of a path being filed goes in a list (`HitTree::place_in_list`).
enum Place {
    /// The list's node for it: the path goes on under that node.
    Found(u32),
    /// The path parts here; its node is linked after this one (0: as the root's first).
    After(u32),
    /// The path parts here, in an indexed list: the index has taken its node, the one
    /// filed next (`HitTree::used`).
    Indexed,
    /// The path is not filed: it goes on past another path's end, or the list takes no
    /// more nodes (`LONG_LIST`; the index full, or the list's nodes read different words).
    Refused,
}

/// A node of an indexed list: the list whose first node is `list % 2^GENERATION_SHIFT`
/// (of generation `list >> GENERATION_SHIFT`; 0: a free entry) has node `node`, which
/// matches the word `val`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IndexEntry {
    val: u64,
    list: u32,
    node: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Root {
    sp: u64,
    first: u32,
    /// Lookups under this root that failed since its last answer.
    misses: u32,
}

/// All-zero bytes are a valid, empty tree (the unwinder maps it zeroed).
#[repr(C)]
pub struct HitTree {
    /// `epoch + 1` of the dlclose epoch its paths were read in; 0 while never used.
    epoch_tag: u32,
    /// Nodes handed out; node 0 is the null link.
    used: u32,
    /// Nodes this tree may use (taken from `BUDGET`); 0 until the first filing.
    limit: u32,
    /// Captures answered and filed since the tree last started empty.
    answered: u32,
    filed: u32,
    /// Filings still to skip after the tree filled up to no purpose.
    skip: u32,
    /// Counts lookups under roots that keep failing, to try one in `GATE_EVERY`.
    gated: u32,
    /// Which filling of the tree this is (1 up to `GENERATIONS - 1`, then 1 again with
    /// the index cleared; 0 before the first).
    generation: u32,
    /// Index entries of this generation.
    indexed: u32,
    /// Whether the index may hold entries of any generation (none in a fresh mapping).
    index_written: bool,
    roots: [Root; ROOTS],
    nodes: [Node; MAX_NODES],
    index: [IndexEntry; INDEX_SLOTS],
}

#[inline(always)]
fn root_slot(sp: u64) -> usize {
    ((sp >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize & (ROOTS - 1)
}

/// Where the index entry of list `first`'s node for word `val` is looked for first.
#[inline(always)]
fn index_slot(first: u32, val: u64) -> usize {
    ((val ^ (first as u64) << 40).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 47) as usize & (INDEX_SLOTS - 1)
}

impl HitTree {
    /// The stack id of an earlier capture at stack pointer `sp0` (start RBP `bp0`) all
    /// of whose reads `read` still finds, if the tree holds one. If that path has at
    /// most `trace_up_to` reads, `on_path` then sees them, in order, as
    /// `(Some(address), value)` for a stack word and `(None, value)` for the start RBP.
    /// Under a root whose last `GATE_AFTER` lookups all failed, only one lookup in
    /// `GATE_EVERY` is made (the others return `None` at once) until one answers.
    #[inline]
    pub fn lookup(
        &mut self,
        sp0: u64,
        bp0: u64,
        epoch: u32,
        read: impl Fn(u64) -> u64,
        trace_up_to: usize,
        on_path: impl FnMut(Option<u64>, u64),
    ) -> Option<u32> {
        if self.epoch_tag != epoch.wrapping_add(1) || self.epoch_tag == 0 {
            return None;
        }
        let slot = root_slot(sp0);
        let root = &self.roots[slot];
        if root.sp != sp0 {
            return None;
        }
        if root.misses >= GATE_AFTER {
            self.gated = self.gated.wrapping_add(1);
            if !self.gated.is_multiple_of(GATE_EVERY) {
                return None;
            }
        }
        let first = root.first;
        let found = self.walk(sp0, first, bp0, &read, |_, _| {});
        let root = &mut self.roots[slot];
        match found {
            Some((id, reads)) => {
                root.misses = 0;
                self.answered = self.answered.saturating_add(1);
                if reads <= trace_up_to {
                    self.walk(sp0, first, bp0, &read, on_path);
                }
                Some(id)
            }
            None => {
                root.misses = root.misses.saturating_add(1);
                None
            }
        }
    }

    /// The stack id and the number of reads of the path whose every read holds;
    /// `on_read` sees each read that matched, as `lookup`'s `on_path` does. Kept to the
    /// fewest instructions a read — a node load, a stack load, two compares — since
    /// nearly every lookup in a training step answers, after ~80 reads, and the reads
    /// cost what their instructions cost: recording each read here on every lookup took
    /// one from ~100 to ~330 cycles, so `lookup` walks with a no-op `on_read` and walks
    /// again to record only short paths. A run of nodes is walked as a slice, bounds
    /// checked once where it starts (at the first node, and at each sibling moved to):
    /// each node indexed and masked took ~415 cycles a lookup in a big model's training
    /// step, ~360 so (86 reads a lookup).
    #[inline(always)]
    fn walk(&self, sp0: u64, first: u32, bp0: u64, read: &impl Fn(u64) -> u64, mut on_read: impl FnMut(Option<u64>, u64)) -> Option<(u32, usize)> {
        let mut c = first as usize;
        'runs: loop {
            // A run of nodes from `c`: a read that matches goes on to the next node, so
            // the run is walked in order without indexing (and masking) each node. An
            // index past the nodes ends the walk, as node 0's `STOP` does.
            let run = self.nodes.get(c..)?;
            for (k, n) in run.iter().enumerate() {
                let addr = sp0.wrapping_add(n.off as u64);
                let word = if n.off < STOP {
                    read(addr)
                } else {
                    // Rare: the end of a path, node 0, or the start RBP (at most once a path).
                    std::hint::cold_path();
                    match n.off {
                        LEAF => return Some((n.val as u32, n.sibling as usize)),
                        STOP => return None,
                        _ => bp0,
                    }
                };
                if word == n.val {
                    on_read((n.off < STOP).then_some(addr), n.val);
                } else {
                    // A mismatch either ends the lookup or moves to a sibling: rare on a
                    // path that answers. Without the hint the compiler picks the next node
                    // or the sibling with a conditional move, and every node's address then
                    // waits for the previous word's comparison (lookups 2.3x slower).
                    std::hint::cold_path();
                    c = self.next_in_list(c + k, n, word)? as usize;
                    continue 'runs;
                }
            }
            return None;
        }
    }

    /// Where a walk goes on when node `at` (`n`) does not match the `word` read for it:
    /// the node of its list that does, through the index for an indexed list (then `at`
    /// is that list's first node), else its next sibling. `None` ends the lookup: no
    /// such node, or a link that does not go forward (never made by `insert`).
    #[inline(always)]
    fn next_in_list(&self, at: usize, n: &Node, word: u64) -> Option<u32> {
        if n.sibling & INDEXED != 0 {
            return self.indexed_node(at as u32, word);
        }
        (n.sibling as usize > at).then_some(n.sibling)
    }

    /// The node of indexed list `first` that matches `val`.
    fn indexed_node(&self, first: u32, val: u64) -> Option<u32> {
        let list = first | self.generation << GENERATION_SHIFT;
        let mut i = index_slot(first, val);
        // At most three quarters of the slots are this generation's: a free one ends
        // every probe run; the bound only guards against a corrupted tree.
        for _ in 0..INDEX_SLOTS {
            let e = &self.index[i];
            if e.list == list && e.val == val {
                return Some(e.node);
            }
            if !self.is_current(e) {
                return None;
            }
            i = (i + 1) & (INDEX_SLOTS - 1);
        }
        None
    }

    /// Whether index entry `e` belongs to this generation (else it is free).
    #[inline(always)]
    fn is_current(&self, e: &IndexEntry) -> bool {
        e.list != 0 && e.list >> GENERATION_SHIFT == self.generation
    }

    /// Files node `node`, matching `val`, under indexed list `first`, whose nodes do not
    /// hold `val` yet; false where the index is full.
    fn index_node(&mut self, first: u32, val: u64, node: u32) -> bool {
        if self.indexed as usize >= INDEX_MAX {
            return false;
        }
        let mut i = index_slot(first, val);
        while self.is_current(&self.index[i]) {
            i = (i + 1) & (INDEX_SLOTS - 1);
        }
        self.index[i] = IndexEntry { val, list: first | self.generation << GENERATION_SHIFT, node };
        self.indexed += 1;
        self.index_written = true;
        true
    }

    /// Moves list `first` (not indexed, `len` nodes) to the index, with room for one
    /// node more, if all its nodes read the same stack word as the one to be added
    /// (at `off`); false (nothing changed) otherwise, or where the index lacks room.
    fn index_list(&mut self, first: u32, len: usize, off: u32) -> bool {
        let head = self.nodes[first as usize];
        if head.off != off || off >= STOP || self.indexed as usize + len > INDEX_MAX {
            return false;
        }
        let mut c = head.sibling;
        while c != 0 {
            if self.nodes[c as usize].off != off {
                return false;
            }
            c = self.nodes[c as usize].sibling;
        }
        let mut c = head.sibling;
        while c != 0 {
            let n = self.nodes[c as usize];
            self.index_node(first, n.val, c);
            c = n.sibling;
        }
        self.nodes[first as usize].sibling |= INDEXED;
        true
    }

    /// Where the read `(off, val)` of a path being filed goes in list `first`.
    fn place_in_list(&mut self, first: u32, off: u32, val: u64) -> Place {
        let head = self.nodes[first as usize];
        if first != 0 && head.sibling & INDEXED != 0 {
            if head.off != off {
                return Place::Refused;
            }
            if head.val == val {
                return Place::Found(first);
            }
            if let Some(c) = self.indexed_node(first, val) {
                return Place::Found(c);
            }
            return if self.index_node(first, val, self.used) { Place::Indexed } else { Place::Refused };
        }
        let (mut c, mut last, mut len) = (first, 0, 0);
        while c != 0 {
            let n = self.nodes[c as usize];
            if n.off == LEAF {
                // A path that ends where this one goes on: an unwind is a function of
                // the words it reads, so this does not happen with the same epoch;
                // leave the tree as it is if it does.
                return Place::Refused;
            }
            if n.off == off && n.val == val {
                return Place::Found(c);
            }
            (last, c, len) = (c, n.sibling, len + 1);
        }
        if len < LONG_LIST {
            Place::After(last)
        } else if self.index_list(first, len, off) && self.index_node(first, val, self.used) {
            Place::Indexed
        } else {
            Place::Refused
        }
    }

    /// Files a finished capture: at `sp0`, with the start RBP if its unwind depended on
    /// it, the `reads` it made (address, value), and the stack it found.
    pub fn insert(&mut self, sp0: u64, bp0: Option<u64>, reads: &[(u64, u64)], epoch: u32, stack_id: u32) {
        if stack_id == 0 || reads.is_empty() {
            return;
        }
        if self.skip > 0 {
            self.skip -= 1;
            return;
        }
        // Offsets from the stack pointer must fit below the three tags.
        if reads.iter().any(|&(a, _)| a < sp0 || a - sp0 >= STOP as u64) {
            return;
        }
        let tag = epoch.wrapping_add(1);
        let need = reads.len() + usize::from(bp0.is_some()) + 1;
        if self.limit == 0 {
            if !take_budget(FIRST_LIMIT) {
                return;
            }
            self.limit = FIRST_LIMIT as u32;
        }
        if need >= self.limit as usize {
            return;
        }
        if self.epoch_tag != tag || self.used == 0 {
            self.reset(tag);
        } else if self.used as usize + need > self.limit as usize {
            let limit = self.limit as usize;
            if limit < MAX_NODES && take_budget(limit) {
                self.limit = (2 * limit) as u32;
            } else {
                if self.answered < self.filed / 4 {
                    self.skip = self.filed;
                }
                self.reset(tag);
            }
        }
        self.filed = self.filed.saturating_add(1);
        let slot = root_slot(sp0);
        if self.roots[slot].sp != sp0 {
            // Another stack pointer's paths go: unreachable now, their nodes wait for
            // the next reset.
            self.roots[slot] = Root { sp: sp0, first: 0, misses: 0 };
        }
        let seq = bp0.map(|b| (BP_REGISTER, b)).into_iter().chain(reads.iter().map(|&(a, v)| ((a - sp0) as u32, v)));
        // The first node of the list the next read belongs in (0: the root has none),
        // until the path parts from every filed one; then its nodes follow one another.
        let mut list = Some(self.roots[slot].first);
        for (off, val) in seq {
            if let Some(first) = list {
                match self.place_in_list(first, off, val) {
                    Place::Refused => return,
                    Place::Found(c) => {
                        list = Some(c + 1);
                        continue;
                    }
                    Place::Indexed => {}
                    Place::After(last) => {
                        let idx = self.used;
                        if last != 0 {
                            self.nodes[last as usize].sibling = idx;
                        } else {
                            self.roots[slot].first = idx;
                        }
                    }
                }
                list = None;
            }
            self.nodes[self.used as usize] = Node { val, off, sibling: 0 };
            self.used += 1;
        }
        if list.is_some() {
            // Every read matched a filed path's: already filed, or a path that goes on
            // where this one ends (see above).
            return;
        }
        self.nodes[self.used as usize] = Node { val: stack_id as u64, off: LEAF, sibling: (need - 1) as u32 };
        self.used += 1;
    }

    fn reset(&mut self, tag: u32) {
        // A tree never filed into is still the zeroed mapping: its roots are empty
        // already (filling them faulted in 64 KiB of every capturing thread's pages).
        let fresh = self.used == 0;
        self.epoch_tag = tag;
        self.nodes[0] = Node { val: 0, off: STOP, sibling: 0 };
        self.used = 1;
        self.answered = 0;
        self.filed = 0;
        if !fresh {
            self.roots.fill(Root::default());
        }
        // The index's entries of the last generation are free from now on.
        self.indexed = 0;
        self.generation += 1;
        if self.generation == GENERATIONS {
            if self.index_written {
                self.index.fill(IndexEntry::default());
                self.index_written = false;
            }
            self.generation = 1;
        }
    }

    /// Whether the tree grew past its first limit (what `shrink` gives back).
    pub fn grown(&self) -> bool {
        self.limit as usize > FIRST_LIMIT
    }

    /// Starts the tree empty again at its first limit and gives back its nodes past it:
    /// their share of the budget, and their pages (`import torch`'s main thread doubles
    /// its tree to 8 MiB filing paths that the teardown will not take again). Returns
    /// the bytes given back.
    pub fn shrink(&mut self) -> usize {
        let limit = self.limit as usize;
        if limit <= FIRST_LIMIT {
            return 0;
        }
        self.reset(self.epoch_tag);
        self.skip = 0;
        BUDGET.fetch_add(limit - FIRST_LIMIT, Ordering::AcqRel);
        self.limit = FIRST_LIMIT as u32;
        let nodes = self.nodes.as_ptr() as usize;
        let size = std::mem::size_of::<Node>();
        // SAFETY: this tree's nodes past `used` and the first limit, in the private
        // anonymous mapping that holds the tree: no node there is read before it is
        // written again.
        let given = unsafe { super::mapping::give_back_pages(nodes + FIRST_LIMIT * size, nodes + limit * size) };
        given + self.forget_index()
    }

    /// Gives back the index's whole pages (they read as free entries again); the bytes
    /// given back.
    fn forget_index(&mut self) -> usize {
        if !self.index_written {
            return 0;
        }
        let start = self.index.as_ptr() as usize;
        // SAFETY: this tree's index, in the mapping that holds the tree; its entries
        // are plain integers, and zero is a free entry.
        unsafe { super::mapping::give_back_pages(start, start + std::mem::size_of_val(&self.index)) }
    }

    /// Gives the tree's nodes back to the shared budget (its thread is ending).
    pub fn release(&mut self) {
        BUDGET.fetch_add(self.limit as usize, Ordering::AcqRel);
        self.limit = 0;
    }

    #[cfg(test)]
    fn nodes_used(&self) -> usize {
        self.used as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn empty() -> Box<HitTree> {
        // SAFETY: HitTree is plain integers; all-zero is its documented empty state.
        unsafe { Box::<HitTree>::new_zeroed().assume_init() }
    }

    /// A fresh tree's first filing writes its one root, not all of them: the roots of
    /// every thread that captures were 64 KiB of pages faulted in for zeros.
    #[test]
    fn a_fresh_tree_touches_only_the_root_it_files_under() {
        // Mapped as the unwinder maps a thread's tree: fresh zero pages.
        let bytes = std::mem::size_of::<HitTree>();
        let m = super::super::mapping::map_zeroed(bytes, super::super::mapping::Part::Other).expect("a mapping");
        // SAFETY: a fresh zeroed mapping of the tree's size and page alignment; all-zero
        // is the empty tree; unmapped below, after the last use.
        let t = unsafe { &mut *(m as *mut HitTree) };
        let (roots, len) = (t.roots.as_ptr() as usize, std::mem::size_of_val(&t.roots));
        let page = super::super::mapping::PAGE;
        let (from, to) = (roots.next_multiple_of(page), (roots + len) / page * page);
        assert_eq!(crate::os::own::resident(from, to - from), 0, "a fresh mapping starts untouched");
        t.insert(0x7000_0000 - 8, None, &distinct_path(0x7000_0000, 1, 4), 0, 1);
        assert!(crate::os::own::resident(from, to - from) <= page as u64, "one root's page at most");
        let read = |a: u64| if (0x7000_0000..0x7000_0020).contains(&a) { 1000 + (a - 0x7000_0000) / 8 } else { 0 };
        assert_eq!(t.lookup(0x7000_0000 - 8, 0, 0, read, 0, |_, _| {}), Some(1));
        super::super::mapping::unmap(m, bytes);
    }

    /// Path `p` of `len` reads of the stack words from `base` up, its values its own.
    fn distinct_path(base: u64, p: u64, len: usize) -> Vec<(u64, u64)> {
        (0..len as u64).map(|k| (base + k * 8, p * 1000 + k)).collect()
    }

    /// Files distinct paths (`distinct_path`) of `per_path` reads under the stack pointer
    /// just below `base`, path p as stack p + 1, until `done`; the paths filed.
    fn file_until(t: &mut HitTree, base: u64, epoch: u32, per_path: usize, done: impl Fn(&HitTree) -> bool) -> u64 {
        let mut p = 0u64;
        while !done(t) {
            t.insert(base - 8, None, &distinct_path(base, p, per_path), epoch, p as u32 + 1);
            p += 1;
        }
        p
    }

    fn reader(mem: &HashMap<u64, u64>) -> impl Fn(u64) -> u64 + '_ {
        move |a| mem.get(&a).copied().unwrap_or(0xdead)
    }

    #[test]
    fn a_path_is_found_while_every_word_it_read_holds() {
        let mut t = empty();
        let mut mem: HashMap<u64, u64> = [(0x1008, 11), (0x1040, 22), (0x1100, 33)].into();
        t.insert(0x1000, None, &[(0x1008, 11), (0x1040, 22), (0x1100, 33)], 0, 7);
        assert_eq!(t.lookup(0x1000, 0, 0, reader(&mem), usize::MAX, |_, _| {}), Some(7));
        // Another stack pointer, another epoch: nothing.
        assert_eq!(t.lookup(0x1010, 0, 0, reader(&mem), usize::MAX, |_, _| {}), None);
        assert_eq!(t.lookup(0x1000, 0, 1, reader(&mem), usize::MAX, |_, _| {}), None);
        // Any word changed: a miss.
        mem.insert(0x1100, 34);
        assert_eq!(t.lookup(0x1000, 0, 0, reader(&mem), usize::MAX, |_, _| {}), None);
    }

    #[test]
    fn paths_sharing_their_first_reads_share_nodes_and_part_where_they_differ() {
        let mut t = empty();
        let shared = [(0x2008, 1), (0x2020, 2), (0x2040, 3)];
        for op in 0..50u64 {
            let mut reads = shared.to_vec();
            reads.push((0x2080, 100 + op));
            reads.push((0x2100 + op * 8, 200 + op));
            t.insert(0x2000, None, &reads, 5, 10 + op as u32);
        }
        // 3 shared nodes, then 2 per path and its leaf.
        assert_eq!(t.nodes_used(), 1 + 3 + 50 * 3);
        for op in 0..50u64 {
            let mut mem: HashMap<u64, u64> = shared.iter().copied().collect();
            mem.insert(0x2080, 100 + op);
            mem.insert(0x2100 + op * 8, 200 + op);
            assert_eq!(t.lookup(0x2000, 0, 5, reader(&mem), usize::MAX, |_, _| {}), Some(10 + op as u32), "path {op}");
        }
    }

    #[test]
    fn a_root_whose_lookups_keep_failing_is_tried_now_and_then_and_opens_on_an_answer() {
        let mut t = empty();
        t.insert(0x5000, None, &[(0x5008, 1), (0x5010, 2)], 0, 9);
        let held: HashMap<u64, u64> = [(0x5008, 1), (0x5010, 2)].into();
        let new_path: HashMap<u64, u64> = [(0x5008, 1), (0x5010, 3)].into();
        for _ in 0..GATE_AFTER {
            assert_eq!(t.lookup(0x5000, 0, 0, reader(&new_path), usize::MAX, |_, _| {}), None);
        }
        // Gated: the path the tree holds is looked for in one capture of GATE_EVERY.
        let tries: Vec<Option<u32>> = (0..GATE_EVERY).map(|_| t.lookup(0x5000, 0, 0, reader(&held), usize::MAX, |_, _| {})).collect();
        let first = tries.iter().position(|r| *r == Some(9)).expect("one lookup in GATE_EVERY is made");
        assert!(first > 0 && tries[..first].iter().all(|r| r.is_none()), "{tries:?}");
        // The answer opened the root again: every lookup is made.
        for _ in 0..2 * GATE_EVERY {
            assert_eq!(t.lookup(0x5000, 0, 0, reader(&held), usize::MAX, |_, _| {}), Some(9));
        }
        // Another root is not gated by this one's misses.
        t.insert(0x6000, None, &[(0x6008, 4)], 0, 10);
        let other: HashMap<u64, u64> = [(0x6008, 4)].into();
        assert_eq!(t.lookup(0x6000, 0, 0, reader(&other), usize::MAX, |_, _| {}), Some(10));
    }

    #[test]
    fn a_lookup_reports_the_path_it_followed() {
        let mut t = empty();
        t.insert(0x4000, Some(0x99), &[(0x4008, 1), (0x4010, 2)], 0, 3);
        t.insert(0x4000, Some(0x99), &[(0x4008, 1), (0x4018, 5)], 0, 4);
        // The first path's last word changed: the lookup goes on to its sibling.
        let mem: HashMap<u64, u64> = [(0x4008, 1), (0x4010, 3), (0x4018, 5)].into();
        let mut path = Vec::new();
        assert_eq!(t.lookup(0x4000, 0x99, 0, reader(&mem), usize::MAX, |a, v| path.push((a, v))), Some(4));
        assert_eq!(path, [(None, 0x99), (Some(0x4008), 1), (Some(0x4018), 5)]);
        // Three reads: traced up to three, not up to two, and answered either way.
        path.clear();
        assert_eq!(t.lookup(0x4000, 0x99, 0, reader(&mem), 3, |a, v| path.push((a, v))), Some(4));
        assert_eq!(path.len(), 3);
        path.clear();
        assert_eq!(t.lookup(0x4000, 0x99, 0, reader(&mem), 2, |a, v| path.push((a, v))), Some(4));
        assert!(path.is_empty());
    }

    #[test]
    fn the_start_rbp_counts_only_for_paths_that_depended_on_it() {
        let mut t = empty();
        let mem: HashMap<u64, u64> = [(0x3008, 1), (0x3010, 2)].into();
        t.insert(0x3000, Some(0x7777), &[(0x3008, 1)], 0, 4);
        assert_eq!(t.lookup(0x3000, 0x7777, 0, reader(&mem), usize::MAX, |_, _| {}), Some(4));
        assert_eq!(t.lookup(0x3000, 0x7778, 0, reader(&mem), usize::MAX, |_, _| {}), None);
        t.insert(0x3000, None, &[(0x3010, 2)], 0, 5);
        assert_eq!(t.lookup(0x3000, 0x1234, 0, reader(&mem), usize::MAX, |_, _| {}), Some(5));
    }

    #[test]
    fn a_tree_grows_to_its_maximum_then_starts_again_and_a_new_epoch_forgets_everything() {
        let mut t = empty();
        let per_path = 64;
        let paths = MAX_NODES / (per_path + 1) + 3;
        let mut limits = Vec::new();
        for p in 0..paths as u64 {
            let reads = distinct_path(0x10_0000, p, per_path);
            t.insert(0x10_0000 - 8, None, &reads, 2, p as u32 + 1);
            assert!(t.nodes_used() <= t.limit as usize && t.limit as usize <= MAX_NODES);
            if limits.last() != Some(&t.limit) {
                limits.push(t.limit);
            }
            let mem: HashMap<u64, u64> = reads.iter().copied().collect();
            assert_eq!(t.lookup(0x10_0000 - 8, 0, 2, reader(&mem), usize::MAX, |_, _| {}), Some(p as u32 + 1));
        }
        assert_eq!(limits, [1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 19]);
        assert!(t.nodes_used() < 8 * per_path, "it started again once full");
        let reads = [(0x5008, 9)];
        t.insert(0x5000, None, &reads, 3, 99);
        assert_eq!(t.nodes_used(), 3, "an insert in a new epoch empties the tree first");
        let mem: HashMap<u64, u64> = reads.into_iter().collect();
        assert_eq!(t.lookup(0x5000, 0, 3, reader(&mem), usize::MAX, |_, _| {}), Some(99));
        t.release();
    }

    #[test]
    fn a_shrunk_tree_starts_empty_at_its_first_limit_and_files_again() {
        let mut t = empty();
        let per_path = 64;
        let path = |p: u64| distinct_path(0x30_0000, p, per_path);
        let p = file_until(&mut t, 0x30_0000, 1, per_path, |t| t.limit as usize >= 4 * FIRST_LIMIT);
        let given = t.shrink();
        assert!(given >= 2 * FIRST_LIMIT * std::mem::size_of::<Node>(), "{given} bytes given back");
        assert_eq!((t.limit as usize, t.nodes_used()), (FIRST_LIMIT, 1));
        assert!(t.nodes[FIRST_LIMIT * 2..FIRST_LIMIT * 3].iter().all(|n| n.val == 0 && n.off == 0), "pages given back read as zeros");
        let old: HashMap<u64, u64> = path(0).into_iter().collect();
        assert_eq!(t.lookup(0x30_0000 - 8, 0, 1, reader(&old), usize::MAX, |_, _| {}), None, "empty again");
        t.insert(0x30_0000 - 8, None, &path(p), 1, 77);
        let new: HashMap<u64, u64> = path(p).into_iter().collect();
        assert_eq!(t.lookup(0x30_0000 - 8, 0, 1, reader(&new), usize::MAX, |_, _| {}), Some(77));
        assert_eq!(t.shrink(), 0, "at its first limit: nothing to give back");
        t.release();
    }

    #[test]
    fn a_tree_that_filled_to_no_purpose_stops_filing_for_a_while() {
        let mut t = empty();
        let per_path = 64;
        let path = |p: u64| distinct_path(0x20_0000, p, per_path);
        // Paths filed once and never asked for again, until the tree is full at its
        // largest and starts again.
        let p = file_until(&mut t, 0x20_0000, 0, per_path, |t| t.limit as usize == MAX_NODES && t.nodes_used() <= 2 * per_path);
        let filed_before_reset = p as usize - 1;
        assert!(t.skip as usize >= filed_before_reset - 1, "skip {}", t.skip);
        // The next filings are skipped: nothing new is found.
        t.insert(0x20_0000 - 8, None, &path(p), 0, p as u32 + 1);
        let mem: HashMap<u64, u64> = path(p).into_iter().collect();
        assert_eq!(t.lookup(0x20_0000 - 8, 0, 0, reader(&mem), usize::MAX, |_, _| {}), None);
        t.release();
    }

    /// Unwind-like paths (the same word offsets in the same order, values from a small
    /// alphabet so that paths share prefixes and part at random depths), filed in random
    /// order: a lookup answers the one path all of whose words hold, reports its reads,
    /// and misses when a word of every path differs.
    #[test]
    fn random_paths_are_found_exactly_with_their_reads() {
        let mut rng = crate::test_rng::TestRng::new(0x5eed_1234_abcd_ef01);
        for round in 0..20 {
            let mut t = empty();
            let sp = 0x7000_0000u64;
            let len = 2 + rng.below(40) as usize;
            // Ordered, so that the lookups below are the same on every run: with a
            // HashMap's random order, 8 misses in a row sometimes closed the root's gate
            // (`GATE_AFTER`) and a filed path was skipped, failing about one run in three.
            // In this sequence no lookup is skipped, and every one is checked exactly.
            let mut paths: std::collections::BTreeMap<Vec<u64>, u32> = std::collections::BTreeMap::new();
            for id in 1..=300u32 {
                let vals: Vec<u64> = (0..len).map(|_| rng.below(3)).collect();
                let reads: Vec<(u64, u64)> = vals.iter().enumerate().map(|(k, &v)| (sp + 8 + 8 * k as u64, v)).collect();
                paths.entry(vals).or_insert_with(|| {
                    t.insert(sp, None, &reads, 0, id);
                    id
                });
            }
            let filed: Vec<&Vec<u64>> = paths.keys().collect();
            for _ in 0..500 {
                let mut vals = filed[rng.below(filed.len() as u64) as usize].clone();
                if rng.below(3) == 0 {
                    let k = rng.below(len as u64) as usize;
                    vals[k] = rng.below(4);
                }
                let mem: HashMap<u64, u64> = vals.iter().enumerate().map(|(k, &v)| (sp + 8 + 8 * k as u64, v)).collect();
                let mut seen = Vec::new();
                let got = t.lookup(sp, 0, 0, reader(&mem), usize::MAX, |a, v| seen.push((a.unwrap(), v)));
                let want = paths.get(&vals).copied();
                assert_eq!(got, want, "round {round}");
                if got.is_some() {
                    let expected: Vec<(u64, u64)> = vals.iter().enumerate().map(|(k, &v)| (sp + 8 + 8 * k as u64, v)).collect();
                    assert_eq!(seen, expected, "round {round}: the reads of the path found");
                }
            }
        }
    }

    /// Path `v` of a node with many children: a shared first read, then its own word
    /// (the list), then one more.
    fn fan_out_path(sp: u64, v: u64) -> Vec<(u64, u64)> {
        vec![(sp + 8, 1), (sp + 16, v), (sp + 24, 1000 + v)]
    }

    fn lookup_fresh(t: &mut HitTree, sp: u64, epoch: u32, reads: &[(u64, u64)]) -> (Option<u32>, Vec<(u64, u64)>) {
        // Each lookup as the first at its root: the gate of earlier misses stays shut.
        t.roots[root_slot(sp)].misses = 0;
        let mem: HashMap<u64, u64> = reads.iter().copied().collect();
        let mut seen = Vec::new();
        let found = t.lookup(sp, 0, epoch, reader(&mem), usize::MAX, |a, v| seen.push((a.unwrap(), v)));
        (found, seen)
    }

    /// A node with 5,000 children (one function calling 5,000 sites): past `LONG_LIST`
    /// its list moves to the index; every path is found, with its reads, and a word no
    /// path read is a miss.
    #[test]
    fn a_long_list_moves_to_the_index_and_every_path_in_it_is_found() {
        let mut t = empty();
        let sp = 0x7100_0000u64;
        let n = 5_000u64;
        for v in 0..n {
            t.insert(sp, None, &fan_out_path(sp, v), 0, v as u32 + 1);
        }
        assert_eq!(t.nodes_used(), 1 + 1 + 3 * n as usize, "one shared node, then two and a leaf a path");
        let head = t.roots[root_slot(sp)].first as usize + 1;
        assert!(t.nodes[head].sibling & INDEXED != 0, "the list is indexed");
        assert_eq!(t.indexed as u64, n - 1, "every node but the first");
        for v in (0..n).rev() {
            let path = fan_out_path(sp, v);
            assert_eq!(lookup_fresh(&mut t, sp, 0, &path), (Some(v as u32 + 1), path.clone()), "path {v}");
            // Filed again: nothing new.
            t.insert(sp, None, &path, 0, v as u32 + 1);
        }
        assert_eq!(t.nodes_used(), 1 + 1 + 3 * n as usize);
        assert_eq!(lookup_fresh(&mut t, sp, 0, &fan_out_path(sp, n + 7)).0, None);
        let mut other_end = fan_out_path(sp, 3);
        other_end[2].1 = 5;
        assert_eq!(lookup_fresh(&mut t, sp, 0, &other_end).0, None, "the word after the list differs");
        t.release();
    }

    /// A list whose nodes read different words, and a list that would need a full
    /// index, stop at `LONG_LIST` nodes: the paths past that are not filed, the others
    /// are still found.
    #[test]
    fn a_list_that_cannot_be_indexed_takes_no_more_than_long_list_nodes() {
        let mut t = empty();
        let sp = 0x7200_0000u64;
        let n = 3 * LONG_LIST as u64;
        // Each path's first read at its own offset: one list at the root, of mixed words.
        for p in 0..n {
            t.insert(sp, None, &[(sp + 8 + 8 * p, p)], 0, p as u32 + 1);
        }
        for p in 0..n {
            let want = (p < LONG_LIST as u64).then_some(p as u32 + 1);
            assert_eq!(lookup_fresh(&mut t, sp, 0, &[(sp + 8 + 8 * p, p)]).0, want, "path {p}");
        }
        assert_eq!(t.indexed, 0);
        // The index full: a list of one word cannot move there either.
        let sp = 0x7300_0000u64;
        t.indexed = INDEX_MAX as u32;
        for v in 0..n {
            t.insert(sp, None, &fan_out_path(sp, v), 0, v as u32 + 1);
        }
        for v in 0..n {
            let want = (v < LONG_LIST as u64).then_some(v as u32 + 1);
            assert_eq!(lookup_fresh(&mut t, sp, 0, &fan_out_path(sp, v)).0, want, "path {v}");
        }
        t.release();
    }

    /// A reset (here a new epoch) frees the index's entries: the same list filed again
    /// with fewer paths does not answer for the ones only the old one had. At the last
    /// generation the index is cleared.
    #[test]
    fn a_tree_started_again_forgets_its_index() {
        let mut t = empty();
        let sp = 0x7400_0000u64;
        for v in 0..200 {
            t.insert(sp, None, &fan_out_path(sp, v), 0, v as u32 + 1);
        }
        assert_eq!(lookup_fresh(&mut t, sp, 0, &fan_out_path(sp, 150)).0, Some(151));
        for v in 0..100 {
            t.insert(sp, None, &fan_out_path(sp, v), 1, v as u32 + 1);
        }
        let head = t.roots[root_slot(sp)].first as usize + 1;
        assert!(t.nodes[head].sibling & INDEXED != 0, "indexed again, at the same node");
        assert_eq!(lookup_fresh(&mut t, sp, 1, &fan_out_path(sp, 50)).0, Some(51));
        assert_eq!(lookup_fresh(&mut t, sp, 1, &fan_out_path(sp, 150)).0, None, "only the old list had it");
        assert!(t.index_written);
        t.generation = GENERATIONS - 1;
        t.insert(sp, None, &fan_out_path(sp, 1), 2, 2);
        assert_eq!((t.generation, t.index_written), (1, false));
        assert!(t.index.iter().all(|e| e.list == 0 && e.val == 0 && e.node == 0), "cleared");
        t.release();
    }

    /// Unwind-like paths whose second word takes hundreds of values (so that lists move
    /// to the index) and whose others take few, filed in random order: a lookup answers
    /// exactly the path all of whose words hold, with its reads.
    #[test]
    fn random_paths_through_indexed_lists_are_found_exactly() {
        let mut rng = crate::test_rng::TestRng::new(0x1d3a_77c0_5eed_0042);
        for round in 0..10 {
            let mut t = empty();
            let sp = 0x7500_0000u64;
            let len = 3 + rng.below(6) as usize;
            let value = |rng: &mut crate::test_rng::TestRng, k: usize| if k == 1 { rng.below(400) } else { rng.below(3) };
            let mut paths: std::collections::BTreeMap<Vec<u64>, u32> = std::collections::BTreeMap::new();
            for id in 1..=2_000u32 {
                let vals: Vec<u64> = (0..len).map(|k| value(&mut rng, k)).collect();
                let reads: Vec<(u64, u64)> = vals.iter().enumerate().map(|(k, &v)| (sp + 8 + 8 * k as u64, v)).collect();
                paths.entry(vals).or_insert_with(|| {
                    t.insert(sp, None, &reads, 0, id);
                    id
                });
            }
            assert!(t.indexed > 0, "round {round}: some list was indexed");
            let filed: Vec<&Vec<u64>> = paths.keys().collect();
            for _ in 0..2_000 {
                let mut vals = filed[rng.below(filed.len() as u64) as usize].clone();
                if rng.below(3) == 0 {
                    let k = rng.below(len as u64) as usize;
                    vals[k] = value(&mut rng, k) + rng.below(2);
                }
                let reads: Vec<(u64, u64)> = vals.iter().enumerate().map(|(k, &v)| (sp + 8 + 8 * k as u64, v)).collect();
                let (got, seen) = lookup_fresh(&mut t, sp, 0, &reads);
                assert_eq!(got, paths.get(&vals).copied(), "round {round}");
                if got.is_some() {
                    assert_eq!(seen, reads, "round {round}: the reads of the path found");
                }
            }
            t.release();
        }
    }

    #[test]
    fn a_path_never_continues_past_another_paths_leaf() {
        let mut t = empty();
        t.insert(0x6000, None, &[(0x6008, 1)], 0, 1);
        // Impossible for real unwinds (same words read, different decisions); the tree
        // keeps the first.
        t.insert(0x6000, None, &[(0x6008, 1), (0x6010, 2)], 0, 2);
        let mem: HashMap<u64, u64> = [(0x6008, 1), (0x6010, 2)].into();
        assert_eq!(t.lookup(0x6000, 0, 0, reader(&mem), usize::MAX, |_, _| {}), Some(1));
    }

    #[test]
    fn a_walk_ends_on_a_link_backwards_and_at_the_end_of_the_nodes() {
        let mut t = empty();
        t.insert(0x7000, None, &[(0x7008, 1), (0x7010, 2)], 0, 3);
        t.insert(0x7000, None, &[(0x7008, 1), (0x7010, 5)], 0, 4);
        let mem: HashMap<u64, u64> = [(0x7008, 1), (0x7010, 9)].into();
        assert_eq!(t.lookup(0x7000, 0, 0, reader(&mem), usize::MAX, |_, _| {}), None);
        // A sibling link that points back (never made by `insert`) ends the lookup
        // instead of looping.
        let slot = root_slot(0x7000);
        let second = t.roots[slot].first as usize + 1;
        let back = t.nodes[second].sibling;
        assert!(back as usize > second);
        t.nodes[back as usize].sibling = second as u32;
        assert_eq!(t.lookup(0x7000, 0, 0, reader(&mem), usize::MAX, |_, _| {}), None);
        // A path running into the last node wraps to node 0, whose STOP ends it.
        t.nodes[MAX_NODES - 1] = Node { val: 7, off: 0x18, sibling: 0 };
        t.roots[slot].first = (MAX_NODES - 1) as u32;
        let mem: HashMap<u64, u64> = [(0x7018, 7)].into();
        assert_eq!(t.lookup(0x7000, 0, 0, reader(&mem), usize::MAX, |_, _| {}), None);
    }
}
