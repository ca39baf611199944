//! The versions of the report schema as a reader meets them (docs/report-format.md).
//!
//! - `leaktrace-report/1`: every stack lists its frames in full.
//! - `leaktrace-report/2`: the report has one `frames` table of distinct frames and
//!   every stack (`leaks[].stack`, `timeline.series[].stack`) lists indices into it.
//! - `leaktrace-report/3`: as 2; a frame may be a Python frame (`"python": true`, no
//!   address: its `function`, `file` and `line` are the Python code's, `offset` the
//!   instruction's byte offset in its code object). A reader of 2 would show such a
//!   frame as a native frame at address 0, hence the new major version.
//!
//! Readers of both turn a report into the version 1 shape with `inline_frames`, so that
//! everything after the parse sees frames in full.
use std::borrow::Cow;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Bytes and blocks: how every amount of memory in a report is written (`summary`'s
/// reachability, a leak group's, a check's). The library writes it and the command
/// reads it with this one type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Amount {
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub blocks: u64,
}

impl Amount {
    pub fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
        self.blocks += 1;
    }
}

/// LeakSanitizer's classes of outstanding memory, as the pointer scan found them:
/// `{definite, indirect, reachable}`, each an `Amount`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reachability {
    #[serde(default)]
    pub definite: Amount,
    #[serde(default)]
    pub indirect: Amount,
    #[serde(default)]
    pub reachable: Amount,
}

impl std::ops::AddAssign for Amount {
    fn add_assign(&mut self, other: Amount) {
        self.bytes += other.bytes;
        self.blocks += other.blocks;
    }
}

impl std::ops::AddAssign for Reachability {
    fn add_assign(&mut self, other: Reachability) {
        self.definite += other.definite;
        self.indirect += other.indirect;
        self.reachable += other.reachable;
    }
}

impl Reachability {
    /// Everything outstanding: definite + indirect + reachable.
    pub fn outstanding(&self) -> Amount {
        let mut all = self.leaked();
        all += self.reachable;
        all
    }

    /// Definite + indirect: what counts as leaked.
    pub fn leaked(&self) -> Amount {
        Amount { bytes: self.definite.bytes.saturating_add(self.indirect.bytes), blocks: self.definite.blocks.saturating_add(self.indirect.blocks) }
    }
}

/// A name the library writes from a fixed set (`kind`, `api`, `reason`, ...): borrowed
/// when written, owned when read.
pub type Name = Cow<'static, str>;

/// An address: written as a hex string ("0x7f..."), as the report has always had it.
mod hex_addr {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:#x}"))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Text(String),
            Number(u64),
        }
        match Either::deserialize(d)? {
            Either::Number(n) => Ok(n),
            Either::Text(t) => {
                let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(&t);
                if digits.is_empty() {
                    return Ok(0);
                }
                u64::from_str_radix(digits, 16).map_err(|_| serde::de::Error::custom(format!("{t:?} is not a hex address")))
            }
        }
    }
}

/// One frame of a stack, innermost first. A native frame has its return address and,
/// once symbolized, module+offset, function, file and line (`inlined`: a function that
/// the compiler inlined into the next frame). A Python frame (`python`) has no address:
/// its `function`, `file` and `line` are the Python code's and `offset` the instruction's
/// byte offset in its code object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    #[serde(default, with = "hex_addr")]
    pub ip: u64,
    #[serde(default)]
    pub module: Option<Arc<str>>,
    #[serde(default)]
    pub offset: Option<u64>,
    #[serde(default)]
    pub function: Option<Arc<str>>,
    #[serde(default)]
    pub file: Option<Arc<str>>,
    #[serde(default)]
    pub line: Option<u32>,
    #[serde(default)]
    pub inlined: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub python: bool,
}

/// A stack as a reader holds it: its frames in full.
pub type Inline = Vec<Frame>;
/// A stack as the library writes it (schema 2+): indices into the report's `frames`.
pub type Indexed = Vec<u32>;

/// Memory outstanding from one call stack, entry point and device. `S` is how its stack
/// is held (`Inline` or `Indexed`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct Group<S = Inline> {
    pub kind: Name,
    pub api: Name,
    /// CUDA device ordinal (device-side groups, when known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    /// The caching allocator that holds this memory (PyTorch's, TensorFlow's): not a
    /// leak by default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_by: Option<Name>,
    pub bytes: u64,
    pub blocks: u64,
    #[serde(default)]
    pub peak_bytes: u64,
    #[serde(default)]
    pub total_allocs: u64,
    #[serde(default)]
    pub total_bytes: u64,
    #[serde(default)]
    pub stack_id: u32,
    /// What the pointer scan found (absent without a scan).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reachability: Option<Reachability>,
    /// Its indirect leaks by the definite leak each hangs from (that leak's stack): a
    /// suppressed leak hides them with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub indirect_from: Vec<IndirectFrom>,
    #[serde(default)]
    pub stack: S,
    /// For reachable memory the report shows: what keeps its largest reachable block
    /// alive, one link per holder from the block out to a root (`HeldLink`). Empty
    /// without a scan, for leaked memory, and for groups the scan was not asked about.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_by: Vec<HeldLink<S>>,
    /// When the blocks looked at for `held_by` are not all held by one thing: the second
    /// most common holder, and how many of them each holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub also_held_by: Option<OtherHolder<S>>,
}

/// The second holder of a group's memory (`also_held_by`): of the `looked_at` blocks
/// drawn from the group for its holder, `held_by_blocks` are held by the path shown as
/// `held_by`, `blocks` by this one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct OtherHolder<S = Inline> {
    pub blocks: u32,
    pub held_by_blocks: u32,
    pub looked_at: u32,
    pub held_by: Vec<HeldLink<S>>,
}

impl<S> OtherHolder<S> {
    /// The same holder with its links' stacks held as `f` makes them.
    pub fn map_stacks<T>(&self, mut f: impl FnMut(&S) -> T) -> OtherHolder<T> {
        OtherHolder {
            blocks: self.blocks,
            held_by_blocks: self.held_by_blocks,
            looked_at: self.looked_at,
            held_by: self.held_by.iter().map(|l| l.map_stack(&mut f)).collect(),
        }
    }
}

/// One link of a path from a reachable block out to the root that keeps it: what holds
/// the reference to the step before (the block itself, for the first link) and where in
/// it. `kind` says what the holder is:
/// - a tracked block: its kind of memory (`host`, `pinned`, `mmap`, ...), with `api`,
///   `size`, `stack_id` and `stack` (where it was allocated); `offset` is the
///   reference's byte offset in it;
/// - `global`: a module's global or static variable, `symbol` (when the module's symbol
///   tables name it) and `module`; `offset` inside the symbol (or the module's data);
/// - `stack` / `registers`: a thread's (`thread`: its kernel id), with the `function`
///   whose frame holds it when the unwinder knows;
/// - `tls`, `root_region` (LeakSanitizer's registered regions, ignored blocks),
///   `inherited` (a block of the parent process), `cuda_library`;
/// - `python_object`: a Python object (`type_name`; none for a raw block of the
///   interpreter's, as a small dict's entries or a short list's items) in pymalloc's
///   arenas, `symbol` the module's name for a module;
/// - `elided`: `elided` links of a long chain left out here (a long linked list);
/// - `unscanned`: kept without a scan finding it (an ignored block, the loader's).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct HeldLink<S = Inline> {
    pub kind: Name,
    #[serde(default)]
    pub offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<Name>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack_id: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symbol: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module: Option<Arc<str>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thread: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub type_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elided: Option<u64>,
    /// The dict key whose value is the reference (the holder is a dict's entries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The reference is one of a Python object's attributes (kept in values beside it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attribute: bool,
    /// The word points this many bytes into what it holds, not to its start: a
    /// reference a person would not count on (an old pointer, a value that only looks
    /// like one); the path is then uncertain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub into: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack: Option<S>,
}

impl<S> HeldLink<S> {
    /// The same link with its stack held as `f` makes it.
    pub fn map_stack<T>(&self, f: impl FnOnce(&S) -> T) -> HeldLink<T> {
        HeldLink {
            kind: self.kind.clone(),
            offset: self.offset,
            api: self.api.clone(),
            size: self.size,
            stack_id: self.stack_id,
            symbol: self.symbol.clone(),
            module: self.module.clone(),
            thread: self.thread,
            function: self.function.clone(),
            type_name: self.type_name.clone(),
            elided: self.elided,
            key: self.key.clone(),
            attribute: self.attribute,
            into: self.into,
            stack: self.stack.as_ref().map(f),
        }
    }
}

impl<S> Group<S> {
    /// The same group with its stack held as `stack`.
    pub fn with_stack<T>(&self, stack: T) -> Group<T> {
        Group {
            kind: self.kind.clone(),
            api: self.api.clone(),
            device: self.device,
            cached_by: self.cached_by.clone(),
            bytes: self.bytes,
            blocks: self.blocks,
            peak_bytes: self.peak_bytes,
            total_allocs: self.total_allocs,
            total_bytes: self.total_bytes,
            stack_id: self.stack_id,
            reachability: self.reachability,
            indirect_from: self.indirect_from.clone(),
            stack,
            held_by: Vec::new(),
            also_held_by: None,
        }
    }

    /// `kind`, with the device for device-side groups: "device, device 1".
    pub fn kind_label(&self) -> String {
        match self.device {
            Some(d) => format!("{}, device {d}", self.kind),
            None => self.kind.to_string(),
        }
    }

    /// What counts as leaked: definite + indirect with a scan, else all of it.
    pub fn leaked(&self) -> Amount {
        match self.reachability {
            Some(r) => r.leaked(),
            None => Amount { bytes: self.bytes, blocks: self.blocks },
        }
    }
}

/// Indirect leaks of a group that hang from the definite leaks of one stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IndirectFrom {
    pub stack_id: u32,
    pub bytes: u64,
    pub blocks: u64,
}

/// One kind of memory (host, device, pinned, ...) over the whole process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindTotals {
    #[serde(default)]
    pub live_bytes: u64,
    #[serde(default)]
    pub live_blocks: u64,
    #[serde(default)]
    pub total_allocs: u64,
    #[serde(default)]
    pub total_frees: u64,
    #[serde(default)]
    pub peak_live_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reachability: Option<Reachability>,
}

/// Groups beyond the report's limit (`LEAKTRACE_REPORT_GROUPS`): counted, not listed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Omitted {
    #[serde(default)]
    pub groups: u64,
    #[serde(default)]
    pub bytes: u64,
    #[serde(default)]
    pub blocks: u64,
    /// Of those, leaked: definite + indirect with a scan, else everything.
    #[serde(default)]
    pub leaked_bytes: u64,
    #[serde(default)]
    pub leaked_blocks: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    pub host: KindTotals,
    #[serde(default)]
    pub device: KindTotals,
    #[serde(default)]
    pub pinned: KindTotals,
    #[serde(default)]
    pub managed: KindTotals,
    #[serde(default)]
    pub reservation: KindTotals,
    #[serde(default)]
    pub mapping: KindTotals,
    /// Python objects, estimated from a sample by bytes (schema 3, added 2026-11).
    #[serde(default)]
    pub python: KindTotals,
    /// The program's own anonymous mappings (schema 3, added 2026-11).
    #[serde(default)]
    pub mmap: KindTotals,
    /// Outstanding memory held by known caching allocators (also inside the kinds above).
    #[serde(default)]
    pub cached: Amount,
    /// Groups outstanding but not listed in `leaks` (over `LEAKTRACE_REPORT_GROUPS`).
    #[serde(default)]
    pub omitted: Omitted,
    #[serde(default)]
    pub leak_groups: usize,
}

/// How the library itself fared.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Diagnostics {
    #[serde(default)]
    pub host_tracking: String,
    #[serde(default)]
    pub events: u64,
    #[serde(default)]
    pub buffer_full_waits: u64,
    #[serde(default)]
    pub rings_grown: u64,
    #[serde(default)]
    pub unknown_frees: u64,
    /// Blocks freed by their own thread while their allocation's event still waited in
    /// that thread's ring: the allocation and the free came to the collector as one
    /// event (counted in `events` once, in the totals as both).
    #[serde(default)]
    pub merged_frees: u64,
    /// Blocks of the program's that the C library freed on the library's own threads
    /// or inside its untracked steps (a dead thread's dynamic TLS): applied as frees.
    #[serde(default)]
    pub frees_on_library_threads: u64,
    /// Frees on the library's threads that found no room in their ring without waiting:
    /// those blocks stay in the books.
    #[serde(default)]
    pub releases_dropped: u64,
    #[serde(default)]
    pub stacks_interned: u64,
    #[serde(default)]
    pub stack_table_overflows: u64,
    #[serde(default)]
    pub cuda_untracked_copies: u64,
    /// What the holder searches through Python objects cost this process image; absent
    /// when none made a round (added without a major version change).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_searches: Option<HolderSearches>,
}

/// The holder searches' cost (`diagnostics.holder_searches`): those made on a thread of
/// leaktrace's while the program ran, and those at Python's exit, on its main thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderSearches {
    /// Searches started while the program ran, each on a thread of leaktrace's.
    #[serde(default)]
    pub searches: u64,
    /// Their rounds (one pass over the live Python objects and heap blocks each), and
    /// what those rounds read of the program's memory.
    #[serde(default)]
    pub rounds: u64,
    #[serde(default)]
    pub bytes_read: u64,
    /// CPU time of the threads that made those searches.
    #[serde(default)]
    pub cpu_ms: u64,
    /// The rounds at Python's exit (the atexit callback, on the program's main thread),
    /// what they read, and the wall time of that whole step (its scan too), which the
    /// program's exit waited for.
    #[serde(default)]
    pub exit_rounds: u64,
    #[serde(default)]
    pub exit_bytes_read: u64,
    #[serde(default)]
    pub exit_ms: u64,
}

/// The pointer scan of this report: whether it ran, and what it measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scan {
    #[serde(default)]
    pub ran: bool,
    #[serde(default)]
    pub duration_ms: u64,
    #[serde(default)]
    pub threads: usize,
    #[serde(default)]
    pub threads_stopped: usize,
    /// Threads that block the stop signal: their stacks were copied while they slept.
    #[serde(default)]
    pub threads_copied: usize,
    #[serde(default)]
    pub root_bytes: u64,
    #[serde(default)]
    pub heap_bytes: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tool {
    #[serde(default)]
    pub name: Name,
    #[serde(default)]
    pub version: Name,
}

/// A forked child's inheritance from its parent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fork {
    #[serde(default)]
    pub forked_from_pid: Option<u32>,
    #[serde(default)]
    pub inherited_live_bytes: u64,
    #[serde(default)]
    pub inherited_live_blocks: u64,
    #[serde(default)]
    pub inherited_frees: u64,
    /// A process started in standby and switched on (`leaktrace attach`) at this time:
    /// the `inherited_*` blocks are those live then, never a leak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switched_on_unix_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Config {
    #[serde(default)]
    pub stack_depth: usize,
    #[serde(default)]
    pub interval_ms: u64,
}

/// One periodic snapshot of the whole process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Point {
    pub unix_ms: u64,
    pub live_bytes: u64,
    #[serde(default)]
    pub live_blocks: u64,
    /// The process's memory by part at this point (`crate::memory::Memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::Memory>,
}

/// Live bytes of one followed stack at each point.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct Series<S = Inline> {
    pub kind: Name,
    pub api: Name,
    pub stack_id: u32,
    /// None when a leak group of the same report has this `stack_id` (and so the stack).
    #[serde(default)]
    pub stack: Option<S>,
    pub bytes: Vec<u64>,
    /// What keeps the stack's memory alive at the final report (`Group::held_by`),
    /// for a growing stack that is not among the listed groups.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_by: Vec<HeldLink<S>>,
    /// As `Group::also_held_by`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub also_held_by: Option<OtherHolder<S>>,
}

/// Live bytes by a line of the user's own Python code (Python processes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct LineSeries<S = Inline> {
    #[serde(default)]
    pub function: String,
    #[serde(default)]
    pub file: String,
    #[serde(default)]
    pub line: u32,
    pub bytes: Vec<u64>,
    /// For a line whose memory grew: what holds the largest part of it, found while the
    /// program still held it (as `Group::held_by`).
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub held_by: Vec<HeldLink<S>>,
    /// As `Group::also_held_by`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub also_held_by: Option<OtherHolder<S>>,
}

impl<S> LineSeries<S> {
    /// The same line with its holders' stacks held as `stack` gives them.
    pub fn map_stacks<T>(&self, mut stack: impl FnMut(&S) -> T) -> LineSeries<T> {
        LineSeries {
            function: self.function.clone(),
            file: self.file.clone(),
            line: self.line,
            bytes: self.bytes.clone(),
            held_by: self.held_by.iter().map(|l| l.map_stack(&mut stack)).collect(),
            also_held_by: self.also_held_by.as_ref().map(|o| o.map_stacks(&mut stack)),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct Timeline<S = Inline> {
    #[serde(default)]
    pub points: Vec<Point>,
    #[serde(default = "Vec::new")]
    pub series: Vec<Series<S>>,
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub lines: Vec<LineSeries<S>>,
}

/// What a leak check looked at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Blocks allocated since the last `leaktrace_mark`.
    #[default]
    Region,
    /// Every outstanding block (LeakSanitizer's on-demand check).
    All,
}

/// One leak check (`leaktrace_snapshot(label)`, a pytest test): what the scan found
/// among the blocks of its region.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct Check<S = Inline> {
    pub label: String,
    #[serde(default)]
    pub unix_ms: u64,
    #[serde(default)]
    pub scope: Scope,
    /// What the scan found among the blocks checked (suppressed leaks left out), as
    /// `definite`, `indirect`, `reachable` at the top of the check.
    #[serde(flatten)]
    pub found: Reachability,
    /// Leaks the suppressions hid (with the indirect leaks hanging from them).
    #[serde(default)]
    pub suppressed: Amount,
    /// Groups with leaked blocks, after suppressions.
    #[serde(default)]
    pub leak_groups: usize,
    /// The largest of them.
    #[serde(default = "Vec::new")]
    pub leaks: Vec<CheckLeak<S>>,
    /// With `LEAKTRACE_WHY_REACHABLE`: the checked blocks of the groups it names that
    /// the scan found reachable, each with the path that keeps it.
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub why_reachable: Vec<WhyReachable<S>>,
}

/// One reachable block and the path of references the scan followed to it
/// (`LEAKTRACE_WHY_REACHABLE=PATTERN`, `leaktrace run --why-reachable PATTERN`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct WhyReachable<S = Inline> {
    #[serde(default)]
    pub kind: Name,
    #[serde(default)]
    pub api: Name,
    #[serde(default)]
    pub address: u64,
    #[serde(default)]
    pub size: u64,
    /// The block's allocation stack (its group's).
    #[serde(default)]
    pub stack_id: u32,
    #[serde(default)]
    pub stack: S,
    /// From the word that holds the block out to its root, as `Group::held_by`.
    #[serde(default)]
    pub held_by: Vec<HeldLink<S>>,
}

impl<S> WhyReachable<S> {
    /// The same block with its stacks held as `stack` gives them.
    pub fn map_stacks<T>(&self, mut stack: impl FnMut(&S) -> T) -> WhyReachable<T> {
        WhyReachable {
            kind: self.kind.clone(),
            api: self.api.clone(),
            address: self.address,
            size: self.size,
            stack_id: self.stack_id,
            stack: stack(&self.stack),
            held_by: self.held_by.iter().map(|l| l.map_stack(&mut stack)).collect(),
        }
    }
}

impl<S> Check<S> {
    /// The same check with every stack it holds (its leaks', its `why_reachable`
    /// blocks' and their holders') held as `stack` gives it.
    pub fn with_stacks<T>(&self, mut stack: impl FnMut(&S) -> T) -> Check<T> {
        Check {
            label: self.label.clone(),
            unix_ms: self.unix_ms,
            scope: self.scope,
            found: self.found,
            suppressed: self.suppressed,
            leak_groups: self.leak_groups,
            leaks: self
                .leaks
                .iter()
                .map(|l| CheckLeak {
                    kind: l.kind.clone(),
                    api: l.api.clone(),
                    device: l.device,
                    reachability: l.reachability,
                    stack_id: l.stack_id,
                    stack: stack(&l.stack),
                })
                .collect(),
            why_reachable: self.why_reachable.iter().map(|w| w.map_stacks(&mut stack)).collect(),
        }
    }

    /// Definite + indirect bytes: what counts against a test.
    pub fn leaked_bytes(&self) -> u64 {
        self.found.leaked().bytes
    }

    pub fn leaked_blocks(&self) -> u64 {
        self.found.leaked().blocks
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct CheckLeak<S = Inline> {
    #[serde(default)]
    pub kind: Name,
    #[serde(default)]
    pub api: Name,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<u32>,
    #[serde(default)]
    pub reachability: Reachability,
    #[serde(default)]
    pub stack_id: u32,
    #[serde(default)]
    pub stack: S,
}

/// A whole report file. The library writes `Report<Indexed>` (stacks as indices into
/// `frames`); `leaktrace` reads `Report<Inline>` after `inline_frames`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(bound(serialize = "S: Serialize", deserialize = "S: Deserialize<'de> + Default"))]
pub struct Report<S = Inline> {
    pub schema: Name,
    #[serde(default)]
    pub tool: Tool,
    pub pid: u32,
    #[serde(default)]
    pub ppid: u32,
    #[serde(default)]
    pub exe: String,
    #[serde(default)]
    pub argv: Vec<String>,
    /// `periodic`, `exit`, `signal`, `snapshot`, ...
    pub reason: Name,
    /// The signal that ended the process, when the final report was written for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_signal: Option<i32>,
    /// Present when this process can never be given a final report: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_final_report: Option<Name>,
    #[serde(default)]
    pub started_unix_ms: u64,
    #[serde(default)]
    pub written_unix_ms: u64,
    #[serde(default)]
    pub fork: Fork,
    /// Where it ran in a distributed job: rank, local rank, world size, host, job
    /// (`crate::launch`). Absent outside one (added without a major version change).
    #[serde(default, skip_serializing_if = "is_default_launch")]
    pub launch: crate::launch::Launch,
    #[serde(default)]
    pub config: Config,
    pub summary: Summary,
    #[serde(default)]
    pub diagnostics: Diagnostics,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scan: Option<Scan>,
    /// The process's memory by part when the report was written: where every byte of
    /// its RSS is (`crate::memory::Memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<crate::memory::Memory>,
    /// The distinct frames that `Indexed` stacks refer to, before them for readers that
    /// stream. Inlined stacks leave it as it was read.
    #[serde(default)]
    pub frames: Vec<Frame>,
    #[serde(default = "Timeline::default")]
    pub timeline: Timeline<S>,
    #[serde(default = "Vec::new")]
    pub leaks: Vec<Group<S>>,
    /// The checks the program asked for, oldest first.
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<Check<S>>,
    /// Checks over the kept number, counted only.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub checks_dropped: u64,
    /// With `LEAKTRACE_WHY_REACHABLE`: the reachable blocks of the groups it names
    /// (in a report the scan ran for), each with the path that keeps it.
    #[serde(default = "Vec::new", skip_serializing_if = "Vec::is_empty")]
    pub why_reachable: Vec<WhyReachable<S>>,
    /// Where a reader found it (not part of the file).
    #[serde(skip)]
    pub path: std::path::PathBuf,
}

impl<S> Report<S> {
    /// A short name for the process: "python3 (pid 123)".
    pub fn label(&self) -> String {
        let name = std::path::Path::new(&self.exe).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "?".into());
        match self.launch.describe() {
            // A forked worker inherits its rank's variables: it is that rank's worker.
            Some(place) if self.fork.forked_from_pid.is_some() && self.launch.rank.is_some() => {
                format!("{name} (pid {}, worker of {place})", self.pid)
            }
            Some(place) => format!("{name} (pid {}, {place})", self.pid),
            None => format!("{name} (pid {})", self.pid),
        }
    }
}

impl Report<Inline> {
    /// The stack of a timeline series: its own, or that of the leak group it names.
    pub fn series_stack<'a>(&'a self, s: &'a Series) -> &'a [Frame] {
        match &s.stack {
            Some(st) => st,
            None => self.leaks.iter().find(|g| g.stack_id == s.stack_id).map(|g| g.stack.as_slice()).unwrap_or(&[]),
        }
    }
}

/// For `skip_serializing_if`: a count or size of zero.
pub fn is_zero<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

pub const SCHEMA_PREFIX: &str = "leaktrace-report/";
/// The major version the library writes.
pub const CURRENT_MAJOR: u32 = 3;
/// The major versions `inline_frames` reads.
pub const READABLE_MAJORS: [u32; 3] = [1, 2, 3];

/// The major version of a report's `schema` field: `None` when the field is missing or
/// is not `leaktrace-report/<number>`.
pub fn major_of(report: &Value) -> Option<u32> {
    report.get("schema")?.as_str()?.strip_prefix(SCHEMA_PREFIX)?.parse().ok()
}

/// Replaces every stack's frame indices by the frames of the report's table (versions 2, 3);
/// a version 1 report is left as it is. The error says which stack refers to what.
pub fn inline_frames(report: &mut Value) -> Result<(), String> {
    if !matches!(major_of(report), Some(2 | 3)) {
        return Ok(());
    }
    let table = match report.get_mut("frames").map(Value::take) {
        Some(Value::Array(frames)) => frames,
        Some(Value::Null) | None => Vec::new(),
        Some(_) => return Err("\"frames\" is not a list".into()),
    };
    let expand = |stack: &mut Value, owner: &str| -> Result<(), String> {
        let Value::Array(items) = stack else {
            return if stack.is_null() { Ok(()) } else { Err(format!("the stack of {owner} is not a list")) };
        };
        for item in items.iter_mut() {
            let frame = item
                .as_u64()
                .and_then(|i| table.get(usize::try_from(i).ok()?))
                .ok_or_else(|| format!("the stack of {owner} refers to frame {item}, but the frame table has {} frames", table.len()))?;
            *item = frame.clone();
        }
        Ok(())
    };
    let expand_links = |owner: &mut Value, what: &str| -> Result<(), String> {
        if let Some(Value::Array(links)) = owner.get_mut("held_by") {
            for (k, l) in links.iter_mut().enumerate() {
                if let Some(stack) = l.get_mut("stack") {
                    expand(stack, &format!("{what} held_by link {k}"))?;
                }
            }
        }
        if let Some(Value::Array(links)) = owner.get_mut("also_held_by").and_then(|o| o.get_mut("held_by")) {
            for (k, l) in links.iter_mut().enumerate() {
                if let Some(stack) = l.get_mut("stack") {
                    expand(stack, &format!("{what} also_held_by link {k}"))?;
                }
            }
        }
        Ok(())
    };
    if let Some(Value::Array(groups)) = report.get_mut("leaks") {
        for (i, g) in groups.iter_mut().enumerate() {
            if let Some(stack) = g.get_mut("stack") {
                expand(stack, &format!("leak group {i}"))?;
            }
            expand_links(g, &format!("leak group {i}"))?;
        }
    }
    if let Some(Value::Array(series)) = report.get_mut("timeline").and_then(|t| t.get_mut("series")) {
        for (i, s) in series.iter_mut().enumerate() {
            if let Some(stack) = s.get_mut("stack") {
                expand(stack, &format!("timeline series {i}"))?;
            }
            expand_links(s, &format!("timeline series {i}"))?;
        }
    }
    if let Some(Value::Array(lines)) = report.get_mut("timeline").and_then(|t| t.get_mut("lines")) {
        for (i, l) in lines.iter_mut().enumerate() {
            expand_links(l, &format!("timeline line {i}"))?;
        }
    }
    let expand_why = |owner: &mut Value, what: &str| -> Result<(), String> {
        if let Some(Value::Array(blocks)) = owner.get_mut("why_reachable") {
            for (k, b) in blocks.iter_mut().enumerate() {
                if let Some(stack) = b.get_mut("stack") {
                    expand(stack, &format!("{what} why_reachable block {k}"))?;
                }
                expand_links(b, &format!("{what} why_reachable block {k}"))?;
            }
        }
        Ok(())
    };
    if let Some(Value::Array(checks)) = report.get_mut("checks") {
        for (i, c) in checks.iter_mut().enumerate() {
            if let Some(Value::Array(leaks)) = c.get_mut("leaks") {
                for (j, l) in leaks.iter_mut().enumerate() {
                    if let Some(stack) = l.get_mut("stack") {
                        expand(stack, &format!("check {i} leak {j}"))?;
                    }
                }
            }
            expand_why(c, &format!("check {i}"))?;
        }
    }
    expand_why(report, "the report")?;
    report["frames"] = Value::Array(table);
    Ok(())
}

impl Report<Indexed> {
    /// The report with every stack's frames written out from its table: the frames'
    /// names are shared (`Arc<str>`), so this costs a reference count per frame, where
    /// `inline_frames` copies each frame's JSON object. `None` when a stack refers to a
    /// frame the table does not have (`inline_frames` then says which).
    pub fn inline(self) -> Option<Report<Inline>> {
        let table = &self.frames;
        let mut bad = false;
        let mut stack = |ix: &Indexed| -> Inline {
            ix.iter()
                .map(|&i| {
                    table.get(i as usize).cloned().unwrap_or_else(|| {
                        bad = true;
                        Frame::default()
                    })
                })
                .collect()
        };
        let leaks: Vec<Group<Inline>> = self
            .leaks
            .iter()
            .map(|g| {
                let mut out = g.with_stack(stack(&g.stack));
                out.held_by = g.held_by.iter().map(|l| l.map_stack(&mut stack)).collect();
                out.also_held_by = g.also_held_by.as_ref().map(|o| o.map_stacks(&mut stack));
                out
            })
            .collect();
        let series = self
            .timeline
            .series
            .iter()
            .map(|s| Series {
                kind: s.kind.clone(),
                api: s.api.clone(),
                stack_id: s.stack_id,
                stack: s.stack.as_ref().map(&mut stack),
                bytes: s.bytes.clone(),
                held_by: s.held_by.iter().map(|l| l.map_stack(&mut stack)).collect(),
                also_held_by: s.also_held_by.as_ref().map(|o| o.map_stacks(&mut stack)),
            })
            .collect();
        let lines = self.timeline.lines.iter().map(|l| l.map_stacks(&mut stack)).collect();
        let checks = self.checks.iter().map(|c| c.with_stacks(&mut stack)).collect();
        let why_reachable = self.why_reachable.iter().map(|w| w.map_stacks(&mut stack)).collect();
        if bad {
            return None;
        }
        Some(Report {
            schema: self.schema,
            tool: self.tool,
            pid: self.pid,
            ppid: self.ppid,
            exe: self.exe,
            argv: self.argv,
            reason: self.reason,
            exit_signal: self.exit_signal,
            no_final_report: self.no_final_report,
            started_unix_ms: self.started_unix_ms,
            written_unix_ms: self.written_unix_ms,
            fork: self.fork,
            launch: self.launch,
            config: self.config,
            summary: self.summary,
            diagnostics: self.diagnostics,
            scan: self.scan,
            memory: self.memory,
            timeline: Timeline { points: self.timeline.points, series, lines },
            leaks,
            checks,
            checks_dropped: self.checks_dropped,
            why_reachable,
            path: self.path,
            frames: self.frames,
        })
    }
}

fn is_default_launch(l: &crate::launch::Launch) -> bool {
    l.rank.is_none() && l.world_size.is_none() && l.local_rank.is_none() && !l.launcher && l.job.is_none()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn amounts_read_what_they_write_and_missing_fields_are_zero() {
        let r = Reachability { definite: Amount { bytes: 7, blocks: 1 }, ..Default::default() };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(text, r#"{"definite":{"bytes":7,"blocks":1},"indirect":{"bytes":0,"blocks":0},"reachable":{"bytes":0,"blocks":0}}"#);
        assert_eq!(serde_json::from_str::<Reachability>(&text).unwrap(), r);
        assert_eq!(serde_json::from_str::<Reachability>(r#"{"indirect":{"bytes":3}}"#).unwrap().leaked(), Amount { bytes: 3, blocks: 0 });
        let mut sum = r;
        sum += Reachability { reachable: Amount { bytes: 5, blocks: 2 }, ..Default::default() };
        assert_eq!(sum.outstanding(), Amount { bytes: 12, blocks: 3 });
    }

    #[test]
    fn a_written_report_reads_back_with_its_stacks_inlined() {
        let frame = |ip, f: &str| Frame { ip, function: Some(f.into()), ..Default::default() };
        let series =
            |stack_id, stack| Series { kind: "host".into(), api: "malloc".into(), stack_id, stack, bytes: vec![1, 2], held_by: Vec::new(), also_held_by: None };
        let written = Report::<Indexed> {
            schema: format!("{SCHEMA_PREFIX}{CURRENT_MAJOR}").into(),
            pid: 7,
            reason: "exit".into(),
            summary: Summary { leak_groups: 1, ..Default::default() },
            frames: vec![frame(0x10, "leak"), frame(0x7f00_0000_0020, "main")],
            timeline: Timeline {
                points: vec![Point { unix_ms: 1, live_bytes: 64, live_blocks: 1, memory: None }],
                series: vec![series(3, None), series(4, Some(vec![1]))],
                lines: Vec::new(),
            },
            leaks: vec![Group { kind: "host".into(), api: "malloc".into(), bytes: 64, blocks: 1, stack_id: 3, stack: vec![0, 1], ..Default::default() }],
            checks: vec![Check {
                label: "t".into(),
                scope: Scope::All,
                leaks: vec![CheckLeak { stack: vec![1, 0], ..Default::default() }],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut v = serde_json::to_value(&written).unwrap();
        assert_eq!(v["frames"][1]["ip"], "0x7f0000000020");
        assert_eq!(v["checks"][0]["scope"], "all");
        assert!(v.get("checks_dropped").is_none() && v.get("path").is_none() && v["timeline"].get("lines").is_none());
        inline_frames(&mut v).unwrap();
        let read: Report = serde_json::from_value(v).unwrap();
        assert_eq!(read.leaks[0].stack, written.frames);
        assert_eq!(read.checks[0].leaks[0].stack, vec![written.frames[1].clone(), written.frames[0].clone()]);
        assert_eq!(read.series_stack(&read.timeline.series[0]), written.frames.as_slice(), "a series without a stack takes its group's");
        assert_eq!(read.series_stack(&read.timeline.series[1])[0].ip, 0x7f00_0000_0020);
        assert_eq!((read.pid, read.reason.as_ref(), read.summary.leak_groups, read.checks[0].scope), (7, "exit", 1, Scope::All));
    }

    #[test]
    fn addresses_read_as_hex_text_or_numbers() {
        let f: Frame = serde_json::from_str(r#"{"ip": "0xfF"}"#).unwrap();
        assert_eq!(f.ip, 255);
        let f: Frame = serde_json::from_str(r#"{"ip": 12, "function": "f"}"#).unwrap();
        assert_eq!((f.ip, f.function.as_deref()), (12, Some("f")));
        assert_eq!(serde_json::from_str::<Frame>("{}").unwrap(), Frame::default());
        assert!(serde_json::from_str::<Frame>(r#"{"ip": "0xzz"}"#).unwrap_err().to_string().contains("not a hex address"));
    }

    #[test]
    fn version_2_stacks_become_frames() {
        let mut r = json!({
            "schema": "leaktrace-report/2",
            "frames": [{"ip": "0x1", "function": "a"}, {"ip": "0x2", "function": "b"}],
            "timeline": {"series": [{"stack": null}, {"stack": [1]}]},
            "leaks": [{"stack": [0, 1]}, {"stack": []}],
            "checks": [{"label": "t", "leaks": [{"stack": [1, 0]}]}]
        });
        inline_frames(&mut r).unwrap();
        assert_eq!(r["checks"][0]["leaks"][0]["stack"][0]["function"], "b");
        assert_eq!(r["leaks"][0]["stack"][1]["function"], "b");
        assert_eq!(r["leaks"][1]["stack"], json!([]));
        assert!(r["timeline"]["series"][0]["stack"].is_null());
        assert_eq!(r["timeline"]["series"][1]["stack"][0]["ip"], "0x2");
    }

    #[test]
    fn version_1_is_left_alone_and_bad_indices_are_named() {
        let v1 = json!({"schema": "leaktrace-report/1", "leaks": [{"stack": [{"ip": "0x1"}]}]});
        let mut r = v1.clone();
        inline_frames(&mut r).unwrap();
        assert_eq!(r, v1);
        assert_eq!(major_of(&r), Some(1));
        let mut bad = json!({"schema": "leaktrace-report/2", "frames": [{}], "leaks": [{"stack": [0, 5]}]});
        let e = inline_frames(&mut bad).unwrap_err();
        assert!(e.contains("leak group 0") && e.contains("frame 5") && e.contains("has 1 frames"), "{e}");
        let mut bad = json!({"schema": "leaktrace-report/2", "frames": [{}], "leaks": [{"stack": [{"ip": "0x1"}]}]});
        assert!(inline_frames(&mut bad).is_err());
        let mut bad = json!({"schema": "leaktrace-report/2", "frames": 3});
        assert!(inline_frames(&mut bad).is_err());
        assert_eq!(major_of(&json!({"schema": "leaktrace-report/x"})), None);
    }
}
