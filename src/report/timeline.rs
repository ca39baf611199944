//! Live memory over time, from every report written (periodic, snapshot, final): the
//! process totals, and the live bytes of the stacks that were ever among the largest.
//! The CLI's growth detection and HTML chart read it from the report.
use crate::collector::state::Snapshot;
use crate::hotpath::event::Api;

/// Stacks followed at most; a stack joins when it is among the `JOIN_TOP` largest, or
/// among the `JOIN_GROWING` that grew most of those growing steadily, whatever their size
/// (a leak spread over dozens of small stacks is in none of the largest).
const MAX_SERIES: usize = 64;
pub const JOIN_TOP: usize = 16;
const JOIN_GROWING: usize = 16;
/// Points kept; beyond, every other old point is dropped (the series stay aligned).
const MAX_POINTS: usize = 1024;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Point {
    pub unix_ms: u64,
    pub live_bytes: u64,
    pub live_blocks: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Series {
    pub stack: u32,
    pub api: Api,
    /// Live bytes at each point (0 before the stack was followed, or when it had none).
    pub bytes: Vec<u64>,
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

#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub points: Vec<Point>,
    pub series: Vec<Series>,
    pub lines: Vec<LineSeries>,
    /// Each stack's user line, by stack id, worked out once: `LINE_UNKNOWN`, `NO_LINE`
    /// (no Python frame of the user's) or an index into `known_lines`. A vector, not a
    /// map: after `import torch` every snapshot looks up ~600k groups among 2M stacks,
    /// and a hash map's probes were most of the collector's time then.
    line_of: Vec<u32>,
    /// The same by Python part (`python::python_part`): decoded once per part.
    line_of_part: crate::collector::state::FxMap<u32, u32>,
    /// The distinct user lines met, and their indices.
    known_lines: Vec<super::python::UserLine>,
    index_of_line: crate::collector::state::FxMap<super::python::UserLine, u32>,
}

const LINE_UNKNOWN: u32 = 0;
const NO_LINE: u32 = u32::MAX;

impl Timeline {
    pub fn record(&mut self, unix_ms: u64, snapshot: &Snapshot) {
        if self.points.len() >= MAX_POINTS {
            self.thin();
        }
        self.points.push(Point { unix_ms, live_bytes: snapshot.totals.host().live_bytes, live_blocks: snapshot.totals.host().live_blocks });
        let n = self.points.len();
        // One pass over the groups (a process that imported PyTorch has half a million);
        // groups of one stack and api on several devices add up.
        let followed: std::collections::HashMap<(u32, Api), usize> = self.series.iter().enumerate().map(|(i, s)| ((s.stack, s.api), i)).collect();
        let mut now = vec![0u64; self.series.len()];
        for g in &snapshot.groups {
            if let Some(&i) = followed.get(&(g.stack, g.api)) {
                now[i] += g.stats.live_bytes;
            }
        }
        for (s, v) in self.series.iter_mut().zip(now) {
            s.bytes.push(v);
        }
        if crate::hotpath::python::enabled() {
            self.record_lines(snapshot, n);
        }
        // `snapshot.groups` is sorted largest first. When every slot is taken (an import
        // churns through many stacks before a training loop starts), a newcomer replaces
        // the followed stack that holds least now, if that is less than the newcomer's:
        // a leak that starts late still gets followed.
        let top: Vec<(u32, Api)> = snapshot.groups.iter().take(JOIN_TOP).map(|g| (g.stack, g.api)).collect();
        let mut growing: Vec<&crate::collector::state::GroupSnapshot> = snapshot.groups.iter().filter(|g| g.stats.trend.steady()).collect();
        growing.sort_by_key(|g| std::cmp::Reverse(g.stats.trend.growth()));
        growing.truncate(JOIN_GROWING);
        let keep: Vec<(u32, Api)> = top.iter().copied().chain(growing.iter().map(|g| (g.stack, g.api))).collect();
        for g in snapshot.groups.iter().take(JOIN_TOP).chain(growing.iter().copied()) {
            if self.series.iter().any(|s| s.stack == g.stack && s.api == g.api) {
                continue;
            }
            let mut bytes = vec![0; n - 1];
            bytes.push(g.stats.live_bytes);
            let newcomer = Series { stack: g.stack, api: g.api, bytes };
            if self.series.len() < MAX_SERIES {
                self.series.push(newcomer);
                continue;
            }
            let weakest = self
                .series
                .iter()
                .enumerate()
                .filter(|(_, s)| !keep.contains(&(s.stack, s.api)))
                .min_by_key(|(_, s)| s.bytes.last().copied().unwrap_or(0))
                .map(|(i, s)| (i, s.bytes.last().copied().unwrap_or(0)));
            if let Some((i, now)) = weakest {
                if now < g.stats.live_bytes {
                    self.series[i] = newcomer;
                }
            }
        }
    }

    /// The user line of `stack` as `line_of` holds it (see there), worked out if new.
    fn line_index(&mut self, stack: u32) -> u32 {
        let slot = crate::hotpath::stacks::dense_index(stack);
        if self.line_of.len() <= slot {
            self.line_of.resize((slot + 1).next_power_of_two(), LINE_UNKNOWN);
        }
        if self.line_of[slot] != LINE_UNKNOWN {
            return self.line_of[slot];
        }
        let found = match super::python::python_part(stack) {
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
        };
        self.line_of[slot] = found;
        found
    }

    /// Adds the point of each Python line (`n` points so far, this one included).
    fn record_lines(&mut self, snapshot: &Snapshot, n: usize) {
        // By index into `known_lines` + 1.
        let mut sums: Vec<u64> = Vec::new();
        for g in snapshot.groups.iter().filter(|g| g.stats.live_bytes > 0) {
            let i = self.line_index(g.stack);
            if i == NO_LINE {
                continue;
            }
            if sums.len() <= i as usize {
                sums.resize(self.known_lines.len() + 1, 0);
            }
            sums[i as usize] += g.stats.live_bytes;
        }
        sums.resize(self.known_lines.len() + 1, 0);
        for s in self.lines.iter_mut() {
            let i = self.index_of_line.get(&s.line).map_or(0, |&i| i as usize);
            s.bytes.push(std::mem::take(&mut sums[i]));
        }
        let mut newcomers: Vec<(super::python::UserLine, u64)> =
            sums.iter().enumerate().skip(1).filter(|e| *e.1 > 0).map(|(i, &b)| (self.known_lines[i - 1], b)).collect();
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
    use super::*;
    use crate::collector::state::{GroupSnapshot, GroupStats, Totals};

    fn snap(groups: &[(u32, u64)]) -> Snapshot {
        let mut gs: Vec<GroupSnapshot> = groups
            .iter()
            .map(|&(stack, bytes)| GroupSnapshot {
                stack,
                api: Api::Malloc,
                device: None,
                stats: GroupStats { live_bytes: bytes, live_blocks: 1, ..Default::default() },
            })
            .collect();
        gs.sort_by_key(|g| std::cmp::Reverse(g.stats.live_bytes));
        let total = groups.iter().map(|g| g.1).sum();
        let mut totals = Totals::default();
        totals.kinds[0].live_bytes = total;
        totals.kinds[0].live_blocks = groups.len() as u64;
        Snapshot { totals, groups: gs }
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
            let mut g = s.groups[0].clone();
            (g.stack, g.stats.live_bytes) = (7, 2048 * (step + 1));
            g.stats.trend = crate::collector::state::Trend { seen: true, base: 2048, last: 2048 * (step + 1), steps: step as u16, ups: step as u16, downs: 0 };
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
