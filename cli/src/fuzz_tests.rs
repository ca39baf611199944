//! Hostile input for the report reader and every renderer: random JSON, and the sample
//! report with fields deleted, retyped or set to extreme values. Nothing may panic; bad
//! input must come back as an error message.
use serde_json::{json, Value};

use crate::{analyze, diff, flame, growth, html, model, render};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn random_value(r: &mut Rng, depth: u32) -> Value {
    match if depth > 4 { r.below(5) } else { r.below(8) } {
        0 => Value::Null,
        1 => json!(r.below(2) == 0),
        2 => json!(r.next()),
        3 => json!(-(r.below(1000) as i64)),
        4 => json!(["", "host", "malloc", "exit", "0x1", "leaktrace-report/2", "a;b\nc", "\u{1F600}"][r.below(8) as usize]),
        5 => json!(r.next() as f64 / 3.0),
        6 => Value::Array((0..r.below(4)).map(|_| random_value(r, depth + 1)).collect()),
        _ => {
            let keys = ["schema", "pid", "reason", "summary", "host", "leaks", "stack", "timeline", "points", "series", "bytes", "function", "ip", "frames"];
            Value::Object((0..r.below(5)).map(|_| (keys[r.below(keys.len() as u64) as usize].to_string(), random_value(r, depth + 1))).collect())
        }
    }
}

/// Replaces one randomly chosen node of `v` with a random value.
fn mutate(v: &mut Value, r: &mut Rng) {
    match v {
        Value::Object(m) if !m.is_empty() && r.below(4) != 0 => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let k = &keys[r.below(keys.len() as u64) as usize];
            if r.below(5) == 0 {
                m.remove(k);
            } else {
                mutate(m.get_mut(k).unwrap(), r);
            }
        }
        Value::Array(a) if !a.is_empty() && r.below(4) != 0 => {
            let i = r.below(a.len() as u64) as usize;
            mutate(&mut a[i], r);
        }
        _ => *v = random_value(r, 2),
    }
}

fn exercise(text: &str) {
    let path = std::path::Path::new("fuzz.json");
    match model::parse(text, path) {
        Err(e) => assert!(!e.is_empty() && !e.contains('\n'), "{e}"),
        Ok(report) => {
            let reports = vec![report.clone(), report];
            let a = analyze::analyze(&reports, &analyze::Filters { growth_min_bytes: growth::DEFAULT_MIN_BYTES, ..Default::default() });
            let _ = render::text(&a, 5);
            let _ = render::markdown(&a, 5);
            let _ = render::json(&a);
            let _ = html::page(&a, &reports);
            let _ = flame::svg(&a);
            let _ = render::diff_text(
                &diff::diff(&crate::analyze::analyze(&reports[..1], &Default::default()), &crate::analyze::analyze(&reports[1..], &Default::default())),
                5,
                false,
            );
        }
    }
}

/// A schema 1 report in schema 2's shape: its frames in one table, stacks as indices.
fn as_version_2(v1: &Value) -> Value {
    let mut v = v1.clone();
    let mut table: Vec<Value> = Vec::new();
    let mut index = |stack: &mut Value| {
        if let Value::Array(frames) = stack {
            for f in frames.iter_mut() {
                let i = table.iter().position(|t| t == f).unwrap_or_else(|| {
                    table.push(f.clone());
                    table.len() - 1
                });
                *f = json!(i);
            }
        }
    };
    for g in v["leaks"].as_array_mut().unwrap() {
        index(&mut g["stack"]);
    }
    for s in v["timeline"]["series"].as_array_mut().unwrap() {
        index(&mut s["stack"]);
    }
    v["frames"] = Value::Array(table);
    v["schema"] = json!("leaktrace-report/2");
    v
}

#[test]
fn the_sample_reads_the_same_in_both_schemas() {
    let v1: Value = serde_json::from_str(include_str!("../tests/data/sample-report.json")).unwrap();
    let v2 = as_version_2(&v1);
    assert!(v2["leaks"][0]["stack"][0].is_u64());
    let (a, b) = (model::parse(&v1.to_string(), "1.json".as_ref()).unwrap(), model::parse(&v2.to_string(), "2.json".as_ref()).unwrap());
    assert!(!a.leaks[0].stack.is_empty());
    for (x, y) in a.leaks.iter().zip(&b.leaks) {
        assert_eq!(x.stack, y.stack);
    }
    assert_eq!(a.leaks.len(), b.leaks.len());
}

#[test]
fn hostile_reports_never_panic() {
    let sample_v1: Value = serde_json::from_str(include_str!("../tests/data/sample-report.json")).unwrap();
    let sample_v2 = as_version_2(&sample_v1);
    let mut r = Rng(0x9e37_79b9_7f4a_7c15);
    for sample in [&sample_v1, &sample_v2] {
        for _ in 0..2000 {
            let mut v = sample.clone();
            for _ in 0..=r.below(4) {
                mutate(&mut v, &mut r);
            }
            exercise(&v.to_string());
        }
    }
    for _ in 0..2000 {
        let mut v = random_value(&mut r, 0);
        if r.below(2) == 0 {
            if let Value::Object(m) = &mut v {
                let schema = if r.below(2) == 0 { "leaktrace-report/1" } else { "leaktrace-report/2" };
                m.insert("schema".into(), json!(schema));
            }
        }
        exercise(&v.to_string());
    }
    let sample = sample_v2;
    // Counts at the top of the range in several groups and processes.
    let mut huge = sample.clone();
    for g in huge["leaks"].as_array_mut().unwrap() {
        g["bytes"] = json!(u64::MAX);
        g["blocks"] = json!(u64::MAX);
    }
    exercise(&huge.to_string());
    // Truncated files, deep nesting, huge numbers.
    let full = sample.to_string();
    for cut in (0..full.len()).step_by(97) {
        exercise(&full[..cut]);
    }
    exercise(&format!("{}{}", "[".repeat(10_000), "]".repeat(10_000)));
    exercise(r#"{"schema":"leaktrace-report/1","pid":1e400,"reason":"exit","summary":{"host":{}}}"#);
    exercise(
        r#"{"schema":"leaktrace-report/1","pid":1,"reason":"exit","summary":{"host":{"live_bytes":18446744073709551615,"live_blocks":1,"total_allocs":1,"total_frees":0,"peak_live_bytes":1}},"timeline":{"points":[{"unix_ms":5,"live_bytes":1},{"unix_ms":1,"live_bytes":2}],"series":[{"kind":"host","api":"malloc","stack_id":9,"bytes":[1]}]}}"#,
    );
}
