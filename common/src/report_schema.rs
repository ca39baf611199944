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
        Amount { bytes: self.definite.bytes + self.indirect.bytes, blocks: self.definite.blocks + self.indirect.blocks }
    }
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
    if let Some(Value::Array(groups)) = report.get_mut("leaks") {
        for (i, g) in groups.iter_mut().enumerate() {
            if let Some(stack) = g.get_mut("stack") {
                expand(stack, &format!("leak group {i}"))?;
            }
        }
    }
    if let Some(Value::Array(series)) = report.get_mut("timeline").and_then(|t| t.get_mut("series")) {
        for (i, s) in series.iter_mut().enumerate() {
            if let Some(stack) = s.get_mut("stack") {
                expand(stack, &format!("timeline series {i}"))?;
            }
        }
    }
    if let Some(Value::Array(checks)) = report.get_mut("checks") {
        for (i, c) in checks.iter_mut().enumerate() {
            if let Some(Value::Array(leaks)) = c.get_mut("leaks") {
                for (j, l) in leaks.iter_mut().enumerate() {
                    if let Some(stack) = l.get_mut("stack") {
                        expand(stack, &format!("check {i} leak {j}"))?;
                    }
                }
            }
        }
    }
    report["frames"] = Value::Array(table);
    Ok(())
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
