//! The collector's model of the process: the live set and per-stack aggregates.
//! Plain safe Rust, fed one event at a time in ticket order.

use super::address_table::{AddressTable, Packed};
use super::groups::Groups;
use super::transients::{Pending, Transients};
use crate::hotpath::channel::Sink;
use crate::hotpath::event::{Api, Event, EventKind, Kind, Space, INTERNAL_FREE, LATE_FREE};
use crate::spans::Spans;

use crate::util::FxMap;

impl Sink for &mut Collector {
    #[inline(always)]
    fn apply(&mut self, ev: Event) {
        // A transient (nearly every event of a loop that allocates and frees at once)
        // takes a few additions here, inlined in the drain; the rest the general step.
        if ev.kind == EventKind::Transient {
            self.totals.events += 1;
            self.count_transient(&ev);
        } else {
            Collector::apply(self, &ev);
        }
    }
    #[inline(always)]
    fn prefetch(&self, addr: u64) {
        Collector::prefetch(self, addr);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveBlock {
    pub size: u64,
    /// Index into `Collector::groups` (one per stack and api).
    pub group: u32,
    /// The process generation that allocated it (`Collector::generation`); an older
    /// one means the parent allocated it before this (forked) process existed.
    pub generation: u16,
    /// The checkpoint region it was allocated in (`Collector::mark`, 31 bits): a
    /// checkpoint counts the blocks of the current region (`leaktrace_mark`).
    pub mark: u32,
    /// Never a leak, as LeakSanitizer's ignored objects: `__lsan_ignore_object`, or
    /// allocated between `__lsan_disable` and `__lsan_enable`. Its contents keep what
    /// they point to reachable.
    pub ignored: bool,
}

pub const MARK_MASK: u32 = (1 << 31) - 1;

/// A live block in one word of the table's `VALUE_BITS` (52), as nearly all are: size
/// below 16 MiB (24 bits), group index below 2^24 - 1 (24 bits), process generation below
/// 4 (2 bits), checkpoint region 0 or 1, ignored. Any other block is kept aside by the
/// table (`AddressTable::wide`), in full.
const SIZE_BITS: u32 = 24;
const GROUP_BITS: u32 = 24;
const GENERATION_SHIFT: u32 = SIZE_BITS + GROUP_BITS;
const _: () = assert!(GENERATION_SHIFT + 4 == super::address_table::VALUE_BITS);

impl Packed for LiveBlock {
    fn pack(self) -> Option<u64> {
        let fits = self.size < 1 << SIZE_BITS && self.group < (1 << GROUP_BITS) - 1 && self.generation < 4 && self.mark < 2;
        // The group's bound keeps the word from being all ones (the table's mark).
        fits.then_some(
            self.size
                | (self.group as u64) << SIZE_BITS
                | (self.generation as u64) << GENERATION_SHIFT
                | (self.mark as u64) << (GENERATION_SHIFT + 2)
                | (self.ignored as u64) << (GENERATION_SHIFT + 3),
        )
    }

    fn unpack(w: u64) -> LiveBlock {
        LiveBlock {
            size: w & ((1 << SIZE_BITS) - 1),
            group: ((w >> SIZE_BITS) & ((1 << GROUP_BITS) - 1)) as u32,
            generation: ((w >> GENERATION_SHIFT) & 3) as u16,
            mark: ((w >> (GENERATION_SHIFT + 2)) & 1) as u32,
            ignored: (w >> (GENERATION_SHIFT + 3)) & 1 != 0,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupStats {
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub total_allocs: u64,
    pub total_bytes: u64,
    pub peak_live_bytes: u64,
    /// The process generation these figures belong to; older ones count as zero (a
    /// forked child starts its statistics afresh without writing to every group, which
    /// would copy every page of the table out of the parent's).
    pub generation: u16,
    /// How its live bytes moved from report to report.
    pub trend: Trend,
    /// Its live bytes when the timeline last took the changes (`take_changes`), and
    /// whether it is in the list of groups changed since.
    pub pointed_bytes: u64,
    pub changed: bool,
}

/// A group whose live bytes moved since the timeline last looked (`take_changes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub stack: u32,
    pub api: Api,
    pub before: u64,
    pub now: u64,
}

/// A group's live bytes across reports: where they started, and how many steps went up
/// and down. A leak spread over many small stacks is found by these, whatever the
/// stack's size (`report::timeline` follows the ones that grow steadily).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Trend {
    pub seen: bool,
    pub base: u64,
    pub last: u64,
    pub steps: u16,
    pub ups: u16,
    pub downs: u16,
}

/// Growth below this many bytes is not called steady.
pub const STEADY_MIN_BYTES: u64 = 1024;

impl Trend {
    /// One more report: the group holds `now` live bytes.
    pub fn step(&mut self, now: u64) {
        if !self.seen {
            if now > 0 {
                (self.seen, self.base, self.last) = (true, now, now);
            }
            return;
        }
        self.steps = self.steps.saturating_add(1);
        if now > self.last {
            self.ups = self.ups.saturating_add(1);
        } else if now < self.last {
            self.downs = self.downs.saturating_add(1);
        }
        self.last = now;
    }

    /// Grew at nearly every step (the CLI's rule: 70% of the steps up, at most 15%
    /// down) over at least three steps, by at least `STEADY_MIN_BYTES`.
    pub fn steady(&self) -> bool {
        let (steps, ups, downs) = (u64::from(self.steps), u64::from(self.ups), u64::from(self.downs));
        steps >= 3 && leaktrace_common::growth::mostly_rising(steps, ups, downs) && self.last >= self.base.saturating_add(STEADY_MIN_BYTES)
    }

    pub fn growth(&self) -> u64 {
        self.last.saturating_sub(self.base)
    }
}

/// Totals of one kind of memory (host, device, pinned, ...).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KindTotals {
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub total_allocs: u64,
    pub total_frees: u64,
    pub peak_live_bytes: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Indexed by `Kind::index`.
    pub kinds: [KindTotals; Kind::ALL.len()],
    pub inherited_live_bytes: u64,
    pub inherited_live_blocks: u64,
    pub inherited_frees: u64,
    /// Frees of addresses never seen allocated (allocated before tracking started, or by
    /// the library itself): ignored.
    pub unknown_frees: u64,
    /// Blocks of the program's freed on the library's own threads or inside its
    /// untracked steps (`event::INTERNAL_FREE`): the C library freeing a dead thread's
    /// dynamic TLS there.
    pub frees_on_library_threads: u64,
    pub events: u64,
    /// `EventKind::Transient` events: a free merged with its allocation's event.
    pub merged_frees: u64,
}

impl Totals {
    pub fn kind(&self, k: Kind) -> &KindTotals {
        &self.kinds[k.index()]
    }

    pub fn host(&self) -> &KindTotals {
        self.kind(Kind::Host)
    }
}

/// What a report reads of every live group: its identity, its live figures and its
/// growth, 24 bytes (after `import torch` a report copies ~520k of them, 12.5 MB; 32
/// bytes a group were 16.7 MB, which every periodic report added to the tracer's memory
/// while it ran). A listed group's other figures come from the collector by its key
/// (`Collector::details`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct GroupSnapshot {
    pub stack: u32,
    /// Its growth since the timeline first saw it (`Trend::growth`) in KiB, rounded up
    /// (at most `u32::MAX`), when it grows steadily (`Trend::steady`), else 0. It only
    /// ranks the growing groups a timeline follows.
    pub steady_growth_kib: u32,
    pub live_bytes: u64,
    /// Live blocks, the api and the CUDA device.
    packed: ApiWord<BLOCK_BITS>,
}

/// A count or size in the low `LOW` bits of a word (clamped to fit), an api's 8 bits
/// above it and a CUDA device's code (`device_code`: the ordinal plus one, 0 for none,
/// 9 bits) above those: `GroupSnapshot`'s live blocks, `LiveEntry`'s size.
#[derive(Clone, Copy, PartialEq, Eq)]
struct ApiWord<const LOW: u32>(u64);

impl<const LOW: u32> ApiWord<LOW> {
    fn new(low: u64, api: Api, device: Option<u8>) -> Self {
        const { assert!(LOW + 8 + 9 <= 64) };
        ApiWord(low.min((1 << LOW) - 1) | (api as u64) << LOW | crate::hotpath::event::device_code(device) << (LOW + 8))
    }

    #[inline]
    fn low(self) -> u64 {
        self.0 & ((1 << LOW) - 1)
    }

    #[inline]
    fn api(self) -> Api {
        Api::from_bits((self.0 >> LOW) as u8)
    }

    #[inline]
    fn device(self) -> Option<u8> {
        crate::hotpath::event::device_of_code(self.0 >> (LOW + 8))
    }
}

/// Bits of `GroupSnapshot::packed` for the live blocks: 2^40 live blocks of one group
/// would be 32 TiB of malloc's smallest chunks (and a CUDA allocation is at least 256
/// bytes), so the count is exact for any process.
const BLOCK_BITS: u32 = 40;

impl GroupSnapshot {
    pub fn new(stack: u32, api: Api, device: Option<u8>, steady_growth_kib: u32, live_bytes: u64, live_blocks: u64) -> GroupSnapshot {
        GroupSnapshot { stack, steady_growth_kib, live_bytes, packed: ApiWord::new(live_blocks, api, device) }
    }

    pub fn api(&self) -> Api {
        self.packed.api()
    }

    /// CUDA device ordinal, for device-side groups where it is known.
    pub fn device(&self) -> Option<u8> {
        self.packed.device()
    }

    pub fn live_blocks(&self) -> u64 {
        self.packed.low()
    }

    pub fn steady(&self) -> bool {
        self.steady_growth_kib > 0
    }
}

impl std::fmt::Debug for GroupSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupSnapshot")
            .field("stack", &self.stack)
            .field("api", &self.api())
            .field("device", &self.device())
            .field("steady_growth_kib", &self.steady_growth_kib)
            .field("live_bytes", &self.live_bytes)
            .field("live_blocks", &self.live_blocks())
            .finish()
    }
}

const _: () = assert!(std::mem::size_of::<GroupSnapshot>() == 24);

/// `GroupSnapshot::steady_growth_kib` of a trend's growth in bytes.
pub fn growth_kib(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

/// A listed group's figures besides its live ones, read from the collector for the few
/// groups a report lists (`Collector::details`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupDetails {
    pub peak_live_bytes: u64,
    pub total_allocs: u64,
    pub total_bytes: u64,
}

/// In `Collector::group_by_stack`: the stack's group is retired; the rest of the word is
/// its token (`Groups::retire`: a record's index, or the group itself).
const RETIRED: u32 = 1 << 31;

/// A group's identity: one per call stack, entry point and device.
pub type GroupKey = (u32, Api, Option<u8>);

/// The group of the blocks live before tracking began (`adopt_before_start`): no stack.
const BEFORE_START: GroupKey = (u32::MAX, Api::Malloc, None);

/// Pool allocations (`cudaMallocAsync` and friends) belong to a memory pool, not to a
/// context: a context reset leaves them to the pool.
fn is_pool(api: Api) -> bool {
    matches!(api, Api::CudaMallocAsync | Api::CudaMallocFromPoolAsync | Api::CuMemAllocAsync | Api::CuMemAllocFromPoolAsync)
}

/// One outstanding block, for the pointer scan: 24 bytes (the final report holds one
/// per live block beside the scan's own tables: 660k in `import torch`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LiveEntry {
    pub addr: u64,
    /// The size (no block reaches 2^47 bytes: that is all of user space without 5-level
    /// page tables), the api and the device.
    word: ApiWord<ENTRY_SIZE_BITS>,
    pub stack: u32,
    /// Its checkpoint region (31 bits, see `LiveBlock`) and, in the top bit, whether
    /// it is ignored.
    region: u32,
}

const ENTRY_SIZE_BITS: u32 = 47;
const ENTRY_IGNORED: u32 = 1 << 31;

impl LiveEntry {
    pub fn new(addr: u64, size: u64, mark: u32, ignored: bool, stack: u32, api: Api, device: Option<u8>) -> LiveEntry {
        LiveEntry { addr, word: ApiWord::new(size, api, device), stack, region: (mark & MARK_MASK) | if ignored { ENTRY_IGNORED } else { 0 } }
    }

    #[inline]
    pub fn size(&self) -> u64 {
        self.word.low()
    }

    #[inline]
    pub fn api(&self) -> Api {
        self.word.api()
    }

    #[inline]
    pub fn device(&self) -> Option<u8> {
        self.word.device()
    }

    /// Its checkpoint region.
    #[inline]
    pub fn mark(&self) -> u32 {
        self.region & MARK_MASK
    }

    #[inline]
    pub fn ignored(&self) -> bool {
        self.region & ENTRY_IGNORED != 0
    }
}

impl std::fmt::Debug for LiveEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveEntry")
            .field("addr", &self.addr)
            .field("size", &self.size())
            .field("mark", &self.mark())
            .field("ignored", &self.ignored())
            .field("stack", &self.stack)
            .field("api", &self.api())
            .field("device", &self.device())
            .finish()
    }
}

/// What the pointer scan classifies, and, in a forked child, the readable blocks it
/// inherited (the parent's: not classified, but they may point to the child's).
#[derive(Clone, Debug, Default)]
pub struct ScanInput {
    /// Sorted by address.
    pub blocks: Vec<LiveEntry>,
    /// `(start, size)`, sorted by start.
    pub inherited: Spans,
}

/// For a sorted list of inherited blocks, in order: false for those whose address is in
/// `freed` (sorted), each of which names one of them.
fn still_live(freed: &[u64]) -> impl FnMut(&(u64, u64)) -> bool + '_ {
    let mut gone = freed.iter().peekable();
    move |&(addr, _)| {
        while gone.next_if(|&&f| f < addr).is_some() {}
        gone.next_if(|&&f| f == addr).is_none()
    }
}

#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub totals: Totals,
    /// Groups with live blocks, largest first (once sorted).
    pub groups: Vec<GroupSnapshot>,
}

impl Snapshot {
    /// Largest live bytes first, then most blocks; ties by stack, api and device, so the
    /// order is total and an unstable sort gives the one answer.
    fn order(a: &GroupSnapshot, b: &GroupSnapshot) -> std::cmp::Ordering {
        b.live_bytes
            .cmp(&a.live_bytes)
            .then(b.live_blocks().cmp(&a.live_blocks()))
            .then(a.stack.cmp(&b.stack))
            .then(a.api().cmp(&b.api()))
            .then(a.device().cmp(&b.device()))
    }

    pub fn sort(&mut self) {
        self.groups.sort_unstable_by(Self::order);
    }

    /// Orders the groups as far as a periodic report reads them: the `k` largest host
    /// groups and the `k` largest CUDA groups come first, together in `sort`'s order;
    /// the others follow in no order. So the first `k` groups of each class met from the
    /// front, and the first groups overall, are what a full sort would give. After
    /// `import torch` (600k groups) `perf` put the full sort at ~25 ms of the
    /// collector's core per report, this at ~2 ms.
    pub fn sort_top(&mut self, k: usize) {
        let v = &mut self.groups;
        if k == 0 || v.len() <= 4 * k {
            v.sort_unstable_by(Self::order);
            return;
        }
        // [host | CUDA], then each class's k largest to its front.
        let hosts = partition_in_place(v, |g| g.api().kind() == Kind::Host);
        let host_top = select_first(&mut v[..hosts], k);
        let cuda_top = select_first(&mut v[hosts..], k);
        // [host top | host rest | CUDA top | CUDA rest] -> [host top | CUDA top | ...].
        let host_rest = hosts - host_top;
        if host_rest >= cuda_top {
            let (front, back) = v.split_at_mut(hosts);
            front[host_top..host_top + cuda_top].swap_with_slice(&mut back[..cuda_top]);
        } else {
            v[host_top..hosts + cuda_top].rotate_left(host_rest);
        }
        v[..host_top + cuda_top].sort_unstable_by(Self::order);
    }
}

/// Moves the elements for which `first` holds to the front, in no order; their count.
fn partition_in_place<T>(v: &mut [T], first: impl Fn(&T) -> bool) -> usize {
    let mut n = 0;
    for i in 0..v.len() {
        if first(&v[i]) {
            if i != n {
                v.swap(i, n);
            }
            n += 1;
        }
    }
    n
}

/// Moves the `k` first groups in `Snapshot::order` to the front of `v`, in no order;
/// how many that is (all of `v` when it holds no more).
fn select_first(v: &mut [GroupSnapshot], k: usize) -> usize {
    if v.len() > k {
        v.select_nth_unstable_by(k, Snapshot::order);
        k
    } else {
        v.len()
    }
}

#[derive(Default)]
pub struct Collector {
    /// Heap blocks by address (the hot map: one entry per malloc).
    live: AddressTable<LiveBlock>,
    /// Everything CUDA, by key space and address or handle.
    cuda_live: FxMap<(Space, u64), LiveBlock>,
    /// Per group statistics; a free finds its group by index, without hashing.
    groups: Groups,
    /// The groups `group_by_stack` does not point to (and some it does): see `group_of`.
    group_index: FxMap<GroupKey, u32>,
    /// Stack id (its `shared_index`, which a native stack shares with its first Python
    /// child) -> its most recent group + 1: a stack is nearly always allocated from with
    /// one API on one device, so this answers most lookups without hashing. Or
    /// `RETIRED` and its retired group's token (`retire_if_idle`, `Groups::retire`).
    group_by_stack: Vec<u32>,
    /// One past the highest place of `group_by_stack` ever written: the places past it
    /// are 0, and not read. A place read before its page was written maps the zero page,
    /// and the write that follows replaces it with a TLB flush on every CPU the process
    /// runs on (2,105 of `import torch`'s 22,579; stack ids come in order, so nearly
    /// every new page was first read).
    by_stack_written: usize,
    /// Blocks between a release (realloc, or a CUDA free that may fail) and its
    /// outcome, by thread and key space.
    realloc_in_flight: FxMap<(u32, Space), (u64, LiveBlock)>,
    totals: Totals,
    /// How many fork boundaries this process image is below the traced program's first
    /// process. A chain of 65,536 nested forks would wrap it.
    generation: u16,
    /// The current checkpoint region: bumped by each `Mark` event.
    mark: u32,
    /// In a forked child: the groups whose statistics this generation started afresh,
    /// the only ones with anything live here. A snapshot looks at these instead of every
    /// group (a PyTorch DataLoader worker inherits 880k groups and touches a few
    /// thousand).
    touched: Vec<u32>,
    /// The groups whose live bytes moved since `take_changes` last ran: a timeline point
    /// between reports reads these instead of every group (a training step changes a few
    /// thousand of the 600k groups that `import torch` leaves).
    changed: Vec<u32>,
    /// In a forked child, once `gather_inherited` ran: what the exit scan needs without
    /// walking the whole heap table (`live_blocks`).
    prepared: Option<Prepared>,
    /// The length of `changed` at which `retire_idle_changed` runs next (at least
    /// `RETIRE_PASS_MIN`).
    retire_at: usize,
    /// Transients not yet applied to their groups, summed by key (see `transients`).
    transients: Transients,
}

/// The most room the list of changed groups keeps once taken (256 KiB).
const KEEP_CHANGED: usize = 1 << 16;

/// `Collector::retire_idle_changed` runs once this many groups changed, at least (in
/// the unit tests, soon, so that every test of the collector goes through it).
const RETIRE_PASS_MIN: usize = if cfg!(test) { 8 } else { 1 << 16 };

/// A forked child's blocks, kept apart from the moment the collector thread gathered the
/// inherited ones (a DataLoader worker inherits 700k blocks and allocates a hundred; the
/// gather and sort took 40–75 ms of every worker's exit, on the parent's critical path).
#[derive(Default)]
struct Prepared {
    /// The inherited blocks the scan reads (heap and page-locked memory), sorted by the
    /// collector thread outside the lock; `None` until then.
    inherited: Option<Spans>,
    /// Addresses of those blocks freed since the gather.
    freed: Vec<u64>,
    /// The child's own live heap blocks.
    own_heap: AddressTable<LiveBlock>,
}

impl Collector {
    pub fn new() -> Collector {
        Collector::default()
    }

    pub fn totals(&self) -> Totals {
        self.totals
    }

    /// On the collector's turns during a teardown (the Python interpreter's exit, and
    /// the libraries' destructors after it): the live table follows the frees down
    /// (`AddressTable::halve_if_sparse`) while the process's peak is still ahead.
    pub fn compact_going(&mut self) {
        self.live.halve_if_sparse();
    }

    /// Between drains: the block tables give back what a peak of live blocks left
    /// (`AddressTable::shrink_if_sparse`).
    pub fn compact(&mut self) {
        self.live.shrink_if_sparse();
        if let Some(p) = self.prepared.as_mut() {
            p.own_heap.shrink_if_sparse();
        }
    }

    /// The group of `key`, made if new. Every group is found through `group_by_stack`
    /// (the slot of its stack points to it) or `group_index`: a group enters the hash map
    /// only when another group of its stack takes the slot. `import torch` makes 880k
    /// groups, nearly all of a stack never seen before; a hash map entry for each was a
    /// cache miss or two on the collector thread, a fifth of its time there.
    fn group_of(&mut self, key: GroupKey) -> u32 {
        // Stack ids are dense (handed out in order, `shared_index`): the vector stays
        // proportional to the stack table. A native stack and its first Python child
        // share a slot, told apart by the group's key. Larger ones (never in practice)
        // go through the hash map only.
        let stack = crate::hotpath::stacks::shared_index(key.0);
        if stack >= 1 << 24 {
            return self.group_of_hashed(key);
        }
        if self.group_by_stack.len() <= stack {
            crate::util::grow_zeroed(&mut self.group_by_stack, (stack + 1).next_power_of_two());
        }
        let mut slot = if stack < self.by_stack_written { self.group_by_stack[stack] } else { 0 };
        if slot & RETIRED != 0 {
            // The stack's group was retired: back, with its totals, whichever key comes.
            let g = self.groups.revive(slot & !RETIRED, stack);
            slot = g + 1;
            self.group_by_stack[stack] = slot;
        }
        if slot != 0 && self.groups.key(slot - 1) == key {
            return slot - 1;
        }
        let idx = if slot == 0 {
            // No group of this stack exists: none to look for.
            self.new_group(key)
        } else {
            let displaced = slot - 1;
            self.group_index.entry(self.groups.key(displaced)).or_insert(displaced);
            self.group_of_hashed(key)
        };
        self.group_by_stack[stack] = idx + 1;
        self.by_stack_written = self.by_stack_written.max(stack + 1);
        idx
    }

    fn group_of_hashed(&mut self, key: GroupKey) -> u32 {
        if let Some(&idx) = self.group_index.get(&key) {
            return idx;
        }
        // A new group may take a retired one's index: not necessarily the next.
        let idx = self.new_group(key);
        self.group_index.insert(key, idx);
        idx
    }

    fn new_group(&mut self, key: GroupKey) -> u32 {
        self.groups.push(key)
    }

    fn inherited(&self, block: &LiveBlock) -> bool {
        block.generation != self.generation
    }

    /// Applies `f` to a group's statistics in this process generation.
    #[inline]
    fn update_group(&mut self, group: u32, f: impl FnOnce(&mut GroupStats)) {
        let generation = self.generation;
        let touched = &mut self.touched;
        self.groups.update(group, |stats| {
            if stats.generation != generation {
                *stats = GroupStats { generation, ..GroupStats::default() };
                touched.push(group);
            }
            f(stats)
        });
    }

    /// Puts `group` in the list of changed groups, once.
    #[inline]
    fn note_changed(&mut self, group: u32) {
        if self.groups.mark_changed(group) {
            self.changed.push(group);
        }
    }

    /// Between timeline points, when the list of changed groups grew long (between
    /// events: see `apply`): retires the
    /// groups in it that were made and emptied since the last point (nothing to tell
    /// the timeline: no bytes then, none now) and drops them from the list. While
    /// `import torch` runs, points are seconds apart and ~700k groups come and go
    /// between two of them. The next pass waits for the list to double.
    #[cold]
    fn retire_idle_changed(&mut self) {
        let mut changed = std::mem::take(&mut self.changed);
        if self.generation == 0 {
            let in_flight: Vec<u32> = self.realloc_in_flight.values().map(|(_, b)| b.group).collect();
            changed.retain(|&g| in_flight.contains(&g) || !self.retire_if_idle(g));
        }
        self.retire_at = (2 * changed.len()).max(RETIRE_PASS_MIN);
        self.changed = changed;
    }

    /// The groups whose live bytes moved since the last call, with their live bytes then
    /// and now (into `out`, emptied first). The totals of these changes, added to what
    /// the last call's caller summed, give every group's live bytes now.
    pub fn take_changes(&mut self, out: &mut Vec<Change>) {
        out.clear();
        self.drain_changed(|c| out.push(c));
    }

    /// `take_changes` for a caller that sums every group afresh (a report's snapshot).
    pub fn settle_changes(&mut self) {
        self.drain_changed(|_| {});
    }

    /// Empties the list of changed groups, giving each that moved to `moved`; their
    /// bytes now are the next call's "before".
    fn drain_changed(&mut self, mut moved: impl FnMut(Change)) {
        // A group of transients only is in the list once they are applied.
        self.settle_transients();
        let changed = std::mem::take(&mut self.changed);
        // Blocks between a realloc's release and its outcome name their groups.
        let in_flight: Vec<u32> = self.realloc_in_flight.values().map(|(_, b)| b.group).collect();
        for &g in &changed {
            let (stack, api, _) = self.groups.key(g);
            self.groups.update(g, |stats| {
                stats.changed = false;
                if stats.pointed_bytes != stats.live_bytes {
                    moved(Change { stack, api, before: stats.pointed_bytes, now: stats.live_bytes });
                    stats.pointed_bytes = stats.live_bytes;
                }
            });
            if !in_flight.contains(&g) {
                self.retire_if_idle(g);
            }
        }
        self.changed = changed;
        self.changed.clear();
        // Room for a training loop's changes between points, not for an import's: one
        // point in `import torch` took 262k (the list's 2 MB stayed resident to the
        // process's peak at its exit).
        self.changed.shrink_to(KEEP_CHANGED);
        self.retire_at = RETIRE_PASS_MIN;
    }

    /// Retires group `g` (`Groups::retire`) if it holds nothing and only its stack's
    /// slot refers to it. Only in the first process: a forked child's inherited blocks
    /// name the parent's groups, whatever their figures here.
    fn retire_if_idle(&mut self, g: u32) -> bool {
        if self.generation != 0 {
            return false;
        }
        let key = self.groups.key(g);
        let stack = crate::hotpath::stacks::shared_index(key.0);
        if self.group_by_stack.get(stack) != Some(&(g + 1)) || (!self.group_index.is_empty() && self.group_index.get(&key) == Some(&g)) {
            return false;
        }
        match self.groups.retire(g, self.generation) {
            Some(r) => {
                self.group_by_stack[stack] = RETIRED | r;
                true
            }
            None => false,
        }
    }

    fn kind_of(&self, block: &LiveBlock) -> Kind {
        self.groups.key(block.group).1.kind()
    }

    /// Whether the exit scan reads a block of `space` when a forked child inherited it:
    /// heap blocks and page-locked host memory are readable, device and managed memory
    /// are not.
    fn readable_when_inherited(&self, space: Space, block: &LiveBlock) -> bool {
        space == Space::Heap || (space == Space::Cuda && self.kind_of(block) == Kind::Pinned)
    }

    /// The pointer scan's entry for the live block `b` at `addr`.
    /// The live sampled Python objects (`Space::Python`), as entries (`size` is the
    /// bytes each stands for, not the object's).
    pub fn python_samples(&self) -> Vec<LiveEntry> {
        self.cuda_live.iter().filter(|((space, _), _)| *space == Space::Python).map(|(&(_, addr), b)| self.live_entry(addr, b)).collect()
    }

    fn live_entry(&self, addr: u64, b: &LiveBlock) -> LiveEntry {
        let (stack, api, device) = self.groups.key(b.group);
        LiveEntry::new(addr, b.size, b.mark, b.ignored, stack, api, device)
    }

    /// `block` is live at `addr`; `new`: a new allocation, which its group also counts
    /// (a block back from a failed realloc, or adopted, is not).
    fn add_live(&mut self, space: Space, addr: u64, block: LiveBlock, new: bool) {
        let old = match space {
            Space::Heap => self.live.insert(addr, block),
            _ => self.cuda_live.insert((space, addr), block),
        };
        if let Some(old) = old {
            // A free we never saw (made from an untracked context): forget the old block.
            self.note_removed(space, addr, &old);
            self.remove_accounting(&old);
        }
        if self.prepared.is_some() {
            if self.inherited(&block) {
                // An inherited block back from a failed realloc: rare; the exit scan
                // gathers everything again instead of un-freeing it.
                self.prepared = None;
            } else if let (Space::Heap, Some(p)) = (space, self.prepared.as_mut()) {
                p.own_heap.insert(addr, block);
            }
        }
        if self.inherited(&block) {
            self.totals.inherited_live_bytes += block.size;
            self.totals.inherited_live_blocks += 1;
            return;
        }
        // The group's live bytes change: its transients first (their peak is over these).
        let key = self.groups.key(block.group);
        self.settle_group(&key);
        let kind = key.1.kind();
        let stepped =
            if new { self.groups.alloc_live(block.group, self.generation, block.size) } else { self.groups.add_live(block.group, self.generation, block.size) };
        if !stepped {
            self.update_group(block.group, |g| {
                if new {
                    g.total_allocs += 1;
                    g.total_bytes += block.size;
                }
                g.live_bytes += block.size;
                g.live_blocks += 1;
                g.peak_live_bytes = g.peak_live_bytes.max(g.live_bytes);
            });
        }
        self.note_changed(block.group);
        let t = &mut self.totals.kinds[kind.index()];
        t.live_bytes += block.size;
        t.live_blocks += 1;
        t.peak_live_bytes = t.peak_live_bytes.max(t.live_bytes);
    }

    fn remove_accounting(&mut self, block: &LiveBlock) {
        if self.inherited(block) {
            self.totals.inherited_live_bytes -= block.size;
            self.totals.inherited_live_blocks -= 1;
            return;
        }
        // The group's live bytes change: its transients first (their peak is over these).
        let key = self.groups.key(block.group);
        self.settle_group(&key);
        let kind = key.1.kind();
        if !self.groups.remove_live(block.group, self.generation, block.size) {
            self.update_group(block.group, |g| {
                g.live_bytes -= block.size;
                g.live_blocks -= 1;
            });
        }
        self.note_changed(block.group);
        let t = &mut self.totals.kinds[kind.index()];
        t.live_bytes -= block.size;
        t.live_blocks -= 1;
    }

    fn count_free(&mut self, block: &LiveBlock) {
        if self.inherited(block) {
            self.totals.inherited_frees += 1;
        } else {
            let kind = self.kind_of(block);
            self.totals.kinds[kind.index()].total_frees += 1;
        }
    }

    fn take_live(&mut self, space: Space, addr: u64) -> Option<LiveBlock> {
        let block = match space {
            Space::Heap => self.live.remove(addr)?,
            _ => self.cuda_live.remove(&(space, addr))?,
        };
        self.note_removed(space, addr, &block);
        self.remove_accounting(&block);
        Some(block)
    }

    /// Keeps `prepared` in step with a block leaving the live set.
    fn note_removed(&mut self, space: Space, addr: u64, block: &LiveBlock) {
        if self.prepared.is_none() {
            return;
        }
        let inherited = self.inherited(block);
        let scanned_inherited = inherited && self.readable_when_inherited(space, block);
        let Some(p) = self.prepared.as_mut() else { return };
        if scanned_inherited {
            p.freed.push(addr);
        } else if !inherited && space == Space::Heap {
            p.own_heap.remove(addr);
        }
    }

    /// In a forked child, the first time: the inherited blocks the exit scan reads
    /// (unsorted), and from now on the child's own heap blocks kept apart, so that
    /// `live_blocks` need not walk the whole table. The caller sorts the list without
    /// holding the collector and hands it back to `install_inherited` with the returned
    /// generation. `None` in the first process, or when already done.
    pub fn gather_inherited(&mut self) -> Option<(Spans, u16)> {
        if self.generation == 0 || self.prepared.is_some() {
            return None;
        }
        let mut inherited = Spans::new();
        inherited.reserve_exact(self.totals.inherited_live_blocks as usize);
        let mut own_heap = AddressTable::new();
        for (addr, b) in self.live.iter() {
            if self.inherited(&b) {
                inherited.push(addr, b.size);
            } else {
                own_heap.insert(addr, b);
            }
        }
        for (&(space, addr), b) in self.cuda_live.iter() {
            if self.inherited(b) && self.readable_when_inherited(space, b) {
                inherited.push(addr, b.size);
            }
        }
        self.prepared = Some(Prepared { inherited: None, freed: Vec::new(), own_heap });
        Some((inherited, self.generation))
    }

    /// The list `gather_inherited` returned, sorted by address. Dropped if the process
    /// forked again (another generation) or the preparation was abandoned meanwhile.
    pub fn install_inherited(&mut self, sorted: Spans, generation: u16) {
        if generation != self.generation {
            return;
        }
        if let Some(p) = self.prepared.as_mut() {
            p.inherited = Some(sorted);
        }
    }

    /// Starts loading what applying an event on host address `addr` will touch.
    #[inline]
    pub fn prefetch(&self, addr: u64) {
        self.live.prefetch(addr);
    }

    pub fn apply(&mut self, ev: &Event) {
        self.totals.events += 1;
        let space = ev.api.space();
        match ev.kind {
            EventKind::Alloc => {
                if ev.api.is_realloc() {
                    if let Some((_, old)) = self.realloc_in_flight.remove(&(ev.tid, Space::Heap)) {
                        self.count_free(&old);
                    }
                }
                let size = ev.bytes();
                let group = self.group_of((ev.stack, ev.api, ev.device()));
                let block = LiveBlock { size, group, generation: self.generation, mark: self.mark, ignored: false };
                self.totals.kinds[ev.api.kind().index()].total_allocs += 1;
                self.add_live(space, ev.addr, block, true);
            }
            EventKind::Free => match self.take_live(space, ev.addr) {
                Some(block) => {
                    self.count_free(&block);
                    if ev.stack == INTERNAL_FREE {
                        self.totals.frees_on_library_threads += 1;
                    }
                }
                None if ev.stack == LATE_FREE || ev.stack == INTERNAL_FREE => {}
                None => self.totals.unknown_frees += 1,
            },
            EventKind::ReallocRelease => {
                if let Some(block) = self.take_live(space, ev.addr) {
                    if ev.stack == INTERNAL_FREE {
                        self.totals.frees_on_library_threads += 1;
                    }
                    self.realloc_in_flight.insert((ev.tid, space), (ev.addr, block));
                }
            }
            EventKind::ReallocRestore => {
                if let Some((addr, block)) = self.realloc_in_flight.remove(&(ev.tid, space)) {
                    self.add_live(space, addr, block, false);
                }
            }
            EventKind::ReallocFreed => {
                if let Some((_, block)) = self.realloc_in_flight.remove(&(ev.tid, space)) {
                    self.count_free(&block);
                }
            }
            EventKind::Transient => self.count_transient(ev),
            EventKind::Mark => self.mark = (self.mark + 1) & MARK_MASK,
            EventKind::Ignore => self.ignore(ev.addr),
        }
        // After the event, never inside it: a realloc's release takes the block's
        // accounting before the block enters `realloc_in_flight`, and a group retired in
        // between would be named by a block in flight.
        if self.changed.len() >= self.retire_at.max(RETIRE_PASS_MIN) {
            self.retire_idle_changed();
        }
    }

    /// An allocation its own thread freed before this event was taken from its ring
    /// (`EventKind::Transient`): an allocation and a free in the totals and its group's,
    /// its bytes live for a moment in the peaks, never in the live set. The totals take
    /// it now; its group, with the other transients of its key, before anything reads
    /// the group or its live bytes change (`transients`).
    #[inline(always)]
    fn count_transient(&mut self, ev: &Event) {
        let size = ev.bytes();
        if let Some(other) = self.transients.add((ev.stack, ev.api, ev.device()), size) {
            self.apply_transients(other);
            // Between events, as in `apply`: the group may have joined the list of changes.
            if self.changed.len() >= self.retire_at.max(RETIRE_PASS_MIN) {
                self.retire_idle_changed();
            }
        }
        self.totals.merged_frees += 1;
        let t = &mut self.totals.kinds[ev.api.kind().index()];
        t.total_allocs += 1;
        t.total_frees += 1;
        t.peak_live_bytes = t.peak_live_bytes.max(t.live_bytes + size);
    }

    /// A key's transients, into its group: each counts as allocated, the largest's bytes
    /// live for a moment over the group's live bytes (unchanged since they came). The
    /// group is noted as changed, as an allocation's would be, so that a group of such
    /// allocations only is retired like any other that holds nothing.
    #[cold]
    #[inline(never)]
    fn apply_transients(&mut self, p: Pending) {
        let group = self.group_of(p.key);
        let stepped = p.count == 1 && self.groups.count_transient(group, self.generation, p.bytes);
        if !stepped {
            self.update_group(group, |g| {
                g.total_allocs += p.count;
                g.total_bytes += p.bytes;
                g.peak_live_bytes = g.peak_live_bytes.max(g.live_bytes + p.largest);
            });
        }
        self.note_changed(group);
    }

    /// Applies the transients of `key`'s group before its live bytes change.
    #[inline(always)]
    fn settle_group(&mut self, key: &GroupKey) {
        if let Some(p) = self.transients.take(key) {
            self.apply_transients(p);
        }
    }

    /// Applies every transient counted so far to its group: called before the groups'
    /// figures are read (`agent::consumer::drain_into` does after every drain but the
    /// collector thread's own turns).
    pub fn settle_transients(&mut self) {
        while let Some(p) = self.transients.take_any() {
            self.apply_transients(p);
        }
    }

    /// The current checkpoint region (see `LiveBlock::mark`).
    pub fn mark(&self) -> u32 {
        self.mark
    }

    /// Marks the live heap block at `addr` ignored; an address that is not the start
    /// of one is left alone (LeakSanitizer's `__lsan_ignore_object` says so and does
    /// nothing else).
    fn ignore(&mut self, addr: u64) {
        if let Some(mut b) = self.live.get(addr) {
            b.ignored = true;
            self.live.insert(addr, b);
            if let Some(p) = self.prepared.as_mut() {
                if p.own_heap.get(addr).is_some() {
                    p.own_heap.insert(addr, b);
                }
            }
        }
    }

    /// A CUDA context was destroyed or its device reset: every context-bound block of
    /// `device` (device, managed, page-locked memory and registrations; not VMM or pool
    /// memory) is gone. Returns how many blocks that released.
    pub fn device_reset(&mut self, device: u8) -> u64 {
        let gone: Vec<(Space, u64)> = self
            .cuda_live
            .iter()
            .filter(|((space, _), b)| {
                let (_, api, dev) = self.groups.key(b.group);
                space.bound_to_context() && dev == Some(device) && !is_pool(api)
            })
            .map(|(k, _)| *k)
            .collect();
        for (space, addr) in &gone {
            if let Some(block) = self.take_live(*space, *addr) {
                self.count_free(&block);
            }
        }
        gone.len() as u64
    }

    /// A process switched on from standby (`agent::standby`): the heap blocks that were
    /// live before tracking began (`scan::glibc_heap`), kept as a forked child keeps its
    /// parent's: of an older generation than everything recorded from now on, so never
    /// classified nor counted in a group, their frees harmless, and read by the scan
    /// (`ScanInput::inherited`). An address tracked already (allocated since tracking
    /// began) stays the tracked block. Everything live now becomes that older
    /// generation (`fork_boundary`).
    pub fn adopt_before_start(&mut self, chunks: &[(u64, u64)]) {
        let group = self.group_of_hashed(BEFORE_START);
        let generation = self.generation;
        for &(addr, size) in chunks {
            if self.live.get(addr).is_none() {
                self.add_live(Space::Heap, addr, LiveBlock { size, group, generation, mark: 0, ignored: false }, false);
            }
        }
        self.fork_boundary();
    }

    /// Called in a forked child once the parent's events are consumed: everything live
    /// now belongs to the parent's history, not to the child.
    ///
    /// Nothing is written per block or per group: a DataLoader worker inherits 700k
    /// blocks, and touching each would copy the parent's tables page by page (18k page
    /// copies per worker). Blocks and group statistics of an older generation read as
    /// inherited and as zero.
    pub fn fork_boundary(&mut self) {
        // The parent's transients count in the parent's generation.
        self.settle_transients();
        // A realloc in flight in another thread of the parent will never complete here.
        self.realloc_in_flight.clear();
        let t = &self.totals;
        self.totals = Totals {
            inherited_live_bytes: t.inherited_live_bytes + t.kinds.iter().map(|k| k.live_bytes).sum::<u64>(),
            inherited_live_blocks: t.inherited_live_blocks + t.kinds.iter().map(|k| k.live_blocks).sum::<u64>(),
            events: t.events,
            ..Totals::default()
        };
        self.generation = self.generation.wrapping_add(1);
        self.touched.clear();
        // A child's timeline starts afresh, its groups at zero (`group_stats`).
        self.changed.clear();
        self.prepared = None;
    }

    /// The stack and entry point of the live heap block at `addr`.
    pub fn live_key(&self, addr: u64) -> Option<(u32, Api)> {
        let b = self.live.get(addr)?;
        let (stack, api, _) = self.groups.key(b.group);
        Some((stack, api))
    }

    /// Every outstanding block that the pointer scan can classify (heap blocks and CUDA
    /// allocations: ranges that never overlap), and the host blocks inherited from a
    /// parent process, each sorted by address.
    pub fn live_blocks(&self) -> ScanInput {
        self.live_blocks_prepared().unwrap_or_else(|| self.live_blocks_walked())
    }

    /// `live_blocks` by walking both tables.
    fn live_blocks_walked(&self) -> ScanInput {
        let mut input = ScanInput::default();
        // A forked worker inherits 700k blocks: one allocation, not a dozen doublings.
        input.inherited.reserve_exact(self.totals.inherited_live_blocks as usize);
        // The same for the process's own: a DDP rank's 705k live blocks by doublings
        // took 25 MB of room for 17 MB, and 38 MB while the last doubling copied (the
        // holder searches take this list while the program runs).
        input.blocks.reserve_exact((self.live.len() as u64).saturating_sub(self.totals.inherited_live_blocks) as usize + self.cuda_live.len());
        // The heap table holds malloc-family blocks only: an inherited one is readable
        // host memory without looking at its group (a cache miss each, 700k of them in
        // a PyTorch DataLoader worker).
        for (addr, b) in self.live.iter() {
            if self.inherited(&b) {
                input.inherited.push(addr, b.size);
            } else {
                input.blocks.push(self.live_entry(addr, &b));
            }
        }
        // CUDA allocations (registrations and VMM handles and ranges are not scanned).
        for (&(space, addr), b) in self.cuda_live.iter() {
            if self.inherited(b) {
                if self.readable_when_inherited(space, b) {
                    input.inherited.push(addr, b.size);
                }
            } else if matches!(space, Space::Cuda | Space::Mmap) {
                input.blocks.push(self.live_entry(addr, b));
            }
        }
        input.blocks.sort_unstable_by_key(|b| b.addr);
        input.inherited.sort();
        input
    }

    /// `live_blocks` for the last report of this process image: a prepared list is
    /// filtered where it lies instead of copied (11 MB of fresh pages in a DataLoader
    /// worker), and is gone afterwards.
    pub fn take_live_blocks(&mut self) -> ScanInput {
        let Some(mut ready) = self.prepared.as_mut().and_then(|p| p.inherited.take()) else {
            return self.live_blocks();
        };
        let mut input = self.own_blocks();
        let p = self.prepared.as_mut().expect("taken from it");
        p.freed.sort_unstable();
        ready.retain(still_live(&p.freed));
        input.inherited = ready;
        input
    }

    /// The blocks a forked child allocated itself, sorted, from its own table (with
    /// `prepared`) and the CUDA table.
    fn own_blocks(&self) -> ScanInput {
        let mut input = ScanInput::default();
        let Some(p) = self.prepared.as_ref() else { return input };
        for (addr, b) in p.own_heap.iter() {
            input.blocks.push(self.live_entry(addr, &b));
        }
        for (&(space, addr), b) in self.cuda_live.iter() {
            if matches!(space, Space::Cuda | Space::Mmap) && !self.inherited(b) {
                input.blocks.push(self.live_entry(addr, b));
            }
        }
        input.blocks.sort_unstable_by_key(|b| b.addr);
        input
    }

    /// `live_blocks` from what `gather_inherited` prepared: the child's own blocks from
    /// their own table, the inherited list less what was freed since (one pass).
    fn live_blocks_prepared(&self) -> Option<ScanInput> {
        let p = self.prepared.as_ref()?;
        let ready = p.inherited.as_ref()?;
        let mut input = self.own_blocks();
        let mut freed = p.freed.clone();
        freed.sort_unstable();
        input.inherited.reserve_exact(ready.len().saturating_sub(freed.len()));
        let mut keep = still_live(&freed);
        for b in ready.iter().filter(|b| keep(b)) {
            input.inherited.push(b.0, b.1);
        }
        // Each part was pushed in order: the sort only checks.
        input.inherited.sort();
        Some(input)
    }

    /// Moves every group's trend one report on (before the report's snapshot).
    pub fn advance_trends(&mut self) {
        let generation = self.generation;
        let step = |s: &mut GroupStats| {
            let now = if s.generation == generation { s.live_bytes } else { 0 };
            if now > 0 || s.trend.seen {
                s.trend.step(now);
            }
        };
        if generation == 0 {
            for g in 0..self.groups.len() as u32 {
                self.groups.update(g, step);
            }
        } else {
            for &g in &self.touched {
                self.groups.update(g, step);
            }
        }
    }

    /// The groups with live blocks and the totals, largest first.
    pub fn snapshot(&self) -> Snapshot {
        let mut s = self.snapshot_unsorted();
        s.sort();
        s
    }

    /// `snapshot` without its order, which `Snapshot::sort` gives: the copy is taken
    /// while the collector is held, the sort (~25 ms for the 600k groups after `import
    /// torch`) after it is let go, so that threads waiting for room can drain meanwhile.
    pub fn snapshot_unsorted(&self) -> Snapshot {
        self.snapshot_unsorted_into(Vec::new())
    }

    /// `snapshot_unsorted` into `buf` (emptied first): a buffer kept from the last
    /// report is reused (a small one: `agent::reports` drops large ones between reports).
    /// Sized exactly: the live groups are counted first (a pass that reads the groups'
    /// figures only), so that a report of 600k groups maps 19 MB once instead of growing
    /// by doubling (40-byte groups then: the copy at the last doubling held the old and
    /// the new buffer, 42 MB, at once).
    pub fn snapshot_unsorted_into(&self, mut buf: Vec<GroupSnapshot>) -> Snapshot {
        buf.clear();
        // The first process's groups all start in its generation, 0, and are never reset.
        let candidates = || -> Box<dyn Iterator<Item = u32> + '_> {
            if self.generation == 0 {
                Box::new(0..self.groups.len() as u32)
            } else {
                Box::new(self.touched.iter().copied())
            }
        };
        let live = |group: u32| self.groups.holds_live(group, self.generation);
        let count = candidates().filter(|&group| live(group)).count();
        if buf.capacity() < count {
            // The last report's buffer goes before the new one is mapped.
            buf = Vec::new();
            buf.reserve_exact(count);
        }
        buf.extend(candidates().filter(|&group| live(group)).map(|group| {
            let ((stack, api, device), stats) = (self.groups.key(group), self.groups.get(group));
            let steady = if stats.trend.steady() { growth_kib(stats.trend.growth()).max(1) } else { 0 };
            GroupSnapshot::new(stack, api, device, steady, stats.live_bytes, stats.live_blocks)
        }));
        Snapshot { totals: self.totals, groups: buf }
    }

    /// The index of the live (not retired) group of `key`, if there is one.
    fn group_index_of(&self, key: GroupKey) -> Option<u32> {
        match self.group_by_stack.get(crate::hotpath::stacks::shared_index(key.0)) {
            Some(&slot) if slot != 0 && slot & RETIRED == 0 && self.groups.key(slot - 1) == key => Some(slot - 1),
            _ => self.group_index.get(&key).copied(),
        }
    }

    /// The figures of a snapshot's group that a snapshot does not copy; zero for a group
    /// of an earlier process generation. Found by its key: through the slot of its stack,
    /// retired or not, or the hash map (a report asks for the few groups it lists).
    pub fn details(&self, g: &GroupSnapshot) -> GroupDetails {
        let key = (g.stack, g.api(), g.device());
        let of = |s: GroupStats| {
            if s.generation == self.generation {
                GroupDetails { peak_live_bytes: s.peak_live_bytes, total_allocs: s.total_allocs, total_bytes: s.total_bytes }
            } else {
                GroupDetails::default()
            }
        };
        let place = crate::hotpath::stacks::shared_index(g.stack);
        match self.group_by_stack.get(place) {
            Some(&slot) if slot & RETIRED != 0 && self.groups.retired_key(slot & !RETIRED, place) == key && self.generation == 0 => {
                let (peak_live_bytes, total_allocs, total_bytes) = self.groups.retired_totals(slot & !RETIRED, place);
                GroupDetails { peak_live_bytes, total_allocs, total_bytes }
            }
            // Retired and back under another index: that group's figures.
            _ => self.group_index_of(key).map_or_else(GroupDetails::default, |i| of(self.groups.get(i))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scan entry keeps its size, api, device, region and ignored bit in 24 bytes.
    #[test]
    fn a_scan_entry_packs_what_it_keeps_in_24_bytes() {
        assert_eq!(std::mem::size_of::<LiveEntry>(), 24);
        for &api in Api::ALL.iter() {
            for device in [None, Some(0), Some(7), Some(255)] {
                for size in [0, 1, 4096, (1 << 36) + 5, (1 << ENTRY_SIZE_BITS) - 1] {
                    for (mark, ignored) in [(0, false), (1, true), (MARK_MASK, false), (MARK_MASK, true)] {
                        let e = LiveEntry::new(0x7f00_1234_5670, size, mark, ignored, 77, api, device);
                        assert_eq!(
                            (e.addr, e.size(), e.mark(), e.ignored(), e.stack, e.api(), e.device()),
                            (0x7f00_1234_5670, size, mark, ignored, 77, api, device)
                        );
                    }
                }
            }
        }
    }

    /// A snapshot's group keeps its key and figures exactly in its 24 bytes.
    #[test]
    fn a_snapshot_group_packs_its_key_and_figures() {
        for api in [Api::Malloc, Api::CudaMalloc, Api::Realloc, Api::from_bits(0x7f)] {
            for device in [None, Some(0), Some(7), Some(255)] {
                for blocks in [0, 1, 123_456_789, (1 << BLOCK_BITS) - 1] {
                    let g = GroupSnapshot::new(42, api, device, 9, u64::MAX - 3, blocks);
                    assert_eq!((g.stack, g.api(), g.device(), g.steady_growth_kib, g.live_bytes, g.live_blocks()), (42, api, device, 9, u64::MAX - 3, blocks));
                }
            }
        }
    }

    fn ev(kind: EventKind, api: Api, tid: u32, stack: u32, addr: u64, size: u64) -> Event {
        Event { kind, api, tid, stack, addr, size }
    }
    fn cuda(kind: EventKind, api: Api, stack: u32, addr: u64, size: u64, device: u8) -> Event {
        Event { kind, api, tid: 1, stack, addr, size: crate::hotpath::event::pack_size(size, Some(device)) }
    }
    fn alloc(addr: u64, size: u64, stack: u32) -> Event {
        ev(EventKind::Alloc, Api::Malloc, 1, stack, addr, size)
    }
    fn free(addr: u64) -> Event {
        ev(EventKind::Free, Api::Malloc, 1, 0, addr, 0)
    }

    #[test]
    fn a_transient_event_counts_as_an_allocation_and_its_free_and_leaves_nothing_live() {
        let mut paired = Collector::new();
        let mut merged = Collector::new();
        for (i, c) in [&mut paired, &mut merged].into_iter().enumerate() {
            c.apply(&ev(EventKind::Alloc, Api::Malloc, 1, 3, 0x100, 64));
            if i == 0 {
                c.apply(&ev(EventKind::Alloc, Api::Malloc, 1, 4, 0x200, 32));
                c.apply(&ev(EventKind::Free, Api::Malloc, 1, 0, 0x200, 0));
            } else {
                c.apply(&ev(EventKind::Transient, Api::Malloc, 1, 4, 0x200, 32));
            }
        }
        let totals = |c: &Collector| c.totals.kinds[Kind::Host.index()];
        assert_eq!(totals(&paired), totals(&merged));
        assert_eq!((totals(&merged).total_allocs, totals(&merged).total_frees, totals(&merged).live_blocks, totals(&merged).peak_live_bytes), (2, 1, 1, 96));
        assert!(merged.live.get(0x200).is_none());
        let details = |c: &mut Collector| {
            c.settle_transients();
            let g = c.group_of((4, Api::Malloc, None));
            let s = c.groups.get(g);
            (s.total_allocs, s.total_bytes, s.live_bytes, s.peak_live_bytes)
        };
        assert_eq!(details(&mut paired), details(&mut merged));
        assert_eq!(details(&mut merged), (1, 32, 0, 32));
    }

    /// Transients summed by key before their groups take them (`transients`) give every
    /// figure that the same allocations and frees applied one by one give: the totals,
    /// each group's totals and peak (a transient's bytes over its group's live bytes of
    /// the moment), the timeline's changes, with groups retired and revived meanwhile,
    /// over more keys than the sums' table has places, across a fork boundary.
    #[test]
    fn transients_summed_by_key_give_the_figures_of_their_events_one_by_one() {
        let mut rng = crate::test_rng::TestRng::new(0x7a11);
        let (mut summed, mut paired) = (Collector::new(), Collector::new());
        let mut live: Vec<(u64, u32, Api)> = Vec::new();
        let mut next_addr = 0x1_0000u64;
        let (mut changes_s, mut changes_p) = (Vec::new(), Vec::new());
        let mut transients_since_fork = 0u64;
        let mut moved: [FxMap<(u32, Api), i64>; 2] = Default::default();
        let pick = |rng: &mut crate::test_rng::TestRng| {
            // A few hot keys and many rare ones (more than the table's places).
            let stack = if rng.below(4) == 0 { 100 + rng.below(3000) as u32 } else { 10 + rng.below(8) as u32 };
            (stack, if rng.below(5) == 0 { Api::PyObject } else { Api::Malloc })
        };
        for step in 0..60_000u32 {
            let roll = rng.below(10);
            if roll < 6 {
                let (stack, api) = pick(&mut rng);
                let large = rng.below(50) == 0;
                let size = 1 + rng.below(if large { 1 << 20 } else { 256 });
                summed.apply(&ev(EventKind::Transient, api, 1, stack, next_addr, size));
                transients_since_fork += 1;
                paired.apply(&ev(EventKind::Alloc, api, 1, stack, next_addr, size));
                paired.apply(&ev(EventKind::Free, api, 1, 0, next_addr, 0));
                next_addr += 0x100;
            } else if roll < 8 || live.is_empty() {
                let (stack, api) = pick(&mut rng);
                let size = 1 + rng.below(4096);
                for c in [&mut summed, &mut paired] {
                    c.apply(&ev(EventKind::Alloc, api, 1, stack, next_addr, size));
                }
                live.push((next_addr, stack, api));
                next_addr += 0x100;
            } else {
                let (addr, _, api) = live.swap_remove(rng.below(live.len() as u64) as usize);
                for c in [&mut summed, &mut paired] {
                    c.apply(&ev(EventKind::Free, api, 1, 0, addr, 0));
                }
            }
            if step % 509 == 0 {
                summed.take_changes(&mut changes_s);
                paired.take_changes(&mut changes_p);
                for (m, changes) in moved.iter_mut().zip([&changes_s, &changes_p]) {
                    for ch in changes.iter() {
                        *m.entry((ch.stack, ch.api)).or_default() += ch.now as i64 - ch.before as i64;
                    }
                }
            }
            if step == 40_000 {
                summed.fork_boundary();
                paired.fork_boundary();
                transients_since_fork = 0;
            }
        }
        summed.settle_transients();
        assert!(summed.groups.retired_count() > 0, "no group was retired");
        let mut t = summed.totals();
        assert_eq!(t.merged_frees, transients_since_fork, "the transients since the fork boundary");
        (t.merged_frees, t.events) = (0, paired.totals().events);
        assert_eq!(t, paired.totals());
        assert_eq!(moved[0], moved[1], "the timeline's changes");
        let figures = |c: &Collector| {
            let mut all: Vec<_> = (0..c.groups.len() as u32)
                .filter(|&g| c.groups.get(g).generation == c.generation)
                .map(|g| {
                    let s = c.groups.get(g);
                    (c.groups.key(g), s.total_allocs, s.total_bytes, s.live_bytes, s.live_blocks, s.peak_live_bytes)
                })
                .collect();
            all.sort_by_key(|f| (f.0 .0, f.0 .1 as u8));
            all
        };
        let (a, b) = (figures(&summed), figures(&paired));
        assert!(a.len() > 100, "{} groups", a.len());
        assert_eq!(a, b);
        // Retired groups keep their totals: every key's, whatever its form now.
        for key in b.iter().map(|f| f.0) {
            let (gs, gp) = (summed.group_of(key), paired.group_of(key));
            let (ss, sp) = (summed.groups.get(gs), paired.groups.get(gp));
            assert_eq!((ss.total_allocs, ss.total_bytes, ss.peak_live_bytes), (sp.total_allocs, sp.total_bytes, sp.peak_live_bytes), "{key:?}");
        }
    }

    #[test]
    fn a_live_block_fits_a_word_unless_a_field_is_out_of_its_range() {
        let b = LiveBlock { size: (1 << 24) - 1, group: (1 << 24) - 2, generation: 3, mark: 1, ignored: true };
        let w = b.pack().unwrap();
        assert_eq!(LiveBlock::unpack(w), b);
        // Within the table's word, and never all of its ones (its mark for a value aside).
        assert!(w < (1 << super::super::address_table::VALUE_BITS) - 1, "{w:#x}");
        let plain = LiveBlock { size: 24, group: 7, generation: 0, mark: 0, ignored: false };
        assert_eq!(LiveBlock::unpack(plain.pack().unwrap()), plain);
        for wide in [
            LiveBlock { size: 1 << 24, ..plain },
            LiveBlock { group: (1 << 24) - 1, ..plain },
            LiveBlock { generation: 4, ..plain },
            LiveBlock { mark: 2, ..plain },
        ] {
            assert_eq!(wide.pack(), None, "{wide:?}");
        }
    }

    /// Blocks that do not fit a word (a huge one, one past a second checkpoint, one of a
    /// forked grandchild's grandchild) are kept, freed and counted as any other.
    #[test]
    fn blocks_kept_aside_count_as_any_other() {
        let mut c = Collector::new();
        c.apply(&alloc(0x1000, 1 << 40, 1));
        c.apply(&ev(EventKind::Mark, Api::Malloc, 1, 0, 0, 0));
        c.apply(&ev(EventKind::Mark, Api::Malloc, 1, 0, 0, 0));
        c.apply(&alloc(0x2000, 32, 2));
        c.apply(&alloc(0x3000, 48, 2));
        assert_eq!(c.live.get(0x2000).map(|b| b.mark), Some(2));
        assert_eq!(c.totals().kind(Kind::Host).live_bytes, (1 << 40) + 80);
        c.apply(&free(0x1000));
        c.apply(&free(0x2000));
        assert_eq!(c.totals().kind(Kind::Host).live_bytes, 48);
        assert_eq!(c.live.len(), 1);
        assert_eq!(c.live.wide.len(), 1);
    }

    #[test]
    fn sort_top_puts_each_classs_largest_first_in_the_full_sorts_order() {
        let mut rng = crate::test_rng::TestRng::new(0x5eed);
        for case in 0..200u64 {
            let n = rng.below(400) as usize;
            let k = 1 + rng.below(40) as usize;
            let cuda_share = rng.below(4);
            let groups: Vec<GroupSnapshot> = (0..n)
                .map(|i| {
                    let stack = rng.below(50) as u32 + i as u32 * 64;
                    let api = if rng.below(4) < cuda_share { Api::CudaMalloc } else { Api::Malloc };
                    // Few distinct sizes: ties are ordered by blocks, then stack.
                    GroupSnapshot::new(stack, api, None, 0, rng.below(30) * 8, 1 + rng.below(3))
                })
                .collect();
            let mut full = Snapshot { totals: Totals::default(), groups: groups.clone() };
            full.sort();
            let mut top = Snapshot { totals: Totals::default(), groups };
            top.sort_top(k);
            let mut sorted_ids: Vec<u32> = top.groups.iter().map(|g| g.stack).collect();
            sorted_ids.sort_unstable();
            let mut all_ids: Vec<u32> = full.groups.iter().map(|g| g.stack).collect();
            all_ids.sort_unstable();
            assert_eq!(sorted_ids, all_ids, "case {case}: the same groups");
            for host in [true, false] {
                let first_k =
                    |s: &Snapshot| -> Vec<u32> { s.groups.iter().filter(|g| (g.api().kind() == Kind::Host) == host).take(k).map(|g| g.stack).collect() };
                assert_eq!(first_k(&top), first_k(&full), "case {case}: n {n} k {k} host {host}");
            }
            let head = k.min(n);
            let ids = |s: &Snapshot| -> Vec<u32> { s.groups.iter().take(head).map(|g| g.stack).collect() };
            assert_eq!(ids(&top), ids(&full), "case {case}: the largest overall");
        }
    }

    #[test]
    fn a_group_that_grows_at_every_report_is_steady_and_one_that_plateaus_is_not() {
        let mut c = Collector::new();
        let mut addr = 0x1000;
        for round in 0..6u64 {
            // Stack 1 gains a 512-byte block each round; stack 2 gains only in round 0.
            c.apply(&alloc(addr, 512, 1));
            addr += 0x1000;
            if round == 0 {
                c.apply(&alloc(addr, 4096, 2));
                addr += 0x1000;
            }
            c.advance_trends();
        }
        let s = c.snapshot();
        let g = |stack: u32| s.groups.iter().find(|g| g.stack == stack).copied().unwrap();
        let t = |stack: u32| c.groups.get(c.group_index_of((stack, Api::Malloc, None)).unwrap()).trend;
        assert!(t(1).steady(), "{:?}", t(1));
        assert_eq!((t(1).steps, t(1).ups, t(1).downs, t(1).growth()), (5, 5, 0, 5 * 512));
        assert!(!t(2).steady(), "{:?}", t(2));
        // A snapshot says the same.
        assert_eq!((g(1).steady(), g(1).steady_growth_kib, g(2).steady()), (true, 3, false));
        let mut small = Trend::default();
        for v in [10, 20, 30, 40] {
            small.step(v);
        }
        assert!(!small.steady(), "30 bytes of growth is noise");
    }

    #[test]
    fn alloc_free_accounting_and_groups() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 100, 1));
        c.apply(&alloc(0x20, 50, 1));
        c.apply(&alloc(0x30, 7, 2));
        c.apply(&free(0x20));
        c.apply(&free(0x999));
        let s = c.snapshot();
        assert_eq!(s.totals.host().live_bytes, 107);
        assert_eq!(s.totals.host().live_blocks, 2);
        assert_eq!(s.totals.host().total_allocs, 3);
        assert_eq!(s.totals.host().total_frees, 1);
        assert_eq!(s.totals.host().peak_live_bytes, 157);
        assert_eq!(s.totals.unknown_frees, 1);
        assert_eq!(s.groups.len(), 2);
        assert_eq!((s.groups[0].stack, s.groups[0].live_bytes, c.details(&s.groups[0]).peak_live_bytes), (1, 100, 150));
        assert_eq!((s.groups[1].stack, s.groups[1].live_blocks()), (2, 1));
        assert_eq!(s.totals.host().total_allocs - s.totals.host().total_frees, s.totals.host().live_blocks);
    }

    #[test]
    fn a_release_on_the_librarys_threads_frees_a_program_block_and_is_counted_and_one_of_its_own_is_no_diagnostic() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 100, 1));
        c.apply(&alloc(0x20, 50, 1));
        // The C library frees a program thread's block on a thread of ours.
        c.apply(&ev(EventKind::Free, Api::Malloc, 7, INTERNAL_FREE, 0x10, 0));
        // The library frees a block of its own: never seen allocated.
        c.apply(&ev(EventKind::Free, Api::Malloc, 7, INTERNAL_FREE, 0x999, 0));
        // A realloc there moves the other program block.
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 7, INTERNAL_FREE, 0x20, 0));
        c.apply(&ev(EventKind::ReallocFreed, Api::Realloc, 7, 0, 0, 0));
        // The address comes back to the program: a new block, not a replaced one.
        c.apply(&alloc(0x10, 30, 2));
        let s = c.snapshot();
        let host = s.totals.host();
        assert_eq!((host.live_blocks, host.live_bytes, host.total_allocs, host.total_frees), (1, 30, 3, 2));
        assert_eq!(host.total_allocs - host.total_frees, host.live_blocks);
        assert_eq!(s.totals.frees_on_library_threads, 2);
        assert_eq!(s.totals.unknown_frees, 0);
    }

    fn same_input(a: &ScanInput, b: &ScanInput) -> bool {
        let key = |i: &ScanInput| (i.blocks.iter().map(|e| (e.addr, e.size(), e.stack, e.api(), e.device())).collect::<Vec<_>>(), i.inherited.clone());
        key(a) == key(b)
    }

    /// In a forked child, what `gather_inherited` prepared gives the scan exactly what
    /// walking the tables gives, through random frees, reallocs (failed ones too),
    /// page-locked and device memory, addresses reused and a second fork.
    #[test]
    fn prepared_inherited_blocks_match_a_full_walk() {
        let mut rng = crate::test_rng::TestRng::new(0x9e37_79b9_7f4a_7c15);
        let mut prepared_checks = 0;
        for round in 0..40 {
            let mut c = Collector::new();
            let step = |c: &mut Collector, rng: &mut crate::test_rng::TestRng| {
                let addr = 0x1000 + rng.below(600) * 16;
                let stack = rng.below(20) as u32 + 1;
                match rng.below(12) {
                    0..=4 => c.apply(&alloc(addr, 16 + rng.below(64), stack)),
                    5..=7 => c.apply(&free(addr)),
                    8 => {
                        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, addr, 0));
                        if rng.below(8) == 0 {
                            c.apply(&ev(EventKind::ReallocRestore, Api::Realloc, 1, 0, 0, 0));
                        } else {
                            c.apply(&ev(EventKind::Alloc, Api::Realloc, 1, stack, 0x1000 + rng.below(600) * 16, 40));
                        }
                    }
                    9 => c.apply(&cuda(EventKind::Alloc, Api::CudaMallocHost, stack, 0x10_0000 + addr, 32, 0)),
                    10 => c.apply(&cuda(EventKind::Alloc, Api::CudaMalloc, stack, 0x20_0000 + addr, 64, 0)),
                    _ => c.apply(&ev(EventKind::Free, Api::releasing(Space::Cuda), 1, 0, [0x10_0000, 0x20_0000][rng.below(2) as usize] + addr, 0)),
                }
            };
            for _ in 0..800 {
                step(&mut c, &mut rng);
            }
            c.fork_boundary();
            for _ in 0..rng.below(100) {
                step(&mut c, &mut rng);
            }
            let (mut list, generation) = c.gather_inherited().expect("a forked child gathers once");
            assert!(c.gather_inherited().is_none());
            for _ in 0..rng.below(100) {
                step(&mut c, &mut rng);
            }
            list.sort();
            c.install_inherited(list, generation);
            for _ in 0..rng.below(400) {
                step(&mut c, &mut rng);
                prepared_checks += usize::from(c.live_blocks_prepared().is_some());
                assert!(same_input(&c.live_blocks(), &c.live_blocks_walked()), "round {round}");
            }
            if round % 4 == 1 {
                // The last report takes the prepared list and filters it in place.
                let walked = c.live_blocks_walked();
                assert!(same_input(&c.take_live_blocks(), &walked), "round {round}");
                assert!(same_input(&c.live_blocks(), &walked), "after the take, a walk again");
            }
            if round % 4 == 0 {
                // Another fork: the list of the old generation is no longer the truth.
                c.fork_boundary();
                step(&mut c, &mut rng);
                assert!(c.live_blocks_prepared().is_none());
                assert!(same_input(&c.live_blocks(), &c.live_blocks_walked()));
            }
        }
        // Most checks went through the prepared lists (a failed realloc of an inherited
        // block abandons them).
        assert!(prepared_checks > 2000, "{prepared_checks}");
    }

    /// A key always finds the group it made, and two keys never share one, when one
    /// stack is used with several APIs and devices in turn (the slot per stack changes
    /// hands), including stack ids beyond the per-stack vector.
    #[test]
    fn every_key_keeps_one_group_while_stacks_change_hands() {
        let mut c = Collector::new();
        let mut reference: std::collections::HashMap<GroupKey, u32> = std::collections::HashMap::new();
        let mut rng = crate::test_rng::TestRng::new(0x2545_f491_4f6c_dd1d);
        let mut next = |n: u64| rng.below(n);
        let apis = [Api::Malloc, Api::Calloc, Api::Realloc, Api::CudaMalloc];
        for _ in 0..50_000 {
            // Natives and their first Python children share slots (`shared_index`).
            let child = if next(3) == 0 { crate::hotpath::stacks::CHILD_BASE } else { 0 };
            let stack = if next(50) == 0 { (1 << 24) + next(4) as u32 } else { child + next(300) as u32 };
            let key = (stack, apis[next(4) as usize], if next(3) == 0 { Some(next(2) as u8) } else { None });
            let g = c.group_of(key);
            assert_eq!(c.groups.key(g), key);
            assert_eq!(*reference.entry(key).or_insert(g), g, "{key:?}");
        }
        assert_eq!(c.groups.len(), reference.len(), "one group per key");
    }

    /// A group that holds nothing at a timeline point is retired, its index goes to the
    /// next new group, and it comes back with its totals when its stack allocates again;
    /// a snapshot taken before still finds its figures. Groups a report saw holding
    /// memory, or in a realloc's flight, stay.
    #[test]
    fn idle_groups_are_retired_at_a_point_and_come_back_with_their_totals() {
        let mut c = Collector::new();
        let mut changes = Vec::new();
        c.apply(&alloc(0x10, 8, 1));
        let before = c.snapshot();
        c.apply(&free(0x10));
        c.apply(&alloc(0x20, 24, 1));
        c.apply(&free(0x20));
        c.take_changes(&mut changes);
        assert_eq!((c.groups.retired_count(), c.groups.len()), (1, 1));
        // The snapshot's group, retired since: found by its key.
        let d = c.details(&before.groups[0]);
        assert_eq!((d.total_allocs, d.total_bytes, d.peak_live_bytes), (2, 32, 24));
        // Its index, reused.
        c.apply(&alloc(0x30, 4, 2));
        assert_eq!((c.groups.len(), c.groups.retired_count()), (1, 1));
        assert_eq!(c.details(&before.groups[0]).total_allocs, 2, "a retired group's figures, not the index's new owner's");
        // Back, with its totals.
        c.apply(&alloc(0x40, 16, 1));
        assert_eq!((c.groups.len(), c.groups.retired_count()), (2, 0));
        let s = c.snapshot();
        let g1 = s.groups.iter().find(|g| g.stack == 1).unwrap();
        let d = c.details(g1);
        assert_eq!((g1.live_bytes, d.total_allocs, d.total_bytes, d.peak_live_bytes), (16, 3, 48, 24));
        assert_eq!(c.details(&before.groups[0]), d);
        // Seen holding memory at a report: kept (its trend is history).
        c.advance_trends();
        c.apply(&free(0x40));
        c.take_changes(&mut changes);
        assert_eq!(c.groups.retired_count(), 0, "seen at a report: kept");
        // A realloc in flight names its group: kept until the outcome.
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 8, 5));
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x10, 0));
        c.take_changes(&mut changes);
        assert_eq!(c.groups.retired_count(), 0);
        c.apply(&ev(EventKind::ReallocRestore, Api::Realloc, 1, 0, 0x10, 0));
        assert_eq!(c.snapshot().groups[0].live_bytes, 8);
    }

    /// A pass that runs while a realloc's block is between its release and its outcome
    /// leaves that block's group alone: the block comes back to its own group, whatever
    /// the event at which the list of changes reached the pass's length.
    #[test]
    fn a_block_in_a_reallocs_flight_keeps_its_group_through_retiring_passes() {
        let mut c = Collector::new();
        for k in 0..200u32 {
            let (stack, addr) = (10 + k, 0x10_0000 + u64::from(k) * 0x100);
            // Groups made and emptied (retired by the next pass), around the realloc.
            c.apply(&alloc(0x90_0000, 4, 5_000 + k));
            c.apply(&free(0x90_0000));
            c.apply(&alloc(addr, 8, stack));
            c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, addr, 0));
            c.apply(&alloc(0x91_0000, 4, 6_000 + k));
            c.apply(&free(0x91_0000));
            c.apply(&ev(EventKind::ReallocRestore, Api::Realloc, 1, 0, addr, 0));
            let s = c.snapshot();
            let g = s.groups.iter().find(|g| g.stack == stack).unwrap_or_else(|| panic!("stack {stack} lost its block at {k}"));
            assert_eq!((g.api(), g.live_bytes, g.live_blocks()), (Api::Malloc, 8, 1));
            c.apply(&free(addr));
        }
        assert!(c.groups.retired_count() > 100, "{} retired", c.groups.retired_count());
    }

    /// With groups retired and revived at random points, every key's figures and the
    /// timeline's sums of changes stay what a plain count gives.
    #[test]
    fn retiring_groups_changes_no_figure() {
        let mut c = Collector::new();
        let mut rng = crate::test_rng::TestRng::new(0x9e37_79b9_7f4a_7c15);
        let apis = [Api::Malloc, Api::Calloc];
        // key -> (live bytes, live blocks, allocations, bytes, peak)
        let mut want: std::collections::HashMap<GroupKey, [u64; 5]> = std::collections::HashMap::new();
        let mut live: Vec<(u64, GroupKey, u64)> = Vec::new();
        let mut summed: std::collections::HashMap<(u32, Api), i64> = std::collections::HashMap::new();
        let mut changes = Vec::new();
        let mut next_addr = 0x1000u64;
        let mut retired_seen = 0;
        for step in 0..40_000 {
            // A few dozen blocks live at a time, over ~450 keys.
            if live.is_empty() || (live.len() < 40 && rng.below(2) == 0) {
                // A stack allocates through one API, now and then through the other too
                // (its slot changes hands; those groups go through the hash map).
                // Natives and their first Python children share slots (`shared_index`):
                // half the stacks are first children, and now and then their native
                // stack allocates too.
                let native = 1 + rng.below(400) as u32;
                let child = native.is_multiple_of(2) ^ (rng.below(500) == 0);
                let stack = native + if child { crate::hotpath::stacks::CHILD_BASE } else { 0 };
                let api = apis[usize::from(stack.is_multiple_of(10)) ^ usize::from(rng.below(2000) == 0)];
                let key = (stack, api, None);
                let size = 1 + rng.below(300);
                c.apply(&ev(EventKind::Alloc, key.1, 1, key.0, next_addr, size));
                let w = want.entry(key).or_default();
                w[0] += size;
                w[1] += 1;
                w[2] += 1;
                w[3] += size;
                w[4] = w[4].max(w[0]);
                live.push((next_addr, key, size));
                next_addr += 0x1000;
            } else {
                let (addr, key, size) = live.swap_remove(rng.below(live.len() as u64) as usize);
                c.apply(&free(addr));
                let w = want.get_mut(&key).unwrap();
                w[0] -= size;
                w[1] -= 1;
            }
            if step % 97 == 0 {
                c.take_changes(&mut changes);
                for ch in &changes {
                    *summed.entry((ch.stack, ch.api)).or_default() += ch.now as i64 - ch.before as i64;
                }
                retired_seen = retired_seen.max(c.groups.retired_count());
            }
        }
        assert!(retired_seen > 0, "no group was retired");
        c.take_changes(&mut changes);
        for ch in &changes {
            *summed.entry((ch.stack, ch.api)).or_default() += ch.now as i64 - ch.before as i64;
        }
        let s = c.snapshot();
        for (key, w) in &want {
            assert_eq!(summed.get(&(key.0, key.1)).copied().unwrap_or(0), w[0] as i64, "{key:?}: changes sum to its live bytes");
            match s.groups.iter().find(|g| (g.stack, g.api(), g.device()) == *key) {
                Some(g) => {
                    let d = c.details(g);
                    assert_eq!([g.live_bytes, g.live_blocks(), d.total_allocs, d.total_bytes, d.peak_live_bytes], *w, "{key:?}");
                }
                None => assert_eq!(w[1], 0, "{key:?} holds blocks but is not in the snapshot"),
            }
        }
        // The table holds about as many groups as keys live at a time, not every key.
        assert!(c.groups.len() < want.len() / 2, "{} groups for {} keys", c.groups.len(), want.len());
    }

    #[test]
    fn address_reuse_after_free_is_a_new_block() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 8, 1));
        c.apply(&free(0x10));
        c.apply(&alloc(0x10, 16, 2));
        let s = c.snapshot();
        assert_eq!(s.groups.len(), 1);
        assert_eq!((s.groups[0].stack, s.groups[0].live_bytes), (2, 16));
    }

    #[test]
    fn realloc_moved_in_place_failed_and_zero() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 8, 1));
        // moved
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x10, 0));
        c.apply(&ev(EventKind::Alloc, Api::Realloc, 1, 3, 0x40, 64));
        // failed: block stays as it was
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x40, 0));
        c.apply(&ev(EventKind::ReallocRestore, Api::Realloc, 1, 0, 0x40, 0));
        let s = c.snapshot();
        assert_eq!((s.totals.host().live_blocks, s.totals.host().live_bytes), (1, 64));
        assert_eq!((s.totals.host().total_allocs, s.totals.host().total_frees), (2, 1));
        assert_eq!((s.groups[0].stack, s.groups[0].api()), (3, Api::Realloc));
        // realloc(p, 0) freed it
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x40, 0));
        c.apply(&ev(EventKind::ReallocFreed, Api::Realloc, 1, 0, 0x40, 0));
        let s = c.snapshot();
        assert_eq!((s.totals.host().live_blocks, s.totals.host().total_allocs, s.totals.host().total_frees), (0, 2, 2));
        assert!(s.groups.is_empty());
    }

    #[test]
    fn realloc_of_unknown_block_counts_only_the_new_one() {
        let mut c = Collector::new();
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 5, 0, 0x10, 0));
        c.apply(&ev(EventKind::Alloc, Api::Realloc, 5, 3, 0x40, 64));
        let t = c.totals();
        assert_eq!((t.host().live_blocks, t.host().total_allocs, t.host().total_frees), (1, 1, 0));
    }

    #[test]
    fn interleaved_reallocs_of_two_threads_stay_apart() {
        let mut c = Collector::new();
        c.apply(&ev(EventKind::Alloc, Api::Malloc, 1, 1, 0x10, 8));
        c.apply(&ev(EventKind::Alloc, Api::Malloc, 2, 2, 0x20, 8));
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x10, 0));
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 2, 0, 0x20, 0));
        c.apply(&ev(EventKind::ReallocRestore, Api::Realloc, 2, 0, 0, 0));
        c.apply(&ev(EventKind::Alloc, Api::Realloc, 1, 9, 0x30, 32));
        let s = c.snapshot();
        let mut live: Vec<_> = s.groups.iter().map(|g| (g.stack, g.live_bytes)).collect();
        live.sort();
        assert_eq!(live, vec![(2, 8), (9, 32)]);
    }

    /// Switched on from standby: the blocks live before are kept as a parent's, freed
    /// harmlessly; one allocated since tracking began stays tracked; a free of a block
    /// nobody saw is nothing.
    #[test]
    fn blocks_from_before_the_start_are_kept_apart_and_their_frees_are_harmless() {
        let mut c = Collector::new();
        c.apply(&alloc(0x20, 64, 3));
        c.adopt_before_start(&[(0x10, 100), (0x20, 48), (0x30, 200)]);
        let s = c.snapshot();
        assert!(s.groups.is_empty());
        // The tracked block at 0x20 became the older generation as well (recorded in the
        // moment before the walk): never a leak either.
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_live_blocks), (364, 3));
        assert_eq!(c.live_blocks().inherited.to_vec(), vec![(0x10, 100), (0x20, 64), (0x30, 200)]);
        c.apply(&free(0x10));
        c.apply(&free(0x999));
        c.apply(&alloc(0x40, 8, 5));
        let s = c.snapshot();
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_frees), (264, 1));
        assert_eq!((s.totals.host().live_bytes, s.groups.len()), (8, 1));
        let input = c.live_blocks();
        assert_eq!(input.inherited.to_vec(), vec![(0x20, 64), (0x30, 200)]);
        assert_eq!(input.blocks.iter().map(|b| b.addr).collect::<Vec<_>>(), vec![0x40]);
    }

    #[test]
    fn fork_boundary_moves_everything_to_inherited() {
        let mut c = Collector::new();
        c.apply(&alloc(0x10, 100, 1));
        c.apply(&alloc(0x20, 20, 1));
        c.fork_boundary();
        let s = c.snapshot();
        assert!(s.groups.is_empty());
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_live_blocks), (120, 2));
        c.apply(&free(0x10));
        c.apply(&alloc(0x30, 5, 4));
        let s = c.snapshot();
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_frees), (20, 1));
        assert_eq!((s.totals.host().live_bytes, s.totals.host().total_allocs, s.totals.host().total_frees), (5, 1, 0));
        assert_eq!(s.groups.len(), 1);
        // The child allocates from the parent's stack 1: the group starts afresh, and
        // the parent's block from the same stack stays the parent's.
        c.apply(&alloc(0x40, 7, 1));
        c.apply(&free(0x20));
        let s = c.snapshot();
        let g1 = s.groups.iter().find(|g| g.stack == 1).unwrap();
        assert_eq!((g1.live_bytes, g1.live_blocks(), c.details(g1).total_allocs), (7, 1, 1));
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_live_blocks, s.totals.inherited_frees), (0, 0, 2));
        // A grandchild inherits the child's blocks, and nothing of the old statistics.
        c.fork_boundary();
        let s = c.snapshot();
        assert!(s.groups.is_empty());
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_live_blocks), (12, 2));
        let input = c.live_blocks();
        assert!(input.blocks.is_empty());
        assert_eq!(input.inherited.to_vec(), vec![(0x30, 5), (0x40, 7)]);
        c.apply(&free(0x40));
        c.apply(&alloc(0x50, 3, 1));
        let s = c.snapshot();
        assert_eq!((s.totals.inherited_live_bytes, s.totals.inherited_frees, s.totals.host().live_bytes), (5, 1, 3));
        assert_eq!(s.groups.len(), 1);
        assert_eq!((s.groups[0].live_bytes, c.details(&s.groups[0]).total_allocs), (3, 1));
    }

    #[test]
    fn a_forked_childs_snapshot_sees_every_group_it_touched() {
        // What a snapshot would list had it looked at every group.
        let every = |c: &Collector| {
            let mut v: Vec<(u32, u64)> = (0..c.groups.len() as u32)
                .map(|g| (c.groups.key(g), c.groups.get(g)))
                .filter(|(_, s)| s.live_blocks > 0 && s.generation == c.generation)
                .map(|((stack, _, _), s)| (stack, s.live_bytes))
                .collect();
            v.sort();
            v
        };
        let listed = |c: &Collector| {
            let mut v: Vec<(u32, u64)> = c.snapshot().groups.iter().map(|g| (g.stack, g.live_bytes)).collect();
            v.sort();
            v
        };
        let mut c = Collector::new();
        for i in 0..200u64 {
            c.apply(&alloc(0x1000 + i * 16, i + 1, (i % 50) as u32 + 1));
        }
        for generation in 0..3u64 {
            c.fork_boundary();
            for i in 0..120u64 {
                let addr = 0x9000 * (generation + 1) + i * 16;
                c.apply(&alloc(addr, 8, (i % 70) as u32 + 1));
                if i % 3 == 0 {
                    c.apply(&free(addr));
                }
                if i % 5 == 0 {
                    // Frees of inherited blocks leave the child's groups alone.
                    c.apply(&free(0x1000 + i * 16));
                }
            }
            assert_eq!(listed(&c), every(&c), "generation {}", generation + 1);
            assert!(!listed(&c).is_empty());
        }
    }

    #[test]
    fn changes_added_to_the_last_sums_give_every_groups_live_bytes() {
        // Sums per (stack, api) kept only from `take_changes`, as the timeline keeps them,
        // against the snapshot, across reallocs, unknown frees, settles and forks.
        let mut rng = crate::test_rng::TestRng::new(0xc4a9);
        let mut c = Collector::new();
        let mut sums: std::collections::HashMap<(u32, Api), u64> = Default::default();
        let mut live: Vec<u64> = Vec::new();
        let mut next = 0x10_000u64;
        let mut changes = Vec::new();
        for step in 0..4000 {
            match rng.below(10) {
                0..=4 => {
                    let api = if rng.below(4) == 0 { Api::Calloc } else { Api::Malloc };
                    c.apply(&ev(EventKind::Alloc, api, 1, 1 + rng.below(40) as u32, next, 1 + rng.below(300)));
                    live.push(next);
                    next += 512;
                }
                5..=7 if !live.is_empty() => {
                    let addr = live.swap_remove(rng.below(live.len() as u64) as usize);
                    c.apply(&free(addr));
                }
                8 if !live.is_empty() => {
                    // realloc in place to a new size, under another stack.
                    let addr = live[rng.below(live.len() as u64) as usize];
                    c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, addr, 0));
                    c.apply(&ev(EventKind::Alloc, Api::Realloc, 1, 1 + rng.below(40) as u32, addr, 1 + rng.below(900)));
                }
                _ => c.apply(&free(0xdead_0000 + step)),
            }
            match rng.below(50) {
                0 => {
                    c.take_changes(&mut changes);
                    for ch in &changes {
                        let s = sums.entry((ch.stack, ch.api)).or_default();
                        *s = *s + ch.now - ch.before;
                    }
                    let mut expect: std::collections::HashMap<(u32, Api), u64> = Default::default();
                    for g in c.snapshot().groups {
                        *expect.entry((g.stack, g.api())).or_default() += g.live_bytes;
                    }
                    sums.retain(|_, v| *v > 0);
                    expect.retain(|_, v| *v > 0);
                    assert_eq!(sums, expect, "step {step}");
                }
                // A report: the sums start afresh from its snapshot.
                1 => {
                    c.settle_changes();
                    sums.clear();
                    for g in c.snapshot().groups {
                        *sums.entry((g.stack, g.api())).or_default() += g.live_bytes;
                    }
                }
                // A forked child: a fresh timeline, the parent's blocks inherited.
                2 if step % 7 == 0 => {
                    c.fork_boundary();
                    live.clear();
                    sums.clear();
                }
                _ => {}
            }
        }
    }

    #[test]
    fn cuda_spaces_kinds_and_devices_stay_apart() {
        let mut c = Collector::new();
        // A heap block, its registration, a device block and a VMM handle with the same number.
        c.apply(&alloc(0x1000, 64, 1));
        c.apply(&cuda(EventKind::Alloc, Api::CudaHostRegister, 2, 0x1000, 64, 0));
        c.apply(&cuda(EventKind::Alloc, Api::CudaMalloc, 3, 0x2000, 256, 0));
        c.apply(&cuda(EventKind::Alloc, Api::CudaMalloc, 3, 0x3000, 256, 1));
        c.apply(&cuda(EventKind::Alloc, Api::CuMemCreate, 4, 0x1000, 2 << 20, 0));
        c.apply(&cuda(EventKind::Alloc, Api::CudaMallocHost, 5, 0x4000, 32, 0));
        let s = c.snapshot();
        assert_eq!(s.totals.host().live_bytes, 64);
        assert_eq!(s.totals.kind(Kind::Device).live_bytes, 512 + (2 << 20));
        assert_eq!(s.totals.kind(Kind::Pinned).live_bytes, 64 + 32);
        // One group per device for the same stack and api.
        let dev: Vec<_> = s.groups.iter().filter(|g| g.api() == Api::CudaMalloc).map(|g| g.device()).collect();
        assert_eq!(dev, vec![Some(0), Some(1)]);
        // Freeing the registration leaves the heap block; a device free finds its space.
        c.apply(&ev(EventKind::Free, Api::releasing(Space::Registered), 1, 0, 0x1000, 0));
        c.apply(&ev(EventKind::Free, Api::releasing(Space::Cuda), 1, 0, 0x2000, 0));
        let s = c.snapshot();
        assert_eq!(s.totals.host().live_blocks, 1);
        assert_eq!(s.totals.kind(Kind::Pinned).live_bytes, 32);
        assert_eq!((s.totals.kind(Kind::Device).live_blocks, s.totals.kind(Kind::Device).total_frees), (2, 1));
        assert_eq!(s.totals.unknown_frees, 0);
        // A CUDA free that failed leaves its block; one that succeeded does not, and a
        // heap realloc on the same thread in between (inside the driver) is unaffected.
        let rel = Api::releasing(Space::Cuda);
        c.apply(&ev(EventKind::ReallocRelease, rel, 1, 0, 0x3000, 0));
        c.apply(&ev(EventKind::ReallocRelease, Api::Realloc, 1, 0, 0x1000, 0));
        c.apply(&ev(EventKind::Alloc, Api::Realloc, 1, 9, 0x1000, 128));
        c.apply(&ev(EventKind::ReallocRestore, rel, 1, 0, 0, 0));
        assert_eq!(c.totals().kind(Kind::Device).live_blocks, 2);
        assert_eq!(c.totals().host().live_bytes, 128);
        c.apply(&ev(EventKind::ReallocRelease, rel, 1, 0, 0x3000, 0));
        c.apply(&ev(EventKind::ReallocFreed, rel, 1, 0, 0, 0));
        assert_eq!(c.totals().kind(Kind::Device).live_blocks, 1);
        // The scan sees heap and CUDA allocations, never handles or registrations.
        let scanned: Vec<u64> = c.live_blocks().blocks.iter().map(|b| b.addr).collect();
        assert_eq!(scanned, vec![0x1000, 0x4000]);
    }

    #[test]
    fn device_reset_frees_context_bound_blocks_of_that_device_only() {
        let mut c = Collector::new();
        c.apply(&cuda(EventKind::Alloc, Api::CudaMalloc, 1, 0x1000, 100, 0));
        c.apply(&cuda(EventKind::Alloc, Api::CuMemAllocHost, 1, 0x2000, 10, 0));
        c.apply(&cuda(EventKind::Alloc, Api::CudaMalloc, 1, 0x3000, 100, 1));
        c.apply(&cuda(EventKind::Alloc, Api::CuMemCreate, 1, 0x4000, 100, 0));
        c.apply(&cuda(EventKind::Alloc, Api::CudaMallocAsync, 1, 0x5000, 100, 0));
        c.apply(&alloc(0x6000, 8, 1));
        assert_eq!(c.device_reset(0), 2);
        let s = c.snapshot();
        let left: Vec<_> = s.groups.iter().map(|g| (g.api(), g.device())).collect();
        assert_eq!(left.len(), 4, "{left:?}");
        assert!(!left.contains(&(Api::CudaMalloc, Some(0))) && !left.contains(&(Api::CuMemAllocHost, Some(0))));
        assert_eq!(s.totals.kind(Kind::Device).total_frees, 1);
        assert_eq!(s.totals.kind(Kind::Pinned).total_frees, 1);
    }
}
