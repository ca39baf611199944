//! The pointer scan's verdicts on the live set, by group: what `scan` finds, with the
//! roots only the agent knows (ignored blocks, pending thread arguments, the loader's
//! own blocks).
use std::collections::BTreeMap;

// Fx maps (`util::FxMap`: no `getrandom` at a process's exit report).
use crate::util::FxMap as HashMap;

use crate::collector::state::ScanInput;
use crate::hotpath::event::Kind;
use crate::hotpath::stacks;
use crate::report::build::{self, Tally};
use crate::scan::mark::{self, Verdict};

type GroupKey = (u32, &'static str, Option<u8>);

/// Each scanned group's verdicts (bytes and blocks reachable, indirect and definite).
/// A process that ends with its memory live has about as many groups as blocks (`import
/// torch` ending in `os._exit`: 535k groups of 660k blocks), so this is the largest
/// thing a final report makes: as a map from `GroupKey` to the verdicts it added 70 MB
/// to the report's peak (an 80-byte entry in a table at most 7/8 full, rounded up to a
/// power of two). Here a slot is 16 bytes: the key as one word (`word`), and a word
/// that holds the amount of a group whose blocks are all reachable (nearly every group
/// at exit), or else the index of its verdicts in `mixed`.
#[derive(Default)]
pub(super) struct GroupVerdicts {
    by_key: HashMap<u64, u64>,
    mixed: Vec<build::Reachability>,
}

/// A value word with this bit holds an index into `GroupVerdicts::mixed`; without it,
/// the bytes (`REACHABLE_BYTE_BITS`) and blocks (the bits above them) of a group whose
/// blocks are all reachable.
const MIXED: u64 = 1 << 63;
const REACHABLE_BYTE_BITS: u32 = 40;
const REACHABLE_BYTES: u64 = (1 << REACHABLE_BYTE_BITS) - 1;
const REACHABLE_BLOCKS: u64 = (MIXED - 1) >> REACHABLE_BYTE_BITS;

impl GroupVerdicts {
    /// A group's key as one word: the stack id in the low bits (where the multiplicative
    /// hash spreads it), then the api (its name is its own: `api_names_are_distinct`) and
    /// the device.
    #[inline]
    fn word(stack: u32, api: crate::hotpath::event::Api, device: Option<u8>) -> u64 {
        stack as u64 | (api as u64) << 32 | crate::hotpath::event::device_code(device) << 40
    }

    /// The value word of `bytes` in `blocks` all reachable, if it fits one.
    #[inline]
    fn reachable_word(bytes: u64, blocks: u64) -> Option<u64> {
        (bytes <= REACHABLE_BYTES && blocks <= REACHABLE_BLOCKS).then_some(bytes | blocks << REACHABLE_BYTE_BITS)
    }

    #[inline]
    fn reachable_amount(value: u64) -> build::Amount {
        build::Amount { bytes: value & REACHABLE_BYTES, blocks: value >> REACHABLE_BYTE_BITS }
    }

    #[inline]
    fn add(&mut self, stack: u32, api: crate::hotpath::event::Api, device: Option<u8>, verdict: Verdict, bytes: u64) {
        let value = self.by_key.entry(Self::word(stack, api, device)).or_insert(0);
        if *value & MIXED != 0 {
            self.mixed[(*value & !MIXED) as usize].add(verdict, bytes);
            return;
        }
        let was = Self::reachable_amount(*value);
        if verdict == Verdict::Reachable {
            if let Some(w) = was.bytes.checked_add(bytes).and_then(|b| Self::reachable_word(b, was.blocks + 1)) {
                *value = w;
                return;
            }
        }
        // Another verdict, or an amount past the word: the group's verdicts in full.
        let mut all = build::Reachability { reachable: was, ..Default::default() };
        all.add(verdict, bytes);
        *value = MIXED | self.mixed.len() as u64;
        self.mixed.push(all);
    }

    /// The verdicts of the group of `stack`, `api` and `device`; `None` where the scan
    /// read none of its blocks.
    pub(super) fn get(&self, stack: u32, api: crate::hotpath::event::Api, device: Option<u8>) -> Option<build::Reachability> {
        let &value = self.by_key.get(&Self::word(stack, api, device))?;
        Some(if value & MIXED != 0 {
            self.mixed[(value & !MIXED) as usize]
        } else {
            build::Reachability { reachable: Self::reachable_amount(value), ..Default::default() }
        })
    }
}

pub(super) struct ScanResult {
    pub(super) out: crate::scan::ScanInfo,
    pub(super) by_group: GroupVerdicts,
    pub(super) totals: build::KindReachability,
    /// Per group, its indirect bytes and blocks by the stack of the definite leak each
    /// block hangs from.
    pub(super) indirect_from: HashMap<GroupKey, BTreeMap<u32, (u64, u64)>>,
    /// For the groups asked for that hold reachable memory, one path from their largest
    /// reachable block out to a root.
    pub(super) held_by: HashMap<GroupKey, crate::report::held::RawPath>,
    /// The scan's verdicts and paths, kept for `LEAKTRACE_WHY_REACHABLE`.
    pub(super) kept: Option<KeptScan>,
}

/// What `why_reachable` needs of a scan, block by block.
pub(super) struct KeptScan {
    pub(super) verdicts: Vec<Verdict>,
    pub(super) parent: Vec<u32>,
    pub(super) via: Vec<u64>,
    pub(super) labels: crate::scan::RootLabels,
}

/// Links kept of a longer path: the first half near the block, the rest near the root.
const PATH_LINKS: usize = 12;

/// Classifies the outstanding blocks of this process image (inherited ones help keep
/// others reachable but are not counted). Device and managed memory is a target only:
/// its contents are not host memory to read (managed pages would migrate); page-locked
/// host memory is read like the heap.
/// The pointer scan's verdict on each of `input.blocks` (in order), the index of the
/// leaked block each indirect one hangs from, and what the scan measured.
pub(super) fn classify_live(input: &ScanInput) -> crate::scan::ScanOut {
    let live = &input.blocks;
    let blocks: Vec<mark::Block> = live
        .iter()
        .map(|b| {
            let block = mark::Block::new(b.addr, b.size());
            match b.api().kind() {
                // Device memory is not ours to read. A mapping of the program's is read
                // on its written pages, within the parts still writable (a mapping may
                // be partly inaccessible, or reserved without memory behind it).
                Kind::Device | Kind::Managed => block.opaque().cuda(),
                Kind::Mmap => block.mapping(),
                Kind::Pinned => block.cuda(),
                Kind::Host => block.in_glibc_chunk(),
                _ => block,
            }
        })
        .collect();
    // Ignored blocks are roots (what they point to is not leaked either), and so are
    // the regions the program registered (LeakSanitizer's interface).
    let mut extra_roots = crate::scan::roots::root_regions();
    // The start arguments of threads created and not yet running (a copy, read as a
    // root while the scan runs).
    let pending = crate::scan::roots::pending_args();
    extra_roots.push((pending.as_ptr() as u64, (pending.len() * 8) as u64));
    extra_roots.extend(live.iter().filter(|b| b.ignored()).map(|b| (b.addr, b.size())));
    let mut out = crate::scan::scan(&blocks, &input.inherited, &extra_roots);
    let verdicts = &mut out.verdicts;
    for (b, v) in live.iter().zip(verdicts.iter_mut()) {
        if b.ignored() {
            *v = Verdict::Reachable;
        }
    }
    if let Some((lo, hi)) = crate::scan::roots::loader_range() {
        // Only leaked blocks can change (most are reachable): each lookup reads the
        // stack table, a cache miss or two, 120k of them after `import torch`.
        for (n, (b, v)) in live.iter().zip(verdicts.iter_mut()).filter(|(_, v)| **v != Verdict::Reachable).enumerate() {
            let innermost = stacks::innermost(b.stack);
            if innermost.is_some_and(|ip| ip >= lo && ip < hi) {
                *v = Verdict::Reachable;
            }
            // The records read map their pages of the spilled table again.
            if n % 16384 == 16383 {
                stacks::release_spilled();
            }
        }
        stacks::release_spilled();
    }
    out
}

/// `wanted`: the groups to find a holder for (`(stack, api)`; the report's largest and
/// the growing ones); `budget` bounds the search through Python objects for those of
/// `through_python` (`held::Budget`).
pub(super) fn reachability_scan(
    input: &ScanInput,
    wanted: &crate::util::FxSet<(u32, crate::hotpath::event::Api)>,
    through_python: &crate::util::FxSet<(u32, crate::hotpath::event::Api)>,
    keep: bool,
    budget: &mut crate::report::held::Budget<'_>,
) -> ScanResult {
    let live = &input.blocks;
    let crate::scan::ScanOut { verdicts, owners, parent, via, labels, info } = classify_live(input);
    let mut by_group = GroupVerdicts::default();
    let mut indirect_from: HashMap<GroupKey, BTreeMap<u32, (u64, u64)>> = Default::default();
    let mut totals = build::KindReachability::default();
    // Per wanted group: its largest reachable block (the most recent of equal ones is
    // not known; the highest address is taken, for a stable answer), and its reachable
    // blocks' indices, from which more are drawn (`representatives`).
    let mut representative: HashMap<GroupKey, (u64, u64, usize)> = Default::default();
    let mut members: HashMap<GroupKey, Vec<usize>> = Default::default();
    for (i, ((b, &v), owner)) in live.iter().zip(&verdicts).zip(owners).enumerate() {
        let key = (b.stack, b.api().name(), b.device());
        if v == Verdict::Reachable && !wanted.is_empty() && wanted.contains(&(b.stack, b.api())) && parent[i] != mark::FROM_FREED {
            let r = representative.entry(key).or_insert((b.size(), b.addr, i));
            if (b.size(), b.addr) > (r.0, r.1) {
                *r = (b.size(), b.addr, i);
            }
            if through_python.contains(&(b.stack, b.api())) {
                members.entry(key).or_default().push(i);
            }
        }
        by_group.add(b.stack, b.api(), b.device(), v, b.size());
        totals[b.api().kind().index()].add(v, b.size());
        if v == Verdict::Indirect {
            if let Some(o) = live.get(owner as usize) {
                let e = indirect_from.entry(key).or_default().entry(o.stack).or_default();
                e.0 += b.size();
                e.1 += 1;
            }
        }
    }
    let largest: HashMap<GroupKey, usize> = representative.iter().map(|(k, r)| (*k, r.2)).collect();
    let mut held_by: HashMap<GroupKey, crate::report::held::RawPath> = representative
        .into_iter()
        .map(|(key, (_, _, i))| {
            let (steps, left_out) = mark::path(&parent, &via, i, PATH_LINKS);
            (key, crate::report::held::RawPath::new(live, i, &steps, left_out, PATH_LINKS / 2, crate::scan::Labels::new(&labels, &input.inherited)))
        })
        .collect();
    // Through Python objects (a pass over them per round) for the growing ones only,
    // from several of each group's blocks: the one path a group shows is the holder
    // most of them have. The largest block alone was often the newest, which a running
    // function's local also holds (`state` in a training loop) while the container
    // that keeps all the others (the replay buffer) is what grows.
    let python_keys: Vec<GroupKey> = held_by.keys().filter(|k| through_python.iter().any(|t| t.0 == k.0 && t.1.name() == k.1)).copied().collect();
    let mut python: HashMap<(GroupKey, usize), crate::report::held::RawPath> = HashMap::default();
    for key in python_keys {
        let Some(first) = held_by.remove(&key) else { continue };
        let first_block = largest.get(&key).copied();
        python.insert((key, 0), first);
        for (n, i) in spread(members.get(&key).map_or(&[][..], Vec::as_slice), REPRESENTATIVES).into_iter().filter(|&i| Some(i) != first_block).enumerate() {
            let (steps, left_out) = mark::path(&parent, &via, i, PATH_LINKS);
            python.insert(
                (key, n + 1),
                crate::report::held::RawPath::new(live, i, &steps, left_out, PATH_LINKS / 2, crate::scan::Labels::new(&labels, &input.inherited)),
            );
        }
    }
    crate::report::held::extend_python(&mut python, live, &parent, &via, crate::scan::Labels::new(&labels, &input.inherited), PATH_LINKS, budget);
    held_by.extend(most_common_holder(python));
    let kept = keep.then_some(KeptScan { verdicts, parent, via, labels });
    ScanResult { out: info, by_group, totals, indirect_from, held_by, kept }
}

/// Blocks listed per report or check for `LEAKTRACE_WHY_REACHABLE`.
pub(super) const WHY_BLOCKS: usize = 256;

/// For `LEAKTRACE_WHY_REACHABLE`: the path that keeps each of `blocks` (indices into
/// `live`, reachable by the scan whose `parent`, `via` and `labels` these are), through
/// Python objects as the growing groups' holders go, named. `stacks`: each block's
/// allocation stack by stack id.
pub(super) fn why_reachable(
    live: &[crate::collector::state::LiveEntry],
    blocks: &[usize],
    scan: (&[u32], &[u64], crate::scan::Labels<'_>),
    stacks: &HashMap<u32, Vec<leaktrace_common::report_schema::Frame>>,
    sym: &mut crate::report::symbolize::Symbolizer,
) -> Vec<leaktrace_common::report_schema::WhyReachable> {
    let (parent, via, labels) = scan;
    let mut paths: HashMap<usize, crate::report::held::RawPath> = blocks
        .iter()
        .take(WHY_BLOCKS)
        .map(|&i| {
            let (steps, left_out) = mark::path(parent, via, i, PATH_LINKS);
            (i, crate::report::held::RawPath::new(live, i, &steps, left_out, PATH_LINKS / 2, labels))
        })
        .collect();
    crate::report::held::extend_python(&mut paths, live, parent, via, labels, PATH_LINKS, &mut crate::report::held::Budget::unbounded());
    blocks
        .iter()
        .take(WHY_BLOCKS)
        .filter_map(|i| {
            let b = &live[*i];
            let path = paths.get(i)?;
            Some(leaktrace_common::report_schema::WhyReachable {
                kind: b.api().kind().name().into(),
                api: b.api().name().into(),
                address: b.addr,
                size: b.size(),
                stack_id: b.stack,
                stack: stacks.get(&b.stack).cloned().unwrap_or_default(),
                held_by: crate::report::held::resolve(path, sym),
            })
        })
        .collect()
}

/// Whether a stack's frames match `template` (a suppression's pattern).
pub(super) fn stack_matches(template: &str, stack: &[leaktrace_common::report_schema::Frame]) -> bool {
    leaktrace_common::suppressions::frame_names(stack).any(|n| leaktrace_common::suppressions::template_match(template, n))
}

/// Blocks of a group whose holders are compared besides its largest.
const REPRESENTATIVES: usize = 4;

/// Up to `count` of `items`, spread evenly over them (the first among them).
pub(super) fn spread<T: Copy + PartialEq>(items: &[T], count: usize) -> Vec<T> {
    let n = count.min(items.len());
    let mut out: Vec<T> = (0..n).map(|k| items[k * items.len() / n]).collect();
    out.dedup();
    out
}

/// Per group, the path whose last link (what holds the chain: a module's global, a
/// function's local, a stack) most of its representatives share; among those, the
/// first drawn (the largest block's).
fn most_common_holder(paths: HashMap<(GroupKey, usize), crate::report::held::RawPath>) -> HashMap<GroupKey, crate::report::held::RawPath> {
    let mut by_group: HashMap<GroupKey, Vec<(usize, crate::report::held::RawPath)>> = HashMap::default();
    for ((key, n), p) in paths {
        by_group.entry(key).or_default().push((n, p));
    }
    by_group
        .into_iter()
        .filter_map(|(key, mut drawn)| {
            drawn.sort_by_key(|(n, _)| *n);
            let votes = |p: &crate::report::held::RawPath| drawn.iter().filter(|(_, q)| crate::report::held::same_holder(q, p)).count();
            let best = drawn.iter().enumerate().max_by_key(|(k, (_, p))| (votes(p), std::cmp::Reverse(*k))).map(|(k, _)| k)?;
            let drawn: Vec<crate::report::held::RawPath> = drawn.into_iter().map(|(_, p)| p).collect();
            Some((key, crate::report::held::with_second(drawn, best, |p| !p.links.is_empty())))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_items_evenly_from_the_first_and_never_more_than_there_are() {
        let items: Vec<u32> = (0..10).collect();
        assert_eq!(spread(&items, 4), vec![0, 2, 5, 7]);
        assert_eq!(spread(&items[..3], 5), vec![0, 1, 2]);
        assert!(spread::<u32>(&[], 4).is_empty());
    }

    /// `GroupVerdicts` keys a group by its api where the report keys it by the api's
    /// name: the same thing only while no two apis share a name.
    #[test]
    fn api_names_are_distinct() {
        use crate::hotpath::event::Api;
        let apis: std::collections::BTreeSet<u8> = (0..128u8).map(|b| Api::from_bits(b) as u8).collect();
        let names: std::collections::BTreeSet<&str> = apis.iter().map(|&b| Api::from_bits(b).name()).collect();
        assert_eq!(names.len(), apis.len());
    }

    /// Verdicts add up by group: the same stack under another api or device, or the
    /// largest stack id, is a group of its own; a group the scan never read has none.
    #[test]
    fn group_verdicts_add_up_by_stack_api_and_device() {
        use crate::hotpath::event::Api;
        let mut g = GroupVerdicts::default();
        let top = u32::MAX;
        for (stack, api, device, verdict, bytes) in [
            (7, Api::Malloc, None, Verdict::Reachable, 16),
            (7, Api::Malloc, None, Verdict::Definite, 32),
            (7, Api::Malloc, None, Verdict::Reachable, 8),
            (7, Api::Calloc, None, Verdict::Indirect, 64),
            (7, Api::CudaMalloc, Some(0), Verdict::Definite, 512),
            (7, Api::CudaMalloc, Some(1), Verdict::Reachable, 256),
            (top, Api::Malloc, None, Verdict::Definite, 48),
        ] {
            g.add(stack, api, device, verdict, bytes);
        }
        let amount = |bytes, blocks| build::Amount { bytes, blocks };
        let got = |stack, api, device| g.get(stack, api, device).unwrap();
        assert_eq!(got(7, Api::Malloc, None), build::Reachability { reachable: amount(24, 2), definite: amount(32, 1), ..Default::default() });
        assert_eq!(got(7, Api::Calloc, None), build::Reachability { indirect: amount(64, 1), ..Default::default() });
        assert_eq!(got(7, Api::CudaMalloc, Some(0)), build::Reachability { definite: amount(512, 1), ..Default::default() });
        assert_eq!(got(7, Api::CudaMalloc, Some(1)), build::Reachability { reachable: amount(256, 1), ..Default::default() });
        assert_eq!(got(top, Api::Malloc, None), build::Reachability { definite: amount(48, 1), ..Default::default() });
        assert_eq!(g.get(8, Api::Malloc, None), None);
        assert_eq!(g.get(7, Api::CudaMalloc, None), None);
        assert_eq!(g.mixed.len(), 4, "the groups with more than reachable blocks");
    }

    /// A group whose blocks are all reachable keeps its amount in the slot's word until
    /// it no longer fits; then it has its verdicts in full, exact as before.
    #[test]
    fn an_all_reachable_group_past_what_a_word_holds_keeps_its_exact_amount() {
        use crate::hotpath::event::Api;
        let mut g = GroupVerdicts::default();
        let big = REACHABLE_BYTES - 10;
        g.add(1, Api::Malloc, None, Verdict::Reachable, big);
        g.add(1, Api::Malloc, None, Verdict::Reachable, 10);
        assert_eq!(g.mixed.len(), 0);
        g.add(1, Api::Malloc, None, Verdict::Reachable, 1);
        assert_eq!(g.mixed.len(), 1);
        g.add(1, Api::Malloc, None, Verdict::Reachable, u64::MAX - REACHABLE_BYTES - 1);
        let amount = build::Amount { bytes: u64::MAX, blocks: 4 };
        assert_eq!(g.get(1, Api::Malloc, None), Some(build::Reachability { reachable: amount, ..Default::default() }));
        for _ in 0..3 {
            g.add(2, Api::Malloc, None, Verdict::Reachable, 0);
        }
        let value = g.by_key[&GroupVerdicts::word(2, Api::Malloc, None)];
        assert_eq!(GroupVerdicts::reachable_amount(value), build::Amount { bytes: 0, blocks: 3 });
        assert_eq!(GroupVerdicts::reachable_word(0, REACHABLE_BLOCKS + 1), None);
    }
}
