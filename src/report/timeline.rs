//! Live memory over time, from every report written (periodic, snapshot, final) and
//! from the collector's points between reports (`config::point_period`): the process
//! totals, the live bytes of the stacks followed (the largest, and those that grow
//! steadily), and of each line of the user's Python code. The CLI's growth detection and
//! HTML chart read it from the report.
use crate::collector::state::{Change, Snapshot, Totals};
use crate::hotpath::event::Api;

/// Stacks followed at most; a stack joins when it is among the `JOIN_TOP` largest, or
/// among the `JOIN_GROWING` that grew most of those growing steadily, whatever their size
/// (a leak spread over dozens of small stacks is in none of the largest).
const MAX_SERIES: usize = 64;
pub const JOIN_TOP: usize = 16;
const JOIN_GROWING: usize = 16;
/// Bytes a stack holds at least to join at a point between reports (`join_rising`):
/// `reports::grew`'s least rise.
const JOIN_AT_POINT_MIN: u64 = 64 << 10;
/// Points in a row a stack rises at (by `JOIN_AT_POINT_MIN` at least) to join between
/// reports however little it holds (`join_rising`).
const RISES_TO_JOIN: u8 = 3;
/// Points kept; beyond, every other old point is dropped (the series stay aligned).
const MAX_POINTS: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Point {
    pub unix_ms: u64,
    pub live_bytes: u64,
    pub live_blocks: u64,
    /// The process's memory by part, measured with the point.
    pub memory: Option<leaktrace_common::memory::Memory>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Series {
    pub stack: u32,
    pub api: Api,
    /// Live bytes at each point (0 before the stack was followed, or when it had none).
    pub bytes: Vec<u64>,
    /// Its live bytes now (summed over devices), kept up by the changes between points.
    now: u64,
    /// The most it held at a point since it was followed (`join` keeps the series that
    /// held most: a leak freed at teardown is still the report's story).
    peak: u64,
}

/// The live bytes of every stack whose innermost frame in the user's own Python code
/// (not the standard library, not an installed package) is one line: a leak spread over
/// dozens of native stacks grows as one line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineSeries {
    pub line: super::python::UserLine,
    pub bytes: Vec<u64>,
}

/// Python lines followed at most.
const MAX_LINES: usize = 256;

/// Points come two ways (design.md, "Growth over time"): a report gives every live group
/// (`record`), from which the series and line sums are worked out afresh and the stacks
/// to follow chosen; a point between reports gives only the groups whose live bytes
/// changed since the last point (`record_changes`), which move those sums.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub points: Vec<Point>,
    pub series: Vec<Series>,
    pub lines: Vec<LineSeries>,
    /// Each stack's user line, by stack id (`shared_index`), worked out once:
    /// `LINE_UNKNOWN`, `NO_LINE` (no Python frame of the user's) or an index into
    /// `known_lines`, with `FIRST_CHILD` set for a first Python child. A vector, not a
    /// map: after `import torch` every snapshot looks up ~600k groups among 2M stacks,
    /// and a hash map's probes were most of the collector's time then. A native stack
    /// and its first child share a place: the first of them to be looked up keeps it,
    /// the other goes to `line_of_other`. In 16 bits a place while the lines fit
    /// (`LineMemo`).
    line_of: LineMemo,
    line_of_other: crate::util::FxMap<u32, u32>,
    /// The same by Python part (`python::python_part`): decoded once per part.
    line_of_part: crate::util::FxMap<u32, u32>,
    /// The distinct user lines met, and their indices.
    known_lines: Vec<super::python::UserLine>,
    index_of_line: crate::util::FxMap<super::python::UserLine, u32>,
    /// Live bytes under each known line now, by its index (slot 0 unused).
    line_now: Vec<u64>,
    /// The stacks not followed that rose at the last point, and at how many points in a
    /// row (`join_rising`; a report's point neither counts nor breaks a run).
    rises: crate::util::FxMap<Key, u8>,
}

/// A followed stack: its id and entry point (its devices add up).
type Key = (u32, Api);

const LINE_UNKNOWN: u32 = 0;
const NO_LINE: u32 = u32::MAX >> 1;
/// In `line_of`: the place is its first Python child's.
const FIRST_CHILD: u32 = 1 << 31;

/// `Timeline::line_of`: a place per stack, 16 bits each while every line index fits
/// them (after `import torch` 1.1M places, 4.4 MB resident in 32 bits; a program has a
/// few hundred user lines), then 32 bits for good. Answers and takes the 32-bit form
/// (`LINE_UNKNOWN`, `NO_LINE`, an index, `FIRST_CHILD`).
#[derive(Clone, Debug, Default)]
struct LineMemo {
    narrow: Vec<u16>,
    /// Once a line's index does not fit 15 bits: every place, in 32 bits.
    wide: Option<Vec<u32>>,
}

const NARROW_CHILD: u16 = 1 << 15;
const NARROW_NO_LINE: u16 = NARROW_CHILD - 1;

impl LineMemo {
    fn get(&self, slot: usize) -> u32 {
        if let Some(wide) = &self.wide {
            return wide.get(slot).copied().unwrap_or(LINE_UNKNOWN);
        }
        let v = self.narrow.get(slot).copied().unwrap_or(0);
        let line = match v & !NARROW_CHILD {
            NARROW_NO_LINE => NO_LINE,
            i => i as u32,
        };
        if v & NARROW_CHILD != 0 {
            line | FIRST_CHILD
        } else {
            line
        }
    }

    fn set(&mut self, slot: usize, value: u32) {
        let line = value & !FIRST_CHILD;
        if self.wide.is_none() && line != NO_LINE && line >= NARROW_NO_LINE as u32 {
            self.wide = Some((0..self.narrow.len()).map(|k| self.get(k)).collect());
            self.narrow = Vec::new();
        }
        if let Some(wide) = &mut self.wide {
            if wide.len() <= slot {
                crate::util::grow_zeroed(wide, (slot + 1).next_power_of_two());
            }
            wide[slot] = value;
            return;
        }
        if self.narrow.len() <= slot {
            // LINE_UNKNOWN is 0.
            crate::util::grow_zeroed(&mut self.narrow, (slot + 1).next_power_of_two());
        }
        let narrow = if line == NO_LINE { NARROW_NO_LINE } else { line as u16 };
        self.narrow[slot] = narrow | if value & FIRST_CHILD != 0 { NARROW_CHILD } else { 0 };
    }
}

impl Timeline {
    /// The memory measured with the last point.
    pub fn note_memory(&mut self, memory: leaktrace_common::memory::Memory) {
        // Only the last point keeps the tracer's memory by part (the exit summary names
        // its largest parts); the points before it drop theirs.
        let n = self.points.len();
        if let Some(m) = self.points.iter_mut().rev().nth(1).and_then(|p| p.memory.as_mut()) {
            m.tracer_parts = Vec::new();
        }
        debug_assert!(n == 0 || self.points[..n - 1].iter().all(|p| p.memory.as_ref().is_none_or(|m| m.tracer_parts.is_empty())));
        if let Some(p) = self.points.last_mut() {
            p.memory = Some(memory);
        }
    }

    /// A point from every live group (`snapshot`, sorted at least as `sort_top(JOIN_TOP)`
    /// leaves it), taken in the same hold of the collector as a `take_changes` whose
    /// changes are dropped: the sums start afresh from here.
    pub fn record(&mut self, unix_ms: u64, snapshot: &Snapshot) {
        let (keep, newcomers) = self.to_join(snapshot);
        // Followed series by index, then the newcomers after them: their bytes now come
        // from the same pass.
        let followed_len = self.series.len();
        let mut slot_of = self.followed();
        for (j, &k) in newcomers.iter().enumerate() {
            slot_of.insert(k, followed_len + j);
        }
        let mut newcomer_now = vec![0u64; newcomers.len()];
        for s in self.series.iter_mut() {
            s.now = 0;
        }
        self.line_now.iter_mut().for_each(|b| *b = 0);
        let python = crate::hotpath::python::enabled();
        // One pass over the groups (a process that imported PyTorch has half a million);
        // groups of one stack and api on several devices add up.
        for g in snapshot.groups.iter().filter(|g| g.live_bytes > 0) {
            match slot_of.get(&(g.stack, g.api())) {
                Some(&i) if i < followed_len => self.series[i].now += g.live_bytes,
                Some(&i) => newcomer_now[i - followed_len] += g.live_bytes,
                None => {}
            }
            if python {
                self.add_to_line(g.stack, g.live_bytes, 0);
            }
        }
        self.push_point(unix_ms, snapshot.totals.host());
        self.join(&keep, newcomers.into_iter().zip(newcomer_now));
    }

    /// A point from the groups that changed since the last point (`take_changes`), the
    /// totals now. A stack that rose to among the largest followed joins here, not only
    /// at the next report (`join_rising`).
    pub fn record_changes(&mut self, unix_ms: u64, totals: &Totals, changes: &[Change]) {
        let followed = self.followed();
        let python = crate::hotpath::python::enabled();
        let mut rising: crate::util::FxMap<Key, u64> = Default::default();
        for c in changes {
            match followed.get(&(c.stack, c.api)) {
                Some(&i) => {
                    let s = &mut self.series[i];
                    s.now = (s.now + c.now).saturating_sub(c.before);
                }
                None if c.now > c.before && c.now >= JOIN_AT_POINT_MIN => *rising.entry((c.stack, c.api)).or_default() += c.now,
                None => {}
            }
            if python {
                self.add_to_line(c.stack, c.now, c.before);
            }
        }
        self.push_point(unix_ms, totals.host());
        self.join_rising(rising);
    }

    /// Between reports, the stacks of `rising` (their bytes now; they rose since the last
    /// point and are not followed) that hold at least what the `JOIN_TOP`-th largest
    /// followed stack holds now, or that rose at the last `RISES_TO_JOIN` points in a
    /// row, join, the largest `JOIN_TOP` of them at most; once a report has followed
    /// `JOIN_TOP` stacks (before, an import's churn would fill every slot). Without this
    /// a stack that starts to grow after a report is followed only from the next one:
    /// with reports seconds apart (their cadence follows their cost), a loop of a few
    /// seconds had too few points to be seen growing, and its holders were not looked
    /// for while the program held them. Without the run of rises a small grower joined
    /// when it reached the largest, a point that moves with the machine's load: a loop
    /// that keeps its autograd graphs had a dozen stacks of ~1 MB judged growing on a
    /// quiet machine and not beside two busy loops (they joined 6 points before the
    /// end, and 8 are judged). A stack spread over several devices, of which only some
    /// changed, starts from those devices' bytes; the next report counts all of them.
    fn join_rising(&mut self, rising: crate::util::FxMap<Key, u64>) {
        let rises = rising.keys().map(|k| (*k, self.rises.get(k).map_or(1, |r| r.saturating_add(1)))).collect();
        self.rises = rises;
        // Before a report has chosen the largest (an import's first seconds), nothing.
        if rising.is_empty() || self.series.len() < JOIN_TOP {
            return;
        }
        let mut nows: Vec<(u64, Key)> = self.series.iter().map(|s| (s.now, (s.stack, s.api))).collect();
        nows.sort_unstable_by_key(|&n| std::cmp::Reverse(n));
        nows.truncate(JOIN_TOP);
        let bar = nows[JOIN_TOP - 1].0;
        let rose_long = |k: &Key| self.rises.get(k).is_some_and(|&r| r >= RISES_TO_JOIN);
        let mut newcomers: Vec<(Key, u64)> = rising.into_iter().filter(|&(k, now)| now >= bar || rose_long(&k)).collect();
        newcomers.sort_unstable_by_key(|&(k, now)| std::cmp::Reverse((now, k)));
        newcomers.truncate(JOIN_TOP);
        let keep: Vec<Key> = nows.iter().map(|&(_, k)| k).chain(newcomers.iter().map(|&(k, _)| k)).collect();
        self.join(&keep, newcomers.into_iter());
    }

    fn followed(&self) -> crate::util::FxMap<Key, usize> {
        self.series.iter().enumerate().map(|(i, s)| ((s.stack, s.api), i)).collect()
    }

    /// Moves the sum of `stack`'s user line (if it has one) from `before` to `now`.
    fn add_to_line(&mut self, stack: u32, now: u64, before: u64) {
        let i = self.line_index(stack);
        if i == NO_LINE {
            return;
        }
        if self.line_now.len() <= i as usize {
            self.line_now.resize(self.known_lines.len() + 1, 0);
        }
        let b = &mut self.line_now[i as usize];
        *b = (*b + now).saturating_sub(before);
    }

    /// Ends a point: the totals, each followed series' and line's bytes now, and the
    /// lines that hold something for the first time.
    fn push_point(&mut self, unix_ms: u64, host: &crate::collector::state::KindTotals) {
        if self.points.len() >= MAX_POINTS {
            self.thin();
        }
        self.points.push(Point { unix_ms, live_bytes: host.live_bytes, live_blocks: host.live_blocks, memory: None });
        for s in self.series.iter_mut() {
            s.bytes.push(s.now);
            s.peak = s.peak.max(s.now);
        }
        if crate::hotpath::python::enabled() {
            self.push_lines();
        }
    }

    /// The stacks to keep following (the `JOIN_TOP` largest: `snapshot.groups` is sorted
    /// largest first; and the `JOIN_GROWING` that grew most of those growing steadily),
    /// and those of them not followed yet, each once, in that order.
    fn to_join(&self, snapshot: &Snapshot) -> (Vec<Key>, Vec<Key>) {
        let mut growing: Vec<&crate::collector::state::GroupSnapshot> = snapshot.groups.iter().filter(|g| g.steady()).collect();
        growing.sort_by_key(|g| std::cmp::Reverse(g.steady_growth_kib));
        growing.truncate(JOIN_GROWING);
        let keep: Vec<Key> = snapshot.groups.iter().take(JOIN_TOP).chain(growing).map(|g| (g.stack, g.api())).collect();
        let mut newcomers: Vec<Key> = Vec::new();
        for &k in &keep {
            if !newcomers.contains(&k) && !self.series.iter().any(|s| (s.stack, s.api) == k) {
                newcomers.push(k);
            }
        }
        (keep, newcomers)
    }

    /// Follows `newcomers` (with their bytes now), this point their first. When every
    /// slot is taken (an import churns through many stacks before a training loop
    /// starts), a newcomer replaces a followed stack outside `keep` that holds less now
    /// than it (a leak that starts late, or grows slowly, still gets followed): of
    /// those, the one that held least at its peak, so that a stack that held much (a
    /// loop's tensors, freed when the interpreter tears down before the final report)
    /// keeps its series while stacks that held little are there to give way.
    fn join(&mut self, keep: &[Key], newcomers: impl Iterator<Item = (Key, u64)>) {
        let n = self.points.len();
        for ((stack, api), now) in newcomers {
            let mut bytes = vec![0; n - 1];
            bytes.push(now);
            let newcomer = Series { stack, api, bytes, now, peak: now };
            if self.series.len() < MAX_SERIES {
                self.series.push(newcomer);
                continue;
            }
            let weakest = self.series.iter().enumerate().filter(|(_, s)| s.now < now && !keep.contains(&(s.stack, s.api))).min_by_key(|(_, s)| s.peak);
            if let Some((i, _)) = weakest {
                self.series[i] = newcomer;
            }
        }
    }

    /// The user line of `stack` (its innermost frame in the user's own Python code).
    pub fn line_of_stack(&mut self, stack: u32) -> Option<super::python::UserLine> {
        match self.line_index(stack) {
            NO_LINE | LINE_UNKNOWN => None,
            i => self.known_lines.get(i as usize - 1).copied(),
        }
    }

    /// The user line of `stack` as `line_of` holds it (see there), worked out if new.
    fn line_index(&mut self, stack: u32) -> u32 {
        self.memo_line(stack, Self::work_out_line)
    }

    /// `line_of`'s answer for `stack`, or `work_out`'s, kept.
    #[inline]
    fn memo_line(&mut self, stack: u32, work_out: impl FnOnce(&mut Self, u32) -> u32) -> u32 {
        let slot = crate::hotpath::stacks::shared_index(stack);
        let tag = if crate::hotpath::stacks::is_first_child(stack) { FIRST_CHILD } else { 0 };
        let memo = self.line_of.get(slot);
        if memo != LINE_UNKNOWN {
            if memo & FIRST_CHILD == tag {
                return memo & !FIRST_CHILD;
            }
            if let Some(&found) = self.line_of_other.get(&stack) {
                return found;
            }
        }
        let found = work_out(self, stack);
        if memo == LINE_UNKNOWN {
            self.line_of.set(slot, found | tag);
        } else {
            self.line_of_other.insert(stack, found);
        }
        found
    }

    /// The user line of `stack` (as `line_index` answers), by its Python part.
    fn work_out_line(&mut self, stack: u32) -> u32 {
        match super::python::python_part(stack) {
            None => NO_LINE,
            Some(part) => match self.line_of_part.get(&part) {
                Some(&i) => i,
                None => {
                    let i = match super::python::user_line_of_part(part) {
                        None => NO_LINE,
                        Some(line) => *self.index_of_line.entry(line).or_insert_with(|| {
                            self.known_lines.push(line);
                            self.known_lines.len() as u32
                        }),
                    };
                    self.line_of_part.insert(part, i);
                    i
                }
            },
        }
    }

    /// Adds each followed line's bytes now as its point, and follows the lines that
    /// hold something for the first time (`n` points so far, this one included).
    fn push_lines(&mut self) {
        let n = self.points.len();
        self.line_now.resize(self.known_lines.len() + 1, 0);
        let mut is_followed = vec![false; self.line_now.len()];
        for s in self.lines.iter_mut() {
            let i = self.index_of_line.get(&s.line).map_or(0, |&i| i as usize);
            is_followed[i] = true;
            s.bytes.push(self.line_now[i]);
        }
        let mut newcomers: Vec<(super::python::UserLine, u64)> =
            self.line_now.iter().enumerate().skip(1).filter(|&(i, &b)| b > 0 && !is_followed[i]).map(|(i, &b)| (self.known_lines[i - 1], b)).collect();
        newcomers.sort_by_key(|e| std::cmp::Reverse(e.1));
        for (line, bytes) in newcomers {
            let mut v = vec![0; n - 1];
            v.push(bytes);
            if self.lines.len() < MAX_LINES {
                self.lines.push(LineSeries { line, bytes: v });
                continue;
            }
            // Full: a line that holds more now replaces the one that holds least.
            if let Some((i, least)) = self.lines.iter().enumerate().map(|(i, s)| (i, s.bytes.last().copied().unwrap_or(0))).min_by_key(|e| e.1) {
                if least < bytes {
                    self.lines[i] = LineSeries { line, bytes: v };
                }
            }
        }
    }

    fn thin(&mut self) {
        fn keep_odd<T: Clone>(v: &[T]) -> Vec<T> {
            // Keep the newest half at full resolution, every other point before it.
            let half = v.len() / 2;
            v[..half].iter().step_by(2).chain(v[half..].iter()).cloned().collect()
        }
        self.points = keep_odd(&self.points);
        for s in self.series.iter_mut() {
            s.bytes = keep_odd(&s.bytes);
        }
        for s in self.lines.iter_mut() {
            s.bytes = keep_odd(&s.bytes);
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_line_memo_answers_in_16_bits_and_widens_for_good_past_them() {
        let mut m = LineMemo::default();
        assert_eq!(m.get(5), LINE_UNKNOWN);
        for (slot, v) in [(0, NO_LINE), (1, NO_LINE | FIRST_CHILD), (2, 7), (3, 7 | FIRST_CHILD), (1000, NARROW_NO_LINE as u32 - 1)] {
            m.set(slot, v);
            assert_eq!(m.get(slot), v, "{slot}");
        }
        assert!(m.wide.is_none());
        assert_eq!(m.narrow.len(), 1024);
        // The first index past 15 bits: every place kept, in 32 bits from now on.
        m.set(2000, NARROW_NO_LINE as u32 | FIRST_CHILD);
        assert!(m.wide.is_some() && m.narrow.is_empty());
        for (slot, v) in [
            (0, NO_LINE),
            (1, NO_LINE | FIRST_CHILD),
            (2, 7),
            (3, 7 | FIRST_CHILD),
            (1000, NARROW_NO_LINE as u32 - 1),
            (2000, NARROW_NO_LINE as u32 | FIRST_CHILD),
            (4, LINE_UNKNOWN),
            (1 << 20, LINE_UNKNOWN),
        ] {
            assert_eq!(m.get(slot), v, "{slot}");
        }
        m.set(3000, 1 << 20);
        assert_eq!(m.get(3000), 1 << 20);
    }
    use super::*;
    use crate::collector::state::{GroupSnapshot, Totals};

    fn snap(groups: &[(u32, u64)]) -> Snapshot {
        let mut gs: Vec<GroupSnapshot> = groups.iter().map(|&(stack, bytes)| GroupSnapshot::new(stack, Api::Malloc, None, 0, bytes, 1)).collect();
        gs.sort_by_key(|g| std::cmp::Reverse(g.live_bytes));
        let total = groups.iter().map(|g| g.1).sum();
        let mut totals = Totals::default();
        totals.kinds[0].live_bytes = total;
        totals.kinds[0].live_blocks = groups.len() as u64;
        Snapshot { totals, groups: gs }
    }

    #[test]
    fn a_native_stack_and_its_first_python_child_keep_their_own_lines() {
        use crate::hotpath::stacks::CHILD_BASE;
        let mut t = Timeline::default();
        let never = |_: &mut Timeline, s: u32| panic!("stack {s:#x} worked out twice");
        // Either may come first; both answers stay, whatever they are.
        assert_eq!(t.memo_line(7, |_, _| NO_LINE), NO_LINE);
        assert_eq!(t.memo_line(CHILD_BASE + 7, |_, _| 3), 3);
        assert_eq!(t.memo_line(CHILD_BASE + 9, |_, _| 4), 4);
        assert_eq!(t.memo_line(9, |_, _| 5), 5);
        for _ in 0..2 {
            assert_eq!([7, CHILD_BASE + 7, CHILD_BASE + 9, 9].map(|s| t.memo_line(s, never)), [NO_LINE, 3, 4, 5]);
        }
        assert_eq!(t.line_of_other.len(), 2);
    }

    #[test]
    fn series_stay_aligned_with_points() {
        let mut t = Timeline::default();
        t.record(1, &snap(&[(1, 10)]));
        t.record(2, &snap(&[(1, 20), (2, 5)]));
        t.record(3, &snap(&[(2, 7)]));
        assert_eq!(t.points.len(), 3);
        assert_eq!(t.series.len(), 2);
        assert_eq!(t.series[0].bytes, vec![10, 20, 0]);
        assert_eq!(t.series[1].bytes, vec![0, 5, 7]);
        assert_eq!(t.points[1].live_bytes, 25);
    }

    #[test]
    fn points_from_changes_match_points_from_every_group() {
        // Two timelines over the same groups: one given every group at each point, the
        // other every group at a report and only the changes between.
        let mut rng = crate::test_rng::TestRng::new(0x71e);
        let mut c = crate::collector::state::Collector::new();
        let (mut full, mut incremental) = (Timeline::default(), Timeline::default());
        let mut live: Vec<u64> = Vec::new();
        let mut next = 0x10_000u64;
        let mut changes = Vec::new();
        for point in 0..300u64 {
            for _ in 0..rng.below(60) {
                if live.is_empty() || rng.below(3) > 0 {
                    let stack = 1 + rng.below(30) as u32 + if point > 150 { 100 } else { 0 };
                    c.apply(&crate::hotpath::event::Event {
                        kind: crate::hotpath::event::EventKind::Alloc,
                        api: Api::Malloc,
                        tid: 1,
                        stack,
                        addr: next,
                        size: 1 + rng.below(5000),
                    });
                    live.push(next);
                    next += 8192;
                } else {
                    let addr = live.swap_remove(rng.below(live.len() as u64) as usize);
                    c.apply(&crate::hotpath::event::Event { kind: crate::hotpath::event::EventKind::Free, api: Api::Malloc, tid: 1, stack: 0, addr, size: 0 });
                }
            }
            let mut snapshot = c.snapshot();
            snapshot.sort_top(JOIN_TOP);
            if point % 5 == 0 {
                c.advance_trends();
                c.settle_changes();
                incremental.record(point, &snapshot);
            } else {
                c.take_changes(&mut changes);
                incremental.record_changes(point, &c.totals(), &changes);
            }
            full.record(point, &snapshot);
            // Every followed stack's bytes now are its groups' (whether it joined at a
            // report or at a point).
            for s in &incremental.series {
                let now: u64 = snapshot.groups.iter().filter(|g| (g.stack, g.api()) == (s.stack, s.api)).map(|g| g.live_bytes).sum();
                assert_eq!(s.bytes.last(), Some(&now), "point {point} stack {}", s.stack);
            }
            assert_eq!(incremental.points, full.points);
        }
        assert!(incremental.series.len() > JOIN_TOP, "later stacks joined");
    }

    #[test]
    fn a_stack_that_held_most_keeps_its_series_when_it_is_freed_before_the_last_report() {
        let mut t = Timeline::default();
        // Every slot taken by an import's stacks (10 KB each, then nothing).
        let churn = MAX_SERIES as u32 / JOIN_TOP as u32;
        for k in 0..churn {
            let groups: Vec<(u32, u64)> = (0..JOIN_TOP as u32).map(|i| (1000 + k * 100 + i, 10_000 - i as u64)).collect();
            t.record(k as u64, &snap(&groups));
        }
        assert_eq!(t.series.len(), MAX_SERIES);
        // Stack 7 (a loop's tensors) holds 90 MB, then teardown frees everything and the
        // last report sees newcomers of 50 KB.
        t.record(100, &snap(&[(7, 90 << 20)]));
        let late: Vec<(u32, u64)> = (0..JOIN_TOP as u32).map(|i| (5000 + i, 50_000)).collect();
        t.record(101, &snap(&late));
        let kept = t.series.iter().find(|s| s.stack == 7).expect("the series that held most is kept");
        assert_eq!(kept.bytes[kept.bytes.len() - 2..], [90 << 20, 0]);
        assert_eq!(t.series.len(), MAX_SERIES);
        assert!(late.iter().all(|&(stack, _)| t.series.iter().any(|s| s.stack == stack)), "the newcomers replaced stacks that held less");
    }

    #[test]
    fn a_small_steady_grower_still_gets_a_slot_from_stacks_that_held_much_but_hold_nothing_now() {
        let mut t = Timeline::default();
        // Every slot taken by an import's stacks of 1 MB each, all freed since.
        for k in 0..MAX_SERIES as u32 / JOIN_TOP as u32 {
            let groups: Vec<(u32, u64)> = (0..JOIN_TOP as u32).map(|i| (1000 + k * 100 + i, (1 << 20) - i as u64)).collect();
            t.record(k as u64, &snap(&groups));
        }
        assert_eq!(t.series.len(), MAX_SERIES);
        // Stack 7 grows by 2 KiB a report, steady from the third.
        for step in 0..6u64 {
            let mut s = snap(&[(7, 2048 * (step + 1))]);
            s.groups[0].steady_growth_kib = if step >= 3 { 2 * step as u32 } else { 0 };
            t.record(100 + step, &s);
        }
        let grower = t.series.iter().find(|s| s.stack == 7).expect("the small grower is followed");
        assert_eq!(grower.bytes[grower.bytes.len() - 3..], [4 * 2048, 5 * 2048, 6 * 2048]);
        assert_eq!(t.series.len(), MAX_SERIES);
    }

    /// A collector and its timeline after an import: `JOIN_TOP` + 4 stacks of 1 MB, flat,
    /// and a report that follows the largest; then allocations and points between
    /// reports.
    struct AfterAnImport {
        collector: crate::collector::state::Collector,
        timeline: Timeline,
        next: u64,
        changes: Vec<Change>,
    }

    impl AfterAnImport {
        fn new() -> Self {
            let mut run =
                AfterAnImport { collector: crate::collector::state::Collector::new(), timeline: Timeline::default(), next: 0x10_000, changes: Vec::new() };
            for i in 0..JOIN_TOP as u32 + 4 {
                run.alloc(100 + i, 1 << 20);
            }
            let mut snapshot = run.collector.snapshot();
            snapshot.sort_top(JOIN_TOP);
            run.collector.settle_changes();
            run.timeline.record(0, &snapshot);
            run
        }

        fn alloc(&mut self, stack: u32, size: u64) {
            let ev = crate::hotpath::event::Event { kind: crate::hotpath::event::EventKind::Alloc, api: Api::Malloc, tid: 1, stack, addr: self.next, size };
            self.collector.apply(&ev);
            self.next += size.next_multiple_of(4096);
        }

        /// A point between reports at `unix_ms`.
        fn point(&mut self, unix_ms: u64) {
            self.collector.take_changes(&mut self.changes);
            self.timeline.record_changes(unix_ms, &self.collector.totals(), &self.changes);
        }
    }

    #[test]
    fn a_stack_that_starts_growing_between_reports_is_followed_from_that_point() {
        let mut run = AfterAnImport::new();
        // Then, between reports, a loop's stack 7 grows by 512 KiB a point, and stack 8
        // by 8 KiB (never near the largest).
        for point in 1..=6u64 {
            run.alloc(7, 512 << 10);
            run.alloc(8, 8 << 10);
            run.point(point);
        }
        let t = run.timeline;
        let grown = t.series.iter().find(|s| s.stack == 7).expect("the loop's stack is followed before the next report");
        // It joined at the point where it reached the 16th largest (1 MB), the second.
        assert_eq!(grown.bytes, [0, 0, 1 << 20, 3 << 19, 2 << 20, 5 << 19, 3 << 20]);
        assert!(!t.series.iter().any(|s| s.stack == 8), "a small stack waits for the next report's trend");
        assert_eq!(t.series.len(), JOIN_TOP + 1);
        assert!(t.series.iter().all(|s| s.bytes.len() == t.points.len()));
    }

    #[test]
    fn a_small_stack_that_rises_at_points_in_a_row_joins_though_never_among_the_largest() {
        let mut run = AfterAnImport::new();
        // Between reports: stack 7 rises by 96 KiB at every point (far below the 16th
        // largest, 1 MB); stack 9 by as much at two points of every three.
        for point in 1..=8u64 {
            run.alloc(7, 96 << 10);
            if point % 3 != 0 {
                run.alloc(9, 96 << 10);
            }
            run.point(point);
        }
        let t = run.timeline;
        let grown = t.series.iter().find(|s| s.stack == 7).expect("the small riser is followed");
        // It joined at the third point it rose at, with what it held then.
        let kib96 = |n: u64| n * (96 << 10);
        assert_eq!(grown.bytes, [0, 0, 0, kib96(3), kib96(4), kib96(5), kib96(6), kib96(7), kib96(8)]);
        assert!(!t.series.iter().any(|s| s.stack == 9), "a stack that rose at two points in a row waits");
        assert!(t.series.iter().all(|s| s.bytes.len() == t.points.len()));
    }

    #[test]
    fn long_runs_are_thinned_not_truncated() {
        let mut t = Timeline::default();
        for i in 0..(MAX_POINTS as u64 * 3) {
            t.record(i, &snap(&[(1, i)]));
        }
        assert!(t.points.len() <= MAX_POINTS);
        assert_eq!(t.points.first().unwrap().unix_ms, 0);
        assert_eq!(t.points.last().unwrap().unix_ms, MAX_POINTS as u64 * 3 - 1);
        assert_eq!(t.series[0].bytes.len(), t.points.len());
        assert!(t.points.windows(2).all(|w| w[0].unix_ms < w[1].unix_ms));
    }

    #[test]
    fn a_small_stack_that_grows_steadily_is_followed_though_never_among_the_largest() {
        let mut t = Timeline::default();
        let big: Vec<(u32, u64)> = (0..JOIN_TOP as u32 + 4).map(|i| (100 + i, 1_000_000 + i as u64)).collect();
        for step in 0..6u64 {
            let mut s = snap(&big);
            // Stack 7: 2 KiB more at every report, far below the 16 largest.
            let mut g = s.groups[0];
            (g.stack, g.live_bytes) = (7, 2048 * (step + 1));
            // Up at every step: steady from the third (`Trend::steady`).
            g.steady_growth_kib = if step >= 3 { 2 * step as u32 } else { 0 };
            s.groups.push(g);
            t.record(step, &s);
        }
        let followed = t.series.iter().find(|s| s.stack == 7).expect("the steady grower is followed");
        assert_eq!(followed.bytes[followed.bytes.len() - 3..], [4 * 2048, 5 * 2048, 6 * 2048]);
        assert!(!t.series.iter().any(|s| s.stack == 100), "the 20th largest, flat, is not");
    }

    #[test]
    fn a_stack_that_grows_late_replaces_one_that_holds_little_now() {
        let mut t = Timeline::default();
        // An import churns through many stacks, each briefly among the largest.
        for k in 0..(MAX_SERIES as u32 / JOIN_TOP as u32 + 2) {
            let groups: Vec<(u32, u64)> = (0..JOIN_TOP as u32).map(|i| (1000 + k * 100 + i, 10_000 - i as u64)).collect();
            t.record(k as u64, &snap(&groups));
        }
        assert_eq!(t.series.len(), MAX_SERIES);
        // Then a loop's stack grows beyond everything followed (which now holds nothing).
        for step in 0..5u64 {
            t.record(100 + step, &snap(&[(7, 50_000 * (step + 1))]));
        }
        let grown = t.series.iter().find(|s| s.stack == 7).expect("the late grower is followed");
        assert_eq!(grown.bytes.len(), t.points.len());
        assert_eq!(&grown.bytes[grown.bytes.len() - 5..], &[50_000, 100_000, 150_000, 200_000, 250_000]);
        assert_eq!(t.series.len(), MAX_SERIES);
        assert!(t.series.iter().all(|s| s.bytes.len() == t.points.len()));
    }
}
