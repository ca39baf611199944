//! `leaktrace report --format pprof`: the reports as one gzip'd `profile.proto`, which
//! `go tool pprof`, Pyroscope, Parca, Grafana and speedscope read (issue 54).
//!
//! Four values per sample: `inuse_space`/`inuse_objects` (live when the report was
//! written) and `alloc_space`/`alloc_objects` (allocated from that stack over the
//! process's life). One sample per leak group and verdict (a group with definite,
//! indirect and reachable memory is three samples; its `alloc_*` go with the first),
//! labelled with the process (`pid`, `rank`, `host`), the kind of memory (`kind`: host,
//! device, pinned, python, mmap, …) and the verdict (`verdict`: definite, indirect,
//! reachable, or `live` without a scan; `growing` when the stack grew over the run).
//! Groups a report left out of its list are one `[omitted]` sample per process, so that
//! the `inuse_*` totals are the reports' summaries. Frames are functions with file and
//! line (Python frames and native ones alike); native frames have their module as a
//! mapping. The encoding is written here (a few message types, varints and
//! length-delimited fields), not generated.
use std::collections::HashMap;
use std::io::Write;

use leaktrace_common::report_schema::{Frame, Report};

/// Protobuf wire encoding of one message.
#[derive(Default)]
struct Msg(Vec<u8>);

impl Msg {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    /// A varint field (skipped when 0, as proto3 does).
    fn uint(&mut self, field: u32, v: u64) -> &mut Msg {
        if v != 0 {
            self.varint(u64::from(field) << 3);
            self.varint(v);
        }
        self
    }

    fn int(&mut self, field: u32, v: i64) -> &mut Msg {
        self.uint(field, v as u64)
    }

    /// A length-delimited field: a sub-message or bytes.
    fn bytes(&mut self, field: u32, b: &[u8]) -> &mut Msg {
        self.varint((u64::from(field) << 3) | 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }

    /// A packed repeated varint field.
    fn packed(&mut self, field: u32, vs: &[u64]) -> &mut Msg {
        let mut inner = Msg::default();
        for &v in vs {
            inner.varint(v);
        }
        self.bytes(field, &inner.0)
    }
}

/// The profile being built: strings, functions, locations and mappings, each once.
#[derive(Default)]
struct Builder {
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    functions: Vec<Msg>,
    function_ids: HashMap<(String, String, i64), u64>,
    locations: Vec<Msg>,
    location_ids: HashMap<(u64, String, String, u32, bool), u64>,
    mappings: Vec<Msg>,
    mapping_ids: HashMap<String, u64>,
    samples: Vec<Msg>,
}

impl Builder {
    fn new() -> Builder {
        let mut b = Builder::default();
        b.string("");
        b
    }

    fn string(&mut self, s: &str) -> i64 {
        if let Some(&id) = self.string_ids.get(s) {
            return id;
        }
        let id = self.strings.len() as i64;
        self.strings.push(s.to_string());
        self.string_ids.insert(s.to_string(), id);
        id
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        let key = (name.to_string(), file.to_string(), 0);
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        let (n, f) = (self.string(name), self.string(file));
        let mut m = Msg::default();
        m.uint(1, id).int(2, n).int(3, n).int(4, f);
        self.functions.push(m);
        self.function_ids.insert(key, id);
        id
    }

    fn mapping(&mut self, module: &str, start: u64) -> u64 {
        if let Some(&id) = self.mapping_ids.get(module) {
            return id;
        }
        let id = self.mappings.len() as u64 + 1;
        let file = self.string(module);
        let mut m = Msg::default();
        // The module's extent is not in the report: from its load address on.
        m.uint(1, id).uint(2, start).uint(3, u64::MAX).int(5, file).uint(7, 1).uint(8, 1).uint(9, 1);
        self.mappings.push(m);
        self.mapping_ids.insert(module.to_string(), id);
        id
    }

    /// The location of one frame: its function, file and line; its module as a mapping.
    fn location(&mut self, f: &Frame) -> u64 {
        let name = match (&f.function, &f.module, f.offset) {
            (Some(func), _, _) => func.to_string(),
            (None, Some(m), Some(off)) => format!("{}+{off:#x}", m.rsplit('/').next().unwrap_or(m)),
            (None, Some(m), None) => m.to_string(),
            _ => format!("{:#x}", f.ip),
        };
        let file = f.file.as_deref().unwrap_or("").to_string();
        let key = (f.ip, name.clone(), file.clone(), f.line.unwrap_or(0), f.python);
        if let Some(&id) = self.location_ids.get(&key) {
            return id;
        }
        let id = self.locations.len() as u64 + 1;
        let function = self.function(&name, &file);
        let mapping = match (&f.module, f.offset) {
            (Some(m), Some(off)) if !f.python && f.ip >= off => self.mapping(m, f.ip - off),
            _ => 0,
        };
        let mut line = Msg::default();
        line.uint(1, function).int(2, i64::from(f.line.unwrap_or(0)));
        let mut m = Msg::default();
        m.uint(1, id).uint(2, mapping).uint(3, if f.python { 0 } else { f.ip });
        m.bytes(4, &line.0);
        self.locations.push(m);
        self.location_ids.insert(key, id);
        id
    }

    fn sample(&mut self, locations: &[u64], values: [i64; 4], labels: &[(&str, Label)]) {
        let mut m = Msg::default();
        m.packed(1, locations);
        m.packed(2, &values.map(|v| v as u64));
        for (key, value) in labels {
            let k = self.string(key);
            let mut l = Msg::default();
            l.int(1, k);
            match value {
                Label::Str(s) => {
                    let v = self.string(s);
                    l.int(2, v);
                }
                Label::Num(n) => {
                    l.int(3, *n);
                }
            }
            m.bytes(3, &l.0);
        }
        self.samples.push(m);
    }

    fn finish(mut self, time_ns: i64) -> Vec<u8> {
        let types = [("inuse_space", "bytes"), ("inuse_objects", "count"), ("alloc_space", "bytes"), ("alloc_objects", "count")];
        let mut p = Msg::default();
        for (t, u) in types {
            let (t, u) = (self.string(t), self.string(u));
            let mut vt = Msg::default();
            vt.int(1, t).int(2, u);
            p.bytes(1, &vt.0);
        }
        for s in &self.samples {
            p.bytes(2, &s.0);
        }
        for m in &self.mappings {
            p.bytes(3, &m.0);
        }
        for l in &self.locations {
            p.bytes(4, &l.0);
        }
        for f in &self.functions {
            p.bytes(5, &f.0);
        }
        let (space, bytes) = (self.string("space"), self.string("bytes"));
        for s in &self.strings {
            p.bytes(6, s.as_bytes());
        }
        p.int(9, time_ns);
        let mut period = Msg::default();
        period.int(1, space).int(2, bytes);
        p.bytes(11, &period.0);
        // inuse_space first in `go tool pprof`.
        p.0
    }
}

#[derive(Clone)]
enum Label {
    Str(String),
    Num(i64),
}

/// The profile of `reports` (each process's latest), gzip'd; `growing`: the stack ids
/// that grew, per pid.
pub fn profile(reports: &[Report], growing: &HashMap<u32, Vec<u32>>) -> Vec<u8> {
    let mut b = Builder::new();
    let mut newest = 0u64;
    for r in reports {
        newest = newest.max(r.written_unix_ms);
        let mut common: Vec<(&str, Label)> = vec![("pid", Label::Num(i64::from(r.pid)))];
        if let Some(rank) = r.launch.rank {
            common.push(("rank", Label::Num(i64::from(rank))));
        }
        if !r.launch.host.is_empty() {
            common.push(("host", Label::Str(r.launch.host.clone())));
        }
        let grew = growing.get(&r.pid);
        for g in &r.leaks {
            let locations: Vec<u64> = g.stack.iter().map(|f| b.location(f)).collect();
            let verdicts: Vec<(&str, u64, u64)> = match &g.reachability {
                Some(re) => [("definite", re.definite), ("indirect", re.indirect), ("reachable", re.reachable)]
                    .into_iter()
                    .filter(|(_, a)| a.bytes > 0 || a.blocks > 0)
                    .map(|(v, a)| (v, a.bytes, a.blocks))
                    .collect(),
                None => vec![("live", g.bytes, g.blocks)],
            };
            let verdicts = if verdicts.is_empty() { vec![("live", g.bytes, g.blocks)] } else { verdicts };
            let growing = grew.is_some_and(|ids| ids.contains(&g.stack_id));
            for (k, (verdict, bytes, blocks)) in verdicts.into_iter().enumerate() {
                let (alloc_bytes, allocs) = if k == 0 { (g.total_bytes, g.total_allocs) } else { (0, 0) };
                let mut labels: Vec<(&str, Label)> = common.clone();
                labels.push(("kind", Label::Str(g.kind.to_string())));
                labels.push(("verdict", Label::Str(verdict.into())));
                if growing {
                    labels.push(("growing", Label::Str("true".into())));
                }
                b.sample(&locations, [bytes as i64, blocks as i64, alloc_bytes as i64, allocs as i64], &labels);
            }
        }
        let o = &r.summary.omitted;
        if o.bytes > 0 || o.blocks > 0 {
            let f = Frame { function: Some("[omitted]".into()), ..Default::default() };
            let loc = b.location(&f);
            let mut labels: Vec<(&str, Label)> = common.clone();
            labels.push(("verdict", Label::Str("omitted".into())));
            b.sample(&[loc], [o.bytes as i64, o.blocks as i64, 0, 0], &labels);
        }
    }
    let raw = b.finish((newest as i64).saturating_mul(1_000_000));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let _ = gz.write_all(&raw);
    gz.finish().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_fields_are_protobufs() {
        let mut m = Msg::default();
        m.uint(1, 150);
        assert_eq!(m.0, vec![0x08, 0x96, 0x01]);
        let mut m = Msg::default();
        m.uint(1, 0).bytes(2, b"ab").packed(3, &[1, 300]);
        assert_eq!(m.0, vec![0x12, 2, b'a', b'b', 0x1a, 3, 1, 0xac, 0x02]);
    }

    #[test]
    fn each_frame_and_function_is_written_once() {
        let mut b = Builder::new();
        let f = Frame {
            ip: 0x1234,
            module: Some("/bin/x".into()),
            offset: Some(0x234),
            function: Some("f".into()),
            file: Some("x.c".into()),
            line: Some(3),
            ..Default::default()
        };
        let py = Frame { function: Some("step".into()), file: Some("train.py".into()), line: Some(14), python: true, ..Default::default() };
        assert_eq!(b.location(&f), 1);
        assert_eq!(b.location(&py), 2);
        assert_eq!(b.location(&f), 1);
        assert_eq!((b.functions.len(), b.mappings.len(), b.strings[0].as_str()), (2, 1, ""));
    }
}
