//! Growth detection: stacks whose live bytes rise steadily across the periodic
//! snapshots after a warm-up — the training-loop leak that is freed at exit and so
//! never shows in the exit report.
//!
//! Rule, on one stack's series of live bytes (the final exit point is left out, since
//! teardown frees what the run accumulated):
//! * at least `MIN_POINTS` points; the first quarter is warm-up and ignored;
//! * after warm-up, at least 70% of the steps go up and at most 15% go down;
//! * it is still rising at the end: the last value exceeds the value three quarters in;
//! * it grew by at least `min_bytes` overall after warm-up.
//!
//! A plateau (growth that stops) fails the third test; noise fails the second.
use serde::Serialize;

use crate::model::{Frame, Report};

pub const MIN_POINTS: usize = 8;
pub const DEFAULT_MIN_BYTES: u64 = 1024;

#[derive(Clone, Debug, Serialize)]
pub struct Growth {
    pub kind: String,
    pub api: String,
    pub stack_id: u32,
    pub first_bytes: u64,
    pub last_bytes: u64,
    pub grown_bytes: u64,
    pub bytes_per_minute: u64,
    pub points: usize,
    pub stack: Vec<Frame>,
}

/// Whether `values` (after warm-up) grow steadily by at least `min_bytes`.
pub fn grows_steadily(values: &[u64], min_bytes: u64) -> bool {
    if values.len() < MIN_POINTS {
        return false;
    }
    let data = &values[values.len() / 4..];
    let steps = data.len() - 1;
    let ups = data.windows(2).filter(|w| w[1] > w[0]).count();
    let downs = data.windows(2).filter(|w| w[1] < w[0]).count();
    let first = data[0];
    let last = data[steps];
    let three_quarters = data[steps * 3 / 4];
    ups * 10 >= steps * 7 && downs * 100 <= steps * 15 && last > three_quarters && last >= first.saturating_add(min_bytes)
}

pub fn detect(report: &Report, min_bytes: u64) -> Vec<Growth> {
    let mut points = report.timeline.points.as_slice();
    let mut cut = 0;
    if report.reason == "exit" && !points.is_empty() {
        points = &points[..points.len() - 1];
        cut = 1;
    }
    let mut found: Vec<Growth> = report
        .timeline
        .series
        .iter()
        .filter_map(|s| {
            let values = &s.bytes[..s.bytes.len().saturating_sub(cut)];
            if values.len() != points.len() || !grows_steadily(values, min_bytes) {
                return None;
            }
            let start = values.len() / 4;
            let (first, last) = (values[start], *values.last()?);
            let minutes = (points.last()?.unix_ms.saturating_sub(points[start].unix_ms)) as f64 / 60_000.0;
            Some(Growth {
                kind: s.kind.clone(),
                api: s.api.clone(),
                stack_id: s.stack_id,
                first_bytes: first,
                last_bytes: last,
                grown_bytes: last - first,
                bytes_per_minute: if minutes > 0.0 { ((last - first) as f64 / minutes) as u64 } else { 0 },
                points: values.len(),
                stack: report.series_stack(s).to_vec(),
            })
        })
        .collect();
    found.sort_by_key(|g| std::cmp::Reverse(g.grown_bytes));
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_growth_is_flagged() {
        let v: Vec<u64> = (0..30).map(|i| 1000 + i * 4096).collect();
        assert!(grows_steadily(&v, 1024));
    }

    #[test]
    fn plateau_noise_and_short_runs_are_not() {
        let plateau: Vec<u64> = (0..30).map(|i| 1000 + i.min(12) * 4096).collect();
        assert!(!grows_steadily(&plateau, 1024));
        let noisy: Vec<u64> = (0..30).map(|i| if i % 2 == 0 { 10_000 } else { 50_000 }).collect();
        assert!(!grows_steadily(&noisy, 1024));
        let short: Vec<u64> = (0..5).map(|i| i * 100_000).collect();
        assert!(!grows_steadily(&short, 1024));
        let tiny: Vec<u64> = (0..30).map(|i| 1000 + i).collect();
        assert!(!grows_steadily(&tiny, 1024));
    }

    #[test]
    fn growth_with_a_few_dips_still_counts() {
        let v: Vec<u64> = (0..40).map(|i| 1000 + i * 4096 - if i % 10 == 5 { 2048 } else { 0 }).collect();
        assert!(grows_steadily(&v, 1024));
    }
}
