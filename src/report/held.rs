//! "Held by": for reachable memory, one path of references from a block out to the
//! root that keeps it, as the mark phase found it (`scan::mark::path`), and its names
//! (`HeldLink` in the report). The scan keeps raw values only (block indices, word
//! addresses); naming them (allocation stacks, symbols, Python type names) happens
//! here, for the few groups a report shows.
use std::sync::Arc;

use leaktrace_common::report_schema::{Frame, HeldLink};

use super::symbolize::Symbolizer;
use crate::collector::state::LiveEntry;
use crate::hotpath::event::Api;
use crate::scan::{mark, Labels, RootKind, RootLabel};

/// One link as the scan found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RawLink {
    /// A tracked block holds the reference, `offset` bytes into it (`key`: the dict key
    /// whose value it is, when the block is a dict's entries).
    Block { stack: u32, api: Api, size: u64, offset: u64, key: Option<String> },
    /// A Python object (or a raw pymalloc block: `type_name` `None`) holds it, `offset`
    /// bytes into it; `module`: the module's name, for a module object.
    /// `attribute`: the reference is one of the object's attribute values, kept apart
    /// from it (3.11+: before the object, through its values pointer).
    Python { start: u64, offset: u64, type_name: Option<String>, key: Option<String>, module: Option<String>, attribute: bool },
    /// A running function's frame holds it (3.11+): a local variable (`name`) or a
    /// value on its stack (`None`); `function`: `qualname() (file:first line)`.
    Local { name: Option<String>, function: String },
    /// Root memory holds it, at `addr`.
    Root { addr: u64, label: Option<RootLabel> },
    /// Links of a long chain left out here.
    Elided(u64),
    /// No reference found it: kept by the agent's own rule (an ignored block, the
    /// loader's allocations).
    Unscanned,
}

/// A path from one block (`block_size` bytes) out to its root: `links[0]` holds the
/// block, the last link is the root.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawPath {
    pub block_size: u64,
    pub links: Vec<RawLink>,
    /// The links (by index) whose word points into the middle of what they hold, with
    /// how far in: references a person would not count on (`HeldLink::into`).
    pub interior: Vec<(usize, u64)>,
    /// When this path was chosen among several blocks' paths and their holders differ:
    /// the next most common holder (`choose`).
    pub also: Option<Box<Also>>,
}

/// The second holder of a group's blocks (`RawPath::also`): its path, how many of the
/// blocks looked at it holds, how many the chosen path's holder holds, of how many.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Also {
    pub path: RawPath,
    pub blocks: u32,
    pub held_by_blocks: u32,
    pub looked_at: u32,
}

/// Of the paths drawn from one group's blocks (`drawn`, in the order drawn: the first
/// the group's representative), those that `named` says reached a holder vote by
/// their last link (what holds the chain): the path chosen is `best`'s index (its
/// holder most of them share, as the caller chose it); with the next most common
/// holder among the named paths, when one is certain (no word into a block's middle),
/// as its `also`.
pub fn with_second(mut drawn: Vec<RawPath>, best: usize, named: impl Fn(&RawPath) -> bool) -> RawPath {
    let votes = |p: &RawPath| drawn.iter().filter(|q| named(q) && same_holder(q, p)).count() as u32;
    let held_by_blocks = votes(&drawn[best]);
    let looked_at = drawn.iter().filter(|q| !q.links.is_empty()).count() as u32;
    let second = (0..drawn.len())
        .filter(|&k| named(&drawn[k]) && drawn[k].interior.is_empty() && !same_holder(&drawn[k], &drawn[best]))
        .map(|k| (votes(&drawn[k]), k))
        .max_by_key(|&(v, k)| (v, std::cmp::Reverse(k)));
    let also = second.map(|(blocks, k)| {
        let mut path = std::mem::take(&mut drawn[k]);
        path.also = None;
        Box::new(Also { path, blocks, held_by_blocks, looked_at })
    });
    let mut chosen = drawn.swap_remove(best);
    chosen.also = also;
    chosen
}

/// Whether two paths end at the same holder: the same root (their last link) holding
/// them under the same key (a module's global by its name: the module is the root of
/// every global of it).
pub fn same_holder(a: &RawPath, b: &RawPath) -> bool {
    !a.links.is_empty() && a.links.last() == b.links.last() && holder_name(a) == holder_name(b)
}

/// The key a path's root holds it under (a global's name, a dict entry's key): that of
/// the last of its last three links that has one.
fn holder_name(p: &RawPath) -> Option<&str> {
    p.links.iter().rev().take(3).find_map(|l| match l {
        RawLink::Python { key: Some(k), .. } | RawLink::Block { key: Some(k), .. } => Some(k.as_str()),
        _ => None,
    })
}

impl RawPath {
    /// From `mark::path`'s steps of block `live[i]`'s chain: `left_out` links were left
    /// out after the first `head`.
    ///
    /// Each word is read again (a copy) to tell one that points to the start of what it
    /// holds from one that points into its middle (`interior`); not where copies are
    /// refused, and not across the links left out.
    pub fn new(live: &[LiveEntry], block: usize, steps: &[(u32, u64)], left_out: usize, head: usize, labels: Labels<'_>) -> RawPath {
        let mut links = Vec::with_capacity(steps.len() + 1);
        let read = crate::scan::roots::copies_allowed();
        // The words to read again: (link, word address, the block it refers to).
        let mut words: Vec<(usize, u64, &LiveEntry)> = Vec::new();
        // The block the next step's word refers to, while known.
        let mut held = Some(block);
        for (k, &(parent, at)) in steps.iter().enumerate() {
            if k == head && left_out > 0 {
                links.push(RawLink::Elided(left_out as u64));
                held = None;
            }
            if let Some(h) = held.filter(|_| read && at != 0).and_then(|h| live.get(h)) {
                words.push((links.len(), at, h));
            }
            held = (parent < mark::FROM_FREED).then_some(parent as usize);
            links.push(match parent {
                mark::FROM_ROOT if at == 0 => RawLink::Unscanned,
                mark::FROM_ROOT => RawLink::Root { addr: at, label: labels.of(at) },
                mark::FROM_FREED => RawLink::Unscanned,
                p => {
                    let holder = &live[p as usize];
                    RawLink::Block { stack: holder.stack, api: holder.api(), size: holder.size(), offset: at.wrapping_sub(holder.addr), key: None }
                }
            });
        }
        // All of the path's words in one read (one system call each had been 105 of the
        // 139 copies in `git --version`'s report).
        let addrs: Vec<u64> = words.iter().map(|w| w.1).collect();
        let values = if addrs.is_empty() { Vec::new() } else { crate::scan::roots::read_own_words(&addrs) };
        let interior = words.iter().zip(values).filter_map(|(&(link, _, held), value)| Some((link, word_into(value?, held)?))).collect();
        RawPath { block_size: live.get(block).map_or(0, |b| b.size()), links, interior, also: None }
    }
}

/// How far into `held` a word that holds `value` points, when `INTERIOR_FROM` bytes or
/// more (past any header put before an object: Python's GC header and pre-header, 16
/// and 32 bytes; `make_shared`'s control block, 16).
fn word_into(value: u64, held: &LiveEntry) -> Option<u64> {
    let into = value.wrapping_sub(held.addr);
    (into >= INTERIOR_FROM && into < held.size()).then_some(into)
}

/// How far into a block a word must point to make a path uncertain.
const INTERIOR_FROM: u64 = 64;

/// The links of `path`, named: blocks with their allocation stacks, roots with their
/// symbol, thread, function or Python type.
pub fn resolve(path: &RawPath, sym: &mut Symbolizer) -> Vec<HeldLink> {
    let ids: Vec<u32> = path.links.iter().filter_map(|l| if let RawLink::Block { stack, .. } = l { Some(*stack) } else { None }).collect();
    let mut stacks = super::build::resolve_stacks(&ids, sym).into_iter();
    let mut links: Vec<HeldLink> = path
        .links
        .iter()
        .map(|l| match l {
            RawLink::Block { stack, api, size, offset, key } => HeldLink {
                kind: api.kind().name().into(),
                offset: *offset,
                api: Some(api.name().into()),
                size: Some(*size),
                stack_id: Some(*stack),
                stack: Some(stacks.next().unwrap_or_default()),
                key: key.clone(),
                ..Default::default()
            },
            RawLink::Python { offset, type_name, key, module, attribute, .. } => HeldLink {
                kind: "python_object".into(),
                offset: *offset,
                type_name: type_name.clone(),
                key: key.clone(),
                symbol: module.clone(),
                attribute: *attribute,
                ..Default::default()
            },
            RawLink::Local { name, function } => local_link(name.clone(), Some(function.clone())),
            RawLink::Elided(n) => HeldLink { kind: "elided".into(), elided: Some(*n), ..Default::default() },
            RawLink::Unscanned => HeldLink { kind: "unscanned".into(), ..Default::default() },
            RawLink::Root { addr, label } => root_link(*addr, *label, sym),
        })
        .collect();
    for &(k, into) in &path.interior {
        if let Some(l) = links.get_mut(k) {
            l.into = Some(into);
        }
    }
    forget_keys_of_attribute_values(&mut links);
    links
}

/// A raw block that an object's pre-header points to holds its attribute values (3.11+):
/// no keys lie between them, so the "key" read before a value there (a string the word
/// before it points to) is the attribute before it, not its name.
fn forget_keys_of_attribute_values(links: &mut [HeldLink]) {
    for k in 1..links.len() {
        if leaktrace_common::held::are_attribute_values(&links[k - 1], links.get(k)) {
            links[k - 1].key = None;
        }
    }
}

/// The addresses of `path`'s roots in a module's data (its second holder's too): the
/// words `resolve` names by their variable (`Symbolizer::prefetch_data_symbols`).
pub fn data_roots(path: &RawPath, out: &mut Vec<u64>) {
    for l in &path.links {
        if let RawLink::Root { addr, label: Some(label) } = l {
            if matches!(label.kind, RootKind::Module | RootKind::CudaLibrary) {
                out.push(*addr);
            }
        }
    }
    if let Some(a) = &path.also {
        data_roots(&a.path, out);
    }
}

/// `path`'s second holder (`RawPath::also`), named as `resolve` names a path.
pub fn resolve_also(path: &RawPath, sym: &mut Symbolizer) -> Option<leaktrace_common::report_schema::OtherHolder> {
    let a = path.also.as_ref()?;
    Some(leaktrace_common::report_schema::OtherHolder {
        blocks: a.blocks,
        held_by_blocks: a.held_by_blocks,
        looked_at: a.looked_at,
        held_by: resolve(&a.path, sym),
    })
}

/// A running function's local variable (or stack value).
fn local_link(name: Option<String>, function: Option<String>) -> HeldLink {
    HeldLink { kind: "python_local".into(), symbol: name, function, ..Default::default() }
}

fn root_link(addr: u64, label: Option<RootLabel>, sym: &mut Symbolizer) -> HeldLink {
    let Some(label) = label else { return HeldLink { kind: "root".into(), ..Default::default() } };
    let offset = addr - label.start;
    match label.kind {
        RootKind::Module | RootKind::CudaLibrary => {
            let kind = if label.kind == RootKind::Module { "global" } else { "cuda_library" };
            match sym.data_symbol(addr) {
                Some(d) => HeldLink { kind: kind.into(), offset: d.offset, symbol: d.name, module: Some(d.module), ..Default::default() },
                None => HeldLink { kind: kind.into(), offset, ..Default::default() },
            }
        }
        RootKind::Stack { tid, ip, .. } => {
            let function = (ip != 0).then(|| function_at(ip, sym)).flatten();
            HeldLink { kind: "stack".into(), thread: Some(tid), function, ..Default::default() }
        }
        RootKind::Registers { tid } => HeldLink { kind: "registers".into(), thread: Some(tid), ..Default::default() },
        RootKind::Tls => HeldLink { kind: "tls".into(), offset, ..Default::default() },
        RootKind::Region => HeldLink { kind: "root_region".into(), offset, ..Default::default() },
        RootKind::Inherited => HeldLink { kind: "inherited".into(), offset, ..Default::default() },
        RootKind::PythonFrames => {
            let slot = crate::hotpath::python::minor()
                .filter(|_| crate::scan::roots::copies_allowed())
                .and_then(|minor| crate::scan::referrers::frame_slot(addr, (label.start, label.len), minor, None));
            match slot {
                Some(s) => local_link(s.name, Some(s.function)),
                None => local_link(None, None),
            }
        }
        RootKind::PythonObject => {
            let block = crate::scan::roots::copies_allowed().then(|| crate::scan::arenas::block_at(addr, label.start, label.len)).flatten();
            let named = block.and_then(|(b, size)| crate::scan::referrers::object_in_block(b, size));
            let start = named.as_ref().map(|n| n.0).or(block.map(|b| b.0)).unwrap_or(addr);
            HeldLink { kind: "python_object".into(), offset: addr - start, type_name: named.map(|n| n.1), ..Default::default() }
        }
    }
}

/// Rounds of the search for who holds a Python object: a path goes at most this many
/// objects further (a tensor, a list, a hook's closure, a module's hooks, the layer,
/// its parent's modules, the parent, a global: a dozen).
const PYTHON_ROUNDS: usize = 12;
/// Links a path grows to at most.
const MAX_LINKS: usize = 40;
/// Branches followed per path in a round.
const MAX_BRANCHES: usize = 24;

/// What holder searches may read (`extend_python`, `python_holders`): the bytes their
/// rounds may read in all, and a flag that stops them.
///
/// A round reads every live object and heap block once, so its cost is the program's
/// heap: ~0.3 GB with torch loaded, but a service that had kept 1.2 GB of log records
/// took 1.5 s a round and spent 29 s of its exit in the holder rounds at Python's exit
/// (for a 14 s run). A budget in bytes, not in time, bounds that and keeps the answer
/// the same on a busy machine as on a quiet one: a search whose next round would pass
/// it ends as one whose rounds ran out (the longest way found so far, which no one
/// takes for a holder that reached its end: `reaches_a_holder`).
pub struct Budget<'a> {
    /// Bytes the rounds may still read, all searches given this budget together.
    pub bytes_left: u64,
    /// Set by another thread: the search ends before its next round.
    pub stop: Option<&'a std::sync::atomic::AtomicBool>,
    /// The rounds taken so far, and the bytes they read: what the searches cost
    /// (`diagnostics.holder_searches`).
    pub rounds: u64,
    pub bytes_read: u64,
    /// What the last round taken read (0: none yet): about what the next would.
    pub last_round: u64,
}

impl Budget<'_> {
    /// No bound.
    pub fn unbounded() -> Budget<'static> {
        Budget::new(u64::MAX, None)
    }

    /// `bytes` to read in all; `stop`, where given, ends the search before its next round.
    pub fn new(bytes: u64, stop: Option<&std::sync::atomic::AtomicBool>) -> Budget<'_> {
        Budget { bytes_left: bytes, stop, rounds: 0, bytes_read: 0, last_round: 0 }
    }

    /// Takes a round of `bytes` from the budget; false (nothing taken) when it has not
    /// that many left or the search was asked to stop.
    fn take_round(&mut self, bytes: u64) -> bool {
        if self.stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::Relaxed)) || bytes > self.bytes_left {
            return false;
        }
        self.bytes_left -= bytes;
        self.rounds += 1;
        self.bytes_read += bytes;
        self.last_round = bytes;
        true
    }
}

/// What one round of a search reads: the arenas, the frame chunks and the heap blocks
/// not found holding no address (`referrers::find`'s `pointer_free`).
fn round_bytes(arenas: &[(u64, u64)], chunks: &[(u64, u64)], blocks: &[(u64, u64)], pointer_free: &[bool]) -> u64 {
    let blocks: u64 = blocks.iter().zip(pointer_free).filter(|(_, &free)| !free).map(|(b, _)| b.1).sum();
    [arenas, chunks].iter().flat_map(|r| r.iter()).map(|&(_, len)| len).sum::<u64>() + blocks
}

/// One way out from a path's Python object so far: the links found after the path's
/// own, and the object to look for holders of next.
struct Branch<K> {
    path: K,
    links: Vec<RawLink>,
    target: u64,
    reach: u64,
    seen: Vec<u64>,
    /// Rounds its path has left: `PYTHON_ROUNDS` from the round the path joined.
    left: usize,
}

impl<K> Branch<K> {
    /// A path's first branch: from `target`, its whole budget of rounds ahead.
    fn start(path: K, target: u64, reach: u64) -> Branch<K> {
        Branch { path, links: Vec::new(), target, reach, seen: vec![target], left: PYTHON_ROUNDS }
    }
}

/// The first branches of paths that joined a running search (`Joiner`'s answer).
fn joined_branches<K: Clone + Eq + std::hash::Hash, S: std::hash::BuildHasher>(
    joined: Vec<(K, Option<u64>)>,
    paths: &mut std::collections::HashMap<K, RawPath, S>,
) -> Vec<Branch<K>> {
    joined
        .into_iter()
        .filter_map(|(k, block)| match block {
            Some(addr) => Some(Branch::start(k, addr, 0)),
            None => paths.get_mut(&k).and_then(python_end).map(|(start, reach)| Branch::start(k, start, reach)),
        })
        .collect()
}

/// Paths that join a search while it runs (`python_holders`' later lines): called
/// before each round while the search is young enough (`JOIN_ROUNDS`), it inserts the
/// new paths into the map and returns their keys, each with the heap block to look
/// for holders of from the start (`None`: the path ends at a Python object already).
type Joiner<'a, K, S> = dyn FnMut(&mut std::collections::HashMap<K, RawPath, S>) -> Vec<(K, Option<u64>)> + 'a;

/// Rounds of a search during which new paths may join it: past these, a line that
/// starts to grow waits for the next search, so that no search runs on for ever.
const JOIN_ROUNDS: usize = 2 * PYTHON_ROUNDS;

/// Paths that end at a Python object go on through the objects that refer to it (the
/// scan does not trace through Python objects: they are its roots), breadth first:
/// each round one pass over the live objects and blocks for every branch of every path
/// (`scan::referrers`), a few holders per object; a tracked block found holding one
/// continues along its own scan path. A path ends at the first branch to reach a module
/// object; with none in `PYTHON_ROUNDS` rounds, at the first branch that reached another
/// root (a global, a stack), else at its longest branch through the best holders. `live`, `parent`, `via` and `labels` are the scan's.
/// `budget` bounds its rounds (`Budget`).
#[allow(clippy::too_many_arguments)]
pub fn extend_python<K: Clone + Eq + std::hash::Hash, S: std::hash::BuildHasher>(
    paths: &mut std::collections::HashMap<K, RawPath, S>,
    live: &[LiveEntry],
    parent: &[u32],
    via: &[u64],
    labels: Labels<'_>,
    path_links: usize,
    budget: &mut Budget<'_>,
) {
    extend_python_from(paths, Vec::new(), live, parent, via, labels, path_links, None, budget);
}

/// `extend_python`, with `starts` (a path's key and a heap block's start) looked for
/// from the start as well: the paths of heap blocks that no scan reached.
/// `join`, where given, brings paths that join while the search runs (`Joiner`).
#[allow(clippy::too_many_arguments)]
fn extend_python_from<K: Clone + Eq + std::hash::Hash, S: std::hash::BuildHasher>(
    paths: &mut std::collections::HashMap<K, RawPath, S>,
    starts: Vec<(K, u64)>,
    live: &[LiveEntry],
    parent: &[u32],
    via: &[u64],
    labels: Labels<'_>,
    path_links: usize,
    mut join: Option<&mut Joiner<'_, K, S>>,
    budget: &mut Budget<'_>,
) {
    use crate::scan::referrers;
    let Some(minor) = crate::hotpath::python::minor() else { return };
    if !crate::scan::roots::copies_allowed() {
        return;
    }
    let mut frontier: Vec<Branch<K>> = starts.into_iter().map(|(path, target)| Branch::start(path, target, 0)).collect();
    for (k, p) in paths.iter_mut() {
        if let Some((start, reach)) = python_end(p) {
            frontier.push(Branch::start(k.clone(), start, reach));
        }
    }
    if frontier.is_empty() && join.is_none() {
        return;
    }
    let mut arenas = Vec::with_capacity(crate::scan::arenas::capacity());
    crate::scan::arenas::live_arenas(&mut arenas);
    arenas.sort_unstable();
    let mut chunks = Vec::with_capacity(crate::scan::arenas::capacity());
    crate::scan::arenas::live_frame_chunks(&mut chunks);
    crate::scan::arenas::cut_frame_chunks_to_live(&mut chunks);
    chunks.retain(|c| c.1 > 0);
    // Sized at once: a filter's collect grows by doublings (room for up to twice the
    // blocks, and the old and new room both while the last doubling copies).
    let mut heap: Vec<usize> = Vec::with_capacity(live.len());
    heap.extend((0..live.len()).filter(|&i| live[i].api().kind() == crate::hotpath::event::Kind::Host));
    let blocks: Vec<(u64, u64)> = heap.iter().map(|&i| (live[i].addr, live[i].size())).collect();
    // The heap blocks a round found holding no address: skipped by the rounds after it.
    let mut pointer_free = vec![false; blocks.len()];
    // Per path: the branch that went furthest through first choices, for a path that
    // reaches no module.
    let mut best: std::collections::HashMap<K, Vec<RawLink>> = Default::default();
    let mut done: std::collections::HashSet<K> = Default::default();
    // Per path: the first branch that reached a root that is no module.
    let mut rooted: std::collections::HashMap<K, Vec<RawLink>> = Default::default();
    for round in 0.. {
        if round < JOIN_ROUNDS {
            if let Some(join) = join.as_deref_mut() {
                frontier.extend(joined_branches(join(paths), paths));
            }
        }
        frontier.retain(|b| b.left > 0);
        if frontier.is_empty() || !budget.take_round(round_bytes(&arenas, &chunks, &blocks, &pointer_free)) {
            break;
        }
        let targets: Vec<(u64, u64)> = frontier.iter().map(|b| (b.target, b.reach)).collect();
        let found = referrers::find(&targets, &arenas, &chunks, &blocks, minor, &mut pointer_free);
        let mut next: Vec<Branch<K>> = Vec::new();
        let mut branches: std::collections::HashMap<K, usize> = Default::default();
        for b in frontier {
            if done.contains(&b.path) {
                continue;
            }
            for (choice, f) in found.get(&b.target).into_iter().flatten().enumerate() {
                let mut links = b.links.clone();
                let mut seen = b.seen.clone();
                let end = match f.holder {
                    referrers::Holder::Object { start, size } => {
                        let typed = referrers::object_in_block(start, size);
                        let object = typed.as_ref().map_or(start, |t| t.0);
                        let type_name = typed.map(|t| t.1);
                        if seen.contains(&object) {
                            continue;
                        }
                        seen.push(object);
                        let is_module = type_name.as_deref() == Some("module");
                        let module = is_module.then(|| referrers::module_name(object, minor)).flatten();
                        // A word before the object's start is in its pre-header: the
                        // pointer to its attribute values.
                        let attribute = f.at < object;
                        let reach = if type_name.is_some() { 0 } else { (size - 8).min(crate::scan::referrers::INTERIOR) };
                        links.push(RawLink::Python { start: object, offset: f.at.saturating_sub(object), type_name, key: f.key.clone(), module, attribute });
                        if is_module {
                            None
                        } else {
                            Some((object, reach))
                        }
                    }
                    referrers::Holder::Frame { start, size } => {
                        // A running function's local: a variable the user names.
                        match referrers::frame_slot(f.at, (start, size), minor, Some(b.target)) {
                            Some(slot) => links.push(RawLink::Local { name: slot.name, function: slot.function }),
                            None => continue,
                        }
                        None
                    }
                    referrers::Holder::ListItems { items, list } => {
                        if seen.contains(&list) {
                            continue;
                        }
                        seen.push(list);
                        // The item's place in the array, then the list: `list[i]`.
                        links.push(RawLink::Python { start: items, offset: f.at - items, type_name: None, key: None, module: None, attribute: false });
                        links.push(RawLink::Python {
                            start: list,
                            offset: referrers::LIST_ITEM_FIELD,
                            type_name: Some("list".into()),
                            key: None,
                            module: None,
                            attribute: false,
                        });
                        Some((list, 0))
                    }
                    referrers::Holder::Block(j) if parent.is_empty() => {
                        // No scan to follow: on through what refers to the block.
                        let i = heap[j];
                        let blk = &live[i];
                        if seen.contains(&blk.addr) {
                            continue;
                        }
                        seen.push(blk.addr);
                        links.push(RawLink::Block { stack: blk.stack, api: blk.api(), size: blk.size(), offset: f.at - blk.addr, key: f.key.clone() });
                        Some((blk.addr, 0))
                    }
                    referrers::Holder::Block(j) => {
                        let i = heap[j];
                        let blk = &live[i];
                        links.push(RawLink::Block { stack: blk.stack, api: blk.api(), size: blk.size(), offset: f.at - blk.addr, key: f.key.clone() });
                        // On along the block's own path to its root.
                        let (steps, left_out) = mark::path(parent, via, i, path_links);
                        let mut rest = RawPath::new(live, i, &steps, left_out, path_links / 2, labels);
                        let end = python_end(&mut rest);
                        links.extend(rest.links);
                        match end {
                            Some((o, _)) if seen.contains(&o) => continue,
                            Some(e) => {
                                seen.push(e.0);
                                Some(e)
                            }
                            // A root that is no Python object (a global, a stack): done.
                            None => None,
                        }
                    }
                };
                if choice == 0 && best.get(&b.path).is_none_or(|l| l.len() < links.len()) {
                    best.insert(b.path.clone(), links.clone());
                }
                let at_module = matches!(
                    links.last(),
                    Some(RawLink::Python { module: Some(_), .. }) | Some(RawLink::Python { type_name: Some(_), .. }) | Some(RawLink::Local { name: Some(_), .. })
                        if end.is_none()
                );
                match end {
                    None if at_module => {
                        // A module: the path takes this branch.
                        if done.insert(b.path.clone()) {
                            if let Some(p) = paths.get_mut(&b.path) {
                                p.links.extend(links);
                            }
                        }
                        break;
                    }
                    None => {
                        // Another root (a global, a stack): kept unless a module is found.
                        rooted.entry(b.path.clone()).or_insert(links);
                    }
                    Some((target, reach)) => {
                        let n = branches.entry(b.path.clone()).or_default();
                        if *n < MAX_BRANCHES && links.len() < MAX_LINKS {
                            *n += 1;
                            next.push(Branch { path: b.path.clone(), links, target, reach, seen, left: b.left - 1 });
                        }
                    }
                }
            }
        }
        next.retain(|b| !done.contains(&b.path));
        frontier = next;
    }
    for (k, links) in rooted {
        if done.insert(k.clone()) {
            if let Some(p) = paths.get_mut(&k) {
                p.links.extend(links);
            }
        }
    }
    for (k, links) in best {
        if !done.contains(&k) {
            if let Some(p) = paths.get_mut(&k) {
                p.links.extend(links);
            }
        }
    }
}

/// Answers the stack and entry point of each live heap block of the addresses given,
/// now (`python_holders`).
pub type KeysOf<'a> = dyn FnMut(&[u64]) -> Vec<Option<(u32, Api)>> + 'a;

/// Where a holder search starts (`python_holders`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// A heap block of the live blocks the search was given: where its address lies in
    /// a Python arena now, the block was freed and its memory mapped again since, and it
    /// is not searched from (the arena's objects are not what held it).
    Block(u64),
    /// A sampled Python object: in an arena, or a heap block (a large object).
    Object(u64),
}

/// What holds the starts of each of `lines` (sampled Python objects, which the scan
/// never reaches, and heap blocks looked for without a scan, while a line grows): from
/// each out through the objects and heap blocks that refer to it (`extend_python`
/// without a scan's paths), up to a module's global or a function's local where one is
/// found. Per line, of the paths that reached one, the holder most of them reached (the
/// first start's among equals), else the longest way; from the object's holder out.
/// `live`: the heap blocks, sorted by address.
///
/// All lines are searched at once: each round of the search reads every object and heap
/// block of the program (1–3 s with torch loaded), whatever the number of targets, so
/// lines searched one after another named the last ones seconds late, often after the
/// program had let the memory go (`kept_list.py append`: no holder in 1 run of 12).
///
/// `key_of` answers the stack and entry point of live heap blocks now (the collector's
/// table): a block that a list's array was when `live` was taken may have been
/// reallocated since (a growing list moves its array at every ~12% of growth, and the
/// search takes a second with torch loaded); the list whose array now has the same stack
/// then holds it (`torch_user_leaks.py losses`: the line that appends to the list had no
/// holder in 3 runs of 3 once its items were read whole).
///
/// A line that starts to grow while the search runs joins it (`joining`, asked before
/// each of its first `JOIN_ROUNDS` rounds) with its own starts, drawn from the live
/// blocks then, and its own `PYTHON_ROUNDS`: waiting for the search to end named it
/// seconds late, after the program had let the memory go (`torch_user_leaks.py
/// losses`: the appending line "list ← a Python object" in 2 runs of 8). The answer has
/// one entry per line, `lines` first, then the joined ones in the order they joined.
pub fn python_holders(
    live: &[LiveEntry],
    lines: &[Vec<Start>],
    key_of: &mut KeysOf<'_>,
    mut joining: Option<&mut LinesJoining<'_>>,
    budget: &mut Budget<'_>,
) -> Vec<Option<RawPath>> {
    let mut paths: std::collections::HashMap<(usize, usize), RawPath> = std::collections::HashMap::new();
    let mut drawn = Drawn::default();
    let starts = drawn.add(lines, live, &mut paths, key_of);
    let mut later = |paths: &mut std::collections::HashMap<(usize, usize), RawPath>| -> Vec<((usize, usize), Option<u64>)> {
        let Some(joining) = joining.as_deref_mut() else { return Vec::new() };
        let Some((live_now, new_lines)) = joining() else { return Vec::new() };
        let known: std::collections::HashSet<(usize, usize)> = paths.keys().copied().collect();
        let blocks = drawn.add(&new_lines, &live_now, paths, key_of);
        let mut out: Vec<((usize, usize), Option<u64>)> = blocks.iter().map(|&(k, addr)| (k, Some(addr))).collect();
        // Their objects in the arenas, and blocks that are a list's array now: paths that
        // end at a Python object already.
        out.extend(paths.keys().filter(|k| !known.contains(k) && !blocks.iter().any(|b| b.0 == **k)).map(|&k| (k, None)));
        out
    };
    extend_python_from(&mut paths, starts, live, &[], &[], Labels::new(&Default::default(), &crate::spans::EMPTY), 0, Some(&mut later), budget);
    // A heap block freed while it was searched from (its memory handed out again: a
    // list's old array, unmapped, and a Python arena mapped at its address) was found
    // held by whatever holds the new occupant ("list[2890641]" for the array of the
    // list itself, under load): its path is dropped unless the block is still live
    // with the same stack and entry point, and outside the arenas.
    if !drawn.searched.is_empty() {
        let now = key_of(&drawn.searched.iter().map(|s| s.1).collect::<Vec<_>>());
        let mut arenas_now = Vec::with_capacity(crate::scan::arenas::capacity());
        crate::scan::arenas::live_arenas(&mut arenas_now);
        for (&(k, addr, then), key) in drawn.searched.iter().zip(now) {
            if key.is_none() || key != then || arena_of(&arenas_now, addr).is_some() {
                paths.remove(&k);
            }
        }
    }
    let mut by_line: Vec<Vec<(usize, RawPath)>> = vec![Vec::new(); drawn.lines];
    for ((line, k), mut p) in paths {
        // An object's first link is the object itself: the path starts at what holds it.
        if !drawn.heap_starts.contains(&(line, k)) {
            if p.links.len() < 2 {
                continue;
            }
            p.links.remove(0);
        }
        if !p.links.is_empty() {
            by_line[line].push((k, p));
        }
    }
    by_line.into_iter().map(chosen_holder).collect()
}

/// Whether a path found for a growing line ends at a holder: a module, a named local, or
/// a root that is no Python object (a global, a thread's stack). Not a way cut short
/// (`extend_python`'s longest branch through first choices, when none reached a root in
/// its rounds: "list[12735]" for an int that a list held while its cell was not found,
/// 1 run in 30 beside two busy loops, the interpreter moving on as it is read), which a
/// later search may carry to its end.
pub fn reaches_a_holder(p: &RawPath) -> bool {
    match p.links.last() {
        Some(RawLink::Python { module, .. }) => module.is_some(),
        Some(RawLink::Local { name, .. }) => name.is_some(),
        Some(RawLink::Root { label, .. }) => label.as_ref().is_none_or(|l| l.kind != RootKind::PythonObject),
        _ => false,
    }
}

/// Whether the holder the exit's scan found for a group of `named` bytes under a growing
/// line replaces the one found while the line grew (`series`: the line's bytes at each
/// timeline point): only where the group stands for at least half the line's peak. The
/// memory that grew may be gone by then (a list cleared before the program ends), and
/// what is left under the line something else (pymalloc's arena table, made at the line
/// whose int needed a new arena: "global nfp2lasta"). Measured against the line's last
/// point, the verdict hung on whether a point fell after the clear (1 run in 12 beside
/// two busy loops, `kept_list.py append`); the peak does not move with it.
pub fn exit_holder_replaces(named: u64, series: &[u64]) -> bool {
    let peak = series.iter().copied().max().unwrap_or(0);
    named.saturating_mul(2) >= peak
}

/// Lines that join a running search (`python_holders`): the live blocks now (sorted by
/// address) and each new line's starts drawn from them, or `None`.
pub type LinesJoining<'a> = dyn FnMut() -> Option<(Vec<LiveEntry>, Vec<Vec<Start>>)> + 'a;

/// A heap block searched from: its path's key, its address, and its stack and entry
/// point when drawn.
type Searched = ((usize, usize), u64, Option<(u32, Api)>);

/// The starts of a search's lines as drawn (`python_holders`), those of lines that
/// joined it included.
#[derive(Default)]
struct Drawn {
    /// Lines so far: the next line's number.
    lines: usize,
    /// Paths that start at a heap block (the block itself is no link of the path).
    heap_starts: Vec<(usize, usize)>,
    /// Heap blocks searched from, with their stack and entry point when drawn.
    searched: Vec<Searched>,
}

impl Drawn {
    /// Numbers `lines` on from the lines so far and draws their starts against `live`
    /// (sorted by address) and the arenas now: each start's path goes into `paths`;
    /// returns the heap blocks to search from.
    fn add(
        &mut self,
        lines: &[Vec<Start>],
        live: &[LiveEntry],
        paths: &mut std::collections::HashMap<(usize, usize), RawPath>,
        key_of: &mut KeysOf<'_>,
    ) -> Vec<((usize, usize), u64)> {
        let mut arenas = Vec::with_capacity(crate::scan::arenas::capacity());
        crate::scan::arenas::live_arenas(&mut arenas);
        let in_arena = |addr: u64| arena_of(&arenas, addr);
        let live_at = |addr: u64| live.binary_search_by_key(&addr, |b| b.addr).ok();
        let first = self.lines;
        self.lines += lines.len();
        let mut starts = Vec::new();
        for (line, drawn) in lines.iter().enumerate() {
            for (k, &start) in drawn.iter().enumerate() {
                let key = (first + line, k);
                match start {
                    // Freed since `live` was taken: its memory is a Python arena's now.
                    Start::Block(addr) if in_arena(addr).is_some() || live_at(addr).is_none() => {}
                    Start::Block(addr) => {
                        // A heap block: its holders are found from its start; no link of its own.
                        paths.insert(key, RawPath::default());
                        starts.push((key, addr));
                        self.heap_starts.push(key);
                    }
                    Start::Object(addr) => {
                        if let Some((start, len)) = in_arena(addr) {
                            let label = RootLabel { start, len, kind: RootKind::PythonObject };
                            paths.insert(key, RawPath { block_size: 0, links: vec![RawLink::Root { addr, label: Some(label) }], ..Default::default() });
                        } else if live_at(addr).is_some() {
                            // A large object, a heap block: as a block start, no link of its own.
                            paths.insert(key, RawPath::default());
                            starts.push((key, addr));
                            self.heap_starts.push(key);
                        }
                    }
                }
            }
        }
        follow_moved_arrays(paths, &mut starts, live, &arenas, key_of);
        self.searched.extend(starts.iter().map(|&(k, addr)| (k, addr, live_at(addr).map(|i| (live[i].stack, live[i].api())))));
        starts
    }
}

/// The arena of `arenas` (`(start, len)`) that `addr` lies in.
fn arena_of(arenas: &[(u64, u64)], addr: u64) -> Option<(u64, u64)> {
    arenas.iter().find(|a| addr >= a.0 && addr < a.0 + a.1).copied()
}

/// Of the paths found from one line's starts (by the start's place in the order drawn):
/// the holder most of those that reached a module or a named local reached (the first
/// start's among equals), else the longest way, with the second holder.
fn chosen_holder(found: Vec<(usize, RawPath)>) -> Option<RawPath> {
    let at_module = |p: &RawPath| matches!(p.links.last(), Some(RawLink::Python { module: Some(_), .. }) | Some(RawLink::Local { name: Some(_), .. }));
    let votes = |p: &RawPath| found.iter().filter(|(_, q)| at_module(q) && same_holder(q, p)).count();
    let keys: Vec<(usize, usize, usize)> = found.iter().map(|(k, p)| (votes(p), p.links.len(), *k)).collect();
    let best = (0..found.len()).min_by_key(|&i| {
        let (votes, len, k) = keys[i];
        let reached = at_module(&found[i].1);
        (!reached, std::cmp::Reverse(if reached { votes } else { 0 }), if reached { 0 } else { usize::MAX - len }, k)
    })?;
    // In the order drawn, for the second holder's tie-break.
    let order: Vec<usize> = {
        let mut o: Vec<usize> = (0..found.len()).collect();
        o.sort_by_key(|&i| found[i].0);
        o
    };
    let best = order.iter().position(|&i| i == best)?;
    let mut found: Vec<Option<RawPath>> = found.into_iter().map(|(_, p)| Some(p)).collect();
    let drawn: Vec<RawPath> = order.iter().map(|&i| found[i].take().unwrap_or_default()).collect();
    Some(with_second(drawn, best, at_module))
}

/// For each heap block of `starts` that is a live list's item array now, or that no
/// list's array is now but whose stack and entry point a list's array has that `live`
/// does not list (reallocated since), starts its path at that list (`python_holders`):
/// found here, a moment after the blocks were listed, rather than by the search's pass
/// over every object, a second later with torch loaded, when the array may have moved.
fn follow_moved_arrays<K: Copy + Eq + std::hash::Hash>(
    paths: &mut std::collections::HashMap<K, RawPath>,
    starts: &mut Vec<(K, u64)>,
    live: &[LiveEntry],
    arenas: &[(u64, u64)],
    key_of: &mut KeysOf<'_>,
) {
    if starts.is_empty() {
        return;
    }
    let lists = crate::scan::referrers::lists_now(arenas);
    // Arrays in the arenas are pymalloc's, never a tracked heap block.
    let in_arenas = |a: u64| arena_of(arenas, a).is_some();
    let moved: Vec<(u64, u64)> =
        lists.iter().copied().filter(|&(items, _)| !in_arenas(items) && live.binary_search_by_key(&items, |b| b.addr).is_err()).collect();
    let mut keys: Option<Vec<Option<(u32, Api)>>> = None;
    starts.retain(|&(k, addr)| {
        let list = match lists.iter().find(|l| l.0 == addr) {
            Some(&(_, list)) => list,
            None if moved.is_empty() => return true,
            None => {
                let Ok(i) = live.binary_search_by_key(&addr, |b| b.addr) else { return true };
                let key = Some((live[i].stack, live[i].api()));
                let keys = keys.get_or_insert_with(|| key_of(&moved.iter().map(|m| m.0).collect::<Vec<_>>()));
                match moved.iter().zip(keys.iter()).find(|(_, k)| **k == key) {
                    Some((&(_, list), _)) => list,
                    None => return true,
                }
            }
        };
        let Some((start, len)) = arena_of(arenas, list) else { return true };
        let label = RootLabel { start, len, kind: RootKind::PythonObject };
        let word = list + crate::scan::referrers::LIST_ITEM_FIELD;
        paths.insert(k, RawPath { block_size: 0, links: vec![RawLink::Root { addr: word, label: Some(label) }], ..Default::default() });
        false
    });
}

/// When `p` ends at a Python object's word (a root in pymalloc's arenas), makes that
/// link the object and returns its start and reach (see `referrers::find`).
fn python_end(p: &mut RawPath) -> Option<(u64, u64)> {
    let Some(RawLink::Root { addr, label: Some(label) }) = p.links.last().cloned() else { return None };
    if label.kind != RootKind::PythonObject {
        return None;
    }
    let (block, size) = crate::scan::arenas::block_at(addr, label.start, label.len)?;
    let (start, type_name) = match crate::scan::referrers::object_in_block(block, size) {
        Some((o, t)) => (o, Some(t)),
        None => (block, None),
    };
    let reach = if type_name.is_some() { 0 } else { (size - 8).min(crate::scan::referrers::INTERIOR) };
    p.links.pop();
    p.links.push(RawLink::Python { start, offset: addr.saturating_sub(start), type_name, key: None, module: None, attribute: addr < start });
    Some((start, reach))
}

/// "function (file:line)" of the frame whose return address is `ip`.
fn function_at(ip: u64, sym: &mut Symbolizer) -> Option<String> {
    let frames: Vec<Frame> = super::build::resolve_frames(ip, sym);
    let f = frames.iter().rev().find(|f| f.function.is_some())?;
    let name: &str = f.function.as_deref()?;
    Some(match (&f.file, f.line) {
        (Some(file), Some(line)) => format!("{name} ({}:{line})", short(file)),
        _ => name.to_string(),
    })
}

fn short(path: &Arc<str>) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_key_read_among_an_objects_attribute_values_is_dropped_and_no_other() {
        let py = |t: Option<&str>, key: Option<&str>, attribute: bool| HeldLink {
            kind: "python_object".into(),
            type_name: t.map(Into::into),
            key: key.map(Into::into),
            attribute,
            ..Default::default()
        };
        let mut links =
            vec![py(None, Some("v"), false), py(Some("dict"), None, false), py(None, Some("msg's value"), false), py(Some("LogRecord"), None, true)];
        forget_keys_of_attribute_values(&mut links);
        assert_eq!(links.iter().map(|l| l.key.as_deref()).collect::<Vec<_>>(), [Some("v"), None, None, None]);
    }

    #[test]
    fn a_budget_takes_whole_rounds_until_it_has_too_few_bytes_or_is_stopped() {
        let mut b = Budget::new(10, None);
        assert!(b.take_round(4) && b.take_round(4));
        assert!(!b.take_round(4), "2 bytes left: no round of 4");
        assert_eq!(b.bytes_left, 2, "a round not made takes nothing");
        assert_eq!((b.rounds, b.bytes_read), (2, 8), "what the rounds made read, and no more");
        assert!(b.take_round(2) && !b.take_round(1));
        assert_eq!((b.rounds, b.bytes_read, b.last_round), (3, 10, 2));
        let stop = std::sync::atomic::AtomicBool::new(false);
        let mut b = Budget::new(u64::MAX, Some(&stop));
        assert!(b.take_round(1 << 40));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(!b.take_round(1), "stopped");
        assert_eq!(round_bytes(&[(0x1000, 100)], &[(0x9000, 5)], &[(0x5000, 7), (0x6000, 1)], &[false, false]), 113);
        assert_eq!(round_bytes(&[(0x1000, 100)], &[(0x9000, 5)], &[(0x5000, 7), (0x6000, 1)], &[true, false]), 106);
    }

    #[test]
    fn a_way_cut_short_reaches_no_holder_and_one_that_ends_at_a_module_a_named_local_or_a_global_does() {
        use super::{reaches_a_holder, RawLink, RawPath};
        use crate::scan::{RootKind, RootLabel};
        let path = |links: Vec<RawLink>| RawPath { links, ..Default::default() };
        let object = |type_name: &str, module: Option<&str>| RawLink::Python {
            start: 0x1000,
            offset: 24,
            type_name: Some(type_name.into()),
            key: None,
            module: module.map(Into::into),
            attribute: false,
        };
        let items = RawLink::Python { start: 0x2000, offset: 8, type_name: None, key: None, module: None, attribute: false };
        // "list[12735]": the list's holders were not found in the search's rounds.
        assert!(!reaches_a_holder(&path(vec![items.clone(), object("list", None)])));
        assert!(!reaches_a_holder(&path(Vec::new())));
        assert!(!reaches_a_holder(&path(vec![RawLink::Block { stack: 1, api: crate::hotpath::event::Api::Malloc, size: 64, offset: 0, key: None }])));
        assert!(!reaches_a_holder(&path(vec![object("list", None), RawLink::Local { name: None, function: "f".into() }])));
        let object_root = RootLabel { start: 0x1000, len: 1 << 20, kind: RootKind::PythonObject };
        assert!(!reaches_a_holder(&path(vec![RawLink::Root { addr: 0x1010, label: Some(object_root) }])));
        // Ends: the list's cell's local, a module's global, a C global.
        assert!(reaches_a_holder(&path(vec![
            items,
            object("list", None),
            object("cell", None),
            RawLink::Local { name: Some("losses".into()), function: "append".into() }
        ])));
        assert!(reaches_a_holder(&path(vec![object("dict", None), object("module", Some("__main__"))])));
        assert!(reaches_a_holder(&path(vec![RawLink::Root { addr: 0x5000, label: Some(RootLabel { start: 0x5000, len: 64, kind: RootKind::Module }) }])));
        assert!(reaches_a_holder(&path(vec![RawLink::Root { addr: 0x5000, label: None }])));
    }

    #[test]
    fn the_exit_holder_of_what_is_left_under_a_line_replaces_the_one_found_while_it_grew_only_for_half_its_peak() {
        // `kept_list.py append`: a GiB of ints held by a list, then the list cleared; at
        // exit only the arena table (48 KiB) is left under the line.
        let rising: Vec<u64> = (1..=20).map(|i| i * (50 << 20)).collect();
        let mut cleared = rising.clone();
        cleared.push(48 << 10);
        for series in [&rising, &cleared] {
            assert!(!super::exit_holder_replaces(48 << 10, series), "whether a point fell after the clear or not");
        }
        // What grew is still held at exit: the exit's holder (read from a scan) stands.
        assert!(super::exit_holder_replaces(900 << 20, &rising));
        assert!(super::exit_holder_replaces(500 << 20, &cleared));
        assert!(!super::exit_holder_replaces(400 << 20, &cleared));
        // A line with no points (none followed): the exit's holder.
        assert!(super::exit_holder_replaces(1, &[]));
    }

    use super::*;

    fn entry(addr: u64, size: u64, stack: u32) -> LiveEntry {
        LiveEntry::new(addr, size, 0, false, stack, Api::Malloc, None)
    }

    #[test]
    fn the_holder_most_blocks_share_is_chosen_and_the_next_is_kept_with_its_share() {
        let module =
            RawLink::Python { start: 0x7000, offset: 16, type_name: Some("module".into()), key: None, module: Some("__main__".into()), attribute: false };
        let global = |name: &str, index: u64| RawPath {
            block_size: 64,
            links: vec![
                RawLink::Python { start: 0x100 + index, offset: 24 + 8 * index, type_name: Some("list".into()), key: None, module: None, attribute: false },
                RawLink::Python { start: 0x5000, offset: 232, type_name: None, key: Some(name.into()), module: None, attribute: false },
                module.clone(),
            ],
            ..Default::default()
        };
        // Two globals of one module are two holders, though the module is both roots.
        assert!(same_holder(&global("SEEN", 1), &global("SEEN", 7)));
        assert!(!same_holder(&global("SEEN", 1), &global("LATER", 1)));
        assert!(!same_holder(&RawPath::default(), &RawPath::default()));
        let mut uncertain = global("OTHER", 0);
        uncertain.interior = vec![(0, 96)];
        let drawn = vec![global("LATER", 9), global("SEEN", 1), global("SEEN", 2), uncertain, global("SEEN", 3), RawPath::default()];
        let chosen = with_second(drawn, 1, |p| !p.links.is_empty());
        assert_eq!(chosen.links, global("SEEN", 1).links);
        let also = chosen.also.expect("a second holder");
        // An uncertain path is never shown as a holder; of the five paths found, LATER holds one.
        assert_eq!((also.blocks, also.held_by_blocks, also.looked_at), (1, 3, 5));
        assert_eq!(also.path.links, global("LATER", 9).links);
        // All held by one thing: no second.
        assert!(with_second(vec![global("SEEN", 1), global("SEEN", 2)], 0, |p| !p.links.is_empty()).also.is_none());
    }

    #[test]
    fn lines_that_join_a_search_are_numbered_after_the_first_and_keep_their_own_blocks() {
        // No interpreter in this test: no arenas, no lists, so every block start stays a
        // heap block to search from.
        let first = [entry(0x1000, 64, 7), entry(0x3000, 16, 9)];
        let later = [entry(0x1000, 64, 7), entry(0x2000, 32, 8), entry(0x3000, 16, 10)];
        let mut paths: std::collections::HashMap<(usize, usize), RawPath> = Default::default();
        let mut drawn = Drawn::default();
        let mut no_keys = |_: &[u64]| -> Vec<Option<(u32, Api)>> { panic!("no list moved: nothing to ask") };
        // A block gone before the search began (0x9000) is not searched from.
        let starts = drawn.add(&[vec![Start::Block(0x1000), Start::Block(0x9000)], vec![Start::Object(0x3000)]], &first, &mut paths, &mut no_keys);
        assert_eq!(starts, vec![((0, 0), 0x1000), ((1, 0), 0x3000)]);
        // A line that joins later is the third, drawn against the blocks live then: its
        // block 0x2000 was not live when the search began, and 0x3000 has another stack now.
        let joined = drawn.add(&[vec![Start::Block(0x2000), Start::Block(0x3000)]], &later, &mut paths, &mut no_keys);
        assert_eq!(joined, vec![((2, 0), 0x2000), ((2, 1), 0x3000)]);
        assert_eq!(drawn.lines, 3);
        // Heap starts are the heap blocks', an object's among them (an object in an
        // arena has a first link, the object itself; one in a heap block has none).
        assert_eq!(drawn.heap_starts, vec![(0, 0), (1, 0), (2, 0), (2, 1)]);
        // Each searched block with the stack it had where it was drawn: the check after
        // the search compares with that one.
        let searched: Vec<_> = drawn.searched.iter().map(|&(k, a, key)| (k, a, key.map(|k| k.0))).collect();
        assert_eq!(searched, vec![((0, 0), 0x1000, Some(7)), ((1, 0), 0x3000, Some(9)), ((2, 0), 0x2000, Some(8)), ((2, 1), 0x3000, Some(10))]);
        assert_eq!(paths.len(), 4);
        // They start with a whole search's rounds ahead, however late they joined; a path
        // that ends at no Python object has no branch.
        let branches = joined_branches(vec![((2, 0), Some(0x2000)), ((0, 0), None)], &mut paths);
        assert_eq!(branches.len(), 1);
        assert_eq!((branches[0].path, branches[0].target, branches[0].left), ((2, 0), 0x2000, PYTHON_ROUNDS));
    }

    #[test]
    fn a_path_names_each_holder_block_and_its_root() {
        let live = [entry(0x1000, 64, 7), entry(0x2000, 32, 8), entry(0x3000, 16, 9)];
        let labels = crate::scan::RootLabels { list: vec![RootLabel { start: 0x600000, len: 0x1000, kind: RootKind::Module }], inherited_at: 1 };
        // Block 2 is held by block 1 at +8, block 1 by block 0 at +16, block 0 by a global.
        let parent = [mark::FROM_ROOT, 0, 1];
        let via = [0x600010, 0x1010, 0x2008];
        let (steps, left_out) = mark::path(&parent, &via, 2, 12);
        let p = RawPath::new(&live, 2, &steps, left_out, 6, Labels::new(&labels, &crate::spans::EMPTY));
        assert_eq!(p.block_size, 16);
        assert_eq!(
            p.links,
            vec![
                RawLink::Block { stack: 8, api: Api::Malloc, size: 32, offset: 8, key: None },
                RawLink::Block { stack: 7, api: Api::Malloc, size: 64, offset: 16, key: None },
                RawLink::Root { addr: 0x600010, label: Some(labels.list[0]) },
            ]
        );
    }

    /// A word that points into the middle of what it holds is marked on its link (read
    /// again from this process's memory); one that points to the start is not.
    #[test]
    fn a_word_into_the_middle_of_a_block_is_marked_on_its_link() {
        // Copies are allowed once /proc/self/status says no seccomp filter: opened here,
        // not left to a test that ran before.
        crate::os::procfs::open(false);
        let target: Box<[u64; 32]> = Box::new([0; 32]);
        let t = &*target as *const _ as u64;
        let holder: Box<[u64; 4]> = Box::new([0, t + 96, t + 16, t]);
        let h = &*holder as *const _ as u64;
        let mut live = vec![entry(t, 256, 1), entry(h, 32, 2)];
        live.sort_by_key(|b| b.addr);
        let (ti, hi) = (live.iter().position(|b| b.addr == t).unwrap(), live.iter().position(|b| b.addr == h).unwrap());
        let path = |word: u64| {
            let mut parent = vec![mark::FROM_ROOT; 2];
            let mut via = vec![0x600000; 2];
            parent[ti] = hi as u32;
            via[ti] = word;
            let (steps, left_out) = mark::path(&parent, &via, ti, 12);
            RawPath::new(&live, ti, &steps, left_out, 6, Labels::new(&Default::default(), &crate::spans::EMPTY))
        };
        assert_eq!(path(h + 8).interior, vec![(0, 96)]);
        // Its start, or just past a header: a reference.
        assert!(path(h + 24).interior.is_empty());
        assert!(path(h + 16).interior.is_empty());
        drop((target, holder));
    }

    #[test]
    fn a_long_chain_keeps_its_ends_and_counts_what_it_left_out() {
        // A list of 100 nodes from a root: node k is held by node k - 1.
        let n = 100;
        let live: Vec<LiveEntry> = (0..n).map(|k| entry(0x10_0000 + 0x100 * k as u64, 48, 3)).collect();
        let parent: Vec<u32> = (0..n).map(|k| if k == 0 { mark::FROM_ROOT } else { k as u32 - 1 }).collect();
        let via: Vec<u64> = (0..n).map(|k| if k == 0 { 0x600000 } else { 0x10_0000 + 0x100 * (k as u64 - 1) + 8 }).collect();
        let (steps, left_out) = mark::path(&parent, &via, n - 1, 12);
        assert_eq!((steps.len(), left_out), (12, 100 - 12));
        let p = RawPath::new(&live, n - 1, &steps, left_out, 6, Labels::new(&Default::default(), &crate::spans::EMPTY));
        assert_eq!(p.links.len(), 13);
        assert_eq!(p.links[6], RawLink::Elided(88));
        assert_eq!(p.links[0], RawLink::Block { stack: 3, api: Api::Malloc, size: 48, offset: 8, key: None });
        assert_eq!(p.links[12], RawLink::Root { addr: 0x600000, label: None });
        // A block freed meanwhile, or one no reference found, ends the path unnamed.
        let (steps, left_out) = mark::path(&[mark::FROM_FREED], &[0], 0, 12);
        assert_eq!(RawPath::new(&live, 0, &steps, left_out, 6, Labels::new(&Default::default(), &crate::spans::EMPTY)).links, vec![RawLink::Unscanned]);
    }
}
